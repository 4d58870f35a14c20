"""The node worker: a process beside each SuperNode that lives for the whole run, the deployment's
adapter of the node runtime (``node.Node``, where what a round does is written).

Flower 1.42 starts a new ClientApp process for every message, so the background computation of
ParaBlock cannot live in the ClientApp. The worker keeps the model resident (GPU if any), the
node's state in memory, and a compute thread that trains the next block while the reply travels
to the server and the next message comes back. The per-message ClientApp only relays arrays over
a Unix socket. What this module adds to the runtime: one request at a time, in order, for one
partition, a repeat answered with the same reply; and where computations run (the compute thread).
It imports no Flower (``wire.py`` encodes arrays), so no server code reaches this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import core, kept_blocks, node
from ..config import ConfigError, RunConfig
from ..memory import collect_round_garbage, release_freed_memory
from ..messages import (
    EVALUATE,
    GLOBAL_STEP,
    PING,
    RESUME_PENDING,
    WITHDRAWN,
    MessageError,
    RoundConfig,
    TrainMetrics,
    UpdateCommit,
    WorkerReply,
    WorkerRequest,
    metrics_to_record,
    relay_split,
)
from ..messages import key as field_key
from ..node.settings import NodeSettings, error_line
from ..node.state import NodeState, ResidualStore
from ..runtime import setup_torch
from ..transport.node_side import Prefetched
from ..wire import WireError, pack_pieces, unpack
from .answers import Answers
from .endpoint import MessageLimit, WorkerSocket
from .protocol import ProtocolError, recv, send
from .stream import EarlyUpload, WorkerStream

log = logging.getLogger(__name__)


def split_records(arrays: dict[str, np.ndarray]) -> dict[str, core.Tensors]:
    """``{relay_name(record, array): array}`` from the relay back into ``{record: {name: tensor}}``: each
    record's packed arrays (``wire.py``) unpacked. A malformed record is refused (nothing changed)."""
    packed: dict[str, dict[str, np.ndarray]] = {}
    for name, array in arrays.items():
        record, array_name = relay_split(name)
        packed.setdefault(record, {})[array_name] = array
    records: dict[str, core.Tensors] = {GLOBAL_STEP: {}}  # an empty record's arrays do not travel
    for record, parts in packed.items():
        try:  # checked now, each tensor decoded when read: no block in fp32 beside the next block's training
            records[record] = unpack(parts, lazy=True)
        except WireError as err:
            raise node.StateIntact(f"record {record!r:.40}: {err}") from None
    return records


@dataclass(frozen=True)
class TrainReply:
    """A train round's reply: its header and pieces for the socket, and the metrics it says."""

    header: dict
    pieces: dict[str, list[np.ndarray]]
    metrics: TrainMetrics
    trace: dict
    commit: UpdateCommit | None  # the update is on the stream (the reply commits it); None: inline ``pieces``

    @property
    def committed(self) -> bool:
        return self.commit is not None

    @classmethod
    def of(cls, metrics: TrainMetrics, trace: dict, commit: UpdateCommit | None, pieces=None) -> TrainReply:
        """With ``commit`` the reply commits the update on the stream; else it carries ``pieces`` inline."""
        stream_commit = commit.to_config() if commit is not None else {}
        reply = WorkerReply(metrics=metrics_to_record(metrics), trace=trace, stream_commit=stream_commit)
        return cls(reply.to_header(), pieces or {}, metrics, trace, commit)

    def saying(self, **fields) -> TrainReply:
        """The same reply, its metrics with ``fields`` (a leg of the round timed once the reply was made)."""
        return TrainReply.of(dataclasses.replace(self.metrics, **fields), self.trace, self.commit, self.pieces)


class NodeWorker:
    """The deployment's adapter of the node runtime (``node.Node``): one node, one partition.

    Requests are serialised: one at a time changes the node (``lock``). A repeat of the request
    in progress or just answered (a ClientApp that gave up waiting, a retried round) waits for it
    and gets the same reply, never a second computation. The first request pins the worker's
    partition; a request for another partition, or for a run this worker has left, is refused.
    Computations run in one compute thread (``compute_cpus``-pinned), where ParaBlock's round r+1
    starts ahead while round r's reply travels.
    """

    def __init__(self, compute_cpus: set[int] | None = None, state_dir: Path | None = None) -> None:
        # Every computation runs in this one thread; pinned to ``compute_cpus`` when given, so that
        # receiving, decoding and sending arrays (the request threads) stay off the compute's cores.
        self.compute_thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="parablock-compute", initializer=_pin_thread, initargs=(compute_cpus,)
        )
        self.device = ""  # --device: the node's device unless its node config names one
        # Where the residuals outlive this process: fixed when it starts (--state-dir, else SOCKET.state), never
        # taken from a message, since a peer must not choose which folders this process writes or clears.
        self.state_dir = state_dir
        self.lock = threading.Lock()
        self.node = node.Node(submit=self.compute_thread.submit, runs_ahead=True)
        self.run_id: int | None = None
        self.left_runs: set[int] = set()  # runs replaced by a newer one on this worker
        self.partition_id: int | None = None  # pinned by the first request
        self.answers = Answers()  # what it answered, by request key, under ``lock``: a repeat gets the same reply
        self.last_reply_sent = 0.0  # when the reply of ``last_reply_round`` left this worker (first on the stream)
        self.last_reply_round = 0
        self._stamp_lock = threading.Lock()
        self.last_request = time.time()  # for the optional idle exit
        self.message_limit = MessageLimit()  # the most array bytes a message may declare (serve sets it)
        self.stream = WorkerStream()  # transport = "direct": the run's stream, its channels kept across rounds
        # A request replaced the node's state: its copies are given back after the reply. Set under ``lock``;
        # read and cleared by the event loop (``handle``), which sends the replies one at a time.
        self.release_due = False

    # ------------------------------------------------------------ requests
    def serve_request(
        self, header: dict, arrays: dict[str, np.ndarray], from_stream: bool = False
    ) -> tuple[dict, dict[str, list[np.ndarray]]]:
        """One ``train`` or ``evaluate`` request (a ``WorkerRequest``'s header), in order: its reply's
        header (``WorkerReply``; a header that is no request is refused in one line, state intact) and
        the update's arrays as their pieces (``wire.pack_pieces``; ``wire.join_pieces`` joins them).
        A message pushed ahead is first made the request its content makes (``content_request``), unless
        its round was answered already. ``from_stream``: the request is this worker's own, made from a content
        it took ahead (``start_from_stream``); it runs only if no request tried that round first, and what it
        answers is its message's answer."""
        received = time.time()
        try:
            request = WorkerRequest.from_header(header)
            if request.op == PING:
                raise MessageError("worker request: op='ping' expected train or evaluate here")
            pushed_ahead = bool(request.stream_offer.get(field_key("message_name")))
            if pushed_ahead:  # its content on the stream
                request, answered = self.content_request(request)
                if answered is not None:
                    return answered
                received = time.time()
            config = RoundConfig.from_config(request.round)
        except (MessageError, node.StateIntact) as err:
            return WorkerReply(error=str(err), state_intact=True).to_header(), {}
        # A repeat is the same round with nothing that replaces the node's state: a round that carries a
        # full sync (or a hand-back) says the server dropped what it knew of the node, so it is computed
        # again from that state every time, never answered with a reply computed before.
        replaces = config.sync_version is not None or config.resume_pending_block is not None
        replaces = replaces or any(relay_split(n)[0] == RESUME_PENDING for n in arrays)
        key = (request.op, request.run_id, request.partition_id, config.server_round)
        with self.lock:
            if from_stream and self.answers.tried == key:  # its message came first: that was the round's one try
                return WorkerReply(error="round tried already", state_intact=True).to_header(), {}
            if not replaces and (answered := self.answers.answered(key, pushed_ahead)) is not None:
                return answered
            self.answers.tried = key
            if from_stream:
                log.info("round %d: its content came on the stream; started before its message", config.server_round)
            failure = None
            try:
                reply = self.handle_request(request, arrays, received, from_stream or pushed_ahead)
            except node.StateIntact as err:
                log.warning("round %d not done, state intact: %s", config.server_round, err)
                failure = WorkerReply(error=str(err), state_intact=True)
            except Exception as err:  # reported to the ClientApp, which replies an error to the server
                log.exception("round failed")
                failure = WorkerReply(error=error_line(err))
            if failure is not None:
                reply = failure.to_header(), {}
            self.answers.keep(key, reply, failed=failure is not None, from_stream=from_stream)
            self.release_due = self.release_due or (replaces and failure is None)
            return reply

    def content_request(self, request: WorkerRequest):
        """A message pushed a round ahead, as its ClientApp relayed it (its offer names the content on the
        stream): the request its content makes and None, or (the round was answered already: started from its
        content, this worker's own download of it) the request and that answer. The content comes from that
        download, else under the message's own capability (a restarted worker). ``node.StateIntact`` when the
        server withdrew it or it cannot be fetched."""
        offer = self.stream.offer(request)
        if offer.run_id != request.run_id:
            raise node.RequestRefused(f"message pushed ahead: for run {offer.run_id}; expected run {request.run_id}")
        own = self.stream.content_for(request.run_id, offer.server_round)
        if own is not None:
            futures_wait([own])  # the content comes; the round may start from it (``serve_from_stream``)
        with self.lock:  # a round started from its content holds the lock until it has answered
            key = (request.op, request.run_id, request.partition_id, offer.server_round)
            answered = self.answers.answered(key, True)
        if answered is not None:
            return request, answered
        try:
            timeout_s = 2 * RunConfig.from_flower(request.run_config).round_timeout_s  # the capability's lifetime
        except ConfigError as err:
            raise node.RequestRefused(f"run config refused: {err}") from None
        content = self.stream.message_content(offer, request.run_id, self.node_settings(request.node), timeout_s)
        if content is None:
            raise node.StateIntact(f"{WITHDRAWN}round {offer.server_round}'s message went to this node on "
                                   f"Flower's path, or none")  # fmt: skip
        return dataclasses.replace(request, round=content[0], stream_offer=content[1]), None

    def start_from_stream(self, request: WorkerRequest) -> None:
        """After round r's reply: round r+1 starts as soon as its content comes on the stream (``WorkerStream``
        downloads it under the capability round r's offer issued ahead), with the request it makes; the
        ClientApp's request for that round, when Flower delivers it, gets that round's answer. A round that
        replaces the node's state (a full sync, a hand-back) is left to its request."""
        pending = self.stream.content_for(request.run_id, request.server_round + 1)
        if pending is not None:
            pending.add_done_callback(lambda done: self.stream.submit(self.serve_from_stream, request, done))

    def serve_from_stream(self, base: WorkerRequest, content) -> None:
        """``base`` (round r's request) made round r+1's with the content that came (``start_from_stream``)."""
        try:
            taken = content.result()
            config = RoundConfig.from_config(taken[0]) if taken is not None else None
        except Exception:  # noqa: BLE001 - withdrawn, failed or malformed: the ClientApp's request says why
            return
        if config is None or config.sync_version is not None or config.resume_pending_block is not None:
            return
        self.last_request = time.time()
        header = dataclasses.replace(base, round=taken[0], stream_offer=taken[1]).to_header()
        self.serve_request(header, {}, from_stream=True)

    def handle_request(
        self, request: WorkerRequest, arrays: dict[str, np.ndarray], received: float, content_fetched: bool = False
    ):  # fmt: skip
        try:
            cfg = RunConfig.from_flower(request.run_config)
        except ConfigError as err:  # read before anything changes: the node is as it was
            raise node.RequestRefused(f"run config refused: {err}") from None
        settings = self.node_settings(request.node)  # a refused one changes nothing
        if (refused := settings.refusal(cfg.model, cfg.dataset)) is not None:
            raise node.RequestRefused(refused)  # before admit: a run this node refuses does not take it from its run
        node.check_fits(cfg, request.run_id, settings)  # the same: a run it cannot hold
        self.admit(request)
        ahead = self.stream.take_transfers_ahead(request.run_id, request.server_round)  # what moved before this message
        offer = self.stream.offer(request)  # transport = "direct": the records wait on the run's stream
        legs: dict[str, float] = {}  # the worker's own legs of the round (``TrainMetrics``)
        with node.timed(legs, "records_fetch_s"):
            arrays, prefetched = self.stream_records(offer, ahead, arrays, settings, cfg.round_timeout_s)
        setup_torch(cfg)
        res = node.resources(cfg, request.run_id, settings, serves_one_node=True)
        req = node.Request.parse(request.op, request.run_id, request.round, split_records(arrays),
                                 request.partition_id, request.num_partitions)  # fmt: skip
        fetch_step = self.steps_of(req, res)
        if request.op == EVALUATE:
            return WorkerReply(
                metrics=self.node.evaluate(res, cfg, req, fetch_step).metrics.to_record()
            ).to_header(), {}
        store = self.residual_store(settings, req.partition_id) if cfg.transfer_dtype != "fp32" else None
        # The update moving ahead as it was rounded: the round's training (and the next round's computation,
        # which it starts) goes on while its upload is still in flight, and the reply waits for that upload.
        with node.timed(legs, "ahead_wait_s"):
            rounded = ahead.early_update() if ahead is not None else None
        # The residual's durable write (a block in fp32, at the disk's pace) runs on while the update uploads;
        # the reply leaves only once it is done (``wait_for_write`` below), as the node runtime requires.
        done = self.node.train(res, cfg, req, fetch_step, store, store, rounded, defer_write=True)
        try:  # from here on, every way out waits for the residual's write (and its rename) first
            with node.timed(legs, "ahead_wait_s"):  # an upload still in flight is waited for
                early = ahead.early_upload() if ahead is not None else None
            early = early if done.used_early else None  # the update is the one moved ahead, bit for bit
            metrics = dataclasses.replace(done.metrics, request_received=received,
                                          prev_reply_sent=self.last_reply_sent, worker_cpu_s=time.process_time(),
                                          direct_step_prefetched=1 if prefetched is not None else None,
                                          direct_content_fetched=1 if content_fetched else None, **legs)  # fmt: skip
            # Each array as its pieces (one per tensor), written to the socket in turn: no joined copy of the block.
            pieces = early.pieces if early is not None else pack_pieces(done.update, cfg.transfer_dtype, done.encoded)
            bytes_out = sum(p.nbytes for parts in pieces.values() for p in parts)
            reply = self.train_reply(metrics, done.trace, pieces, offer, settings, cfg.round_timeout_s, early)
        except BaseException as err:
            node.wait_for_write(done.residual_written, err)
            raise
        reply = self.once_residual_written(reply, done)
        if reply.committed and self.stream.upload_reply(offer, settings, reply.header, cfg.round_timeout_s):
            self.stamp_reply(request.server_round)  # the server holds it now, whenever the ClientApp takes it
        log.info(round_line(reply.metrics, sum(a.nbytes for a in arrays.values()), bytes_out))
        if offer is not None and reply.committed:  # on the stream: round r+1's bytes move from now on
            early_update = self.node.early_update(cfg, request.server_round + 1, store)
            self.stream.start_transfers_ahead(offer, request.run_id, cfg.transfer_dtype, early_update,
                                              reply.commit.update_size)  # fmt: skip
            self.start_from_stream(request)
        return reply.header, reply.pieces

    @staticmethod
    def once_residual_written(reply: TrainReply, done: node.NodeAnswer) -> TrainReply:
        """``reply`` once the round's residual is durable (its write's error fails the reply: nothing is committed
        yet), saying how long the worker waited for it (``residual_wait_s``)."""
        legs: dict[str, float] = {}
        with node.timed(legs, "residual_wait_s"):
            node.wait_for_write(done.residual_written)
        return reply.saying(**legs)

    def stream_records(
        self, offer, ahead, arrays: dict[str, np.ndarray], settings: NodeSettings, timeout_s: float
    ) -> tuple[dict[str, np.ndarray], Prefetched | None]:
        """``arrays`` with the records the offer keeps on the stream (none without an offer), and the step
        fetched ahead when the fetch used it (it matched the offer's size and SHA-256)."""
        if offer is None:
            return arrays, None
        prefetched = ahead.step_for(offer) if ahead is not None else None
        arrays = {**arrays, **self.stream.fetch(offer, settings, timeout_s, prefetched)}
        used = prefetched is not None and any(map(prefetched.matches, offer.records))
        return arrays, prefetched if used else None

    def train_reply(
        self, metrics: TrainMetrics, trace: dict, pieces: dict, offer, settings, timeout_s: float,
        early: EarlyUpload | None = None,
    ):  # fmt: skip
        """The round's reply: with the direct transport, the update uploaded and the reply committing it, or
        (the stream unusable) the update inline, counted as a fallback (``direct-fallbacks``). An update
        ``early`` uploaded into this round's slot before the message came is committed without a second upload."""
        if early is not None and early.commit is not None and offer is not None and early.name == offer.upload_name:
            return TrainReply.of(dataclasses.replace(metrics, direct_update_ahead=1, upload_s=0.0), trace, early.commit)
        if offer is not None and offer.upload_name:
            legs: dict[str, float] = {}
            with node.timed(legs, "upload_s"):
                commit = self.stream.upload(offer, settings, pieces, timeout_s)
            metrics = dataclasses.replace(metrics, **legs)
            if commit is not None:
                return TrainReply.of(metrics, trace, commit)
            metrics = dataclasses.replace(metrics, direct_fallbacks=1)
        return TrainReply.of(metrics, trace, None, pieces)

    @staticmethod
    def steps_of(req: node.Request, res: node.NodeResources):
        """The global steps this worker's replica may replay: only those the message brought (the server
        sends a node the steps it knows the node missed)."""

        def fetch_step(version: int):
            if version in req.steps:
                return req.steps[version]
            raise RuntimeError(
                f"this worker's model is at v{res.replica.version} and the message lacks "
                f"global step v{version} (the server sends missed steps to nodes it knows are behind)"
            )

        return fetch_step

    def admit(self, request: WorkerRequest) -> None:
        """The partition pin and the run: a request this worker must not act on is refused; a new
        run starts from a fresh node state."""
        partition_id, run_id = request.partition_id, request.run_id
        if self.partition_id is None:
            self.partition_id = partition_id
        elif partition_id != self.partition_id:
            raise node.RequestRefused(
                f"partition-id={partition_id} refused: this worker serves partition-id={self.partition_id} "
                f"(one worker per node: give each SuperNode its own worker-socket)"
            )
        if run_id == self.run_id:
            return
        if run_id in self.left_runs:
            raise node.RequestRefused(
                f"round {request.server_round} of run {run_id} refused: this worker left that run for run "
                f"{self.run_id} (last answered round {self.node.state.last_round})"
            )
        if self.run_id is not None:
            self.left_runs.add(self.run_id)
        self.node.drop_ahead()
        self.node.state, self.run_id, self.last_reply_sent, self.last_reply_round = NodeState(), run_id, 0.0, 0
        self.answers.forget()
        kept_blocks.KEPT.clear()  # the last run's idle buffers: this run's blocks may have other sizes
        log.info("new run %s", run_id)

    def residual_store(self, settings: NodeSettings, partition_id: int) -> ResidualStore | None:
        """The partition's store, in the state dir this worker was started with."""
        return ResidualStore(self.state_dir / f"partition-{partition_id}") if self.state_dir is not None else None

    def node_settings(self, node_config: dict) -> NodeSettings:
        """The node's own data and device (its node config, relayed), the device defaulting to ``--device``.
        A node config's ``state-dir`` only confirms the worker's own: any other is refused (``node.RequestRefused``)."""
        settings = NodeSettings.from_header(node_config)
        if settings.state_dir and (
            self.state_dir is None or os.path.realpath(settings.state_dir) != os.path.realpath(self.state_dir)
        ):
            raise node.RequestRefused(
                f"node config state-dir={settings.state_dir!r} refused: this worker keeps its state in "
                f"{self.state_dir}, set when it started (start it with --state-dir {settings.state_dir})"
            )
        if not settings.device and self.device:
            settings = dataclasses.replace(settings, device=self.device)
        return settings

    # ------------------------------------------------------------ serving
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                header, arrays = await recv(reader, self.message_limit)
            except ProtocolError as err:  # nothing it declared was allocated: answered with the reason
                log.warning("refused a message: %s", err)
                with contextlib.suppress(OSError):
                    await send(writer, WorkerReply(error=f"ProtocolError: {err}").to_header())
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # connected and left without a message (another worker's start-up check)
            self.last_request = time.time()
            if self.is_ping(header):
                await send(writer, WorkerReply(pid=os.getpid(), run_id=self.run_id).to_header())
                return
            reply, reply_arrays = await asyncio.get_running_loop().run_in_executor(
                None, self.serve_request, header, arrays
            )
            await send(writer, reply, reply_arrays)
            answer = WorkerReply.from_header(reply)
            if not answer.error and type(server_round := answer.metrics.get(field_key("server_round"))) is int:
                self.stamp_reply(server_round)
            del arrays, reply_arrays
            if self.release_due:  # a full sync or a hand-back: its copies given back, once the reply is out
                self.release_due = False
                await asyncio.get_running_loop().run_in_executor(None, release_freed_memory)
            seconds = await asyncio.get_running_loop().run_in_executor(None, collect_round_garbage)
            kept_blocks.KEPT.trim()  # once a reply: what the last one freed and this one did not take again
            if seconds > 0.1:  # what was loaded is frozen (memory.freeze_loaded): a pass scans only the rounds'
                log.info("the garbage collector's pass after the reply took %.2f s", seconds)
        finally:
            writer.close()

    def stamp_reply(self, server_round: int) -> None:
        """A round's reply left this worker now (uploaded on the stream, or sent to the ClientApp): the next round's
        window starts at its first leaving, and a later round's stamp is never replaced by an earlier round's."""
        with self._stamp_lock:
            if server_round > self.last_reply_round:
                self.last_reply_sent, self.last_reply_round = time.time(), server_round

    @staticmethod
    def is_ping(header: dict) -> bool:
        """A ping (who serves, in which run), answered at once; anything else is a request, in order."""
        try:
            return WorkerRequest.from_header(header).op == PING
        except MessageError:
            return False  # serve_request refuses it, in order, with the reason


def round_line(metrics: TrainMetrics, bytes_in: int, bytes_out: int) -> str:
    """The one line a site's operator sees per round: the round, its block, the training loss, the
    compute time, the bytes in and out, how long the node waited for the server between its last
    reply and this request, and what moved before the message (numbers only: nothing of the site's data)."""
    moved_ahead = [what for what, flag in (("its update", metrics.direct_update_ahead),
                                           ("its step", metrics.direct_step_prefetched),
                                           ("its content", metrics.direct_content_fetched)) if flag == 1]  # fmt: skip
    prev, received = metrics.prev_reply_sent, metrics.request_received
    waited = f"{received - prev:.2f} s" if prev else "- (first request of this run)"
    return (
        f"round {metrics.server_round} block {metrics.block}: train-loss {metrics.train_loss:.4f}, "
        f"compute {metrics.compute_s:.2f} s, in {bytes_in / 1e6:,.2f} MB, out {bytes_out / 1e6:,.2f} MB, "
        f"waited for the server {waited}"
        + (f", peak memory {metrics.peak_rss_bytes / 1e9:.2f} GB" if metrics.peak_rss_bytes else "")
        + (f"; moved before the message: {', '.join(moved_ahead)}" if moved_ahead else "")
    )


def _pin_thread(cpus: set[int] | None) -> None:
    """Pin the calling thread (Linux: pid 0 is the calling thread) to ``cpus``."""
    if cpus:
        os.sched_setaffinity(0, cpus)


async def serve(
    endpoint: WorkerSocket,
    idle_exit_s: float,
    compute_cpus: set[int] | None = None,
    device: str = "",
    max_message_bytes: int = 0,
    state_dir: Path | None = None,
) -> None:
    worker = NodeWorker(compute_cpus, state_dir or endpoint.path.with_name(endpoint.path.name + ".state"))
    worker.device = device
    worker.message_limit = MessageLimit(max_message_bytes)
    server = await asyncio.start_unix_server(endpoint.admitting(worker.handle), sock=endpoint.sock, limit=2**26)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("node worker %d listening on %s", os.getpid(), endpoint.describe())
    async with server:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=5.0)
            if idle_exit_s and time.time() - worker.last_request > idle_exit_s:
                log.info("no message for %.0f s: exiting", idle_exit_s)
                break
    worker.compute_thread.shutdown(wait=False, cancel_futures=True)
    worker.stream.close()


def run_worker(
    endpoint: WorkerSocket,
    idle_exit_s: float = 0.0,
    compute_cpus: set[int] | None = None,
    device: str = "",
    max_message_bytes: int = 0,
    state_dir: Path | None = None,
) -> None:
    """Serve one node on a claimed socket (``WorkerSocket.claim``; its claimer releases it) until
    stopped (SIGTERM/SIGINT), or idle for ``idle_exit_s`` if that is > 0.

    By default the worker lives as long as its node: a node not sampled for hours, or a
    round longer than an hour, must not lose its model and its pending update."""
    asyncio.run(serve(endpoint, idle_exit_s, compute_cpus, device, max_message_bytes, state_dir))
