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
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .. import core, node
from ..config import RunConfig
from ..replica import catch_up_steps, resumed_pending
from ..runtime import setup_torch
from .protocol import recv, send

log = logging.getLogger("parablock_flwr.worker")


class CorrectionSlot:
    """An aggregate handed to the running computation (``on-receipt`` mode).

    The request thread posts ``(g^{r-1}, Δ_i^{r-1})``; the compute thread
    applies it at its next step boundary, never inside a step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._posted: tuple[core.Tensors, core.Tensors] | None = None
        self.applied_after_step: int | None = None

    def post(self, step: core.Tensors, own_update: core.Tensors) -> None:
        with self._lock:
            self._posted = (step, own_update)

    def __call__(self, k: int, params: dict, before: core.Tensors) -> None:
        with self._lock:
            posted, self._posted = self._posted, None
        if posted is not None and self.applied_after_step is None:
            core.correct_in_place(params, before, *posted)
            self.applied_after_step = k


def split_records(arrays: dict[str, np.ndarray]) -> dict[str, core.Tensors]:
    """``{"record/name": array}`` from the relay back into ``{record: {name: tensor}}``."""
    records: dict[str, core.Tensors] = {"global-step": {}}
    for key, array in arrays.items():
        record, _, name = key.partition("/")
        records.setdefault(record, {})[name] = torch.from_numpy(array.copy())
    return records


class NodeWorker:
    """One node's persistent state and its background computation."""

    def __init__(self) -> None:
        self.compute_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parablock-compute")
        self.run_id: int | None = None
        self.pending: core.PendingUpdate | None = None
        self.next_round: tuple[int, Future, CorrectionSlot] | None = None  # round, its TrainResult, its slot
        self.last_reply_sent = 0.0
        self.last_request = time.time()

    # ------------------------------------------------------------ rounds
    def train(self, header: dict, arrays: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
        received = time.time()
        self.last_request = received
        cfg = RunConfig.from_flower(header["run-config"])
        if header["run-id"] != self.run_id:
            self._new_run(header["run-id"])
        setup_torch(cfg)
        res = node.resources(cfg, header["run-id"])
        rnd = header["round"]
        server_round, block, next_block = int(rnd["server-round"]), int(rnd["block"]), int(rnd["next-block"])
        pid, nparts = int(header["partition-id"]), int(header["num-partitions"])
        records = split_records(arrays)
        steps = catch_up_steps(rnd, records)

        def fetch_step(version: int):
            if version in steps:
                return steps[version]
            raise RuntimeError(f"this worker's model is at v{res.replica.version} and the message lacks global "
                               f"step v{version} (the server sends missed steps to nodes it knows are behind)")

        waited = 0.0
        ahead = self.next_round
        self.next_round = None
        if ahead is not None and ahead[0] != server_round:
            # Computed ahead for a round this node was not part of: wait for it (it uses the replica), drop it.
            with contextlib.suppress(Exception):
                ahead[1].result()
            ahead = None
        if "sync-version" in rnd:  # missed more steps than there are blocks: take x^{r-1} as values
            res.replica.reset_to(int(rnd["sync-version"]), records["sync-values"])
        if (handed_back := resumed_pending(rnd, records)) is not None:  # the server restarted from a checkpoint
            self.pending = handed_back
        correction_step = cfg.local_steps  # at the end, unless applied on receipt
        if rnd["algorithm"] == "parablock" and ahead is not None:
            _, future, slot = ahead
            if cfg.correction_mode == "on-receipt" and self.pending is not None:
                slot.post(steps[server_round - 1][1], self.pending.delta)  # applied at the next step boundary
            wait_start = time.time()
            result = future.result()  # Δ_i^r, computed from x^{r-2} + Δ_i^{r-1}
            waited = time.time() - wait_start
            base_version = server_round - 2
            correction_step = slot.applied_after_step or cfg.local_steps
            # The correction as the local model's bookkeeping: re-base onto x^{r-1}, keep Δ_i^r.
            res.replica.advance_to(server_round - 1, fetch_step)
        else:  # nothing computed ahead: compute now (from x^{r-1}, or x^{r-2} + Δ_i^{r-1} after a resume)
            pending = None
            if rnd["algorithm"] == "parablock":
                base_version, pending = core.parablock_base(self.pending, server_round)
            else:
                base_version = server_round - 1
            res.replica.advance_to(base_version, fetch_step)
            result = node.compute_update(res, cfg, server_round, block, pending, base_version, pid, nparts)
            res.replica.advance_to(server_round - 1, fetch_step)
        metrics = {
            **node.update_metrics(result, server_round, block, pid, base_version),
            "compute-start": result.started, "compute-end": result.ended,
            "request-received": received, "waited-s": waited, "prev-reply-sent": self.last_reply_sent,
            "correction-after-step": correction_step,
        }
        trace = {}
        if rnd["algorithm"] == "parablock":
            self.pending = core.correct(block, result.delta, server_round)
            if cfg.verify_invariant:  # before the next computation touches the replica
                trace["local-model-sha256"] = core.digest_after(res.replica.params, res.partition.all_names(),
                                                                result.delta)
            if next_block >= 0:
                slot = CorrectionSlot()
                future = self.compute_thread.submit(node.compute_update, res, cfg, server_round + 1, next_block,
                                                    self.pending, server_round - 1, pid, nparts, slot)
                self.next_round = (server_round + 1, future, slot)
        reply_arrays = {n: t.numpy() for n, t in result.delta.items()}
        return {"metrics": metrics, "trace": trace}, reply_arrays

    def _new_run(self, run_id: int) -> None:
        """A new run on this node starts from a fresh state."""
        if self.next_round is not None:
            with contextlib.suppress(Exception):
                self.next_round[1].result()
        self.run_id, self.pending, self.next_round, self.last_reply_sent = run_id, None, None, 0.0
        log.info("new run %s", run_id)

    # ------------------------------------------------------------ serving
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header, arrays = await recv(reader)
            if header.get("op") == "ping":
                await send(writer, {"ok": True, "pid": os.getpid(), "run-id": self.run_id})
                return
            try:
                reply, reply_arrays = await asyncio.get_running_loop().run_in_executor(
                    None, self.train, header, arrays)
            except Exception as err:  # reported to the ClientApp, which replies an error to the server
                log.exception("round failed")
                await send(writer, {"error": f"{type(err).__name__}: {err}"})
                return
            await send(writer, reply, reply_arrays)
            self.last_reply_sent = time.time()
        finally:
            writer.close()


async def serve(socket_path: Path, idle_exit_s: float) -> None:
    worker = NodeWorker()
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()
    server = await asyncio.start_unix_server(worker.handle, path=str(socket_path), limit=2**26)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("node worker %d listening on %s", os.getpid(), socket_path)
    async with server:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=5.0)
            if idle_exit_s and time.time() - worker.last_request > idle_exit_s:
                log.info("no message for %.0f s: exiting", idle_exit_s)
                break
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()
    worker.compute_thread.shutdown(wait=False, cancel_futures=True)


def run_worker(socket_path: Path, idle_exit_s: float = 3600.0) -> None:
    """Serve one node until stopped (SIGTERM/SIGINT) or idle for ``idle_exit_s``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [worker] %(message)s")
    asyncio.run(serve(Path(socket_path), idle_exit_s))
