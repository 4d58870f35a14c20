"""What a node does in a round: the node runtime, the same in simulation and deployment.

A round-r message (``Request``, parsed here and nowhere else) reaches ``Node.train``, which owns the
node's state (``node_state.NodeState``: its pending update, its residuals, the last round it answered)
and the computation running ahead, and is the only code that changes them:

1. refuse a message for an older round (``Refused``: nothing changes);
2. keep the computation running ahead only if it is this run's, this partition's, this round's, and
   nothing replaced the state it started from; else let it finish and drop it;
3. a full sync (``sync-version``) drops the node's own state; a resumed server hands its pending
   update back (``resume-pending``); the first message of a resumed run restores the residuals;
4. round r's update: the computation ahead's (``g^{r-1}`` is handed to it, ``aggregate_arrived``),
   or computed now from the client half's start point;
5. round it to ``transfer-dtype`` with error feedback (residuals, written durably);
6. the client half finishes the round (ParaBlock: the correction); the replica ends at ``x^{r-1}``;
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
from dataclasses import dataclass, field

import datasets
import torch

from . import core
from .config import RunConfig
from .data import (
    client_partition,
    local_rows_limit,
    node_splits,
    sample_batches,
    tokenized_rows,
    tokenized_splits,
    truncated_in_batches,
)
from .evaluation import evaluate
from .model import load_for_training, load_tokenizer
from .node_data import NodeSettings, error_line
from .node_state import NodeState, ResidualStore
from .replica import FetchStep, ModelReplica, ReplicaLost, Step, catch_up_steps, resumed_pending
from .runtime import round_seed
from .strategies import client_half
from .training import TrainResult, TrainSettings, train_block

log = logging.getLogger(__name__)


class StateIntact(Exception):
    """A request failed and the node's model state is as it was before it (or as consistent: the
    replica at an exact version, the pending update unchanged): the server may keep its sync state.
    Its reply's reason starts with ``node_data.STATE_INTACT``."""


class Refused(StateIntact):
    """A message the node must not act on (an older round, another run, another partition)."""


@dataclass
class NodeResources:
    """Loaded once per process (a Ray actor or a node worker) and reused."""

    key: tuple[int, RunConfig, NodeSettings]
    replica: ModelReplica
    partition: core.BlockPartition
    train_rows: datasets.Dataset  # the node's own rows, or the run's training rows to take a partition of
    pad_id: int
    heldout_rows: datasets.Dataset | None = None  # for evaluation = "clients"
    tokenizer: object = None
    settings: NodeSettings = NodeSettings()
    # Source rows ``max-seq-len`` cut before their answer, dropped (data.Split): the node's own data's,
    # or (a partition of the run's dataset) the whole dataset's, the same on every such node.
    dropped_for_length: int = 0
    malformed_rows: int = 0  # its data's rows skipped as malformed (data.Malformed), counted like the above

    def rows(self, cfg: RunConfig, partition_id: int, num_partitions: int) -> datasets.Dataset:
        """The rows this node trains on: its own data, or its partition of the run's dataset."""
        if self.settings.local:
            return self.train_rows
        return client_partition(
            self.train_rows, partition_id, num_partitions, cfg.partitioning, cfg.dirichlet_alpha, cfg.seed
        )


_RESOURCES: NodeResources | None = None
WEIGHTS_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def resources(cfg: RunConfig, run_id: int, settings: NodeSettings | None = None) -> NodeResources:
    """This process's model replica and data, rebuilt only for a new run, model or node settings.

    A node with its own ``dataset`` (``settings``) loads only that, never the run config's
    ``dataset``; its held-out rows are its ``heldout-dataset``, or (``evaluation = "clients"``
    without one) the first ``heldout-examples`` rows of its own data."""
    global _RESOURCES
    settings = settings or NodeSettings()
    if (refused := settings.refusal(cfg.model, cfg.dataset)) is not None:
        raise Refused(refused)  # the node config's allow-lists: nothing loaded, nothing changed
    key = (run_id, cfg, settings)
    if _RESOURCES is None or _RESOURCES.key != key:
        _RESOURCES = None  # free the previous run's model before loading the next
        model, partition = load_for_training(cfg, cfg.weights)  # bf16: no fp32 copy of the whole model
        device = node_device(settings.device)
        weights_dtype = WEIGHTS_DTYPES[cfg.weights]
        replica = ModelReplica(model, partition.all_names(), weights_dtype)  # weights cast before the move
        model.to(device)
        tokenizer = load_tokenizer(cfg.model, cfg.prompt_format)
        own_heldout = cfg.heldout_examples if cfg.evaluation == "clients" else 0
        if settings.local:
            split = node_splits(
                settings.dataset, settings.heldout_dataset, own_heldout, cfg.num_examples, cfg.seed, tokenizer,
                cfg.max_seq_len,
            )  # fmt: skip
        else:
            split = tokenized_splits(
                cfg.dataset, cfg.num_examples, cfg.heldout_examples, cfg.seed, tokenizer, cfg.max_seq_len
            )
        train_rows, heldout_rows = split
        if not settings.local and settings.heldout_dataset:
            limit = local_rows_limit(settings.heldout_dataset, cfg.num_examples)
            heldout_rows = tokenized_rows(settings.heldout_dataset, limit, cfg.seed, tokenizer, cfg.max_seq_len)
        _RESOURCES = NodeResources(
            key,
            replica,
            partition,
            train_rows,
            tokenizer.pad_token_id,
            heldout_rows,
            tokenizer,
            settings,
            split.dropped_for_length,
            split.malformed,
        )
    return _RESOURCES


def loaded() -> NodeResources | None:
    """The resources this process holds, if any: the worker bounds a run's messages by its model."""
    return _RESOURCES


def node_device(name: str) -> torch.device:
    """The node's device: as named (``cuda:1``), else CUDA when there is a GPU, else the CPU."""
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device={name!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


# ------------------------------------------------------------------ a message, parsed once
@dataclass
class Request:
    """One message to a node: every key a round's (or the final evaluation's) message carries."""

    op: str  # "train" or "evaluate"
    run_id: int
    partition_id: int
    num_partitions: int
    server_round: int
    block: int
    next_block: int  # -1: none (the last round, or the final evaluation)
    algorithm: str
    run_dir: str  # the server's run folder (simulation: the step log the replica catches up from)
    steps: dict[int, Step]  # g^{r-1} and any catch-up steps, by version
    sync_version: int | None = None  # a full sync: the node's own state is dropped ...
    sync_values: core.Tensors | None = None  # ... and x^{sync_version} given (None: the driver replays it)
    handed_back: core.PendingUpdate | None = None  # a resumed server's Δ_i^R
    evaluate_version: int | None = None  # evaluation = "clients": evaluate x^v in this round
    evaluate_generate: bool = False
    resumed_after: int | None = None  # a resumed run: the round R its server's checkpoint holds
    resume_dir: str = ""  # ... and that run's folder, resolved by the server (simulation: its node-state/)

    @classmethod
    def parse(
        cls, op: str, run_id: int, round_cfg, arrays: dict[str, core.Tensors], partition_id: int, num_partitions: int
    ) -> Request:
        """``round_cfg`` is the message's ``round`` config; ``arrays`` its array records as tensors."""
        version = int(round_cfg.get("evaluate-version", -1))
        return cls(
            op=op,
            run_id=int(run_id),
            partition_id=int(partition_id),
            num_partitions=int(num_partitions),
            server_round=int(round_cfg["server-round"]),
            block=int(round_cfg.get("block", -1)),
            next_block=int(round_cfg.get("next-block", -1)),
            algorithm=str(round_cfg.get("algorithm", "")),
            run_dir=str(round_cfg.get("run-dir", "")),
            steps=catch_up_steps(round_cfg, arrays),
            sync_version=int(round_cfg["sync-version"]) if "sync-version" in round_cfg else None,
            sync_values=arrays.get("sync-values"),
            handed_back=resumed_pending(round_cfg, arrays),
            evaluate_version=version if version >= 0 else None,
            evaluate_generate=bool(round_cfg.get("evaluate-generate", 0)),
            resumed_after=int(round_cfg["resumed-after"]) if "resumed-after" in round_cfg else None,
            resume_dir=str(round_cfg.get("resume-dir", "")),
        )

    @property
    def key(self) -> tuple:
        """What makes two messages the same request (a repeat gets the same reply)."""
        return self.op, self.run_id, self.partition_id, self.server_round

    def step(self, version: int) -> core.Tensors:
        return self.steps[version][1]


@dataclass
class Reply:
    """What a node answers: its metrics, its update (train only) and its trace (``verify-invariant``)."""

    metrics: dict
    update: core.Tensors = field(default_factory=dict)
    trace: dict[str, str] = field(default_factory=dict)


@dataclass
class Ahead:
    """Round ``server_round``'s computation, started before its message came (deployment)."""

    run_id: int
    partition_id: int
    server_round: int
    base_version: int
    started_from: core.PendingUpdate | None
    future: Future
    slot: object  # the client half's correction slot (None: nothing reaches it while it runs)


def check_blocks(req: Request, num_blocks: int) -> None:
    """A round's block (and the next one, -1: none) among this model's, refused in one line before any
    work: only a server of another model or partition, or a forged message, names another."""
    for key, block, none in (("block", req.block, None), ("next-block", req.next_block, -1)):
        if not (0 <= block < num_blocks or block == none):
            raise Refused(f"{key}={block} refused: this node's model has blocks 0..{num_blocks - 1}")


def run_here(fn: Callable, *args):
    """Run ``fn`` now, in the caller's thread (the inline ClientApp's way), as a finished Future."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as err:  # noqa: BLE001 - re-raised by .result()
        future.set_exception(err)
    return future


def in_background(fn: Callable, *args) -> Callable[[], None]:
    """Start ``fn(*args)`` on a thread of its own; the function returned waits for it and raises its error.

    The residual's durable write (a block in fp32, fsynced: seconds at 8B sizes) runs beside
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
    or the worker's compute thread, in which case ParaBlock's round r+1 starts ahead. ``store`` keeps
    the residuals durably (None: they are not kept across processes; fp32 transfer needs none).
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
    ) -> Reply:
        """Round ``req.server_round``; ``resumed_store`` is where a resumed run's residuals come from."""
        self.check_order(req)
        check_blocks(req, res.partition.num_blocks)
        client = client_half(req.algorithm, cfg.correction_mode)
        ahead = self.take_ahead(req)
        self.apply_sync(res, req, store)
        if store is not None and self.state.last_round == 0:  # this node's first message in this run
            self.begin_run(cfg, req, store, resumed_store)

        waited = 0.0
        if ahead is not None:  # round r, started from x^{r-2} + Δ_i^{r-1} when round r-1 was answered
            base_version, started_from, slot = ahead.base_version, ahead.started_from, ahead.slot
            client.aggregate_arrived(slot, req.step(req.server_round - 1), started_from)
            wait_start = time.time()
            result = computed(ahead.future)
            waited = time.time() - wait_start
        else:
            base_version, started_from = client.start_point(self.state.pending, req.server_round, fetch_step)
            res.replica.advance_to(base_version, fetch_step)
            slot = client.new_slot()
            if slot is not None and req.server_round > 1:  # g^{r-1} came with the message
                client.aggregate_arrived(slot, req.step(req.server_round - 1), started_from)
            job = (res, cfg, req.server_round, req.block, started_from, base_version, req.partition_id,
                   req.num_partitions, slot)  # fmt: skip
            result = computed(self.submit(compute_update, *job))

        residual_written = None
        if cfg.transfer_dtype != "fp32":  # error feedback: what rounding dropped goes into the next update
            result.delta, self.state.residuals[req.block] = core.round_with_feedback(
                result.delta, self.state.residuals.get(req.block), cfg.transfer_dtype
            )
            if store is not None:  # durable before the reply leaves; written while the next block starts
                residual = {n: t.detach().cpu() for n, t in self.state.residuals[req.block].items()}
                residual_written = in_background(store.save, req.server_round, req.block, residual)
        try:
            kept = client.finish_round(res.replica, started_from, result.delta, req.block, req.server_round, fetch_step)
            res.replica.advance_to(req.server_round - 1, fetch_step)
            self.state.pending, self.state.last_round = kept, req.server_round

            trace = {}
            if cfg.verify_invariant and kept is not None:  # y after the correction is x^{r-1} + Δ_i^r
                names = res.partition.all_names()
                trace["local-model-sha256"] = core.digest_after(res.replica.params, names, kept.delta)
            metrics = {
                **update_metrics(result, req.server_round, req.block, req.partition_id, base_version),
                "own-data": int(res.settings.local),
                "dropped-examples": res.dropped_for_length,  # its data's rows max-seq-len cut before their answer
                "malformed-examples": res.malformed_rows,  # rows skipped as malformed (counted, never quoted)
                "oom-retries": result.oom_retries,
                "compute-start": result.started,
                "compute-end": result.ended,
                "waited-s": waited,
                **client.round_metrics(slot, res.replica, kept, cfg.local_steps),
            }
            if req.evaluate_version is not None:  # x^{r-1}: the replica holds it, nothing runs on it
                # Not StateIntact if it fails: the node has taken round r in already, the server has not.
                job = (res, cfg, req.evaluate_version, req.evaluate_generate)
                metrics.update(self.submit(evaluate_replica, *job).result())
            if self.runs_ahead and client.runs_ahead and req.next_block >= 0:
                self.start_ahead(res, cfg, req, client, fetch_step)
        except BaseException as err:
            wait_for_write(residual_written, err)
            raise
        wait_for_write(residual_written)
        return Reply(metrics, result.delta, trace)

    def evaluate(self, res: NodeResources, cfg: RunConfig, req: Request, fetch_step: FetchStep) -> Reply:
        """``evaluation = "clients"`` after the last round: the held-out loss of ``x^R``. Anything still
        running is waited for before the replica moves."""
        self.check_order(req)
        self.drop_ahead()
        self.apply_sync(res, req, None)
        res.replica.advance_to(req.evaluate_version, fetch_step)
        metrics = computed(self.submit(evaluate_replica, res, cfg, req.evaluate_version, req.evaluate_generate))
        self.state.last_round = req.server_round
        return Reply({**metrics, "partition-id": req.partition_id})

    # -------------------------------------------------------------- its steps
    def check_order(self, req: Request) -> None:
        """A message for a round this node has answered already changes nothing."""
        if req.server_round <= self.state.last_round and not (
            req.server_round == self.state.last_round and req.sync_version is not None
        ):
            raise Refused(
                f"round {req.server_round} ({req.op}) refused: this node already answered round "
                f"{self.state.last_round} of run {req.run_id}"
            )

    def take_ahead(self, req: Request) -> Ahead | None:
        """The computation running ahead, if it is this request's round, run and partition and the
        message keeps the state it started from; any other is finished and dropped."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        same = (ahead.run_id, ahead.partition_id, ahead.server_round) == (
            req.run_id, req.partition_id, req.server_round
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
        replica's where the message carries them); a resumed server's hand-back becomes the pending."""
        if req.sync_version is not None:
            if req.sync_values is not None:
                res.replica.reset_to(req.sync_version, req.sync_values)
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
        if store.begun(req.run_id):  # a restarted process, later in this run: its newest residuals
            if req.sync_version is None:  # (a full sync has just dropped them)
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
        if req.sync_version is not None and back is None:  # the stopped server had dropped this node's state
            self.state.residuals = {}
        store.restart_at(req.resumed_after, self.state.residuals)
        store.begin(req.run_id)
        log.info("resumed after round %d with residuals of blocks %s", req.resumed_after, sorted(self.state.residuals))

    def start_ahead(self, res: NodeResources, cfg: RunConfig, req: Request, client, fetch_step: FetchStep) -> None:
        """Round r+1 starts now, from the client half's start point, while round r's reply travels."""
        next_round = req.server_round + 1
        base_version, started_from = client.start_point(self.state.pending, next_round, fetch_step)
        slot = client.new_slot()
        job = (res, cfg, next_round, req.next_block, started_from, base_version, req.partition_id,
               req.num_partitions, slot)  # fmt: skip
        future = self.submit(compute_update, *job)
        self.ahead = Ahead(req.run_id, req.partition_id, next_round, base_version, started_from, future, slot)


def finish(ahead: Ahead) -> None:
    """Wait for a computation running ahead (it holds the replica), whatever its outcome."""
    try:
        ahead.future.result()
    except Exception as err:  # noqa: BLE001 - dropped anyway; said
        log.warning("round %d computed ahead failed and was dropped: %s", ahead.server_round, err)


def computed(future: Future):
    """A computation's result; its failure leaves the replica as it was (``local_model`` restores it)."""
    try:
        return future.result()
    except (StateIntact, ReplicaLost):
        raise
    except (ValueError, RuntimeError, OSError) as err:  # a data or memory error inside the computation
        log.warning("the computation failed: %s: %s", type(err).__name__, err)  # the whole text, at the site
        raise StateIntact(error_line(err)) from err


def evaluate_replica(resources: NodeResources, cfg: RunConfig, version: int, generate: bool) -> dict:
    """``evaluation = "clients"``: the held-out loss of ``x^version`` (the replica, nothing applied, nothing
    running on it) on this node's held-out rows, as reply metrics. The caller guarantees that no
    computation uses the replica meanwhile (the worker runs it before starting the next one)."""
    if resources.replica.version != version:
        have = resources.replica.version
        raise RuntimeError(f"evaluation of x^{version} asked while this node's model is at x^{have}")
    if resources.heldout_rows is None or not len(resources.heldout_rows):
        raise ValueError("evaluation='clients': this node has no held-out rows")
    own = dataclasses.replace(cfg, dataset=resources.settings.dataset or cfg.dataset)  # task accuracy by its data
    metrics, _ = evaluate(resources.replica.model, resources.tokenizer, resources.heldout_rows, own, generate)
    out = {
        "eval-version": version,
        "heldout-loss": metrics["heldout_loss"],
        "heldout-examples": len(resources.heldout_rows),
    }
    if "task_accuracy" in metrics:
        out["task-accuracy"], out["task-examples"] = metrics["task_accuracy"], metrics["task_examples"]
    return out


def compute_update(
    resources: NodeResources,
    cfg: RunConfig,
    server_round: int,
    block: int,
    pending: core.PendingUpdate | None,
    base_version: int,
    partition_id: int,
    num_partitions: int,
    slot=None,
) -> TrainResult:
    """Train ``block`` from ``x^{base_version} + pending``; the replica is left as it was.

    ``slot`` (a client half's correction slot) is called between steps and sees the trained
    model's parameters before they are restored (``capture``). Out of device memory, the round is
    tried once more with half the micro-batch (``oom-retries``), else it fails naming what to change.
    """
    rows = resources.rows(cfg, partition_id, num_partitions)
    seed = round_seed(cfg, server_round, partition_id)
    settings = TrainSettings(
        cfg.local_steps,
        cfg.learning_rate,
        cfg.weight_decay,
        cfg.lr_schedule,
        cfg.warmup_steps,
        cfg.max_grad_norm,
        "bf16" if cfg.weights == "bf16" else cfg.precision,  # bf16 weights with an fp32 block: autocast
        micro_batch_size=cfg.micro_batch_size,
        gradient_checkpointing=cfg.gradient_checkpointing,
        # lr-schedule-scope = "run": one schedule over R x K steps, round r starting at step (r-1) x K
        schedule_steps=cfg.num_server_rounds * cfg.local_steps if cfg.lr_schedule_scope == "run" else 0,
        schedule_offset=(server_round - 1) * cfg.local_steps if cfg.lr_schedule_scope == "run" else 0,
    )
    names = resources.partition.names(block)
    device = next(resources.replica.model.parameters()).device
    for attempt in (0, 1):
        torch.manual_seed(seed)
        batches = sample_batches(rows, cfg.local_steps, cfg.batch_size, seed, resources.pad_id)
        try:
            with resources.replica.local_model(base_version, pending, names) as model:
                result = train_block(model, names, batches, settings, slot)
                if slot is not None:
                    slot.capture(dict(model.named_parameters()))
            break
        except torch.OutOfMemoryError as err:
            first = settings.micro_batch_size or cfg.batch_size
            if attempt or first <= 1:
                raise StateIntact(out_of_memory(err, device, first, cfg)) from err
            settings = dataclasses.replace(settings, micro_batch_size=max(1, first // 2))
            log.warning("round %d: out of memory on %s with micro-batch %d; retrying once with %d",
                        server_round, device, first, settings.micro_batch_size)  # fmt: skip
            free_device_cache(device)
            if slot is not None:
                slot.rearm()
    result.oom_retries = attempt
    result.num_examples = len(rows)
    result.truncated = truncated_in_batches(rows, cfg.local_steps, cfg.batch_size, seed)
    return result


def free_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def out_of_memory(err: BaseException, device: torch.device, micro_batch: int, cfg: RunConfig) -> str:
    """One line: the memory the round needed (torch's own figure and the peak), and the keys to change."""
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else "out of memory"
    peak = ""
    if device.type == "cuda":
        peak = f"; peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated of "
        peak += f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.2f} GiB"
    return (
        f"out of memory on {device} (micro-batch {micro_batch}, after one retry at half of it): {first_line}{peak}; "
        f"lower micro-batch-size (now {cfg.micro_batch_size}) or layers-per-block (now {cfg.layers_per_block}), "
        f"or set gradient-checkpointing = true"
    )


def update_metrics(result: TrainResult, server_round: int, block: int, partition_id: int, base_version: int) -> dict:
    """The metrics every reply carries with ``Δ_i^r`` (what ``strategies.reply_checks`` reads)."""
    return {
        "server-round": server_round,
        "block": block,
        "num-examples": result.num_examples,
        "partition-id": partition_id,
        "train-loss": result.mean_loss,
        "compute-s": result.compute_s,
        "base-version": base_version,
        "truncated-examples": result.truncated,
    }
