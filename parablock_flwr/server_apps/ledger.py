"""A run's records and clocks: what ``metrics.jsonl`` says of each round.

``RoundLedger`` writes each round's training record (the algorithm's fields, the driver's counts and stamps,
the server's clocks) once the round is durable, and appends its evaluation when it comes; it keeps the
run's elapsed and modeled wall-clock across a resume. It reads the ``RoundDriver``'s counts and stamps and
calls nothing back.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ..messages import TrainMetrics
from ..metrics import RunRecorder, round_line
from ..strategies.round_stats import critical_path_rows
from .round_driver import RoundDriver

log = logging.getLogger(__name__)


class RoundLedger:
    """The records of one run (``recorder``: ``metrics.jsonl``), each round's clocks, and the run's time."""

    def __init__(self, run_dir: Path, metrics_sink: str, algorithm: str):
        self.recorder = RunRecorder(run_dir, metrics_sink)
        self.algorithm = algorithm
        self.started = time.perf_counter()
        self.modeled_wall_s = 0.0
        self.last: dict = {}  # the last aggregated round's record (written once the round is durable)
        self._recorded: dict[int, dict] = {}  # round -> its training record, until its evaluation is logged
        # Wall-clock times (time.time, comparable with the node workers' on one host) of the last aggregation
        # and of the previous round's finish (the driver stamps pushes and replies); and the previous round's.
        self.times: dict[str, float] = {}
        self._previous: dict = {}
        self._cpu_at_aggregate = time.process_time()  # the server's CPU seconds when the last round was aggregated

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def resumed(self, elapsed_s: float, modeled_wall_s: float, unevaluated: tuple[int, dict] | None) -> None:
        """The run goes on from a checkpoint: its clocks where they stopped, and (``unevaluated``) its last round
        and that round's record, when its evaluation was not written, to be completed."""
        self.started, self.modeled_wall_s = time.perf_counter() - elapsed_s, modeled_wall_s
        if unevaluated is not None:
            server_round, record = unevaluated
            self._recorded[server_round] = record

    def clock(self, accepted: dict[int, TrainMetrics], driver: RoundDriver) -> dict:
        """Round r's figures once it is aggregated (``accepted``: node -> its reply's metrics): the driver's message
        counts, the round's wall time (since round r-1 was aggregated), the time from its last reply to its
        aggregate (checks ran as replies arrived), and where the time between round r-1's replies and round r's
        messages reaching the workers went (``critical_path_rows``)."""
        now, times = time.time(), {**driver.times, **self.times}
        clock = {
            **driver.counts,
            "round_wall_s": now - times.get("aggregated", now),
            "server_cpu_s": time.process_time() - self._cpu_at_aggregate,  # this process's, every thread
            "aggregate_s": now - times.get("last_reply", now),
            # Wall-clock stamps of the round on the server: pushed, first reply checked, last reply, aggregated.
            "server_times": {**times, "aggregated": now},
            **critical_path_rows(accepted, self._previous, times.get("pushed")),
        }
        self._previous = {
            "last_reply": times.get("last_reply"),
            "aggregated": now,
            "arrivals": driver.take_arrivals(),
            "clientapp_reply": {n: m.clientapp_reply for n, m in accepted.items() if m.clientapp_reply is not None},
        }
        self.times["aggregated"], self._cpu_at_aggregate = now, time.process_time()
        return clock

    def record(self, server_round: int, extra: dict, num_rounds: int, driver: RoundDriver) -> None:
        """Append round r's training record (``last``: the algorithm's fields and the round's clocks, and
        ``extra``) to ``metrics.jsonl``."""
        record = {"round": server_round, "algorithm": self.algorithm}
        self.modeled_wall_s += self.last.get("modeled_round_s", 0.0)
        record.update(self.last, **extra, modeled_wall_s=self.modeled_wall_s)
        if 0 < server_round < num_rounds and "last_reply" in driver.times:
            # From the round's last reply to the next round's messages being out: only aggregation.
            record["server_critical_path_s"] = driver.times["pushed"] - driver.times["last_reply"]
        record["elapsed_s"] = self.elapsed_s()
        if server_round < num_rounds:
            record["eta_s"] = record["elapsed_s"] / server_round * (num_rounds - server_round)
        self.recorder.write(record)
        self._recorded[server_round] = record

    def write_evaluation(self, server_round: int, evaluation: dict, num_rounds: int) -> None:
        """Complete round r's record with its evaluation (appended) and log the round's line. Called by the loop
        and by the evaluator's receiving thread (``RunRecorder.write`` is one append)."""
        if server_round == 0 and "algorithm" not in evaluation:  # round 0 has no training record
            # x^0 is what the run starts from: stamped at the start, however late its evaluation ends (the
            # evaluator runs at the lowest priority), so that loss against wall-clock reads forwards.
            evaluation = {"algorithm": self.algorithm, "elapsed_s": 0.0, **evaluation}
        if evaluation:
            self.recorder.write({"round": server_round, **evaluation}, crash_stage=("record", server_round))
        training = self._recorded.pop(server_round, {"round": server_round})
        log.info(round_line({**training, **evaluation}, num_rounds))
