"""Every algorithm over shaped links: network namespaces, veth pairs, `tc tbf` and a latency proxy.

One command builds a small network on this one machine, runs each algorithm
in turn over it (same model, data, seed, rounds and links), reports what was
measured next to what the server's time model predicts, and removes
everything it made:

    namespace pbn-<pid>-link     flower-superlink on 0.0.0.0:9093, its ServerApp, `flwr run`
         |  one veth pair per node: 10.213.<i>.1 (link side) <-> 10.213.<i>.2 (node side),
         |  `tc tbf` on both ends: node-side egress = uplink, link-side egress = downlink
    namespace pbn-<pid>-n<i>     latency proxy 127.0.0.1:9092 -> 10.213.<i>.1:9093 (one-way delay
                                 on every chunk, both directions; this kernel has no netem),
                                 flower-supernode -> the proxy, the node worker (Unix socket)

SuperLink, SuperNodes, workers and proxies are restarted for every run (a fresh
worker per run, so its peak memory is that run's); the namespaces and links
stay, and their rate is changed between the rates of a sweep. Every process is
stopped by its PID (with its process group), every namespace deleted, also on
Ctrl-C, SIGTERM or an error. Needs root (`ip netns`). The namespaces, links, shaping,
proxy and clean-up are benchmarks/netlab.py; this file is the experiment: runs, tables, plots.

    .venv/bin/python -m benchmarks.network                       # SmolLM2, 2 clients, 3 rounds, every algorithm
    .venv/bin/python -m benchmarks.network --rates 10,25,100     # a sweep of link rates
    .venv/bin/python -m benchmarks.network --fast                # tiny model, a short smoke run (no docs)
    .venv/bin/python -m benchmarks.network --probe               # 1 round: the rate at which link time = compute

Writes into --out: results.json, loss-vs-wall.png, round-times.png, the run
folders and every process's log; without --fast (or with --docs) also a
section of docs/benchmarks.md with the plots under docs/img/.

How the default link rate was chosen (compute ~ communication): a round of the
default job moves one 5-layer block of SmolLM2 each way per client,
5 x 3.54 M params x 4 B = 70.8 MB up and 70.8 MB down, and the server's time
model charges it 2 x latency + 8 x (up + down) / rate. The link time equals a
round's compute C at rate = 8 x 141.6 MB / (C - 2 x latency). On this 2-core
machine (2 workers, 1 torch thread each, 3 local steps, batch 4 x 192 tokens):
  - `--probe` (2026-11-29, while another job's tests kept the load at ~4)
    measured C = 61.4 s, i.e. 18.5 Mbit/s;
  - the quiet-machine local deployment in docs/benchmarks.md measured C =
    31.6 s (ParaBlock) and 23.8 s (sequential BCD) for the same round 1, mean
    27.7 s, i.e. 41 Mbit/s.
The default, 40 Mbit/s with 50 ms one way, is the quiet-machine figure (the
benchmark is meant to run on a quiet machine). On another machine run
`--probe` first and pass the rate it prints with --rate. The same
calculation, with the tiny model's ~0.55 s of compute and 0.59 MB each round,
sets the --fast rate (8 Mbit/s, 20 ms); there Flower's fixed costs (3 s polls,
process start-up) dominate the communication window anyway.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import GSM_AS_MEASURED, PROJECT_DIR, machine, read_records, replace_doc_section
from benchmarks.netlab import (
    Network,
    build_network,
    check_machine,
    descendants,
    in_netns,
    listens_in,
    peak_rss_mb,
    proxy_command,
    shape,
    started_in,
    stop_on_sigterm,
    terminate_all,
    wait_gone,
    wire_bytes,
)
from parablock_flwr.tools.launch import (
    flower_env,
    flwr_run,
    node_config,
    superlink_command,
    supernode_command,
    wait_for,
    worker_command,
    write_connection,
)

log = logging.getLogger(__name__)

# Chosen so that link time ~ one round's compute: see the module docstring.
DEFAULT_RATE_MBPS = 40.0
DEFAULT_LATENCY_MS = 50.0
FAST_RATE_MBPS = 8.0
FAST_LATENCY_MS = 20.0

# Ports inside the namespaces: every namespace is fresh, so fixed ports are free.
SUPERLINK_PORT, SUPERLINK_HEALTH_PORT = 9093, 9094
PROXY_PORT, CLIENTAPPIO_PORT, SUPERNODE_HEALTH_PORT = 9092, 9095, 9096

# The tiny model's run (as benchmarks/local_deployment.py --tiny): seconds per round.
TINY_CONFIG = {"num-examples": 64, "heldout-examples": 8, "max-seq-len": 128, "learning-rate": 3e-3}


# ------------------------------------------------------------------ one run
def run_one(net: Network, algorithm: str, rate: float, args: argparse.Namespace, model: str, out: Path) -> dict:
    """SuperLink, workers, proxies and SuperNodes in their namespaces, `flwr run`, then stop them all."""
    workdir = out / "runs" / f"{rate:g}mbps-{algorithm}"
    flwr_home = workdir / "flwr-home"
    flwr_home.mkdir(parents=True, exist_ok=True)
    write_connection(flwr_home, f"127.0.0.1:{SUPERLINK_PORT}")
    run_config = make_run_config(algorithm, rate, args, model, workdir / "out")
    wire_before = [wire_bytes(node) for node in net.nodes]
    result: dict = {
        "algorithm": algorithm,
        "rate_mbps": rate,
        "latency_ms": args.latency_ms,
        "pids": [],
        "workdir": str(workdir),
    }
    began = time.perf_counter()
    with contextlib.ExitStack() as procs:  # stops each process (SIGKILL after a grace period), even on error
        try:
            workers = start_processes(
                procs,
                net,
                args.latency_ms,
                workdir,
                flower_env_for(flwr_home),
                result["pids"],
                getattr(args, "compute_cpus", ""),
            )
            result["startup_s"] = time.perf_counter() - began
            proc = flwr_run(workdir, run_config, PROJECT_DIR, args.timeout_s, prefix=in_netns(net.link_ns))
            (workdir / "flwr-run.log").write_text(proc.stdout + proc.stderr + proc.summary("network.py") + "\n")
            result["returncode"] = "timeout" if proc.kind == "timeout" else proc.returncode
            result["status"] = proc.status
            result["total_wall_s"] = time.perf_counter() - began
            result["worker_peak_rss_mb"] = [peak_rss_mb(w.pid) for w in workers]  # before they are stopped
        finally:
            stopping = time.perf_counter()
            terminate(result["pids"])
    result["killed_pids"] = kill_survivors(result["pids"])  # should be none
    result["stop_s"] = time.perf_counter() - stopping
    wire_after = [wire_bytes(node) for node in net.nodes]
    result["wire_bytes_up_per_client"] = _mean([a[0] - b[0] for a, b in zip(wire_after, wire_before)])
    result["wire_bytes_down_per_client"] = _mean([a[1] - b[1] for a, b in zip(wire_after, wire_before)])
    result.update(read_run(workdir / "out") if result["returncode"] == 0 else {})
    if "rounds" not in result:
        result["error"] = f"the run ended with {result['returncode']}; see {workdir}/flwr-run.log"
    elif len(result["rounds"]) < args.rounds:  # `flwr run --stream` can return while the run is unfinished
        result["error"] = (
            f"the run stopped after {len(result['rounds'])} of {args.rounds} rounds; see {workdir}/superlink.log"
        )
        result["partial_rounds"] = result.pop("rounds")
    return result


def run_dtype_sweep(net: Network, args: argparse.Namespace, model: str, out: Path) -> list[dict]:
    """Every rate x transfer dtype x algorithm over ONE set of processes (SuperLink, workers, proxies,
    SuperNodes started once; the links re-shaped between rates; one `flwr run` per combination):
    the window against the link rate for each dtype, without a start-up per point."""
    workdir = out / "runs" / "dtype-sweep"
    flwr_home = workdir / "flwr-home"
    flwr_home.mkdir(parents=True, exist_ok=True)
    # The server evaluates at rounds 0 and R only: its evaluation would share the CPUs with the windows measured.
    args.extra_config = {**getattr(args, "extra_config", {}), "eval-every": args.rounds, "generate-examples": 0}
    runs: list[dict] = []
    pids: list[int] = []
    with contextlib.ExitStack() as procs:
        try:
            start_processes(procs, net, args.latency_ms, workdir, flower_env_for(flwr_home), pids,
                            getattr(args, "compute_cpus", ""))  # fmt: skip
            for rate in args.rates:
                shape(net, rate, args.latency_ms)
                for dtype in args.transfer_dtypes:
                    for algorithm in args.algorithms:
                        print(f"[{time.strftime('%H:%M:%S')}] {algorithm}, {dtype}, {rate:g} Mbit/s ...", flush=True)
                        runs.append(_sweep_point(net, algorithm, rate, dtype, args, model, workdir))
                        print(f"    {runs[-1].get('error', 'ok')}: {runs[-1]['total_wall_s']:.0f} s", flush=True)
                        _save({"runs": runs}, out)
        finally:
            terminate(pids)
    kill_survivors(pids)
    return runs


def terminate(pids: list[int]) -> None:
    """SIGTERM to every process started (``pids`` grows by their descendants: e.g. the SuperLink's
    detached flower-superexec), and up to 10 s for them to go."""
    pids += descendants(pids)
    terminate_all(pids)
    wait_gone(pids, timeout_s=10)


def kill_survivors(pids: list[int]) -> list[int]:
    """SIGKILL, by PID, whatever of ``pids`` is still there 2 s later (after the ExitStack's own stops);
    returns those PIDs."""
    survivors = wait_gone(pids, timeout_s=2)
    for pid in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return survivors


def _sweep_point(net: Network, algorithm: str, rate: float, dtype: str, args, model: str, workdir: Path) -> dict:
    """One `flwr run` of the sweep against the running processes."""
    point = workdir / f"{rate:g}mbps-{dtype}-{algorithm}"
    (point / "flwr-home").mkdir(parents=True, exist_ok=True)
    write_connection(point / "flwr-home", f"127.0.0.1:{SUPERLINK_PORT}")
    run_config = {**make_run_config(algorithm, rate, args, model, point / "out"), "transfer-dtype": dtype}
    result: dict = {"algorithm": algorithm, "rate_mbps": rate, "latency_ms": args.latency_ms,
                    "transfer_dtype": dtype, "workdir": str(point), "load_1min": os.getloadavg()[0]}  # fmt: skip
    began = time.perf_counter()
    proc = flwr_run(point, run_config, PROJECT_DIR, args.timeout_s, prefix=in_netns(net.link_ns))
    (point / "flwr-run.log").write_text(proc.stdout + proc.stderr + proc.summary("network.py") + "\n")
    result["total_wall_s"] = time.perf_counter() - began
    result.update(read_run(point / "out") if proc.returncode == 0 else {})
    if len(result.get("rounds", [])) < args.rounds:
        result["error"] = (
            f"the run ended with {proc.returncode} after {len(result.get('rounds', []))} rounds; see {point}"
        )
    return result


def flower_env_for(flwr_home: Path) -> dict[str, str]:
    env = flower_env(flwr_home)
    env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = "0.2"  # the only Flower poll that can be tuned
    return env


def start_processes(
    procs: contextlib.ExitStack,
    net: Network,
    latency_ms: float,
    workdir: Path,
    env: dict[str, str],
    pids: list[int],
    compute_cpus: str = "",
) -> list[subprocess.Popen]:
    """Every process of one run, each in its namespace, each appended to ``pids``; returns the workers
    (their compute thread pinned to ``compute_cpus`` when given).

    A SuperNode starts only once its worker listens (its first message needs it)
    and its proxy accepts connections.
    """

    def start(ns: str, cmd: list[str], log: str) -> subprocess.Popen:
        proc = procs.enter_context(started_in(ns, cmd, workdir / log, env))
        pids.append(proc.pid)  # also its process group: `started_in` gives each a session of its own
        return proc

    # Unix socket paths are limited to ~100 bytes: keep them short, under /tmp.
    sockets = Path(procs.enter_context(tempfile.TemporaryDirectory(prefix=f"{net.prefix}-")))
    superlink = start(
        net.link_ns, superlink_command(SUPERLINK_PORT, SUPERLINK_HEALTH_PORT, host="0.0.0.0"), "superlink.log"
    )
    workers, proxies = [], []
    for node in net.nodes:
        worker = worker_command(sockets / f"w{node.index}.sock", compute_cpus=compute_cpus)
        workers.append(start(node.ns, worker, f"worker-{node.index}.log"))
        proxies.append(
            start(
                node.ns,
                proxy_command(f"127.0.0.1:{PROXY_PORT}", f"{node.link_ip}:{SUPERLINK_PORT}", latency_ms),
                f"proxy-{node.index}.log",
            )
        )
    wait_for(lambda: listens_in(net.link_ns, SUPERLINK_PORT), superlink, workdir / "superlink.log")
    for node, worker, proxy in zip(net.nodes, workers, proxies):
        sock = sockets / f"w{node.index}.sock"
        wait_for(sock.exists, worker, workdir / f"worker-{node.index}.log")
        wait_for(lambda ns=node.ns: listens_in(ns, PROXY_PORT), proxy, workdir / f"proxy-{node.index}.log")
        start(
            node.ns,
            supernode_command(
                f"127.0.0.1:{PROXY_PORT}",
                CLIENTAPPIO_PORT,
                SUPERNODE_HEALTH_PORT,
                node_config(node.index, len(net.nodes), sock),
            ),
            f"supernode-{node.index}.log",
        )
    return workers


def read_run(out: Path) -> dict:
    """The run folder's metrics.jsonl, one row per round (round 0 = before training)."""
    run_dirs = sorted(out.glob("*")) if out.exists() else []
    if not run_dirs or not (run_dirs[-1] / "metrics.jsonl").exists():
        return {}
    records = read_records(run_dirs[-1])
    return {
        "run_dir": str(run_dirs[-1]),
        "heldout_loss_initial": records[0].get("heldout_loss"),
        "initial_elapsed_s": records[0].get("elapsed_s"),
        "rounds": [round_row(rec) for rec in records[1:]],
    }


def make_run_config(algorithm: str, rate: float, args: argparse.Namespace, model: str, out: Path) -> dict:
    """Same everything for every algorithm; the link goes into the server's time model too."""
    config = {
        "algorithm": algorithm,
        "model": model,
        **GSM_AS_MEASURED,
        "output-dir": str(out),
        "num-server-rounds": args.rounds,
        "layers-per-block": args.layers_per_block,
        "local-steps": args.local_steps,
        "torch-threads": 1,
        "uplink-mbps": rate,
        "downlink-mbps": rate,
        "latency-ms": args.latency_ms,
        "min-available-nodes": args.clients,
    }  # the server waits for every node before round 1
    if args.tiny:
        config.update(TINY_CONFIG)
    config.update(getattr(args, "extra_config", {}))
    return config


def round_row(rec: dict) -> dict:
    """One round as measured (node workers' timeline, server's round wall) and as modeled.

    Communication is the node's window from its previous reply leaving the
    worker to this round's message reaching it (so none in round 1); idle is
    the part of that window the node's worker did not compute; overlap
    efficiency = round wall / max(compute, communication), 1.0 = perfect overlap.
    """
    compute = rec.get("measured_compute_s", rec.get("compute_s_mean"))
    comm = rec.get("measured_comm_s")
    wall = rec.get("round_wall_s")
    # Idle: the part of each node's window with no compute running (all of it for sequential BCD).
    windows = [t for t in rec.get("timeline", []) if "comm_s" in t]
    idle = _mean([t["comm_s"] * (1 - t["overlap_share"]) for t in windows]) if windows else None
    efficiency = wall / max(compute, comm) if None not in (wall, compute, comm) and max(compute, comm) > 0 else None
    return {
        "round": rec["round"],
        "block": rec.get("block"),
        "heldout_loss": rec.get("heldout_loss"),
        "elapsed_s": rec.get("elapsed_s"),
        "round_wall_s": wall,
        "compute_s": compute,
        "comm_s": comm,
        "idle_s": idle,
        "overlap_share": rec.get("measured_overlap_share"),
        "overlap_efficiency": efficiency,
        "bytes_up_per_client": rec.get("bytes_up_per_client"),
        "bytes_down_per_client": rec.get("bytes_down_per_client"),
        "modeled_compute_s": rec.get("compute_s_mean"),
        "modeled_comm_s": rec.get("comm_s_modeled"),
        "modeled_round_s": rec.get("modeled_round_s"),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# ------------------------------------------------------------------ report
def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _sum(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) if values else None


def tables(runs: list[dict]) -> str:
    """Markdown: per round (measured next to modeled), then per algorithm and rate."""
    lines = [
        "| rate Mbit/s | algorithm | round | compute s | comm s | idle s | round wall s | overlap eff. | "
        "modeled comm s | modeled round s | MB up / down per client | held-out loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for r in run.get("rounds", []):
            lines.append(
                f"| {run['rate_mbps']:g} | {run['algorithm']} | {r['round']} | {_f(r['compute_s'])} | "
                f"{_f(r['comm_s'])} | {_f(r['idle_s'])} | {_f(r['round_wall_s'])} | {_f(r['overlap_efficiency'], 2)} | "
                f"{_f(r['modeled_comm_s'])} | {_f(r['modeled_round_s'])} | "
                f"{_mb(r['bytes_up_per_client'])} / {_mb(r['bytes_down_per_client'])} | {_f(r['heldout_loss'], 4)} |"
            )
    lines += [
        "",
        "| rate Mbit/s | algorithm | total wall s | rounds 2..R wall s (modeled) | mean overlap eff. r≥2 | "
        "wire MB per client up / down | worker peak RSS MB | held-out loss r0 → rR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        if "rounds" not in run:
            lines.append(f"| {run['rate_mbps']:g} | {run['algorithm']} | failed: {run['error']} | | | | | |")
            continue
        later = run["rounds"][1:]
        effs = [r["overlap_efficiency"] for r in later if r["overlap_efficiency"] is not None]
        peaks = ", ".join(_f(p, 0) for p in run["worker_peak_rss_mb"])
        lines.append(
            f"| {run['rate_mbps']:g} | {run['algorithm']} | {run['total_wall_s']:.0f} | "
            f"{_f(_sum(later, 'round_wall_s'))} ({_f(_sum(later, 'modeled_round_s'))}) | "
            f"{_f(_mean(effs) if effs else None, 2)} | "
            f"{_mb(run['wire_bytes_up_per_client'])} / {_mb(run['wire_bytes_down_per_client'])} | {peaks} | "
            f"{_f(run['heldout_loss_initial'], 4)} → {_f(run['rounds'][-1]['heldout_loss'], 4)} |"
        )
    return "\n".join(lines)


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def plots(runs: list[dict], folder: Path) -> list[Path]:
    """Held-out loss against wall clock; per-round compute / communication / idle bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if "rounds" in r]
    if not done:
        return []
    rates = sorted({r["rate_mbps"] for r in done})
    algorithms = list(dict.fromkeys(r["algorithm"] for r in done))
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for run in (r for r in done if r["rate_mbps"] == rate):
            points = [(run["initial_elapsed_s"], run["heldout_loss_initial"])]
            points += [(r["elapsed_s"], r["heldout_loss"]) for r in run["rounds"]]
            ax.plot(*zip(*points), marker="o", label=run["algorithm"])
        ax.set(
            title=f"{rate:g} Mbit/s, {runs[0]['latency_ms']:g} ms one way",
            xlabel="wall clock since the strategy started, s (first point: before training)",
            ylabel="held-out loss",
        )
        ax.legend()
    loss_png = folder / "loss-vs-wall.png"
    fig.tight_layout()
    fig.savefig(loss_png, dpi=110)
    plt.close(fig)

    height = 3.2 * len(rates) + 0.5  # + a row for the legend
    fig, axes = plt.subplots(len(rates), len(algorithms), figsize=(4 * len(algorithms), height), squeeze=False)
    for row, rate in zip(axes, rates):
        for ax, algorithm in zip(row, algorithms):
            run = next((r for r in done if r["rate_mbps"] == rate and r["algorithm"] == algorithm), None)
            if run is None:
                ax.set_visible(False)
                continue
            xs = [r["round"] for r in run["rounds"]]
            for k, (key, label) in enumerate(
                (("compute_s", "compute"), ("comm_s", "communication"), ("idle_s", "idle"))
            ):
                ax.bar(
                    [x + (k - 1) * 0.27 for x in xs], [r[key] or 0.0 for r in run["rounds"]], width=0.27, label=label
                )
            ax.plot(xs, [r["round_wall_s"] for r in run["rounds"]], "k_", markersize=22, mew=2, label="round wall")
            ax.plot(
                xs,
                [r["modeled_round_s"] for r in run["rounds"]],
                "_",
                color="grey",
                markersize=22,
                mew=2,
                linestyle="none",
                label="modeled round",
            )
            ax.set(title=f"{algorithm}, {rate:g} Mbit/s", xlabel="round", ylabel="s", xticks=xs)
    fig.legend(
        *next(ax for ax in axes.flat if ax.get_visible()).get_legend_handles_labels(),
        loc="lower center",
        ncol=5,
        fontsize=8,
    )
    times_png = folder / "round-times.png"
    fig.tight_layout(rect=(0, 0.5 / height, 1, 1))
    fig.savefig(times_png, dpi=110)
    plt.close(fig)
    return [loss_png, times_png]


DOC_HEADING = "## Shaped links: every algorithm over rate-limited, delayed links"


def write_docs(report: str, pngs: list[Path]) -> None:
    """Replace (or append) this benchmark's section of docs/benchmarks.md; other sections stay as they are."""
    img = PROJECT_DIR / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    links = []
    for png in pngs:
        shutil.copy(png, img / f"network-{png.name}")
        links.append(f"![{png.stem}](img/network-{png.name})")
    replace_doc_section(DOC_HEADING, f"{report}\n\n" + "\n\n".join(links) + "\n")


def describe(results: dict) -> str:
    """The section's text: what ran, where, with which command, then the tables."""
    s, m = results["settings"], results["machine"]
    return (
        f"Command: `{results['command']}`  \nDate: {results['date']}  \n"
        f"Machine: {m['arch']}, {m['cpu']}, nproc {m['nproc']}, {m['memory_gib']} GiB, GPU: {m['gpu']}  \n"
        f"Model `{s['model_label']}`, {s['clients']} clients (each a SuperNode with a node worker, 1 torch "
        f"thread, in its own network namespace), {s['rounds']} rounds, {s['layers_per_block']} layers per block, "
        f"{s['local_steps']} local steps; links of {', '.join(f'{r:g}' for r in s['rates_mbps'])} Mbit/s each way "
        f"(`tc tbf` on both ends of a veth pair) with {s['latency_ms']:g} ms one way (user-space proxy). The "
        f"server's time model was given the same link (`modeled_*`). The default rate is the one at which the "
        f"link time of a round equals its compute (how it was chosen: the docstring of benchmarks/network.py; "
        f"`--probe` measures it on another machine).\n\n"
        "compute = mean over nodes of the worker's compute of the round's update; comm = the node's window "
        "from its previous reply leaving the worker to this round's message reaching it (includes Flower's "
        "polling, serialization and the server's aggregation and evaluation; none in round 1); idle = the "
        "part of that window in which the worker computed nothing; round wall = the server's round, from "
        "sending the messages to the end of its held-out evaluation; overlap eff. = round wall / "
        "max(compute, comm), 1.0 is "
        "perfect overlap; wire MB = bytes that crossed each node's veth during the whole run (all rounds and "
        "Flower's polls).\n\n" + results["tables"]
    )


# ------------------------------------------------------------------ command line
class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; one line is enough
        sys.exit(f"network.py: {message}")


def _positive(kind: type):
    """An argparse type: an int or float > 0."""
    expected = f"expected {'an integer' if kind is int else 'a number'} > 0"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {expected}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: {expected}")
        return value

    return parse


def _rates(text: str) -> list[float]:
    return [_positive(float)(part) for part in text.split(",")]


def algorithm_names() -> tuple[str, ...]:
    """What the project's config accepts now (imported late: it imports torch, ~4 s, not needed for --help)."""
    from parablock_flwr.config import ALGORITHMS

    return ALGORITHMS


def _algorithms(text: str) -> list[str]:
    names = list(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    for name in names or [text]:
        if name not in algorithm_names():
            raise argparse.ArgumentTypeError(f"{name!r}: expected a comma list of {', '.join(algorithm_names())}")
    return names


def _transfer_dtypes(text: str) -> list[str]:
    from parablock_flwr.config import TRANSFER_DTYPES

    names = list(dict.fromkeys(d.strip() for d in text.split(",") if d.strip()))
    for name in names or [text]:
        if name not in TRANSFER_DTYPES:
            raise argparse.ArgumentTypeError(f"{name!r}: expected a comma list of {', '.join(TRANSFER_DTYPES)}")
    return names


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number >= 0")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--rate",
        type=_positive(float),
        help=f"link rate each way, Mbit/s (default {DEFAULT_RATE_MBPS:g}; --fast {FAST_RATE_MBPS:g})",
    )
    p.add_argument("--rates", type=_rates, help="a sweep: comma list of link rates, Mbit/s (e.g. 10,25,100)")
    p.add_argument(
        "--latency-ms",
        type=_non_negative,
        help=f"one-way latency (default {DEFAULT_LATENCY_MS:g}; --fast {FAST_LATENCY_MS:g})",
    )
    p.add_argument("--clients", type=_positive(int), help="SuperNodes, each with a worker (default 2)")
    p.add_argument(
        "--model", help="embedded:<name>, HF id or folder (default: the embedded SmolLM2; --fast: a tiny Llama)"
    )
    p.add_argument("--layers-per-block", type=_positive(int), help="default 5 (--fast 2)")
    p.add_argument("--local-steps", type=_positive(int), help="default 3")
    p.add_argument("--rounds", type=_positive(int), help="default 3")
    p.add_argument(
        "--algorithms", type=_algorithms, help="comma list (default: every name in parablock_flwr.config.ALGORITHMS)"
    )
    p.add_argument("--out", type=Path, help="output folder (default runs/network-<date-time> in the project)")
    p.add_argument("--fast", action="store_true", help="tiny model, 2 clients, 3 rounds: a short smoke run")
    docs = p.add_mutually_exclusive_group()
    docs.add_argument("--docs", action="store_true", help="write the docs/benchmarks.md section even with --fast")
    docs.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md alone")
    p.add_argument(
        "--probe",
        action="store_true",
        help="run 1 round of the first algorithm and print the rate at which link time = compute",
    )
    p.add_argument(
        "--transfer-dtypes",
        type=_transfer_dtypes,
        help="a sweep of every rate x these dtypes (e.g. fp32,bf16,int8) over one set of processes: the window "
        "against the rate for each dtype, and the time model calibrated on two points, checked on the rest",
    )
    p.add_argument("--timeout-s", type=_positive(float), default=7200.0, help="limit for each `flwr run`")
    args = p.parse_args(argv)
    if args.rate is not None and args.rates is not None:
        p.error(f"--rate={args.rate:g} and --rates={','.join(f'{r:g}' for r in args.rates)}: expected only one")
    if args.clients is not None and args.clients > 250:
        p.error(f"--clients={args.clients}: expected at most 250 (one /30 subnet per node in 10.213.0.0/16)")
    _defaults(args)
    return args


def _defaults(args: argparse.Namespace) -> None:
    """Fill what was not given: the defaults, or --fast's."""
    fast = args.fast
    args.tiny = args.model is None and fast
    args.rates = args.rates or [args.rate or (FAST_RATE_MBPS if fast else DEFAULT_RATE_MBPS)]
    if args.latency_ms is None:
        args.latency_ms = FAST_LATENCY_MS if fast else DEFAULT_LATENCY_MS
    args.clients = args.clients or 2
    args.layers_per_block = args.layers_per_block or (2 if fast else 5)
    args.local_steps = args.local_steps or 3
    args.rounds = args.rounds or (1 if args.probe else 3)
    args.algorithms = args.algorithms or list(algorithm_names())
    if args.probe:
        args.algorithms = args.algorithms[:1]
    args.write_docs = not args.no_docs and not args.probe and (args.docs or not fast)
    args.out = (args.out or PROJECT_DIR / "runs" / f"network-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def probe_report(run: dict) -> str:
    """The rate at which the modeled link time of a round equals its measured compute."""
    r = run["rounds"][0]
    payload = r["bytes_up_per_client"] + r["bytes_down_per_client"]
    budget = r["compute_s"] - 2 * run["latency_ms"] / 1e3
    rate = 8 * payload / budget / 1e6 if budget > 0 else float("inf")
    return (
        f"probe: compute {r['compute_s']:.1f} s (client-reported {_f(r['modeled_compute_s'])} s), "
        f"{payload / 1e6:.1f} MB up+down per client, latency {run['latency_ms']:g} ms one way -> "
        f"link time = compute at {rate:.1f} Mbit/s each way"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_machine()
    stop_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    prefix = f"pbn-{os.getpid()}"
    command = "python -m benchmarks.network " + shlex.join(sys.argv[1:] if argv is None else argv)
    results = {
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "network_prefix": prefix,
        "runs": [],
    }
    with contextlib.ExitStack() as stack:
        model = args.model or "embedded:smollm2-135m-instruct"
        if args.tiny:
            from parablock_flwr.tools.tiny_model import build_tiny_model

            model = str(build_tiny_model(args.out / "tiny-model"))
        results["settings"] = {
            "model": model,
            **GSM_AS_MEASURED,
            "model_label": "tiny Llama (parablock_flwr.tools.tiny_model)" if args.tiny else model,
            "clients": args.clients,
            "rounds": args.rounds,
            "layers_per_block": args.layers_per_block,
            "local_steps": args.local_steps,
            "rates_mbps": args.rates,
            "latency_ms": args.latency_ms,
            "algorithms": args.algorithms,
            "torch_threads": 1,
        }
        net = build_network(stack, prefix, args.clients)
        if args.transfer_dtypes:
            return dtype_sweep_main(net, args, model, results)
        for rate in args.rates:
            shape(net, rate, args.latency_ms)
            for algorithm in args.algorithms:
                print(
                    f"[{time.strftime('%H:%M:%S')}] {algorithm} over {rate:g} Mbit/s, {args.latency_ms:g} ms ...",
                    flush=True,
                )
                run = run_one(net, algorithm, rate, args, model, args.out)
                results["runs"].append(run)
                print(
                    f"    {'ok' if 'rounds' in run else run['error']}: {run['total_wall_s']:.0f} s (start-up "
                    f"{run['startup_s']:.0f} s), then {run['stop_s']:.1f} s to stop",
                    flush=True,
                )
                _save(results, args.out)
    results["tables"] = tables(results["runs"])
    results["plots"] = [str(p) for p in plots(results["runs"], args.out)]
    _save(results, args.out)
    print(results["tables"])
    if args.probe and "rounds" in results["runs"][0]:
        print(probe_report(results["runs"][0]))
    if args.write_docs:
        write_docs(describe(results), [Path(p) for p in results["plots"]])
        print("wrote the section of docs/benchmarks.md and docs/img/network-*.png")
    print(f"results: {args.out / 'results.json'}")
    return 0 if all("rounds" in r for r in results["runs"]) else 1


def dtype_sweep_main(net: Network, args: argparse.Namespace, model: str, results: dict) -> int:
    """``--transfer-dtypes``: the sweep, then its tables, figure and docs section (benchmarks/dtype_sweep.py)."""
    from benchmarks import dtype_sweep

    results["runs"] = run_dtype_sweep(net, args, model, args.out)
    _save(results, args.out)
    return dtype_sweep.report(results, args.out, args.write_docs)


def _save(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as error:  # a setup command or a process failed; everything is already cleaned up
        sys.exit(f"network.py: {error}")
