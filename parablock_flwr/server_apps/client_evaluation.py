"""Evaluation without central data (``evaluation = "clients"``): the server's side.

Round r's message asks its nodes to evaluate ``x^{r-1}`` (which a node holds once its
round-r update is computed, before the next computation starts); the evaluations come
back with round r's replies and complete round r-1's record. ``x^R`` is evaluated by one
EVALUATE message after the last round. The aggregate is the mean of the nodes' own
held-out losses weighted by their held-out example counts; every number a node reports
is read through the message schema (``messages.EvaluateReply``), as a reply's metrics are.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from flwr.app import Message

from ..config import RunConfig
from ..messages import METRICS, EvaluateReply
from ..strategies.reply_checks import Reply

log = logging.getLogger(__name__)


def evaluation_due(config: RunConfig, version: int, num_rounds: int) -> bool:
    """Is ``x^version`` evaluated (before training, every ``eval-every`` rounds, after the last)?"""
    return version % config.eval_every == 0 or version == num_rounds


def request(config: RunConfig, version: int, num_rounds: int) -> dict:
    """The ``RoundConfig`` fields that ask a node to evaluate ``x^version`` (none with server evaluation)."""
    if config.evaluation != "clients" or not evaluation_due(config, version, num_rounds):
        return {}
    every = config.generate_every
    generate = version == 0 or version == num_rounds or bool(every and version % every == 0)
    return {"evaluate_version": version, "evaluate_generate": generate}


def valid_rows(replies: Iterable[Message], version: int) -> list[EvaluateReply]:
    """The valid evaluate replies, in partition order (a fixed float-sum order)."""
    rows = []
    for msg in replies:
        reply = read_evaluation(msg)
        if isinstance(reply, str):
            log.warning("evaluation of x^%d: rejected the reply of node %d: %s", version,
                        msg.metadata.src_node_id, reply)  # fmt: skip
            continue
        rows.append(reply)
    return sorted(rows, key=lambda r: r.partition_id)


def read_evaluation(msg: Message) -> EvaluateReply | str:
    """An evaluate reply (``node.evaluate_replica``), or why it is not one."""
    if msg.has_error():
        return f"client error: {msg.error.reason}"
    record = msg.content.metric_records.get(METRICS)
    if record is None:
        return f"missing {METRICS!r}"
    return EvaluateReply.from_record(dict(record))


def aggregate(rows: list[EvaluateReply]) -> dict:
    """The nodes' own held-out losses, weighted by their held-out example counts (accuracy by
    ``task-examples``), and each node's own numbers."""
    evaluations = [r.evaluation for r in rows]
    weights = [float(e.heldout_examples) for e in evaluations]
    loss = sum(w * float(e.heldout_loss) for w, e in zip(weights, evaluations)) / sum(weights)
    out = {
        "heldout_loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "heldout_examples": sum(weights),
        "evaluated_by": "clients",
        "heldout_nodes": [
            {
                "partition_id": r.partition_id,
                "heldout_loss": float(r.evaluation.heldout_loss),
                "heldout_examples": int(r.evaluation.heldout_examples),
            }
            for r in rows
        ],  # fmt: skip
    }
    answered = [e for e in evaluations if e.task_examples]
    if answered:
        n = sum(float(e.task_examples) for e in answered)
        out["task_accuracy"] = sum(float(e.task_accuracy) * float(e.task_examples) for e in answered) / n
        out["task_examples"] = int(n)
    return out


class ClientEvaluations:
    """The nodes' aggregated evaluations by version, each held until the record it completes is written."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.by_version: dict[int, dict] = {}

    def request(self, version: int, num_rounds: int) -> dict:
        """What asks the nodes of round ``version + 1`` to evaluate ``x^version`` (``request``)."""
        return request(self.config, version, num_rounds)

    def collect(self, version: int, replies: list[Reply]) -> None:
        """The nodes' evaluations of ``x^version`` that came with round ``version + 1``'s accepted replies."""
        rows = [EvaluateReply(r.partition_id, r.metrics.evaluation) for r in replies
                if r.metrics.evaluation is not None and r.metrics.evaluation.eval_version == version]  # fmt: skip
        if rows:
            self.by_version[version] = aggregate(rows)

    def collect_final(self, version: int, replies: Iterable[Message]) -> None:
        """The replies to the EVALUATE message of ``x^version`` sent after the last round."""
        if rows := valid_rows(replies, version):
            self.by_version[version] = aggregate(rows)

    def take(self, version: int | None = None) -> list[tuple[int, dict]]:
        """``version``'s evaluation (empty if none came), or with None every one held, in version order."""
        if version is not None:
            return [(version, self.by_version.pop(version, {}))]
        return [(v, self.by_version.pop(v)) for v in sorted(self.by_version)]
