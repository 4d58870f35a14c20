"""``--transports``: issue 32's targets for a shaped link, the transports side by side.

Two targets, per rate and transport, from the runs of one invocation (same links, same model, same seed):

- **The window**: sequential BCD's window (``fedbcd``: the worker's computation of round r-1 ending to that
  of round r starting, rounds 2..R) against the link's own time up and down (``core.LinkModel``: the
  bytes of round r-1's reply and round r's message at the rate, and the latency each way) plus Flower's
  control floor over the same link (``--floor``: the Flower-only app with an empty payload). Met when
  the window is at most ``WINDOW_TOLERANCE`` above that sum.
- **The overlap**: ParaBlock's round time over sequential BCD's (means of rounds 2..R) against the ideal
  max(C, W) / (C + W), with C and W sequential BCD's compute and window. Met when the measured ratio is
  at most ``OVERLAP_TOLERANCE`` above the ideal.

``report`` also says where the window goes: sequential BCD's legs, the worker's and Flower's.
"""

from __future__ import annotations

from benchmarks.network.analysis import _f, mean
from parablock_flwr import core

WINDOW_TOLERANCE = 0.10  # issue 32: the window within 10 % of the link's own time plus the control floor
OVERLAP_TOLERANCE = 0.05  # issue 32: ParaBlock / BCD within 5 % of the ideal max(C, W) / (C + W)
SEQUENTIAL, OVERLAPPED = "fedbcd", "parablock"
LEGS = ("upload", "reply_relay", "reply_to_server", "aggregate", "dispatch", "delivery", "clientapp_relay", "fetch")


def later(run: dict | None) -> list[dict]:
    """Rounds 2..R of a finished run (round 1 has no window); none for a failed or missing run."""
    return (run or {}).get("rounds", [])[1:]


def avg(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return mean(values) if values else None


def link_seconds(run: dict) -> float | None:
    """The link's own time of a window, mean over rounds 2..R: round r-1's reply up and round r's message
    down (g^{r-1}, which round r-1's record counts) at the run's rate, and its latency each way."""
    rounds = run.get("rounds", [])
    link = core.LinkModel(run["rate_mbps"], run["rate_mbps"], run["latency_ms"])
    keys = ("bytes_up_per_client", "bytes_down_per_client")
    times = [link.comm_seconds(*(prev[k] for k in keys)) for prev in rounds[:-1]
             if all(prev.get(k) is not None for k in keys)]  # fmt: skip
    return mean(times) if times else None


def find(runs: list[dict], rate: float, algorithm: str, transport: str) -> dict | None:
    return next((r for r in runs if r["rate_mbps"] == rate and r["algorithm"] == algorithm
                 and r.get("transport", "flower") == transport), None)  # fmt: skip


def targets(runs: list[dict], floors: list[dict]) -> list[dict]:
    """One row per rate and transport: both targets, what they were measured against, and met or not."""
    rows = []
    for rate in dict.fromkeys(r["rate_mbps"] for r in runs):
        floor_run = next((f for f in floors if f["rate_mbps"] == rate and f.get("points")), None)
        floor = mean([p["window_s"] for p in floor_run["points"]]) if floor_run else None
        for transport in dict.fromkeys(r.get("transport", "flower") for r in runs if r["rate_mbps"] == rate):
            seq, par = find(runs, rate, SEQUENTIAL, transport), find(runs, rate, OVERLAPPED, transport)
            row = {"rate_mbps": rate, "transport": transport, "floor_s": floor}
            if later(seq):
                row.update(window_target(seq, floor))
            if later(seq) and later(par):
                row.update(overlap_target(seq, par))
            rows.append(row)
    return rows


def window_target(seq: dict, floor: float | None) -> dict:
    """Sequential BCD's window against the link's own time plus the control floor."""
    window, link = avg(later(seq), "window_s"), link_seconds(seq)
    out = {"window_s": window, "link_s": link, "compute_s": avg(later(seq), "compute_s"),
           "bcd_round_s": avg(later(seq), "round_wall_s")}  # fmt: skip
    if None not in (window, link, floor):
        out["window_target_s"] = floor + link
        out["window_ratio"] = window / (floor + link)
        out["window_met"] = out["window_ratio"] <= 1 + WINDOW_TOLERANCE
    return out


def overlap_target(seq: dict, par: dict) -> dict:
    """ParaBlock's round over sequential BCD's against max(C, W) / (C + W) of sequential BCD's C and W."""
    c, w = avg(later(seq), "compute_s"), avg(later(seq), "window_s")
    bcd, pb = avg(later(seq), "round_wall_s"), avg(later(par), "round_wall_s")
    out = {"parablock_round_s": pb, "parablock_compute_s": avg(later(par), "compute_s")}
    if None not in (c, w, bcd, pb) and c + w > 0 and bcd > 0:
        out["ideal"] = max(c, w) / (c + w)
        out["ratio"] = pb / bcd
        out["overlap_met"] = out["ratio"] <= out["ideal"] * (1 + OVERLAP_TOLERANCE)
    return out


def _met(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "**no**")


def report(runs: list[dict], floors: list[dict]) -> str:
    """The targets' table, the floor's runs, sequential BCD's legs and the stream's counts, as markdown."""
    rows = targets(runs, floors)
    lines = [
        "Issue 32's targets on a shaped link (means of rounds 2..R, s). Window: sequential BCD's, against the "
        f"link's own time up and down plus the control floor, met within {WINDOW_TOLERANCE:.0%}. Overlap: "
        "ParaBlock's round over sequential BCD's, against max(C, W) / (C + W) of sequential BCD's compute C and "
        f"window W, met within {OVERLAP_TOLERANCE:.0%}:",
        "",
        "| rate Mbit/s | transport | control floor s | link time s | BCD window s | floor + link s | "
        "window / (floor + link) | window met | C s | BCD round s | ParaBlock round s | ParaBlock / BCD | "
        "ideal | overlap met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate_mbps']:g} | {r['transport']} | {_f(r['floor_s'], 2)} | {_f(r.get('link_s'), 2)} | "
            f"{_f(r.get('window_s'), 2)} | {_f(r.get('window_target_s'), 2)} | {_f(r.get('window_ratio'), 2)} | "
            f"{_met(r.get('window_met'))} | {_f(r.get('compute_s'), 2)} | {_f(r.get('bcd_round_s'), 2)} | "
            f"{_f(r.get('parablock_round_s'), 2)} | {_f(r.get('ratio'), 3)} | {_f(r.get('ideal'), 3)} | "
            f"{_met(r.get('overlap_met'))} |"
        )
    lines += ["", "Flower's control floor over each link (the Flower-only app, no payload; rounds 2..R):", "",
              "| rate Mbit/s | load | windows s | dispatch | delivery | clientapp_relay | reply_to_server |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for f in floors:
        if not f.get("points"):
            lines.append(f"| {f['rate_mbps']:g} | | failed: {f.get('error', '')} | | | | |")
            continue
        legs = " | ".join(_f(mean([p[leg] for p in f["points"]]), 2) for leg in
                          ("dispatch", "delivery", "clientapp_relay", "reply_to_server"))  # fmt: skip
        windows = ", ".join(f"{p['window_s']:.2f}" for p in f["points"])
        lines.append(f"| {f['rate_mbps']:g} | {f['load_1min']:.1f} | {windows} | {legs} |")
    lines += ["", "Where sequential BCD's window goes, means of rounds 2..R, s (the worker's `upload` and `fetch`; "
              "Flower's legs from the records' critical path):", "",
              "| rate Mbit/s | transport | window | " + " | ".join(LEGS) + " |",
              "|---|---|---|" + "---|" * len(LEGS)]  # fmt: skip
    for run in runs:
        if run["algorithm"] == SEQUENTIAL and later(run):
            cells = " | ".join(_f(avg(later(run), leg), 2) for leg in LEGS)
            lines.append(f"| {run['rate_mbps']:g} | {run.get('transport', 'flower')} | "
                         f"{_f(avg(later(run), 'window_s'), 2)} | {cells} |")  # fmt: skip
    lines += ["", "Each run's bytes through its node's proxies (means per node, whole run, MB up / down) and, on "
              "the stream, its counts summed over the rounds:", "",
              "| rate Mbit/s | algorithm | transport | via the SuperLink's proxy | via the stream's proxy | "
              "fallbacks | refusals | updates ahead | steps prefetched |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in runs:
        counts = [sum(r.get(k) or 0 for r in run.get("rounds", [])) if run.get("transport") == "direct" else None
                  for k in ("direct_fallbacks", "direct_refusals", "direct_updates_ahead",
                            "direct_steps_prefetched")]  # fmt: skip
        lines.append(f"| {run['rate_mbps']:g} | {run['algorithm']} | {run.get('transport', 'flower')} | "
                     f"{_mb_pair(run, 'superlink_proxy')} | {_mb_pair(run, 'stream_proxy')} | "
                     f"{' | '.join(_f(c, 0) for c in counts)} |")  # fmt: skip
    return "\n".join(lines)


def _mb_pair(run: dict, key: str) -> str:
    up, down = run.get(f"{key}_bytes_up_per_client"), run.get(f"{key}_bytes_down_per_client")
    return "-" if up is None else f"{up / 1e6:.1f} / {down / 1e6:.1f}"
