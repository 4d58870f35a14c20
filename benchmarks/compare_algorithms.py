"""Measures every algorithm side by side in simulation: held-out loss, task accuracy, bytes and time.

Runs each (algorithm, train) pair in turn through `flwr run` on Flower's
simulation engine with the same model, data, seed, clients and rounds, then
prints one table (held-out loss, task accuracy, bytes per round per client,
modeled and measured time) and writes it to docs/results/compare_algorithms.md
with the command that reproduces it.

    .venv/bin/python -m benchmarks.compare_algorithms              # embedded SmolLM2, 2 clients, 3 rounds
    .venv/bin/python -m benchmarks.compare_algorithms --tiny --no-write
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import GSM_AS_MEASURED, simulate, write_report
from parablock_flwr.tools.tiny_model import build_tiny_model

RUNS = [
    ("parablock", "full"),
    ("fedbcd", "full"),
    ("parablock", "lora"),
    ("fedbcd", "lora"),
    ("fedavg-lora", "lora"),
    ("fedavg-full", "full"),
]
TITLE = "Every algorithm side by side in simulation"


def run(algorithm: str, train: str, args, model: str, workdir: Path) -> list[dict]:
    out = workdir / f"out-{algorithm}-{train}"
    config = {
        "algorithm": algorithm,
        "train": train,
        "model": model,
        **GSM_AS_MEASURED,
        "output-dir": str(out),
        "num-server-rounds": args.rounds,
        "learning-rate": args.lora_learning_rate if train == "lora" else args.learning_rate,
    }
    if args.tiny:
        config.update(
            {
                "num-examples": 64,
                "heldout-examples": 8,
                "layers-per-block": 2,
                "max-seq-len": 128,
                "generate-examples": 2,
                "max-new-tokens": 8,
            }
        )
    started = time.perf_counter()
    print(f"{algorithm} ({train}) ...", flush=True)
    _, records = simulate(workdir / f"flower-{algorithm}-{train}", config, args.clients, cpus_per_client=2)
    records[0]["total_wall_s"] = time.perf_counter() - started
    return records


def table(results: dict[tuple[str, str], list[dict]]) -> str:
    lines = [
        "| algorithm | trains | held-out loss r0 → rR | perplexity rR | task accuracy r0 → rR | "
        "MB up per client per round | modeled training s | end-to-end wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (algorithm, train), records in results.items():
        first, last = records[0], records[-1]
        rounds = records[1:]
        mb_up = sum(r["bytes_up_per_client"] for r in rounds) / len(rounds) / 1e6
        acc = (
            f"{first['task_accuracy']:.3f} → {last['task_accuracy']:.3f}"
            if "task_accuracy" in first and "task_accuracy" in last
            else "-"
        )
        lines.append(
            f"| {algorithm} | {train} | {first['heldout_loss']:.4f} → {last['heldout_loss']:.4f} | "
            f"{last['perplexity']:.2f} | {acc} | {mb_up:.2f} | {last['modeled_wall_s']:.1f} | "
            f"{first['total_wall_s']:.0f} |"
        )
    return "\n".join(lines)


def write_section(text: str, args) -> None:
    """docs/results/compare_algorithms.md, whole."""
    model = "tiny Llama" if args.tiny else "SmolLM2-135M-Instruct (embedded)"
    body = (
        f"{model}, GSM-style reasoning-gym math, "
        f"{args.clients} virtual clients, {args.rounds} rounds, the default run config otherwise (3 local steps, "
        f"batch 4, 5 layers per block, LoRA r=8 on q/k/v/o); learning rate {args.learning_rate} for full weights, "
        f"{args.lora_learning_rate} for LoRA adapters. Task accuracy: greedy answers to the first 8 held-out "
        f"prompts, scored by their exact answer. Modeled training time: the time model at 50 Mbit/s, 50 ms "
        f"(docs/algorithm.md); end-to-end wall includes the SuperLink/Ray start and the evaluations.\n\n{text}\n"
    )
    write_report("compare_algorithms", TITLE, body)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare_algorithms",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama instead of SmolLM2 (smoke test)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--lora-learning-rate", type=float, default=5e-4)
    parser.add_argument("--only", help="comma-separated algorithm:train pairs, e.g. parablock:full,fedavg-lora:lora")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/results/ alone")
    args = parser.parse_args()
    runs = [tuple(p.split(":")) for p in args.only.split(",")] if args.only else RUNS
    for pair in runs:
        if pair not in RUNS:
            sys.exit(f"--only {':'.join(pair)}: expected pairs among {', '.join(':'.join(r) for r in RUNS)}")
    with tempfile.TemporaryDirectory(prefix="parablock-compare-") as tmp:
        workdir = Path(tmp)
        model = str(build_tiny_model(workdir / "tiny")) if args.tiny else "embedded:smollm2-135m-instruct"
        results = {}
        for algorithm, train in runs:
            results[(algorithm, train)] = run(algorithm, train, args, model, workdir)
            print(f"{algorithm} ({train}) done in {results[(algorithm, train)][0]['total_wall_s']:.0f} s", flush=True)
    text = table(results)
    print(text)
    if not args.no_write:
        write_section(text, args)


if __name__ == "__main__":
    main()
