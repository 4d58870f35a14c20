"""Measures every algorithm over shaped links: round times, overlap, wire bytes and the time model's error.

Network namespaces, veth pairs, `tc tbf` and a latency proxy on this one machine.

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
Ctrl-C, SIGTERM or an error. Needs root (`ip netns`). The parts: ``cli`` (arguments), ``netlab``
(namespaces, links, shaping, proxy, clean-up), ``runs`` (the processes of a run), ``analysis``
(rows and tables), ``plots``, ``report`` (docs/results/network.md) and ``dtypes`` (``--transfer-dtypes``:
the window against the rate per transfer dtype, and the time model calibrated on it).

    .venv/bin/python -m benchmarks.network                       # SmolLM2, 2 clients, 3 rounds, every algorithm
    .venv/bin/python -m benchmarks.network --rates 10,25,100     # a sweep of link rates
    .venv/bin/python -m benchmarks.network --fast                # tiny model, a short smoke run (no docs)
    .venv/bin/python -m benchmarks.network --probe               # 1 round: the rate at which link time = compute
    .venv/bin/python -m benchmarks.network --clients 1 --separate-cores --rates 1000,200 --latency-ms 30 \
        --algorithms parablock,fedbcd --transports flower,direct --floor   # issue 32's targets: network-direct.md

With ``--transports flower,direct`` each algorithm runs on both transports, side by side: on ``direct``
the ServerApp serves the run's stream on port 9097 of the link's namespace, and each node's namespace
has a second latency proxy at 127.0.0.1:9097 to its link's far end, the address the run config (and so
the offer in Flower's messages) names; plaintext like the SuperLink (``--insecure``). Every proxy
counts the bytes it moved. ``targets`` compares the windows with the link's own time plus Flower's
control floor (``--floor``) and ParaBlock's rounds with sequential BCD's.

Writes into --out: results.json, loss-vs-wall.png, round-times.png, the run
folders and every process's log; without --fast (or with --docs) also
docs/results/network.md (docs/results/network-dtypes.md for --transfer-dtypes) with the plots under
docs/img/.

How the default link rate was chosen (compute ~ communication): a round of the
default job moves one 5-layer block of SmolLM2 each way per client,
5 x 3.54 M params x 4 B = 70.8 MB up and 70.8 MB down, and the server's time
model charges it 2 x latency + 8 x (up + down) / rate. The link time equals a
round's compute C at rate = 8 x 141.6 MB / (C - 2 x latency). On this 2-core
machine (2 workers, 1 torch thread each, 3 local steps, batch 4 x 192 tokens):
the local deployment's round 1 (docs/results/local_deployment.md) gives C of
about 28 s, i.e. about 40 Mbit/s. The default, 40 Mbit/s with 50 ms one way, is
that figure (the benchmark is meant to run on a quiet machine). On another machine run
`--probe` first and pass the rate it prints with --rate. The same
calculation, with the tiny model's ~0.55 s of compute and 0.59 MB each round,
sets the --fast rate (8 Mbit/s, 20 ms); there Flower's fixed costs (3 s polls,
process start-up) dominate the communication window anyway.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from benchmarks.common import GSM_AS_MEASURED, command, commit, machine
from benchmarks.network import dtypes
from benchmarks.network.analysis import probe_report, tables
from benchmarks.network.cli import parse_args
from benchmarks.network.netlab import build_network, check_machine, shape, stop_on_sigterm
from benchmarks.network.plots import plots
from benchmarks.network.report import write_direct_docs, write_docs
from benchmarks.network.runs import run_dtype_sweep, run_floor, run_one, save
from benchmarks.network.targets import report as targets_report

__all__ = ["main", "run_one"]


def main(argv: list[str] | None = None) -> int:
    """Parse, build the network, run every rate x algorithm (or the dtype sweep), then report."""
    args = parse_args(argv)
    if args.report:
        return finish(json.loads(args.report.read_text()), args)
    check_machine()
    stop_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    prefix = f"pbn-{os.getpid()}"
    results = {
        "command": command("network") if argv is None else f"python -m benchmarks.network {' '.join(argv)}".strip(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "machine": machine(),
        "network_prefix": prefix,
        "runs": [],
        "floors": [],
    }
    if args.separate_cores:  # every process started from here on: CPU 0 (the workers' compute threads: CPU 1)
        os.sched_setaffinity(0, {0})
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
            "transports": args.transports,
            "separate_cores": args.separate_cores,
            "torch_threads": 1,
        }
        net = build_network(stack, prefix, args.clients)
        if args.transfer_dtypes:
            return dtype_sweep_main(net, args, model, results)
        for rate in args.rates:
            shape(net, rate, args.latency_ms)
            if args.floor:
                print(f"[{time.strftime('%H:%M:%S')}] control floor over {rate:g} Mbit/s ...", flush=True)
                results["floors"].append(run_floor(net, rate, args, args.out))
                floor = results["floors"][-1]
                print(f"    {floor.get('error') or [round(p['window_s'], 2) for p in floor['points']]}", flush=True)
            for algorithm in args.algorithms:
                for transport in args.transports:
                    print(
                        f"[{time.strftime('%H:%M:%S')}] {algorithm} ({transport}) over {rate:g} Mbit/s, "
                        f"{args.latency_ms:g} ms ...",
                        flush=True,
                    )
                    run = run_one(net, algorithm, rate, args, model, args.out, transport)
                    results["runs"].append(run)
                    print(
                        f"    {'ok' if 'rounds' in run else run['error']}: {run['total_wall_s']:.0f} s (start-up "
                        f"{run['startup_s']:.0f} s), then {run['stop_s']:.1f} s to stop",
                        flush=True,
                    )
                    save(results, args.out)
    return finish(results, args)


def finish(results: dict, args) -> int:
    """Tables, plots and (unless told not to) docs of the runs in ``results``; also for ``--report``."""
    results["tables"] = tables(results["runs"])
    results["plots"] = [str(p) for p in plots(results["runs"], args.out)]
    direct = "direct" in results.get("settings", {}).get("transports", [])
    if direct or results.get("floors"):
        results["targets"] = targets_report(results["runs"], results.get("floors", []))
    save(results, args.out)
    print(results["tables"])
    print(results.get("targets", ""))
    if args.probe and results["runs"] and "rounds" in results["runs"][0]:
        print(probe_report(results["runs"][0]))
    if args.write_docs and direct:
        print(f"wrote {write_direct_docs(results, [Path(p) for p in results['plots']])}")
    elif args.write_docs:
        write_docs(results, [Path(p) for p in results["plots"]])
        print("wrote docs/results/network.md and docs/img/network-*.png")
    print(f"results: {args.out / 'results.json'}")
    runs_ok = all("rounds" in r for r in results["runs"]) and all("points" in f for f in results.get("floors", []))
    return 0 if runs_ok else 1


def dtype_sweep_main(net, args, model: str, results: dict) -> int:
    """``--transfer-dtypes``: the sweep, then its tables, figure and results file (``dtypes``)."""
    results["runs"] = run_dtype_sweep(net, args, model, args.out)
    save(results, args.out)
    return dtypes.report(results, args.out, args.write_docs)
