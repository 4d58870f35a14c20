"""Sequential federated block coordinate descent, the base of every block strategy.

The server keeps the global model ``x``. Round r: send each client the
previous global step ``g^{r-1} = η_s Δ̄^{r-1}`` (block-sized) and the block
``b_r``; clients reply ``Δ_i^r`` (block-sized); the server checks each reply,
aggregates the valid ones and applies ``x^r[b_r] = x^{r-1}[b_r] + g^r``.
What distinguishes ParaBlock is on the client (it computes round r from a
one-round-stale model while round r-1's exchange travels); the server side
differs only in the time model and the invariant check (see ``parablock.py``).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from .. import core
from ..checkpoint import Checkpoint, clear_staged_pending, save_checkpoint
from ..metrics import RunRecorder, round_line
from ..records import to_record, to_tensors
from ..replica import StepLog

log = logging.getLogger("parablock_flwr")


class TooFewReplies(RuntimeError):
    """A round kept fewer valid replies than ``min-accepted-replies``: the run stops."""


class FedBCD(Strategy):
    """Federated BCD: one block per round, every client, no overlap.

    Override points (stable signatures, see docs/extending.md):
    ``choose_block``, ``select_nodes``, ``round_config``, ``add_catch_up``, ``check_reply``,
    ``client_weight``, ``combine``, ``server_update``, ``extra_round_metrics``,
    ``record_round``, ``state_dict``/``load_state_dict``.
    """

    algorithm = "fedbcd"
    overlapped = False  # does a round cost max(compute, comm) instead of their sum?

    def __init__(
        self,
        *,
        global_params: dict[str, torch.Tensor],
        partition: core.BlockPartition,
        schedule: list[int],
        run_dir: Path,
        server_lr: float = 1.0,
        weighting: str = "examples",
        link: core.LinkModel = core.LinkModel(20.0, 20.0, 50.0),
        verify_invariant: bool = False,
        fraction_train: float = 1.0,
        min_available_nodes: int = 1,
        seed: int = 0,
        max_update_norm: float = 0.0,
        min_accepted_replies: int = 1,
        on_too_few_replies: str = "retry",
        max_round_retries: int = 2,
    ):
        self.global_params = global_params
        self.partition = partition
        self.schedule = schedule
        self.run_dir = Path(run_dir)
        self.server_lr = server_lr
        self.weighting = weighting
        self.link = link
        self.verify_invariant = verify_invariant
        self.fraction_train = fraction_train
        self.min_available_nodes = min_available_nodes
        self.seed = seed
        self.max_update_norm = max_update_norm
        self.min_accepted_replies = min_accepted_replies
        self.on_too_few_replies = on_too_few_replies
        self.max_round_retries = max_round_retries
        self.step_log = StepLog(run_dir)
        self.recorder = RunRecorder(run_dir)
        self._round: dict = {}
        self._started = time.perf_counter()
        self._modeled_wall_s = 0.0
        self._num_rounds = len(schedule)
        self._blocks: dict[int, int] = {}
        # The global version each node's model holds, learned from its replies (0: unknown).
        self.node_versions: dict[int, int] = {}
        self.first_round = 1  # R+1 when resumed from round R's checkpoint
        self.resume_pending: dict[int, core.PendingUpdate] = {}  # partition id -> Δ_i^R to hand back
        self.node_partitions: dict[int, int] = {}  # node id -> partition id, asked when resuming

    # ---------------------------------------------------------------- policy
    def block_for_round(self, server_round: int) -> int:
        """``b_r``, decided once by ``choose_block`` and remembered.

        ParaBlock tells clients ``b_{r+1}`` in round r (so that a node worker
        can start it early), i.e. before round r is aggregated: the choice
        must not change afterwards.
        """
        if server_round not in self._blocks:
            block = self.choose_block(server_round)
            if not 0 <= block < self.partition.num_blocks:
                raise ValueError(f"choose_block({server_round}) = {block}: expected 0..{self.partition.num_blocks - 1}")
            self._blocks[server_round] = block
        return self._blocks[server_round]

    def choose_block(self, server_round: int) -> int:
        """Override point: the block of round r. Called during round r-1 (before
        its aggregation) for r >= 2. Default: the seeded schedule."""
        return self.schedule[server_round - 1]

    def select_nodes(self, server_round: int, grid: Grid) -> list[int]:
        """A seeded sample of ``fraction-train`` of the connected nodes (at least one),
        once at least ``min-available-nodes`` are connected.

        A ParaBlock client that sat out round r-1 holds a pending update that is
        already aggregated (or was rejected): on its return it is resynchronised
        and trains from ``x^{r-1}`` (``core.parablock_base``), never counted twice.
        """
        _, available = sample_nodes(grid, self.min_available_nodes, sample_size=1)  # waits for enough nodes
        nodes = sorted(available)
        if self.fraction_train >= 1.0:
            return nodes
        k = max(1, math.ceil(self.fraction_train * len(nodes)))
        return sorted(random.Random(self.seed * 1_000_003 + server_round).sample(nodes, k))

    def round_config(self, server_round: int, block: int, step_block: int) -> ConfigRecord:
        """What every client is told this round; subclasses may add keys."""
        return ConfigRecord({
            "server-round": server_round,
            "block": block,
            "step-block": step_block,
            # Lets a node worker start the next round's computation before the next message.
            "next-block": self.block_for_round(server_round + 1) if server_round < self._num_rounds else -1,
            "algorithm": self.algorithm,
            "run-dir": str(self.run_dir),
        })

    def client_weight(self, metrics: MetricRecord) -> float:
        """``w_i``: number of local examples, or uniform."""
        return float(metrics["num-examples"]) if self.weighting == "examples" else 1.0

    def combine(self, updates: Iterable[core.Tensors], weights: list[float]) -> core.Tensors:
        """``Δ̄``: the weighted mean of the accepted updates.

        ``updates`` come one at a time (a generator, in partition order): a combiner
        that needs them all at once makes a list of them first.
        """
        return core.aggregate(updates, weights)

    def server_update(self, server_round: int, block: int, mean_update: core.Tensors) -> core.Tensors:
        """``g^r``, the step applied to ``x[b_r]`` and sent to every client: ``η_s Δ̄``.

        Whatever this returns is applied by the server and by every client with the
        same float operation, so any server optimizer keeps all copies identical.
        """
        return core.global_step(mean_update, self.server_lr)

    def state_dict(self) -> dict:
        """Override point: a subclass's own state (JSON-serialisable) for the checkpoint."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Override point: restore what ``state_dict`` returned."""

    # ---------------------------------------------------------- Flower hooks
    def summary(self) -> None:
        log.info("%s: %d blocks, schedule %s, server-lr %s, weighting %s", type(self).__name__,
                 self.partition.num_blocks, self.schedule, self.server_lr, self.weighting)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Send ``g^{r-1}`` (in ``arrays``, empty in round 1), ``b_r`` and any catch-up to each node."""
        self._round = {"started": time.perf_counter(), "catch_up_steps_sent": 0, "full_syncs_sent": 0,
                       "round_retries": 0}
        self._grid, self._global_step = grid, arrays  # kept for a retry of this round
        nodes = self.select_nodes(server_round, grid)
        if server_round == self.first_round and self.resume_pending:
            self.node_partitions = self.ask_partitions(grid, nodes)
        return self.train_messages(server_round, nodes)

    def train_messages(self, server_round: int, nodes: list[int]) -> list[Message]:
        """Round r's message to each node: ``g^{r-1}``, the blocks, the node's catch-up."""
        block = self.block_for_round(server_round)
        step_block = self.block_for_round(server_round - 1) if server_round > 1 else -1
        self._round["nodes"] = sorted(set(self._round.get("nodes", [])) | set(nodes))
        messages = []
        for node in nodes:
            content = RecordDict({"global-step": self._global_step,
                                  "round": self.round_config(server_round, block, step_block)})
            self.add_catch_up(content, server_round, node)
            self.add_resume_pending(content, server_round, node)
            messages.append(Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node))
        return messages

    def add_catch_up(self, content: RecordDict, server_round: int, node: int) -> None:
        """What a node needs besides ``g^{r-1}`` to hold ``x^{r-1}``: the steps it missed,
        or the values of every block when it missed more steps than there are blocks.

        A node missed steps when it was not sampled, its reply failed, it restarted, or
        it joined mid-run. The values are exact copies, so a full resync is bit-exact too.
        """
        missed = list(range(self.node_versions.get(node, 0) + 1, server_round - 1))
        if not missed:
            return
        if len(missed) <= self.partition.num_blocks:
            steps = {version: self.step_log.read(version) for version in missed}
            content["round"]["catch-up-versions"] = missed
            content["round"]["catch-up-blocks"] = [steps[v][0] for v in missed]
            content["catch-up"] = to_record({f"v{v}/{n}": t for v in missed for n, t in steps[v][1].items()})
            self._round["catch_up_steps_sent"] += len(missed)
        else:
            content["round"]["sync-version"] = server_round - 1
            content["sync-values"] = to_record(self.global_params)
            self._round["full_syncs_sent"] += 1

    def add_resume_pending(self, content: RecordDict, server_round: int, node: int) -> None:
        """In the first round after a resume: hand each client back its own ``Δ_i^R``.

        It computes round R+1 from ``x^{R-1} + Δ_i^R``, as it would have without the
        restart. A client with none (it sat out round R) resynchronises, as it would have.
        """
        pending = self.resume_pending.get(self.node_partitions.get(node, -1))
        if server_round != self.first_round or pending is None or pending.base_version != server_round - 2:
            return
        content["round"]["resume-pending-block"] = pending.block
        content["round"]["resume-pending-version"] = pending.base_version
        content["resume-pending"] = to_record(pending.delta)

    def ask_partitions(self, grid: Grid, nodes: list[int]) -> dict[int, int]:
        """Node id -> data partition id, asked with a QUERY message: node ids change when
        Flower restarts, partitions do not."""
        messages = [Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in nodes]
        replies = grid.send_and_receive(messages, timeout=self._timeout)
        return {m.metadata.src_node_id: int(m.content["node"]["partition-id"]) for m in replies
                if not m.has_error() and "node" in m.content.metric_records}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check each reply, aggregate the valid ones, apply ``g^r`` to ``x``, log ``g^r``."""
        block = self.block_for_round(server_round)
        names = self.partition.names(block)
        replies = list(replies)
        accepted, rejected = self.check_replies(server_round, block, replies)
        while len(accepted) < self.min_accepted_replies:
            more = self.retry_round(server_round, accepted, rejected)
            more_accepted, more_rejected = self.check_replies(server_round, block, more)
            replies, accepted, rejected = replies + more, accepted + more_accepted, rejected + more_rejected

        # Float sums depend on order and replies arrive in any order: sort them by the
        # client's stable partition id (node ids change from run to run).
        accepted.sort(key=lambda a: (int(a[0].get("partition-id", 0)), a[1].metadata.src_node_id))
        clear_staged_pending(self.run_dir)
        if accepted:
            updates = self.accepted_updates(server_round, block, accepted)
            mean = self.combine(updates, [self.client_weight(m) for m, _ in accepted])
            step = self.server_update(server_round, block, mean)
        else:  # nothing valid: x does not move, but clients still need a (zero) step to re-base on
            step = {n: torch.zeros_like(self.global_params[n]) for n in names}
        core.apply_step(self.global_params, step)
        self.step_log.write(server_round, block, step)

        self._round.update(self._round_metrics(server_round, block, step, accepted, replies, rejected))
        self._round.update(timeline_metrics(accepted))
        self._round.update(self.extra_round_metrics(server_round, accepted))
        summary = {k: v for k, v in self._round.items() if isinstance(v, (int, float)) and k != "started"}
        return to_record(step), MetricRecord(summary)

    def accepted_updates(self, server_round: int, block: int, accepted: list) -> Iterator[core.Tensors]:
        """Each accepted ``Δ_i^r`` in turn, its reply's arrays dropped once converted.

        ``combine`` consumes them one by one, so the default weighted mean holds the
        running sum and one update, not one per client. ``observe_update`` sees each
        update here first (ParaBlock's invariant check and checkpoint).
        """
        for metrics, msg in accepted:
            update = to_tensors(msg.content["update"])
            del msg.content["update"]
            self.observe_update(server_round, block, update, metrics, msg)
            yield update

    def observe_update(self, server_round: int, block: int, update: core.Tensors, metrics: MetricRecord,
                       msg: Message) -> None:
        """Every accepted update once, before it is combined: nothing to do in sequential BCD."""

    def check_replies(self, server_round: int, block: int, replies: list[Message]) -> tuple[list, list[dict]]:
        """Split replies into accepted ``(metrics, msg)`` and rejected ``{node, reason}``."""
        accepted, rejected = [], []
        for msg in replies:
            self.track_node_version(msg, server_round)
            reason = self.check_reply(msg, server_round, block)
            if reason is None:
                accepted.append((msg.content["metrics"], msg))
            else:
                node = msg.metadata.src_node_id
                log.warning("round %d: rejected the reply of node %d: %s", server_round, node, reason)
                rejected.append({"node": node, "reason": reason})
        return accepted, rejected

    def retry_round(self, server_round: int, accepted: list, rejected: list[dict]) -> list[Message]:
        """Too few valid replies: re-send the round to the nodes without one, or stop the run."""
        if self.on_too_few_replies == "stop" or self._round["round_retries"] >= self.max_round_retries:
            reasons = "; ".join(f"node {r['node']}: {r['reason']}" for r in rejected[-3:]) or "no replies"
            raise TooFewReplies(f"round {server_round}: {len(accepted)} valid replies, expected at least "
                                f"min-accepted-replies={self.min_accepted_replies} ({reasons})")
        self._round["round_retries"] += 1
        done = {m.metadata.src_node_id for _, m in accepted}
        nodes = [n for n in self._round["nodes"] if n not in done]
        log.warning("round %d: %d valid replies, fewer than min-accepted-replies=%d: re-sending to %d nodes "
                    "(retry %d of %d)", server_round, len(accepted), self.min_accepted_replies, len(nodes),
                    self._round["round_retries"], self.max_round_retries)
        return list(self._grid.send_and_receive(self.train_messages(server_round, nodes), timeout=self._timeout))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """No client-side evaluation: the server evaluates held-out loss itself."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's round loop, from ``first_round``: train, the server's evaluation, the round's
        record, the checkpoint. Clients never evaluate (the server does), so there is no
        client evaluation phase. ``initial_arrays`` is the step round ``first_round`` sends."""
        self._num_rounds, self._timeout = num_rounds, timeout
        self.summary()
        result, arrays = Result(), initial_arrays
        if self.first_round == 1:
            self._evaluate_and_record(0, arrays, evaluate_fn, result)
        for server_round in range(self.first_round, num_rounds + 1):
            replies = grid.send_and_receive(self.configure_train(server_round, arrays, ConfigRecord(), grid),
                                            timeout=timeout)
            arrays, train_metrics = self.aggregate_train(server_round, replies)
            result.arrays, result.train_metrics_clientapp[server_round] = arrays, train_metrics
            self._evaluate_and_record(server_round, arrays, evaluate_fn, result)
            self.save_checkpoint(server_round)
        return result

    def _evaluate_and_record(self, server_round: int, arrays: ArrayRecord, evaluate_fn, result: Result) -> None:
        metrics = evaluate_fn(server_round, arrays) if evaluate_fn else None
        if metrics is not None:
            result.evaluate_metrics_serverapp[server_round] = metrics
        self.record_round(server_round, dict(metrics or {}))

    # ------------------------------------------------------------ checkpoint and resume
    def save_checkpoint(self, server_round: int) -> None:
        """After round r is recorded: what a restarted server needs (``checkpoint.py``)."""
        save_checkpoint(self.run_dir, Checkpoint(
            round=server_round, blocks=dict(self._blocks),
            global_sha256=core.digest(self.global_params, self.partition.all_names()),
            elapsed_s=time.perf_counter() - self._started, modeled_wall_s=self._modeled_wall_s,
            strategy_state=self.state_dict()))

    def resume(self, from_run_dir: Path, ckpt: Checkpoint) -> ArrayRecord:
        """Continue the run in ``from_run_dir`` after its last complete round R (``ckpt``).

        ``x^R`` is rebuilt as ``x^0`` plus the logged steps (checked against the stored
        digest); the steps and the records of rounds 0..R are copied into this run's
        folder. Returns ``g^R``, the step that round R+1's message carries.
        """
        old_log = StepLog(from_run_dir)
        for version in range(1, ckpt.round + 1):
            block, step = old_log.read(version)
            core.apply_step(self.global_params, step)
            self.step_log.write(version, block, step)
        if core.digest(self.global_params, self.partition.all_names()) != ckpt.global_sha256:
            raise ValueError(f"resume-from={str(from_run_dir)!r}: x^0 plus the logged steps does not give the "
                             f"checkpointed x^{ckpt.round}; expected the same model files as the first run")
        for record in RunRecorder(from_run_dir).read():
            if record["round"] <= ckpt.round:
                self.recorder.write(record)
        self.first_round = ckpt.round + 1
        self._blocks = dict(ckpt.blocks)
        self._modeled_wall_s = ckpt.modeled_wall_s
        self._started = time.perf_counter() - ckpt.elapsed_s  # elapsed_s goes on where it stopped
        self.resume_pending = ckpt.pending
        self.load_state_dict(ckpt.strategy_state)
        log.info("Resumed from %s after round %d (%d pending client updates to hand back)", from_run_dir,
                 ckpt.round, len(ckpt.pending))
        return to_record(step)  # a checkpoint is written after round 1 at the earliest

    def track_node_version(self, msg: Message, server_round: int) -> None:
        """A node that answered round r holds ``x^{r-1}``; after an error its state is unknown."""
        node = msg.metadata.src_node_id
        if msg.has_error():
            self.node_versions.pop(node, None)
        else:
            self.node_versions[node] = server_round - 1

    # ------------------------------------------------------------ checking
    def check_reply(self, msg: Message, server_round: int, block: int) -> str | None:
        """Why a reply must not enter the aggregate, or None if it is valid."""
        if msg.has_error():
            return f"client error: {msg.error.reason}"
        content = msg.content
        if "update" not in content.array_records or "metrics" not in content.metric_records:
            return "missing 'update' arrays or 'metrics'"
        metrics = content["metrics"]
        for key in ("server-round", "block", "num-examples"):
            if key not in metrics:
                return f"missing metric {key!r}"
        if metrics["server-round"] != server_round:
            return f"stale round: reply is for round {metrics['server-round']}, expected {server_round}"
        if metrics["block"] != block:
            return f"wrong block id {metrics['block']}, expected {block}"
        if not metrics["num-examples"] > 0:
            return f"num-examples={metrics['num-examples']}, expected > 0"
        update = content["update"]
        expected = set(self.partition.names(block))
        if set(update) != expected:
            missing, extra = sorted(expected - set(update)), sorted(set(update) - expected)
            return f"wrong parameters: missing {missing[:3]}, unexpected {extra[:3]}"
        for name, array in update.items():
            want = tuple(self.global_params[name].shape)
            if tuple(array.shape) != want:
                return f"wrong shape for {name}: {tuple(array.shape)}, expected {want}"
            if array.dtype != "float32":
                return f"wrong dtype for {name}: {array.dtype}, expected float32"
            if not torch.isfinite(torch.from_numpy(array.numpy())).all():
                return f"non-finite values in {name}"
        if self.max_update_norm > 0:
            norm = math.sqrt(sum(float(torch.from_numpy(a.numpy()).double().square().sum()) for a in update.values()))
            if norm > self.max_update_norm:
                return f"update norm {norm:.4g} above max-update-norm={self.max_update_norm}"
        return None

    # ------------------------------------------------------------ metrics
    def _round_metrics(self, server_round, block, step, accepted, replies, rejected) -> dict:
        bytes_down = sum(t.numel() * 4 for t in step.values())  # g^r goes down next round
        ups = [bytes_down] * len(accepted)  # an accepted Δ_i^r has the block's shapes (check_reply)
        compute = [float(m["compute-s"]) for m, _ in accepted if "compute-s" in m]
        comm = [self.link.comm_seconds(u, bytes_down) for u in ups]
        sequential = core.modeled_round_seconds(compute, comm, overlapped=False)
        # Round 1 has nothing to overlap with yet.
        overlapped = core.modeled_round_seconds(compute, comm, overlapped=server_round > 1)
        modeled = overlapped if self.overlapped else sequential
        self._modeled_wall_s += modeled
        weights = [float(m["num-examples"]) for m, _ in accepted]
        losses = [float(m["train-loss"]) for m, _ in accepted]
        return {
            "round": server_round,
            "block": block,
            "block_label": self.partition.labels[block],
            "num_replies": len(replies),
            "num_accepted": len(accepted),
            "num_rejected": len(rejected),
            "rejected": rejected,
            "train_loss": sum(w * l for w, l in zip(weights, losses)) / sum(weights) if accepted else None,
            "bytes_up_per_client": sum(ups) / len(ups) if ups else 0,
            "bytes_down_per_client": bytes_down,
            "bytes_up_total": sum(ups),
            "bytes_down_total": bytes_down * len(replies),
            "compute_s_max": max(compute, default=0.0),
            "compute_s_mean": sum(compute) / len(compute) if compute else 0.0,
            "comm_s_modeled": max(comm, default=0.0),
            "modeled_round_s_sequential": sequential,
            "modeled_round_s_overlapped": overlapped,
            "modeled_round_s": modeled,
            "modeled_wall_s": self._modeled_wall_s,
            # Global steps the client processes replayed from the step log to catch up.
            "replica_steps_from_log": sum(int(m.get("steps-from-log", 0)) for m, _ in accepted),
        }

    def extra_round_metrics(self, server_round: int, accepted: list) -> dict:
        """Hook for subclasses: more numbers for the round's record."""
        return {}

    def record_round(self, server_round: int, evaluation: dict) -> None:
        """Log the round's line and append its record to ``metrics.jsonl``."""
        record = {"round": server_round, "algorithm": self.algorithm}
        if server_round > 0:
            record.update({k: v for k, v in self._round.items() if k != "started"})
            record["round_wall_s"] = time.perf_counter() - self._round["started"]
        record.update(evaluation)
        record["elapsed_s"] = time.perf_counter() - self._started
        if 0 < server_round < self._num_rounds:
            record["eta_s"] = record["elapsed_s"] / server_round * (self._num_rounds - server_round)
        self.recorder.write(record)
        log.info(round_line(record, self._num_rounds))


def timeline_metrics(accepted: list) -> dict:
    """The measured timeline of node workers (deployment only; empty in simulation).

    For round r on one node: the communication window runs from the reply of
    round r-1 leaving the worker to message ``F_r`` reaching it; the compute
    of ``Δ^r`` ran from ``compute-start`` to ``compute-end``. The overlap is
    the part of the window covered by compute; idle is the part after it.
    """
    rows = []
    for m, msg in accepted:
        if "compute-start" not in m:
            continue
        row = {"node": msg.metadata.src_node_id, **{k.replace("-", "_"): float(m[k]) for k in (
            "compute-start", "compute-end", "request-received", "prev-reply-sent", "waited-s",
            "correction-after-step")}}
        if m.get("prev-reply-sent", 0) > 0:
            window = row["request_received"] - row["prev_reply_sent"]
            covered = min(row["compute_end"], row["request_received"]) - max(row["compute_start"],
                                                                                row["prev_reply_sent"])
            row["comm_s"] = window
            row["overlap_share"] = max(0.0, covered) / window if window > 0 else 0.0
            row["idle_s"] = max(0.0, row["request_received"] - row["compute_end"])
        if "clientapp-imported-torch" in m:
            row["clientapp_imported_torch"] = int(m["clientapp-imported-torch"])
            row["clientapp_start_to_reply_s"] = float(m["clientapp-reply"]) - float(m["clientapp-start"])
        rows.append(row)
    if not rows:
        return {}
    out = {"timeline": rows}
    for key in ("comm_s", "overlap_share", "idle_s", "waited_s", "clientapp_start_to_reply_s"):
        values = [r[key] for r in rows if key in r]
        if values:
            out[f"measured_{key}"] = sum(values) / len(values)
    out["measured_compute_s"] = sum(r["compute_end"] - r["compute_start"] for r in rows) / len(rows)
    return out
