"""No node silently left out: per node, the rounds it was asked, aggregated, and not aggregated in a row, so
that the run names at its end (``excluded``: ``status.json``, the last line) each node it never aggregated or
lost for ``max-consecutive-rejections`` rounds in a row. A resumed run goes on counting (``state``, ``carry``)."""

from __future__ import annotations

from collections.abc import Callable


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
