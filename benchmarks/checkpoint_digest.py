"""The checkpoint's digest of ``x`` each round: the whole model hashed (before) against only the
tensors the round's step changed (``core.ModelDigest``), on SmolLM2-135M's trainable weights in its
default 5-layer blocks, one block stepped a round, as a run does. Prints the medians and SHA-256's
throughput here, and what they give for Llama-3.1-8B's trainable weights and largest block (the
plan's shapes: bytes over the measured throughput, linear in the bytes hashed).

    .venv/bin/python -m benchmarks.checkpoint_digest              # about 30 s
    .venv/bin/python -m benchmarks.checkpoint_digest --no-write
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import PROJECT_DIR, write_report
from parablock_flwr import core
from parablock_flwr.config import RunConfig
from parablock_flwr.model import load_for_training
from parablock_flwr.plan import model_config, model_shape

SECTION = "## The checkpoint's digest of the model, each round"
LLAMA_8B = PROJECT_DIR / "docs" / "model-configs" / "llama-3.1-8b"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    cfg = RunConfig()
    model, partition = load_for_training(cfg)
    params = {n: p.detach() for n, p in model.named_parameters() if n in partition.all_names()}
    names = partition.all_names()
    whole, per_tensor = [], []
    model_digest = core.ModelDigest(names)
    model_digest(params)  # the first checkpoint hashes everything in both ways
    for server_round in range(1, args.rounds + 1):
        block = partition.names((server_round - 1) % partition.num_blocks)
        step = {n: torch.full_like(params[n], 1e-6) for n in block}
        core.apply_step(params, step)
        start = time.perf_counter()
        core.digest(params, names)
        whole.append(time.perf_counter() - start)
        model_digest.changed(step)
        start = time.perf_counter()
        model_digest(params)
        per_tensor.append(time.perf_counter() - start)
    trainable = sum(t.numel() for t in params.values()) * 4
    rate = trainable / statistics.median(whole)  # bytes a second
    big = model_shape(cfg, model_config(str(LLAMA_8B)))
    rows = [
        ("SmolLM2-135M, measured", trainable, statistics.median(whole), statistics.median(per_tensor)),
        ("Llama-3.1-8B, from the rate", big.trainable * 4, big.trainable * 4 / rate, max(big.blocks) * 4 / rate),
    ]
    lines = [
        "| model | trainable GiB (fp32) | whole model hashed, s a round | changed tensors only, s a round |",
        "|---|---|---|---|",
        *[f"| {m} | {b / 2**30:.2f} | {w:.2f} | {p:.2f} |" for m, b, w, p in rows],
        "",
        f"SHA-256 here: {rate / 2**30:.2f} GiB/s (median of {args.rounds} rounds; one core).",
    ]
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        write_report("checkpoint_digest", SECTION, __doc__, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
