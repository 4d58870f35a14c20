"""A run's records as rows (measured beside modeled) and the tables of docs/results/network.md."""

from __future__ import annotations

# Flower's legs of a round's critical path, as the records name them (round_stats.CRITICAL_PATH_LEGS).
FLOWER_LEGS = ("aggregate", "dispatch", "delivery", "clientapp_relay", "reply_relay", "reply_to_server")
DIRECT_COUNTS = ("direct_fallbacks", "direct_refusals", "direct_updates_ahead", "direct_steps_prefetched")


def round_row(rec: dict, prev: dict | None = None) -> dict:
    """One round as measured (node workers' timeline, server's round wall) and as modeled.

    Communication is the node's window from its previous reply leaving the
    worker to this round's message reaching it (so none in round 1); idle is
    the part of that window the node's worker did not compute; overlap
    efficiency = round wall / max(compute, communication), 1.0 = perfect overlap.
    ``window_s`` (with ``prev``, the round before) runs from the worker's computation of round r-1 ending
    to that of round r starting, as benchmarks.window's: on the stream the upload and the download are
    in it, which ``comm_s`` leaves out; for sequential BCD it is the whole exchange.
    """
    compute = rec.get("measured_compute_s", rec.get("compute_s_mean"))
    comm = rec.get("measured_comm_s")
    wall = rec.get("round_wall_s")
    # Idle: the part of each node's window with no compute running (all of it for sequential BCD).
    windows = [t for t in rec.get("timeline", []) if "comm_s" in t]
    idle = mean([t["comm_s"] * (1 - t["overlap_share"]) for t in windows]) if windows else None
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
        "window_s": compute_gap(prev, rec),
        **worker_legs(prev, rec),
        **{leg: rec.get(f"critical_path_{leg}_s") for leg in FLOWER_LEGS},
        **{key: rec[key] for key in DIRECT_COUNTS if key in rec},
    }


def compute_gap(prev: dict | None, rec: dict) -> float | None:
    """Mean over nodes of round r's computation start less round r-1's end (the node's worker both times);
    None without both rounds' timelines."""
    ended = {t["node"]: t["compute_end"] for t in (prev or {}).get("timeline", []) if "compute_end" in t}
    gaps = [t["compute_start"] - ended[t["node"]] for t in rec.get("timeline", []) if t.get("node") in ended]
    return mean(gaps) if gaps else None


def worker_legs(prev: dict | None, rec: dict) -> dict:
    """The worker's own legs of the window, means over nodes: ``upload`` (round r-1's computation ending to
    its reply leaving the worker: packing, on the stream the upload) and ``fetch`` (round r's message
    reaching it to the computation starting: on the stream the download), as benchmarks.window's."""
    ended = {t["node"]: t["compute_end"] for t in (prev or {}).get("timeline", []) if "compute_end" in t}
    uploads = [t["prev_reply_sent"] - ended[t["node"]] for t in rec.get("timeline", []) if t.get("node") in ended]
    fetches = [t["compute_start"] - t["request_received"] for t in rec.get("timeline", []) if prev is not None]
    return {"upload": mean(uploads) if uploads else None, "fetch": mean(fetches) if fetches else None}


def label(run: dict) -> str:
    """A run's name in tables and figures: its algorithm, and its transport when not Flower's."""
    transport = run.get("transport", "flower")
    return run["algorithm"] if transport == "flower" else f"{run['algorithm']} ({transport})"


def mean(values: list[float]) -> float:
    """The mean, 0 for none."""
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
                f"| {run['rate_mbps']:g} | {label(run)} | {r['round']} | {_f(r['compute_s'])} | "
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
            lines.append(f"| {run['rate_mbps']:g} | {label(run)} | failed: {run['error']} | | | | | |")
            continue
        later = run["rounds"][1:]
        effs = [r["overlap_efficiency"] for r in later if r["overlap_efficiency"] is not None]
        peaks = ", ".join(_f(p, 0) for p in run["worker_peak_rss_mb"])
        lines.append(
            f"| {run['rate_mbps']:g} | {label(run)} | {run['total_wall_s']:.0f} | "
            f"{_f(_sum(later, 'round_wall_s'))} ({_f(_sum(later, 'modeled_round_s'))}) | "
            f"{_f(mean(effs) if effs else None, 2)} | "
            f"{_mb(run['wire_bytes_up_per_client'])} / {_mb(run['wire_bytes_down_per_client'])} | {peaks} | "
            f"{_f(run['heldout_loss_initial'], 4)} → {_f(run['rounds'][-1]['heldout_loss'], 4)} |"
        )
    return "\n".join(lines)


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


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
