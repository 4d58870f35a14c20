"""The run around a block strategy's rounds: Flower's round loop, each round's record and
checkpoint, and resuming from a checkpoint.

``RoundLoop`` is the base of ``FedBCD``: it holds what belongs to the run (the step
log, ``metrics.jsonl``, the clocks, the checkpoint) so that ``fedbcd/server.py`` holds only
what belongs to the algorithm's rounds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from .. import core
from ..checkpoint import Checkpoint, replay_run, save_checkpoint
from ..metrics import RunRecorder, round_line
from ..records import to_record
from ..replica import StepLog
from . import client_evaluation
from .node_sync import NodeSync
from .reply_checks import Reply
from .round_stats import critical_path_rows

log = logging.getLogger(__name__)


class RoundLoop(Strategy):
    """Run-level state and the loop; the rounds themselves are the subclass's
    (``configure_train``/``aggregate_train``, ``FedBCD``)."""

    algorithm = "?"
    partition: core.BlockPartition
    global_params: core.Tensors
    sync: NodeSync
    last_metrics: dict

    def __init__(self, run_dir: Path, num_rounds: int, round_timeout_s: float, pull_interval_s: float = 0.1):
        self.run_dir = Path(run_dir)
        self.step_log = StepLog(run_dir)  # g^1..g^r: clients catch up from it, resume replays it
        self.recorder = RunRecorder(run_dir)
        self.rounds_completed = 0  # the last round whose checkpoint is on disk
        self._blocks: dict[int, int] = {}  # server round -> block, as decided so far
        self._num_rounds = num_rounds
        self._timeout = round_timeout_s
        self.pull_interval_s = pull_interval_s
        self._started = time.perf_counter()
        # Wall-clock times (time.time, comparable with the node workers' on one host) of this round's
        # push, last reply, aggregation; and of the previous round's, with each node's reply arrival.
        self._times: dict[str, float] = {}
        self._previous: dict = {}
        self._arrivals: dict[int, float] = {}
        self._modeled_wall_s = 0.0
        # evaluation = "clients": version -> the nodes' aggregated held-out evaluation of x^version; it comes
        # with round version+1's replies, after round version's record is written (which it then completes).
        self.client_evaluations: dict[int, dict] = {}

    @property
    def first_round(self) -> int:
        """1, or R+1 when resumed from round R's checkpoint."""
        return self.sync.first_round

    def state_dict(self) -> dict:
        """Override point: a subclass's own state (JSON-serialisable) for the checkpoint."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Override point: restore what ``state_dict`` returned."""

    def client_evaluation_keys(self, version: int) -> dict:
        """``evaluation = "clients"``: what asks the nodes of round ``version + 1`` to evaluate ``x^version``."""
        return client_evaluation.request_keys(self.config, version, self._num_rounds)

    def collect_client_evaluation(self, version: int, replies: list[Reply]) -> None:
        """The nodes' evaluations of ``x^version`` that came with round ``version + 1``'s replies."""
        rows = [r.metrics for r in replies if r.metrics.get("eval-version") == version]
        if rows:
            self.client_evaluations[version] = client_evaluation.aggregate(rows)

    def final_evaluation(self, grid: Grid, arrays: ArrayRecord, num_rounds: int) -> None:
        """``evaluation = "clients"``: the nodes of the last round evaluate ``x^R`` (an EVALUATE message
        carrying ``g^R`` and any catch-up) after the last round."""
        if self.config.evaluation != "clients" or not self.stats.nodes:
            return
        round_cfg = {"server-round": num_rounds + 1, "block": -1, "step-block": self.block_for_round(num_rounds),
                     "next-block": -1, "algorithm": self.algorithm, "run-dir": str(self.run_dir),
                     **self.client_evaluation_keys(num_rounds)}  # fmt: skip
        messages = []
        for node in self.stats.nodes:
            content = RecordDict({"global-step": arrays, "round": ConfigRecord(dict(round_cfg))})
            self.sync.add_to_message(content, num_rounds + 1, node)
            messages.append(Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=node))
        replies = self.replies_as_they_arrive(grid, list(grid.push_messages(messages)))
        if rows := client_evaluation.valid_rows(replies, num_rounds):
            self.client_evaluations[num_rounds] = client_evaluation.aggregate(rows)

    def summary(self) -> None:
        log.info("%s: %d blocks, %d rounds", type(self).__name__, self.partition.num_blocks, self._num_rounds)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No client-side evaluation: the server evaluates held-out loss itself."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's round loop, from ``first_round``, with nothing but aggregation between a
        round's last reply and the next round's messages.

        Round r's messages go out as soon as ``g^{r-1}`` exists; round r-1's evaluation, record
        and checkpoint run while round r's replies are outstanding, and complete before round r
        is aggregated (a stopped run loses at most the round in flight). ``initial_arrays`` is
        the step round ``first_round`` sends.
        """
        self._num_rounds, self._timeout = num_rounds, timeout
        self.summary()
        result, arrays = Result(), initial_arrays
        due = 0 if self.first_round == 1 else None  # a round whose evaluation, record, checkpoint are due
        self._times = {"aggregated": time.time()}
        for server_round in range(self.first_round, num_rounds + 1):
            message_ids = list(grid.push_messages(self.configure_train(server_round, arrays, ConfigRecord(), grid)))
            self._times["pushed"] = time.time()
            self._times.pop("first_reply_checked", None)
            if due is not None:
                self.finish_round(due, result, evaluate_fn)
            arrays, train_metrics = self.aggregate_train(server_round, self.replies_as_they_arrive(grid, message_ids))
            result.arrays, result.train_metrics_clientapp[server_round] = arrays, train_metrics
            due = server_round
        self.final_evaluation(grid, result.arrays, num_rounds)
        self.finish_round(due, result, evaluate_fn)
        return result

    def replies_as_they_arrive(self, grid: Grid, message_ids: Iterable[str]) -> Iterator[Message]:
        """Each reply as soon as it is pulled (every ``pull-interval-s``), until all have come or
        ``round-timeout-s`` passes: the aggregation checks each on arrival."""
        waiting, deadline = set(message_ids), time.monotonic() + self._timeout
        while waiting and time.monotonic() < deadline:
            for reply in grid.pull_messages(waiting):
                waiting.discard(reply.metadata.reply_to_message_id)
                self._times["last_reply"] = self._arrivals[reply.metadata.src_node_id] = time.time()
                yield reply
            if waiting:
                time.sleep(self.pull_interval_s)

    def round_clock(self, accepted_metrics: dict[int, dict]) -> dict:
        """Called once round r is aggregated (``accepted_metrics``: node -> its reply's metrics):
        the round's wall time (since round r-1 was aggregated), the time from its last reply to
        its aggregate (checks ran as replies arrived), and where the time between round r-1's
        replies and round r's messages reaching the workers went (``critical_path_rows``)."""
        now = time.time()
        clock = {
            "round_wall_s": now - self._times.get("aggregated", now),
            "aggregate_s": now - self._times.get("last_reply", now),
            # Wall-clock stamps of the round on the server: pushed, first reply checked, last reply, aggregated.
            "server_times": {**self._times, "aggregated": now},
            **critical_path_rows(accepted_metrics, self._previous, self._times.get("pushed")),
        }
        self._previous = {
            "last_reply": self._times.get("last_reply"),
            "aggregated": now,
            "arrivals": dict(self._arrivals),
            "clientapp_reply": {n: m["clientapp-reply"] for n, m in accepted_metrics.items() if "clientapp-reply" in m},
        }
        self._times["aggregated"], self._arrivals = now, {}
        return clock

    def finish_round(self, server_round: int, result: Result, evaluate_fn) -> None:
        """Round r's evaluation, record and checkpoint (r = 0: the evaluation before training)."""
        started = time.time()  # round r+1's messages are out already (``pushed``)
        metrics = evaluate_fn(server_round, result.arrays) if evaluate_fn else None
        evaluation = dict(metrics or {})
        if metrics is not None:
            result.evaluate_metrics_serverapp[server_round] = metrics
        evaluation["evaluate_s"] = time.time() - started
        evaluation.update(self.client_evaluations.pop(server_round, {}))
        for version in sorted(self.client_evaluations):  # earlier rounds' records, completed in place
            done = self.client_evaluations.pop(version)
            self.recorder.update(version, done)
            log.info("round %d: heldout_loss %.4f (clients' own held-out rows)", version, done["heldout_loss"])
        if 0 < server_round < self._num_rounds and "last_reply" in self._times:
            # From the round's last reply to the next round's messages being out: only aggregation.
            evaluation["server_critical_path_s"] = self._times["pushed"] - self._times["last_reply"]
            evaluation["evaluation_started_after_next_push_s"] = started - self._times["pushed"]
        self.record_round(server_round, evaluation)
        if server_round > 0:
            self.save_checkpoint(server_round)
            self.rounds_completed = server_round

    def record_round(self, server_round: int, evaluation: dict) -> None:
        """Log the round's line and append its record to ``metrics.jsonl``."""
        record = {"round": server_round, "algorithm": self.algorithm}
        if server_round > 0:
            self._modeled_wall_s += self.last_metrics.get("modeled_round_s", 0.0)
            record.update(self.last_metrics, modeled_wall_s=self._modeled_wall_s)
        record.update(evaluation)
        record["elapsed_s"] = time.perf_counter() - self._started
        if 0 < server_round < self._num_rounds:
            record["eta_s"] = record["elapsed_s"] / server_round * (self._num_rounds - server_round)
        self.recorder.write(record)
        log.info(round_line(record, self._num_rounds))

    # ------------------------------------------------------------ checkpoint and resume
    def save_checkpoint(self, server_round: int) -> None:
        """After round r is recorded: what a restarted server needs (``checkpoint.py``)."""
        save_checkpoint(
            self.run_dir,
            Checkpoint(
                round=server_round,
                blocks=dict(self._blocks),
                global_sha256=core.digest(self.global_params, self.partition.all_names()),
                elapsed_s=time.perf_counter() - self._started,
                modeled_wall_s=self._modeled_wall_s,
                strategy_state=self.state_dict(),
            ),
        )

    def resume(self, from_run_dir: Path, ckpt: Checkpoint) -> ArrayRecord:
        """Continue the run in ``from_run_dir`` after its last complete round R (``ckpt``).

        ``x^R`` is rebuilt as ``x^0`` plus the logged steps (checked against the stored
        digest); the steps and the records of rounds 0..R are copied into this run's
        folder. Returns ``g^R``, the step that round R+1's message carries.
        """
        step = replay_run(
            from_run_dir,
            ckpt,
            self.global_params,
            self.partition.all_names(),
            self.step_log,
            self.recorder,
            before_each_step=self.sync.applying,
        )  # keeps x^{R-1} for a full sync
        self.sync.first_round = ckpt.round + 1
        self.rounds_completed = ckpt.round
        self.sync.resume_pending = ckpt.pending
        self._blocks = dict(ckpt.blocks)
        self._modeled_wall_s = ckpt.modeled_wall_s
        self._started = time.perf_counter() - ckpt.elapsed_s  # elapsed_s goes on where it stopped
        self.load_state_dict(ckpt.strategy_state)
        log.info(
            "Resumed from %s after round %d (%d pending client updates to hand back)",
            from_run_dir,
            ckpt.round,
            len(ckpt.pending),
        )
        return to_record(step, self.sync.transfer_dtype)  # a checkpoint is written after round 1 at the earliest
