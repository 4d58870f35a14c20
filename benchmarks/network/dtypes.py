"""``--transfer-dtypes``: the communication window against the link rate for each transfer dtype, and
the time model (``core.LinkModel``) calibrated on two points of the sweep and checked on every other one.

The sweep itself (every rate x dtype over one set of processes) is ``runs.run_dtype_sweep``. Here:
each run's window (rounds 2..R: the previous reply up plus this round's message down, ``comm_s``), a fit
of the framework's cost ``fixed + bytes / throughput`` on the calibration runs after taking the link's
own time away (``8 x bytes / rate`` and twice the latency), and the predicted round (sequential BCD:
compute + window) of every run against the measured one. Writes results.json's ``dtype_sweep``, a
figure (window-vs-rate.png, with matplotlib) and docs/results/network-dtypes.md. The same fit on two
runs of your own is ``python -m benchmarks.time_model``.

Reading the page: where the link is fast, every dtype's window is about the same, Flower's cost per exchange
rather than the link's; where it is slow, the bytes count, and bf16 or int8 shorten the window.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from benchmarks.common import PROJECT_DIR, fit, write_report
from parablock_flwr import core

TITLE = "The window against link rate for each transfer dtype"
TARGET_ERROR = 0.15  # the time model should predict an uncalibrated block size and rate within 15%


def windows(run: dict) -> list[dict]:
    """Rounds 2..R of one run: the window, its bytes (reply up of r-1, message down of r), compute, wall."""
    rounds = run.get("rounds", [])
    return [
        {"round": r["round"], "window_s": r["comm_s"], "bytes_up": prev["bytes_up_per_client"],
         "bytes_down": r["bytes_down_per_client"], "compute_s": r["compute_s"], "round_wall_s": r["round_wall_s"]}
        for prev, r in zip(rounds, rounds[1:]) if r.get("comm_s") is not None
    ]  # fmt: skip


def link_seconds(point: dict, rate: float, latency_ms: float) -> float:
    """The link's own share of a window: both directions' bytes at ``rate``, and the latency each way."""
    return core.LinkModel(rate, rate, latency_ms).comm_seconds(point["bytes_up"], point["bytes_down"])


def calibrate(runs: list[dict], calibration: list[dict]) -> dict:
    """``fixed + bytes / throughput`` fitted to the calibration runs' windows less their link time."""
    xs, ys = [], []
    for run in calibration:
        for p in windows(run):
            xs.append(p["bytes_up"] + p["bytes_down"])
            ys.append(p["window_s"] - link_seconds(p, run["rate_mbps"], run["latency_ms"]))
    model = fit(xs, ys)  # needs two message sizes: two transfer dtypes (or two block sizes)
    return {"fixed_s": model["fixed_s"], "throughput_mbs": model["throughput_mbs"] or 0.0,  # 0: not modeled
            "calibrated_on": [f"{r['transfer_dtype']} at {r['rate_mbps']:g} Mbit/s" for r in calibration]}  # fmt: skip


def predictions(runs: list[dict], model: dict) -> list[dict]:
    """Every run's rounds 2..R predicted (compute + the window the model gives) against the measured."""
    rows = []
    for run in runs:
        link = core.LinkModel(run["rate_mbps"], run["rate_mbps"], run["latency_ms"], model["fixed_s"],
                              model["throughput_mbs"])  # fmt: skip
        for p in windows(run):
            window = link.comm_seconds(p["bytes_up"], p["bytes_down"])
            predicted = core.modeled_round_seconds([p["compute_s"]], [window], overlapped=False)
            rows.append({"transfer_dtype": run["transfer_dtype"], "rate_mbps": run["rate_mbps"], "round": p["round"],
                         "predicted_window_s": window, "measured_window_s": p["window_s"],
                         "predicted_round_s": predicted, "measured_round_s": p["round_wall_s"],
                         "error": predicted / p["round_wall_s"] - 1})  # fmt: skip
    return rows


def analyse(runs: list[dict]) -> dict:
    """Calibrate on the fastest rate's largest and smallest messages; predict the rest."""
    done = [r for r in runs if windows(r)]
    fastest = max((r["rate_mbps"] for r in done), default=None)
    at_fastest = sorted((r for r in done if r["rate_mbps"] == fastest),
                        key=lambda r: np.mean([p["bytes_up"] + p["bytes_down"] for p in windows(r)]))  # fmt: skip
    out: dict = {}
    if len(at_fastest) >= 2:
        calibration = [at_fastest[0], at_fastest[-1]]
        out["model"] = calibrate(done, calibration)
        others = [r for r in done if not any(r is c for c in calibration)]
        out["predictions"] = predictions(others, out["model"])
    return out


def _mean_range(values: list[float]) -> str:
    return f"{np.mean(values):.1f} ({min(values):.1f}-{max(values):.1f})" if values else "-"


def tables(runs: list[dict], analysis: dict) -> str:
    lines = ["| rate Mbit/s | transfer dtype | MB per exchange (up + down) | window s, mean (min-max) | "
             "link's own s | load (1 min) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for run in sorted(runs, key=lambda r: (r["rate_mbps"], r["transfer_dtype"])):
        points = windows(run)
        if not points:
            lines.append(f"| {run['rate_mbps']:g} | {run['transfer_dtype']} | failed: {run.get('error', '?')} | | | |")
            continue
        mb = np.mean([p["bytes_up"] + p["bytes_down"] for p in points]) / 1e6
        link = np.mean([link_seconds(p, run["rate_mbps"], run["latency_ms"]) for p in points])
        window = _mean_range([p["window_s"] for p in points])
        lines.append(
            f"| {run['rate_mbps']:g} | {run['transfer_dtype']} | {mb:.1f} | {window} | {link:.1f} | "
            f"{run['load_1min']:.1f} |"
        )
    if model := analysis.get("model"):
        rows = analysis["predictions"]
        worst = max((abs(r["error"]) for r in rows), default=0.0)
        lines += ["", f"Time model calibrated on {' and '.join(model['calibrated_on'])}: fixed "
                  f"{model['fixed_s']:.2f} s, {model['throughput_mbs']:.0f} MB/s besides the link "
                  f"(`message-overhead-s`, `message-throughput-mbs`); every other run's rounds predicted "
                  f"(compute + window, sequential BCD): largest error {100 * worst:.0f}% "
                  f"(target {100 * TARGET_ERROR:.0f}%).", "",
                  "| rate Mbit/s | transfer dtype | round | window predicted / measured s | round predicted / "
                  "measured s | error |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            lines.append(
                f"| {r['rate_mbps']:g} | {r['transfer_dtype']} | {r['round']} | "
                f"{r['predicted_window_s']:.1f} / {r['measured_window_s']:.1f} | "
                f"{r['predicted_round_s']:.1f} / {r['measured_round_s']:.1f} | {100 * r['error']:+.0f}% |"
            )
    return "\n".join(lines)


def plot(runs: list[dict], analysis: dict, path: Path) -> Path | None:
    """The window against the rate, one colour per dtype: every round a dot, the mean a line, the
    calibrated model dashed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    dtypes = list(dict.fromkeys(r["transfer_dtype"] for r in runs))
    model = analysis.get("model")
    for i, dtype in enumerate(dtypes):
        ours = sorted((r for r in runs if r["transfer_dtype"] == dtype and windows(r)), key=lambda r: r["rate_mbps"])
        if not ours:
            continue
        rates = [r["rate_mbps"] for r in ours]
        for r in ours:
            ax.scatter([r["rate_mbps"]] * len(windows(r)), [p["window_s"] for p in windows(r)], color=f"C{i}", s=12)
        mb = np.mean([p["bytes_up"] + p["bytes_down"] for p in windows(ours[0])]) / 1e6
        ax.plot(rates, [np.mean([p["window_s"] for p in windows(r)]) for r in ours], color=f"C{i}", marker="o",
                label=f"{dtype} ({mb:.3g} MB per exchange)")  # fmt: skip
        if model:
            grid = np.geomspace(min(rates) * 0.8, max(rates) * 1.25, 50)
            p = {"bytes_up": mb * 1e6 / 2, "bytes_down": mb * 1e6 / 2}
            model_s = [core.LinkModel(g, g, ours[0]["latency_ms"], model["fixed_s"], model["throughput_mbs"])
                       .comm_seconds(p["bytes_up"], p["bytes_down"]) for g in grid]  # fmt: skip
            ax.plot(grid, model_s, color=f"C{i}", ls="--", lw=0.8)
    ax.set(xscale="log", xlabel="link rate each way, Mbit/s", ylabel="communication window, s",
           title="One block each way over a shaped link (dashed: the calibrated time model)")  # fmt: skip
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def describe(results: dict) -> str:
    s = results["settings"]
    return (
        "The load average beside each run.  \n"
        f"Model `{s['model_label']}`, {s['clients']} client(s), {', '.join(s['algorithms'])}, {s['rounds']} rounds "
        f"(rounds 2..R: one window each), {s['layers_per_block']} layers per block, {s['local_steps']} local "
        f"step(s); links of {', '.join(f'{r:g}' for r in s['rates_mbps'])} Mbit/s each way with "
        f"{s['latency_ms']:g} ms one way. One set of processes for the whole sweep (one `flwr run` per rate "
        "and dtype). Window = from the worker's reply leaving it to the next message reaching it "
        "(`measured_comm_s`); link's own = both directions' bytes at the rate plus the latency each way.\n\n"
        + results["tables"]
    )


def report(results: dict, out: Path, docs: bool) -> int:
    """Analysis, tables, figure and results.json in ``out``; the docs section when ``docs``."""
    results["dtype_sweep"] = analyse(results["runs"])
    results["tables"] = tables(results["runs"], results["dtype_sweep"])
    png = plot(results["runs"], results["dtype_sweep"], out / "window-vs-rate.png")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(results["tables"])
    if docs:
        text = describe(results)
        if png:
            (PROJECT_DIR / "docs" / "img").mkdir(parents=True, exist_ok=True)
            shutil.copy(png, PROJECT_DIR / "docs" / "img" / "window-vs-rate.png")
            text += "\n\n![window against rate](../img/window-vs-rate.png)\n"
        write_report("network-dtypes", TITLE, text, how=results["command"], measured=results)
        print("wrote docs/results/network-dtypes.md and docs/img/window-vs-rate.png")
    return 0 if all("error" not in r for r in results["runs"]) else 1
