"""Many virtual clients on Flower's simulation engine: peak memory and wall time.

For each client count, one ParaBlock simulation run with the tiny Llama; a
sampler sums the memory of every process of the run (SuperLink, ServerApp,
Ray and its actors) every 0.5 s and keeps the peak, both as resident memory
(RSS, which counts pages shared between processes, such as Ray's object
store, once per process) and as proportional memory (PSS, which splits them).
Writes the table into docs/benchmarks.md with the command that reproduces it.

    .venv/bin/python -m benchmarks.scale --clients 10 50 100
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks.common import GSM_AS_MEASURED, command, read_records, replace_doc_section
from parablock_flwr.tools.launch import run_simulation
from parablock_flwr.tools.tiny_model import build_tiny_model


def tree_memory(root: psutil.Process) -> tuple[int, int]:
    """(RSS, PSS) summed over ``root`` and its descendants."""
    rss = pss = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            info = proc.memory_full_info()
        except psutil.Error:
            continue
        rss, pss = rss + info.rss, pss + info.pss
    return rss, pss


def measure(clients: int, model: Path, rounds: int, workdir: Path) -> dict:
    me = psutil.Process(os.getpid())
    baseline, peak, done = tree_memory(me), [0, 0], threading.Event()

    def sample():
        while not done.is_set():
            peak[:] = [max(p, m) for p, m in zip(peak, tree_memory(me))]
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = workdir / f"out-{clients}"
    config = {
        "model": str(model),
        **GSM_AS_MEASURED,
        "output-dir": str(out),
        "num-examples": max(64, 2 * clients + 8),
        "heldout-examples": 8,
        "layers-per-block": 1,
        "num-server-rounds": rounds,
        "local-steps": 2,
        "batch-size": 2,
        "max-seq-len": 128,
        "torch-threads": 1,
    }
    started = time.perf_counter()
    proc = run_simulation(workdir / f"flower-{clients}", config, num_supernodes=clients, cpus_per_client=1)
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    if proc.returncode != 0:
        sys.exit(f"{clients} clients failed:\n{proc.stdout[-3000:]}\n{proc.summary()}")
    run_dir = proc.run_dir
    records = read_records(run_dir)
    block_bytes = records[-1]["bytes_up_per_client"]
    files = sum(1 for _ in run_dir.rglob("*") if _.is_file())
    return {
        "clients": clients,
        "wall_s": wall,
        "peak_rss_mb": (peak[0] - baseline[0]) / 1e6,
        "peak_pss_mb": (peak[1] - baseline[1]) / 1e6,
        "block_update_mb": block_bytes / 1e6,
        "accepted_last_round": records[-1]["num_accepted"],
        "files_in_run_dir": files,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--hidden", type=int, default=64, help="hidden size of the tiny Llama (block size grows as its square)"
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="parablock-scale-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny", hidden=args.hidden)
        rows = [measure(n, model, args.rounds, Path(tmp)) for n in args.clients]
    lines = [
        "| virtual clients | peak RSS of the run, MB | peak PSS, MB | per extra client (RSS / PSS), MB | "
        "one block update, MB | per extra client in block updates (PSS) | wall s | accepted in last round | "
        "files in run folder |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        more = max(1, row["clients"] - rows[0]["clients"])
        extra_rss = (row["peak_rss_mb"] - rows[0]["peak_rss_mb"]) / more
        extra_pss = (row["peak_pss_mb"] - rows[0]["peak_pss_mb"]) / more
        lines.append(
            f"| {row['clients']} | {row['peak_rss_mb']:.0f} | {row['peak_pss_mb']:.0f} | "
            f"{extra_rss:.2f} / {extra_pss:.2f} | {row['block_update_mb']:.2f} | "
            f"{extra_pss / row['block_update_mb']:.1f} | {row['wall_s']:.0f} | "
            f"{row['accepted_last_round']} | {row['files_in_run_dir']} |"
        )
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        heading = "## Many virtual clients in simulation" + (f", hidden {args.hidden}" if args.hidden != 64 else "")
        replace_doc_section(
            heading,
            f"Command: `{command('scale')}`  \n"
            f"Tiny Llama (4 layers, hidden {args.hidden}), one layer per block, "
            f"{args.rounds} rounds of ParaBlock, 1 CPU per client (2 Ray actors on this 2-core machine). "
            "Peak RSS and PSS are sums over every process of the run, above the benchmark's own.\n\n"
            f"{text}\n",
            dated=True,
        )


if __name__ == "__main__":
    main()
