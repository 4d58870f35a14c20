"""Per-round records: one log line each, appended to ``metrics.jsonl`` in the run folder."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


class RunRecorder:
    """Writes ``metrics.jsonl`` (one JSON object per round, round 0 = before training)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")

    def update(self, server_round: int, fields: dict) -> None:
        """Add ``fields`` to round ``server_round``'s record (the file is replaced atomically)."""
        records = self.read()
        for record in records:
            if record.get("round") == server_round:
                record.update(fields)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        os.replace(tmp, self.path)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}MB"


def round_line(rec: dict, num_rounds: int) -> str:
    """The one human line per round."""
    accuracy = _accuracy(rec)
    if rec["round"] == 0:
        return f"round 0/{num_rounds} heldout_loss {_fmt(rec.get('heldout_loss'))}{accuracy}"
    eta = rec.get("eta_s")
    return (
        f"round {rec['round']}/{num_rounds} block {rec['block']} ({rec['block_label']}) "
        f"train_loss {_fmt(rec['train_loss'])} heldout_loss {_fmt(rec.get('heldout_loss'))}{accuracy} "
        f"up {_mb(rec['bytes_up_per_client'])} down {_mb(rec['bytes_down_per_client'])} per client "
        f"compute {rec['compute_s_max']:.1f}s modeled_round {rec['modeled_round_s']:.1f}s "
        f"(sequential {rec['modeled_round_s_sequential']:.1f}s, overlapped {rec['modeled_round_s_overlapped']:.1f}s) "
        f"accepted {rec['num_accepted']}/{rec['num_replies']} "
        f"elapsed {rec['elapsed_s']:.0f}s" + (f" eta {eta:.0f}s" if eta is not None else "")
    )


def run_summary(records: list[dict]) -> str:
    """The run in one line: the held-out loss and task accuracy before training and at the end."""
    parts = []
    for key, fmt in (("heldout_loss", "{:.4f}"), ("task_accuracy", "{:.3f}")):
        measured = [r for r in records if r.get(key) is not None]
        if len(measured) >= 2:
            first, last = measured[0], measured[-1]
            before, after = fmt.format(first[key]), fmt.format(last[key])
            parts.append(f"{key} {before} (round {first['round']}) -> {after} (round {last['round']})")
    constant = next((r["task_accuracy_constant"] for r in records if r.get("task_accuracy_constant") is not None), None)
    if len(parts) == 2 and constant is not None:
        parts[-1] += f" (always the most common answer: {constant:.3f})"
    return "; ".join(parts)


def _accuracy(rec: dict) -> str:
    """`` task_accuracy 0.250 (16/64)`` where the round measured it, else nothing."""
    if rec.get("task_accuracy") is None:
        return ""
    n = rec.get("task_examples", 0)
    return f" task_accuracy {rec['task_accuracy']:.3f} ({round(rec['task_accuracy'] * n)}/{n})"


def _fmt(x: float | None) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"
