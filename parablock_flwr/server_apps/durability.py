"""What the run makes durable beside its loop, and what a restarted run reads back: the global model's history
(``StepHistory``: each applied step logged once the next round's messages are out, snapshots, pruning), the clients'
pending updates staged for the round's checkpoint (``PendingStaging``, on a writer thread), and a checkpoint replayed
(``replay_checkpoint``). ``Run.make_durable`` orders them before the round's record and checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from .. import core
from ..checkpoint import Checkpoint, clear_staged_pending, replay_run, stage_pending
from ..metrics import RunRecorder
from ..replica import StepLog

# Clients' updates staged for the checkpoint that may wait for the writer thread in memory: a round of a
# thousand clients would otherwise hold a thousand blocks when the disk is slower than the aggregation.
MAX_STAGING = 2


class StepHistory:
    """``x``'s history in the run folder's step log (``g^1..g^r``: clients catch up from it, resume replays it)."""

    def __init__(self, run_dir: Path, snapshot_every: int) -> None:
        self.step_log = StepLog(run_dir)
        self.snapshot_every = snapshot_every
        self.unlogged: list[tuple[int, int, core.Tensors]] = []  # (round, block, g^r) applied, not yet on disk
        self.prune_due = False  # a snapshot was written: the older steps go before the next messages

    def add(self, server_round: int, block: int, step: core.Tensors) -> None:
        """``g^r``, just applied to ``x``: written once round r+1's messages are out (``write``). Its readers
        need it no sooner: round r+1's message carries ``g^r`` itself, catch-ups and lagging Ray actors read
        only older steps, and round r's checkpoint and evaluation come after the write. Off the critical
        path: a block in fp32, fsynced, and a snapshot the whole trainable model."""
        self.unlogged.append((server_round, block, step))

    def write(self, server_round: int, global_params: core.Tensors) -> float:
        """The steps applied up to round r, into the step log (durably), and a snapshot of ``x^r`` if round r
        is one (``snapshot-every``: bounded disk). Called while ``x`` is ``x^r``: after round r+1's messages
        are out, before its replies change ``x``. Returns the seconds it took.

        What a snapshot lets the log drop is dropped before the next round's messages go out (``prune``),
        not now: round r+1's nodes (a lagging Ray actor) may be reading it."""
        started = time.perf_counter()
        while self.unlogged and self.unlogged[0][0] <= server_round:
            version, block, step = self.unlogged[0]
            self.step_log.write(version, block, step)
            self.unlogged.pop(0)  # only once written: a failed write leaves it, and the run stops
        every = self.snapshot_every
        if every and server_round % every == 0:
            self.step_log.write_snapshot(server_round, global_params)
            self.prune_due = True
        return time.perf_counter() - started

    def prune(self, keep_after: int | None) -> None:
        """Drop what the newest snapshot made redundant (``StepLog.prune``), between rounds, but never a step
        after ``keep_after`` (the round the server's evaluator last reported): until it has read them, the
        next prune tries again."""
        if self.prune_due:
            self.prune_due = not self.step_log.prune(keep_after)


class PendingStaging:
    """The clients' pending updates of a round, for its checkpoint (what a restarted server hands back to a
    client: ParaBlock's ``Δ_i^r``), written in order on a thread of their own (a block in fp32 per client)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.writer: ThreadPoolExecutor | None = None  # one writer thread while writes are outstanding
        self.writes: list[Future] = []

    def stage(self, partition_id: int, pending: core.PendingUpdate, held: bool = False) -> None:
        """One client's update; ``wait`` waits for it before the checkpoint. ``held``: its memory is held anyway
        until the round is aggregated (a round's updates in memory, ``FedBCD.step_in_one_pass``), so it waits
        for no earlier write: the writes run beside the aggregation, not before it."""
        if self.writer is None:
            self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-pending")
        if not held and len(self.writes) >= MAX_STAGING:  # written in order: at most MAX_STAGING wait in memory
            wait([self.writes[-MAX_STAGING]])
        self.writes.append(self.writer.submit(stage_pending, self.run_dir, partition_id, pending))

    def wait(self) -> None:
        """Every update staged so far is on disk (a failed write raises here)."""
        if self.writer is not None:
            self.writer.shutdown(wait=True)  # the writes queued so far, in order; its thread ends
        self.writer, writes, self.writes = None, self.writes, []
        for future in writes:
            future.result()

    def discard(self) -> None:
        """The round's aggregate was rejected (or a new attempt starts): what it staged is dropped."""
        self.wait()
        clear_staged_pending(self.run_dir)

    def cancel(self) -> None:
        """The run failed: the writes still queued are of a round that will not be checkpointed."""
        if self.writer is not None:
            self.writer.shutdown(wait=False, cancel_futures=True)


@dataclass
class Replayed:
    """What a checkpoint of round R gives a restarted run besides ``x^R`` (rebuilt in place): ``step``, ``g^R``
    (round R+1's message carries it); ``unevaluated``, round R and its record when its evaluation was not
    written (killed first); ``lost_evaluations``, earlier rounds the server's evaluator had still to evaluate."""

    step: core.Tensors
    unevaluated: tuple[int, dict] | None
    lost_evaluations: list[int]


def replay_checkpoint(
    from_run_dir: Path,
    ckpt: Checkpoint,
    global_params: core.Tensors,
    names: list[str],
    history: StepHistory,
    recorder: RunRecorder,
    step_applied: Callable[[core.Tensors], None],
    eval_every: int | None,
) -> Replayed:
    """``x^R`` rebuilt in ``global_params`` as ``x^0`` plus the logged steps of ``from_run_dir`` (checked against
    the stored digest; ``step_applied`` sees each step's old values), its steps and records copied into this
    run's folder (``replay_run``). ``eval_every``: the server evaluates every that many rounds (None: it does not).

    A lost evaluation is one of a round before R that the evaluator lagged behind when the run stopped: its
    ``x^r`` may be pruned from the step log, so it is recorded as skipped, and counted, rather than lost."""
    step = replay_run(from_run_dir, ckpt, global_params, names, history.step_log, recorder,
                      after_each_step=step_applied)  # fmt: skip
    records = {r["round"]: r for r in recorder.read()}
    last = records.get(ckpt.round, {})
    unevaluated = None if "evaluate_s" in last or "heldout_loss" in last else (ckpt.round, last)
    done = {"heldout_loss", "evaluate_s", "evaluation_skipped"}
    lost = [r for r in range(ckpt.round) if eval_every and r % eval_every == 0 and not done & records.get(r, {}).keys()]
    return Replayed(step, unevaluated, lost)
