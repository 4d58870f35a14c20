"""Many virtual clients on Flower's simulation engine: where each byte per client goes, disk and time.

For each client count, one ParaBlock simulation run; a sampler sums the memory of every process of the
run every 0.5 s, by kind of process (the SuperLink and its SuperExec; the simulation process, which holds
the ServerApp, Flower's contexts of every virtual node and Ray's driver; the server's evaluator; the Ray
actors that run the clients; Ray's own daemons; `flwr run`), and keeps each kind's peak and the peak of the sum, both as
resident memory (RSS, which counts pages shared between processes, such as Ray's object store, once per
process) and as proportional memory (PSS, which splits them). A line fitted to the peaks over the client
counts gives the memory per extra virtual client, in MB and in block updates (one client's update in the
transfer dtype). The run folder's size on disk, its node-state part (each virtual node's pending update
and residuals) and its number of files, the wall time per round, and the server's time per round
(from the last reply to the next messages: checks, aggregation, records) come from the run itself.

    .venv/bin/python -m benchmarks.scale --clients 10 100 300 --hidden 256
    .venv/bin/python -m benchmarks.scale --model embedded --clients 10 1000 --sampled 4 --transfer-dtype int8

Writes docs/results/scale.md (its command at the top) unless ``--no-write``; ``--section`` names the
part of that page a command writes, so that several commands share it.

Reading the page: a virtual client's pending update and residuals live on disk under the run folder, read
only by the actor that serves it, so memory does not grow with the clients that only exist. Where every
client is sampled every round, some memory per client remains, mostly in Ray's actors and Flower's simulation
process (not yet pinned down). With a rounding ``transfer-dtype`` a client's disk is its pending update plus
the fp32 residual of each block it trained: more than one block.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from benchmarks.common import GSM_AS_MEASURED, PROJECT_DIR, command, machine, read_records, replace_doc_section
from parablock_flwr.tools.launch import run_simulation
from parablock_flwr.tools.tiny_model import build_tiny_model

RESULTS = PROJECT_DIR / "docs" / "results" / "scale.md"
KINDS = ("superlink", "simulation", "evaluator", "ray actors", "ray daemons", "other")


def kind_of(proc: psutil.Process) -> str:
    """Which part of the run a process is, from its command line."""
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    if "ClientAppActor" in line or "ray::IDLE" in line:
        return "ray actors"
    if line.startswith("ray::") or "/ray/" in line:  # raylet, GCS, dashboard and its agents, monitors
        return "ray daemons"
    if "multiprocessing.spawn" in line:  # the server's evaluator (server_apps/evaluator.py)
        return "evaluator"
    if "flower-superlink" in line or "flower-superexec" in line:
        return "superlink"
    if "flwr-simulation" in line:
        return "simulation"
    return "other"  # `flwr run`, multiprocessing's resource tracker


def tree_memory(root: psutil.Process) -> dict[str, list[int]]:
    """[RSS, PSS] by kind of process, summed over ``root``'s descendants (``root`` itself left out)."""
    out = {kind: [0, 0] for kind in KINDS}
    for proc in root.children(recursive=True):
        try:
            info = proc.memory_full_info()
        except psutil.Error:
            continue
        row = out[kind_of(proc)]
        row[0], row[1] = row[0] + info.rss, row[1] + info.pss
    return out


def folder_bytes(folder: Path) -> tuple[int, int]:
    """(bytes on disk, files) under ``folder``."""
    size = files = 0
    for path in folder.rglob("*"):
        if path.is_file():
            size, files = size + path.stat().st_blocks * 512, files + 1
    return size, files


def measure(clients: int, model: str, args: argparse.Namespace, workdir: Path) -> dict:
    """One run of ``clients`` virtual clients: its peaks, disk and times."""
    me = psutil.Process(os.getpid())
    peak = {kind: [0, 0] for kind in KINDS}
    total, done = [0, 0], threading.Event()

    def sample():
        while not done.is_set():
            now = tree_memory(me)
            for kind, (rss, pss) in now.items():
                peak[kind] = [max(peak[kind][0], rss), max(peak[kind][1], pss)]
            total[:] = [max(total[0], sum(v[0] for v in now.values())), max(total[1], sum(v[1] for v in now.values()))]
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = workdir / f"out-{clients}"
    fraction = min(1.0, args.sampled / clients) if args.sampled else 1.0
    config = {
        "model": model,
        **GSM_AS_MEASURED,
        "output-dir": str(out),
        "num-examples": max(64, 2 * clients + 8),  # two rows per client at least
        "heldout-examples": 8,
        "generate-examples": 0,
        "layers-per-block": args.layers_per_block,
        "num-server-rounds": args.rounds,
        "local-steps": 2,
        "batch-size": 2,
        "max-seq-len": 128,
        "torch-threads": 1,
        "transfer-dtype": args.transfer_dtype,
        "fraction-train": fraction,
        "eval-every": 100,  # the held-out loss of x^0 and of the last round only
    }
    started = time.perf_counter()
    proc = run_simulation(
        workdir / f"flower-{clients}", config, num_supernodes=clients, cpus_per_client=1, timeout_s=args.timeout_s
    )
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    if proc.returncode != 0 or proc.run_dir is None:
        sys.exit(f"{clients} clients failed:\n{proc.stdout[-3000:]}\n{proc.summary()}")
    run_dir = proc.run_dir
    records = [r for r in read_records(run_dir) if r["round"] > 0]
    disk, files = folder_bytes(run_dir)
    node_disk, node_files = folder_bytes(run_dir / "node-state") if (run_dir / "node-state").exists() else (0, 0)
    metrics_line = max(len(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {
        "clients": clients,
        "sampled": records[-1]["num_accepted"],
        "wall_s": wall,
        "round_wall_s": float(np.mean([r["round_wall_s"] for r in records[1:] or records])),
        "aggregate_s": float(np.mean([r["aggregate_s"] for r in records])),
        "total_mb": [v / 1e6 for v in total],
        "by_kind_mb": {kind: [v / 1e6 for v in peak[kind]] for kind in KINDS},
        "block_update_mb": records[-1]["bytes_up_per_client"] / 1e6,
        "disk_mb": disk / 1e6,
        "node_state_mb": node_disk / 1e6,
        "node_state_files": node_files,
        "files_in_run_dir": files,
        "record_line_bytes": metrics_line,
    }


def slope(rows: list[dict], value) -> float:
    """MB per extra virtual client: the slope of a line fitted to ``value(row)`` over the client counts."""
    xs = [r["clients"] for r in rows]
    if len(set(xs)) < 2:
        return float("nan")
    return float(np.polyfit(xs, [value(r) for r in rows], 1)[0])


def report(rows: list[dict], args: argparse.Namespace) -> str:
    """The tables: the run's figures per client count, where the memory goes, the fitted growth."""
    block = rows[-1]["block_update_mb"]
    lines = [
        "| virtual clients | sampled per round | peak RSS, MB | peak PSS, MB | disk of run folder, MB | "
        "node-state, MB (files) | files in run folder | wall s | s per round | server s per round | "
        "record line, bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['sampled']} | {r['total_mb'][0]:.0f} | {r['total_mb'][1]:.0f} | "
            f"{r['disk_mb']:.1f} | {r['node_state_mb']:.1f} ({r['node_state_files']}) | {r['files_in_run_dir']} | "
            f"{r['wall_s']:.0f} | {r['round_wall_s']:.1f} | {r['aggregate_s']:.3f} | {r['record_line_bytes']} |"
        )
    lines += ["", "Peak by kind of process, RSS / PSS in MB, and the fitted growth per extra virtual client:", ""]
    lines.append(
        "| process | " + " | ".join(f"{r['clients']} clients" for r in rows) + " | MB per extra client (PSS) |"
    )
    lines.append("|---|" + "---|" * (len(rows) + 1))
    for kind in KINDS:
        cells = " | ".join(f"{r['by_kind_mb'][kind][0]:.0f} / {r['by_kind_mb'][kind][1]:.0f}" for r in rows)
        lines.append(f"| {kind} | {cells} | {slope(rows, lambda r, k=kind: r['by_kind_mb'][k][1]):.3f} |")
    rss, pss = slope(rows, lambda r: r["total_mb"][0]), slope(rows, lambda r: r["total_mb"][1])
    disk = slope(rows, lambda r: r["node_state_mb"])
    lines += [
        "",
        f"One block update in {args.transfer_dtype}: {block:.2f} MB. Per extra virtual client (a line fitted "
        f"to the peaks): **{rss:.3f} MB RSS, {pss:.3f} MB PSS = {pss / block:.3f} block updates (PSS)**, "
        f"{rss / block:.3f} (RSS); node-state on disk {disk:.3f} MB per extra client "
        f"({disk / block:.2f} block updates; it grows with the clients that have trained, not with those that "
        "only exist).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--hidden", type=int, default=256, help="the tiny Llama's hidden size (its block grows as its square)"
    )
    parser.add_argument(
        "--model", default="tiny", help="tiny (a tiny Llama, --hidden) or a run-config model, e.g. embedded"
    )
    parser.add_argument("--layers-per-block", type=int, default=1)
    parser.add_argument("--transfer-dtype", default="fp32")
    parser.add_argument("--sampled", type=int, default=0, help="clients sampled per round (fraction-train); 0: all")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--section", default="", help="the heading of this command's part of docs/results/scale.md")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="parablock-scale-") as tmp:
        if args.model == "tiny":
            model, name = (
                str(build_tiny_model(Path(tmp) / "tiny", hidden=args.hidden)),
                f"tiny Llama, hidden {args.hidden}",
            )
        else:
            model = name = "embedded:smollm2-135m-instruct" if args.model == "embedded" else args.model
        rows = []
        for n in args.clients:
            rows.append(measure(n, model, args, Path(tmp)))
            print(report(rows, args), flush=True)
    text = report(rows, args)
    if args.no_write:
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    if not RESULTS.exists():
        RESULTS.write_text(
            "# Many virtual clients: memory, disk and time\n\nFigures written by `benchmarks/scale.py`.\n"
        )
    heading = "## " + (args.section or f"{name}, {args.transfer_dtype}")
    body = (
        f"Command: `{command('scale')}`  \nDate: {time.strftime('%Y-%m-%d')}  \nMachine: {machine()}\n\n"
        f"{name}, {args.layers_per_block} layer(s) per block, {args.rounds} rounds of ParaBlock, 2 local steps, "
        "1 CPU per client (2 Ray actors on this 2-core machine), server evaluation of x^0 and the last round only. "
        "Peaks are over every process of the run, above the benchmark's own.\n\n"
        f"{text}\n"
    )
    replace_doc_section(heading, body, doc=RESULTS)


if __name__ == "__main__":
    main()
