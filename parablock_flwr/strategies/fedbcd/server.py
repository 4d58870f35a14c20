"""Sequential federated block coordinate descent, the server half: ``FedBCD`` (client half: ``client.py``).

Round r: send each client ``g^{r-1} = η_s Δ̄^{r-1}`` and the block ``b_r``; clients reply
``Δ_i^r``; the server checks each reply, aggregates the valid ones and applies
``x^r[b_r] = x^{r-1}[b_r] + g^r``. ParaBlock differs on the client (``ParaBlockClient``).

The algorithm decides; the run acts. ``FedBCD`` builds a round's messages (``configure_train``) and
says what its replies come to (``aggregate_train`` returns a ``RoundOutcome``: the step it applied to
``x``, or why there is none, each reply accepted or rejected with its reason, the round's record).
The run around the rounds (``run.Run``) pushes the messages, pulls the replies, retries, logs the
step, stages pending updates, and writes records and checkpoints; this module never imports it.
The parts live beside the class, as Flower keeps ``strategy_utils`` beside ``FedAvg``:
``reply_checks`` (is a reply valid), ``node_sync`` (what a node needs to hold ``x`` exactly),
``round_stats`` (the round's numbers), ``update_spill`` (the round's updates until combined).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from ... import core
from ...config import RunConfig
from ...messages import GLOBAL_STEP, METRICS, ROUND, UPDATE, PartitionAnswer, RoundConfig, TrainMetrics
from ...metrics import timed
from ...privacy import ServerPrivacy
from ...records import payloads_record, pieces_record, record_arrays
from ...replica import StepLog
from ...wire import WireError, encoding_payloads, pack_encoded, round_and_pack, unpack
from ..node_sync import NodeSync, ask_partitions, seeded_sample
from ..reply_checks import (
    Expected,
    Reply,
    check_own_count,
    check_partition,
    checked_norm,
    honest_update_bound,
    parse_reply,
    state_intact,
)
from ..round_buffers import RoundBuffers
from ..round_stats import Rejection, RoundStats, array_bytes, round_record
from ..update_spill import UpdateSpill, fingerprint

if TYPE_CHECKING:
    from ...checkpoint import Checkpoint

log = logging.getLogger(__name__)
PARTITION_QUERY_TIMEOUT_S = 60.0  # asking a node its partition id: a thin message, no training
# (partition id, a client's pending update, held=...) -> kept; ``held``: its memory is held until the round's
# aggregate anyway (``PendingStaging.stage``).
Stage = Callable[..., None]


@dataclass
class Checked:
    """Replies checked: the valid ones, the others with their reasons, and the nodes whose own state the
    server no longer trusts (a rejected reply, an error, no reply): their next message is a full sync."""

    accepted: list[Reply]
    rejected: list[Rejection] = field(default_factory=list)
    resync: set[int] = field(default_factory=set)
    claimed_partitions: dict[int, int] = field(default_factory=dict)  # node -> the partition a rejected reply names


@dataclass
class RoundOutcome:
    """What round r's replies came to, as far as they have come: the run acts on it.

    With a ``step``, ``x`` holds ``x^r`` and ``arrays`` is ``g^r`` as round r+1's messages carry it.
    Without one, ``reason`` says why: too few valid replies (the run retries or stops); after a rejected
    aggregate (``aggregate_rejected``: its replies are rejected, with the reason, and what they staged is
    void) there are none."""

    server_round: int
    block: int
    accepted: list[Reply]  # in the step, in partition order (so far, without a step)
    rejected: list[Rejection]  # every rejection of the round so far, with its reason
    num_replies: int = 0  # replies received this round, valid or not
    claimed_partitions: dict[int, int] = field(default_factory=dict)  # node -> the partition a rejected reply names
    step: core.Tensors | None = None  # g^r, applied to x, rounded as it travels; read only (it views ``arrays``)
    arrays: ArrayRecord | None = None
    reason: str = ""
    aggregate_rejected: bool = False
    record: dict = field(default_factory=dict)  # the round's record: the algorithm's fields
    pending: list[tuple[int, core.PendingUpdate]] = field(default_factory=list)  # kept here when no ``stage``


@dataclass
class PassAhead:
    """Round r's one pass (``core.applied_mean_step``) on the updates that landed, or are landing (read as they
    land: ``wire.LandingArrays``), ahead of their replies, prepared by ``FedBCD.prepare_pass_ahead`` and run beside
    the loop (``run``). Its inputs are known before it runs: the aggregation compares them first (``take``) and waits
    for the pass only where they are the accepted replies' (the same nodes, partitions and weights, each update in
    the very memory it read: ``update_spill.fingerprint``), so that the same inputs in the same order give the same
    bits; else it drops it at once and runs its own. The pass reads ``x[b]`` as it was prepared (a step taken
    meanwhile gives ``x`` new storage, not new values here), so a dropped pass may end on its own thread, changing
    nothing (one waiting for an upload's bytes ends when they land or the upload ends: refused, broken off, or its
    round's end)."""

    inputs: list[tuple]  # (node, partition id, weight, the update's fingerprint), in partition order
    args: tuple  # applied_mean_step's arguments
    encoded_into: dict  # where the pass writes the step's encoding: views of ``payloads``
    payloads: dict  # the step's record as it travels (``wire.encoding_payloads``)
    held: list  # the packed updates read: alive until taken or dropped, so that no other buffer takes their memory
    # Each update's checked norm (``reply_checks.checked_norm``) read as it lands, on a thread of its own
    # (``run_norms``), for its reply's check (``norm_found_ahead``): update fingerprint -> (the update, its future).
    norms: dict = field(default_factory=dict)
    result: tuple | None = None  # applied_mean_step's (encoding, new x[b], first tensor not finite)
    seconds: float = 0.0  # the pass's own time, off the critical path
    dropped: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        """The pass, unless dropped already; its result is kept only until taken or dropped."""
        start = time.perf_counter()
        try:
            result = core.applied_mean_step(*self.args, encoded_into=self.encoded_into) if not self.dropped else None
            with self.lock:
                self.result = None if self.dropped else result
        finally:
            self.seconds, self.args, self.encoded_into = time.perf_counter() - start, (), {}
            self.done.set()

    def run_norms(self) -> None:
        """Each update's norm, in turn, as its bytes land (waiting for them): set in its future, or the error (an
        upload broken off); one whose future a reply's check found unstarted is left to that check."""
        for update, norm in list(self.norms.values()):
            if not norm.set_running_or_notify_cancel():
                continue
            try:
                norm.set_result(checked_norm(update))
            except BaseException as err:  # its reply's check computes the norm itself; never a future left running
                norm.set_exception(err)
                if not isinstance(err, Exception):
                    raise

    def norm_found_ahead(self, key: tuple) -> float | str | None:
        """The norm ``run_norms`` found of the update with fingerprint ``key`` (waited for, if it is being found:
        the reply's bytes have all landed), or None: not found ahead (not among these updates, not started yet,
        failed)."""
        entry = self.norms.get(key)
        if entry is None or entry[1].cancel():  # not started: the check finds it sooner than the thread would
            return None
        try:
            return entry[1].result()
        except Exception:  # noqa: BLE001 - found again by the check
            return None

    def take(self, inputs: list[tuple]) -> tuple | None:
        """The pass's result and the payloads it wrote where ``inputs`` are the ones it read (waited for), else None
        at once (dropped)."""
        if inputs != self.inputs:
            self.drop()
            return None
        self.done.wait()
        with self.lock:
            result, self.result, self.held, payloads = self.result, None, [], self.payloads
        self.let_go_of_norms()
        return (result, payloads) if result is not None else None

    def drop(self) -> None:
        """Its result and the updates it holds go (a pass still running ends on its own, its result unkept)."""
        with self.lock:
            self.dropped, self.result, self.held, self.payloads = True, None, [], {}
        self.let_go_of_norms()

    def let_go_of_norms(self) -> None:
        """The replies are checked: the norms not started are not found, and the updates they read go (each a
        block's memory, which the next round's uploads may take)."""
        norms, self.norms = self.norms, {}  # a new dict: ``run_norms`` may be going through the old one
        for _, norm in norms.values():
            norm.cancel()


class FedBCD:
    """Federated BCD: one block per round, every sampled client, no overlap.

    Shaped like Flower's Message-API strategies (``configure_train``, ``aggregate_train``,
    ``configure_evaluate``), but not a ``flwr`` ``Strategy``: ``aggregate_train`` returns a
    ``RoundOutcome`` rather than Flower's (arrays, metrics), and the loop is ``run.Run.start``, which
    owns what Flower's ``Strategy.start`` would not do (a deadline per message, retries, the step log,
    records, checkpoints, resume) and reads its rounds, timeout and evaluation from the run config.

    Override points (stable signatures, see docs/extending.md):
    ``choose_block``, ``select_nodes``, ``check_reply``, ``client_weight``,
    ``combine``, ``observe_update``, ``server_update``, ``extra_round_metrics``,
    ``state_dict``/``load_state_dict``. ``run_dir`` is the run's folder: catch-ups read its step log,
    the round's accepted updates wait there until combined (``update_spill``).
    """

    algorithm = "fedbcd"
    overlapped = False  # does a round cost max(compute, comm) instead of their sum?

    def __init__(
        self,
        *,
        global_params: dict[str, torch.Tensor],
        partition: core.BlockPartition,
        schedule: list[int],
        run_dir: Path | str,
        config: RunConfig | None = None,
    ):
        self.config = config or RunConfig()  # the one source of settings and their defaults
        self.global_params = global_params
        self.partition = partition
        self.schedule = schedule
        self.link = core.LinkModel.from_config(self.config)
        self.run_dir = Path(run_dir)
        self.sync = NodeSync(global_params, partition.num_blocks, StepLog(run_dir), self.config.transfer_dtype)
        self.x_hashes = core.TensorHashes()  # each tensor of x's SHA-256 until a step moves it (invariant check)
        self._update_bounds: dict[int, float] = {}  # block -> its honest-update bound while x keeps its values
        self.spill = UpdateSpill(run_dir)
        self.buffers = RoundBuffers()  # the round's sum and new x[b], made while its replies are outstanding
        # The round's prepared sum and new x[b] from its round_step until combine and apply_if_finite take them
        # (each once: a second combine, or a later round's, makes new memory).
        self._sum_into: core.Tensors = {}
        self._new_x_into: core.Tensors = {}
        self.stats = RoundStats(0)
        self._blocks: dict[int, int] = {}  # server round -> block, as decided so far (``block_for_round``)
        self._asked_partition: set[int] = set()  # nodes asked their partition id (select_nodes)
        self.own_counts: dict[int, float] = {}  # partition -> num-examples of a site with its own data
        self._own_counts_before = dict(self.own_counts)  # as the round in flight began: a rejected aggregate
        self.privacy = ServerPrivacy(self.config) if self.config.dp else None  # docs/privacy.md
        self._last_weights: dict[int, float] = {}  # node -> its last accepted reply's weight (``prepare_pass_ahead``)

    def resumed(self, ckpt: Checkpoint) -> None:
        """Called by ``Run.resume`` once ``x^R`` is rebuilt: the blocks decided, the clients' pending
        updates to hand back, the subclass's own state."""
        self.x_hashes, self._update_bounds = core.TensorHashes(), {}  # x is x^R now: hash it anew
        self.sync.first_round = ckpt.round + 1
        self.sync.resume_pending = ckpt.pending
        self.sync.carry(ckpt.node_sync)
        self._blocks = dict(ckpt.blocks)
        if self.privacy is not None:
            self.privacy.load(ckpt.privacy)  # the accountant goes on; the noise's secret seed too
        self.load_state_dict(ckpt.strategy_state)

    def state_dict(self) -> dict:
        """Override point: a subclass's own state (JSON-serialisable) for the checkpoint."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Override point: restore what ``state_dict`` returned."""

    def checkpoint_state(self) -> dict:
        """What round r's checkpoint keeps of the algorithm (``Checkpoint``'s fields): the blocks decided,
        what the server knows of each node's copy, the subclass's own state. ``resumed`` reads it back."""
        return {"blocks": self.decided_blocks(), "node_sync": self.sync.by_partition(),
                "strategy_state": self.state_dict(),
                "privacy": self.privacy.state() if self.privacy is not None else {}}  # fmt: skip

    def stop_reason(self, server_round: int) -> str | None:
        """Why the run must end before round r (None: it runs it): ``dp-target-epsilon`` would be passed."""
        return self.privacy.stop_reason(server_round) if self.privacy is not None else None

    def step_applied(self, before: core.Tensors) -> None:
        """A logged step was replayed onto ``x`` (a resume; ``before``: the values it replaced), so that a
        full sync of the first round sends ``x^{R-1}`` exactly."""
        self.x_moved(before)

    def x_moved(self, before: core.Tensors) -> None:
        """A step replaced these tensors of ``x`` (``before``: their old values): what knows ``x`` follows."""
        self.sync.applied(before)
        self.x_hashes.changed(before)
        self._update_bounds.clear()

    def partition_of(self, node: int) -> int | None:
        """The partition a node serves, as its accepted replies or a query said (None: not known)."""
        return self.sync.partitions.get(node)

    def summary(self) -> None:
        log.info("%s: %d blocks, %d rounds", type(self).__name__, self.partition.num_blocks,
                 self.config.num_server_rounds)  # fmt: skip

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterator[Message]:
        """``evaluation = "clients"``, after the last round R (``server_round`` = R+1): the nodes of round
        R evaluate ``x^R``. ``config`` is the run's part of the round config (what to evaluate); the
        message carries ``g^R`` (``arrays``) and any catch-up, and trains nothing (block -1)."""
        base = RoundConfig.from_config(config)
        base = replace(base, step_block=self._blocks.get(server_round - 1, -1), algorithm=self.algorithm)
        for node in self.round_nodes:
            yield self.message(MessageType.EVALUATE, server_round, arrays, base, node)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Nothing here: the run completes the round records with the nodes' evaluations
        (``client_evaluation``), which hold more than a ``MetricRecord`` does (each node's row)."""
        return None

    @property
    def round_nodes(self) -> list[int]:
        """The nodes sent this round's message (the last round's, once it is over)."""
        return self.stats.nodes

    # ------------------------------------------------------------ blocks
    def block_for_round(self, server_round: int) -> int:
        """``b_r``, decided once by ``choose_block`` and remembered (checkpointed).

        ParaBlock tells clients ``b_{r+1}`` in round r (so that a node worker can start it early),
        i.e. before round r is aggregated: the choice must not change afterwards."""
        if server_round not in self._blocks:
            block = self.choose_block(server_round)
            if not 0 <= block < self.partition.num_blocks:
                raise ValueError(f"choose_block({server_round}) = {block}: expected 0..{self.partition.num_blocks - 1}")
            self._blocks[server_round] = block
        return self._blocks[server_round]

    def block_x(self, block: int) -> dict[str, torch.Tensor]:
        """``x[b]``: the block's tensors of the global model, by name."""
        return {n: self.global_params[n] for n in self.partition.names(block)}

    def block_shapes(self, block: int) -> dict[str, tuple[int, ...]]:
        """The shape of each of ``x[b]``'s tensors: what a reply's update of the block must have."""
        return {n: tuple(t.shape) for n, t in self.block_x(block).items()}

    def decided_blocks(self) -> dict[int, int]:
        """Round -> block, for the rounds decided so far (after a resume: from the last checkpointed
        round on; the step log names each earlier step's block)."""
        return dict(self._blocks)

    def choose_block(self, server_round: int) -> int:
        """Override point: the block of round r. Called during round r-1 (before
        its aggregation) for r >= 2. Default: the seeded schedule."""
        return self.schedule[server_round - 1]

    def select_nodes(self, server_round: int, grid: Grid) -> list[int]:
        """A seeded sample of ``fraction-train`` of the connected nodes (at least one),
        once at least ``min-available-nodes`` are connected.

        The sample is drawn over the nodes' partition ids, not their node ids: Flower gives nodes
        new random ids in every run, so only the partitions make a seed pick the same clients in
        every run (and in a resumed one). A node whose partition is not known yet is asked once.
        A ParaBlock client that sat out round r-1 holds a pending update that is
        already aggregated (or was rejected): on its return it is resynchronised.
        """
        _, available = sample_nodes(grid, self.config.min_available_nodes, sample_size=1)  # waits for enough
        if self.config.fraction_train >= 1.0:
            return sorted(available)
        partitions, timeout = self.sync.partitions, min(self.config.round_timeout_s, PARTITION_QUERY_TIMEOUT_S)
        unknown = [n for n in available if n not in partitions and n not in self._asked_partition]
        if unknown:  # once per node, briefly: a node that does not answer is sampled after the others
            self._asked_partition.update(unknown)
            partitions.update(ask_partitions(grid, unknown, timeout))
        by_partition = sorted(available, key=lambda n: (partitions.get(n, math.inf), n))  # unanswered: last
        chosen = seeded_sample(by_partition, self.config.fraction_train, self.config.seed * 1_000_003 + server_round)
        return sorted(chosen)

    def round_config(self, server_round: int, block: int, step_block: int, run_part: RoundConfig) -> RoundConfig:
        """What every client is told this round: ``run_part`` (the run's folder, a resumed run's round,
        what to evaluate) with the round's blocks and the algorithm's name."""
        last = server_round == self.config.num_server_rounds
        return replace(
            run_part,
            server_round=server_round,
            block=block,
            step_block=step_block,
            # Lets a node worker start the next round's computation before the next message.
            next_block=-1 if last else self.block_for_round(server_round + 1),
            algorithm=self.algorithm,
        )

    def check_reply(self, server_round: int, block: int, reply: Reply) -> str | None:
        """Override point: why a well-formed reply must still be rejected (None: keep it).
        The checks of form and content (``reply_checks``) have passed already."""
        return None

    def client_weight(self, metrics: TrainMetrics) -> float:
        """``w_i``: number of local examples (checked finite, > 0 and bounded), or uniform."""
        return float(metrics.num_examples) if self.config.weighting == "examples" else 1.0

    def combine(self, updates: Iterable[core.Tensors], weights: list[float]) -> core.Tensors:
        """``Δ̄``: the weighted mean of the accepted updates.

        ``updates`` come one at a time (a generator, in partition order): a combiner
        that needs them all at once makes a list of them first. Each is read-only and may be
        decoded again at each read (``wire.Decoded``: kept as it came). The first call of a round
        writes the mean into the round's prepared buffers (``RoundBuffers``).
        """
        out, self._sum_into = self._sum_into, {}
        return core.aggregate(updates, weights, out=out)

    def observe_update(self, server_round: int, block: int, reply: Reply) -> core.PendingUpdate | None:
        """Every accepted update once, before it is combined; returns what the checkpoint keeps of it for
        the client (a restarted server hands it back): nothing in sequential BCD."""
        return None

    def server_update(self, server_round: int, block: int, mean_update: core.Tensors) -> core.Tensors:
        """``g^r``, the step applied to ``x[b_r]`` and sent to every client: ``η_s Δ̄``.

        Whatever this returns is applied by the server and by every client with the
        same float operation, so any server optimizer keeps all copies identical.
        """
        return core.global_step(mean_update, self.config.server_lr)

    def extra_round_metrics(self, server_round: int, accepted: list[Reply]) -> dict:
        """Override point: more numbers for the round's record."""
        return {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterator[Message]:
        """Round r's messages: ``g^{r-1}`` (in ``arrays``, empty in round 1), ``b_r`` and any catch-up to
        each node; ``config`` is the run's part of the round config (``RoundConfig``'s entries)."""
        self.stats = RoundStats(server_round)
        self._own_counts_before = dict(self.own_counts)
        self.spill.start()
        nodes = self.select_nodes(server_round, grid)
        self.buffers.prepare(server_round, self.block_x(self.block_for_round(server_round)),
                             sums=not self.in_one_pass(len(nodes)))  # fmt: skip
        if server_round == self.sync.first_round and (self.sync.resume_pending or self.sync.carried):
            self.sync.partitions.update(ask_partitions(grid, nodes, self.config.round_timeout_s))
        return self.train_messages(server_round, nodes, arrays, config)

    def train_messages(
        self, server_round: int, nodes: list[int], arrays: ArrayRecord, config: ConfigRecord
    ) -> Iterator[Message]:
        """Round r's message to each of ``nodes`` (again, for a retry, with the same ``arrays`` and
        ``config`` as ``configure_train``), built one at a time as the run pushes them: ``g^{r-1}``, the
        blocks, the node's catch-up."""
        block = self.block_for_round(server_round)
        step_block = self.block_for_round(server_round - 1) if server_round > 1 else -1
        round_config = self.round_config(server_round, block, step_block, RoundConfig.from_config(config))
        self.stats.nodes = sorted(set(self.stats.nodes) | set(nodes))
        for node in nodes:
            msg = self.message(MessageType.TRAIN, server_round, arrays, round_config, node)
            self.stats.wire_bytes_down += array_bytes(msg.content)
            yield msg
        if self.privacy is not None:  # once the messages are built: the noise is drawn while the nodes train
            self.privacy.draw_noise_ahead(server_round, self.block_x(block))

    def message(self, kind: str, server_round: int, step: ArrayRecord, config: RoundConfig, node: int) -> Message:
        """One node's message: the step, the round config, and what keeps its copy exact (``NodeSync``)."""
        parts = self.sync.parts_for(server_round, node)
        self.stats.catch_up_steps_sent += parts.catch_up_steps
        self.stats.full_syncs_sent += int(parts.full_sync)
        round_config = ConfigRecord(replace(config, **parts.fields).to_config())
        content = RecordDict({GLOBAL_STEP: step, ROUND: round_config, **parts.records})
        return Message(content=content, message_type=kind, dst_node_id=node, ttl=self.config.round_timeout_s)

    def aggregate_train(
        self,
        server_round: int,
        replies: Iterable[Message],
        sent_to: Mapping[str, int] | None = None,
        accepted: Sequence[Reply] = (),
        stage: Stage | None = None,
        ahead: Future | None = None,
    ) -> RoundOutcome:
        """Check each reply and, with at least ``min-accepted-replies`` valid ones (with ``accepted``,
        those of this round's earlier replies), aggregate them and apply ``g^r`` to ``x``.

        ``sent_to``: message id -> node of the messages the replies answer (a node among them that did
        not reply is resynchronised). ``stage``: where each accepted client's pending update for the
        checkpoint goes as it is combined (``observe_update``); without one it is kept in the outcome.
        ``ahead``: the round's ``PassAhead``, prepared while the replies were outstanding (a future, read once every
        reply is checked: None where none was), kept where the replies carry the very updates it read.
        Nothing on the server changes before every reply is checked, and then only if ``g^r`` keeps ``x``
        finite: else the aggregate is rejected, and its replies with it (``apply_if_finite``).
        """
        block = self.block_for_round(server_round)
        checked = self.check_replies(server_round, block, replies, sent_to or {}, list(accepted), ahead)
        self.stats.rejected.extend(checked.rejected)
        for node in checked.resync:
            self.sync.failed(node)  # its own state is not trusted: it gets a full sync next time
        outcome = RoundOutcome(server_round, block, checked.accepted, list(self.stats.rejected),
                               self.stats.num_replies, checked.claimed_partitions)  # fmt: skip
        if len(outcome.accepted) < self.config.min_accepted_replies:
            outcome.reason = self.too_few(outcome.accepted)
            return outcome
        # Float sums depend on order and replies arrive in any order: sort them by the client's stable
        # partition id (node ids change from run to run).
        outcome.accepted.sort(key=lambda r: (r.partition_id, r.node))
        stage = stage or (lambda partition_id, pending, held=False: outcome.pending.append((partition_id, pending)))
        applied = self.step_in_one_pass(server_round, block, outcome.accepted, stage, ahead)
        if applied is None:  # each step apart: a subclass's combine or server_update, many replies
            with timed(self.stats.legs, "combine_s"):
                step = self.round_step(server_round, block, outcome.accepted, stage)
            applied = self.apply_if_finite(step)
        if isinstance(applied, str):
            self.reject_aggregate(server_round, outcome.accepted, applied)
            outcome.accepted, outcome.aggregate_rejected, outcome.pending = [], True, []
            outcome.reason, outcome.rejected = self.too_few([]), list(self.stats.rejected)
            return outcome
        outcome.step, outcome.arrays = applied
        weights = [self.client_weight(r.metrics) for r in outcome.accepted]
        for reply, weight in zip(outcome.accepted, weights):
            self.sync.accepted(reply.node, server_round, reply.partition_id)
            self._last_weights[reply.node] = weight
        outcome.record = round_record(
            self.stats, self.partition.labels[block], block, outcome.step, outcome.accepted, weights, self.link,
            self.overlapped, self.config.transfer_dtype,
        )  # fmt: skip
        if self.privacy is not None:
            outcome.record.update(self.privacy.released(outcome.accepted))
        outcome.record.update(self.extra_round_metrics(server_round, outcome.accepted))
        return outcome

    def max_update_norm(self, block: int) -> float:
        """The bound on a reply's update norm: ``max-update-norm``, or with -1 (the default) the norm no honest
        AdamW update of this block reaches (``honest_update_bound``; docs/configuration.md); 0: none."""
        cfg = self.config
        if cfg.max_update_norm >= 0:
            return cfg.max_update_norm
        if cfg.dp and cfg.dp_mode == "local":  # a noised update: the clip norm plus what its noise reaches
            numel = sum(self.global_params[n].numel() for n in self.partition.names(block))
            return local_dp_bound(numel, cfg.dp_clip_norm, cfg.dp_noise_multiplier)
        if block not in self._update_bounds:  # once per block while x keeps its values (``x_moved``)
            names = self.partition.names(block)
            numel = sum(self.global_params[n].numel() for n in names)
            x_norm = 0.0
            if cfg.weight_decay > 0:  # a pass over the block, only when the decay counts
                x_norm = math.hypot(*(float(torch.linalg.vector_norm(self.global_params[n].detach())) for n in names))
            self._update_bounds[block] = honest_update_bound(
                numel, cfg.local_steps, cfg.learning_rate, cfg.weight_decay, x_norm
            )
        return self._update_bounds[block]

    def too_few(self, accepted: list[Reply]) -> str:
        """Why a round with ``accepted`` has no step yet (the run's retry and stop lines say it too)."""
        return (f"{len(accepted)} valid replies, expected at least "
                f"min-accepted-replies={self.config.min_accepted_replies}")  # fmt: skip

    def round_step(self, server_round: int, block: int, accepted: list[Reply], stage: Stage) -> core.Tensors:
        """``g^r`` from the accepted replies (sorted), before rounding; a zero step when none is valid
        (``x`` does not move, but clients still need a step to re-base on)."""
        self._sum_into, self._new_x_into = self.buffers.take(server_round)  # ({}, {}): new memory is made
        if not accepted:
            return {n: torch.zeros_like(self.global_params[n]) for n in self.partition.names(block)}
        updates = self.accepted_updates(server_round, block, accepted, stage)
        if self.privacy is not None:  # clipped as combined, the mean noised (docs/privacy.md)
            updates = self.privacy.clip_updates(updates)
        mean = self.combine(updates, [self.client_weight(r.metrics) for r in accepted])
        if self.privacy is not None:
            mean = self.privacy.noised(server_round, mean, len(accepted))
        self.spill.start()  # every update is combined: the file is emptied
        return self.server_update(server_round, block, mean)

    def step_in_one_pass(
        self, server_round: int, block: int, accepted: list[Reply], stage: Stage, ahead: Future | None = None
    ) -> tuple[core.Tensors, ArrayRecord] | str | None:
        """``round_step`` and ``apply_if_finite`` in one pass over the block (``core.applied_mean_step``: the same
        bits, the mean and the step never written as fp32 blocks between the last reply and the next message; the
        step's record written where it travels from, ``wire.encoding_payloads``),
        where the round is the default weighted mean of updates the spill holds in memory (differential privacy's
        clipping and noise included). None where it is not (a subclass's ``combine`` or ``server_update``, more
        replies than ``IN_MEMORY``): then each step runs apart. The pass run ahead (``ahead``: ``PassAhead``) stands
        for it where it read the accepted replies' very updates."""
        if not self.in_one_pass(len(accepted)):
            return None
        privacy = self.privacy_terms(server_round, block, accepted)
        if privacy is None:  # a reply whose clip factor was not found as it was checked: each step apart clips it
            return None
        _, new_x_into = self.buffers.take(server_round)  # none left where a pass ahead took them
        cfg, shapes = self.config, self.block_shapes(block)
        weights = [self.client_weight(r.metrics) for r in accepted]
        with timed(self.stats.legs, "one_pass_s"):  # as combine_s, step_rounding_s and x_apply_s count theirs
            taken = self.pass_run_ahead(ahead, accepted, weights)  # waited for where it is kept
            # Every update in memory: each staged for the checkpoint without waiting for the writes before it.
            updates = list(self.accepted_updates(server_round, block, accepted, stage, held=True))
            if taken is None:
                encoded_into, payloads = encoding_payloads(shapes, cfg.transfer_dtype)
                taken = core.applied_mean_step(updates, weights, cfg.server_lr, self.global_params, cfg.transfer_dtype,
                                               new_x_into, *privacy, encoded_into=encoded_into), payloads  # fmt: skip
            (encoded, new, not_finite), payloads = taken
            self.spill.start()  # every update is combined: the file is emptied
            try:
                step, _ = pack_encoded(encoded, shapes, cfg.transfer_dtype)  # its scales checked as a receiver would
            except WireError as err:
                return self.cannot_travel(err)
        if not_finite is not None:
            return self.not_finite(not_finite)
        self.take_new_x(new)
        return step, payloads_record(payloads)

    def prepare_pass_ahead(self, server_round: int, landed: Mapping[int, Mapping[str, np.ndarray]]) -> PassAhead | None:
        """Round r's one pass on updates that came before their replies (``landed``: node -> its packed update, as
        the transport holds it, or as it lands: ``wire.LandingArrays``, each piece of its values read once it has
        landed), each node at the partition and weight of its last accepted reply, ready to run
        (``PassAhead.run``); None where the round would not run in one pass, a node is new, or an update does not
        unpack. It changes nothing of the algorithm's but taking the round's buffer for the new ``x[b]``; the run
        calls it beside its loop while the round's replies are outstanding (``server_apps/step_ahead.py``). No
        differential privacy here: its clip scales are the checked replies', its noise is drawn once."""
        if self.privacy is not None or not self.in_one_pass(len(landed)):
            return None
        if any(a.flags.writeable for arrays in landed.values() for a in arrays.values()):
            return None  # memory that may change: its fingerprint vouches for nothing
        known = [(self.sync.partitions.get(node), node, self._last_weights.get(node)) for node in landed]
        if any(partition is None or weight is None for partition, _, weight in known):
            return None
        known.sort(key=lambda k: (k[0], k[1]))  # the partition order ``aggregate_train`` sums in
        block = self.block_for_round(server_round)
        try:
            updates = [unpack(landed[node], self.block_shapes(block), lazy=True) for _, node, _ in known]
        except WireError:  # its reply is refused for it, as it is checked
            return None
        x = {n: t.detach() for n, t in self.block_x(block).items()}  # x[b] as it is: a step replaces its storage
        _, new_x_into = self.buffers.take(server_round)
        cfg, weights = self.config, [w for *_, w in known]
        inputs = [(node, partition, weight, fingerprint(landed[node])) for partition, node, weight in known]
        encoded_into, payloads = encoding_payloads(self.block_shapes(block), cfg.transfer_dtype)
        args = (updates, weights, cfg.server_lr, x, cfg.transfer_dtype, new_x_into)
        norms = {key: (update, Future()) for (*_, key), update in zip(inputs, updates)}
        return PassAhead(inputs, args, encoded_into, payloads, held=[landed[node] for _, node, _ in known], norms=norms)

    def pass_run_ahead(self, ahead: Future | None, accepted: list[Reply], weights: list[float]) -> tuple | None:
        """The result of the round's ``PassAhead`` (with the payloads it wrote) where it read exactly the accepted
        replies' updates (in their order, with their partitions and weights), waited for; else None, at once.
        Counted in the round's record:
        ``one_pass_ahead`` (kept, with ``server_one_pass_ahead_s``, the pass's own time, off the critical path) or
        ``one_pass_ahead_dropped``."""
        prepared = ahead.result() if ahead is not None else None
        if prepared is None:
            return None
        inputs = [(r.node, r.partition_id, w, self.spill.fingerprint(r.node)) for r, w in zip(accepted, weights)]
        result = prepared.take(inputs)
        if result is None:
            self.stats.one_pass_ahead_dropped = 1
            return None
        self.stats.one_pass_ahead = 1
        self.stats.legs["one_pass_ahead_s"] = prepared.seconds
        return result

    def privacy_terms(self, server_round: int, block: int, accepted: list[Reply]) -> tuple | None:
        """``applied_mean_step``'s differential privacy: each update's clip scale (found as its reply was checked)
        and the mean's noise with its std (none without DP; no noise in local mode); None where a clip scale was
        not found. Timed (``privacy_s``): any wait for the noise drawn ahead."""
        if self.privacy is None:
            return None, None, 0.0
        with timed(self.stats.legs, "privacy_s"):
            scales = self.privacy.clip_scales(accepted)
            if scales is None:
                return None
            if not self.privacy.adds_noise:
                return scales, None, 0.0
            return scales, self.privacy.noise(server_round, self.block_x(block)), self.privacy.noise_std(len(accepted))

    def in_one_pass(self, replies: int) -> bool:
        """Whether a round of ``replies`` accepted replies runs in one pass (``step_in_one_pass``): the default
        ``combine`` and ``server_update``, every update held in memory (with differential privacy or not)."""
        default = type(self).combine is FedBCD.combine and type(self).server_update is FedBCD.server_update
        return default and 0 < replies <= self.spill.in_memory

    def cannot_travel(self, err: WireError) -> str:
        """Why a step is rejected that its receivers would refuse (an int8 scale past the wire's largest)."""
        return f"the round's step cannot travel as {self.config.transfer_dtype} ({err})"

    def not_finite(self, name: str) -> str:
        """Why a step is rejected that would make ``x[name]`` not finite (``x`` is finite, so the step made it)."""
        return (f"the round's step is not finite in {name} as {self.config.transfer_dtype} "
                f"(server-lr={self.config.server_lr:g}): x is left as it was")  # fmt: skip

    def take_new_x(self, new: core.Tensors) -> None:
        """``x[b]`` takes its new values (as ``core.apply_step_keeping``: the same tensors, new storage)."""
        before = {}
        for name, values in new.items():
            before[name] = self.global_params[name].detach()
            self.global_params[name].data = values
        self.x_moved(before)

    def apply_if_finite(self, step: core.Tensors) -> tuple[core.Tensors, ArrayRecord] | str:
        """Round ``g^r`` as it travels (``transfer-dtype``, from the very pieces sent) and apply it to
        ``x``, only if the step and the new ``x`` are finite: returns (the rounded step, its record),
        or why not, with ``x`` unchanged. Finite replies can sum, or scale by ``server-lr``, past fp32's
        range (or fp16's, or int8's largest scale); a non-finite ``x`` would reach every copy."""
        new_x_into, self._new_x_into, self._sum_into = self._new_x_into, {}, {}  # taken once: none outlives the round
        try:  # g^r as it travels, read from its pieces chunk by chunk: no fp32 copy of it here
            with timed(self.stats.legs, "step_rounding_s"):
                step, wire_pieces = round_and_pack(step, self.config.transfer_dtype, lazy=True)
        except WireError as err:
            return self.cannot_travel(err)
        new = {}
        for name in step:
            x, into = self.global_params[name].detach(), new_x_into.get(name)
            with timed(self.stats.legs, "x_apply_s"):  # x is finite: a non-finite step makes the sum non-finite too
                new[name] = core.added(x, core.read_chunks(step, name), into, finite_only=True)
            if new[name] is None:
                return self.not_finite(name)
        self.take_new_x(new)
        return step, pieces_record(wire_pieces)

    def reject_aggregate(self, server_round: int, accepted: list[Reply], reason: str) -> None:
        """The round's aggregate is not applied: every reply in it is rejected with ``reason`` (counted,
        its node resynchronised: it holds an update the server dropped), and the own-data counts go back
        to the round's start. The run then discards what they staged, and retries or stops."""
        log.warning("round %d: rejected the aggregate of %d replies: %s", server_round, len(accepted), reason)
        for reply in accepted:
            self.stats.rejected.append(Rejection(reply.node, reason, reply.partition_id))
            self.sync.failed(reply.node)
        self.own_counts = dict(self._own_counts_before)

    def check_replies(
        self, server_round: int, block: int, replies: Iterable[Message], sent_to: Mapping[str, int],
        accepted: list[Reply], ahead: Future | None = None,
    ) -> Checked:  # fmt: skip
        """``accepted`` plus the valid ones of ``replies``, and the others with their reasons; a rejected
        reply's node is resynchronised unless the reply says that its state is intact
        (``messages.STATE_INTACT``), and so is a node of ``sent_to`` that did not reply. A reply is
        the node's its message went to (a reply Flower makes itself for an unavailable node names the
        SuperLink as its sender). ``ahead``: the round's ``PassAhead``, whose norms of the updates it read, found as
        they landed, stand for those of the replies that carry those very updates (``norm_ahead``)."""
        shapes = self.block_shapes(block)
        cfg = self.config
        bound = self.max_update_norm(block)
        expected = Expected(server_round, block, shapes, cfg.max_examples_per_client, bound, cfg.transfer_dtype,
                            cfg.max_correction_drift)  # fmt: skip
        seen, checked, replied = {r.partition_id for r in accepted}, Checked(accepted), set()
        for msg in replies:
            with timed(self.stats.legs, "check_s"):
                self.check_one(msg, sent_to, expected, seen, checked, replied, self.norm_ahead(ahead, msg))
        # A node that did not answer may still, having taken in an update the server now drops (ParaBlock's
        # pending, a computation started from it): its state is unknown, as after a rejected reply.
        checked.resync |= set(sent_to.values()) - replied
        return checked

    def norm_ahead(self, ahead: Future | None, msg: Message) -> float | str | None:
        """The norm of ``msg``'s update found as it landed, by the round's ``PassAhead`` (``run_norms``), where the
        reply's update is the very memory it read (``update_spill.fingerprint``: read-only, never written once
        landed, held by the pass); else None. Counted in the record (``update_norms_ahead``)."""
        prepared = ahead.result() if ahead is not None and ahead.done() else None
        record = None if prepared is None or msg.has_error() else msg.content.array_records.get(UPDATE)
        if record is None:
            return None
        try:
            norm = prepared.norm_found_ahead(fingerprint(record_arrays(record)))
        except WireError:  # its check says why
            return None
        self.stats.update_norms_ahead += norm is not None
        return norm

    def check_one(
        self, msg: Message, sent_to: Mapping[str, int], expected: Expected, seen: set, checked: Checked, replied: set,
        norm: float | str | None = None,
    ) -> None:  # fmt: skip
        """One reply of ``check_replies``, into ``checked``: accepted (its update kept until it is combined), or
        rejected with its reason; its node noted in ``replied``. ``norm``: its update's, found ahead."""
        node = sent_to.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
        replied.add(node)
        self.stats.num_replies += 1
        self.stats.wire_bytes_up += 0 if msg.has_error() else array_bytes(msg.content)
        reply = parse_reply(msg, expected, node, norm)
        if isinstance(reply, Reply):  # well-formed: the round's rules, then the subclass's
            reply = (
                check_partition(reply, seen, self.sync.partitions)
                or check_own_count(reply, self.own_counts)
                or self.check_reply(expected.server_round, expected.block, reply)
                or reply
            )
        if isinstance(reply, Reply):
            seen.add(reply.partition_id)
            if reply.metrics.own_data == 1:
                self.own_counts.setdefault(reply.partition_id, reply.num_examples)
            if self.privacy is not None:  # its norm as it came: only the last reply's after the last reply
                reply.clip_scale, reply.clip_scale_found = self.privacy.clip_scale(reply.update), True
            self.spill.put(reply.node, record_arrays(msg.content[UPDATE]))  # as it came, until combined
            reply.update = None
            checked.accepted.append(reply)
            return
        log.warning("round %d: rejected the reply of node %d: %s", expected.server_round, node, reply)
        claimed = None if msg.has_error() else PartitionAnswer.from_record(msg.content.metric_records.get(METRICS))
        if claimed is not None:
            checked.claimed_partitions[node] = claimed.partition_id
        known = self.sync.partitions.get(node)  # what the node's accepted replies said, not what this one claims
        site = known if known is not None else claimed.partition_id if claimed is not None else None
        checked.rejected.append(Rejection(node, reply, site))
        if state_intact(msg):
            self.stats.state_intact_errors += 1  # its model is as it was: no full sync
        else:
            checked.resync.add(node)

    def accepted_updates(
        self, server_round: int, block: int, accepted: list[Reply], stage: Stage, held: bool = False
    ) -> Iterator[core.Tensors]:
        """Each accepted ``Δ_i^r`` in turn, read back from the round's spill (``update_spill``) and
        dropped once combined: the default weighted mean holds the running sum and one update, not one
        per client. What ``observe_update`` keeps of it for the checkpoint goes to ``stage`` (the run
        writes it on a thread of its own, holding a bounded number in memory)."""
        shapes = self.block_shapes(block)
        for reply in accepted:
            if reply.update is None:
                reply.update = self.spill.take(reply.node, shapes)
            pending = self.observe_update(server_round, block, reply)
            if pending is not None:
                stage(reply.partition_id, pending, held=held)
            update, reply.update = reply.update, None
            yield update


def local_dp_bound(numel: int, clip_norm: float, noise_multiplier: float) -> float:
    """``dp-mode = "local"``: the norm no honest noised update of ``numel`` values reaches. Its noise's norm is
    about ``σ C √n`` with a spread of ``σ C / √2``; ten spreads more, and 5 % for rounding with error feedback."""
    return 1.05 * clip_norm * (1.0 + noise_multiplier * (math.sqrt(numel) + 10.0))
