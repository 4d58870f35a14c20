"""The server's evaluation beside the round loop: rounds with evaluation every round, with the
evaluator on Flower's core and on a core of its own (``eval-cpus``), against the same run with
evaluation only at rounds 0 and R (issue 23).

The separated-core set-up (docs/benchmarks.md, "The communication window against block size"):
one node on loopback, its worker (every thread) on CPU 1, every other process (SuperLink,
SuperNode, ClientApps, the ServerApp) on CPU 0. ParaBlock on SmolLM2-135M, the default block
(5 layers, 70.8 MB) and held-out set (64 rows, no generation). Variants: `off` (evaluation at
rounds 0 and R), `on` (every round; the evaluator process on CPU 0 with Flower's processes), `own`
(every round; `eval-cpus = "1"`: on this 2-core machine the only core Flower's processes do not
use is the worker's, where at `SCHED_IDLE` the evaluator takes only the time the worker leaves).
The variants run in order, then again in reverse; the table gives each round's wall time (rounds
2..R), the worker's compute, and the evaluations done and skipped.

    .venv/bin/python -m benchmarks.evaluation_overlap                    # off, on, own, own, on, off (~13 min)
    .venv/bin/python -m benchmarks.evaluation_overlap --variants off,on  # as measured on 2026-12-01
    .venv/bin/python -m benchmarks.evaluation_overlap --fast             # tiny model, a smoke run (no docs)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import command, machine, read_records, replace_doc_section
from benchmarks.window import pin_workers
from parablock_flwr.tools.launch import run_deployment
from parablock_flwr.tools.tiny_model import build_tiny_model

DOC_HEADING = "## The server's evaluation beside the round loop"
OWN_CORE_HEADING = "## The server's evaluation on a core of its own (eval-cpus)"
# variant -> (evaluation every round, eval-cpus)
VARIANTS = {"off": (False, ""), "on": (True, ""), "own": (True, "1")}
LABELS = {"off": "rounds 0 and R", "on": "every round, on CPU 0", "own": "every round, eval-cpus 1"}


def run(variant: str, args, out: Path) -> dict:
    evaluate_every_round, eval_cpus = VARIANTS[variant]
    rounds = args.rounds
    config = {
        "algorithm": "parablock",
        "model": args.model,
        "output-dir": str(out / "runs"),
        "num-server-rounds": rounds,
        "eval-every": 1 if evaluate_every_round else rounds,
        "eval-cpus": eval_cpus,
        "generate-examples": 0,
        "torch-threads": 1,
        "uplink-mbps": 1e6,
        "downlink-mbps": 1e6,
        "latency-ms": 0.0,
    }
    if args.fast:
        config.update({"num-examples": 32, "heldout-examples": 8, "layers-per-block": 1})
    load = os.getloadavg()[0]
    result = run_deployment(out, config, 1, args.timeout_s, on_started=pin_workers)
    if result.run_dir is None or result.kind != "completed":
        sys.exit(f"the run failed: {result.summary('evaluation_overlap.py')}")
    records = read_records(result.run_dir)
    return {
        "variant": variant,
        "load_1min": load,
        "round_wall_s": [r["round_wall_s"] for r in records[2:]],
        "compute_s": [r["measured_compute_s"] for r in records[2:]],
        "evaluated": [r["round"] for r in records if r.get("heldout_loss") is not None],
        "skipped": [r["round"] for r in records if r.get("evaluation_skipped")],
        "evaluate_s": [r["evaluate_s"] for r in records if r.get("heldout_loss") is not None],
        "heldout_loss": {r["round"]: r["heldout_loss"] for r in records if r.get("heldout_loss") is not None},
    }


def table(runs: list[dict]) -> str:
    rows = [
        "| evaluation | run | round wall time, rounds 2..R (s) | mean | worker compute, mean (s) | evaluated "
        "| skipped | evaluation (s) | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs):
        walls = ", ".join(f"{w:.1f}" for w in r["round_wall_s"])
        rows.append(f"| {LABELS[r['variant']]} | {i + 1} | {walls} | {statistics.mean(r['round_wall_s']):.1f} | "
                    f"{statistics.mean(r['compute_s']):.1f} | {r['evaluated']} | {r['skipped']} | "
                    f"{statistics.mean(r['evaluate_s']):.1f} | {r['load_1min']:.1f} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default="off,on,own", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--fast", action="store_true", help="the tiny model, no docs")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if "off" not in variants or not set(variants) <= set(VARIANTS):
        parser.error(f"--variants={args.variants!r}: expected off and any of {', '.join(VARIANTS)}")
    os.sched_setaffinity(0, {0})  # every process started from here on: CPU 0 (the worker moves to CPU 1)
    with tempfile.TemporaryDirectory(prefix="eval-overlap-") as tmp:
        if args.fast:
            args.model = str(build_tiny_model(Path(tmp) / "tiny"))
        runs = []
        for i, variant in enumerate(variants + variants[::-1]):
            print(f"[{time.strftime('%H:%M:%S')}] evaluation {LABELS[variant]} ...", flush=True)
            runs.append(run(variant, args, Path(tmp) / f"run-{i}"))
            print(f"    round walls {runs[-1]['round_wall_s']}", flush=True)
    report = f"{table(runs)}\n\n{ratios(runs)}"
    print(report)
    if not args.fast:
        setup = __doc__.split("\n\n")[1]
        body = (
            f"Command: `{command('evaluation_overlap')}`  \nDate: {time.strftime('%Y-%m-%d')}  \n{machine()}\n\n{setup}"
        )
        body += f"\n\n{report}\n"
        replace_doc_section(OWN_CORE_HEADING if "own" in variants else DOC_HEADING, body)
    return 0


def ratios(runs: list[dict]) -> str:
    """Each evaluating variant's mean round wall time against ``off``'s, and whether the held-out
    losses of the rounds two runs both evaluated are the same (the evaluator's replica is x^r)."""

    def walls(variant):
        return [w for r in runs if r["variant"] == variant for w in r["round_wall_s"]]

    off = statistics.mean(walls("off"))
    lines = [
        f"- {LABELS[v]}: mean round wall time **{statistics.mean(walls(v)) / off:.2f}x** of rounds 0 and R's "
        f"(target: at most 1.10)"
        for v in VARIANTS
        if v != "off" and walls(v)
    ]
    losses = [r["heldout_loss"] for r in runs]
    same = all(a[v] == b[v] for a in losses for b in losses for v in a.keys() & b.keys())
    lines.append(
        f"- the held-out losses of the rounds several runs evaluated are {'identical' if same else 'DIFFERENT'}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
