"""The round computed inside the ClientApp process: Flower's simulation engine.

Per-node state (ParaBlock's pending update and the version it sits on) lives
in ``context.state``, because one Ray actor serves many virtual nodes. The
model is loaded once per actor (``node.resources``). There is no network to
overlap with here: the client trains round r from ``x^{r-2} + Δ^{r-1}`` and
corrects at the end (the ``at-end`` mode), and the saving is modeled.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from .. import core, node
from ..config import RunConfig
from ..records import to_record, to_tensors
from ..replica import StepLog, catch_up_steps, resumed_pending
from ..runtime import setup_torch


def load_pending(state: RecordDict) -> core.PendingUpdate | None:
    if "pending" not in state.config_records:
        return None
    meta = state["pending"]
    return core.PendingUpdate(block=int(meta["block"]), base_version=int(meta["base-version"]),
                              delta=to_tensors(state["pending-delta"]))


def save_pending(state: RecordDict, pending: core.PendingUpdate) -> None:
    state["pending"] = ConfigRecord({"block": pending.block, "base-version": pending.base_version})
    state["pending-delta"] = to_record(pending.delta)


def train_inline(msg: Message, context: Context) -> Message:
    """Round r: train ``b_r``; for ParaBlock from ``x^{r-2} + Δ^{r-1}``, then correct."""
    cfg = RunConfig.from_flower(context.run_config)
    setup_torch(cfg)
    res = node.resources(cfg, context.run_id)
    round_cfg = msg.content["round"]
    server_round, block = int(round_cfg["server-round"]), int(round_cfg["block"])
    partition_id = int(context.node_config.get("partition-id", 0))
    num_partitions = int(context.node_config.get("num-partitions", 1))
    step_log = StepLog(round_cfg["run-dir"])
    # A full resync ("sync-values") is not needed here: the server's step log covers every version.
    records = {name: to_tensors(msg.content[name]) for name in ("global-step", "catch-up", "resume-pending")
               if name in msg.content.array_records}
    steps = catch_up_steps(round_cfg, records)
    from_log = []

    def fetch_step(version: int):
        """Steps come with the message; older ones (this actor is behind) from the server's log."""
        if version in steps:
            return steps[version]
        from_log.append(version)
        return step_log.read(version)

    parablock = round_cfg["algorithm"] == "parablock"
    if parablock:
        pending = resumed_pending(round_cfg, records) or load_pending(context.state)
        base_version, pending = core.parablock_base(pending, server_round)
    else:
        base_version, pending = server_round - 1, None
    res.replica.advance_to(base_version, fetch_step)
    result = node.compute_update(res, cfg, server_round, block, pending, base_version, partition_id,
                                 num_partitions)

    content = RecordDict({
        "update": to_record(result.delta),
        "metrics": MetricRecord({**node.update_metrics(result, server_round, block, partition_id, base_version),
                                 "steps-from-log": len(from_log)}),
    })
    if parablock:
        save_pending(context.state, core.correct(block, result.delta, server_round))
        if cfg.verify_invariant:  # y after the correction is x^{r-1} + Δ^r
            res.replica.advance_to(server_round - 1, fetch_step)
            content["trace"] = ConfigRecord(
                {"local-model-sha256": core.digest_after(res.replica.params, res.partition.all_names(), result.delta)})
    return Message(content=content, reply_to=msg)
