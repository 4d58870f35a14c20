"""What the server knows of each node's copy of the model, and what it sends to keep it exact.

A node that answered round r (and whose reply was accepted) holds ``x^{r-1}``.
Any other node (not sampled, failed, rejected, restarted, new) gets with its
next message either the global steps it missed (``catch-up``) or, when it
missed more steps than there are blocks or must drop its own state, the values
of every block (a full sync, ``sync-values``). A full sync carries
``x^{r-2}`` and lets ``g^{r-1}`` (in every message) move it to ``x^{r-1}``: the
node can then show ``x^{r-2}`` again exactly, which is what a ParaBlock client
handed back its own ``Δ_i^{r-1}`` after a server restart trains from.

A resumed deployment is a new Flower run, which every node worker starts at ``x^0`` (a worker restarted or
not: its copy belongs to the run). So there (``values_on_resume``) each node whose version the stopped server
knew gets ``x``'s values with its first message, keeping its own state (its error-feedback residuals), instead
of the steps it would need from that version: the resumed run's bits are the uninterrupted run's. A
simulation's nodes catch up from the step log on the server's disk, so they get the steps.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from .. import core
from ..messages import CATCH_UP, NODE, RESUME_PENDING, SYNC_VALUES, PartitionAnswer, catch_up_name
from ..records import to_record
from ..replica import StepLog


@dataclass
class SyncParts:
    """What one node's message carries to keep its copy exact: ``RoundConfig`` fields and records of tensors."""

    fields: dict = field(default_factory=dict)  # RoundConfig's field name -> value
    records: dict[str, ArrayRecord] = field(default_factory=dict)  # record name -> its tensors
    catch_up_steps: int = 0
    full_sync: bool = False
    keeps_state: bool = False  # x's values after a resume: the node keeps its own state (the module's docstring)


class NodeSync:
    """Node versions and partitions; the catch-up, full sync and resume hand-back of each message."""

    def __init__(self, global_params: core.Tensors, num_blocks: int, step_log: StepLog, transfer_dtype: str = "fp32"):
        self.global_params = global_params
        self.num_blocks = num_blocks
        self.step_log = step_log
        self.transfer_dtype = transfer_dtype  # steps travel rounded to it already: encoding them is lossless
        self.versions: dict[int, int] = {}  # node id -> global version its model holds (absent: unknown)
        self.partitions: dict[int, int] = {}  # node id -> partition id, from accepted replies or a QUERY
        self.needs_full_sync: set[int] = set()  # nodes whose own state must be dropped
        self.resume_pending: dict[int, core.PendingUpdate] = {}  # partition id -> Δ_i^R to hand back
        self.first_round = 1
        # The values block b_{r-1} had before g^{r-1}: x^{r-2} = x^{r-1} with these put back.
        self.before_last_step: core.Tensors = {}
        self._full_sync: tuple[int, ArrayRecord | None] = (0, None)  # (round, its full-sync record)
        # A resumed run: what the stopped server knew, by partition (node ids change across a restart),
        # taken up by each node once its partition is known: partition -> version, None for a full sync.
        self.carried: dict[int, int | None] = {}
        self.values_on_resume = False  # a deployment: the carried nodes get x's values (the module's docstring)
        self.resync: set[int] = set()  # nodes to get them with their next message

    # ------------------------------------------------------------ what the server learns
    def accepted(self, node: int, server_round: int, partition_id: int) -> None:
        """An accepted round-r reply: the node holds ``x^{r-1}``."""
        self.versions[node] = server_round - 1
        self.partitions[node] = partition_id
        self.needs_full_sync.discard(node)
        self.resync.discard(node)

    def failed(self, node: int) -> None:
        """An error or a rejected reply: the node's state is unknown; it starts over from a full sync.
        (An error reply that says its state is intact does not call this: ``messages.STATE_INTACT``.)"""
        self.versions.pop(node, None)
        self.needs_full_sync.add(node)
        self.resync.discard(node)

    def applied(self, before: core.Tensors) -> None:
        """``g^r`` was just applied to ``x`` (``core.apply_step_keeping``); ``before`` holds the values it
        replaced, which a full sync of round r+1 sends. Round r's messages are all out by then: its
        full-sync record (a copy of every trainable tensor) is freed."""
        self._full_sync = (0, None)
        self.before_last_step = before

    # ------------------------------------------------------------ across a resume
    def by_partition(self) -> dict:
        """For the checkpoint: each node's known version and whether it needs a full sync, by partition,
        so that a resumed server syncs each node as the stopped one would have (a node rejected in the
        last round before the stop still drops its own state, residuals included)."""
        out = {str(p): v for p, v in self.carried.items() if v is not None}
        out.update({str(self.partitions[n]): v for n, v in self.versions.items() if n in self.partitions})
        full = {p for p, v in self.carried.items() if v is None}
        full |= {self.partitions[n] for n in self.needs_full_sync if n in self.partitions}
        return {"versions": out, "full_sync": sorted(full)}

    def carry(self, state: dict) -> None:
        """A resumed run: the stopped server's ``by_partition``."""
        self.carried = {int(p): int(v) for p, v in state.get("versions", {}).items()}
        self.carried.update({int(p): None for p in state.get("full_sync", [])})

    def adopt(self, node: int) -> None:
        """The first message to ``node`` in a resumed run: what the stopped server knew of its partition."""
        if node in self.partitions and self.partitions[node] in self.carried:
            version = self.carried.pop(self.partitions[node])
            if node in self.versions or node in self.needs_full_sync:
                return  # learnt in this run already
            if version is None:
                self.needs_full_sync.add(node)
            elif self.values_on_resume:
                self.resync.add(node)
            else:
                self.versions[node] = version

    # ------------------------------------------------------------ what a message carries
    def parts_for(self, server_round: int, node: int) -> SyncParts:
        """Catch-up or full sync, and any resume hand-back, for ``node``'s round-r message."""
        self.adopt(node)
        pending = self.pending_to_hand_back(server_round, node)
        missed = list(range(self.versions.get(node, 0) + 1, server_round - 1))
        pruned = any(not self.step_log.has(version) for version in missed)  # snapshot-every dropped them
        # x's values after a resume, the node's own state kept (the module's docstring); a hand-back or a dropped
        # state takes a full sync instead
        keeps_state = node in self.resync and node not in self.needs_full_sync and pending is None
        full = not keeps_state and (node in self.needs_full_sync or (
            server_round >= 2
            # A hand-back comes with x^{r-2}'s values: a fresh process (a restarted worker) computes from them.
            and (len(missed) > self.num_blocks or pruned or pending is not None)
        ))  # fmt: skip
        parts = SyncParts()
        if (full or keeps_state) and server_round >= 2:
            parts.fields["sync_version"] = server_round - 2
            parts.records[SYNC_VALUES] = self.full_sync_record(server_round)
            parts.full_sync, parts.keeps_state = True, keeps_state
            if keeps_state:
                parts.fields["sync_keeps_state"] = True
        elif missed:
            steps = {version: self.step_log.read(version) for version in missed}
            parts.fields["catch_up_versions"] = tuple(missed)
            parts.fields["catch_up_blocks"] = tuple(steps[v][0] for v in missed)
            parts.records[CATCH_UP] = to_record(
                {catch_up_name(v, n): t for v in missed for n, t in steps[v][1].items()}, self.transfer_dtype
            )
            parts.catch_up_steps = len(missed)
        if pending is not None:
            parts.fields["resume_pending_block"] = pending.block
            parts.fields["resume_pending_version"] = pending.base_version
            parts.records[RESUME_PENDING] = to_record(pending.delta)
        return parts

    def full_sync_record(self, server_round: int) -> ArrayRecord:
        """Round r's full sync (``x^{r-2}``), built once and shared by every message of the round
        that carries one: the server holds one copy of ``x`` for them, not one per node."""
        if self._full_sync[0] != server_round:
            self._full_sync = (server_round, None)  # the previous round's copy is freed first
            self._full_sync = (server_round, to_record(self.values_before_last_step()))
        return self._full_sync[1]

    def values_before_last_step(self) -> core.Tensors:
        """``x^{r-2}`` while the server holds ``x^{r-1}``: every block's exact values."""
        return {n: self.before_last_step.get(n, t) for n, t in self.global_params.items()}

    def pending_to_hand_back(self, server_round: int, node: int) -> core.PendingUpdate | None:
        """In the first round after a resume: the node's own ``Δ_i^R``, by its partition id.

        It computes round R+1 from ``x^{R-1} + Δ_i^R``, as it would have without the restart.
        A client with none (it sat out round R) resynchronises, as it would have.
        """
        if server_round != self.first_round or node not in self.partitions:
            return None
        pending = self.resume_pending.get(self.partitions[node])
        return pending if pending is not None and pending.base_version == server_round - 2 else None


def ask_partitions(grid: Grid, nodes: list[int], timeout: float) -> dict[int, int]:
    """Node id -> data partition id, asked with a QUERY message (a resumed server maps its new
    node ids to the clients' checkpointed updates with it: node ids change, partitions do not)."""
    messages = [Message(RecordDict(), n, MessageType.QUERY, ttl=timeout) for n in nodes]
    answers = {}
    for msg in grid.send_and_receive(messages, timeout=timeout):
        answer = None if msg.has_error() else PartitionAnswer.from_record(msg.content.metric_records.get(NODE))
        if answer is not None:
            answers[msg.metadata.src_node_id] = answer.partition_id
    return answers


def seeded_sample(nodes: list[int], fraction: float, seed: int) -> list[int]:
    """``fraction`` of ``nodes`` (at least one), sorted, the same for the same seed."""
    if fraction >= 1.0:
        return nodes
    k = max(1, math.ceil(fraction * len(nodes)))
    return sorted(random.Random(seed).sample(nodes, k))
