"""What a node does in a round: the node runtime, the same in simulation and deployment.

A round-r message (``Request``, read from the schema in ``request.py``) reaches ``Node.train``, which
owns the node's state (``node.state.NodeState``: its pending update, its residuals, the last round it
answered) and the computation running ahead, and is the only code that changes them:

1. refuse a message for an older round (``RequestRefused``: nothing changes);
2. keep the computation running ahead only if it is this run's, this partition's, this round's, and
   nothing replaced the state it started from; else let it finish and drop it;
3. a full sync (``sync-version``) drops the node's own state; a resumed server hands its pending
   update back (``resume-pending``); the first message of a resumed run restores the residuals;
4. round r's update: the computation ahead's (``g^{r-1}`` is handed to it, ``aggregate_arrived``),
   or computed now from the client half's start point (``compute.Job``);
5. round it to ``transfer-dtype`` with error feedback (residuals, written durably);
6. the correction: the replica is re-based onto ``x^{r-1}``, and the client half says what the node
   keeps on it (ParaBlock: ``Δ_i^r``, so that ``y = x^{r-1} + Δ_i^r``);
7. evaluate ``x^{r-1}`` if asked (nothing runs on the replica then);
8. start round r+1 ahead when the driver runs computations in a thread of their own (the worker).

The algorithm's rule lives in its client half (``strategies/<algo>/client.py``); the two drivers
(``client_apps/inline.py``, ``worker/server.py``) only load and store this state and say where the
computation runs. A failure that leaves the node's model state intact (a refused message, out of
memory, a data error) raises ``StateIntact``: its reply's reason starts with ``state-intact: `` and
the server keeps that node's sync state.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from .. import core
from ..config import RunConfig
from ..messages import LOCAL_MODEL_DIGEST, EvaluateReply, TrainMetrics
from ..metrics import timed
from ..replica import FetchStep
from ..strategies import client_half
from ..training import TrainResult
from .cache import NodeResources
from .compute import Job, compute_update, computed, evaluate_replica, run_here, update_metrics
from .request import NodeAnswer, Request, RequestRefused, check_blocks
from .state import NodeState, ResidualStore

log = logging.getLogger(__name__)


@dataclass
class Ahead:
    """Round ``job.server_round``'s computation, started before its message came (deployment)."""

    run_id: int
    job: Job
    future: Future

    @property
    def server_round(self) -> int:
        return self.job.server_round


@dataclass(frozen=True)
class StagedResidual:
    """A residual being written durably at ``path`` (``ResidualStore.stage``), a name nothing reads until the
    round that takes it renames it (``ResidualStore.commit``); ``wait`` waits for the write, raising its error."""

    path: Path
    wait: Callable[[], None]


@dataclass(frozen=True, eq=False)
class EarlyUpdate:
    """Round r+1's update rounded to ``transfer-dtype`` before its message came, as ``Node.feed_back`` would
    round it: from the computation ``ahead`` and the residual ``residual_in`` of its block (the very object
    the node held when it was made), to ``sent`` and the residual ``residual_out``, whose durable write begins
    then (``staged``). It changes no node state (a staged file is none: nothing reads it); ``Node.train``
    commits it only when nothing it was computed from has changed since."""

    ahead: Ahead
    residual_in: core.Tensors | None
    sent: core.Tensors
    residual_out: core.Tensors | None
    encoded: core.Encoded | None = None  # ``sent`` as it travels (None: fp32, the values themselves)
    staged: StagedResidual | None = None  # ``residual_out``'s durable write, begun (None: no store, or fp32)


def in_background(fn: Callable, *args) -> Callable[[], None]:
    """Start ``fn(*args)`` on a thread of its own; the function returned waits for it and raises its error.

    The residual's durable write (a block in fp32, fsynced) runs beside
    the correction and the next block's start instead of before them. Its tensors are copied to the
    host first, in the caller's thread: a device copy from another thread would queue behind the
    next block's kernels."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as err:  # noqa: BLE001 - raised by the waiter
            errors.append(err)

    thread = threading.Thread(target=run, name="residual-write", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if errors:
            raise errors[0]

    return wait


def commit_staged(staged: StagedResidual, store: ResidualStore, server_round: int, block: int) -> Callable:
    """The waiter of a residual staged ahead (``Node.early_update``): its write, then its rename into the
    round's name (``ResidualStore.commit``); the reply waits for it as for ``in_background``'s."""

    def wait() -> None:
        staged.wait()
        store.commit(staged.path, server_round, block)

    return wait


class ResidualsMissing(FileNotFoundError):
    """A resumed node cannot find the residuals the resume says it has (its text names where it looked,
    never a site's data)."""


class ResidualWriteFailed(RuntimeError):
    """The round's residual was not written durably while something else in the round failed too: the
    reply names both (never a ``StateIntact``: the node has taken the round in)."""


def wait_for_write(wait: Callable[[], None] | None, failed: BaseException | None = None) -> None:
    """Wait for the residual's write (``in_background``) on every way out of a round, so that it never
    runs beside the next request and its error always fails the reply, also when ``failed`` (another
    error of the round) fails it first."""
    if wait is None:
        return
    try:
        wait()
    except BaseException as write_err:
        if failed is None:
            raise
        raise ResidualWriteFailed(
            f"{type(write_err).__name__} writing the residual: {write_err} (and {type(failed).__name__}: {failed})"
        ) from failed


# ------------------------------------------------------------------ the runtime
class Node:
    """One node's state and the only code that changes it (see the module's docstring).

    ``submit(fn, *args) -> Future`` says where computations run: ``run_here`` (inline: simulation),
    or the worker's compute thread, in which case ParaBlock's round r+1 starts ahead. ``train``'s ``store``
    keeps the residuals durably (None: they are not kept across processes; fp32 transfer needs none).
    """

    def __init__(
        self, state: NodeState | None = None, submit: Callable[..., Future] = run_here, runs_ahead: bool = False
    ) -> None:
        self.state = state or NodeState()
        self.submit = submit
        self.runs_ahead = runs_ahead
        self.ahead: Ahead | None = None

    # -------------------------------------------------------------- round r
    def train(
        self,
        res: NodeResources,
        cfg: RunConfig,
        req: Request,
        fetch_step: FetchStep,
        store: ResidualStore | None = None,
        resumed_store: ResidualStore | None = None,
        early: EarlyUpdate | None = None,
        defer_write: bool = False,
    ) -> NodeAnswer:
        """Round ``req.server_round``, the module's steps in order; ``resumed_store`` is where a resumed
        run's residuals come from; ``early``: this round's update as ``early_update`` rounded it ahead, which
        step 5 takes instead of rounding again when it still holds (the reply's ``used_early`` says so).
        ``defer_write``: the residual's durable write may still run when this returns (the reply's
        ``residual_written``), so that the update's upload moves beside it; the driver waits for it before the
        reply leaves (the node worker: docs/transport.md)."""
        self.check_order(req)  # 1
        check_blocks(req, res.partition.num_blocks)
        client = client_half(req.algorithm, cfg.correction_mode)
        ahead = self.take_ahead(req)  # 2
        self.apply_sync(res, req, store)  # 3
        if store is not None and self.state.last_round == 0:  # this node's first message in this run
            self.begin_run(cfg, req, store, resumed_store)
        legs: dict[str, float] = {}  # where the round's time went (``TrainMetrics``' worker legs)
        job, result, waited, legs["step_apply_s"] = self.round_update(res, cfg, req, client, ahead, fetch_step)  # 4
        early = early if early is not None and ahead is not None and early.ahead is ahead else None
        with timed(legs, "rounding_s"):
            residual_written, used_early, encoded = self.feed_back(cfg, req, result, store, early)  # 5
        try:
            sent = core.kept_encoded(result.delta, encoded)  # held as it travelled: a quarter of fp32 in int8
            with timed(legs, "correction_s"):
                kept = self.finish_round(res, req, client, job, sent, fetch_step)  # 6
            metrics = self.reply_metrics(res, cfg, req, client, job, result, kept, waited)  # 7
            metrics = dataclasses.replace(metrics, **legs)
            trace = self.trace(res, cfg, kept)
            if self.runs_ahead and client.runs_ahead and req.next_block >= 0:  # 8
                self.start_ahead(res, cfg, req, client, fetch_step)
        except BaseException as err:
            wait_for_write(residual_written, err)
            raise
        if not defer_write:
            wait_for_write(residual_written)
            residual_written = None
        return NodeAnswer(metrics, result.delta, trace, used_early=used_early, encoded=encoded,
                     residual_written=residual_written)  # fmt: skip

    def evaluate(self, res: NodeResources, cfg: RunConfig, req: Request, fetch_step: FetchStep) -> NodeAnswer:
        """``evaluation = "clients"`` after the last round: the held-out loss of ``x^R``. Anything still
        running is waited for before the replica moves."""
        self.check_order(req)
        self.drop_ahead()
        self.apply_sync(res, req, None)
        res.replica.advance_to(req.evaluate_version, fetch_step)
        evaluation = computed(self.submit(evaluate_replica, res, cfg, req.evaluate_version, req.evaluate_generate))
        self.state.last_round = req.server_round
        return NodeAnswer(EvaluateReply(req.partition_id, evaluation))

    # -------------------------------------------------------------- its steps
    def check_order(self, req: Request) -> None:
        """A message for a round this node has answered already changes nothing."""
        if req.server_round <= self.state.last_round and not (
            req.server_round == self.state.last_round and req.sync_version is not None
        ):
            raise RequestRefused(
                f"round {req.server_round} ({req.op}) refused: this node already answered round "
                f"{self.state.last_round} of run {req.run_id}"
            )

    def take_ahead(self, req: Request) -> Ahead | None:
        """The computation running ahead, if it is this request's round, run, partition and block and the
        message keeps the state it started from; any other is finished and dropped."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        same = (ahead.run_id, ahead.job.partition_id, ahead.job.server_round, ahead.job.block) == (
            req.run_id, req.partition_id, req.server_round, req.block
        )  # fmt: skip
        if same and req.sync_version is None and req.handed_back is None:
            return ahead
        finish(ahead)  # it holds the replica until it is done
        return None

    def drop_ahead(self) -> None:
        if self.ahead is not None:
            finish(self.ahead)
            self.ahead = None

    def apply_sync(self, res: NodeResources, req: Request, store: ResidualStore | None) -> None:
        """A full sync drops the node's own state (the server's values of ``x^{r-2}`` replace the
        replica's where the message carries them), unless it says it keeps it (a resumed deployment's values,
        to a worker that starts the new run at ``x^0``); a resumed server's hand-back becomes the pending."""
        if req.sync_version is not None:
            if req.sync_values is not None:
                res.replica.reset_to(req.sync_version, req.sync_values)
            if not req.sync_keeps_state:
                self.state.pending, self.state.residuals = None, {}
                if store is not None:
                    store.reset(req.server_round)
        if req.handed_back is not None:
            self.state.pending = req.handed_back

    def begin_run(
        self, cfg: RunConfig, req: Request, store: ResidualStore, resumed_store: ResidualStore | None
    ) -> None:
        """A resumed run: the residuals as of the checkpoint's round R, which every message of a resumed
        run names (``resumed-after``), also to a node first sampled rounds later that answered rounds
        after R before the server stopped; a new run: none. A process restarted later in the run (the
        store says the run has begun on it) goes on from its newest residuals, not from round R's.

        A hand-back (``resume-pending``) says this node's round-R reply was aggregated, so the store
        must hold that round's residual of its block: without it the node would go on from zero and the
        run would silently stop being exact, so it fails instead, naming where it looked. A full sync
        without a hand-back drops them, as the stopped server's would have (its reply of round R was
        rejected, or it missed too much): the resumed server syncs each node as the stopped one would."""
        drops = req.sync_version is not None and not req.sync_keeps_state
        if store.begun(req.run_id):  # a restarted process, later in this run: its newest residuals
            if not drops:  # (a full sync has just dropped them)
                self.state.residuals = store.as_of(req.server_round - 1)
            return
        if req.resumed_after is None or resumed_store is None:
            store.clear()
            store.begin(req.run_id)
            return
        self.state.residuals = resumed_store.as_of(req.resumed_after)
        back = req.handed_back
        if back is not None and back.block not in self.state.residuals:
            raise ResidualsMissing(
                f"resumed after round {req.resumed_after}: no residual of block {back.block} in "
                f"{resumed_store.dir} (expected this node's round-{req.resumed_after} residuals of "
                f"transfer-dtype={cfg.transfer_dtype} there); not starting its error feedback from zero"
            )
        if drops and back is None:  # the stopped server had dropped this node's state
            self.state.residuals = {}
        store.restart_at(req.resumed_after, self.state.residuals)
        store.begin(req.run_id)
        log.info("resumed after round %d with residuals of blocks %s", req.resumed_after, sorted(self.state.residuals))

    def round_update(
        self, res: NodeResources, cfg: RunConfig, req: Request, client, ahead: Ahead | None, fetch_step: FetchStep
    ) -> tuple[Job, TrainResult, float, float]:
        """Step 4: round r's update, how long the node waited for the computation running ahead, and how long
        the replica took to reach the computation's start (the steps applied; none for one that ran ahead)."""
        if ahead is not None:  # round r, started from the start point when round r-1 was answered
            client.aggregate_arrived(ahead.job.slot, req.step(req.server_round - 1), ahead.job.started_from)
            wait_start = time.time()
            result = computed(ahead.future)
            return ahead.job, result, time.time() - wait_start, 0.0
        job = self.new_job(req, client, req.server_round, req.block, fetch_step)
        apply_start = time.perf_counter()
        res.replica.advance_to(job.base_version, fetch_step)
        applied_s = time.perf_counter() - apply_start
        if job.slot is not None and req.server_round > 1:  # g^{r-1} came with the message
            client.aggregate_arrived(job.slot, req.step(req.server_round - 1), job.started_from)
        return job, computed(self.submit(compute_update, res, cfg, job)), 0.0, applied_s

    def new_job(self, req: Request, client, server_round: int, block: int, fetch_step: FetchStep) -> Job:
        """Round ``server_round``'s computation of ``block``, from the client half's start point."""
        base_version, started_from = client.start_point(self.state.pending, server_round, fetch_step)
        return Job(server_round=server_round, block=block, base_version=base_version,
                   started_from=started_from, partition_id=req.partition_id, num_partitions=req.num_partitions,
                   slot=client.new_slot())  # fmt: skip

    def feed_back(
        self, cfg: RunConfig, req: Request, result: TrainResult, store: ResidualStore | None,
        early: EarlyUpdate | None = None,
    ) -> tuple[Callable[[], None] | None, bool, core.Encoded | None]:  # fmt: skip
        """Step 5: ``Δ_i^r`` rounded to ``transfer-dtype``; what rounding dropped goes into this block's
        next update (error feedback). The residual is durable before the reply leaves, written while
        the next block starts (the function returned waits for the write). ``early`` (this round's
        computation, rounded ahead) is taken when it was rounded from the residual the node holds now, so
        the update and residual are the very values its upload used, and its residual, written since it was
        rounded, only needs a rename; whether it was, second; third, the update as it travels (from the same
        conversion: packing it converts nothing again; None for fp32)."""
        residual = self.state.residuals.get(req.block)
        used_early = early is not None and early.residual_in is residual
        if cfg.transfer_dtype == "fp32":
            return None, used_early, None
        if used_early:
            result.delta, self.state.residuals[req.block], encoded = early.sent, early.residual_out, early.encoded
        else:
            result.delta, self.state.residuals[req.block], encoded = core.round_with_feedback_encoded(
                result.delta, residual, cfg.transfer_dtype
            )
        if store is None:
            return None, used_early, encoded
        if used_early and early.staged is not None:  # (one not taken is gone by a later write of the store)
            return commit_staged(early.staged, store, req.server_round, req.block), used_early, encoded
        residual = {n: t.detach().cpu() for n, t in self.state.residuals[req.block].items()}
        return in_background(store.save, req.server_round, req.block, residual), used_early, encoded

    def early_update(
        self, cfg: RunConfig, server_round: int, store: ResidualStore | None = None
    ) -> Callable[[], EarlyUpdate | None]:
        """Round ``server_round``'s update rounded as soon as its computation running ahead is done, for a
        driver that moves it before its message comes: what it rounds from is taken now (call it between
        requests, when nothing changes the node), and the function returned waits for the computation and
        rounds, changing nothing the node holds. Its new residual starts its durable write into ``store`` at
        once, under a staged name (``ResidualStore.stage``), beside the upload: the round that takes it then
        renames it, and its reply waits for no write. None from it: there is no such computation, or its
        result depends on when its message comes (``on-receipt``'s correction)."""
        ahead = self.ahead
        if ahead is None or ahead.server_round != server_round or ahead.job.slot is not None:
            return lambda: None
        block, dtype = ahead.job.block, cfg.transfer_dtype
        residual_in = self.state.residuals.get(block)

        def rounded() -> EarlyUpdate:
            delta = ahead.future.result().delta  # its failure is the round's to report, when its message comes
            if dtype == "fp32":
                return EarlyUpdate(ahead, residual_in, delta, residual_in)
            sent, residual_out, encoded = core.round_with_feedback_encoded(delta, residual_in, dtype)
            staged = None
            if store is not None:
                path = store.staged_name(server_round, block)
                host = {n: t.detach().cpu() for n, t in residual_out.items()}
                staged = StagedResidual(path, in_background(store.stage, path, host))
            return EarlyUpdate(ahead, residual_in, sent, residual_out, encoded, staged)

        return rounded

    def finish_round(
        self, res: NodeResources, req: Request, client, job: Job, delta: core.Tensors, fetch_step: FetchStep
    ) -> core.PendingUpdate | None:
        """Step 6, the correction: re-base the replica onto ``x^{r-1}`` (replay ``g^{r-1}``), and keep
        what the client half keeps written on it (ParaBlock: ``Δ_i^r``; BCD: nothing). Re-basing equals
        adding ``η_s Δ̄^{r-1} − Δ_i^{r-1}`` to the trained model in exact arithmetic and, unlike it,
        rounds nothing: the node's model ``y = x^{r-1} + Δ_i^r`` holds to the bit."""
        res.replica.advance_to(req.server_round - 1, fetch_step)
        kept = client.finish_round(job.started_from, delta, job.block, req.server_round, fetch_step)
        self.state.pending, self.state.last_round = kept, req.server_round
        return kept

    def reply_metrics(
        self, res: NodeResources, cfg: RunConfig, req: Request, client, job: Job, result: TrainResult,
        kept: core.PendingUpdate | None, waited: float,
    ) -> TrainMetrics:  # fmt: skip
        """What the reply says: the update's numbers, the client half's rule, and (step 7) the evaluation
        of ``x^{r-1}`` when the round asks for it (the replica holds it; nothing runs on it meanwhile).
        An evaluation that fails is not ``StateIntact``: the node has taken round r in, the server not."""
        rule = client.round_metrics(job.slot, res.replica, kept, cfg.local_steps)
        metrics = dataclasses.replace(update_metrics(result, job, res), waited_s=waited, **rule)
        if req.evaluate_version is None:
            return metrics
        evaluation = self.submit(evaluate_replica, res, cfg, req.evaluate_version, req.evaluate_generate).result()
        return dataclasses.replace(metrics, evaluation=evaluation)

    @staticmethod
    def trace(res: NodeResources, cfg: RunConfig, kept: core.PendingUpdate | None) -> dict[str, str]:
        """``verify-invariant``: the digest of the node's model after the correction, ``x^{r-1} + Δ_i^r``, from its
        parts (``core.model_digest``): the replica's tensors, from their cache but the block the step moved, and
        its own update as it travelled."""
        if not cfg.verify_invariant or kept is None:
            return {}
        replica = res.replica
        names = res.partition.all_names()
        return {LOCAL_MODEL_DIGEST: core.model_digest(replica.params, names, kept.delta, replica.hashes)}

    def start_ahead(self, res: NodeResources, cfg: RunConfig, req: Request, client, fetch_step: FetchStep) -> None:
        """Step 8: round r+1 starts now, from the client half's start point, while round r's reply travels."""
        job = self.new_job(req, client, req.server_round + 1, req.next_block, fetch_step)
        self.ahead = Ahead(req.run_id, job, self.submit(compute_update, res, cfg, job))


def finish(ahead: Ahead) -> None:
    """Wait for a computation running ahead (it holds the replica), whatever its outcome."""
    try:
        ahead.future.result()
    except Exception as err:  # noqa: BLE001 - dropped anyway; said
        log.warning("round %d computed ahead failed and was dropped: %s", ahead.server_round, err)
