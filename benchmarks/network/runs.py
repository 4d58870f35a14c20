"""The processes of one run over the shaped network, each in its namespace, and their clean-up."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import GSM_AS_MEASURED, PROJECT_DIR, read_records
from benchmarks.network.analysis import mean, round_row
from benchmarks.network.latency_proxy import moved_bytes
from benchmarks.network.netlab import (
    Network,
    descendants,
    in_netns,
    listens_in,
    peak_rss_mb,
    proxy_command,
    shape,
    started_in,
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

# Ports inside the namespaces: every namespace is fresh, so fixed ports are free.
SUPERLINK_PORT, SUPERLINK_HEALTH_PORT = 9093, 9094
PROXY_PORT, CLIENTAPPIO_PORT, SUPERNODE_HEALTH_PORT = 9092, 9095, 9096
# transport = "direct": the ServerApp serves the run's stream on this port of every interface in the link's
# namespace, and each node's namespace has a second latency proxy on 127.0.0.1 at the same port, to that node's
# link address. So the one address the offer names, 127.0.0.1:STREAM_PORT, reaches the stream from every node
# over its own shaped link, as the SuperNode reaches the SuperLink through its proxy.
STREAM_PORT = 9097
STREAM_ADDRESS = f"127.0.0.1:{STREAM_PORT}"

# The tiny model's run (as benchmarks/local_deployment.py --tiny): seconds per round.
TINY_CONFIG = {"num-examples": 64, "heldout-examples": 8, "max-seq-len": 128, "learning-rate": 3e-3}


def run_one(
    net: Network,
    algorithm: str,
    rate: float,
    args: argparse.Namespace,
    model: str,
    out: Path,
    transport: str = "flower",
) -> dict:
    """SuperLink, workers, proxies and SuperNodes in their namespaces, `flwr run`, then stop them all."""
    workdir = out / "runs" / f"{rate:g}mbps-{algorithm}{'' if transport == 'flower' else '-' + transport}"
    flwr_home = workdir / "flwr-home"
    flwr_home.mkdir(parents=True, exist_ok=True)
    write_connection(flwr_home, f"127.0.0.1:{SUPERLINK_PORT}")
    run_config = {**make_run_config(algorithm, rate, args, model, workdir / "out"), **transport_config(transport)}
    wire_before = [wire_bytes(node) for node in net.nodes]
    result: dict = {
        "algorithm": algorithm,
        "transport": transport,
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
                stream=transport == "direct",
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
    result["wire_bytes_up_per_client"] = mean([a[0] - b[0] for a, b in zip(wire_after, wire_before)])
    result["wire_bytes_down_per_client"] = mean([a[1] - b[1] for a, b in zip(wire_after, wire_before)])
    result.update(proxy_bytes(workdir, len(net.nodes)))
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
                        runs.append(sweep_point(net, algorithm, rate, dtype, args, model, workdir))
                        print(f"    {runs[-1].get('error', 'ok')}: {runs[-1]['total_wall_s']:.0f} s", flush=True)
                        save({"runs": runs}, out)
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


def sweep_point(net: Network, algorithm: str, rate: float, dtype: str, args, model: str, workdir: Path) -> dict:
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
    stream: bool = False,
) -> list[subprocess.Popen]:
    """Every process of one run, each in its namespace, each appended to ``pids``; returns the workers
    (their compute thread pinned to ``compute_cpus`` when given). With ``stream``, each node also gets the
    stream's proxy (``STREAM_PORT``): its worker dials the run's stream through it.

    A SuperNode starts only once its worker listens (its first message needs it)
    and its proxies accept connections.
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
        paths = [(PROXY_PORT, SUPERLINK_PORT, "proxy")] + (
            [(STREAM_PORT, STREAM_PORT, "stream-proxy")] if stream else []
        )
        for port, target_port, name in paths:
            cmd = proxy_command(f"127.0.0.1:{port}", f"{node.link_ip}:{target_port}", latency_ms)
            proxies.append((node.ns, port, start(node.ns, cmd, f"{name}-{node.index}.log"), f"{name}-{node.index}.log"))
    wait_for(lambda: listens_in(net.link_ns, SUPERLINK_PORT), superlink, workdir / "superlink.log")
    for node, worker in zip(net.nodes, workers):
        wait_for((sockets / f"w{node.index}.sock").exists, worker, workdir / f"worker-{node.index}.log")
    for ns, port, proxy, log in proxies:
        wait_for(lambda ns=ns, port=port: listens_in(ns, port), proxy, workdir / log)
    for node in net.nodes:
        start(
            node.ns,
            supernode_command(
                f"127.0.0.1:{PROXY_PORT}",
                CLIENTAPPIO_PORT,
                SUPERNODE_HEALTH_PORT,
                node_config(node.index, len(net.nodes), sockets / f"w{node.index}.sock"),
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
        "rounds": [round_row(rec, prev) for prev, rec in zip(records, records[1:])],
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


def transport_config(transport: str) -> dict:
    """The run config of ``transport``: on the stream, the address every node dials (its own proxy, see
    ``STREAM_PORT``), plaintext as the benchmark's SuperLink (`--insecure`)."""
    if transport == "flower":
        return {}
    return {"transport": transport, "transport-address": STREAM_ADDRESS, "transport-insecure": True}


def proxy_bytes(workdir: Path, num_nodes: int) -> dict:
    """The bytes each node's proxies moved (from their logs, once stopped), means per node: towards the
    SuperLink and back, and on the stream where it ran. A proxy that did not say is left out."""
    out = {}
    for name, key in (("proxy", "superlink_proxy"), ("stream-proxy", "stream_proxy")):
        found = []
        for i in range(num_nodes):
            log = workdir / f"{name}-{i}.log"
            if log.exists() and (moved := moved_bytes(log.read_text(errors="replace"))) is not None:
                found.append(moved)
        if found:
            out[f"{key}_bytes_up_per_client"] = mean([up for up, _ in found])
            out[f"{key}_bytes_down_per_client"] = mean([down for _, down in found])
    return out


def run_floor(net: Network, rate: float, args: argparse.Namespace, out: Path) -> dict:
    """Flower's control floor over the same links: benchmarks.flower_floor's app (no model, no payload) on
    the same processes as a run, its windows (rounds 2..R) from benchmarks.window's reading of them."""
    from benchmarks.window import floor_app, floor_points

    workdir = out / "runs" / f"{rate:g}mbps-floor"
    flwr_home = workdir / "flwr-home"
    flwr_home.mkdir(parents=True, exist_ok=True)
    write_connection(flwr_home, f"127.0.0.1:{SUPERLINK_PORT}")
    config = {"rounds": args.rounds, "payload-bytes": 0, "arrays": 1, "output-dir": str(workdir / "out"),
              "min-available-nodes": len(net.nodes)}  # fmt: skip
    result: dict = {"kind": "floor", "rate_mbps": rate, "latency_ms": args.latency_ms, "pids": [],
                    "workdir": str(workdir), "load_1min": os.getloadavg()[0]}  # fmt: skip
    began = time.perf_counter()
    with contextlib.ExitStack() as procs:
        try:
            start_processes(procs, net, args.latency_ms, workdir, flower_env_for(flwr_home), result["pids"])
            proc = flwr_run(workdir, config, floor_app(out / "floor-app"), args.timeout_s,
                            prefix=in_netns(net.link_ns))  # fmt: skip
            (workdir / "flwr-run.log").write_text(proc.stdout + proc.stderr + "\n")
        finally:
            terminate(result["pids"])
    result["killed_pids"] = kill_survivors(result["pids"])
    result["total_wall_s"] = time.perf_counter() - began
    points = floor_points(workdir / "out")
    if points is None:
        result["error"] = f"the Flower-only app wrote no floor.json; see {workdir}/flwr-run.log"
    else:
        result["points"] = points
    return result


def save(results: dict, out: Path) -> None:
    """results.json in ``out``, rewritten after every run (a stopped sweep keeps what it measured)."""
    (out / "results.json").write_text(json.dumps(results, indent=1))
