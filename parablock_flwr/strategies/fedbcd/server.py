"""Sequential federated block coordinate descent, the server half: ``FedBCD`` (client half: ``client.py``).

Round r: send each client ``g^{r-1} = η_s Δ̄^{r-1}`` and the block ``b_r``; clients reply
``Δ_i^r``; the server checks each reply, aggregates the valid ones and applies
``x^r[b_r] = x^{r-1}[b_r] + g^r``. ParaBlock differs on the client (``ParaBlockClient``).
The parts live beside the class, as Flower keeps ``strategy_utils`` beside ``FedAvg``:
``reply_checks`` (is a reply valid), ``node_sync`` (what a node needs to hold ``x`` exactly),
``round_stats`` (the round's numbers). The run around the rounds (loop, records, checkpoints,
resume, evaluation) is another object, ``run.Run``, reached as ``self.run``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from ... import core
from ...config import RunConfig
from ...records import pieces_record, record_arrays
from ...versions import PROTOCOL_VERSION, ROUND_KEY
from ...wire import WireError, round_and_pack
from ..node_sync import NodeSync, ask_partitions, seeded_sample
from ..reply_checks import (
    Expected,
    Reply,
    all_finite,
    check_own_count,
    check_partition,
    parse_reply,
    state_intact,
)
from ..round_stats import RoundStats, array_bytes, round_record
from ..run import TooFewReplies
from ..update_spill import UpdateSpill

if TYPE_CHECKING:
    from ...checkpoint import Checkpoint
    from ..run import Run

log = logging.getLogger(__name__)
PARTITION_QUERY_TIMEOUT_S = 60.0  # asking a node its partition id: a thin message, no training


class FedBCD(Strategy):
    """Federated BCD: one block per round, every sampled client, no overlap.

    Override points (stable signatures, see docs/extending.md):
    ``choose_block``, ``select_nodes``, ``round_config``, ``check_reply``, ``client_weight``,
    ``combine``, ``observe_update``, ``server_update``, ``extra_round_metrics``,
    ``state_dict``/``load_state_dict``. The run it belongs to (``self.run``, a ``run.Run``)
    attaches itself; ``run.py``'s docstring lists what each gives the other.
    """

    algorithm = "fedbcd"
    overlapped = False  # does a round cost max(compute, comm) instead of their sum?
    run: Run
    sync: NodeSync

    def __init__(
        self,
        *,
        global_params: dict[str, torch.Tensor],
        partition: core.BlockPartition,
        schedule: list[int],
        config: RunConfig | None = None,
    ):
        self.config = config or RunConfig()  # the one source of settings and their defaults
        self.global_params = global_params
        self.partition = partition
        self.schedule = schedule
        cfg = self.config
        self.link = core.LinkModel.from_config(cfg)
        self.stats = RoundStats(0)
        self._blocks: dict[int, int] = {}  # server round -> block, as decided so far (``block_for_round``)
        self._asked_partition: set[int] = set()  # nodes asked their partition id (select_nodes)
        self.own_counts: dict[int, float] = {}  # partition -> num-examples of a site with its own data
        self.last_metrics: dict = {}  # the last round's record

    # ------------------------------------------------------------ with the run
    def attach(self, run: Run) -> None:
        """Called by ``Run``: the run whose messages, step log and records this algorithm uses."""
        self.run = run
        self.spill = UpdateSpill(run.run_dir)
        self.sync = NodeSync(self.global_params, self.partition.num_blocks, run.step_log, self.config.transfer_dtype)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable | None = None) -> Result:  # fmt: skip
        """Flower's entry point: the attached run's loop (``Run.start``); the rounds and the timeout
        come from the run config, the evaluation from the run's evaluator."""
        return self.run.start(grid, initial_arrays)

    def resumed(self, ckpt: Checkpoint) -> None:
        """Called by ``Run.resume`` once ``x^R`` is rebuilt: the blocks decided, the clients' pending
        updates to hand back, the subclass's own state."""
        self.sync.first_round = ckpt.round + 1
        self.sync.resume_pending = ckpt.pending
        self.sync.carry(ckpt.node_sync)
        self._blocks = dict(ckpt.blocks)
        self.load_state_dict(ckpt.strategy_state)

    def state_dict(self) -> dict:
        """Override point: a subclass's own state (JSON-serialisable) for the checkpoint."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Override point: restore what ``state_dict`` returned."""

    def summary(self) -> None:
        log.info("%s: %d blocks, %d rounds", type(self).__name__, self.partition.num_blocks, self.run.num_rounds)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No evaluation messages of Flower's kind: the run evaluates (``ServerEvaluator``, or the nodes'
        own held-out rows asked in the round's config)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
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

    def round_config(self, server_round: int, block: int, step_block: int) -> ConfigRecord:
        """What every client is told this round; subclasses may add keys."""
        last = server_round == self.config.num_server_rounds
        return ConfigRecord(
            {
                **self.run.client_evaluation_keys(server_round - 1),
                ROUND_KEY: PROTOCOL_VERSION,  # a node of another release refuses the round
                "server-round": server_round,
                "block": block,
                "step-block": step_block,
                # Lets a node worker start the next round's computation before the next message.
                "next-block": -1 if last else self.block_for_round(server_round + 1),
                "algorithm": self.algorithm,
                "run-dir": str(self.run.run_dir),
                # A resumed run: the round its checkpoint holds, whose residuals a node goes on from
                # (it may have answered later rounds before the server stopped), and its folder as the
                # server resolved it (a relative resume-from means nothing in a Ray actor's directory).
                **(
                    {"resumed-after": self.run.first_round - 1, "resume-dir": str(self.run.resumed_from)}
                    if self.run.first_round > 1
                    else {}
                ),
            }
        )

    def check_reply(self, server_round: int, block: int, reply: Reply) -> str | None:
        """Override point: why a well-formed reply must still be rejected (None: keep it).
        The checks of form and content (``reply_checks``) have passed already."""
        return None

    def client_weight(self, metrics: dict) -> float:
        """``w_i``: number of local examples (checked finite, > 0 and bounded), or uniform."""
        return float(metrics["num-examples"]) if self.config.weighting == "examples" else 1.0

    def combine(self, updates: Iterable[core.Tensors], weights: list[float]) -> core.Tensors:
        """``Δ̄``: the weighted mean of the accepted updates.

        ``updates`` come one at a time (a generator, in partition order): a combiner
        that needs them all at once makes a list of them first.
        """
        return core.aggregate(updates, weights)

    def observe_update(self, server_round: int, block: int, reply: Reply) -> None:
        """Every accepted update once, before it is combined: nothing to do in sequential BCD."""

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
    ) -> Iterable[Message]:
        """Send ``g^{r-1}`` (in ``arrays``, empty in round 1), ``b_r`` and any catch-up to each node."""
        self.stats = RoundStats(server_round)
        self._retry_grid, self._global_step = grid, arrays  # kept for a retry of this round
        self.spill.start()
        nodes = self.select_nodes(server_round, grid)
        if server_round == self.run.first_round and (self.sync.resume_pending or self.sync.carried):
            self.sync.partitions.update(ask_partitions(grid, nodes, self.config.round_timeout_s))
        return self.train_messages(server_round, nodes)

    def train_messages(self, server_round: int, nodes: list[int]) -> Iterator[Message]:
        """Round r's message to each node: ``g^{r-1}``, the blocks, the node's catch-up; built one
        at a time as the run pushes them (``Run.push``)."""
        block = self.block_for_round(server_round)
        step_block = self.block_for_round(server_round - 1) if server_round > 1 else -1
        self.stats.nodes = sorted(set(self.stats.nodes) | set(nodes))
        for node in nodes:
            content = RecordDict(
                {"global-step": self._global_step, "round": self.round_config(server_round, block, step_block)}
            )
            sent = self.sync.add_to_message(content, server_round, node)
            self.stats.catch_up_steps_sent += sent["catch_up_steps_sent"]
            self.stats.full_syncs_sent += sent["full_syncs_sent"]
            self.stats.wire_bytes_down += array_bytes(content)
            yield Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node,
                          ttl=self.config.round_timeout_s)  # fmt: skip

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check each reply, aggregate the valid ones, apply ``g^r`` to ``x``, log ``g^r``.

        Nothing on the server changes before every reply of the round is checked, and then only if
        ``g^r`` keeps ``x`` finite: else the aggregate is rejected and the round retried or stopped as
        for too few valid replies (``apply_if_finite``, ``reject_aggregate``).
        """
        block = self.block_for_round(server_round)
        own_counts = dict(self.own_counts)  # as before the round: a rejected aggregate accepted nothing
        accepted = self.check_replies(server_round, block, replies, [])
        while True:
            while len(accepted) < self.config.min_accepted_replies:
                accepted = self.check_replies(server_round, block, self.retry_round(server_round, accepted), accepted)
            # Float sums depend on order and replies arrive in any order: sort them by the
            # client's stable partition id (node ids change from run to run).
            accepted.sort(key=lambda r: (r.partition_id, r.node))
            applied = self.apply_if_finite(self.round_step(server_round, block, accepted))
            if not isinstance(applied, str):
                break
            self.reject_aggregate(server_round, accepted, applied)
            self.own_counts, accepted = dict(own_counts), []
        step, wire_pieces = applied
        self.run.log_step(server_round, block, step)
        for reply in accepted:
            self.sync.accepted(reply.node, server_round, reply.partition_id)
        reasons = {r["node"]: r["reason"] for r in self.stats.rejected}
        self.run.note_participation(self.stats.nodes, {r.node for r in accepted}, reasons)

        self.run.collect_client_evaluation(server_round - 1, accepted)
        weights = [self.client_weight(r.metrics) for r in accepted]
        record = round_record(
            self.stats, self.partition.labels[block], block, step, accepted, weights, self.link, self.overlapped,
            self.config.transfer_dtype,
        )  # fmt: skip
        record.update(self.run.round_clock({r.node: r.metrics for r in accepted}))
        record.update(self.extra_round_metrics(server_round, accepted))
        self.last_metrics = record
        numbers = {k: v for k, v in record.items() if type(v) in (int, float)}
        return pieces_record(wire_pieces), MetricRecord(numbers)

    def round_step(self, server_round: int, block: int, accepted: list[Reply]) -> core.Tensors:
        """``g^r`` from the accepted replies (sorted), before rounding; a zero step when none is valid
        (``x`` does not move, but clients still need a step to re-base on)."""
        if not accepted:
            return {n: torch.zeros_like(self.global_params[n]) for n in self.partition.names(block)}
        updates = self.accepted_updates(server_round, block, accepted)
        mean = self.combine(updates, [self.client_weight(r.metrics) for r in accepted])
        self.spill.start()  # every update is combined: the file is emptied
        return self.server_update(server_round, block, mean)

    def apply_if_finite(self, step: core.Tensors) -> tuple[core.Tensors, dict] | str:
        """Round ``g^r`` as it travels (``transfer-dtype``, from the very pieces sent) and apply it to
        ``x``, only if the step and the new ``x`` are finite: returns (the rounded step, its wire pieces),
        or why not, with ``x`` unchanged. Finite replies can sum, or scale by ``server-lr``, past fp32's
        range (or fp16's, or int8's largest scale); a non-finite ``x`` would reach every copy."""
        try:
            step, wire_pieces = round_and_pack(step, self.config.transfer_dtype)
        except WireError as err:
            return f"the round's step cannot travel as {self.config.transfer_dtype} ({err})"
        new = {}
        for name, delta in step.items():
            current = self.global_params[name].detach()
            new[name] = current + delta.to(device=current.device, dtype=current.dtype)  # apply_step's float op
            if not all_finite(new[name]):  # x is finite: a non-finite step makes the sum non-finite too
                return (f"the round's step is not finite in {name} as {self.config.transfer_dtype} "
                        f"(server-lr={self.config.server_lr:g}): x is left as it was")  # fmt: skip
        before = {}
        for name, values in new.items():  # as core.apply_step_keeping: the same tensors take the new values
            before[name] = self.global_params[name].detach()
            self.global_params[name].data = values
        self.sync.applied(before)
        return step, wire_pieces

    def reject_aggregate(self, server_round: int, accepted: list[Reply], reason: str) -> None:
        """The round's aggregate is not applied: every reply in it is rejected with ``reason`` (counted,
        its node resynchronised: it holds an update the server dropped), and the pending updates staged
        for the checkpoint are discarded. The round then retries or stops (``on-too-few-replies``)."""
        log.warning("round %d: rejected the aggregate of %d replies: %s", server_round, len(accepted), reason)
        for reply in accepted:
            self.stats.rejected.append({"node": reply.node, "reason": reason})
            self.sync.failed(reply.node)
        self.run.discard_staged()

    def check_replies(
        self, server_round: int, block: int, replies: Iterable[Message], accepted: list[Reply]
    ) -> list[Reply]:
        """``accepted`` plus the valid ones of ``replies``; each rejection is logged and counted,
        and its node gets a full sync next time unless the reply says that its state is intact
        (``reply_checks.STATE_INTACT``). A reply is the node's its message went to (``Run.sent_to``)."""
        shapes = {n: tuple(self.global_params[n].shape) for n in self.partition.names(block)}
        cfg = self.config
        expected = Expected(server_round, block, shapes, cfg.max_examples_per_client, cfg.max_update_norm,
                            cfg.transfer_dtype, cfg.max_correction_drift)  # fmt: skip
        seen, accepted = {r.partition_id for r in accepted}, list(accepted)
        for msg in replies:
            node = self.run.sent_to(msg)
            self.stats.num_replies += 1
            self.stats.wire_bytes_up += 0 if msg.has_error() else array_bytes(msg.content)
            reply = parse_reply(msg, expected, node)
            if isinstance(reply, Reply):  # well-formed: the round's rules, then the subclass's
                reply = (
                    check_partition(reply, seen, self.sync.partitions)
                    or check_own_count(reply, self.own_counts)
                    or self.check_reply(server_round, block, reply)
                    or reply
                )
            if isinstance(reply, Reply):
                seen.add(reply.partition_id)
                if reply.metrics.get("own-data") == 1:
                    self.own_counts.setdefault(reply.partition_id, reply.num_examples)
                self.spill.put(reply.node, record_arrays(msg.content["update"]))  # as it came, until combined
                reply.update = None
                accepted.append(reply)
                continue
            log.warning("round %d: rejected the reply of node %d: %s", server_round, node, reply)
            self.stats.rejected.append({"node": node, "reason": reply})
            self.run.note_partition(node, msg)
            if state_intact(msg):
                self.stats.state_intact_errors += 1  # its model is as it was: no full sync
            else:
                self.sync.failed(node)  # its own state is not trusted: it gets a full sync next time
        return accepted

    def accepted_updates(self, server_round: int, block: int, accepted: list[Reply]) -> Iterator[core.Tensors]:
        """Each accepted ``Δ_i^r`` in turn, read back from the round's spill (``update_spill``) and
        dropped once combined: the default weighted mean holds the running sum and one update, not one
        per client (ParaBlock's are held until written for the checkpoint, on the run's writer thread)."""
        shapes = {n: tuple(self.global_params[n].shape) for n in self.partition.names(block)}
        for reply in accepted:
            if reply.update is None:
                reply.update = self.spill.take(reply.node, shapes)
            self.observe_update(server_round, block, reply)
            update, reply.update = reply.update, None
            yield update

    def retry_round(self, server_round: int, accepted: list[Reply]) -> list[Message]:
        """Too few valid replies: re-send the round to the nodes without one, or stop the run."""
        stats = self.stats
        if self.config.on_too_few_replies == "stop" or stats.round_retries >= self.config.max_round_retries:
            reasons = "; ".join(f"node {r['node']}: {r['reason']}" for r in stats.rejected[-3:]) or "no replies"
            raise TooFewReplies(
                f"round {server_round}: {len(accepted)} valid replies, expected at least "
                f"min-accepted-replies={self.config.min_accepted_replies} ({reasons})",
                kind="timeout" if stats.num_replies == 0 else "too-few-replies",
            )
        stats.round_retries += 1
        done = {r.node for r in accepted}
        nodes = [n for n in stats.nodes if n not in done]
        log.warning("round %d: %d valid replies, fewer than min-accepted-replies=%d: re-sending to %d nodes "
                    "(retry %d of %d)", server_round, len(accepted), self.config.min_accepted_replies, len(nodes),
                    stats.round_retries, self.config.max_round_retries)  # fmt: skip
        sent = self.run.push(self._retry_grid, self.train_messages(server_round, nodes))
        return list(self.run.replies_as_they_arrive(self._retry_grid, sent))
