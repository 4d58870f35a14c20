"""The run around an algorithm's rounds: Flower's round loop, each round's record and checkpoint, resume.

The algorithm decides, the run acts; neither calls the other back. The run asks the algorithm for a round's
messages (``configure_train``; ``train_messages`` for a retry; ``configure_evaluate`` for the nodes' final
evaluation) and for what the replies come to (``aggregate_train``: a ``RoundOutcome``, given where pending updates
are staged). Everything with a side effect is the run's, in parts that do not call each other: pushing and pulling
through the run's ``Channel`` (``RoundDriver``), records, clocks and exclusions (``RoundLedger``,
``Participation``), the step log, staging and resume (``durability``), the nodes' evaluations
(``ClientEvaluations``) and the server's (``ServerEvaluator``, in a process of its own).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from .. import core, kept_blocks
from ..checkpoint import Checkpoint, save_checkpoint
from ..messages import RoundConfig
from ..records import to_record
from ..transport.channel import Channel
from ..transport.server_side import update_bound
from .client_evaluation import ClientEvaluations
from .durability import PendingStaging, StepHistory, replay_checkpoint
from .ledger import Participation, RoundLedger
from .round_driver import RoundDriver
from .step_ahead import StepAhead

if TYPE_CHECKING:
    from ..strategies.fedbcd.server import FedBCD, RoundOutcome
    from ..strategies.reply_checks import Reply

log = logging.getLogger(__name__)
RoundMessage = tuple[ArrayRecord, ConfigRecord]  # a round's step and the run's part of its config


class TooFewReplies(RuntimeError):
    """A round kept fewer valid replies than ``min-accepted-replies``: the run stops (``kind``: ``timeout``
    when no node answered at all, else ``too-few-replies``)."""

    def __init__(self, message: str, kind: str = "too-few-replies"):
        super().__init__(message)
        self.kind = kind


class Run:
    """One run of ``algorithm`` through ``channel``. ``evaluator`` (a ``ServerEvaluator``, or None) evaluates
    each durable round's ``x^r`` on a replica of its own, beside the loop, which never waits for it."""

    def __init__(self, algorithm: FedBCD, evaluator=None, channel: Channel | None = None):
        self.algorithm = algorithm
        self.config = algorithm.config
        self.run_dir = run_dir = algorithm.run_dir
        self.history = StepHistory(run_dir, self.config.snapshot_every)  # x's steps, durably, beside the loop
        self.staging = PendingStaging(run_dir)  # ParaBlock's pending updates, on a writer thread
        self.ledger = RoundLedger(run_dir, self.config.metrics_sink, algorithm.algorithm)  # records and clocks
        self.evaluator = evaluator
        self.num_rounds = self.config.num_server_rounds  # lowered by a documented stop (``stop_early``)
        self.stopped_early = ""  # why the run ended before num-server-rounds
        self.first_round = 1  # R+1 when resumed from round R's checkpoint
        self.resumed_from: Path | None = None  # the resumed run's folder, resolved here once for every node
        self.rounds_completed = 0  # the last round whose checkpoint is on disk
        self.client_evaluations = ClientEvaluations(self.config)  # x^r's, from round r+1's replies
        self.unevaluated_round: int | None = None  # resumed after a round whose evaluation was lost
        self.participation = Participation(algorithm.partition_of, self.config.round_timeout_s,
                                           self.config.max_consecutive_rejections)  # fmt: skip
        # Pushes in batches of at most one model's worth of arrays; Flower's path unless a channel is given.
        model_bytes = sum(t.numel() * t.element_size() for t in algorithm.global_params.values())
        self.driver = RoundDriver(channel if channel is not None else Channel(), self.config.round_timeout_s,
                                  self.config.pull_interval_s, model_bytes)  # fmt: skip
        self.step_ahead = StepAhead()  # a round's pass on updates that landed before their replies

    # ------------------------------------------------------------ the loop
    def start(self, grid: Grid, first_step: ArrayRecord) -> Result:
        """Flower's round loop, from ``first_round`` (``first_step``: the step it sends, empty in round 1), with
        nothing but aggregation between a round's last reply and the next round's messages. Round r-1's step,
        pending updates, record and checkpoint are made durable, and its evaluation handed on, once round r's
        messages are out: no reply waits for a disk, and a stopped run loses at most the round in flight."""
        self.algorithm.summary()
        if self.evaluator is not None:
            self.evaluator.begin(self)
        result, arrays = Result(), first_step
        due = 0 if self.first_round == 1 else self.unevaluated_round  # a round whose finish is due
        self.ledger.times = {"aggregated": time.time()}
        try:
            for server_round in range(self.first_round, self.num_rounds + 1):
                if why := self.algorithm.stop_reason(server_round):  # a documented stop (dp-target-epsilon)
                    self.stop_early(server_round, why)
                    break
                self.driver.new_round()
                self.prune_step_log()  # before the messages: no node of this round reads what it drops
                config = self.round_part(server_round)
                messages = self.algorithm.configure_train(server_round, arrays, config, grid)
                sent = self.driver.push(grid, self.outgoing(server_round, messages), ahead_round=server_round)
                if self.config.transport_messages_ahead and server_round < self.num_rounds:
                    self.driver.push_ahead(grid, server_round + 1, set(sent.values()))
                ahead = self.start_pass_ahead(server_round, sent)  # beside round r-1's disk, round r's updates first
                if due is not None:
                    self.driver.pull_audits(grid)  # before the disk: Flower hands a reply over only while it lives
                    self.conclude_round(due)
                    self.ledger.times["previous_finished"] = time.time()  # beside the message's way to the nodes
                    kept_blocks.KEPT.trim()  # once a round: what the last round freed and this one did not take again
                self.staging.discard()  # what an earlier, failed attempt staged
                replies = self.step_ahead.replies(self.driver.replies(grid, sent, server_round))
                outcome = self.aggregate(server_round, replies, sent, grid, (arrays, config), ahead)
                numbers = {k: v for k, v in outcome.record.items() if type(v) in (int, float)}
                arrays = result.arrays = outcome.arrays
                result.train_metrics_clientapp[server_round] = MetricRecord(numbers)
                due = server_round
            if due is not None:
                self.make_durable(due)  # before the nodes' final evaluation, which may take round-timeout-s
            self.final_client_evaluation(grid, result.arrays)
            # The channel closes once the last reply is in; what it counted after the last record completes it.
            self.ledger.final_counts(
                due if due is not None else self.num_rounds, self.driver.close(grid, self.num_rounds + 1)
            )
            if due is not None:
                self.conclude_round(due)
            self.prune_step_log()
        except BaseException:
            self.staging.cancel()
            self.step_ahead.close()
            if self.evaluator is not None:
                self.evaluator.close(raise_error=False)  # the run's own error is the one to report
            raise
        self.step_ahead.close()
        if self.evaluator is not None:
            self.evaluator.close()  # the queue drains: every round handed over is evaluated first
            self.prune_step_log()  # what the evaluator held back
        return result

    def start_pass_ahead(self, server_round: int, sent: dict[str, int]) -> Future | None:
        """Round r's one pass, started beside the loop once the updates of every node it went to are held
        (``StepAhead``), where the channel holds updates before their replies; None where it cannot."""
        if not self.driver.channel.updates_land_ahead or not sent:
            return None
        return self.step_ahead.start(self.algorithm, self.driver.channel, server_round, set(sent.values()),
                                     self.config.round_timeout_s)  # fmt: skip

    def stop_early(self, server_round: int, why: str) -> None:
        """The run ends after round r-1 instead of ``num-server-rounds`` (``stopped_early`` says why): what
        follows the loop (the last round made durable, the nodes' final evaluation) counts from there."""
        log.warning("stopping before round %d: %s", server_round, why)
        self.stopped_early, self.num_rounds = why, server_round - 1
        self.driver.withdraw(server_round)  # round r's messages pushed ahead (their replies dropped)

    def round_part(self, server_round: int, resumed: bool = True) -> ConfigRecord:
        """The run's part of round r's config (``RoundConfig``): its folder, what the nodes evaluate
        (``evaluation = "clients"``: ``x^{r-1}``), and for a resumed run the round its checkpoint holds (whose
        residuals a node goes on from: it may have answered later rounds before the server stopped) and its
        folder as the server resolved it (a relative resume-from means nothing in a Ray actor's directory)."""
        evaluation = self.client_evaluations.request(server_round - 1, self.num_rounds)
        part = RoundConfig(server_round=server_round, run_dir=str(self.run_dir), **evaluation)
        if resumed and self.first_round > 1:
            part = replace(part, resumed_after=self.first_round - 1, resume_dir=str(self.resumed_from))
        return ConfigRecord(part.to_config())

    # ------------------------------------------------------------ a round's replies
    def aggregate(self, server_round: int, replies: Iterable[Message], sent: dict[str, int], grid: Grid | None,
                  message: RoundMessage | None = None, ahead: Future | None = None) -> RoundOutcome:  # fmt: skip
        """Round r's replies (answering ``sent``) checked as they arrive and aggregated by the algorithm;
        then ``g^r`` logged, the round's participation, clocks and the nodes' evaluations noted. Too few
        valid replies: the round is re-sent to the nodes without one (``on-too-few-replies = "retry"``, at
        most ``max-round-retries`` times), or the run stops (``TooFewReplies``); an aggregate the
        algorithm rejected voids what its replies staged for the checkpoint. Returns the outcome, its
        record completed with the run's figures. ``message``: the round's step and the run's part of its
        config, which a retry sends again. ``ahead``: the round's pass run beside it (``start_pass_ahead``), for its
        first aggregation."""
        accepted: list[Reply] = []
        while True:
            outcome = self.algorithm.aggregate_train(server_round, replies, sent, accepted, self.staging.stage, ahead)
            if ahead is not None:  # kept or not, the pass ahead is done with: a retry's replies are others
                self.step_ahead.finish()
                ahead = None
            self.participation.note_claimed(outcome.claimed_partitions)
            if outcome.step is not None:
                break
            if outcome.aggregate_rejected:
                self.staging.discard()
            accepted, replies, sent = outcome.accepted, [], {}
            if len(accepted) < self.config.min_accepted_replies:  # (else: aggregate again, with none)
                sent = self.retry(grid, outcome, message)
                replies = self.driver.replies(grid, sent, server_round)
        self.history.add(server_round, outcome.block, outcome.step)
        outcome.record.update(self.driver.channel.end_round(server_round))  # e.g. the stream's fallbacks and refusals
        reasons = {r.node: r.reason for r in outcome.rejected}
        self.participation.note_round(self.algorithm.round_nodes, {r.node for r in outcome.accepted}, reasons)
        self.client_evaluations.collect(server_round - 1, outcome.accepted)
        outcome.record.update(self.ledger.clock({r.node: r.metrics for r in outcome.accepted}, self.driver))
        self.ledger.last = outcome.record
        return outcome

    def retry(
        self, grid: Grid | None, outcome: RoundOutcome, message: tuple[ArrayRecord, ConfigRecord]
    ) -> dict[str, int]:
        """Too few valid replies: re-send the round to the nodes without one (returns what was pushed),
        or stop the run (``on-too-few-replies = "stop"``, the retries spent, or no grid to re-send on)."""
        cfg, retries = self.config, self.driver.counts["round_retries"]
        if cfg.on_too_few_replies == "stop" or retries >= cfg.max_round_retries or grid is None or message is None:
            reasons = "; ".join(f"node {r.node}: {r.reason}" for r in outcome.rejected[-3:]) or "no replies"
            raise TooFewReplies(f"round {outcome.server_round}: {outcome.reason} ({reasons})",
                                kind="timeout" if outcome.num_replies == 0 else "too-few-replies")  # fmt: skip
        done = {r.node for r in outcome.accepted}
        nodes = [n for n in self.algorithm.round_nodes if n not in done]
        log.warning("round %d: %d valid replies, fewer than min-accepted-replies=%d: re-sending to %d nodes "
                    "(retry %d of %d)", outcome.server_round, len(outcome.accepted), cfg.min_accepted_replies,
                    len(nodes), retries + 1, cfg.max_round_retries)  # fmt: skip
        self.driver.withdraw(outcome.server_round + 1, set(nodes))  # their next messages, pushed ahead, came first
        messages = self.algorithm.train_messages(outcome.server_round, nodes, *message)
        return self.driver.resend(grid, self.outgoing(outcome.server_round, messages, first=False))

    def outgoing(self, server_round: int, messages: Iterable[Message], update: bool = True,
                 first: bool = True) -> Iterator[Message]:  # fmt: skip
        """``messages`` as the channel sends them (``Channel.outgoing``; with the direct transport their block
        records on the run's stream, with a capability to upload the round's update if ``update``, bounded by
        its block's size, and round r+1's capabilities). ``first``: the round's first push, not a retry's."""

        def bound(r: int) -> int:  # the most bytes a node's update of round r's block may take on the stream
            names = self.algorithm.partition.names(self.algorithm.block_for_round(r))
            return update_bound(sum(self.algorithm.global_params[n].numel() for n in names), len(names))

        return self.driver.channel.outgoing(messages, server_round, bound if update else None,
                                            server_round >= self.num_rounds, first,
                                            self.config.transport_messages_ahead)  # fmt: skip

    def prune_step_log(self) -> None:
        """What the newest snapshot made redundant, between rounds, but no step the server's evaluator has
        still to read (after the round it last reported)."""
        self.history.prune(self.evaluator.version if self.evaluator is not None else None)

    # ------------------------------------------------------------ evaluation
    def final_client_evaluation(self, grid: Grid, arrays: ArrayRecord) -> None:
        """``evaluation = "clients"``: the nodes of the last round evaluate ``x^R`` (an EVALUATE message
        carrying ``g^R`` and any catch-up) after the last round."""
        num_rounds = self.num_rounds
        if self.config.evaluation != "clients" or not self.algorithm.round_nodes:
            return
        config = self.round_part(num_rounds + 1, resumed=False)
        messages = self.algorithm.configure_evaluate(num_rounds + 1, arrays, config, grid)
        sent = self.driver.push(grid, self.outgoing(num_rounds + 1, messages, update=False))
        self.client_evaluations.collect_final(num_rounds, self.driver.replies(grid, sent, num_rounds + 1))

    def conclude_round(self, server_round: int) -> None:
        """Round r's record and checkpoint made durable, then its evaluation handed on (r = 0: the
        evaluation before training): to the evaluator, which completes the record when it is done,
        and the nodes' evaluations (``evaluation = "clients"``) that came with this round's replies."""
        self.make_durable(server_round)
        if self.evaluator is not None:
            self.evaluator.submit(server_round)
        else:
            self.write_evaluation(*self.client_evaluations.take(server_round)[0])
        for version, done in self.client_evaluations.take():  # earlier rounds' records, completed by appending
            self.ledger.recorder.write({"round": version, **done})
            log.info("round %d: heldout_loss %.4f (clients' own held-out rows)", version, done["heldout_loss"])

    def write_evaluation(self, server_round: int, evaluation: dict) -> None:
        """Complete round r's record with its evaluation (``RoundLedger.write_evaluation``); the evaluator's
        receiving thread calls this too."""
        self.ledger.write_evaluation(server_round, evaluation, self.num_rounds)

    def make_durable(self, server_round: int) -> None:
        """Round r's step and its clients' pending updates on disk, its training record, then its
        checkpoint, once: from here on a crash loses nothing of it."""
        if server_round > self.rounds_completed:
            step_log_s = self.history.write(server_round, self.algorithm.global_params)  # what the checkpoint counts on
            self.staging.wait()
            self.ledger.record(server_round, {"step_log_write_s": step_log_s}, self.num_rounds, self.driver)
            self.save_checkpoint(server_round)
            self.rounds_completed = server_round

    # ------------------------------------------------------------ checkpoint and resume
    def save_checkpoint(self, server_round: int) -> None:
        """After round r is recorded: what a restarted server needs (``checkpoint.py``). ``x``'s digest comes from
        the algorithm's cache of its tensors' hashes (``x_hashes``): the block round r moved is hashed here, while
        round r+1 is out, and round r+1's invariant checks find it hashed."""
        ledger, algorithm = self.ledger, self.algorithm
        digest = core.model_digest(algorithm.global_params, algorithm.partition.all_names(), hashes=algorithm.x_hashes)
        save_checkpoint(self.run_dir, Checkpoint(
            round=server_round, global_sha256=digest, elapsed_s=ledger.elapsed_s(),
            modeled_wall_s=ledger.modeled_wall_s, participation=self.participation.state(),
            **self.algorithm.checkpoint_state()))  # fmt: skip

    def resume(self, from_run_dir: Path, ckpt: Checkpoint) -> ArrayRecord:
        """Continue the run in ``from_run_dir`` after its last complete round R (``ckpt``): ``x^R`` rebuilt
        and its history copied here (``replay_checkpoint``), the clocks, participation, the algorithm's state
        and the clients' pending updates carried, and this folder's own checkpoint written (resumable from its
        first moment). Returns ``g^R``, the step that round R+1's message carries."""
        algorithm, names = self.algorithm, self.algorithm.partition.all_names()
        server_eval = self.evaluator is not None and self.config.evaluation == "server"
        replayed = replay_checkpoint(from_run_dir, ckpt, algorithm.global_params, names, self.history,
                                     self.ledger.recorder, algorithm.step_applied,
                                     self.config.eval_every if server_eval else None)  # fmt: skip
        self.first_round, self.rounds_completed = ckpt.round + 1, ckpt.round
        self.resumed_from = Path(from_run_dir).expanduser().resolve()
        if replayed.unevaluated is not None:
            self.unevaluated_round = ckpt.round
        self.ledger.resumed(ckpt.elapsed_s, ckpt.modeled_wall_s, replayed.unevaluated, replayed.lost_evaluations)
        self.participation.carry(ckpt.participation)
        algorithm.resumed(ckpt)
        for partition_id, pending in ckpt.pending.items():
            self.staging.stage(partition_id, pending)
        self.staging.wait()
        self.save_checkpoint(ckpt.round)
        log.info("Resumed from %s after round %d (%d pending client updates to hand back)", from_run_dir,
                 ckpt.round, len(ckpt.pending))  # fmt: skip
        return to_record(replayed.step, self.config.transfer_dtype)  # a checkpoint comes after round 1 at the earliest
