"""Per-round records: one log line each, appended to ``metrics.jsonl`` in the run folder.

A round's record is written in parts, each one appended line: the training numbers once the
round is aggregated, then its evaluation once it is done (the server's, or the nodes' that come
with the next round's replies). Writing a round costs the same at round 10 and at round 1000
(nothing earlier is rewritten), and the same for 2 nodes and for 200: what is per node (each
accepted client's weight, the workers' timelines, each rejection, each node's held-out loss)
goes to ``nodes.jsonl`` instead, one line per round. ``RunRecorder.read`` merges both files
into one dict per round, as a run's record always was.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .durable import append_line, make_dirs, read_jsonl

# The run's last line lists every evaluated round's held-out loss, up to this many (then first, last and a count).
SUMMARY_ROUNDS = 12

# Keys whose value has one entry per node: kept out of the main record (``nodes.jsonl``).
PER_NODE_KEYS = ("client_weights", "timeline", "rejected", "heldout_nodes", "served_by")


@contextmanager
def timed(legs: dict[str, float], leg: str) -> Iterator[None]:
    """``legs[leg]`` grows by the seconds the block took: a leg of a round (a worker's, said in its reply's
    metrics; the server's, in the round's record)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        legs[leg] = legs.get(leg, 0.0) + time.perf_counter() - start


class RunRecorder:
    """``metrics.jsonl`` (round 0 = before training) and ``nodes.jsonl`` (the per-node detail)."""

    def __init__(self, run_dir: Path, sink: str = ""):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.nodes_path = Path(run_dir) / "nodes.jsonl"
        make_dirs(self.path.parent)
        self._lock = threading.Lock()  # the round loop and the server's evaluator both append
        self.sink = TensorBoardSink(Path(run_dir) / "tensorboard") if sink == "tensorboard" else None

    def write(self, record: dict, crash_stage: tuple[str, int] | None = None) -> None:
        """Append one part of a round's record (it must carry ``round``), durably; its per-node
        keys go to ``nodes.jsonl``. ``crash_stage``: the crash tests' point (``durable.crash_point``)."""
        main = {k: v for k, v in record.items() if k not in PER_NODE_KEYS}
        detail = {k: v for k, v in record.items() if k in PER_NODE_KEYS}
        with self._lock:
            if detail:
                append_line(self.nodes_path, {"round": record["round"], **detail})
            append_line(self.path, main, crash_stage)
            if self.sink is not None:
                self.sink.write(main)

    def read(self) -> list[dict]:
        """One merged dict per round, in round order (a torn last line is skipped with a warning)."""
        return merge_rounds(read_jsonl(self.path) + read_jsonl(self.nodes_path))

    def copy_rounds(self, from_run_dir: Path, up_to: int) -> None:
        """Append the record parts of rounds ``0..up_to`` of another run (a resumed one) to this one."""
        source = RunRecorder(from_run_dir)
        for src, dst in ((source.path, self.path), (source.nodes_path, self.nodes_path)):
            for part in read_jsonl(src):
                if part["round"] <= up_to:
                    append_line(dst, part)


class TensorBoardSink:
    """``metrics-sink = "tensorboard"``: each record part's numbers as scalars at step = its round, in
    TensorBoard event files under ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``). A copy
    for the ecosystem's tools: ``metrics.jsonl`` stays the record that resume and ``report`` read."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (an extra)

        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, record: dict) -> None:
        for key, value in record.items():
            if key != "round" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=record["round"])
        self.writer.flush()


def merge_rounds(parts: list[dict]) -> list[dict]:
    """The parts of each round merged in the order they were written, one dict per round."""
    rounds: dict[int, dict] = {}
    for part in parts:
        rounds.setdefault(part["round"], {}).update(part)
    return [rounds[r] for r in sorted(rounds)]


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}MB"


def round_line(rec: dict, num_rounds: int) -> str:
    """The one human line per round."""
    held_out = _heldout(rec) + _accuracy(rec)
    if rec["round"] == 0:
        return f"round 0/{num_rounds}{held_out}"
    eta = rec.get("eta_s")
    return (
        f"round {rec['round']}/{num_rounds} block {rec['block']} ({rec['block_label']}) "
        f"train_loss {_fmt(rec['train_loss'])}{held_out} "
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
        if key == "heldout_loss" and len(measured) >= 2:  # every evaluated round's, the middle elided past a few
            shown = [f"{fmt.format(r[key])} (round {r['round']})" for r in measured]
            if len(shown) > SUMMARY_ROUNDS:
                elided = f"... {len(shown) - SUMMARY_ROUNDS + 1} more rounds in metrics.jsonl ..."
                shown = [*shown[: SUMMARY_ROUNDS // 2], elided, *shown[-(SUMMARY_ROUNDS // 2 - 1) :]]
            parts.append(f"{key} {' -> '.join(shown)}")
        elif len(measured) >= 2:
            first, last = measured[0], measured[-1]
            before, after = fmt.format(first[key]), fmt.format(last[key])
            parts.append(f"{key} {before} (round {first['round']}) -> {after} (round {last['round']})")
    constant = next((r["task_accuracy_constant"] for r in records if r.get("task_accuracy_constant") is not None), None)
    if len(parts) == 2 and constant is not None:
        parts[-1] += f" (always the most common answer: {constant:.3f})"
    # What the run did less than asked, said on its last line (each round's record has the detail).
    if rejected := sum(r.get("num_rejected", 0) for r in records):
        parts.append(f"{rejected} replies rejected")
    if skipped := sum(r.get("evaluation_skipped", 0) for r in records):
        parts.append(f"{skipped} scheduled evaluations skipped (the evaluator was more than eval-max-lag behind)")
    if dropped := max((r.get("dropped_examples", 0) for r in records), default=0):
        parts.append(f"up to {dropped} data rows dropped, cut before their answer by max-seq-len")
    if malformed := max((r.get("malformed_examples", 0) for r in records), default=0):
        parts.append(f"up to {malformed} malformed data rows skipped (each site's log names the first one's row)")
    parts += _direct_transport(records)
    if private := [r for r in records if r.get("dp_epsilon") is not None]:
        last = private[-1]
        clipped = sum(r.get("dp_clipped", 0) for r in private)
        parts.append(f"differential privacy: epsilon {last['dp_epsilon']:.3f} at delta {last['dp_delta']:g}"
                     + (f", {clipped} updates clipped" if clipped else ""))  # fmt: skip
    return "; ".join(parts)


def _direct_transport(records: list[dict]) -> list[str]:
    """``transport = "direct"``: the messages whose blocks went on Flower's path instead, what the stream
    refused, by kind, and replies taken from the stream that their Flower reply contradicted or never audited;
    each round's ``direct_*`` and the last round's ``final_direct_*`` (the final evaluation,
    and refusals until the stream stopped) summed, so that neither is said only in the records."""

    def total(name: str) -> int:
        return sum(r.get(name, 0) + r.get(f"final_{name}", 0) for r in records)

    parts = []
    if fallbacks := total("direct_fallbacks"):
        parts.append(f"{fallbacks} messages' blocks on Flower's path instead of the direct stream (direct_fallbacks)")
    if refusals := total("direct_refusals"):
        prefix = "direct_refused_"
        kinds = sorted({k.removeprefix("final_").removeprefix(prefix) for r in records for k in r
                        if k.removeprefix("final_").startswith(prefix)})  # fmt: skip
        by_kind = ", ".join(f"{kind} {total(prefix + kind)}" for kind in kinds)
        parts.append(f"{refusals} requests refused by the direct stream ({by_kind})")
    if contradicted := total("direct_replies_contradicted"):
        parts.append(f"{contradicted} replies taken from the direct stream contradicted by their Flower reply "
                     "(direct_replies_contradicted)")  # fmt: skip
    if unaudited := total("direct_replies_unaudited"):
        parts.append(f"{unaudited} replies taken from the direct stream without their Flower reply to audit them "
                     "(direct_replies_unaudited)")  # fmt: skip
    return parts


def _heldout(rec: dict) -> str:
    """`` heldout_loss 0.1942`` where the round was evaluated, `` heldout_loss skipped`` where its due
    evaluation was skipped (``eval-max-lag``), else nothing: a round's line never says ``nan`` for a
    loss nobody measured."""
    if rec.get("heldout_loss") is not None:
        return f" heldout_loss {_fmt(rec['heldout_loss'])}"
    return " heldout_loss skipped" if rec.get("evaluation_skipped") else ""


def _accuracy(rec: dict) -> str:
    """`` task_accuracy 0.250 (16/64)`` where the round measured it, else nothing."""
    if rec.get("task_accuracy") is None:
        return ""
    n = rec.get("task_examples", 0)
    return f" task_accuracy {rec['task_accuracy']:.3f} ({round(rec['task_accuracy'] * n)}/{n})"


def _fmt(x: float | None) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"
