"""Measures the default job with updates and steps sent in fp32, bf16, fp16 and int8: held-out loss,
bytes and the invariant checks (half or a quarter of the bytes, same invariant).

Each run is the README's main job (ParaBlock, the embedded SmolLM2, 2 virtual clients,
3 rounds on Flower's simulation engine) with only ``transfer-dtype`` changed, and
``verify-invariant`` on: every client's local model must still be exactly
``x^{r-1} + Δ_i^r`` (it keeps the rounded update it sent; error feedback carries the
rounding into its next update of that block). Prints and writes to docs/results/transfer_dtype.md
(``--study``: docs/results/transfer_dtype-study.md):
the held-out loss after the last round against fp32's, the bytes that crossed (the
arrays of every message and reply, as serialised: int8's include its fp32 scales, one per 256
values, and every record's small layout), and the invariant checks.

    .venv/bin/python -m benchmarks.transfer_dtype            # fp32, bf16, fp16, int8 (~20 min here)
    .venv/bin/python -m benchmarks.transfer_dtype --tiny --no-write
    .venv/bin/python -m benchmarks.transfer_dtype --study --dtypes fp32,int8   # the tiny convergence study's
        # setting (benchmarks/convergence.py: alpha 0.1, 40 rounds, 3 seeds, 8 clients), ParaBlock per dtype
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import GSM_AS_MEASURED, command, read_records, write_report
from parablock_flwr.tools.launch import run_simulation
from parablock_flwr.tools.tiny_model import build_tiny_model

TITLE = "Transfer precision: bf16, fp16 and int8 updates against fp32"
STUDY_TITLE = "Transfer precision on the tiny convergence study"


def run(dtype: str, args, model: str, workdir: Path) -> dict:
    out = workdir / f"out-{dtype}"
    config = {"model": model, **GSM_AS_MEASURED,
              "output-dir": str(out), "num-server-rounds": args.rounds, "transfer-dtype": dtype,
              "verify-invariant": True, "generate-examples": 0}  # fmt: skip
    if args.tiny:
        config.update({"num-examples": 64, "heldout-examples": 8, "layers-per-block": 2, "max-seq-len": 128})
    print(f"[{time.strftime('%H:%M:%S')}] transfer-dtype={dtype} ...", flush=True)
    result = run_simulation(workdir / f"flower-{dtype}", config, num_supernodes=2, cpus_per_client=1, timeout_s=3600)
    if result.returncode != 0 or result.run_dir is None:
        return {"dtype": dtype, "error": result.reason}
    records = read_records(result.run_dir)
    trained = records[1:]
    return {
        "dtype": dtype,
        "heldout_loss_initial": records[0]["heldout_loss"],
        "heldout_loss_final": records[-1]["heldout_loss"],
        "wire_bytes_up": sum(r["wire_bytes_up"] for r in trained),
        "wire_bytes_down": sum(r["wire_bytes_down"] for r in trained),
        "invariant_checked": sum(r.get("invariant_checked", 0) for r in trained),
        "invariant_failed": sum(r.get("invariant_failed", 0) for r in trained),
    }


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["dtype"] == "fp32" and "error" not in r), None)
    lines = [
        "| transfer-dtype | held-out loss r0 → rR | vs fp32 | MB up (all rounds) | MB down | bytes vs fp32 | "
        "invariant checks (failed) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['dtype']} | failed: {r['error']} | | | | | |")
            continue
        gap = f"{100 * (r['heldout_loss_final'] / base['heldout_loss_final'] - 1):+.2f}%" if base else "-"
        total = r["wire_bytes_up"] + r["wire_bytes_down"]
        ratio = f"{total / (base['wire_bytes_up'] + base['wire_bytes_down']):.3f}" if base else "-"
        lines.append(
            f"| {r['dtype']} | {r['heldout_loss_initial']:.4f} → {r['heldout_loss_final']:.4f} | {gap} | "
            f"{r['wire_bytes_up'] / 1e6:.1f} | {r['wire_bytes_down'] / 1e6:.1f} | {ratio} | "
            f"{r['invariant_checked']} ({r['invariant_failed']}) |"
        )
    return "\n".join(lines)


def study(args, dtypes: list[str]) -> str:
    """ParaBlock on the tiny convergence study's setting, once per dtype and seed: the final held-out loss
    against fp32's, seed by seed, and whether each dtype's mean lies within fp32's spread over the seeds.
    Runs are kept under ``--workdir`` (fp32's under the study's own names: shared with it)."""
    from benchmarks.convergence import ALGORITHMS, TINY, final_loss, fmt_spread, run_once

    model = build_tiny_model(args.workdir / "tiny-model")
    finals, mb = {}, {}
    for dtype in dtypes:
        finals[dtype], mb[dtype] = [], []
        for seed in args.seeds:
            config = {**TINY, **ALGORITHMS["parablock"], "model": str(model), "dirichlet-alpha": args.alpha,
                      "seed": seed, "num-server-rounds": args.rounds, "transfer-dtype": dtype}  # fmt: skip
            suffix = "" if dtype == "fp32" else f"-{dtype}"
            name = f"tiny-a{args.alpha:g}-parablock{suffix}-s{seed}-r{args.rounds}"
            result = run_once(name, config, args.clients, args.workdir)
            finals[dtype].append(final_loss(result))
            mb[dtype].append(sum(r.get("wire_bytes_up", 0) + r.get("wire_bytes_down", 0) for r in result["records"]))
    base = finals.get("fp32")
    lines = [
        f"| transfer-dtype | final held-out loss, mean (min–max over seeds {args.seeds}) | against fp32, seed by seed "
        "| mean within fp32's spread | MB sent per run |",
        "|---|---|---|---|---|",
    ]
    for dtype in dtypes:
        paired = ", ".join(f"{a / b - 1:+.2%}" for a, b in zip(finals[dtype], base)) if base else "–"
        mean = sum(finals[dtype]) / len(finals[dtype])
        within = ("yes" if min(base) <= mean <= max(base) else "no") if base and dtype != "fp32" else "–"
        lines.append(f"| {dtype} | {fmt_spread(finals[dtype])} | {paired} | {within} | "
                     f"{sum(mb[dtype]) / len(mb[dtype]) / 1e6:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.transfer_dtype",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dtypes", default="fp32,bf16,fp16,int8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="the tiny test model (seconds), not SmolLM2")
    p.add_argument("--no-write", action="store_true", help="leave docs/results/ alone")
    p.add_argument("--study", action="store_true", help="the tiny convergence study's setting instead")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--workdir", type=Path, default=Path("~/parablock-runs/convergence-study").expanduser())
    args = p.parse_args(argv)
    how = command("transfer_dtype") if argv is None else f"python -m benchmarks.transfer_dtype {' '.join(argv)}".strip()
    if args.study:
        args.rounds = 40 if args.rounds == 3 else args.rounds  # the study's rounds unless told otherwise
        text = study(args, args.dtypes.split(","))
        print(text)
        if not args.no_write:
            write_report(
                "transfer_dtype-study",
                STUDY_TITLE,
                f"ParaBlock (`at-end`) on the tiny convergence study's setting (benchmarks/convergence.py: a tiny "
                f"Llama from scratch, Dirichlet alpha {args.alpha:g} over instruction-mix's task families, "
                f"{args.clients} virtual clients, half sampled each round, {args.rounds} rounds), one run per "
                "transfer dtype and seed; the same seeds give the same data, partitions, clients and batches.\n\n"
                + text
                + "\n",
                how=how,
            )
        return 0
    with tempfile.TemporaryDirectory(prefix="parablock-transfer-") as tmp:
        model = str(build_tiny_model(Path(tmp) / "tiny")) if args.tiny else "embedded:smollm2-135m-instruct"
        rows = [run(dtype, args, model, Path(tmp)) for dtype in args.dtypes.split(",")]
    text = table(rows)
    print(text)
    if not args.no_write:
        write_report(
            "transfer_dtype",
            TITLE,
            f"ParaBlock, `{'tiny Llama' if args.tiny else model}`, 2 virtual clients, {args.rounds} rounds, "
            "verify-invariant on; bytes = the serialised arrays of every message and reply (`wire_bytes_*` in "
            "metrics.jsonl).\n\n" + text + "\n",
            how=how,
        )
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
