"""The simulation's adapter of the node runtime (``node.Node``): the round runs inside this ClientApp.

One Ray actor serves many virtual nodes, so a node's state (``node.state.NodeState``) is loaded into the
runtime and stored back around each message: its pending update and the residuals of ``transfer-dtype``
on disk, under ``RUN_DIR/node-state/partition-P`` (``node.state.PendingStore``, ``ResidualStore``: read
only by the actor that serves the node in a round, and of the residuals only the round's block), and
the last round it answered in ``context.state`` (one number: Flower keeps every node's context in its own
process, so nothing there may grow with a block). The model is loaded once per actor
(``node.resources``). There is no network to overlap with: the computation runs here, in the handler
(correcting at the end, or with ``on-receipt`` after the first local step, the aggregate having come
with the message). The actor's replica catches up from the server's step log (``RUN_DIR/global-steps``)
when another node moved it on (``context.state`` starts empty in a resumed run: the server hands the
pending update back, the residuals come from the resumed folder). A failure replies an error;
``state-intact: `` leads its reason when the node's state is as it was.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from .. import kept_blocks, node
from ..config import RunConfig
from ..messages import (
    BLOCK_RECORDS,
    EVALUATE,
    METRICS,
    OFFER,
    ROUND,
    STATE_INTACT,
    STREAM_UNUSABLE,
    TRACE,
    TRAIN,
    UPDATE,
    MessageError,
    TransportOffer,
    metrics_to_record,
)
from ..node.settings import NodeSettings, error_line, partition_of
from ..node.state import NodeState, PendingStore, ResidualStore
from ..records import to_record, to_tensors
from ..replica import StepLog
from ..runtime import setup_torch
from . import error_reply

log = logging.getLogger(__name__)


def node_folder(run_dir: str, partition_id: int) -> Path:
    """Where a virtual node's state lives between its rounds (each actor that serves it reads it there)."""
    return Path(run_dir) / "node-state" / f"partition-{partition_id}"


def load_state(state: RecordDict, folder: Path, block: int, keeps_residuals: bool) -> NodeState:
    """The node's state as its previous message in this run left it: its pending update and (of the
    residuals, only ``block``'s, the one this round can change) from ``folder``, its last round from
    ``context.state``."""
    record = NodeState.CONTEXT_RECORD
    last_round = int(state[record][NodeState.LAST_ROUND]) if record in state.config_records else 0
    if last_round == 0:  # its first message in this run: what the folder holds is an earlier run's
        return NodeState()
    residuals = ResidualStore(folder).as_of(last_round, only=block) if keeps_residuals else {}
    return NodeState(PendingStore(folder).load(), residuals, last_round)


def store_state(state: RecordDict, folder: Path, before: NodeState, after: NodeState, transfer_dtype: str) -> None:
    """Store the node's state back: its pending update where it changed (the residuals were written by
    the runtime as they changed), its last round."""
    if after.pending is not before.pending:
        PendingStore(folder).save(after.pending, transfer_dtype)
    state[NodeState.CONTEXT_RECORD] = ConfigRecord({NodeState.LAST_ROUND: after.last_round})


def train_inline(msg: Message, context: Context) -> Message:
    """Round r of the algorithm named in the message, for the node this context belongs to."""
    return _handle(msg, context, TRAIN)


def evaluate_inline(msg: Message, context: Context) -> Message:
    """``evaluation = "clients"`` after the last round: this node's held-out loss of ``x^R``."""
    return _handle(msg, context, EVALUATE)


def _handle(msg: Message, context: Context, op: str) -> Message:
    try:
        content = _run(msg, context, op)
    except node.StateIntact as err:
        log.warning("%s not done, state intact: %s", op, err)
        return error_reply(msg, f"{STATE_INTACT}{err}")
    except Exception as err:
        log.exception("%s failed", op)
        return error_reply(msg, error_line(err))
    finally:
        kept_blocks.KEPT.trim()  # once a message: the actor keeps what the last one freed, for the next node's round
    return Message(content=content, reply_to=msg)


def offered_the_stream(msg: Message) -> bool:
    """``transport = "direct"`` reaching a node that runs its rounds here, without a node worker: it moves
    nothing on the stream. Records offered there make the round an error, state intact (the server then
    sends this node its records inline); an update it may upload goes inline, counted as a fallback."""
    if OFFER not in msg.content.config_records:
        return False
    try:
        offer = TransportOffer.from_config(dict(msg.content[OFFER]))
    except MessageError as err:
        raise node.StateIntact(str(err)) from None
    if offer.records:
        raise node.StateIntact(f"{STREAM_UNUSABLE}this node runs its rounds in its ClientApp, without a node worker")
    return True


def _run(msg: Message, context: Context, op: str) -> RecordDict:
    cfg = RunConfig.from_flower(context.run_config)
    fell_back = offered_the_stream(msg)
    setup_torch(cfg)
    res = node.resources(cfg, context.run_id, NodeSettings.from_node_config(context.node_config))
    partition_id, num_partitions = partition_of(context.node_config)
    # A full sync's values are decoded too: the step log covers every version, but only they repair this
    # actor's replica once it is lost (ReplicaLost), for every node it serves.
    arrays = {name: to_tensors(msg.content[name]) for name in BLOCK_RECORDS if name in msg.content.array_records}
    req = node.Request.parse(op, context.run_id, msg.content[ROUND], arrays, partition_id, num_partitions)
    step_log, from_log = StepLog(req.run_dir), []

    def fetch_step(version: int):  # the message's steps, else (this actor is behind) the server's log
        if version in req.steps:
            return req.steps[version]
        from_log.append(version)
        return step_log.read(version)

    folder = node_folder(req.run_dir, partition_id)
    before = load_state(context.state, folder, req.block, cfg.transfer_dtype != "fp32")
    runtime = node.Node(dataclasses.replace(before))
    if op == EVALUATE:
        step_log.rebase_if_pruned(res.replica, req.evaluate_version - 1)
        done = runtime.evaluate(res, cfg, req, fetch_step)
        store_state(context.state, folder, before, runtime.state, cfg.transfer_dtype)
        return RecordDict({METRICS: MetricRecord(done.metrics.to_record())})
    # Behind a pruned step log (snapshot-every): start again from a snapshot. ParaBlock needs x^{r-2} next.
    step_log.rebase_if_pruned(res.replica, req.server_round - 2)
    store = resumed = None
    if cfg.transfer_dtype != "fp32":
        store = ResidualStore(folder)
        if req.resumed_after is not None:
            resumed = ResidualStore(resumed_node_folder(req, partition_id))
    done = runtime.train(res, cfg, req, fetch_step, store, resumed)
    store_state(context.state, folder, before, runtime.state, cfg.transfer_dtype)
    metrics = dataclasses.replace(done.metrics, steps_from_log=len(from_log), process_id=os.getpid(),
                                  direct_fallbacks=1 if fell_back else None)  # fmt: skip
    content = RecordDict(
        {UPDATE: to_record(done.update, cfg.transfer_dtype), METRICS: MetricRecord(metrics_to_record(metrics))}
    )
    if done.trace:
        content[TRACE] = ConfigRecord(done.trace)
    return content


def resumed_node_folder(req: node.Request, partition_id: int) -> Path:
    """This node's folder in the resumed run (``node_folder``), where the server says that run is (a
    relative ``resume-from`` is the server's to resolve: this actor's working directory is another). Its
    ``node-state/`` not there: the node fails, naming it, rather than start its residuals from zero."""
    folder = node_folder(req.resume_dir, partition_id)
    if not req.resume_dir or not folder.parent.is_dir():
        raise node.ResidualsMissing(
            f"resume-dir={req.resume_dir!r}: this node cannot see the resumed run's node-state/ folder "
            f"(expected the residuals of the run resumed after round {req.resumed_after} there)"
        )
    return folder
