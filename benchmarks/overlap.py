"""Measures ParaBlock's round time against sequential BCD's with compute on a core of its own, over a
shaped link: the ratio, overlap efficiency, the time model's error and each round's critical path.

On a 2-core machine two CPU-bound jobs cannot overlap, so this benchmark gives each its
own core, as a node with an accelerator has: the node worker's compute thread is pinned
to CPU 1 (``--compute-cpus``), and every other process (SuperLink, SuperNode, ClientApps,
the ServerApp, the latency proxy, the worker's I/O threads) stays on CPU 0. One node, over
a shaped link (benchmarks/network/netlab.py: network namespaces, veth, ``tc tbf``, a user-space
latency proxy).

1. Probe: sequential BCD over a fast link (1000 Mbit/s) measures a round's compute C
   (alone), the payload each way, and the fixed cost F of one exchange (the communication
   window minus the link's own time). The rate at which the communication window equals
   compute is then  rate* = 8 (up + down) / (C - F - 2 latency).
2. Sweep: ParaBlock and sequential BCD at rate* x (1/8, 1/2, 1, 2, 4), from communication-bound
   to compute-bound. The server's time model is given F (``message-overhead-s``), so its
   ``modeled_round_s`` is compared with the measured round time at every point.
3. Beside it, labelled as such: 2 nodes sharing both cores, at rate*, no pinning.

The server evaluates only before training and after the last round (``eval-every`` = rounds,
no generation): its evaluation is off the critical path anyway, but on this machine it would
share CPU 0 with Flower's processes.

    .venv/bin/python -m benchmarks.overlap                 # SmolLM2: probe, sweep, shared-core run (~25 min)
    .venv/bin/python -m benchmarks.overlap --rates 40,80   # skip the probe (message-overhead-s from --overhead-s)
    .venv/bin/python -m benchmarks.overlap --fast          # tiny model, a smoke run (no docs)

Writes into --out: overlap.json and the PNGs; without --fast also docs/results/overlap.json (the
summary) and docs/results/overlap.md with the PNGs under docs/img/.

Reading the page: ParaBlock hides the smaller of compute C and the window W, so its round is at best
max(C, W) where sequential BCD's is C + W: half of it at rate*, where the two are equal, and less of a saving
toward either end of the rate range. The overlap needs compute and Flower's processes on cores of their own;
where they share the cores (the page's 2-node run, ``benchmarks.local_deployment``) the saving is smaller.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common import GSM_AS_MEASURED, PROJECT_DIR, RESULTS_DIR, command, read_records, write_report
from benchmarks.network import run_one
from benchmarks.network.cli import rates as rate_list
from benchmarks.network.netlab import build_network, check_machine, shape, stop_on_sigterm

PROBE_RATE_MBPS = 1000.0
SWEEP_FACTORS = (0.125, 0.5, 1.0, 2.0, 4.0)
LEGS = ("aggregate", "dispatch", "delivery", "clientapp_relay", "reply_relay", "reply_to_server", "wait_for_others")
TITLE = "Overlap on separated cores: where ParaBlock's saving comes from"


def run(net, algorithm: str, rate: float, args, model: str, out: Path, compute_cpus: str, extra: dict) -> dict:
    """One run of benchmarks.network's harness, with this benchmark's pinning and run config."""
    args.compute_cpus, args.extra_config = compute_cpus, extra
    print(f"[{time.strftime('%H:%M:%S')}] {algorithm}, {rate:g} Mbit/s, {len(net.nodes)} node(s) ...", flush=True)
    result = run_one(net, algorithm, rate, args, model, out)
    result["records"] = read_records(Path(result["run_dir"])) if "run_dir" in result else []
    print(f"    {'ok' if 'rounds' in result else result['error']}: {result['total_wall_s']:.0f} s", flush=True)
    return result


def later(result: dict) -> list[dict]:
    """Rounds 2..R (round 1 has nothing to overlap with)."""
    return [r for r in result["records"] if r["round"] >= 2]


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def probe(result: dict, latency_ms: float) -> dict:
    """Compute C, payload, the fixed cost F of an exchange, and rate* (window = compute)."""
    rounds = [r for r in result["records"] if r["round"] >= 1]
    compute = mean([r.get("measured_compute_s") for r in rounds])
    window = mean([r.get("measured_comm_s") for r in later(result)])
    up, down = mean([r["wire_bytes_up"] for r in rounds]), mean([r["wire_bytes_down"] for r in later(result)])
    link_s = 8 * (up + down) / (PROBE_RATE_MBPS * 1e6) + 2 * latency_ms / 1e3
    overhead = max(0.0, window - link_s)
    budget = compute - overhead - 2 * latency_ms / 1e3
    rate = 8 * (up + down) / budget / 1e6 if budget > 0 else None
    return {"compute_s": compute, "window_s": window, "payload_up_bytes": up, "payload_down_bytes": down,
            "message_overhead_s": overhead, "rate_mbps": rate}  # fmt: skip


def summary(result: dict) -> dict:
    """One run's figures for the tables and the machine-readable file."""
    rows = later(result)
    wall = sum(r["round_wall_s"] for r in rows) if rows else None
    modeled = sum(r["modeled_round_s"] for r in rows) if rows else None
    compute = mean([r.get("measured_compute_s") for r in rows])
    window = mean([r.get("measured_comm_s") for r in rows])
    errors = [abs(r["modeled_round_s"] - r["round_wall_s"]) / r["round_wall_s"] for r in rows if r["round_wall_s"]]
    last = result["records"][-1] if result["records"] else {}
    return {
        "algorithm": result["algorithm"],
        "rate_mbps": result["rate_mbps"],
        "nodes": len(result.get("worker_peak_rss_mb", [])),
        "ok": "rounds" in result,
        "rounds_2_to_R_wall_s": wall,
        "rounds_2_to_R_modeled_s": modeled,
        "max_modeled_error": max(errors) if errors else None,
        "compute_s": compute,
        "window_s": window,
        "overlap_efficiency": wall / len(rows) / max(compute, window) if rows and compute and window else None,
        "heldout_loss_initial": result["records"][0].get("heldout_loss") if result["records"] else None,
        "heldout_loss_final": last.get("heldout_loss"),
        "wire_bytes_up_per_round": mean([r["wire_bytes_up"] for r in rows]),
        "wire_bytes_down_per_round": mean([r["wire_bytes_down"] for r in rows]),
        "veth_bytes_up_per_client": result.get("wire_bytes_up_per_client"),
        "veth_bytes_down_per_client": result.get("wire_bytes_down_per_client"),
        "critical_path_s": {leg: mean([r.get(f"critical_path_{leg}_s") for r in rows]) for leg in LEGS},
        "server_critical_path_s": mean([r.get("server_critical_path_s") for r in rows]),
        "worker_peak_rss_mb": result.get("worker_peak_rss_mb"),
        "run_dir": result.get("run_dir"),
    }


def ratios(summaries: list[dict]) -> list[dict]:
    """ParaBlock over sequential BCD at each rate (rounds 2..R), measured and modeled."""
    out = []
    for rate in sorted({s["rate_mbps"] for s in summaries}):
        pair = {s["algorithm"]: s for s in summaries if s["rate_mbps"] == rate}
        pb, bcd = pair.get("parablock"), pair.get("fedbcd")
        if not (pb and bcd and pb["rounds_2_to_R_wall_s"] and bcd["rounds_2_to_R_wall_s"]):
            continue
        out.append({
            "rate_mbps": rate,
            "measured_ratio": pb["rounds_2_to_R_wall_s"] / bcd["rounds_2_to_R_wall_s"],
            "modeled_ratio": pb["rounds_2_to_R_modeled_s"] / bcd["rounds_2_to_R_modeled_s"],
            "final_loss_gap": abs(pb["heldout_loss_final"] - bcd["heldout_loss_final"]) / bcd["heldout_loss_final"]
            if pb["heldout_loss_final"] and bcd["heldout_loss_final"] else None,
        })  # fmt: skip
    return out


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def tables(results: dict) -> str:
    p = results["probe"]
    lines = [
        f"Probe (sequential BCD, {PROBE_RATE_MBPS:g} Mbit/s): compute C = {_f(p['compute_s'])} s, communication "
        f"window {_f(p['window_s'])} s, payload {_f(p['payload_up_bytes'] / 1e6)} MB up / "
        f"{_f(p['payload_down_bytes'] / 1e6)} MB down per round, fixed cost of an exchange F = "
        f"{_f(p['message_overhead_s'], 2)} s -> window = compute at rate* = {_f(p['rate_mbps'])} Mbit/s.",
        "",
        "| nodes, cores | rate Mbit/s | algorithm | rounds 2..R wall s (modeled) | max model error | compute s | "
        "window s | overlap eff. | held-out loss r0 → rR |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results["summaries"]:
        cores = "1, compute on its own core" if s["nodes"] == 1 else f"{s['nodes']}, shared cores"
        if not s["ok"]:
            lines.append(f"| {cores} | {s['rate_mbps']:g} | {s['algorithm']} | failed | | | | | |")
            continue
        err = None if s["max_modeled_error"] is None else 100 * s["max_modeled_error"]
        lines.append(
            f"| {cores} | {s['rate_mbps']:g} | {s['algorithm']} | {_f(s['rounds_2_to_R_wall_s'])} "
            f"({_f(s['rounds_2_to_R_modeled_s'])}) | {_f(err, 0)}% | {_f(s['compute_s'])} | {_f(s['window_s'])} | "
            f"{_f(s['overlap_efficiency'], 2)} | "
            f"{_f(s['heldout_loss_initial'], 4)} → {_f(s['heldout_loss_final'], 4)} |"
        )
    lines += [
        "",
        "| rate Mbit/s | ParaBlock / BCD, rounds 2..R: measured | modeled | final loss gap |",
        "|---|---|---|---|",
    ]
    for r in results["ratios"]:
        gap = None if r["final_loss_gap"] is None else 100 * r["final_loss_gap"]
        lines.append(f"| {r['rate_mbps']:g} | {r['measured_ratio']:.2f} | {r['modeled_ratio']:.2f} | {_f(gap, 2)}% |")
    for r in results.get("shared_ratios", []):
        gap = None if r["final_loss_gap"] is None else 100 * r["final_loss_gap"]
        lines.append(
            f"| {r['rate_mbps']:g}, 2 nodes sharing both cores | {r['measured_ratio']:.2f} | "
            f"{r['modeled_ratio']:.2f} | {_f(gap, 2)}% |"
        )
    lines += ["", "Critical path, mean over rounds 2..R, s (one node, compute on its own core):", "",
              "| rate Mbit/s | algorithm | " + " | ".join(LEGS) + " |", "|---|---|" + "---|" * len(LEGS)]  # fmt: skip
    for s in results["summaries"]:
        if s["nodes"] == 1 and s["ok"]:
            legs = " | ".join(_f(s["critical_path_s"][leg], 2) for leg in LEGS)
            lines.append(f"| {s['rate_mbps']:g} | {s['algorithm']} | {legs} |")
    return "\n".join(lines)


def plots(results: dict, folder: Path) -> list[Path]:
    """The ratio against the rate (measured, modeled, ideal), and the critical path's legs as stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pngs = []
    if results["ratios"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        rates = [r["rate_mbps"] for r in results["ratios"]]
        ax.plot(rates, [r["measured_ratio"] for r in results["ratios"]], "o-", label="measured")
        ax.plot(rates, [r["modeled_ratio"] for r in results["ratios"]], "s--", label="modeled")
        ax.axhline(0.5, color="grey", lw=0.8, label="ideal at window = compute")
        if results["probe"]["rate_mbps"]:
            ax.axvline(results["probe"]["rate_mbps"], color="grey", ls=":", label="rate*: window = compute")
        ax.set(xscale="log", xlabel="link rate, Mbit/s each way", ylabel="ParaBlock / BCD wall, rounds 2..R",
               title="Compute on its own core, 1 node", ylim=(0, 1.1))  # fmt: skip
        ax.legend(fontsize=8)
        fig.tight_layout()
        pngs.append(folder / "overlap-ratio.png")
        fig.savefig(pngs[-1], dpi=110)
        plt.close(fig)
    pinned = [s for s in results["summaries"] if s["nodes"] == 1 and s["ok"]]
    if pinned:
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(pinned)), 4))
        for i, s in enumerate(pinned):
            bottom = 0.0
            for k, leg in enumerate(LEGS):
                value = s["critical_path_s"][leg] or 0.0
                ax.bar(i, value, bottom=bottom, color=f"C{k}", label=leg if i == 0 else None)
                bottom += value
            ax.plot([i - 0.4, i + 0.4], [s["compute_s"] or 0] * 2, "k-", lw=2, label="compute" if i == 0 else None)
        ax.set_xticks(range(len(pinned)), [f"{s['algorithm']}\n{s['rate_mbps']:g} Mbit/s" for s in pinned], fontsize=7)
        ax.set(ylabel="s, mean over rounds 2..R", title="Critical path between a reply and the next message")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        pngs.append(folder / "overlap-critical-path.png")
        fig.savefig(pngs[-1], dpi=110)
        plt.close(fig)
    return pngs


def write_docs(results: dict, pngs: list[Path]) -> None:
    """docs/results/overlap.json (the summary), the PNGs under docs/img/ and docs/results/overlap.md."""
    img = PROJECT_DIR / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    for png in pngs:
        shutil.copy(png, img / png.name)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "overlap.json").write_text(
        json.dumps({k: results[k] for k in ("command", "date", "settings", "probe", "ratios", "summaries")}, indent=1)
    )
    s = results["settings"]
    text = (
        f"Model `{s['model']}`, {s['rounds']} rounds, {s['layers_per_block']} layers per block, {s['local_steps']} "
        f"local steps, 1 torch thread, latency {s['latency_ms']:g} ms one way; evaluation only at rounds 0 and R. "
        "Pinned runs: the worker's compute thread on CPU 1, every other process on CPU 0. Round wall = the "
        "server's time between aggregating round r-1 and round r. Window = from the worker's reply leaving it "
        "to the next message reaching it. Overlap efficiency = round wall / max(compute, window). Modeled = the "
        "server's time model (`modeled_round_s`: measured compute, the link, F). "
        "Summary: docs/results/overlap.json.\n\n"
        + results["tables"]
        + "\n\n"
        + "\n\n".join(f"![{p.stem}](../img/{p.name})" for p in pngs)
        + "\n"
    )
    write_report("overlap", TITLE, text, how=results["command"])


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.overlap", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rates", type=rate_list, help="skip the probe: these rates, Mbit/s")
    p.add_argument("--overhead-s", type=float, default=0.0, help="with --rates: message-overhead-s for the model")
    p.add_argument("--latency-ms", type=float, default=20.0, help="one-way latency (default 20)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers-per-block", type=int)
    p.add_argument("--local-steps", type=int, default=3)
    p.add_argument("--no-shared", action="store_true", help="skip the 2-node shared-core run")
    p.add_argument("--fast", action="store_true", help="tiny model: a smoke run (no docs)")
    p.add_argument("--out", type=Path)
    p.add_argument("--timeout-s", type=float, default=3600.0)
    args = p.parse_args(argv)
    args.tiny = args.fast
    args.layers_per_block = args.layers_per_block or (2 if args.fast else 5)
    args.out = (args.out or PROJECT_DIR / "runs" / f"overlap-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        sys.exit("overlap.py: expected at least 2 CPUs (one for compute, one for everything else)")
    check_machine()
    stop_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    all_cpus = os.sched_getaffinity(0)
    how = command("overlap") if argv is None else f"python -m benchmarks.overlap {' '.join(argv)}".strip()
    results: dict = {"command": how, "date": time.strftime("%Y-%m-%d"), "summaries": [], "runs": []}
    model = "embedded:smollm2-135m-instruct"
    if args.tiny:
        from parablock_flwr.tools.tiny_model import build_tiny_model

        model = str(build_tiny_model(args.out / "tiny-model"))
    results["settings"] = {"model": model, "rounds": args.rounds, "layers_per_block": args.layers_per_block,
                           "local_steps": args.local_steps, "latency_ms": args.latency_ms}  # fmt: skip
    extra = {**GSM_AS_MEASURED, "eval-every": args.rounds, "generate-examples": 0}

    def record(result: dict) -> None:
        results["runs"].append({k: v for k, v in result.items() if k != "records"})
        results["summaries"].append(summary(result))
        (args.out / "overlap.json").write_text(json.dumps(results, indent=1))

    with contextlib.ExitStack() as stack:
        os.sched_setaffinity(0, {min(all_cpus)})  # every process started from here on: CPU 0
        pinned = build_network(stack, f"pbo-{os.getpid()}", 1)
        args.clients = 1
        if args.rates:
            rates, overhead = args.rates, args.overhead_s
            results["probe"] = {"rate_mbps": None, "message_overhead_s": overhead, "compute_s": None,
                                "window_s": None, "payload_up_bytes": 0, "payload_down_bytes": 0}  # fmt: skip
        else:
            shape(pinned, PROBE_RATE_MBPS, args.latency_ms)
            probed = run(pinned, "fedbcd", PROBE_RATE_MBPS, args, model, args.out / "probe", "1", extra)
            results["probe"] = probe(probed, args.latency_ms)
            overhead = results["probe"]["message_overhead_s"]
            star = results["probe"]["rate_mbps"] or PROBE_RATE_MBPS / 8
            rates = [round(star * f, 1) for f in SWEEP_FACTORS]
            print(f"probe: {results['probe']}", flush=True)
        extra = {**extra, "message-overhead-s": round(overhead, 3)}
        for rate in rates:
            shape(pinned, rate, args.latency_ms)
            for algorithm in ("parablock", "fedbcd"):
                record(run(pinned, algorithm, rate, args, model, args.out / "pinned", "1", extra))
        if not args.no_shared:
            os.sched_setaffinity(0, all_cpus)  # both cores for every process
            shared = build_network(stack, f"pbs-{os.getpid()}", 2)
            args.clients = 2
            rate = results["probe"]["rate_mbps"] or rates[len(rates) // 2]
            shape(shared, rate, args.latency_ms)
            for algorithm in ("parablock", "fedbcd"):
                record(run(shared, algorithm, rate, args, model, args.out / "shared", "", extra))
    results["ratios"] = ratios([s for s in results["summaries"] if s["nodes"] == 1])
    results["shared_ratios"] = ratios([s for s in results["summaries"] if s["nodes"] == 2])
    results["tables"] = tables(results)
    pngs = plots(results, args.out)
    (args.out / "overlap.json").write_text(json.dumps(results, indent=1))
    print(results["tables"])
    if not args.fast:
        write_docs(results, pngs)
        print("wrote docs/results/overlap.json, docs/img/overlap-*.png and docs/results/overlap.md")
    return 0 if all(s["ok"] for s in results["summaries"]) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as error:
        sys.exit(f"overlap.py: {error}")
