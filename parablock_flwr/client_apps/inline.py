"""The client round computed inside the ClientApp process: Flower's simulation engine.

Per-node state (ParaBlock's pending update and the version it sits on) lives
in ``context.state``, because one Ray actor serves many virtual nodes. The
model is loaded once per actor (``node.resources``). There is no network to
overlap with here: the round runs inline (``node.train_round``, the same as in
the node worker), correcting at the end (``at-end``) or, with ``on-receipt``, after
the first local step (the aggregate came with the message), and the saving is modeled.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from .. import core, node
from ..config import RunConfig
from ..node_data import NodeSettings
from ..records import to_record, to_tensors
from ..replica import StepLog, catch_up_steps, resumed_pending
from ..runtime import setup_torch
from ..strategies import client_half


def load_pending(state: RecordDict) -> core.PendingUpdate | None:
    if "pending" not in state.config_records:
        return None
    meta = state["pending"]
    return core.PendingUpdate(
        block=int(meta["block"]), base_version=int(meta["base-version"]), delta=to_tensors(state["pending-delta"])
    )


def save_pending(state: RecordDict, pending: core.PendingUpdate | None) -> None:
    if pending is None:
        for key in ("pending", "pending-delta"):
            if key in state:
                del state[key]
        return
    state["pending"] = ConfigRecord({"block": pending.block, "base-version": pending.base_version})
    state["pending-delta"] = to_record(pending.delta)


def _open(msg: Message, context: Context, records: tuple[str, ...]):
    """What every message needs: the run config, this actor's resources for the node, the round's
    config, and a step fetcher: steps come with the message, older ones (this actor is behind)
    from the server's log (the versions it read are appended to the returned list)."""
    cfg = RunConfig.from_flower(context.run_config)
    setup_torch(cfg)
    resources = node.resources(cfg, context.run_id, NodeSettings.from_node_config(context.node_config))
    round_cfg = msg.content["round"]
    arrays = {name: to_tensors(msg.content[name]) for name in records if name in msg.content.array_records}
    steps = catch_up_steps(round_cfg, arrays)
    step_log, from_log = StepLog(round_cfg["run-dir"]), []

    def fetch_step(version: int):
        if version in steps:
            return steps[version]
        from_log.append(version)
        return step_log.read(version)

    return cfg, resources, round_cfg, arrays, step_log, fetch_step, from_log


def train_inline(msg: Message, context: Context) -> Message:
    """Round r of the algorithm named in the message, for the node this context belongs to."""
    # The values of a full sync are not needed here (the server's step log covers every
    # version); what a full sync means for the node's own state is: drop it.
    cfg, resources, round_cfg, records, step_log, fetch_step, from_log = _open(
        msg, context, ("global-step", "catch-up", "resume-pending")
    )
    server_round, block = int(round_cfg["server-round"]), int(round_cfg["block"])
    partition_id = int(context.node_config.get("partition-id", 0))
    num_partitions = int(context.node_config.get("num-partitions", 1))
    # Behind a pruned step log (snapshot-every): start again from a snapshot. ParaBlock needs x^{r-2} next.
    step_log.rebase_if_pruned(resources.replica, server_round - 2)
    pending = resumed_pending(round_cfg, records)
    if "sync-version" in round_cfg:  # a full sync: the node's own state goes, its residuals too
        for key in [k for k in context.state if k.startswith("residual-")]:
            del context.state[key]
    elif pending is None:
        pending = load_pending(context.state)
    residual_key = f"residual-{block}"  # error feedback of transfer-dtype, one record per block trained
    residuals = {block: to_tensors(context.state[residual_key])} if residual_key in context.state else {}
    done = node.train_round(
        resources,
        cfg,
        client_half(str(round_cfg["algorithm"]), cfg.correction_mode),
        server_round,
        block,
        pending,
        fetch_step,
        partition_id,
        num_partitions,
        residuals,
    )
    save_pending(context.state, done.kept)
    if block in residuals:
        context.state[residual_key] = to_record(residuals[block])
    metrics = node.update_metrics(done.result, server_round, block, partition_id, done.base_version)
    if (version := node.evaluation_due(round_cfg)) is not None:  # x^{r-1}: the replica holds it now
        metrics.update(node.evaluate_replica(resources, cfg, version, bool(round_cfg.get("evaluate-generate", 0))))
    content = RecordDict(
        {
            "update": to_record(done.result.delta, cfg.transfer_dtype),
            "metrics": MetricRecord({**metrics, "steps-from-log": len(from_log)}),
        }
    )
    if done.trace:
        content["trace"] = ConfigRecord(done.trace)
    return Message(content=content, reply_to=msg)


def evaluate_inline(msg: Message, context: Context) -> Message:
    """``evaluation = "clients"`` after the last round: this node's held-out loss of ``x^R``."""
    cfg, resources, round_cfg, _, step_log, fetch_step, _ = _open(msg, context, ("global-step", "catch-up"))
    version = int(round_cfg["evaluate-version"])
    step_log.rebase_if_pruned(resources.replica, version - 1)
    resources.replica.advance_to(version, fetch_step)
    metrics = node.evaluate_replica(resources, cfg, version, bool(round_cfg.get("evaluate-generate", 0)))
    metrics["partition-id"] = int(context.node_config.get("partition-id", 0))
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
