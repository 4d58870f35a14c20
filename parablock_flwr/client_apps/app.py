"""The ClientApp: thin and torch-free, the same for simulation and deployment.

- Simulation (no ``worker-socket`` in the node config): the round runs inside
  this process (``inline.py``), where torch and the model are loaded once per
  Ray actor.
- Deployment (the SuperNode was started with ``--node-config
  'worker-socket="PATH"'``): Flower starts a new ClientApp process for every
  message, so this process only relays the message's arrays to the node
  worker (``python -m parablock_flwr.worker --socket PATH``) over a Unix
  socket and replies with the update the worker has ready. It never imports
  torch: it starts in about a second.
"""

from __future__ import annotations

import asyncio
import difflib
import os
import sys
import time

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SType

from ..messages import (
    EVALUATE,
    MESSAGE_AHEAD,
    METRICS,
    NODE,
    OFFER,
    PROTOCOL_KEY,
    ROUND,
    STATE_INTACT,
    STREAM_UNUSABLE,
    TRAIN,
    UPDATE,
    WITHDRAWN,
    MessageError,
    PartitionAnswer,
    TransportOffer,
    WorkerReply,
    WorkerRequest,
    relay_name,
    stamped,
)
from ..node.settings import (
    NODE_CONFIG_KEYS,
    WORKER_SOCKET,
    WORKER_UID,
    NodeSettings,
    node_settings_problem,
    partition_of,
    user_id,
)
from ..npy import NpyError, npy_header, npy_view
from ..transport.message_bytes import content_ahead, reply_content  # the stream's package: 0.03 s at the start
from ..transport.node_side import NodeTransport, StreamUnusable
from ..versions import mismatch
from ..worker.protocol import ProtocolError, UntrustedWorker, request
from . import error_reply


def _process_start_time() -> float:
    """When this process started (Linux /proc), else now: for the start-up time in the timeline."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # since boot, in clock ticks
        # The boot time to the clock's precision (/proc/stat's btime is whole seconds).
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return time.time()


_PROCESS_STARTED = _process_start_time()
app = ClientApp()


def unknown_node_config_key(node_config) -> str | None:
    """One line naming the first node-config key this app does not know (``node.settings.NODE_CONFIG_KEYS``:
    any other is refused rather than silently ignored), with the closest known one."""
    for key in sorted(node_config):
        if key not in NODE_CONFIG_KEYS:
            close = difflib.get_close_matches(key, NODE_CONFIG_KEYS, n=1)
            hint = f"did you mean {close[0]}?" if close else f"expected one of {', '.join(NODE_CONFIG_KEYS)}"
            return f"node config {key}: unknown key; {hint}"
    if WORKER_UID in node_config and user_id(node_config[WORKER_UID]) is None:
        return (f"node config {WORKER_UID}={node_config[WORKER_UID]!r}: expected the node worker's user, "
                "a user id >= 0 or the name of a user of this machine")  # fmt: skip
    return node_settings_problem(node_config)


def message_problem(msg: Message, context: Context) -> str | None:
    """Why this node must not act on ``msg``: its node config, or a round config of another protocol version."""
    if (problem := unknown_node_config_key(context.node_config)) is not None:
        return problem
    if ROUND not in msg.content.config_records:
        return "message from the server has no round config; expected a ParaBlock server's message"
    return mismatch(msg.content[ROUND], PROTOCOL_KEY, "the server", "this node")


def content_from_stream(msg: Message, context: Context) -> str | None:
    """A message pushed a round ahead (``MESSAGE_AHEAD``, ``transport = "direct"``) to a node without a worker
    (a worker takes the content itself: ``relay_to_worker`` hands it the message as it came): its content, downloaded
    from the run's stream once the server has built it (this waits), put in ``msg``; or why not, in one line
    (``WITHDRAWN``: the server withdrew it and drops the reply; ``STREAM_UNUSABLE``: the stream cannot be
    used here, nothing was applied, and the server sends this node's next messages on Flower's path)."""
    settings = NodeSettings.from_node_config(context.node_config)
    if settings.transport == "flower":
        return f"{STATE_INTACT}{STREAM_UNUSABLE}this site keeps to Flower's path (node config transport)"
    try:
        offer = ahead_offer(msg, context)
        timeout_s = 2 * float(context.run_config.get("round-timeout-s", 3600.0))  # the capability's lifetime
        stream = NodeTransport(settings.stream, timeout_s=timeout_s)
        try:
            data = stream.message_content(offer)
        finally:
            stream.close()
        if data is None:
            return f"{WITHDRAWN}round {offer.server_round}'s message went to this node on Flower's path, or none"
        content = content_ahead(offer, data)
    except MessageError as err:
        return f"message from the server: {err}"
    except StreamUnusable as err:
        return f"{STATE_INTACT}{STREAM_UNUSABLE}{err}"
    msg.content = content
    return None


def ahead_offer(msg: Message, context: Context) -> TransportOffer:
    """The offer of a message pushed a round ahead, read strictly; ``MessageError`` when it is malformed or for
    another run or node."""
    offer = TransportOffer.from_config(dict(msg.content[MESSAGE_AHEAD]))
    if (offer.run_id, offer.node_id) != (context.run_id, context.node_id):
        raise MessageError(f"message pushed ahead: for run {offer.run_id} node {offer.node_id}; expected run "
                           f"{context.run_id} node {context.node_id}")  # fmt: skip
    return offer


def trusted_worker_uids(node_config) -> frozenset[int]:
    """Whom the relay sends a round to: a worker of this process's own user or root, or of the node
    config's ``worker-uid`` (a worker run as another user, with ``--allow-uid`` for this one)."""
    extra = () if WORKER_UID not in node_config else (user_id(node_config[WORKER_UID]),)
    return frozenset((os.geteuid(), 0, *extra))


@app.train()
def train(msg: Message, context: Context) -> Message:
    if (problem := message_problem(msg, context)) is not None:
        return error_reply(msg, problem)
    started, socket_path = _PROCESS_STARTED, context.node_config.get(WORKER_SOCKET)
    if MESSAGE_AHEAD in msg.content.config_records:
        if socket_path:  # the worker takes the content from the stream (it may have taken it already)
            try:
                ahead_offer(msg, context)
            except MessageError as err:
                return error_reply(msg, f"message from the server: {err}")
            return relay_to_worker(msg, context, str(socket_path))
        if (problem := content_from_stream(msg, context)) is not None:
            return error_reply(msg, problem)
        if (problem := message_problem(msg, context)) is not None:
            return error_reply(msg, problem)
        started = time.time()  # the round's timeline starts with its content: the process started off its path
    if not socket_path:
        from .inline import train_inline  # imports torch: only where the model lives in this process

        return train_inline(msg, context)
    return relay_to_worker(msg, context, str(socket_path), started=started)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """``evaluation = "clients"``, after the last round: the held-out loss of ``x^R`` on this node's own
    held-out split (every earlier ``x^{r-1}`` is evaluated inside round r, see docs/architecture.md)."""
    if (problem := message_problem(msg, context)) is not None:
        return error_reply(msg, problem)
    socket_path = context.node_config.get(WORKER_SOCKET)
    if not socket_path:
        from .inline import evaluate_inline

        return evaluate_inline(msg, context)
    return relay_to_worker(msg, context, str(socket_path), op=EVALUATE)


@app.query()
def identify(msg: Message, context: Context) -> Message:
    """Which data partition this node serves: a resumed server maps its new node ids to the
    clients' checkpointed state with it."""
    answer = PartitionAnswer(partition_of(context.node_config)[0])
    return Message(content=RecordDict({NODE: MetricRecord(answer.to_record())}), reply_to=msg)


def relay_to_worker(
    msg: Message, context: Context, socket_path: str, op: str = TRAIN, started: float = _PROCESS_STARTED
) -> Message:
    """Hand ``g^{r-1}`` and the round's blocks to the node worker; reply its ``Δ_i^r`` (``op="train"``),
    or its evaluation of ``x^R`` (``op="evaluate"``). ``started``: the reply's ``clientapp_start``, this
    process's start, or for a message pushed ahead when its content came."""
    # The handler starts once Flower has pulled and deserialised the message: what comes before is Flower's.
    stamps = {"clientapp_handler_start": time.time(), "clientapp_pull_cpu_s": time.process_time()}
    try:
        arrays = relayed_arrays(msg)
    except NpyError as err:
        return error_reply(msg, f"message from the server: {err}")
    # A round cannot take longer than the server waits for it; a worker silent for longer is stuck. A message
    # pushed ahead lives as long as the round before it and its own (the worker waits for its content first).
    timeout_s = float(context.run_config.get("round-timeout-s", 3600.0))
    timeout_s *= 2 if MESSAGE_AHEAD in msg.content.config_records else 1

    def sent() -> None:  # the request's last byte is in the worker's socket
        stamps["clientapp_sent"] = time.time()

    header = worker_request(msg, context, op).to_header()
    trusted = trusted_worker_uids(context.node_config)
    try:  # the update's arrays come back as npy payloads, read from the socket behind their npy header
        exchange = request(socket_path, header, arrays, timeout_s, npy_header, sent, worker_uids=trusted)
        answer, update = run_to_end(exchange)
        reply = WorkerReply.from_header(answer)
    except (UntrustedWorker, OSError, TimeoutError, ProtocolError, asyncio.IncompleteReadError, MessageError) as err:
        return error_reply(msg, relay_failure(err, socket_path, timeout_s))
    if reply.error:  # the worker says whether the node's state is intact (node.StateIntact)
        return error_reply(msg, f"{STATE_INTACT if reply.state_intact else ''}node worker failed: {reply.error}")
    if op == EVALUATE:
        return Message(content=RecordDict({METRICS: MetricRecord(reply.metrics)}), reply_to=msg)
    metrics = stamped(
        reply.metrics,
        **stamps,
        clientapp_start=started,
        clientapp_reply=time.time(),
        clientapp_cpu_s=time.process_time(),  # this process's CPU: imports, Flower's pull, the relay
        clientapp_imported_torch=int("torch" in sys.modules),
    )
    # The worker's update is already packed (wire.pack): its arrays become the record as they are; or it
    # moved on the run's stream (transport = "direct") and the reply commits it.
    content = reply_content(metrics, reply.trace, reply.stream_commit)
    if not reply.stream_commit:
        content[UPDATE] = ArrayRecord(update_arrays(update))
    return Message(content=content, reply_to=msg)


def worker_request(msg: Message, context: Context, op: str) -> WorkerRequest:
    """The frame's header: the round's message without its tensors, and who asks (the node config's
    partition, its own data and device)."""
    partition_id, num_partitions = partition_of(context.node_config)
    settings = NodeSettings.from_node_config(context.node_config).as_header()
    # transport = "direct": the offer of the message's records, or of its content when it was pushed ahead
    offer = next((dict(msg.content[name]) for name in (OFFER, MESSAGE_AHEAD) if name in msg.content.config_records),
                 {})  # fmt: skip
    return WorkerRequest(op, context.run_id, dict(context.run_config), dict(msg.content[ROUND]), partition_id,
                         num_partitions, settings, offer)  # fmt: skip


def relayed_arrays(msg: Message) -> dict:
    """Every array record of the message (``g^{r-1}``, any catch-up or full sync), each as its few packed
    arrays (``wire.py``: values, layout, int8's scales) named ``relay_name(record, array)``: the worker
    unpacks them, not this process. Each is a view of Flower's own payload bytes (``npy.npy_view``),
    written to the socket as it is: no copy."""
    return {
        relay_name(record_name, name): npy_view(array.data, relay_name(record_name, name))
        for record_name, record in msg.content.array_records.items()
        for name, array in record.items()
    }


def relay_failure(err: BaseException, socket_path: str, timeout_s: float) -> str:
    """Why the worker gave no answer, in one line that says what to do about it."""
    if isinstance(err, UntrustedWorker):
        return (
            f"node worker socket {socket_path}: the process listening there (pid {err.pid}) runs as uid {err.uid}; "
            f"expected uid {os.geteuid()} (this ClientApp's) or root, or the node config's {WORKER_UID}; nothing "
            f"was sent"
        )
    if isinstance(err, FileNotFoundError | ConnectionRefusedError):
        return (
            f"node worker is not running at {socket_path} ({type(err).__name__}); start it "
            f"with: python -m parablock_flwr.worker --socket {socket_path}"
        )
    if isinstance(err, PermissionError):
        return (
            f"node worker socket {socket_path}: permission denied for uid {os.geteuid()}; run the SuperNode as the "
            f"worker's user, or start the worker with --allow-uid {os.geteuid()} (docs/deployment.md)"
        )
    if isinstance(err, TimeoutError):
        return f"node worker at {socket_path} did not answer within round-timeout-s={timeout_s:g}"
    return f"node worker at {socket_path} gave no readable reply ({type(err).__name__}: {err})"


def run_to_end(coroutine):
    """``asyncio.run`` without its SIGINT handler. Where SIGINT has Python's default handler, ``asyncio.run``
    installs its own and restores the default at the end; Python 3.11's ``signal.signal`` then builds the
    ``repr`` of the handler it replaces, and through it of the finished task's result: the reply's payload
    ``bytes``, as a string four times their size (measured: +116 MB peak for a 64 MB reply)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


def update_arrays(payloads: dict[str, bytes]) -> dict[str, Array]:
    """Flower's ``Array`` of each npy payload, the payload itself as its data (``Array(ndarray)`` would copy
    the values twice more through ``np.save``)."""
    arrays = {}
    for name, payload in payloads.items():
        view = npy_view(payload, name)  # this process wrote the header: it holds
        arrays[name] = Array(dtype=str(view.dtype), shape=view.shape, stype=SType.NUMPY, data=payload)
    return arrays
