"""A run's records, clocks and exclusions: what ``metrics.jsonl`` says of each round, and who took part.

``RoundLedger`` writes each round's training record (the algorithm's fields, the driver's counts and stamps,
the server's clocks) once the round is durable, and appends its evaluation when it comes; it keeps the
run's elapsed and modeled wall-clock across a resume. It reads the ``RoundDriver``'s counts and stamps and
calls nothing back.

``Participation``: no node silently left out. Per node, the rounds it was asked, aggregated, and not aggregated in
a row, so that the run names at its end (``excluded``: ``status.json``, the last line) each node it never
aggregated or lost for ``max-consecutive-rejections`` rounds in a row. A resumed run goes on counting (``state``,
``carry``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
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

    def resumed(
        self, elapsed_s: float, modeled_wall_s: float, unevaluated: tuple[int, dict] | None, skipped: list[int]
    ) -> None:
        """The run goes on from a checkpoint: its clocks where they stopped, and (``unevaluated``) its last round
        and that round's record, when its evaluation was not written, to be completed. ``skipped``: rounds whose
        evaluation was lost, recorded as skipped (and counted on the last line), not lost without a word."""
        self.started, self.modeled_wall_s = time.perf_counter() - elapsed_s, modeled_wall_s
        for server_round in skipped:
            self.recorder.write({"round": server_round, "evaluation_skipped": 1})
        if skipped:
            log.warning("rounds %s were not evaluated before the run stopped: recorded as skipped", skipped)
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

    def final_counts(self, last_round: int, counts: dict[str, int]) -> None:
        """What the channel counted after round ``last_round``'s record was written (``RoundDriver.close``), added
        to that record as ``final_*``: no fallback, refusal or audit goes uncounted for want of a round."""
        if counts:
            self.recorder.write({"round": last_round, **{f"final_{name}": n for name, n in counts.items()}})

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


class Participation:
    """The run's ledger of who took part. ``partition_of`` (the algorithm's) says which partition a node serves,
    as its accepted replies said: a row is kept under it across a restart, where node ids change."""

    def __init__(self, partition_of: Callable[[int], int | None], round_timeout_s: float, max_consecutive: int):
        self.partition_of = partition_of
        self.round_timeout_s = round_timeout_s
        self.max_consecutive = max_consecutive
        self.rows: dict[int, dict] = {}  # node -> rounds asked, aggregated, not in a row
        self.rounds_noted = 0  # rounds whose participation was noted, since round 1 (a resume goes on counting)
        # A resumed run's rows from before the restart, by partition ("partition 3") where it was known,
        # else by node id ("node 7"): node ids change across a restart, partitions do not.
        self.carried: dict[str, dict] = {}

    def note_round(self, asked: list[int], accepted: set[int], reasons: dict[int, str]) -> None:
        """After round r: each node sent the round's message and not aggregated (rejected, an error, no reply)
        counts towards its exclusion."""
        self.rounds_noted += 1
        for node in asked:
            row = self.row(node, self.partition_of(node))
            row["rounds"] += 1
            if node in accepted:
                row["accepted"] += 1
                row["streak"] = 0
            else:
                row["streak"] += 1
                row["longest"] = max(row["longest"], row["streak"])
                row["last_reason"] = reasons.get(node, f"no reply within round-timeout-s={self.round_timeout_s:g}")

    def note_claimed(self, claimed: dict[int, int]) -> None:
        """The partition ids rejected replies claim (node -> id): only to name the node to the operator; the
        server trusts partition ids from accepted replies alone."""
        for node, partition in claimed.items():
            self.row(node, partition)["claimed_partition"] = partition

    def row(self, node: int, partition: int | None) -> dict:
        """``node``'s row; a new one goes on from the row its partition (or node id) had before a resume."""
        if node not in self.rows:
            row = self.carried.pop(f"partition {partition}", None) if partition is not None else None
            row = (
                row or self.carried.pop(f"node {node}", None) or {"rounds": 0, "accepted": 0, "streak": 0, "longest": 0}
            )
            self.rows[node] = row
        return self.rows[node]

    def state(self) -> dict:
        """What the checkpoint keeps, so that a resumed run goes on counting."""
        rows = dict(self.carried)
        for node, row in self.rows.items():
            partition = self.partition(node, row)
            rows[f"partition {partition}" if partition is not None else f"node {node}"] = row
        return {"rounds_noted": self.rounds_noted, "rows": rows}

    def carry(self, state: dict) -> None:
        """A checkpoint's ``state()``: the rows of the run resumed."""
        self.rounds_noted = state.get("rounds_noted", 0)
        self.carried = {key: dict(row) for key, row in state.get("rows", {}).items()}

    def partition(self, node: int | None, row: dict) -> int | None:
        """A node's partition: as the algorithm knows it, else as its rejected replies claimed."""
        known = self.partition_of(node) if node is not None else None
        return known if known is not None else row.get("claimed_partition")

    def excluded(self) -> list[str]:
        """The nodes this run left out, one line each: asked in every round and never aggregated, or not
        aggregated in ``max-consecutive-rejections`` consecutive rounds it was asked (0: only the former). A
        node sampled in a round or two and failing there (a worker restarting) is not left out: it is counted
        in those rounds' records (``rejected``)."""
        k, out = self.max_consecutive, []
        rows = [(f"node {node}", node, row) for node, row in sorted(self.rows.items())]
        rows += [(key, None, row) for key, row in sorted(self.carried.items())]  # not back since
        for name, node, row in rows:
            never = 0 < row["rounds"] == self.rounds_noted and row["accepted"] == 0
            if never or (k and row["longest"] >= k):
                partition = self.partition(node, row)
                if node is not None and partition is not None:
                    name += f" (partition {partition})"
                out.append(f"{name}: not aggregated in {row['rounds'] - row['accepted']} of {row['rounds']} rounds "
                           f"({row['longest']} in a row; last: {row.get('last_reason', 'none')})")  # fmt: skip
        return out
