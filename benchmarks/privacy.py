"""Measures what differential privacy costs in quality: held-out loss and task accuracy against epsilon.

Runs ParaBlock and sequential BCD in simulation (`flwr run` on Flower's engine) with the same model, data,
seed, clients and rounds: first without DP, ParaBlock with `extensions/update_norms.py`, whose records give
each round's largest update norm; then central DP (docs/privacy.md) with the clip norm set to half of their
median and each noise multiplier given. Prints one table (epsilon at dp-delta after the run, the share of
updates clipped, held-out loss and task accuracy before and after) and writes it to docs/results/privacy.md
with the command that reproduces it. The clip norm is chosen from the run's own updates, which a private run
could not do (docs/privacy.md, "Choosing the clip norm"): here it only places the curve.

    .venv/bin/python -m benchmarks.privacy                       # embedded SmolLM2, 2 clients, 4 rounds
    .venv/bin/python -m benchmarks.privacy --tiny --rounds 2 --no-write

Reading the page: with two sites the mean's noise, σ C / 2 on every weight of the block, is far larger than
what a round moves a weight, so any noise that gives a meaningful ε destroys the model. Client-level DP needs
many sites (the noise on the mean falls as 1 / n) or many rounds of small updates; this benchmark has neither,
and says only that the mechanism runs, costs what the noise implies, and is accounted. Where ParaBlock loses
more than BCD under the smallest noise (one seed), a suspect is its stale start, which does not see the noise
of ``g^{r-1}`` until the correction; not studied further.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import simulate, write_report
from parablock_flwr.tools.tiny_model import build_tiny_model

TITLE = "Differential privacy: quality against epsilon"
EXTENSION = "extensions.update_norms:UpdateNormParaBlock"


def run(algorithm: str, sigma: float | None, clip: float, args, model: str, workdir: Path) -> list[dict]:
    """One simulation: ``sigma`` None is the run without DP."""
    label = f"{algorithm}-{'plain' if sigma is None else sigma}"
    config = {
        "algorithm": algorithm,
        "model": model,
        "output-dir": str(workdir / f"out-{label}"),
        "num-server-rounds": args.rounds,
        "weighting": "uniform",  # as DP needs: the runs differ only in clipping and noise
        "seed": args.seed,
    }
    if sigma is None and algorithm == "parablock":
        config["strategy"] = EXTENSION
    if sigma is not None:
        config.update({"dp-clip-norm": clip, "dp-noise-multiplier": sigma})
    if args.tiny:
        config.update({"num-examples": 64, "heldout-examples": 8, "layers-per-block": 2, "max-seq-len": 128,
                       "generate-examples": 2})  # fmt: skip
    print(f"{label} ...", flush=True)
    started = time.perf_counter()
    _, records = simulate(workdir / f"flower-{label}", config, args.clients, cpus_per_client=2)
    records[0]["total_wall_s"] = time.perf_counter() - started
    return records


def row(algorithm: str, sigma: float | None, clip: float, records: list[dict]) -> str:
    first, last = records[0], records[-1]
    trained = [r for r in records[1:] if "train_loss" in r]
    if sigma is None:
        dp, eps, clipped = "none", "∞", "-"
    else:
        dp = f"σ = {sigma:g}, C = {clip:.3g}"
        eps = f"{trained[-1]['dp_epsilon']:.2f}"
        clipped = f"{sum(r['dp_clipped'] for r in trained)}/{sum(r['num_accepted'] for r in trained)}"
    acc = "-"
    if first.get("task_accuracy") is not None and last.get("task_accuracy") is not None:
        acc = f"{first['task_accuracy']:.3f} → {last['task_accuracy']:.3f}"
    return (f"| {algorithm} | {dp} | {eps} | {clipped} | {first['heldout_loss']:.4f} → {last['heldout_loss']:.4f} "
            f"| {acc} | {first['total_wall_s']:.0f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.privacy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama instead of SmolLM2 (smoke test)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise-multipliers", default="0.03,0.3,3", help="comma-separated sigmas")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/results/ alone")
    args = parser.parse_args()
    sigmas = [float(s) for s in args.noise_multipliers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="parablock-privacy-") as tmp:
        workdir = Path(tmp)
        model = str(build_tiny_model(workdir / "tiny")) if args.tiny else "embedded:smollm2-135m-instruct"
        plain = run("parablock", None, 0.0, args, model, workdir)
        norms = [r["max_update_norm_seen"] for r in plain[1:] if "max_update_norm_seen" in r]
        clip = statistics.median(norms) / 2
        print(f"largest update norms per round: {', '.join(f'{n:.3g}' for n in norms)}; clip norm {clip:.3g}")
        for algorithm in ("parablock", "fedbcd"):
            runs = [(None, plain if algorithm == "parablock" else run(algorithm, None, clip, args, model, workdir))]
            runs += [(sigma, run(algorithm, sigma, clip, args, model, workdir)) for sigma in sigmas]
            rows += [row(algorithm, sigma, clip, records) for sigma, records in runs]
    text = "\n".join(
        [
            "| algorithm | DP (central) | ε at δ = 1e-5 | updates clipped | held-out loss r0 → rR "
            "| task accuracy r0 → rR | wall s |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]  # fmt: skip
    )
    print(text)
    if args.no_write:
        return
    model_name = "tiny Llama" if args.tiny else "SmolLM2-135M-Instruct (embedded)"
    body = (
        f"{model_name}, the default data (reasoning-gym mix), {args.clients} virtual clients, {args.rounds} rounds, "
        f"seed {args.seed}, uniform weights, the default run config otherwise. DP is central: each update clipped "
        f"to C (half the median of the run without DP's largest update norms per round), the mean noised with std "
        f"σ C / {args.clients}. ε composes every round (each site is in every round; no amplification by sampling "
        f"is claimed). With {args.clients} sites the mean's noise is large against a block's update: DP needs "
        f"many sites (docs/privacy.md).\n\n{text}\n"
    )
    write_report("privacy", TITLE, body)


if __name__ == "__main__":
    main()
