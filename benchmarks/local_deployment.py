"""Measures ParaBlock against sequential BCD in a real local deployment (loopback): compute, window, round time.

Runs each algorithm in turn with the same model, data, seed and rounds through
`parablock_flwr.tools.launch.run_deployment` (SuperLink, SuperNodes, node workers), then prints the
per-round measured compute, communication and round time and writes the table
to docs/results/local_deployment.md with the command that reproduces it.

    .venv/bin/python -m benchmarks.local_deployment                 # embedded SmolLM2, 2 nodes, 3 rounds
    .venv/bin/python -m benchmarks.local_deployment --tiny --rounds 3

Every process shares the machine's cores here, the workers' compute among them, so ParaBlock saves less
of a round than with compute on a core of its own (``benchmarks.overlap``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import GSM_AS_MEASURED, read_records, write_report
from parablock_flwr.tools.launch import run_deployment
from parablock_flwr.tools.tiny_model import build_tiny_model


def run(algorithm: str, args, model: str, workdir: Path) -> list[dict]:
    out = workdir / f"out-{algorithm}"
    config = {
        "algorithm": algorithm,
        "model": model,
        **GSM_AS_MEASURED,
        "output-dir": str(out),
        "num-server-rounds": args.rounds,
        "torch-threads": 1,
        "local-steps": args.local_steps,
    }
    if args.tiny:
        config.update(
            {
                "num-examples": 64,
                "heldout-examples": 8,
                "layers-per-block": 2,
                "max-seq-len": 128,
                "learning-rate": 3e-3,
            }
        )
    started = time.perf_counter()
    proc = run_deployment(workdir / f"flower-{algorithm}", config, num_supernodes=args.nodes)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"{algorithm} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{proc.summary()}")
    records = read_records(proc.run_dir)
    records[0]["total_wall_s"] = wall
    return records


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| algorithm | round | block | compute s (mean/node) | comm window s | overlap share | "
        "round wall s | held-out loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for algorithm, records in results.items():
        for rec in records[1:]:
            lines.append(
                f"| {algorithm} | {rec['round']} | {rec['block']} | {rec.get('measured_compute_s', 0):.1f} | "
                f"{_f(rec.get('measured_comm_s'))} | {_f(rec.get('measured_overlap_share'), 2)} | "
                f"{rec['round_wall_s']:.1f} | {rec['heldout_loss']:.4f} |"
            )
    lines += [
        "",
        "| algorithm | total wall s (incl. start-up) | sum of round walls s | rounds 2..R wall s | "
        "final held-out loss |",
        "|---|---|---|---|---|",
    ]
    for algorithm, records in results.items():
        rounds = records[1:]
        lines.append(
            f"| {algorithm} | {records[0]['total_wall_s']:.0f} | "
            f"{sum(r['round_wall_s'] for r in rounds):.1f} | "
            f"{sum(r['round_wall_s'] for r in rounds[1:]):.1f} | {rounds[-1]['heldout_loss']:.4f} |"
        )
    return "\n".join(lines)


def _f(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama instead of SmolLM2 (smoke test)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--local-steps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/results/ alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="parablock-bench-") as tmp:
        workdir = Path(tmp)
        model = str(build_tiny_model(workdir / "tiny")) if args.tiny else "embedded:smollm2-135m-instruct"
        results = {a: run(a, args, model, workdir) for a in ("parablock", "fedbcd")}
    text = table(results)
    print(text)
    p, f = results["parablock"][1:], results["fedbcd"][1:]
    ratio = sum(r["round_wall_s"] for r in p[1:]) / max(1e-9, sum(r["round_wall_s"] for r in f[1:]))
    print(f"\nParaBlock / sequential BCD, wall time of rounds 2..R: {ratio:.2f}")
    if not args.no_write:
        title = f"Local deployment, {'tiny Llama' if args.tiny else 'SmolLM2-135M'}: ParaBlock vs sequential BCD"
        write_report(
            "local_deployment",
            title,
            f"Loopback (no link shaping); {args.nodes} SuperNodes each with a node worker (1 torch thread), "
            f"{args.rounds} rounds, {args.local_steps} local steps.\n\n"
            f"{text}\n\nParaBlock / sequential BCD, wall time of rounds 2..R: **{ratio:.2f}**\n",
        )


if __name__ == "__main__":
    main()
