"""Fits the time model's two costs of an exchange besides the link, ``message-overhead-s`` and
``message-throughput-mbs``, to two run folders of your own deployment.

Run a few rounds (3 or more) of sequential BCD (``algorithm = "fedbcd"``) twice, with two message
sizes (``transfer-dtype`` fp32 and int8, or two ``layers-per-block``), and give their run folders
with the link the runs had. Each round from round 2 on gives one window (the node's reply leaving
it to the next message reaching it, ``measured_comm_s`` in a deployment's records); the link's own
time (bytes at the rate, the latency each way) is taken away and ``fixed + bytes / throughput``
fitted to what is left. Prints the two run-config lines (docs/configuration.md).

    .venv/bin/python -m benchmarks.time_model RUN_DIR RUN_DIR --rate 1000 --latency-ms 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import read_records
from benchmarks.network.analysis import round_row
from benchmarks.network.dtypes import calibrate, windows


def fit_run_dirs(run_dirs: list[Path], rate: float, latency_ms: float) -> dict:
    """``fixed_s`` (``message-overhead-s``) and ``throughput_mbs`` (``message-throughput-mbs``) fitted
    to the windows of ``run_dirs``, run over a link of ``rate`` Mbit/s each way and ``latency_ms``."""
    runs = []
    for run_dir in run_dirs:
        rounds = [round_row(rec) for rec in read_records(run_dir)[1:]]
        runs.append({"transfer_dtype": str(run_dir), "rate_mbps": rate, "latency_ms": latency_ms, "rounds": rounds})
    if bad := [str(d) for d, r in zip(run_dirs, runs) if not windows(r)]:
        raise ValueError(
            f"{bad[0]}: no round 2 or later with a measured window (measured_comm_s); expected >= 3 rounds"
        )
    return calibrate(runs, runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.time_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="run folders (>= 2 message sizes)")
    p.add_argument("--rate", type=float, required=True, help="the link rate the runs had, Mbit/s each way")
    p.add_argument("--latency-ms", type=float, default=0.0, help="their one-way latency (default 0)")
    args = p.parse_args(argv)
    if args.rate <= 0:
        p.error(f"--rate {args.rate:g}: expected the runs' link rate in Mbit/s, > 0")
    try:
        model = fit_run_dirs(args.run_dirs, args.rate, args.latency_ms)
    except ValueError as err:
        sys.exit(f"time_model: {err}")
    print(f"message-overhead-s = {model['fixed_s']:.2f}\nmessage-throughput-mbs = {model['throughput_mbs']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
