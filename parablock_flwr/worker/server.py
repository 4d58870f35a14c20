"""The node worker: a process beside each SuperNode that lives for the whole run.

Flower 1.42 starts a new ClientApp process for every message, so the
background computation of ParaBlock cannot live in the ClientApp. The worker
keeps the model resident (GPU if any), the node's local model as
(global version, pending update), and a background thread that trains the
next block while the reply travels to the server and the next message comes
back. The per-message ClientApp only relays arrays over a Unix socket.

Round r (message ``F_r`` carries ``g^{r-1}``, ``b_r`` and ``b_{r+1}``):
wait for round r's background computation (started at ``F_{r-1}``), apply
the correction (re-base onto ``x^{r-1}``), start round r+1's computation in
the background, reply ``Δ_i^r``. With ``on-receipt`` the aggregate is
applied to the running computation at its next step boundary instead of
after its last step (less staleness when communication is fast);
``at-end`` is the deterministic mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .. import core, node
from ..config import RunConfig
from ..node_data import NodeSettings
from ..records import decode, encode
from ..replica import catch_up_steps, resumed_pending
from ..runtime import setup_torch
from ..strategies import client_half
from ..strategies.parablock.client import CorrectionSlot
from .endpoint import MessageLimit, WorkerSocket
from .protocol import ProtocolError, recv, send

log = logging.getLogger(__name__)


def split_records(arrays: dict[str, np.ndarray]) -> dict[str, core.Tensors]:
    """``{"record/name": array}`` from the relay back into ``{record: {name: tensor}}``."""
    records: dict[str, core.Tensors] = {"global-step": {}}
    for key, array in arrays.items():
        record, _, name = key.partition("/")
        records.setdefault(record, {})[name] = decode(array.copy())  # frombuffer arrays are read-only
    return records


class NodeWorker:
    """One node's persistent state and its background computation."""

    def __init__(self, compute_cpus: set[int] | None = None) -> None:
        # Every computation runs in this one thread; pinned to ``compute_cpus`` when given, so that
        # receiving, decoding and sending arrays (the request threads) stay off the compute's cores.
        self.compute_thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="parablock-compute", initializer=_pin_thread, initargs=(compute_cpus,)
        )
        self.run_id: int | None = None
        self.device = ""  # --device: the node's device unless its node config names one
        self.pending: core.PendingUpdate | None = None
        self.residuals: dict[int, core.Tensors] = {}  # transfer-dtype's error feedback, by block
        self.ahead: tuple[int, Future, CorrectionSlot] | None = None  # round, its TrainResult, its slot
        self.last_reply_sent = 0.0
        self.last_request = time.time()  # for the optional idle exit
        self.message_limit = MessageLimit()  # the most array bytes a message may declare (serve sets it)

    # ------------------------------------------------------------ rounds
    def train(self, header: dict, arrays: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
        received = time.time()
        cfg, resources, round_cfg, records, steps, fetch_step = self._open(header, arrays)
        server_round, block = int(round_cfg["server-round"]), int(round_cfg["block"])
        partition_id, num_partitions = int(header["partition-id"]), int(header["num-partitions"])
        client = client_half(str(round_cfg["algorithm"]), cfg.correction_mode)

        handed_back = resumed_pending(round_cfg, records)
        full_sync = "sync-version" in round_cfg
        ahead, self.ahead = self.ahead, None
        if ahead is not None and (ahead[0] != server_round or full_sync or handed_back is not None):
            # Computed ahead from a state the server has just replaced (or for a round this node is
            # not part of): let it finish before the replica is touched, then drop it.
            self._finish(ahead)
            ahead = None
        if full_sync:  # the server's exact values of x^{r-2}; the node's own state is dropped
            resources.replica.reset_to(int(round_cfg["sync-version"]), records["sync-values"])
            self.pending, self.residuals = None, {}
        if handed_back is not None:  # the server restarted from a checkpoint
            self.pending = handed_back
        waited, computed_ahead, correction_step, drift_slot = 0.0, None, cfg.local_steps, None
        started_from = self.pending  # what round r trained from, on x^{r-2} (the ahead computation's start)
        if ahead is not None:
            _, future, slot = ahead
            if cfg.correction_mode == "on-receipt" and self.pending is not None:
                slot.post(steps[server_round - 1][1], self.pending.delta)  # applied at the next step boundary
            wait_start = time.time()
            result = future.result()  # Δ_i^r, computed from x^{r-2} + Δ_i^{r-1}
            waited = time.time() - wait_start
            computed_ahead = (server_round - 2, result)
            correction_step = slot.applied_after_step or cfg.local_steps
            drift_slot = slot
        else:  # nothing ran ahead: compute now, in the compute thread too
            base_version, started_from = client.start_point(self.pending, server_round, fetch_step)
            resources.replica.advance_to(base_version, fetch_step)
            args = (resources, cfg, server_round, block, started_from, base_version, partition_id, num_partitions)
            computed_ahead = (base_version, self.compute_thread.submit(node.compute_update, *args).result())
        done = node.train_round(
            resources,
            cfg,
            client,
            server_round,
            block,
            started_from,
            fetch_step,
            partition_id,
            num_partitions,
            self.residuals,
            computed_ahead,
        )
        self.pending = done.kept
        drift = {}
        if drift_slot is not None and drift_slot.live and done.kept is not None:  # on-receipt: measured, bounded
            drift = {"correction-drift": drift_slot.drift(resources.replica.params, done.kept.delta)}
        evaluation = {}
        if (version := node.evaluation_due(round_cfg)) is not None:
            # x^{r-1}, which the replica holds now; nothing runs on it until round r+1 starts below.
            generate = bool(round_cfg.get("evaluate-generate", 0))
            evaluation = self.compute_thread.submit(node.evaluate_replica, resources, cfg, version, generate).result()
        next_block = int(round_cfg["next-block"])
        if client.runs_ahead and next_block >= 0:  # round r+1 starts now, while this reply travels
            base_version, pending = client.start_point(self.pending, server_round + 1, fetch_step)
            slot = CorrectionSlot()
            future = self.compute_thread.submit(
                node.compute_update,
                resources,
                cfg,
                server_round + 1,
                next_block,
                pending,
                base_version,
                partition_id,
                num_partitions,
                slot,
                slot.capture,
            )
            self.ahead = (server_round + 1, future, slot)
        result = done.result
        metrics = {
            **node.update_metrics(result, server_round, block, partition_id, done.base_version),
            "compute-start": result.started,
            "compute-end": result.ended,
            "request-received": received,
            "waited-s": waited,
            "prev-reply-sent": self.last_reply_sent,
            "correction-after-step": correction_step,
            **drift,
            **evaluation,
        }
        return {"metrics": metrics, "trace": done.trace}, {
            n: encode(t, cfg.transfer_dtype) for n, t in result.delta.items()
        }

    def evaluate(self, header: dict, arrays: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
        """``evaluation = "clients"`` after the last round: the held-out loss of ``x^R``.

        Nothing runs ahead after round R (its message carried no next block); any computation
        still running is waited for before the replica moves to ``x^R``."""
        cfg, resources, round_cfg, records, _, fetch_step = self._open(header, arrays)
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self._finish(ahead)
        if "sync-version" in round_cfg:
            resources.replica.reset_to(int(round_cfg["sync-version"]), records["sync-values"])
            self.pending, self.residuals = None, {}
        version = int(round_cfg["evaluate-version"])
        resources.replica.advance_to(version, fetch_step)
        generate = bool(round_cfg.get("evaluate-generate", 0))
        metrics = self.compute_thread.submit(node.evaluate_replica, resources, cfg, version, generate).result()
        return {"metrics": {**metrics, "partition-id": int(header["partition-id"])}}, {}

    def _open(self, header: dict, arrays: dict[str, np.ndarray]):
        """What every message needs: the run config, this node's resources (a new run starts from a
        fresh state), the round's config, its arrays, the global steps it carries and a fetcher."""
        cfg = RunConfig.from_flower(header["run-config"])
        if header["run-id"] != self.run_id:
            self._new_run(header["run-id"])
        setup_torch(cfg)
        resources = node.resources(cfg, header["run-id"], self.node_settings(header))
        round_cfg = header["round"]
        records = split_records(arrays)
        steps = catch_up_steps(round_cfg, records)

        def fetch_step(version: int):
            if version in steps:
                return steps[version]
            raise RuntimeError(
                f"this worker's model is at v{resources.replica.version} and the message lacks "
                f"global step v{version} (the server sends missed steps to nodes it knows are behind)"
            )

        return cfg, resources, round_cfg, records, steps, fetch_step

    def node_settings(self, header: dict) -> NodeSettings:
        """The node's own data and device (its node config, relayed), the device defaulting to ``--device``."""
        settings = NodeSettings.from_header(header.get("node"))
        if not settings.device and self.device:
            settings = NodeSettings(settings.dataset, settings.heldout_dataset, self.device)
        return settings

    @staticmethod
    def _finish(ahead: tuple[int, Future, CorrectionSlot]) -> None:
        """Wait for a computation running ahead (it holds the replica), whatever its outcome."""
        with contextlib.suppress(Exception):
            ahead[1].result()

    def _new_run(self, run_id: int) -> None:
        """A new run on this node starts from a fresh state."""
        if self.ahead is not None:
            self._finish(self.ahead)
        self.run_id, self.pending, self.ahead, self.last_reply_sent = run_id, None, None, 0.0
        self.residuals = {}
        log.info("new run %s", run_id)

    # ------------------------------------------------------------ serving
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                header, arrays = await recv(reader, self.message_limit)
            except ProtocolError as err:  # nothing it declared was allocated: answered with the reason
                log.warning("refused a message: %s", err)
                with contextlib.suppress(OSError):
                    await send(writer, {"error": f"ProtocolError: {err}"})
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # connected and left without a message (another worker's start-up check)
            self.last_request = time.time()
            if header.get("op") == "ping":
                await send(writer, {"ok": True, "pid": os.getpid(), "run-id": self.run_id})
                return
            try:
                handler = self.evaluate if header.get("op") == "evaluate" else self.train
                reply, reply_arrays = await asyncio.get_running_loop().run_in_executor(None, handler, header, arrays)
            except Exception as err:  # reported to the ClientApp, which replies an error to the server
                log.exception("round failed")
                await send(writer, {"error": f"{type(err).__name__}: {err}"})
                return
            await send(writer, reply, reply_arrays)
            self.last_reply_sent = time.time()
        finally:
            writer.close()


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
) -> None:
    worker = NodeWorker(compute_cpus)
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


def run_worker(
    endpoint: WorkerSocket,
    idle_exit_s: float = 0.0,
    compute_cpus: set[int] | None = None,
    device: str = "",
    max_message_bytes: int = 0,
) -> None:
    """Serve one node on a claimed socket (``WorkerSocket.claim``; its claimer releases it) until
    stopped (SIGTERM/SIGINT), or idle for ``idle_exit_s`` if that is > 0.

    By default the worker lives as long as its node: a node not sampled for hours, or a
    round longer than an hour, must not lose its model and its pending update."""
    asyncio.run(serve(endpoint, idle_exit_s, compute_cpus, device, max_message_bytes))
