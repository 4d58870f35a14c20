"""Checking one client reply before anything on the server changes: pure functions.

A reply is judged on what it carries, not on what it declares: its packed update
(``wire.py``) is deserialised once, and its real dtype, size, layout, finiteness and
norm are checked on the very payload that the aggregation then decodes. Its metrics are read
through the message schema (``messages.metrics_from_record``: each of its kind and range), so a
malformed reply is rejected with a reason instead of crashing the round; what is checked here is
what only the round knows (its number, its block, the bounds of the run config).
``parse_reply`` returns a ``Reply`` or the reason (a string); the strategy adds
the checks that need the round's state (``check_partition``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, Message

from .. import core, wire
from ..messages import METRICS, STATE_INTACT, TRACE, UPDATE, TrainMetrics, metrics_from_record
from ..records import WireError, to_tensors
from ..wire import payload_bytes


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
    max_update_norm: float = 0.0  # 0: no bound (the run's -1 is resolved by the algorithm: ``honest_update_bound``)
    transfer_dtype: str = "fp32"  # the payload dtype updates travel in (records.WIRE_DTYPES)
    max_correction_drift: float = 0.0  # on-receipt: the bound on a node's reported drift (0: none)


# Adam's step per coordinate, |m̂ / sqrt(v̂)|, is at most (1 - β1) * sqrt(1 / ((1 - β2) (1 - β1² / β2))) with
# torch's default betas (0.9, 0.999): Cauchy-Schwarz over the moving averages gives 7.27, rounded up.
ADAM_STEP_BOUND = 7.3


def honest_update_bound(
    numel: int, local_steps: int, learning_rate: float, weight_decay: float, x_norm: float
) -> float:
    """The L2 norm that no honest node's update of a block of ``numel`` values reaches (``max-update-norm = -1``):
    each of the ``local_steps`` AdamW steps moves a value by at most ``learning-rate`` (the schedule's factor is at
    most 1) times ``ADAM_STEP_BOUND``, plus the decoupled weight decay of a block whose norm is ``x_norm`` at most
    grown by those steps. An honest update's norm is several times below it (steady gradients: about a seventh),
    a forged or diverged one far above; error feedback adds at most one rounding step (1 %)."""
    steps = local_steps * learning_rate * ADAM_STEP_BOUND * math.sqrt(numel)
    return 1.01 * (steps + local_steps * learning_rate * weight_decay * (x_norm + steps))


@dataclass
class Reply:
    """A reply that passed every check: typed metrics and the update to aggregate."""

    node: int
    metrics: TrainMetrics
    update: core.Tensors | None  # set to None once aggregated (its memory is freed)
    trace: dict[str, str] = field(default_factory=dict)
    payload_bytes: int = 0  # the update's bytes as received
    # Differential privacy: its update's clip factor (``ServerPrivacy.clip_scale``; None: left as it is), found
    # as it was checked (``clip_scale_found``), for the server's one pass.
    clip_scale: float | None = None
    clip_scale_found: bool = False

    @property
    def partition_id(self) -> int:
        return self.metrics.partition_id

    @property
    def num_examples(self) -> float:
        return float(self.metrics.num_examples)


def parse_reply(
    msg: Message, expected: Expected, node: int | None = None, norm: float | str | None = None
) -> Reply | str:
    """The checked reply, or why it must not enter the aggregate. ``node``: the node the message
    went to (default: the reply's sender). ``norm``: ``checked_norm`` of its update, found as the update's very
    bytes landed (``FedBCD.norm_ahead``); None: found here."""
    if msg.has_error():
        return f"client error: {msg.error.reason}"
    content = msg.content
    arrays, metric_record = content.array_records.get(UPDATE), content.metric_records.get(METRICS)
    if arrays is None or metric_record is None:
        return f"missing {UPDATE!r} arrays or {METRICS!r}"
    metrics = metrics_from_record(TrainMetrics, dict(metric_record))
    if isinstance(metrics, str):
        return metrics
    if metrics.server_round != expected.server_round:
        return f"stale round: reply is for round {metrics.server_round}, expected {expected.server_round}"
    if metrics.block != expected.block:
        return f"wrong block id {metrics.block}, expected {expected.block}"
    bound = expected.max_num_examples  # whatever a node says of its data (own-data): the server cannot verify it
    if not 0 < metrics.num_examples <= bound:
        return (f"num-examples={metrics.num_examples}, expected a number in (0, {bound:g}] "
                f"(max-num-examples, else num-examples)")  # fmt: skip
    drift = metrics.correction_drift or 0.0
    if expected.max_correction_drift > 0 and drift > expected.max_correction_drift:
        return f"correction drift {drift:.3g} above max-correction-drift={expected.max_correction_drift:g}"
    update = read_update(arrays, expected.shapes, expected.transfer_dtype)
    if isinstance(update, str):
        return update
    norm = checked_norm(update) if norm is None else norm
    if isinstance(norm, str):
        return norm
    if expected.max_update_norm > 0 and norm > expected.max_update_norm:
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


def read_update(
    arrays: ArrayRecord, shapes: dict[str, tuple[int, ...]], transfer_dtype: str = "fp32"
) -> wire.Decoded | str:
    """Deserialise the packed record once and check the payload itself (``wire.unpack``: names, shapes,
    dtype, size, int8's scales). The update comes back undecoded (``wire.Decoded``, in ``shapes``' order, fp32
    as views of the record's payload, to be read only): the strategy reads the update it combines from the
    record itself (into the round's sum)."""
    try:
        return to_tensors(arrays, shapes, transfer_dtype, read_only=True, lazy=True)
    except WireError as err:
        return str(err)


def checked_norm(update: core.Tensors) -> float | str:
    """The update's L2 norm (accumulated in float64), or why it is refused: a non-finite value (a NaN or an
    infinity makes its tensor's sum of squares non-finite; a finite fp32 value's square never overflows
    float64). One pass over the values as they came (``core.sum_of_squares``): int8's from its integers and
    scales, other dtypes decoded chunk by chunk into one small buffer that stays in cache; no block in fp32, no
    float64 copy (fresh block-sized memory costs more than the pass itself)."""
    total = 0.0
    for name in update:
        squares = core.sum_of_squares(update, name)
        if not math.isfinite(squares):
            return f"non-finite values in {name}"
        total += squares
    return math.sqrt(total)


def read_trace(content) -> dict[str, str] | str:
    """The client's optional trace (its local model's digest), strings only."""
    record = content.config_records.get(TRACE)
    if record is None:
        return {}
    trace = dict(record)
    if not all(isinstance(v, str) for v in trace.values()):
        return "trace values: expected strings"
    return trace


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
    if reply.metrics.own_data != 1 or first is None or reply.num_examples == first:
        return None
    return f"num-examples={reply.num_examples:g}, expected {first:g} (this site's count in its first accepted reply)"
