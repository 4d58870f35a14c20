"""The figures: held-out loss against wall clock, and each round's compute, communication and idle time."""

from __future__ import annotations

from pathlib import Path

from benchmarks.network.analysis import label as run_label


def plots(runs: list[dict], folder: Path) -> list[Path]:
    """Held-out loss against wall clock; per-round compute / communication / idle bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if "rounds" in r]
    if not done:
        return []
    rates = sorted({r["rate_mbps"] for r in done})
    algorithms = list(dict.fromkeys(run_label(r) for r in done))  # an algorithm on each transport: one column each
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for run in (r for r in done if r["rate_mbps"] == rate):
            points = [(run["initial_elapsed_s"], run["heldout_loss_initial"])]
            points += [(r["elapsed_s"], r["heldout_loss"]) for r in run["rounds"]]
            ax.plot(*zip(*points), marker="o", label=run_label(run))
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
            run = next((r for r in done if r["rate_mbps"] == rate and run_label(r) == algorithm), None)
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
