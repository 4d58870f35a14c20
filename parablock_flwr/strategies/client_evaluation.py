"""Evaluation without central data (``evaluation = "clients"``): the server's side.

Round r's message asks its nodes to evaluate ``x^{r-1}`` (which a node holds once its
round-r update is computed, before the next computation starts); the evaluations come
back with round r's replies and complete round r-1's record. ``x^R`` is evaluated by one
EVALUATE message after the last round. The aggregate is the mean of the nodes' own
held-out losses weighted by their held-out example counts; every number a node reports
is type-checked like a reply's metrics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from flwr.app import Message

from ..config import RunConfig
from .reply_checks import read_metrics

log = logging.getLogger(__name__)


def evaluation_due(config: RunConfig, version: int, num_rounds: int) -> bool:
    """Is ``x^version`` evaluated (before training, every ``eval-every`` rounds, after the last)?"""
    return version % config.eval_every == 0 or version == num_rounds


def request_keys(config: RunConfig, version: int, num_rounds: int) -> dict:
    """The round-config keys that ask a node to evaluate ``x^version`` (none with server evaluation)."""
    if config.evaluation != "clients" or not evaluation_due(config, version, num_rounds):
        return {}
    every = config.generate_every
    generate = version == 0 or version == num_rounds or bool(every and version % every == 0)
    return {"evaluate-version": version, "evaluate-generate": int(generate)}


def valid_rows(replies: Iterable[Message], version: int) -> list[dict]:
    """The valid evaluate replies' metrics, in partition order (a fixed float-sum order)."""
    rows = []
    for msg in replies:
        metrics = read_evaluation(msg)
        if isinstance(metrics, str):
            log.warning("evaluation of x^%d: rejected the reply of node %d: %s", version,
                        msg.metadata.src_node_id, metrics)  # fmt: skip
            continue
        rows.append(metrics)
    return sorted(rows, key=lambda m: m["partition-id"])


def read_evaluation(msg: Message) -> dict | str:
    """An evaluate reply's metrics (``node.evaluate_replica``), each a finite number, or why not."""
    if msg.has_error():
        return f"client error: {msg.error.reason}"
    record = msg.content.metric_records.get("metrics")
    if record is None:
        return "missing 'metrics'"
    metrics = read_metrics({"server-round": 0, "block": 0, "base-version": 0, "num-examples": 1, "train-loss": 0.0,
                            "compute-s": 0.0, **dict(record)})  # fmt: skip
    if isinstance(metrics, str):
        return metrics
    if "heldout-loss" not in metrics or not metrics.get("heldout-examples", 0) > 0:
        return "missing heldout-loss or heldout-examples > 0"
    return metrics


def aggregate(rows: list[dict]) -> dict:
    """The nodes' own held-out losses, weighted by their held-out example counts (accuracy by
    ``task-examples``), and each node's own numbers."""
    weights = [float(m["heldout-examples"]) for m in rows]
    loss = sum(w * float(m["heldout-loss"]) for w, m in zip(weights, rows)) / sum(weights)
    out = {
        "heldout_loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "heldout_examples": sum(weights),
        "evaluated_by": "clients",
        "heldout_nodes": [
            {
                "partition_id": int(m["partition-id"]),
                "heldout_loss": float(m["heldout-loss"]),
                "heldout_examples": int(m["heldout-examples"]),
            }
            for m in rows
        ],  # fmt: skip
    }
    answered_rows = [m for m in rows if m.get("task-examples", 0) > 0]
    if answered_rows:
        n = sum(float(m["task-examples"]) for m in answered_rows)
        out["task_accuracy"] = sum(float(m["task-accuracy"]) * float(m["task-examples"]) for m in answered_rows) / n
        out["task_examples"] = int(n)
    return out
