"""The server's evaluation beside the round loop: rounds with evaluation every round against the
same run with evaluation only at rounds 0 and R (issue 23).

The separated-core set-up (docs/benchmarks.md, "The communication window against block size"):
one node on loopback, its worker (every thread) on CPU 1, every other process (SuperLink,
SuperNode, ClientApps, the ServerApp and its evaluator thread) on CPU 0. ParaBlock on SmolLM2-135M,
the default block (5 layers, 70.8 MB) and held-out set (64 rows, no generation). The two runs go
one after the other, then again in the other order; the table gives each round's wall time
(rounds 2..R) and the evaluations done and skipped.

    .venv/bin/python -m benchmarks.evaluation_overlap             # 2 x 2 runs of 6 rounds (~25 min)
    .venv/bin/python -m benchmarks.evaluation_overlap --fast      # tiny model, a smoke run (no docs)
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


def run(evaluate_every_round: bool, args, out: Path) -> dict:
    rounds = args.rounds
    config = {
        "algorithm": "parablock",
        "model": args.model,
        "output-dir": str(out / "runs"),
        "num-server-rounds": rounds,
        "eval-every": 1 if evaluate_every_round else rounds,
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
        "evaluate_every_round": evaluate_every_round,
        "load_1min": load,
        "round_wall_s": [r["round_wall_s"] for r in records[2:]],
        "evaluated": [r["round"] for r in records if r.get("heldout_loss") is not None],
        "skipped": [r["round"] for r in records if r.get("evaluation_skipped")],
        "evaluate_s": [r["evaluate_s"] for r in records if r.get("heldout_loss") is not None],
        "heldout_loss": {r["round"]: r["heldout_loss"] for r in records if r.get("heldout_loss") is not None},
    }


def table(runs: list[dict]) -> str:
    rows = [
        "| evaluation | run | round wall time, rounds 2..R (s) | mean | evaluated | skipped | evaluation (s) | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs):
        kind = "every round" if r["evaluate_every_round"] else "rounds 0 and R"
        walls = ", ".join(f"{w:.1f}" for w in r["round_wall_s"])
        rows.append(f"| {kind} | {i + 1} | {walls} | {statistics.mean(r['round_wall_s']):.1f} | "
                    f"{r['evaluated']} | {r['skipped']} | {statistics.mean(r['evaluate_s']):.1f} | "
                    f"{r['load_1min']:.1f} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--fast", action="store_true", help="the tiny model, no docs")
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {0})  # every process started from here on: CPU 0 (the worker moves to CPU 1)
    with tempfile.TemporaryDirectory(prefix="eval-overlap-") as tmp:
        if args.fast:
            args.model = str(build_tiny_model(Path(tmp) / "tiny"))
        runs = []
        for i, every in enumerate((True, False, False, True)):
            print(
                f"[{time.strftime('%H:%M:%S')}] evaluation {'every round' if every else 'at 0 and R'} ...", flush=True
            )
            runs.append(run(every, args, Path(tmp) / f"run-{i}"))
            print(f"    round walls {runs[-1]['round_wall_s']}", flush=True)
    on = [w for r in runs if r["evaluate_every_round"] for w in r["round_wall_s"]]
    off = [w for r in runs if not r["evaluate_every_round"] for w in r["round_wall_s"]]
    ratio = statistics.mean(on) / statistics.mean(off)
    same = all(runs[0]["heldout_loss"][v] == runs[1]["heldout_loss"][v] for v in runs[1]["heldout_loss"])
    report = (
        f"{table(runs)}\n\nMean round wall time with evaluation every round / with evaluation at rounds 0 and R: "
        f"**{ratio:.2f}x** (target: at most 1.10). The held-out losses of the rounds both evaluated are "
        f"{'identical' if same else 'DIFFERENT'} (the evaluator's replica is exactly x^r)."
    )
    print(report)
    if not args.fast:
        setup = __doc__.split("\n\n")[1]
        body = (
            f"Command: `{command('evaluation_overlap')}`  \nDate: {time.strftime('%Y-%m-%d')}  \n{machine()}\n\n{setup}"
        )
        body += f"\n\n{report}\n"
        replace_doc_section(DOC_HEADING, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
