"""Checking one client reply before anything on the server changes: pure functions.

A reply is judged on what it carries, not on what it declares: its packed update
(``wire.py``) is deserialised once, and its real dtype, size, layout, finiteness and
norm are checked on the very tensors that the aggregation will then use. Every metric the
server reads is type-checked (a finite number where a number is expected), so a
malformed reply is rejected with a reason instead of crashing the round.
``parse_reply`` returns a ``Reply`` or the reason (a string); the strategy adds
the checks that need the round's state (``check_partition``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord, Message

from .. import core
from ..node_data import STATE_INTACT  # an error from a node whose model state is intact
from ..records import WireError, to_tensors
from ..wire import payload_bytes

# Metrics every reply carries (``node.update_metrics``) and their kinds.
INT_METRICS = ("server-round", "block", "partition-id", "base-version")
NUMBER_METRICS = ("num-examples", "train-loss", "compute-s")
# Optional metrics: the deployment's timeline (node worker, ClientApp) and replica catch-up.
OPTIONAL_NUMBER_METRICS = (
    "steps-from-log",
    "compute-start",
    "compute-end",
    "request-received",
    "prev-reply-sent",
    "waited-s",
    "correction-after-step",
    "correction-drift",
    "clientapp-start",
    "clientapp-handler-start",  # Flower has pulled and deserialised the message
    "clientapp-sent",  # the message's last byte written to the worker's socket
    "clientapp-reply",
    "clientapp-pull-cpu-s",  # the ClientApp process's CPU seconds at its handler's start, and at its reply
    "clientapp-cpu-s",
    "clientapp-imported-torch",
    "truncated-examples",  # examples of the round's batches cut at max-seq-len
    "dropped-examples",  # rows of the node's data max-seq-len cut before their answer (own-data: its own)
    "malformed-examples",  # rows of the node's data skipped as malformed (unreadable, a field missing or not text)
    "oom-retries",  # 1: the node ran out of device memory and redid the round with half the micro-batch
    "own-data",  # 1: the node trains on its own dataset (its num-examples is bounded by max-num-examples only)
    "process-id",  # simulation: the Ray actor's process that computed the update (records' served_by)
    # evaluation = "clients": the node's held-out evaluation of x^{eval-version} (node.evaluate_replica)
    "eval-version",
    "heldout-loss",
    "heldout-examples",
    "task-accuracy",
    "task-examples",
)
# Optional metrics that are counts: integers >= 0 (``heldout-examples`` > 0), or flags 0/1.
COUNT_METRICS = ("steps-from-log", "truncated-examples", "dropped-examples", "malformed-examples", "oom-retries",
                 "eval-version", "heldout-examples", "task-examples", "correction-after-step")  # fmt: skip
FLAG_METRICS = ("own-data", "clientapp-imported-torch")
# Optional metrics that come together or not at all: a node's held-out evaluation, its task accuracy.
METRIC_GROUPS = (("eval-version", "heldout-loss", "heldout-examples"), ("task-accuracy", "task-examples"))


def state_intact(msg: Message) -> bool:
    """Is ``msg`` an error reply from a node that says its model state is intact?"""
    return msg.has_error() and str(msg.error.reason).startswith(STATE_INTACT)


@dataclass(frozen=True)
class Expected:
    """What a valid reply of this round looks like."""

    server_round: int
    block: int
    shapes: dict[str, tuple[int, ...]]  # the block's parameters
    max_num_examples: float  # the bound on every node's num-examples (its aggregation weight)
    max_update_norm: float = 0.0  # 0: no bound
    transfer_dtype: str = "fp32"  # the payload dtype updates travel in (records.WIRE_DTYPES)
    max_correction_drift: float = 0.0  # on-receipt: the bound on a node's reported drift (0: none)


@dataclass
class Reply:
    """A reply that passed every check: typed metrics and the update to aggregate."""

    node: int
    metrics: dict[str, float | int]
    update: core.Tensors | None  # set to None once aggregated (its memory is freed)
    trace: dict[str, str] = field(default_factory=dict)
    payload_bytes: int = 0  # the update's bytes as received

    @property
    def partition_id(self) -> int:
        return int(self.metrics["partition-id"])

    @property
    def num_examples(self) -> float:
        return float(self.metrics["num-examples"])


def parse_reply(msg: Message, expected: Expected, node: int | None = None) -> Reply | str:
    """The checked reply, or why it must not enter the aggregate. ``node``: the node the message
    went to (default: the reply's sender)."""
    if msg.has_error():
        return f"client error: {msg.error.reason}"
    content = msg.content
    arrays, metric_record = content.array_records.get("update"), content.metric_records.get("metrics")
    if arrays is None or metric_record is None:
        return "missing 'update' arrays or 'metrics'"
    metrics = read_metrics(dict(metric_record))
    if isinstance(metrics, str):
        return metrics
    if metrics["server-round"] != expected.server_round:
        return f"stale round: reply is for round {metrics['server-round']}, expected {expected.server_round}"
    if metrics["block"] != expected.block:
        return f"wrong block id {metrics['block']}, expected {expected.block}"
    bound = expected.max_num_examples  # whatever a node says of its data (own-data): the server cannot verify it
    if not 0 < metrics["num-examples"] <= bound:
        return (f"num-examples={metrics['num-examples']}, expected a number in (0, {bound:g}] "
                f"(max-num-examples, else num-examples)")  # fmt: skip
    if metrics["partition-id"] < 0:
        return f"partition-id={metrics['partition-id']}, expected >= 0"
    drift = metrics.get("correction-drift", 0.0)
    if expected.max_correction_drift > 0 and drift > expected.max_correction_drift:
        return f"correction drift {drift:.3g} above max-correction-drift={expected.max_correction_drift:g}"
    update = read_update(arrays, expected.shapes, expected.transfer_dtype)
    if isinstance(update, str):
        return update
    if expected.max_update_norm > 0:
        norm = update_norm(update)
        if norm > expected.max_update_norm:
            return f"update norm {norm:.4g} above max-update-norm={expected.max_update_norm}"
    trace = read_trace(content)
    if isinstance(trace, str):
        return trace
    return Reply(
        node=msg.metadata.src_node_id if node is None else node,
        metrics=metrics,
        update=update,
        trace=trace,
        payload_bytes=payload_bytes(update, expected.transfer_dtype),  # what the transfer dtype sends
    )


def read_metrics(metrics: dict) -> dict[str, float | int] | str:
    """The metrics the server reads, each a finite number of the right kind, or why not."""
    out: dict[str, float | int] = {}
    for key in INT_METRICS + NUMBER_METRICS + OPTIONAL_NUMBER_METRICS:
        if key not in metrics:
            if key in OPTIONAL_NUMBER_METRICS:
                continue
            return f"missing metric {key!r}"
        value = metrics[key]
        if type(value) not in (int, float) or not math.isfinite(value):
            return f"metric {key}={value!r:.40}: expected a finite number"
        if key in INT_METRICS and type(value) is not int:
            return f"metric {key}={value!r}: expected an integer"
        out[key] = value
    return check_optional(out)


def check_optional(metrics: dict[str, float | int]) -> dict[str, float | int] | str:
    """The ranges and groups of the metrics a reply may carry, checked before anything reads them:
    every number a reply carries is >= 0 (times, stamps, counts, losses), a count is an integer, a flag
    0 or 1, an accuracy at most 1, and a group (a node's evaluation) whole or absent."""
    for key, value in metrics.items():
        if value < 0 and key not in INT_METRICS + ("num-examples",):  # those two: their own messages
            return f"metric {key}={value!r}: expected >= 0"
        if key in COUNT_METRICS + FLAG_METRICS and type(value) is not int:
            return f"metric {key}={value!r}: expected an integer"
        if key in FLAG_METRICS and value not in (0, 1):
            return f"metric {key}={value}: expected 0 or 1"
    if metrics.get("heldout-examples", 1) == 0:
        return "metric heldout-examples=0: expected > 0"
    if metrics.get("task-accuracy", 0) > 1:
        return f"metric task-accuracy={metrics['task-accuracy']!r}: expected at most 1"
    for group in METRIC_GROUPS:
        present = [k for k in group if k in metrics]
        if present and len(present) < len(group):
            missing = [k for k in group if k not in metrics]
            return f"metrics {', '.join(present)} without {', '.join(missing)}: expected all or none"
    if "task-accuracy" in metrics and "heldout-loss" not in metrics:
        return "metric task-accuracy without heldout-loss: expected it with an evaluation"
    return metrics


def read_update(
    arrays: ArrayRecord, shapes: dict[str, tuple[int, ...]], transfer_dtype: str = "fp32"
) -> core.Tensors | str:
    """Deserialise the packed record once and check the payload itself (``wire.unpack``: names, shapes,
    dtype, size, int8's scales), then finiteness. The update comes back in fp32, in ``shapes``' order."""
    try:
        update = to_tensors(arrays, shapes, transfer_dtype)
    except WireError as err:
        return str(err)
    for name, tensor in update.items():
        if not all_finite(tensor):
            return f"non-finite values in {name}"
    return update


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, from the tensor's minimum and maximum: one pass that allocates
    nothing (a NaN anywhere makes both NaN, an infinity is the minimum or the maximum), where
    ``torch.isfinite(t).all()`` writes a mask as large as the tensor (30x slower on a 212 MB block,
    on the server's critical path)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def read_trace(content) -> dict[str, str] | str:
    """The client's optional trace (its local model's digest), strings only."""
    record = content.config_records.get("trace")
    if record is None:
        return {}
    trace = dict(record)
    if not all(isinstance(v, str) for v in trace.values()):
        return "trace values: expected strings"
    return trace


def update_norm(update: core.Tensors) -> float:
    """L2 norm over every tensor of an update, accumulated in float64."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in update.values()))


def check_partition(reply: Reply, seen: set[int], known: dict[int, int]) -> str | None:
    """A partition id answers once per round, and a node keeps the partition it is known by."""
    if reply.partition_id in seen:
        return f"partition-id={reply.partition_id} already answered this round"
    if known.get(reply.node, reply.partition_id) != reply.partition_id:
        return f"partition-id={reply.partition_id}, expected this node's {known[reply.node]}"
    return None


def check_own_count(reply: Reply, counts: dict[int, float]) -> str | None:
    """A site's own data does not change during a run: its ``num-examples`` stays what its first
    accepted reply claimed (within the bound every node has, ``Expected.max_num_examples``)."""
    first = counts.get(reply.partition_id)
    if reply.metrics.get("own-data") != 1 or first is None or reply.num_examples == first:
        return None
    return f"num-examples={reply.num_examples:g}, expected {first:g} (this site's count in its first accepted reply)"
