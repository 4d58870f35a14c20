"""What crosses a process boundary, spelled once: a round's message and its reply, the evaluation
reply, the partition query, and the frames between a ClientApp and its node worker.

Every key is derived here from a field name (``server_round`` travels as ``server-round``) or named
here as a constant; no other module writes one (``tests/test_messages.py`` checks it). Each message
is a typed dataclass with a ``to_*`` and a ``from_*``: the sender builds the dataclass, the receiver
gets the dataclass or a one-line reason, never a ``KeyError`` from a field a peer left out.

Neither torch nor Flower is imported: the torch-free ClientApp relay and the Flower-free node worker
read this module too. A block's tensors travel in records of their own beside these fields
(``BLOCK_RECORDS``), packed as ``wire.py`` says.

| message                       | dataclass         | carried as                                  |
|-------------------------------|-------------------|---------------------------------------------|
| round r, server -> node       | ``RoundConfig``   | the ``round`` config record + block records |
| a node's update, node -> server | ``TrainMetrics`` | the ``metrics`` record + ``update`` + ``trace`` |
| the final evaluation's reply  | ``EvaluateReply`` | the ``metrics`` record (``EvaluateMetrics`` flat) |
| which partition a node serves | ``PartitionAnswer`` | the ``node`` record of a QUERY reply      |
| direct transport, server -> node | ``TransportOffer`` | the ``stream-offer`` record, for block records |
| direct transport, node -> server | ``UpdateCommit`` | the ``stream-commit`` record, for ``update``   |
| ClientApp -> node worker      | ``WorkerRequest`` | a frame's JSON header (``worker/protocol.py``) |
| node worker -> ClientApp      | ``WorkerReply``   | a frame's JSON header                       |
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from .versions import PROTOCOL_VERSION

# ------------------------------------------------------------------ record names
ROUND = "round"  # the round's config record (``RoundConfig``)
GLOBAL_STEP = "global-step"  # g^{r-1}
CATCH_UP = "catch-up"  # the steps a node missed, each tensor named ``v{k}/{param}`` (``catch_up_name``)
SYNC_VALUES = "sync-values"  # a full sync: x^{r-2}'s values of every block
RESUME_PENDING = "resume-pending"  # a resumed server hands a node its own Δ_i^R back
BLOCK_RECORDS = (GLOBAL_STEP, CATCH_UP, SYNC_VALUES, RESUME_PENDING)  # the records of tensors a message may carry
UPDATE = "update"  # a node's Δ_i^r
METRICS = "metrics"  # a reply's numbers (``TrainMetrics``, ``EvaluateMetrics``)
TRACE = "trace"  # a reply's strings: its local model's digest (``verify-invariant``)
LOCAL_MODEL_DIGEST = "local-model-sha256"  # the trace's one key
NODE = "node"  # the QUERY reply's record (``PartitionAnswer``)
PROTOCOL_KEY = "protocol-version"  # in every round config and every worker frame (``versions.mismatch``)
TRAIN, EVALUATE, PING = "train", "evaluate", "ping"  # what a worker request asks (``WorkerRequest.op``)
OFFER = "stream-offer"  # transport = "direct": where the message's block records wait (``TransportOffer``)
COMMIT = "stream-commit"  # transport = "direct": the update a reply commits, moved on the stream (``UpdateCommit``)
# An error reply whose reason starts with this says the node's model state is intact (a refused message,
# out of memory, a data error): the server keeps that node's sync state (``node.StateIntact``).
STATE_INTACT = "state-intact: "
# In a node's error reply: it could not fetch the message's records from the stream (its state is intact);
# the server sends that node's next messages with their records on Flower's path.
STREAM_UNUSABLE = "the direct transport's stream is unusable here: "
# transport = "direct": a message pushed a round ahead, whose content the node's worker (or, without one, its
# ClientApp) downloads from the stream once the server has built it (its offer's ``message_*``;
# ``message_content``, ``message_bytes.content_ahead``).
MESSAGE_AHEAD = "stream-message-ahead"
# In the error reply to a message pushed ahead that the server then withdrew (its node not messaged in that
# round, or messaged on Flower's path): the server drops it uncounted.
WITHDRAWN = "withdrawn by the server: "
MAX_REPLY_CONTENT = 1 << 18  # a train reply's content on the stream (its metrics, trace and commit), at most
MAX_MESSAGE_CONTENT = 1 << 20  # a message's content on the stream: config records only (no tensors), at most


class MessageError(ValueError):
    """A message that does not hold what its kind must: the text is one line naming the field."""


def key(name: str) -> str:
    """The key a field travels under: ``server_round`` -> ``server-round``."""
    return name.replace("_", "-")


def _fields(cls) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.name != "extra")


# ------------------------------------------------------------------ server -> node
@dataclass(frozen=True)
class RoundConfig:
    """Round r's control data for one node: which block to train, which step the message brings, what
    else to do (evaluate, take a full sync or a hand-back, resume), all of it small numbers and names.
    The tensors come in ``BLOCK_RECORDS`` beside it."""

    server_round: int
    block: int = -1  # b_r (-1: the final evaluation trains nothing)
    step_block: int = -1  # b_{r-1}, the block of the global step the message brings (-1: round 1)
    next_block: int = -1  # b_{r+1}, for a node worker to start early (-1: none)
    algorithm: str = ""  # the client half to run (``strategies.CLIENT_HALVES``)
    run_dir: str = ""  # the server's run folder (simulation: the step log an actor catches up from)
    protocol_version: int = PROTOCOL_VERSION
    evaluate_version: int | None = None  # evaluation = "clients": evaluate x^v ...
    evaluate_generate: bool = False  # ... and generate answers for the task accuracy
    resumed_after: int | None = None  # a resumed run: the round R its checkpoint holds ...
    resume_dir: str = ""  # ... and its folder, resolved by the server
    sync_version: int | None = None  # a full sync: drop the node's own state; SYNC_VALUES hold x^v
    sync_keeps_state: bool = False  # ... but keep it: x's values after a resume, to a worker that starts at x^0
    catch_up_versions: tuple[int, ...] = ()  # the steps in CATCH_UP ...
    catch_up_blocks: tuple[int, ...] = ()  # ... and their blocks
    resume_pending_block: int | None = None  # RESUME_PENDING's block ...
    resume_pending_version: int | None = None  # ... and the version it is an offset from

    def to_config(self) -> dict[str, Any]:
        """The config record's entries: a field left at None (or an empty list) is not sent."""
        out: dict[str, Any] = {}
        for f in _fields(self):
            value = getattr(self, f.name)
            if value is None or value == () or (f.name == "evaluate_generate" and self.evaluate_version is None):
                continue
            if f.name == "sync_keeps_state" and not value:  # said only where it holds: a message as before
                continue
            out[key(f.name)] = list(value) if isinstance(value, tuple) else int(value) if type(value) is bool else value
        return out

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RoundConfig:
        """The round config a node received; ``MessageError`` names the first field of the wrong kind
        (a server of another release sends another ``protocol-version``: ``versions.mismatch`` first)."""
        values: dict[str, Any] = {}
        for f in _fields(cls):
            name = key(f.name)
            if name not in config:
                if f.default is dataclasses.MISSING:
                    raise MessageError(f"round config: {name} missing")
                continue
            values[f.name] = _typed("round config", name, config[name], f.type)
        if len(values.get("catch_up_versions", ())) != len(values.get("catch_up_blocks", ())):
            raise MessageError("round config: catch-up-versions and catch-up-blocks differ in length")
        return cls(**values)


def _typed(where: str, name: str, value: Any, annotation: str) -> Any:
    """``value`` as the field's type (from its annotation's text), or ``MessageError``."""
    if annotation.startswith("tuple"):
        if not isinstance(value, list | tuple) or not all(type(v) is int for v in value):
            raise MessageError(f"{where}: {name}={value!r:.40} expected a list of integers")
        return tuple(value)
    if annotation.startswith("int") or annotation == "bool":
        if type(value) is not int:
            raise MessageError(f"{where}: {name}={value!r:.40} expected an integer")
        return bool(value) if annotation == "bool" else value
    if annotation == "str":
        if not isinstance(value, str):
            raise MessageError(f"{where}: {name}={value!r:.40} expected a string")
        return value
    raise TypeError(f"{annotation}: not a message field type")  # a field added here without a reader


def catch_up_name(version: int, param: str) -> str:
    """A missed step's tensor in ``CATCH_UP``."""
    return f"v{version}/{param}"


def catch_up_step(tensors: Mapping[str, Any], version: int) -> Mapping[str, Any]:
    """Step ``g^version``'s tensors out of ``CATCH_UP``'s (``catch_up_name``), read through: a node's records
    decode a tensor only when it is applied (``wire.Decoded``), so k missed steps are not k blocks in fp32."""
    return CatchUpStep(tensors, f"v{version}/")


class CatchUpStep(Mapping):
    """The tensors of ``tensors`` named ``prefix`` + a parameter's name, by the parameter's name."""

    def __init__(self, tensors: Mapping[str, Any], prefix: str):
        self.tensors = tensors
        self.names = {n[len(prefix) :]: n for n in tensors if n.startswith(prefix)}  # parameter -> record name

    def __getitem__(self, name: str) -> Any:
        return self.tensors[self.names[name]]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names


# ------------------------------------------------------------------ node -> server
# The kinds of reply metrics (a field's ``metadata["kind"]``); each is checked on arrival.
INT = "int"  # an integer, compared with what the server sent
NUMBER = "number"  # a finite number >= 0: times, stamps, losses
COUNT = "count"  # an integer >= 0
FLAG = "flag"  # 0 or 1


def _metric(kind: str, default: Any = None) -> Any:
    return field(default=default, metadata={"kind": kind})


@dataclass(frozen=True)
class EvaluateMetrics:
    """A node's held-out evaluation of ``x^eval_version`` (``evaluation = "clients"``): inside round
    ``eval_version + 1``'s reply, or alone after the last round."""

    eval_version: int = _metric(COUNT, dataclasses.MISSING)
    heldout_loss: float = _metric(NUMBER, dataclasses.MISSING)
    heldout_examples: int = _metric(COUNT, dataclasses.MISSING)  # > 0
    task_accuracy: float | None = _metric(NUMBER)  # at most 1, with task_examples: exact answers only
    task_examples: int | None = _metric(COUNT)

    def check(self) -> str | None:
        if self.heldout_examples == 0:
            return "metric heldout-examples=0: expected > 0"
        if (self.task_accuracy is None) != (self.task_examples is None):
            return "metrics task-accuracy and task-examples: expected both or neither"
        if self.task_accuracy is not None and self.task_accuracy > 1:
            return f"metric task-accuracy={self.task_accuracy!r}: expected at most 1"
        return None


@dataclass(frozen=True)
class TrainMetrics:
    """What a node says of its round-r update (the update itself is the ``UPDATE`` record).

    The first seven fields come with every update; the rest are optional: the node's timeline (node
    worker, ClientApp), its data's counts, its correction, and its evaluation of ``x^{r-1}`` when the
    round asked for one. A site's rows never appear here: numbers only."""

    server_round: int = _metric(INT, dataclasses.MISSING)
    block: int = _metric(INT, dataclasses.MISSING)
    partition_id: int = _metric(INT, dataclasses.MISSING)  # >= 0
    base_version: int = _metric(INT, dataclasses.MISSING)  # v: the update was trained from x^v (+ pending)
    num_examples: float = _metric(NUMBER, dataclasses.MISSING)  # its weight: bounded by the server
    train_loss: float = _metric(NUMBER, dataclasses.MISSING)
    compute_s: float = _metric(NUMBER, dataclasses.MISSING)
    # The data: rows cut at max-seq-len, dropped before their answer, skipped as malformed; own data.
    truncated_examples: int | None = _metric(COUNT)
    dropped_examples: int | None = _metric(COUNT)
    malformed_examples: int | None = _metric(COUNT)
    own_data: int | None = _metric(FLAG)  # 1: num-examples is the site's own claim
    oom_retries: int | None = _metric(COUNT)  # 1: redone with half the micro-batch
    dp_clipped: int | None = _metric(FLAG)  # dp-mode = "central": 1 if the node clipped its update (local: not sent)
    # The client half's rule: after which local step the correction reached the computation; on-receipt's drift.
    correction_after_step: int | None = _metric(COUNT)
    correction_drift: float | None = _metric(NUMBER)
    # The timeline (wall-clock seconds, comparable on one host): node runtime, node worker, ClientApp.
    compute_start: float | None = _metric(NUMBER)
    compute_end: float | None = _metric(NUMBER)
    waited_s: float | None = _metric(NUMBER)  # for the computation running ahead
    request_received: float | None = _metric(NUMBER)
    prev_reply_sent: float | None = _metric(NUMBER)
    clientapp_start: float | None = _metric(NUMBER)
    clientapp_handler_start: float | None = _metric(NUMBER)  # Flower has pulled and deserialised the message
    clientapp_sent: float | None = _metric(NUMBER)  # the request's last byte is in the worker's socket
    clientapp_reply: float | None = _metric(NUMBER)
    clientapp_pull_cpu_s: float | None = _metric(NUMBER)  # the ClientApp's CPU seconds at its handler's start ...
    clientapp_cpu_s: float | None = _metric(NUMBER)  # ... and at its reply
    worker_cpu_s: float | None = _metric(NUMBER)  # the node worker's CPU seconds (every thread), before its upload
    # Where the node worker's own work of the round went, leg by leg (seconds, wall-clock): its records in hand
    # after the request came (on the stream: the step fetched, or waited for where it was fetched ahead); the
    # update moved ahead waited for (its computation, rounding and upload, where they still ran); g applied to
    # the replica before a computation started now (none when it ran ahead), the update rounded to
    # transfer-dtype with error feedback (none when rounded ahead), the correction, the upload on the stream
    # (none when it moved ahead; a fallback's failed attempt), the residual's durable write waited for after it.
    records_fetch_s: float | None = _metric(NUMBER)
    ahead_wait_s: float | None = _metric(NUMBER)
    step_apply_s: float | None = _metric(NUMBER)
    rounding_s: float | None = _metric(NUMBER)
    correction_s: float | None = _metric(NUMBER)
    upload_s: float | None = _metric(NUMBER)
    residual_wait_s: float | None = _metric(NUMBER)
    clientapp_imported_torch: int | None = _metric(FLAG)
    # Simulation: steps an actor read from the server's step log, and the process that computed.
    steps_from_log: int | None = _metric(COUNT)
    process_id: int | None = _metric(COUNT)
    # The peak resident memory of the process that computed the update, so far (the worker's; an actor's).
    peak_rss_bytes: int | None = _metric(COUNT)
    # transport = "direct": 1 when this update came on Flower's path because the node could not use the stream.
    direct_fallbacks: int | None = _metric(COUNT)
    # ... 1 when this update moved on the stream before the round's message came (the reply commits it) ...
    direct_update_ahead: int | None = _metric(FLAG)
    # ... 1 when the round's global step was fetched before its message came (and matched the message's digest).
    direct_step_prefetched: int | None = _metric(FLAG)
    # ... 1 when the worker took the round's content from the stream itself and started the round with it.
    direct_content_fetched: int | None = _metric(FLAG)
    evaluation: EvaluateMetrics | None = None  # of x^{r-1}, when round r asked (its fields travel flat)

    def check(self) -> str | None:
        if self.partition_id < 0:
            return f"metric partition-id={self.partition_id}: expected >= 0"
        return None if self.evaluation is None else self.evaluation.check()


# The node worker's own legs of a round, as ``TrainMetrics`` names them, in a round's order (the rest of its time
# there is the computation, and what no leg names: the reply's metrics and digests, the update packed, the reply's
# own upload on the stream, the next round's start).
WORKER_LEGS = ("records_fetch_s", "ahead_wait_s", "step_apply_s", "rounding_s", "correction_s", "upload_s",
               "residual_wait_s")  # fmt: skip


def metrics_to_record(metrics: TrainMetrics | EvaluateMetrics, **extra: float | int) -> dict[str, float | int]:
    """The ``METRICS`` record's entries: every field that is set, an evaluation's flat beside them."""
    out: dict[str, float | int] = {}
    for f in dataclasses.fields(metrics):
        value = getattr(metrics, f.name)
        if isinstance(value, EvaluateMetrics):
            out.update(metrics_to_record(value))
        elif value is not None:
            out[key(f.name)] = value
    return {**out, **extra}


def metrics_from_record(cls: type, record: Mapping[str, Any]) -> Any:
    """The reply's metrics as ``cls`` (``TrainMetrics`` or ``EvaluateMetrics``), each value of its kind,
    or one line saying which is not. Keys this release does not know are ignored."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "evaluation":
            values[f.name] = _evaluation_in(record)
            if isinstance(values[f.name], str):
                return values[f.name]
            continue
        name = key(f.name)
        if name not in record:
            if f.default is dataclasses.MISSING:
                return f"missing metric {name!r}"
            continue
        value = _metric_value(name, record[name], f.metadata["kind"])
        if isinstance(value, str):  # the reason: a metric is never a string
            return value
        values[f.name] = value
    metrics = cls(**values)
    problem = metrics.check()
    return metrics if problem is None else problem


def _evaluation_in(record: Mapping[str, Any]) -> EvaluateMetrics | None | str:
    """A train reply's evaluation: all of its fields or none."""
    names = [key(f.name) for f in dataclasses.fields(EvaluateMetrics) if f.default is dataclasses.MISSING]
    present = [n for n in names if n in record]
    if not present:
        extra = [key(f.name) for f in dataclasses.fields(EvaluateMetrics) if key(f.name) in record]
        return f"metric {extra[0]} without heldout-loss: expected it with an evaluation" if extra else None
    if len(present) < len(names):
        missing = [n for n in names if n not in present]
        return f"metrics {', '.join(present)} without {', '.join(missing)}: expected all or none"
    return metrics_from_record(EvaluateMetrics, record)


def _metric_value(name: str, value: Any, kind: str) -> Any:
    """``value`` if it is of ``kind``, else the reason (a string: metrics are never strings)."""
    if type(value) not in (int, float) or not math.isfinite(value):
        return f"metric {name}={value!r:.40}: expected a finite number"
    if kind in (INT, COUNT, FLAG) and type(value) is not int:
        return f"metric {name}={value!r}: expected an integer"
    if kind != INT and name != "num-examples" and value < 0:  # num-examples: the server's bound says more
        return f"metric {name}={value!r}: expected >= 0"
    if kind == FLAG and value not in (0, 1):
        return f"metric {name}={value}: expected 0 or 1"
    return value


def stamped(record: Mapping[str, Any], **fields: float | int) -> dict[str, Any]:
    """A ``METRICS`` record with more ``TrainMetrics`` fields set, by field name: a hop adds its own numbers
    (the ClientApp's timeline) to what the node sent without reading it. A name that is no field raises."""
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(TrainMetrics)})
    if unknown:
        raise TypeError(f"not TrainMetrics fields: {', '.join(unknown)}")
    return {**record, **{key(name): value for name, value in fields.items()}}


@dataclass(frozen=True)
class EvaluateReply:
    """The reply to the final evaluation (``evaluation = "clients"``): which partition evaluated, and how."""

    partition_id: int
    evaluation: EvaluateMetrics

    def to_record(self) -> dict[str, float | int]:
        return metrics_to_record(self.evaluation, **{key("partition_id"): self.partition_id})

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> EvaluateReply | str:
        """The reply, or one line saying what is wrong with it."""
        partition_id = record.get(key("partition_id"))
        if type(partition_id) is not int or partition_id < 0:
            return f"metric partition-id={partition_id!r:.40}: expected an integer >= 0"
        evaluation = metrics_from_record(EvaluateMetrics, record)
        return evaluation if isinstance(evaluation, str) else cls(partition_id, evaluation)


@dataclass(frozen=True)
class PartitionAnswer:
    """A node's answer to the partition query (QUERY): the data partition it serves. A resumed server
    maps its new node ids to the clients' checkpointed state with it."""

    partition_id: int

    def to_record(self) -> dict[str, int]:
        return {key("partition_id"): self.partition_id}

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> PartitionAnswer | None:
        value = None if record is None else record.get(key("partition_id"))
        return cls(value) if type(value) is int and value >= 0 else None


# ------------------------------------------------------------------ transport = "direct" (docs/transport.md)
MAX_ID = 2**64 - 1  # Flower's run and node ids are uint64: they travel as text (a config record's int is int64)
MAX_SIZE = 2**63 - 1
MAX_CA_PEM = 64 * 1024
_HEX64 = frozenset("0123456789abcdef")


class RecordOffer(NamedTuple):
    """One of a message's block records, waiting on the stream: which record of ``BLOCK_RECORDS`` it stands
    for, its name on the service, its size and SHA-256 (hex; what the node checks before it uses a byte),
    and the node's download capability (hex). It travels as ``TransportOffer``'s parallel ``records-*`` lists."""

    record: str
    name: str
    size: int
    sha256: str
    token: str

    def __repr__(self) -> str:  # the capability is a secret: never in a repr, a log line or an error
        return f"RecordOffer(record={self.record!r}, name={self.name!r}, size={self.size}, sha256={self.sha256!r})"


@dataclass(frozen=True)
class TransportOffer:
    """What a round's message says of the stream, for one node and round: where it is, the CA to trust (the
    message is authenticated by Flower: the CA is as trusted as the capabilities beside it), the block
    records waiting there, and the capability to upload this round's update (its name and size bound)."""

    address: str
    run_id: int
    node_id: int
    server_round: int
    ca_pem: str = ""  # "" only with insecure
    insecure: bool = False
    records: tuple[RecordOffer, ...] = ()
    upload_name: str = ""  # "" when the message asks for no update (the final evaluation)
    upload_token: str = field(default="", repr=False)  # a secret: never in a repr, a log line or an error
    upload_max_size: int = 0
    # A capability to upload the round's reply itself (its content: metrics, trace and the update's commit) once
    # the update is up, so that the server aggregates it without waiting for Flower's reply, which then trails
    # as its audit (``transport-replies-on-stream``; "" when not offered).
    reply_name: str = ""
    reply_token: str = field(default="", repr=False)  # a secret: never in a repr, a log line or an error
    # One round ahead (``server_round + 1``), so that the bytes move before that round's message comes: a
    # capability to upload the node's next update into that round's slot, and one to download that round's
    # global step as soon as the server publishes it (its size and SHA-256 come in that round's offer).
    ahead_upload_name: str = ""  # "" when none is offered (the last round, a node on Flower's path)
    ahead_upload_token: str = field(default="", repr=False)  # a secret: never in a repr, a log line or an error
    ahead_upload_max_size: int = 0
    ahead_step_name: str = ""
    ahead_step_token: str = field(default="", repr=False)  # a secret: never in a repr, a log line or an error
    ahead_step_max_size: int = 0
    # And one to download that round's message content (as ``message_*`` name it, below) as soon as the server
    # has built it, so that the node's worker starts that round from the stream itself: Flower's delivery and
    # the ClientApp's start leave the critical path (the message pushed ahead still brings the reply's way back).
    ahead_message_name: str = ""
    ahead_message_token: str = field(default="", repr=False)  # a secret: never in a repr, a log line or an error
    ahead_message_key: str = field(default="", repr=False)  # a secret: never in a repr, a log line or an error
    # A message pushed a round ahead (``MESSAGE_AHEAD``): its content waits on the stream under this name until
    # the server has built it (``message_content``), so that Flower delivers the message and starts the node's
    # ClientApp while the previous round is still being aggregated.
    message_name: str = ""
    message_token: str = field(default="", repr=False)  # a secret: never in a repr, a log line or an error
    message_max_size: int = 0
    message_key: str = field(default="", repr=False)  # 64 hex: the content's HMAC-SHA256 key (``message_bytes``)

    def to_config(self) -> dict[str, Any]:
        """The ``transport`` config record: the records as parallel lists (``records-name``, ...)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "records":
                for sub in RecordOffer._fields:
                    out[key(f"records_{sub}")] = [getattr(r, sub) for r in value]
            else:
                out[key(f.name)] = str(value) if f.name in ("run_id", "node_id") else value
        return out

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TransportOffer:
        """The offer a node received, every field checked (``MessageError`` names the first that is not)."""
        get = _Reader("transport offer", config)
        lists = {sub: get.list(key(f"records_{sub}")) for sub in RecordOffer._fields}
        if len({len(v) for v in lists.values()}) != 1 or len(lists["record"]) > len(BLOCK_RECORDS):
            raise MessageError(f"transport offer: records-* lists of lengths {[len(v) for v in lists.values()]}: "
                               f"expected equal, at most {len(BLOCK_RECORDS)}")  # fmt: skip
        records = tuple(
            RecordOffer(
                record=get.check("records-record", r, r in BLOCK_RECORDS, f"one of {', '.join(BLOCK_RECORDS)}"),
                name=get.check("records-name", n, _record_name(n), "1-128 of A-Z a-z 0-9 _ . : / -"),
                size=get.check("records-size", z, type(z) is int and 0 <= z <= MAX_SIZE, "a size in bytes"),
                sha256=get.check("records-sha256", h, _hex64(h), "64 lowercase hex digits"),
                token=get.check("records-token", t, _hex64(t), "64 lowercase hex digits", secret=True),
            )
            for r, n, z, h, t in zip(*lists.values())
        )
        if len({r.record for r in records}) != len(records):
            raise MessageError("transport offer: records-record names a record twice")
        offer = cls(
            address=get.text("address", 1, 300),
            run_id=get.id("run-id"),
            node_id=get.id("node-id"),
            server_round=get.int("server-round", 0, MAX_ID),
            ca_pem=get.text("ca-pem", 0, MAX_CA_PEM),
            insecure=get.bool("insecure"),
            records=records,
            upload_name=get.text("upload-name", 0, 128),
            upload_token=get.text("upload-token", 0, 64, secret=True),
            upload_max_size=get.int("upload-max-size", 0, MAX_SIZE),
            reply_name=get.text("reply-name", 0, 128),
            reply_token=get.text("reply-token", 0, 64, secret=True),
            ahead_upload_name=get.text("ahead-upload-name", 0, 128),
            ahead_upload_token=get.text("ahead-upload-token", 0, 64, secret=True),
            ahead_upload_max_size=get.int("ahead-upload-max-size", 0, MAX_SIZE),
            ahead_step_name=get.text("ahead-step-name", 0, 128),
            ahead_step_token=get.text("ahead-step-token", 0, 64, secret=True),
            ahead_step_max_size=get.int("ahead-step-max-size", 0, MAX_SIZE),
            ahead_message_name=get.text("ahead-message-name", 0, 128),
            ahead_message_token=get.text("ahead-message-token", 0, 64, secret=True),
            ahead_message_key=get.text("ahead-message-key", 0, 64, secret=True),
            message_name=get.text("message-name", 0, 128),
            message_token=get.text("message-token", 0, 64, secret=True),
            message_max_size=get.int("message-max-size", 0, MAX_MESSAGE_CONTENT),
            message_key=get.text("message-key", 0, 64, secret=True),
        )
        offer.check_pairs()
        return offer

    def check_pairs(self) -> None:
        """Each capability named with a well-formed token (and a message's key), and exactly one of a CA or
        insecure; ``MessageError`` names the first that is not."""
        for what, name, token in (("upload", self.upload_name, self.upload_token),
                                  ("reply", self.reply_name, self.reply_token),
                                  ("ahead-upload", self.ahead_upload_name, self.ahead_upload_token),
                                  ("ahead-step", self.ahead_step_name, self.ahead_step_token),
                                  ("ahead-message", self.ahead_message_name, self.ahead_message_token),
                                  ("message", self.message_name, self.message_token)):  # fmt: skip
            if name and not (_record_name(name) and _hex64(token)):
                raise MessageError(f"transport offer: {what}-name or {what}-token malformed: expected a record "
                                   f"name and 64 lowercase hex digits")  # fmt: skip
        for what, name, secret in (("message", self.message_name, self.message_key),
                                   ("ahead-message", self.ahead_message_name, self.ahead_message_key)):  # fmt: skip
            if name and not _hex64(secret):
                raise MessageError(f"transport offer: {what}-key malformed: expected 64 lowercase hex digits")
        if self.insecure == bool(self.ca_pem):
            raise MessageError("transport offer: expected a CA certificate (ca-pem) or insecure, exactly one")


@dataclass(frozen=True)
class UpdateCommit:
    """A reply's update, moved on the stream: its size and SHA-256 (hex). The server aggregates only the
    uploaded bytes whose digest is this one, which Flower's node authentication vouches for."""

    update_size: int
    update_sha256: str

    def to_config(self) -> dict[str, Any]:
        return {key(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> UpdateCommit:
        get = _Reader("update commit", config)
        name = key("update_sha256")
        sha256 = get.text(name, 64, 64)
        if not _hex64(sha256):
            raise MessageError(f"update commit: {name}={sha256!r:.40} expected 64 lowercase hex digits")
        return cls(update_size=get.int(key("update_size"), 0, MAX_SIZE), update_sha256=sha256)


def _hex64(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX64


def _record_name(value: Any) -> bool:
    allowed = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:/-"
    return isinstance(value, str) and 1 <= len(value) <= 128 and all(c in allowed for c in value)


class _Reader:
    """Strict reads of a config record a peer sent: each value of its type and range, or one
    ``MessageError`` line naming the field (a capability's value is never echoed)."""

    def __init__(self, where: str, config: Mapping[str, Any]):
        self.where, self.config = where, config

    def _get(self, name: str) -> Any:
        if name not in self.config:
            raise MessageError(f"{self.where}: {name} missing")
        return self.config[name]

    def check(self, name: str, value: Any, ok: bool, expected: str, secret: bool = False) -> Any:
        if not ok:
            shown = "(hidden)" if secret else f"{value!r:.40}"
            raise MessageError(f"{self.where}: {name}={shown} expected {expected}")
        return value

    def text(self, name: str, low: int, high: int, secret: bool = False) -> str:
        value = self._get(name)
        return self.check(name, value, isinstance(value, str) and low <= len(value) <= high,
                          f"a string of {low}-{high} characters", secret)  # fmt: skip

    def int(self, name: str, low: int, high: int) -> int:
        value = self._get(name)
        return self.check(name, value, type(value) is int and low <= value <= high, f"an integer in [{low}, {high}]")

    def id(self, name: str) -> int:
        value = self._get(name)
        ok = isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20
        return int(self.check(name, value, ok and int(value) <= MAX_ID, "a decimal id in [0, 2**64 - 1]"))

    def bool(self, name: str) -> bool:
        value = self._get(name)
        return bool(self.check(name, value, type(value) in (bool, int) and value in (0, 1), "true or false"))

    def list(self, name: str) -> list:
        value = self._get(name)
        return list(self.check(name, value, isinstance(value, list | tuple), "a list"))


# ------------------------------------------------------------------ ClientApp <-> node worker
@dataclass(frozen=True)
class WorkerRequest:
    """A frame's header from the ClientApp to its node worker: the round's message without its tensors
    (they follow the header as ``record/array``, ``relay_name``), and who asks."""

    OPS: ClassVar[tuple[str, ...]] = (TRAIN, EVALUATE, PING)

    op: str
    run_id: int = 0
    run_config: dict = field(default_factory=dict)
    round: dict = field(default_factory=dict)  # ``RoundConfig.to_config``: the worker reads it with ``from_config``
    partition_id: int = 0
    num_partitions: int = 1
    node: dict = field(default_factory=dict)  # the node config's settings (``node.settings.NodeSettings.as_header``)
    stream_offer: dict = field(default_factory=dict)  # ``TransportOffer.to_config`` (transport = "direct"), or empty
    OPTIONAL: ClassVar[tuple[str, ...]] = ("stream_offer",)  # fields a header may leave out (empty)

    def to_header(self) -> dict[str, Any]:
        return {key(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> WorkerRequest:
        op = header.get("op", TRAIN)
        if op not in cls.OPS:
            raise MessageError(f"worker request: op={op!r:.40} expected one of {', '.join(cls.OPS)}")
        if op == PING:
            return cls(op)
        values: dict[str, Any] = {"op": op}
        for f in dataclasses.fields(cls):
            name = key(f.name)
            if f.name == "op":
                continue
            if name not in header:
                if f.name in cls.OPTIONAL:
                    continue
                raise MessageError(f"worker request: {name} missing")
            value, expected = header[name], {"dict": dict, "int": int}[f.type]
            if type(value) is not expected or (expected is int and value < 0):
                kind = "a mapping" if expected is dict else "an integer >= 0"
                raise MessageError(f"worker request: {name}={value!r:.40} expected {kind}")
            values[f.name] = value
        return cls(**values)

    @staticmethod
    def run_of(header: Mapping[str, Any]) -> int | None:
        """The run a header names, before the rest is read (the worker bounds a frame's arrays by its run)."""
        value = header.get(key("run_id"))
        return value if type(value) is int else None

    @property
    def server_round(self) -> int:
        """The round, from the round config (``from_config`` checks the rest when the round is handled)."""
        value = self.round.get(key("server_round"))
        if type(value) is not int:
            raise MessageError(f"worker request: round config server-round={value!r:.40} expected an integer")
        return value


def relay_name(record: str, array: str) -> str:
    """A packed record's array in a worker frame: ``global-step/values``."""
    return f"{record}/{array}"


def relay_split(name: str) -> tuple[str, str]:
    """``relay_name``'s inverse."""
    record, _, array = name.partition("/")
    return record, array


@dataclass(frozen=True)
class WorkerReply:
    """A frame's header from the node worker back: the round's metrics and trace (the update's packed
    arrays follow it), or the error and whether the node's state is as it was before the request.
    A ping's answer says which process serves and which run it is in."""

    metrics: dict = field(default_factory=dict)  # ``metrics_to_record``'s entries
    trace: dict = field(default_factory=dict)
    error: str = ""
    state_intact: bool = False
    pid: int = 0  # a ping's answer ...
    run_id: int | None = None  # ... and the run the worker is in
    stream_commit: dict = field(default_factory=dict)  # ``UpdateCommit.to_config``: the update went on the stream

    def to_header(self) -> dict[str, Any]:
        if self.error:  # state-intact travels only when it is so (a reply without it: not intact)
            return {"error": self.error, **({key("state_intact"): True} if self.state_intact else {})}
        if self.pid:
            return {"pid": self.pid, key("run_id"): self.run_id}
        commit = {key("stream_commit"): self.stream_commit} if self.stream_commit else {}
        return {"metrics": self.metrics, "trace": self.trace, **commit}

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> WorkerReply:
        if "error" in header:
            return cls(error=str(header["error"]), state_intact=bool(header.get(key("state_intact"))))
        if "pid" in header:
            pid, run_id = header["pid"], header.get(key("run_id"))
            if type(pid) is not int or not (run_id is None or type(run_id) is int):
                raise MessageError(f"worker reply: pid={pid!r:.40}, run-id={run_id!r:.40} expected integers")
            return cls(pid=pid, run_id=run_id)
        metrics, trace, commit = header.get("metrics"), header.get("trace", {}), header.get(key("stream_commit"), {})
        if not isinstance(metrics, dict) or not isinstance(trace, dict) or not isinstance(commit, dict):
            raise MessageError("worker reply: expected metrics, trace and stream-commit mappings")
        return cls(metrics=metrics, trace=trace, stream_commit=commit)
