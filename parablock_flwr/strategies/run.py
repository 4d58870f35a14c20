"""The run around an algorithm's rounds: Flower's round loop, each round's record and
checkpoint, resume, and the server's evaluation beside the loop (``ServerEvaluator``).

The algorithm decides, the run acts. The run calls the algorithm; the algorithm holds no reference to
the run and never imports this module (the one thing of the run's it is handed is the writer of
pending updates, an argument of ``aggregate_train``). The boundary is small:

- the run asks the algorithm for a round's messages (Flower's ``configure_train``, given the run's
  part of the round config; ``train_messages`` again for a retry; ``configure_evaluate`` for the
  nodes' final evaluation) and for what the replies come to (``aggregate_train``, given the replies,
  the messages they answer and where pending updates go): a ``RoundOutcome``; and for its
  ``summary`` line, once;
- the run does everything with a side effect: pushing and pulling, deadlines, retries and stopping
  (``TooFewReplies``), the step log and staged pending updates (``durability``), participation (``Participation``),
  clocks, the nodes'
  evaluations, records, checkpoints (``checkpoint_state``) and resume (``resumed``, ``step_applied``);
- besides, it reads the algorithm's public settings and model (``config``, ``algorithm``,
  ``partition``, ``global_params``, ``run_dir``) and what it knows of nodes (``round_nodes``,
  ``partition_of``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from .. import core
from ..checkpoint import Checkpoint, replay_run, save_checkpoint
from ..messages import EvaluateReply, RoundConfig, TrainMetrics
from ..metrics import RunRecorder, round_line
from ..records import to_record
from ..transport.server_side import update_bound
from . import client_evaluation
from .durability import PendingStaging, StepHistory
from .participation import Participation
from .reply_checks import Reply
from .round_stats import array_bytes, critical_path_rows

if TYPE_CHECKING:
    from .direct import DirectMessages
    from .fedbcd.server import FedBCD, RoundOutcome

log = logging.getLogger(__name__)


AUDIT_GRACE_S = 30.0  # the run's end waits this long, at most, for Flower's replies that audit the last ones


class TooFewReplies(RuntimeError):
    """A round kept fewer valid replies than ``min-accepted-replies``: the run stops.

    ``kind`` is ``timeout`` when no node answered at all, else ``too-few-replies``.
    """

    def __init__(self, message: str, kind: str = "too-few-replies"):
        super().__init__(message)
        self.kind = kind


def expired_unanswered(reply: Message) -> bool:
    """The SuperLink's own reply to a message that expired (its TTL) before its node answered."""
    return (
        reply.metadata.src_node_id == SUPERLINK_NODE_ID
        and reply.has_error()
        and reply.error.code in (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE)
    )


class Run:
    """One run of ``algorithm``: the loop, the records, the clocks, the checkpoint, resume.

    ``evaluator`` (a ``ServerEvaluator``, or None) evaluates each round's ``x^r`` on a replica of
    its own, beside the loop: the loop hands it each durable round and never waits for it.
    """

    def __init__(self, algorithm: FedBCD, evaluator=None, direct: DirectMessages | None = None):
        self.algorithm = algorithm
        self.direct = direct  # transport = "direct" in a deployment: block records on the run's stream
        self.config = algorithm.config
        self.run_dir = run_dir = algorithm.run_dir
        self.history = StepHistory(run_dir, self.config.snapshot_every)  # x's steps, durably, beside the loop
        # ParaBlock's pending updates go to disk on a thread of their own, in the order staged: the
        # round's aggregation and next messages do not wait for N clients' blocks to be written.
        self.staging = PendingStaging(run_dir)
        self._model_digest = core.ModelDigest(algorithm.partition.all_names())  # rehashes what steps change
        self.recorder = RunRecorder(run_dir, self.config.metrics_sink)
        self.evaluator = evaluator
        self.num_rounds = self.config.num_server_rounds  # lowered by a documented stop (``stop_early``)
        self.stopped_early = ""  # why the run ended before num-server-rounds
        self.round_timeout_s = self.config.round_timeout_s
        self.first_round = 1  # R+1 when resumed from round R's checkpoint
        self.resumed_from: Path | None = None  # the resumed run's folder, resolved here once for every node
        self.rounds_completed = 0  # the last round whose checkpoint is on disk
        self._started = time.perf_counter()
        # Wall-clock times (time.time, comparable with the node workers' on one host) of this round's
        # push, last reply, aggregation; and of the previous round's, with each node's reply arrival.
        self._times: dict[str, float] = {}
        self._cpu_at_aggregate = time.process_time()  # the server's CPU seconds when the last round was aggregated
        self._previous: dict = {}
        self._arrivals: dict[int, float] = {}
        self._counts = self._new_counts()  # this round's message counts (``round_clock``)
        self._modeled_wall_s = 0.0
        # evaluation = "clients": version -> the nodes' aggregated held-out evaluation of x^version; it comes
        # with round version+1's replies, after round version's record is written (which it then completes).
        self.client_evaluations: dict[int, dict] = {}
        self._recorded: dict[int, dict] = {}  # round -> its training record, until its evaluation is logged
        self.unevaluated_round: int | None = None  # resumed after a round whose evaluation was lost
        self._deadline = 0.0  # time.monotonic() at which the round's outstanding replies are abandoned
        self._abandoned: dict[str, tuple[int, float]] = {}  # message id -> (node, when it expires)
        self._withdrawn: dict[str, tuple[int, float]] = {}  # messages pushed ahead, withdrawn: the same
        self.participation = Participation(algorithm.partition_of, self.round_timeout_s,
                                           self.config.max_consecutive_rejections)  # fmt: skip
        self.pull_interval_s = self.config.pull_interval_s
        self.last_record: dict = {}  # the last aggregated round's record (written once the round is durable)
        # A push is sent in batches of at most one model's worth of arrays (``push``).
        self._batch_limit = sum(t.numel() * t.element_size() for t in algorithm.global_params.values())

    # ------------------------------------------------------------ the loop
    def start(self, grid: Grid, first_step: ArrayRecord) -> Result:
        """Flower's round loop, from ``first_round``, with nothing but aggregation between a
        round's last reply and the next round's messages.

        Round r's messages go out as soon as ``g^{r-1}`` exists; round r-1's step (and any
        snapshot), its clients' pending updates, its record and checkpoint are then made durable
        while round r's replies are outstanding, and handed to the evaluator, which evaluates on
        its own replica (a stopped run loses at most the round in flight; no reply waits for an
        evaluation or a disk). ``first_step`` is the step round ``first_round`` sends (empty in
        round 1).
        """
        self.algorithm.summary()
        if self.evaluator is not None:
            self.evaluator.begin(self)
        result, arrays = Result(), first_step
        due = 0 if self.first_round == 1 else self.unevaluated_round  # a round whose finish is due
        self._times = {"aggregated": time.time()}
        try:
            for server_round in range(self.first_round, self.num_rounds + 1):
                if why := self.algorithm.stop_reason(server_round):  # a documented stop (dp-target-epsilon)
                    self.stop_early(server_round, why)
                    break
                self._counts = self._new_counts()
                self.prune_step_log()  # before the messages: no node of this round reads what it drops
                config = self.round_part(server_round, self.client_evaluation_request(server_round - 1))
                messages = self.algorithm.configure_train(server_round, arrays, config, grid)
                sent = self.push(grid, self.outgoing(server_round, messages), ahead_round=server_round)
                self._times["pushed"] = time.time()
                self.push_ahead(grid, server_round + 1, set(sent.values()))
                self._times.pop("first_reply_checked", None)
                if due is not None:
                    self.pull_audits(grid)  # before the disk: Flower hands a reply over only while its message lives
                    self.finish_round(due)
                    self._times["previous_finished"] = time.time()  # beside the message's way to the nodes
                self.staging.discard()  # what an earlier, failed attempt staged
                replies = self.replies_as_they_arrive(grid, sent, server_round)
                outcome = self.aggregate(server_round, replies, sent, grid, (arrays, config))
                numbers = {k: v for k, v in outcome.record.items() if type(v) in (int, float)}
                arrays = result.arrays = outcome.arrays
                result.train_metrics_clientapp[server_round] = MetricRecord(numbers)
                due = server_round
            if due is not None:
                self.make_durable(due)  # before the nodes' final evaluation, which may take round-timeout-s
            self.final_client_evaluation(grid, result.arrays)
            self.close_stream(grid, due if due is not None else self.num_rounds)
            if due is not None:
                self.finish_round(due)
            self.prune_step_log()
        except BaseException:
            self.staging.cancel()
            if self.evaluator is not None:
                self.evaluator.close(raise_error=False)  # the run's own error is the one to report
            raise
        if self.evaluator is not None:
            self.evaluator.close()  # the queue drains: every round handed over is evaluated first
            self.prune_step_log()  # what the evaluator held back
        return result

    def stop_early(self, server_round: int, why: str) -> None:
        """The run ends after round r-1 instead of ``num-server-rounds`` (``stopped_early`` says why): what
        follows the loop (the last round made durable, the nodes' final evaluation) counts from there."""
        log.warning("stopping before round %d: %s", server_round, why)
        self.stopped_early, self.num_rounds = why, server_round - 1
        if self.direct is not None:  # round r's messages pushed ahead are withdrawn (their replies dropped)
            self.note_withdrawn(self.direct.withdraw(server_round))

    @staticmethod
    def _new_counts() -> dict[str, int]:
        return {"messages_not_pushed": 0, "replies_missing": 0, "late_replies_dropped": 0, "round_retries": 0}

    def round_part(self, server_round: int, evaluation: dict, resumed: bool = True) -> ConfigRecord:
        """The run's part of round r's config (``RoundConfig``): its folder, and for a resumed run the
        round its checkpoint holds (whose residuals a node goes on from: it may have answered later rounds
        before the server stopped) and its folder as the server resolved it (a relative resume-from means
        nothing in a Ray actor's directory); ``evaluation``: what the nodes evaluate."""
        part = RoundConfig(server_round=server_round, run_dir=str(self.run_dir), **evaluation)
        if resumed and self.first_round > 1:
            part = replace(part, resumed_after=self.first_round - 1, resume_dir=str(self.resumed_from))
        return ConfigRecord(part.to_config())

    # ------------------------------------------------------------ a round's replies
    def aggregate(
        self,
        server_round: int,
        replies: Iterable[Message],
        sent: dict[str, int],
        grid: Grid | None,
        message: tuple[ArrayRecord, ConfigRecord] = (ArrayRecord(), ConfigRecord()),
    ) -> RoundOutcome:
        """Round r's replies (answering ``sent``) checked as they arrive and aggregated by the algorithm;
        then ``g^r`` logged, the round's participation, clocks and the nodes' evaluations noted. Too few
        valid replies: the round is re-sent to the nodes without one (``on-too-few-replies = "retry"``, at
        most ``max-round-retries`` times), or the run stops (``TooFewReplies``); an aggregate the
        algorithm rejected voids what its replies staged for the checkpoint. Returns the outcome, its
        record completed with the run's figures. ``message``: the round's step and the run's part of its
        config, which a retry sends again."""
        accepted: list[Reply] = []
        while True:
            outcome = self.algorithm.aggregate_train(server_round, replies, sent, accepted, self.staging.stage)
            self.participation.note_claimed(outcome.claimed_partitions)
            if outcome.step is not None:
                break
            if outcome.aggregate_rejected:
                self.staging.discard()
            accepted, replies, sent = outcome.accepted, [], {}
            if len(accepted) < self.config.min_accepted_replies:  # (else: aggregate again, with none)
                sent = self.retry(grid, outcome, message)
                replies = self.replies_as_they_arrive(grid, sent, server_round)
        self.history.add(server_round, outcome.block, outcome.step)
        self._model_digest.changed(outcome.step)
        if self.direct is not None:  # the round's fallbacks and refusals; its capabilities and records forgotten
            outcome.record.update(self.direct.end_round(server_round))
        reasons = {r.node: r.reason for r in outcome.rejected}
        self.participation.note_round(self.algorithm.round_nodes, {r.node for r in outcome.accepted}, reasons)
        self.collect_client_evaluation(server_round - 1, outcome.accepted)
        outcome.record.update(self.round_clock({r.node: r.metrics for r in outcome.accepted}))
        self.last_record = outcome.record
        return outcome

    def retry(
        self, grid: Grid | None, outcome: RoundOutcome, message: tuple[ArrayRecord, ConfigRecord]
    ) -> dict[str, int]:
        """Too few valid replies: re-send the round to the nodes without one (returns what was pushed),
        or stop the run (``on-too-few-replies = "stop"``, the retries spent, or no grid to re-send on)."""
        cfg, retries = self.config, self._counts["round_retries"]
        if cfg.on_too_few_replies == "stop" or retries >= cfg.max_round_retries or grid is None:
            reasons = "; ".join(f"node {r.node}: {r.reason}" for r in outcome.rejected[-3:]) or "no replies"
            raise TooFewReplies(f"round {outcome.server_round}: {outcome.reason} ({reasons})",
                                kind="timeout" if outcome.num_replies == 0 else "too-few-replies")  # fmt: skip
        self._counts["round_retries"] += 1
        done = {r.node for r in outcome.accepted}
        nodes = [n for n in self.algorithm.round_nodes if n not in done]
        log.warning("round %d: %d valid replies, fewer than min-accepted-replies=%d: re-sending to %d nodes "
                    "(retry %d of %d)", outcome.server_round, len(outcome.accepted), cfg.min_accepted_replies,
                    len(nodes), retries + 1, cfg.max_round_retries)  # fmt: skip
        if self.direct is not None:  # their messages of the next round, pushed ahead, would come first
            self.note_withdrawn(self.direct.withdraw(outcome.server_round + 1, set(nodes)))
        messages = self.algorithm.train_messages(outcome.server_round, nodes, *message)
        return self.push(grid, self.outgoing(outcome.server_round, messages, first=False))

    def note_withdrawn(self, withdrawn: dict[str, int]) -> None:
        """Messages pushed ahead and withdrawn (message id -> node): their replies are pulled and dropped."""
        expiry = time.monotonic() + 2 * self.round_timeout_s
        self._withdrawn.update({mid: (node, expiry) for mid, node in withdrawn.items()})

    def outgoing(
        self, server_round: int, messages: Iterable[Message], update: bool = True, first: bool = True
    ) -> Iterator[Message]:
        """``messages`` as they are pushed: with the direct transport, each one's block records moved onto
        the run's stream (``DirectMessages.outgoing``), with a capability to upload the round's update
        (``update``), bounded by its block's size, and round r+1's capabilities (but in the last round).
        After the round's ``first`` push (not a retry's), nodes it did not message lose theirs for round r."""
        if self.direct is None:
            yield from messages
            return
        bound = ahead = None
        if update:
            bound = self.update_bound(server_round)
            if server_round < self.num_rounds:  # round r+1's update and step (g^r: this round's block) ahead
                ahead = (self.update_bound(server_round + 1), bound)
        nodes = set()
        for msg in messages:
            nodes.add(msg.metadata.dst_node_id)
            yield self.direct.outgoing(msg, server_round, bound, ahead, self.config.transport_messages_ahead)
        if update and first:  # every node of the round is messaged: the others' capabilities issued ahead end
            self.direct.messaged(server_round, nodes)

    def update_bound(self, server_round: int) -> int:
        """The most bytes a node's update of round r's block may take on the stream (``update_bound``)."""
        names = self.algorithm.partition.names(self.algorithm.block_for_round(server_round))
        return update_bound(sum(self.algorithm.global_params[n].numel() for n in names), len(names))

    def push(self, grid: Grid, messages: Iterable[Message], ahead_round: int | None = None) -> dict[str, int]:
        """Push ``messages`` (each expires after ``round-timeout-s``); returns message id -> node
        for those the Grid took, with the round's deadline counted from now. ``ahead_round``: round r's
        first push, whose message to a node that has one pushed a round ahead (``push_ahead``) is not
        pushed but published on the stream for it (``DirectMessages.deliver``: that message's id stands for
        it); those no message took are withdrawn.

        ``messages`` may be a generator: they are built and pushed in batches of at most one
        model's worth of arrays, so catch-ups for many nodes never sit in memory together. A
        message the Grid did not take (an empty or ``None`` id) is logged and counted
        (``messages_not_pushed``); its node is then one that did not answer."""
        sent: dict[str, int] = {}
        batch: list[Message] = []
        batch_bytes, limit = 0, self._batch_limit
        for msg in messages:
            if ahead_round is not None and self.direct is not None:
                if (mid := self.direct.deliver(msg, ahead_round)) is not None:
                    sent[mid] = msg.metadata.dst_node_id
                    continue
            msg.metadata.ttl = self.round_timeout_s
            batch.append(msg)
            batch_bytes += array_bytes(msg.content)
            if batch_bytes >= limit:
                sent.update(self._push_batch(grid, batch))
                batch, batch_bytes = [], 0
        sent.update(self._push_batch(grid, batch))
        if ahead_round is not None and self.direct is not None:
            self.note_withdrawn(self.direct.withdraw(ahead_round))
        self._deadline = time.monotonic() + self.round_timeout_s
        return sent

    def push_ahead(self, grid: Grid, server_round: int, nodes: set[int]) -> None:
        """Round r's messages pushed now, while round r-1 is in flight, to those of ``nodes`` whose last reply
        committed its update on the stream (``DirectMessages.message_ahead``; ``transport-messages-ahead``):
        Flower delivers each as soon as its SuperNode has pushed round r-1's reply, and its ClientApp gets the
        round from the node's worker, which waits on the stream for the content round r's push publishes (and
        starts the round with it). They live until round r may end."""
        if self.direct is None or not self.config.transport_messages_ahead or server_round > self.num_rounds:
            return
        messages = [m for n in sorted(nodes) if (m := self.direct.message_ahead(server_round, n)) is not None]
        taken = {mid for mid in grid.push_messages(messages) if mid} if messages else set()
        for msg in messages:
            if msg.metadata.message_id in taken:
                self.direct.pushed(server_round, msg.metadata.dst_node_id, msg.metadata.message_id)

    def _push_batch(self, grid: Grid, batch: list[Message]) -> dict[str, int]:
        if not batch:
            return {}
        taken = {mid for mid in grid.push_messages(batch) if mid}
        sent = {}
        for msg in batch:
            if msg.metadata.message_id in taken:
                sent[msg.metadata.message_id] = msg.metadata.dst_node_id
            else:
                log.warning("the Grid did not take the message to node %d", msg.metadata.dst_node_id)
                self._counts["messages_not_pushed"] += 1
        return sent

    def replies_as_they_arrive(self, grid: Grid, sent: dict[str, int], server_round: int = 0) -> Iterator[Message]:
        """Each reply as soon as it is pulled (every ``pull-interval-s``), until all have come or
        the deadline (``round-timeout-s`` after the push) passes: the aggregation checks each on
        arrival. With the direct transport, a reply's update committed on the stream is taken from it
        first (``DirectMessages.incoming``): round ``server_round``'s upload, checked by its digest; and a
        reply whose content came on the stream is taken as soon as it is in (woken by its upload), its Flower
        reply pulled later as its audit (``DirectMessages.replies_from_stream``, ``audit``).

        Messages still unanswered at the deadline are abandoned: they expire on the SuperLink at
        the same time (their TTL), and a reply to one that still arrives later is pulled and
        dropped, counted in the round that pulls it (``late_replies_dropped``). (The algorithm gives
        its node a full sync next, as after a rejected reply: it is in ``sent`` and did not reply.)
        The SuperLink's notice that a message expired unanswered is no reply: its node is missing,
        whether the notice comes just before the deadline (the TTL counts from the message's
        creation, a moment before the push) or after it. (Flower 1.42's SuperLink sends that notice
        for an expired message even when a reply came in time: a first pull later than
        ``round-timeout-s``, after a previous round's slow record, finds the round's nodes missing.)"""
        waiting, first_pull, direct = dict(sent), True, self.direct
        # At least one pull: what ran since the push (the previous round's record and checkpoint)
        # may have outlasted the deadline, and replies that came in time are waiting on the SuperLink.
        while waiting and (first_pull or time.monotonic() < self._deadline):
            first_pull = False
            on_stream = direct is not None and direct.replies_on_stream
            for reply in direct.replies_from_stream(server_round, waiting) if on_stream else ():
                node = waiting.pop(reply.metadata.reply_to_message_id)
                self._arrived(node)
                yield direct.incoming(reply, server_round, node)
            audits = set(direct.audits) if direct is not None else set()
            ids = set(waiting) | set(self._abandoned) | set(self._withdrawn) | audits
            pulled = list(grid.pull_messages(ids))[::-1] if waiting or audits else []
            while pulled:  # each reply leaves the list as it is checked: the pull holds none of them after
                reply = pulled.pop()
                if (node := self._round_reply(reply, waiting)) is not None:
                    self._arrived(node)
                    yield reply if direct is None else direct.incoming(reply, server_round, node)
            if waiting and direct is not None and direct.replies_on_stream:
                direct.transport.wait_for_upload(self.pull_interval_s)  # a reply on the stream ends it
            elif waiting:
                time.sleep(self.pull_interval_s)
        if direct is not None:
            direct.expire_audits()
        now = time.monotonic()
        self._abandoned = {m: v for m, v in self._abandoned.items() if v[1] > now}  # expired on the SuperLink
        self._withdrawn = {m: v for m, v in self._withdrawn.items() if v[1] > now}
        for mid, node in waiting.items():
            self.count_missing(node, "it did not answer")
            self._abandoned[mid] = (node, now + self.round_timeout_s)

    def _round_reply(self, reply: Message, waiting: dict[str, int]) -> int | None:
        """The node of a pulled reply to check now (its message leaves ``waiting``), or None for one dealt with
        here: an audit of a reply taken from the stream, a notice that a message expired, a late reply, the
        reply to a message withdrawn, or one to a message not ours."""
        mid = reply.metadata.reply_to_message_id
        if self.direct is not None and self.direct.audit(reply):
            return None
        if expired_unanswered(reply):
            self._abandoned.pop(mid, None)
            self._withdrawn.pop(mid, None)
            if mid in waiting:
                self.count_missing(waiting.pop(mid), "its message expired on the SuperLink before a reply")
            return None
        if mid in self._abandoned:
            node, _ = self._abandoned.pop(mid)
            self._counts["late_replies_dropped"] += 1
            log.warning("dropped a late reply of node %d (its round had ended)", node)
            return None
        if mid in self._withdrawn:  # a message pushed ahead that the server withdrew: counted then
            self._withdrawn.pop(mid)
            return None
        return waiting.pop(mid, None)  # None: not a message of ours, nothing to check it against

    def _arrived(self, node: int) -> None:
        """``node``'s reply is in, to be checked now."""
        self._times["last_reply"] = self._arrivals[node] = time.time()
        self._times.setdefault("first_reply_checked", self._times["last_reply"])  # checked on arrival

    def count_missing(self, node: int, why: str) -> None:
        log.warning("node %d: %s within round-timeout-s=%g", node, why, self.round_timeout_s)
        self._counts["replies_missing"] += 1

    def round_clock(self, accepted_metrics: dict[int, TrainMetrics]) -> dict:
        """Called once round r is aggregated (``accepted_metrics``: node -> its reply's metrics):
        the round's message counts, its wall time (since round r-1 was aggregated), the time from
        its last reply to its aggregate (checks ran as replies arrived), and where the time between
        round r-1's replies and round r's messages reaching the workers went (``critical_path_rows``)."""
        now = time.time()
        clock = {
            **self._counts,
            "round_wall_s": now - self._times.get("aggregated", now),
            "server_cpu_s": time.process_time() - self._cpu_at_aggregate,  # this process's, every thread
            "aggregate_s": now - self._times.get("last_reply", now),
            # Wall-clock stamps of the round on the server: pushed, first reply checked, last reply, aggregated.
            "server_times": {**self._times, "aggregated": now},
            **critical_path_rows(accepted_metrics, self._previous, self._times.get("pushed")),
        }
        self._previous = {
            "last_reply": self._times.get("last_reply"),
            "aggregated": now,
            "arrivals": dict(self._arrivals),
            "clientapp_reply": {
                n: m.clientapp_reply for n, m in accepted_metrics.items() if m.clientapp_reply is not None
            },  # fmt: skip
        }
        self._times["aggregated"], self._arrivals, self._cpu_at_aggregate = now, {}, time.process_time()
        return clock

    def prune_step_log(self) -> None:
        """What the newest snapshot made redundant, between rounds, but no step the server's evaluator has
        still to read (after the round it last reported)."""
        self.history.prune(self.evaluator.version if self.evaluator is not None else None)

    # ------------------------------------------------------------ evaluation
    def client_evaluation_request(self, version: int) -> dict:
        """``evaluation = "clients"``: what asks the nodes of round ``version + 1`` to evaluate ``x^version``."""
        return client_evaluation.request(self.config, version, self.num_rounds)

    def collect_client_evaluation(self, version: int, replies: list[Reply]) -> None:
        """The nodes' evaluations of ``x^version`` that came with round ``version + 1``'s replies."""
        rows = [EvaluateReply(r.partition_id, r.metrics.evaluation) for r in replies
                if r.metrics.evaluation is not None and r.metrics.evaluation.eval_version == version]  # fmt: skip
        if rows:
            self.client_evaluations[version] = client_evaluation.aggregate(rows)

    def final_client_evaluation(self, grid: Grid, arrays: ArrayRecord) -> None:
        """``evaluation = "clients"``: the nodes of the last round evaluate ``x^R`` (an EVALUATE message
        carrying ``g^R`` and any catch-up) after the last round."""
        num_rounds = self.num_rounds
        if self.config.evaluation != "clients" or not self.algorithm.round_nodes:
            return
        config = self.round_part(num_rounds + 1, self.client_evaluation_request(num_rounds), resumed=False)
        messages = self.algorithm.configure_evaluate(num_rounds + 1, arrays, config, grid)
        sent = self.push(grid, self.outgoing(num_rounds + 1, messages, update=False))
        replies = self.replies_as_they_arrive(grid, sent, num_rounds + 1)
        if rows := client_evaluation.valid_rows(replies, num_rounds):
            self.client_evaluations[num_rounds] = client_evaluation.aggregate(rows)

    def pull_audits(self, grid: Grid) -> None:
        """Flower's replies that audit replies taken from the stream, those in now (``DirectMessages.audit``)."""
        if self.direct is not None and self.direct.audits:
            for reply in grid.pull_messages(set(self.direct.audits)):
                self.direct.audit(reply)

    def close_stream(self, grid: Grid, last_round: int) -> None:
        """``transport = "direct"``: the stream stops once the last reply is in (the nodes' final evaluation
        included) and Flower's replies that audit the last replies taken from the stream have come (at most
        ``AUDIT_GRACE_S``, or ``round-timeout-s`` if shorter), and what it counted after round ``last_round``'s
        record was written (the final evaluation's fallbacks, those audits, anything it refused until it stopped)
        completes that record as ``final_direct_*``: no fallback, refusal or audit goes uncounted because no round
        was left to record it."""
        if self.direct is None:
            return
        until = time.monotonic() + min(AUDIT_GRACE_S, self.round_timeout_s)
        while self.direct.audits and time.monotonic() < until:
            self.pull_audits(grid)
            if self.direct.audits:
                time.sleep(self.pull_interval_s)
        self.direct.expire_audits(every=True)  # those that did not come: unaudited, said and counted
        self.direct.transport.stop()
        counts = self.direct.end_round(self.num_rounds + 1)  # the final evaluation's capabilities and records too
        self.recorder.write({"round": last_round, **{f"final_{name}": n for name, n in counts.items()}})

    def finish_round(self, server_round: int) -> None:
        """Round r's record and checkpoint made durable, then its evaluation handed on (r = 0: the
        evaluation before training): to the evaluator, which completes the record when it is done,
        and the nodes' evaluations (``evaluation = "clients"``) that came with this round's replies."""
        self.make_durable(server_round)
        if self.evaluator is not None:
            self.evaluator.submit(server_round)
        else:
            self.write_evaluation(server_round, self.client_evaluations.pop(server_round, {}))
        for version in sorted(self.client_evaluations):  # earlier rounds' records, completed by appending
            done = self.client_evaluations.pop(version)
            self.recorder.write({"round": version, **done})
            log.info("round %d: heldout_loss %.4f (clients' own held-out rows)", version, done["heldout_loss"])

    def write_evaluation(self, server_round: int, evaluation: dict) -> None:
        """Complete round r's record with its evaluation (appended) and log the round's line.
        Called by the loop and by the evaluator's receiving thread (``RunRecorder.write`` is one append)."""
        if server_round == 0 and "algorithm" not in evaluation:  # round 0 has no training record
            # x^0 is what the run starts from: stamped at the start, however late its evaluation ends (the
            # evaluator runs at the lowest priority), so that loss against wall-clock reads forwards.
            evaluation = {"algorithm": self.algorithm.algorithm, "elapsed_s": 0.0, **evaluation}
        if evaluation:
            self.recorder.write({"round": server_round, **evaluation}, crash_stage=("record", server_round))
        training = self._recorded.pop(server_round, {"round": server_round})
        log.info(round_line({**training, **evaluation}, self.num_rounds))

    def make_durable(self, server_round: int) -> None:
        """Round r's step and its clients' pending updates on disk, its training record, then its
        checkpoint, once: from here on a crash loses nothing of it."""
        if server_round > self.rounds_completed:
            step_log_s = self.history.write(server_round, self.algorithm.global_params)  # what the checkpoint counts on
            self.staging.wait()
            self.record_round(server_round, {"step_log_write_s": step_log_s})
            self.save_checkpoint(server_round)
            self.rounds_completed = server_round

    def record_round(self, server_round: int, extra: dict) -> None:
        """Append round r's training record (``last_record``: the algorithm's fields and the run's clocks,
        and ``extra``) to ``metrics.jsonl``."""
        record = {"round": server_round, "algorithm": self.algorithm.algorithm}
        self._modeled_wall_s += self.last_record.get("modeled_round_s", 0.0)
        record.update(self.last_record, **extra, modeled_wall_s=self._modeled_wall_s)
        if 0 < server_round < self.num_rounds and "last_reply" in self._times:
            # From the round's last reply to the next round's messages being out: only aggregation.
            record["server_critical_path_s"] = self._times["pushed"] - self._times["last_reply"]
        record["elapsed_s"] = time.perf_counter() - self._started
        if server_round < self.num_rounds:
            record["eta_s"] = record["elapsed_s"] / server_round * (self.num_rounds - server_round)
        self.recorder.write(record)
        self._recorded[server_round] = record

    # ------------------------------------------------------------ checkpoint and resume
    def save_checkpoint(self, server_round: int) -> None:
        """After round r is recorded: what a restarted server needs (``checkpoint.py``)."""
        save_checkpoint(
            self.run_dir,
            Checkpoint(
                round=server_round,
                global_sha256=self._model_digest(self.algorithm.global_params),
                elapsed_s=time.perf_counter() - self._started,
                modeled_wall_s=self._modeled_wall_s,
                participation=self.participation.state(),
                **self.algorithm.checkpoint_state(),
            ),
        )

    def _count_lost_evaluations(self, records: dict[int, dict], resumed_after: int) -> None:
        """Rounds before ``resumed_after`` that the server's evaluator had still to evaluate when the run
        stopped (it lags the loop): their ``x^r`` may be pruned from the step log, so they are recorded
        as skipped, and counted on the last line, rather than lost without a word."""
        if self.evaluator is None or self.config.evaluation != "server":
            return
        done = {"heldout_loss", "evaluate_s", "evaluation_skipped"}
        lost = [
            r for r in range(resumed_after) if r % self.config.eval_every == 0 and not done & records.get(r, {}).keys()
        ]
        for server_round in lost:
            self.recorder.write({"round": server_round, "evaluation_skipped": 1})
        if lost:
            log.warning("rounds %s were not evaluated before the run stopped: recorded as skipped", lost)

    def resume(self, from_run_dir: Path, ckpt: Checkpoint) -> ArrayRecord:
        """Continue the run in ``from_run_dir`` after its last complete round R (``ckpt``).

        ``x^R`` is rebuilt as ``x^0`` plus the logged steps (checked against the stored
        digest); the steps and the records of rounds 0..R are copied into this run's
        folder. Returns ``g^R``, the step that round R+1's message carries.
        """
        algorithm = self.algorithm
        step = replay_run(
            from_run_dir,
            ckpt,
            algorithm.global_params,
            algorithm.partition.all_names(),
            self.history.step_log,
            self.recorder,
            after_each_step=algorithm.step_applied,
        )  # keeps x^{R-1} for a full sync
        self._model_digest = core.ModelDigest(algorithm.partition.all_names())  # x is x^R now: hash it anew
        self.first_round = ckpt.round + 1
        self.resumed_from = Path(from_run_dir).expanduser().resolve()
        self.rounds_completed = ckpt.round
        records = {r["round"]: r for r in self.recorder.read()}
        last = records.get(ckpt.round, {})
        if "evaluate_s" not in last and "heldout_loss" not in last:  # killed before its evaluation was written
            self.unevaluated_round, self._recorded[ckpt.round] = ckpt.round, last
        self._count_lost_evaluations(records, ckpt.round)
        self._modeled_wall_s = ckpt.modeled_wall_s
        self._started = time.perf_counter() - ckpt.elapsed_s  # elapsed_s goes on where it stopped
        self.participation.carry(ckpt.participation)
        algorithm.resumed(ckpt)
        for partition_id, pending in ckpt.pending.items():  # this folder's own copy of the checkpoint:
            self.staging.stage(partition_id, pending)  # resumable from its first moment
        self.staging.wait()
        self.save_checkpoint(ckpt.round)
        log.info(
            "Resumed from %s after round %d (%d pending client updates to hand back)",
            from_run_dir,
            ckpt.round,
            len(ckpt.pending),
        )
        return to_record(step, self.config.transfer_dtype)  # a checkpoint is written after round 1 at the earliest
