"""One round's numbers: what the server counted while running it, and the record it writes.

``RoundStats`` is filled as the round goes (messages, retries, rejections,
invariant checks); ``round_record`` turns it and the accepted replies into the
round's line in ``metrics.jsonl`` (bytes, measured compute, the time model, the
deployment timeline).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from .. import core
from ..messages import WORKER_LEGS, TrainMetrics
from ..wire import payload_bytes
from .reply_checks import Reply


@dataclass(frozen=True)
class Rejection:
    """A reply that is not in the round's step, and why (the round's record lists them)."""

    node: int
    reason: str
    partition_id: int | None = None  # its site, when the server knows it (``report --sites`` groups by it)


# The server's own work in a round, each in seconds (the record's ``server_<leg>``): the replies' checks as they
# came (the last one's on the critical path); then either the default weighted mean, the step rounded as it
# travels and ``x[b] + g`` with its finiteness check in one pass over the block (``one_pass_s``), or each apart
# (a subclass's combine or server_update, more replies than the spill holds in memory): the mean (each update
# decoded into the round's sum), the step's rounding and ``x[b] + g``. Each counts the updates read back and
# staged for the checkpoint; the rest of ``critical_path_aggregate_s`` is the run's bookkeeping. With differential
# privacy, ``privacy_s`` (before the one pass): any wait for the noise drawn ahead (each update's norm for its
# clipping is found as its reply is checked, in ``check_s``).
# ``one_pass_ahead_s``: the one pass run before the last reply, on updates that landed ahead of their replies (off
# the critical path: ``one_pass_s`` then holds any wait for it and the staging; ``one_pass_ahead`` counts it).
SERVER_LEGS = ("check_s", "one_pass_s", "combine_s", "step_rounding_s", "x_apply_s", "privacy_s", "one_pass_ahead_s")


@dataclass
class RoundStats:
    """Counters of one round, from its first message to its aggregation."""

    server_round: int
    started: float = field(default_factory=time.perf_counter)
    nodes: list[int] = field(default_factory=list)  # every node sent this round's message
    catch_up_steps_sent: int = 0
    full_syncs_sent: int = 0
    num_replies: int = 0
    wire_bytes_down: int = 0  # array bytes in this round's messages: g^{r-1}, catch-up, full syncs, hand-backs
    wire_bytes_up: int = 0  # array bytes in every reply received, accepted or not
    rejected: list[Rejection] = field(default_factory=list)
    invariant_checked: int = 0
    invariant_failed: int = 0
    state_intact_errors: int = 0  # error replies from nodes whose model state is intact (no full sync)
    one_pass_ahead: int = 0  # 1: the round's step came from its one pass run ahead (``fedbcd.server.PassAhead``)
    one_pass_ahead_dropped: int = 0  # 1: a pass ran ahead on other inputs than the accepted replies' (run again)
    update_norms_ahead: int = 0  # replies whose update's norm was found as it landed (``PassAhead.run_norms``)
    legs: dict[str, float] = field(default_factory=dict)  # SERVER_LEGS, timed as the round goes

    def counters(self) -> dict:
        out = asdict(self)
        for key in ("server_round", "started", "nodes", "legs"):
            out.pop(key)
        out["num_rejected"] = len(self.rejected)
        out.update({f"server_{leg}": seconds for leg, seconds in self.legs.items()})
        return out


def array_bytes(content) -> int:
    """The serialised bytes of every array a message carries (what Flower sends, framing aside)."""
    return sum(len(array.data) for record in content.array_records.values() for array in record.values())


def dropped_for_length(accepted: list[Reply], count: str = "dropped_examples") -> int:
    """Rows the round's nodes lost to ``max-seq-len`` (cut before their answer; with ``count`` =
    ``malformed_examples``: skipped as malformed): each node with its own data counts its own; nodes on
    partitions of the run's dataset all report that dataset's, once."""
    own = sum(getattr(r.metrics, count) or 0 for r in accepted if r.metrics.own_data == 1)
    shared = [getattr(r.metrics, count) or 0 for r in accepted if r.metrics.own_data != 1]
    return own + max(shared, default=0)


def reply_link(link: core.LinkModel, reply: Reply) -> core.LinkModel:
    """The time model of the path a reply's bytes took: a node that fell back to Flower's path is modeled
    on it, whatever the run's transport."""
    return replace(link, transport="flower") if reply.metrics.direct_fallbacks else link


def round_record(
    stats: RoundStats,
    block_label: str,
    block: int,
    step: core.Tensors,
    accepted: list[Reply],
    weights: list[float],
    link: core.LinkModel,
    overlapped: bool,
    transfer_dtype: str = "fp32",
) -> dict:
    """The round's numbers: replies, loss, bytes (as ``transfer_dtype`` sends them), measured compute,
    the modeled round time."""
    bytes_down = payload_bytes(step, transfer_dtype)  # g^r goes down next round
    ups = [r.payload_bytes for r in accepted]
    compute = [float(r.metrics.compute_s) for r in accepted]
    links = [reply_link(link, r) for r in accepted]
    comm = [node_link.comm_seconds(u, bytes_down) for node_link, u in zip(links, ups)]
    ahead = [node_link.ahead_seconds(u) if r.metrics.direct_update_ahead else 0.0
             for node_link, u, r in zip(links, ups, accepted)]  # fmt: skip
    sequential = core.modeled_round_seconds(compute, comm, overlapped=False)
    # Round 1 has nothing to overlap with yet.
    overlapped_s = core.modeled_round_seconds(compute, comm, overlapped=stats.server_round > 1, ahead_s=ahead)
    weights = [r.num_examples for r in accepted]
    losses = [float(r.metrics.train_loss) for r in accepted]
    return {
        "round": stats.server_round,
        "block": block,
        "block_label": block_label,
        **stats.counters(),
        "num_accepted": len(accepted),
        "train_loss": sum(w * x for w, x in zip(weights, losses)) / sum(weights) if accepted else None,
        "bytes_up_per_client": sum(ups) / len(ups) if ups else 0,
        "bytes_down_per_client": bytes_down,
        "bytes_up_total": sum(ups),
        "bytes_down_total": bytes_down * stats.num_replies,
        "compute_s_max": max(compute, default=0.0),
        "compute_s_mean": sum(compute) / len(compute) if compute else 0.0,
        "comm_s_modeled": max(comm, default=0.0),
        "modeled_round_s_sequential": sequential,
        "modeled_round_s_overlapped": overlapped_s,
        "modeled_round_s": overlapped_s if overlapped else sequential,
        # Global steps the client processes replayed from the step log to catch up.
        "replica_steps_from_log": sum(r.metrics.steps_from_log or 0 for r in accepted),
        # Each accepted client's weight: its own example count (node-local data) or its partition's size.
        "client_weights": [
            {"partition_id": r.partition_id, "num_examples": r.num_examples, "weight": w, "compute_s": c, "bytes_up": u}
            for r, w, c, u in zip(accepted, weights, compute, ups, strict=True)
        ],
        # Simulation: the process (a Ray actor, on any machine of the cluster) that computed each update.
        **served_by(accepted),
        "correction_drift_max": max((r.metrics.correction_drift or 0.0 for r in accepted), default=0.0),
        "truncated_examples": sum(r.metrics.truncated_examples or 0 for r in accepted),
        "oom_retries": sum(r.metrics.oom_retries or 0 for r in accepted),
        # The largest peak RSS of the processes that computed the round's updates (a site's sizing figure).
        "node_peak_rss_bytes_max": max((r.metrics.peak_rss_bytes or 0 for r in accepted), default=0),
        "dropped_examples": dropped_for_length(accepted),
        "malformed_examples": dropped_for_length(accepted, "malformed_examples"),
        **timeline_metrics(accepted),
    }


def served_by(accepted: list[Reply]) -> dict:
    """``served_by``: each accepted update's partition and the process id of the Ray actor that computed
    it (simulation replies carry ``process-id``): which actors, on which machines, did the work."""
    rows = [{"partition_id": r.partition_id, "process_id": r.metrics.process_id}
            for r in accepted if r.metrics.process_id is not None]  # fmt: skip
    return {"served_by": rows} if rows else {}


def timeline_metrics(accepted: list[Reply]) -> dict:
    """The measured timeline of node workers (deployment only; empty in simulation).

    For round r on one node: the communication window runs from the reply of
    round r-1 leaving the worker to message ``F_r`` reaching it; the compute
    of ``Δ^r`` ran from ``compute-start`` to ``compute-end``. The overlap is
    the part of the window covered by compute; idle is the part after it.
    """
    stamps = ("compute_start", "compute_end", "request_received", "prev_reply_sent", "waited_s",
              "correction_after_step")  # fmt: skip
    rows = []
    for reply in accepted:
        m = reply.metrics
        if any(getattr(m, k) is None for k in stamps):
            continue
        row = {"node": reply.node, **{k: float(getattr(m, k)) for k in stamps}}
        if row["prev_reply_sent"] > 0:
            window = row["request_received"] - row["prev_reply_sent"]
            covered = min(row["compute_end"], row["request_received"]) - max(
                row["compute_start"], row["prev_reply_sent"]
            )
            row["comm_s"] = window
            row["overlap_share"] = max(0.0, covered) / window if window > 0 else 0.0
            row["idle_s"] = max(0.0, row["request_received"] - row["compute_end"])
        if None not in (m.clientapp_imported_torch, m.clientapp_start, m.clientapp_reply):
            row["clientapp_imported_torch"] = m.clientapp_imported_torch
            row["clientapp_start_to_reply_s"] = float(m.clientapp_reply) - float(m.clientapp_start)
        for cpu_or_leg in ("clientapp_pull_cpu_s", "clientapp_cpu_s", "worker_cpu_s", *WORKER_LEGS):  # what burns
            if getattr(m, cpu_or_leg) is not None:  # the bytes: which process, and where in the worker's round
                row[cpu_or_leg] = float(getattr(m, cpu_or_leg))
        rows.append(row)
    if not rows:
        return {}
    out: dict = {"timeline": rows}
    for key in ("comm_s", "overlap_share", "idle_s", "waited_s", "clientapp_start_to_reply_s", *WORKER_LEGS):
        values = [r[key] for r in rows if key in r]
        if values:
            out[f"measured_{key}"] = sum(values) / len(values)
    out["measured_compute_s"] = sum(r["compute_end"] - r["compute_start"] for r in rows) / len(rows)
    return out


# The legs of a round's critical path, in order: from round r-1's last reply to round r's
# message reaching each worker (down), and from round r-1's reply leaving the worker to the
# server holding it (up). Every timestamp is wall-clock: comparable on one host.
CRITICAL_PATH_LEGS = (
    "aggregate",
    "dispatch",
    "delivery",
    "clientapp_relay",
    "reply_relay",
    "reply_to_server",
    "wait_for_others",
)
# ``clientapp_relay`` in three (where the ClientApp reports them): ``clientapp_pull`` (process start to its
# handler: Flower's start-up, pull and deserialisation of the message), ``relay_send`` (handler to the
# message's last byte in the worker's socket), ``worker_read`` (to the worker holding every array).
CLIENTAPP_RELAY_PARTS = ("clientapp_pull", "relay_send", "worker_read")


def critical_path_rows(accepted_metrics: dict[int, TrainMetrics], previous: dict, pushed: float | None) -> dict:
    """Per node (deployment, where workers report their timeline), the legs between round r-1's
    reply and round r's message reaching the worker, and their means over nodes.

    down: ``aggregate`` (server: last reply of r-1 to its aggregate), ``dispatch`` (aggregate to
    round r's messages pushed), ``delivery`` (pushed to the ClientApp process starting: SuperLink,
    SuperNode, process start), ``clientapp_relay`` (ClientApp start to the worker holding F_r);
    up: ``reply_relay`` (worker reply of r-1 to its ClientApp returning it; 0 for a reply on the stream),
    ``reply_to_server`` (ClientApp, or the worker's upload on the stream, to the server taking it: SuperNode,
    SuperLink, the pull interval),
    ``wait_for_others`` (its arrival to the round's last reply). Where the ClientApp reports its
    handler's start and its last byte sent, ``clientapp_relay`` is also given in its parts
    (``CLIENTAPP_RELAY_PARTS``).
    """
    if pushed is None or previous.get("last_reply") is None:
        return {}
    legs: dict[str, list[float]] = {leg: [] for leg in CRITICAL_PATH_LEGS}
    for node, m in accepted_metrics.items():
        # A reply of round r-1 that came on the stream left the worker for the server directly: no relay.
        arrived, returned = previous["arrivals"].get(node), previous["clientapp_reply"].get(node, m.prev_reply_sent)
        # A worker that started the round from its content on the stream held it before its ClientApp relayed
        # anything: the way down is the content's delivery on the stream alone.
        started = m.request_received if m.direct_content_fetched else m.clientapp_start
        if None in (arrived, returned, started, m.request_received, m.prev_reply_sent):
            continue
        values = {
            "aggregate": previous["aggregated"] - previous["last_reply"],
            "dispatch": pushed - previous["aggregated"],
            "delivery": started - pushed,
            "clientapp_relay": m.request_received - started,
            "reply_relay": returned - m.prev_reply_sent,
            "reply_to_server": arrived - returned,
            "wait_for_others": previous["last_reply"] - arrived,
        }
        if m.clientapp_handler_start is not None and m.clientapp_sent is not None and not m.direct_content_fetched:
            values["clientapp_pull"] = m.clientapp_handler_start - m.clientapp_start
            values["relay_send"] = m.clientapp_sent - m.clientapp_handler_start
            values["worker_read"] = m.request_received - m.clientapp_sent
        for leg, value in values.items():
            legs.setdefault(leg, []).append(value)
    if not legs["aggregate"]:
        return {}
    return {f"critical_path_{leg}_s": sum(v) / len(v) for leg, v in legs.items()}
