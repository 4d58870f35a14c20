"""`parablock-flwr report RUN_DIR`: the run's status (one line), its table on stdout, PNG plots in RUN_DIR/plots."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .metrics import RunRecorder
from .run_status import STATUS_FILE, read_status

log = logging.getLogger(__name__)

COLUMNS = [  # (header, key, format)
    ("round", "round", "{:d}"),
    ("block", "block", "{}"),
    ("train loss", "train_loss", "{:.4f}"),
    ("held-out loss", "heldout_loss", "{:.4f}"),
    ("up MB/client", "bytes_up_per_client", "{:.1f}"),
    ("down MB/client", "bytes_down_per_client", "{:.1f}"),
    ("compute s", "compute_s_max", "{:.1f}"),
    ("modeled round s", "modeled_round_s", "{:.1f}"),
    ("measured comm s", "measured_comm_s", "{:.1f}"),
    ("overlap share", "measured_overlap_share", "{:.2f}"),
    ("round wall s", "round_wall_s", "{:.1f}"),
    ("elapsed s", "elapsed_s", "{:.0f}"),
]
# Columns shown only for runs whose records have them: differential privacy's epsilon so far (docs/privacy.md).
IF_RECORDED = [("epsilon", "dp_epsilon", "{:.2f}")]


def table(records: list[dict]) -> str:
    columns = COLUMNS + [c for c in IF_RECORDED if any(c[1] in rec for rec in records)]
    rows = [[h for h, _, _ in columns]]
    for rec in records:
        row = []
        for _, key, fmt in columns:
            value = rec.get(key)
            if value is None:
                row.append("-")
            else:
                row.append(fmt.format(value / 1e6 if key.startswith("bytes") else value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def status_line(status: dict | None) -> str:
    """How the run ended, in one line (``status.json``; none while it runs or if it was killed)."""
    if status is None:
        return f"status: unknown (no {STATUS_FILE}: the run is still going, or its ServerApp was killed or crashed)"
    rounds = f"{status.get('rounds_completed')}/{status.get('num_rounds')} rounds"
    if status.get("status") == "completed":
        return f"status: completed ({rounds})"
    if status.get("status") == "completed-with-exclusions":
        code = status.get("exit_code")
        return f"status: completed with exclusions (exit code {code}, {rounds}): {status.get('reason')}"
    if status.get("kind") == "privacy-budget":
        code = status.get("exit_code")
        return f"status: stopped at its privacy budget (exit code {code}, {rounds}): {status.get('reason')}"
    return (
        f"status: failed ({status.get('kind')}, exit code {status.get('exit_code')}, {rounds}): {status.get('reason')}"
    )


def plots(records: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    trained = [r for r in records if r["round"] > 0]
    rounds = [r["round"] for r in trained]
    written = []

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    evaluated = [r for r in records if "heldout_loss" in r]  # every eval-every rounds
    axes[0].plot([r["round"] for r in evaluated], [r["heldout_loss"] for r in evaluated], "o-", label="held-out")
    axes[0].plot(rounds, [r.get("train_loss") for r in trained], "s--", label="train")
    axes[0].set(xlabel="round", ylabel="loss", title="loss per round")
    axes[0].legend()
    elapsed = [r.get("elapsed_s", 0.0) for r in evaluated]  # (a record whose training part was lost: 0)
    axes[1].plot(elapsed, [r["heldout_loss"] for r in evaluated], "o-", label="measured")
    modeled = [r.get("modeled_wall_s", 0.0) for r in evaluated]
    axes[1].plot(modeled, [r["heldout_loss"] for r in evaluated], "s--", label="modeled (time model)")
    axes[1].set(xlabel="wall-clock s", ylabel="held-out loss", title="held-out loss against wall-clock")
    axes[1].legend()
    axes[2].bar([x - 0.2 for x in rounds], [r["bytes_up_per_client"] / 1e6 for r in trained], 0.4, label="up")
    axes[2].bar([x + 0.2 for x in rounds], [r["bytes_down_per_client"] / 1e6 for r in trained], 0.4, label="down")
    axes[2].set(xlabel="round", ylabel="MB per client", title="bytes per round")
    axes[2].legend()
    fig.tight_layout()
    written.append(out / "loss_and_bytes.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    compute = [r.get("measured_compute_s", r.get("compute_s_max", 0.0)) for r in trained]
    comm = [r.get("measured_comm_s", r.get("comm_s_modeled", 0.0)) for r in trained]
    idle = [r.get("measured_idle_s", 0.0) for r in trained]
    ax.bar([x - 0.25 for x in rounds], compute, 0.25, label="compute")
    ax.bar(rounds, comm, 0.25, label="communication" + ("" if "measured_comm_s" in trained[-1] else " (modeled)"))
    ax.bar([x + 0.25 for x in rounds], idle, 0.25, label="worker idle")
    ax.set(xlabel="round", ylabel="seconds", title="compute / communication / idle per round")
    ax.legend()
    fig.tight_layout()
    written.append(out / "time_per_round.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written


def rounds_jsonl(run_dir: Path) -> str:
    """One JSON object a line, one line per round: ``metrics.jsonl`` appends a round's training record and its
    evaluations as they finish (separate lines), and this is their merge (``RunRecorder.read``), what
    ``pandas.read_json(..., lines=True)`` should read to get one row per round."""
    if not (Path(run_dir) / "metrics.jsonl").is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl; expected a run folder")
    return "\n".join(json.dumps(record, sort_keys=True) for record in RunRecorder(run_dir).read())


def report(run_dir: Path) -> str:
    """The status line, then the table (and the plots written), or only the status if no round was recorded."""
    if not Path(run_dir).is_dir():
        raise ValueError(f"{run_dir}: not a folder; expected a run folder")
    status = read_status(run_dir)
    records = RunRecorder(run_dir).read()  # (RunRecorder makes its folder: checked above)
    if not records:
        if status is None:
            raise ValueError(f"{run_dir}: no metrics.jsonl with records and no {STATUS_FILE}; expected a run folder")
        return status_line(status) + "\nno round was recorded"
    text = status_line(status) + "\n" + table(records)
    if len(records) > 1:
        for path in plots(records, Path(run_dir) / "plots"):
            text += f"\nwrote {path}"
    return text


def sites(run_dir: Path) -> str:
    """One row per site (its ``partition-id``) over the whole run, from ``nodes.jsonl``: the rounds its update was
    aggregated in, the replies rejected (with the first reason), its examples (its last count), its compute and
    the bytes it sent. A rejected reply whose site the server did not know is its node's row."""
    if not (Path(run_dir) / "metrics.jsonl").is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl; expected a run folder")
    rows: dict[str, dict] = {}

    def row(site: str) -> dict:
        return rows.setdefault(site, {"accepted": 0, "rejected": 0, "examples": 0, "compute_s": 0.0, "bytes_up": 0,
                                      "first_rejection": ""})  # fmt: skip

    for record in RunRecorder(run_dir).read():
        for w in record.get("client_weights", []):
            r = row(f"site {w['partition_id']}")
            r["accepted"] += 1
            r["examples"] = w["num_examples"]
            r["compute_s"] += w.get("compute_s", 0.0)
            r["bytes_up"] += w.get("bytes_up", 0)
        for x in record.get("rejected", []):
            site = x.get("partition_id")
            r = row(f"site {site}" if site is not None else f"node {x['node']}")
            r["rejected"] += 1
            r["first_rejection"] = r["first_rejection"] or f"round {record['round']}: {x['reason']}"
    header = ["site", "accepted", "rejected", "examples", "compute s", "MB up", "first rejection"]
    lines = [header] + [
        [site, str(r["accepted"]), str(r["rejected"]), f"{r['examples']:g}", f"{r['compute_s']:.1f}",
         f"{r['bytes_up'] / 1e6:.1f}", r["first_rejection"][:80] or "-"]
        for site, r in sorted(rows.items(), key=lambda kv: (kv[0].split()[0], int(kv[0].split()[1])))
    ]  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(c.rjust(w) for c, w in zip(line, widths)), line[-1]]) for line in lines)
