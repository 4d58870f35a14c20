"""The server's side of the message protocol, driven in-process over Flower's own in-memory
LinkState and Grid (tests/federation.py): bounded bytes per round, messages that expire, replies
mapped to the node they came from, error replies from nodes whose state is intact, and nodes
with their own data.

The nodes here answer with a deterministic update of the block's shape and its
``messages.TrainMetrics``, as tests/test_replies.py builds replies: what is tested is the server.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from federation import InMemoryFederation
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from parablock_flwr import core
from parablock_flwr.checkpoint import load_checkpoint
from parablock_flwr.config import RunConfig
from parablock_flwr.data import tokenized_splits
from parablock_flwr.evaluation import evaluate
from parablock_flwr.messages import COMMIT, OFFER, STREAM_UNUSABLE, TransportOffer
from parablock_flwr.metrics import RunRecorder, run_summary
from parablock_flwr.model import load_model, load_tokenizer
from parablock_flwr.records import to_record
from parablock_flwr.replica import StepLog
from parablock_flwr.server_apps.evaluator import ServerEvaluator
from parablock_flwr.server_apps.round_driver import RoundDriver
from parablock_flwr.server_apps.run import Run
from parablock_flwr.strategies import FedBCD
from parablock_flwr.transport import (
    Direction,
    NodeTransport,
    RefusalKind,
    Refused,
    RunTransport,
    StreamSettings,
    Ticket,
    TransportClient,
)
from parablock_flwr.transport.direct_channel import DirectChannel

# Flower's SuperLink state and Grid with node threads, some rounds waiting out a timeout: a minute in all.
pytestmark = pytest.mark.e2e


def make_run(tmp_path: Path, model_dir: Path, rounds: int, algorithm=FedBCD, evaluator=None, **config) -> Run:
    """The run of sequential BCD (or ``algorithm``, ``run.algorithm``) on the tiny model, in ``tmp_path``."""
    model = load_model(str(model_dir))
    partition = core.partition_blocks(model, layers_per_block=2)
    params = dict(model.named_parameters())
    cfg = RunConfig(num_server_rounds=rounds, pull_interval_s=0.01, **config)
    strategy = algorithm(
        global_params={n: params[n] for n in partition.all_names()},
        partition=partition,
        schedule=core.block_schedule("ascending", partition.num_blocks, rounds, 0),
        run_dir=tmp_path,
        config=cfg,
    )
    return Run(strategy, evaluator)


def honest_answer(run: Run, num_examples: int = 10, own_data: int | None = None, varied: bool = False,
                  reweighted: frozenset = frozenset(), poisoned: frozenset = frozenset()):  # fmt: skip
    """A node's reply: a small deterministic update of the round's block, the metrics every reply
    carries, and the held-out evaluation the message asks for (``evaluation = "clients"``). ``varied``: each
    value its own (seeded by node and round), not one value a tensor; ``reweighted``: the (node, round) whose
    reply says another example count; ``poisoned``: those whose update is not finite."""
    strategy = run.algorithm

    def answer(index: int, msg: Message) -> RecordDict:
        if msg.metadata.message_type == MessageType.QUERY:  # a resumed server asks each node's partition
            return RecordDict({"node": MetricRecord({"partition-id": index})})
        cfg = msg.content.config_records["round"]
        at = (index, int(cfg["server-round"]))
        metrics = {"server-round": at[1], "block": int(cfg["block"]), "partition-id": index,
                   "num-examples": 3 * num_examples if at in reweighted else num_examples,
                   "train-loss": 1.0, "compute-s": 0.01,
                   "base-version": int(cfg["server-round"]) - 1}  # fmt: skip
        if own_data is not None:
            metrics["own-data"] = own_data
        if "evaluate-version" in cfg:
            metrics.update({"eval-version": int(cfg["evaluate-version"]), "heldout-loss": 2.0, "heldout-examples": 4})
        content = RecordDict({"metrics": MetricRecord(metrics)})
        if msg.metadata.message_type == MessageType.TRAIN:
            names = strategy.partition.names(int(cfg["block"]))
            update = {n: torch.full_like(strategy.global_params[n], 1e-4 * (index + 1)) for n in names}
            if varied:
                gen = torch.Generator().manual_seed(1000 * at[1] + index)
                update = {n: 1e-3 * torch.randn(u.shape, generator=gen) for n, u in update.items()}
            if at in poisoned:
                update = {n: torch.full_like(u, float("nan")) for n, u in update.items()}
            content["update"] = to_record(update)
        return content

    return answer


def run_rounds(run: Run, federation: InMemoryFederation) -> list[dict]:
    with federation:
        run.start(federation.grid, ArrayRecord())
    return RunRecorder(run.run_dir).read()


def written_bytes() -> int:
    """Bytes this process has written so far (``/proc/self/io``: every file and stream)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["wchar"])


def test_bytes_written_per_round_do_not_grow_over_200_rounds(tmp_path, tiny_model_dir):
    """``evaluation = "clients"`` completes each round's record with the next round's replies:
    appended, never rewritten, and the checkpoint does not grow with the round (before: the
    whole metrics.jsonl was rewritten every round and the checkpoint held every round's block)."""
    rounds, per_round, last = 200, {}, [written_bytes()]

    class Measured(FedBCD):
        def extra_round_metrics(self, server_round, accepted):
            now = written_bytes()
            per_round[server_round], last[0] = now - last[0], now
            return {}

    run = make_run(tmp_path, tiny_model_dir, rounds, evaluation="clients", eval_every=1)
    run.algorithm.__class__ = Measured
    records = run_rounds(run, InMemoryFederation(2, honest_answer(run)))
    assert [r["round"] for r in records] == list(range(rounds + 1))
    assert all(r["heldout_loss"] == 2.0 for r in records), "every x^r evaluated by the nodes"
    print(f"bytes written in round 10: {per_round[10]}, in round 200: {per_round[200]}")
    assert per_round[200] <= per_round[10] * 1.05 + 256, (per_round[10], per_round[200])
    assert max(per_round[r] for r in range(150, 200)) <= per_round[10] * 1.05 + 256


@pytest.mark.parametrize("notice_before_deadline", [False, True])
def test_messages_expire_with_the_round_and_a_stalled_node_is_left_behind(
    tmp_path, tiny_model_dir, notice_before_deadline
):
    """Every message's TTL is ``round-timeout-s``; a node that stalls past it in round 2 is counted
    missing, its message expires on the SuperLink, which refuses its reply; the node recovers in
    round 3 and is aggregated again. The SuperLink's notice that the message expired unanswered is
    no reply, whether the server pulls it after its deadline or just before (the TTL counts from the
    message's creation, a moment before the push: here the deadline is moved a second later)."""
    ttls, stalled = set(), {}
    run = make_run(tmp_path, tiny_model_dir, 4, round_timeout_s=1.5)
    honest = honest_answer(run)
    if notice_before_deadline:
        push = run.driver.push

        def push_with_a_later_deadline(*args, **kw):
            sent = push(*args, **kw)
            run.driver._deadline += 1.0
            return sent

        run.driver.push = push_with_a_later_deadline

    def answer(index, msg):
        ttls.add(msg.metadata.ttl)
        if index == 2 and int(msg.content.config_records["round"]["server-round"]) == 2 and not stalled:
            stalled["at"] = time.monotonic()
            time.sleep(2.5)  # past the deadline: the reply goes nowhere (its message expired)
        return honest(index, msg)

    records = run_rounds(run, InMemoryFederation(3, answer))
    assert ttls == {1.5}
    by_round = {r["round"]: r for r in records}
    assert by_round[2]["replies_missing"] == 1 and by_round[2]["num_accepted"] == 2
    assert by_round[2]["num_rejected"] == 0, by_round[2]["rejected"]
    assert by_round[3]["num_accepted"] == 3 and by_round[4]["num_accepted"] == 3
    assert by_round[3]["full_syncs_sent"] == 1  # it may have answered after all: resynchronised (test below)
    assert sum(r["late_replies_dropped"] for r in records[1:]) == 0  # the SuperLink refused its reply
    assert sum(r["replies_missing"] for r in records[1:]) == 1


def test_a_late_reply_leaves_the_node_where_a_rejected_one_would(tmp_path, tiny_model_dir):
    """In round 2 node 1's reply is rejected and node 2 answers past the deadline: node 2 has taken its
    own round-2 update in (ParaBlock's pending, the computation it started from it), which the server
    dropped. Round 3 must resynchronise both alike: a full sync (dropping the node's own state), no
    catch-up (before: node 2 got g^1 only, and went on from the update the server had dropped)."""
    run = make_run(tmp_path, tiny_model_dir, 3, round_timeout_s=4.0)  # room for the others under load
    honest, late, round3 = honest_answer(run), {}, {}

    def answer(index, msg):
        cfg = msg.content.config_records["round"]
        server_round = int(cfg["server-round"])
        if server_round == 3:
            round3[index] = (cfg.get("sync-version"), "sync-values" in msg.content, "catch-up" in msg.content)
        content = honest(index, msg)
        if server_round == 2 and index == 1:
            content["metrics"]["block"] = 99  # rejected: not the round's block
        if server_round == 2 and index == 2 and not late:
            late["at"] = time.monotonic()
            time.sleep(6.0)  # answered, but past the deadline
        return content

    records = run_rounds(run, InMemoryFederation(3, answer))
    by_round = {r["round"]: r for r in records}
    assert by_round[2]["replies_missing"] == 1 and by_round[2]["num_accepted"] == 1
    assert round3[1] == round3[2] == (1, True, False), round3
    assert round3[0] == (None, False, False)
    assert by_round[3]["full_syncs_sent"] == 2 and by_round[3]["num_accepted"] == 3


def test_an_unavailable_node_is_marked_by_the_message_it_was_sent(tmp_path, tiny_model_dir):
    """Flower answers for a node that stopped heartbeating with a reply whose sender is the
    SuperLink: the server marks the node it sent the message to (before: the SuperLink's id)."""
    run = make_run(tmp_path, tiny_model_dir, 2)
    honest, stopped = honest_answer(run), set()

    def answer(index, msg):
        if index == 1:  # takes its first message, then neither answers nor heartbeats: unavailable
            stopped.add(index)
            return None
        return honest(index, msg)

    federation = InMemoryFederation(2, answer, heartbeat_s=0.5)
    federation.heartbeat = lambda index: index not in stopped
    gone = federation.nodes[1]
    records = run_rounds(run, federation)
    rejected = [x for r in records for x in r.get("rejected", [])]
    assert rejected and {x["node"] for x in rejected} == {gone}, rejected
    assert gone in run.algorithm.sync.needs_full_sync


def test_a_message_the_grid_did_not_take_is_counted_and_not_waited_for(tmp_path, tiny_model_dir):
    run = make_run(tmp_path, tiny_model_dir, 2, round_timeout_s=30.0)
    federation = InMemoryFederation(2, honest_answer(run))
    push = federation.grid.push_messages

    def push_dropping_one(messages):  # a malformed push: Flower's HTTP grid returns None for it
        messages = list(messages)
        ids = list(push(messages[:1]))
        return ids + [None] * (len(messages) - 1)

    federation.grid.push_messages = push_dropping_one
    started = time.monotonic()
    records = run_rounds(run, federation)
    assert time.monotonic() - started < 20, "a round waited for a message that was never sent"
    assert all(r["messages_not_pushed"] == 1 and r["num_accepted"] == 1 for r in records[1:])


@pytest.mark.parametrize("reason, full_sync", [("state-intact: CUDA out of memory", 0), ("CUDA out of memory", 1)])
def test_an_error_from_a_node_whose_state_is_intact_costs_no_full_sync(tmp_path, tiny_model_dir, reason, full_sync):
    run = make_run(tmp_path, tiny_model_dir, 3)
    honest = honest_answer(run)

    def answer(index, msg):
        if index == 1 and int(msg.content.config_records["round"]["server-round"]) == 2:
            return Error(code=0, reason=reason)
        return honest(index, msg)

    records = {r["round"]: r for r in run_rounds(run, InMemoryFederation(2, answer))}
    assert records[2]["num_rejected"] == 1 and records[2]["state_intact_errors"] == 1 - full_sync
    assert records[3]["full_syncs_sent"] == full_sync
    assert records[3]["catch_up_steps_sent"] == 1 - full_sync  # missed g^1 only: a catch-up suffices
    assert records[3]["num_accepted"] == 2


def test_the_final_evaluations_fallbacks_and_refusals_on_the_direct_stream_are_recorded_and_said(
    tmp_path, tiny_model_dir
):
    """``transport = "direct"`` with ``evaluation = "clients"``: what the stream counts after the last round's
    record is written (a node that cannot fetch the final evaluation's records, an outsider's forged
    capability meanwhile) completes that record (``final_direct_*``) and is on the run's last line, beside
    each round's fallbacks (node 0's site keeps to Flower's path; node 1 uploads on the stream)."""
    rounds = 2
    run = make_run(tmp_path, tiny_model_dir, rounds, evaluation="clients")
    transport = RunTransport(StreamSettings("localhost:0", insecure=True), run_id=1, ttl_s=60)
    run.driver.channel = DirectChannel(transport)
    honest, node, outsider = honest_answer(run), NodeTransport(), {}

    def answer(index: int, msg: Message):
        content = honest(index, msg)
        offer = TransportOffer.from_config(dict(msg.content.config_records[OFFER]))
        if msg.metadata.message_type == MessageType.EVALUATE and index == 1:  # the final evaluation's records
            forged = Ticket(os.urandom(32), 1, offer.node_id, offer.server_round, Direction.DOWNLOAD, "r3/x")
            with TransportClient(offer.address, insecure=True) as client, pytest.raises(Refused) as refused:
                client.download(forged, 1, "0" * 64)
            outsider["refused"] = refused.value
            return Error(code=0, reason=f"state-intact: node worker failed: {STREAM_UNUSABLE}no answer")
        if msg.metadata.message_type != MessageType.TRAIN:
            return content
        if index == 0:  # its site keeps to Flower's path: the update inline, counted as a fallback
            content["metrics"]["direct-fallbacks"] = 1
            return content
        commit = node.upload(offer, {name: bytes(a.data) for name, a in content.pop("update").items()})
        content[COMMIT] = ConfigRecord(commit.to_config())
        return content

    transport.start()
    try:
        records = run_rounds(run, InMemoryFederation(2, answer))
    finally:
        transport.stop()
        node.close()
    assert outsider["refused"].kind is RefusalKind.BAD_CAPABILITY and "\n" not in outsider["refused"].line()
    assert [(r["num_accepted"], r["direct_fallbacks"], r["direct_refusals"]) for r in records[1:]] == [(2, 1, 0)] * 2
    final = {k: v for k, v in records[rounds].items() if k.startswith(("final_direct_fallbacks", "final_direct_refus"))}
    assert final == {"final_direct_fallbacks": 1, "final_direct_refusals": 1, "final_direct_refused_bad_capability": 1}
    assert records[rounds]["heldout_loss"] == 2.0  # node 0's evaluation of x^R, the one that came
    assert run_summary(records).endswith(
        "3 messages' blocks on Flower's path instead of the direct stream (direct_fallbacks); "
        "1 requests refused by the direct stream (bad_capability 1)"
    )


def test_a_node_with_its_own_data_is_bounded_like_any_other(tmp_path, tiny_model_dir):
    """A node with its own 64 rows (own-data = 1) is bounded like a partitioned one: by ``num-examples`` = 40
    when ``max-num-examples`` is 0 (rejected, naming both keys), by ``max-num-examples`` when it is set."""
    for max_num_examples, accepted, bound in ((0, 1, 40), (80, 2, 80), (50, 1, 50)):
        run = make_run(tmp_path / str(max_num_examples), tiny_model_dir, 2, num_examples=40,
                       max_num_examples=max_num_examples)  # fmt: skip
        answers = [honest_answer(run, num_examples=20), honest_answer(run, num_examples=64, own_data=1)]
        records = run_rounds(run, InMemoryFederation(2, lambda i, m, answers=answers: answers[i](i, m)))
        assert all(r["num_accepted"] == accepted for r in records[1:]), (max_num_examples, records[1:])
        if accepted == 1:
            assert (
                f"num-examples=64, expected a number in (0, {bound}] (max-num-examples, else num-examples)"
                in (records[1]["rejected"][0]["reason"])
            )


def test_a_node_rejected_in_every_round_is_named_as_excluded(tmp_path, tiny_model_dir):
    run = make_run(tmp_path, tiny_model_dir, 3, num_examples=40)
    honest, big = honest_answer(run, num_examples=20), honest_answer(run, num_examples=64)
    run_rounds(run, InMemoryFederation(2, lambda i, m: big(i, m) if i else honest(i, m)))
    excluded = run.participation.excluded()
    assert len(excluded) == 1 and "(partition 1): not aggregated in 3 of 3 rounds" in excluded[0], excluded
    assert "num-examples=64, expected a number in (0, 40]" in excluded[0]


def test_a_resumed_run_goes_on_counting_who_it_left_out(tmp_path, tiny_model_dir):
    """Rejected in rounds 1-3, the run stopped and resumed for rounds 4-5: the node is named as not
    aggregated in 5 of 5 rounds (before: the count started again, 2 of 2), by its partition, since
    node ids change across a restart."""
    first = make_run(tmp_path / "first", tiny_model_dir, 3, num_examples=40)
    honest, big = honest_answer(first, num_examples=20), honest_answer(first, num_examples=64)
    run_rounds(first, InMemoryFederation(2, lambda i, m: big(i, m) if i else honest(i, m)))
    resumed = make_run(tmp_path / "resumed", tiny_model_dir, 5, num_examples=40)
    checkpoint = load_checkpoint(first.run_dir)  # (check_resumable also reads the config.json the ServerApp writes)
    first_step = resumed.resume(first.run_dir, checkpoint)
    honest, big = honest_answer(resumed, num_examples=20), honest_answer(resumed, num_examples=64)
    with InMemoryFederation(2, lambda i, m: big(i, m) if i else honest(i, m)) as federation:
        resumed.start(federation.grid, first_step)
    excluded = resumed.participation.excluded()
    assert len(excluded) == 1 and "(partition 1): not aggregated in 5 of 5 rounds (5 in a row" in excluded[0], excluded


def test_each_checkpoint_hashes_only_what_its_round_changed_and_a_resume_checks_it(
    tmp_path, tiny_model_dir, monkeypatch
):
    """A round's checkpoint hashes the tensors its step changed, not the model (for an 8B model the
    whole model was 26 GiB of SHA-256 every round); its digest is that of the model hashed afresh, and
    a resume checks it. A checkpoint written before (``digest_format`` absent: the whole model's bytes
    in one SHA-256) still resumes, and a wrong digest is still refused."""
    hashed = []
    hash_tensor = core.tensor_sha256
    # Where model_digest looks the function up: core/digests.py (core re-exports it).
    monkeypatch.setattr(core.digests, "tensor_sha256", lambda t: hashed.append(t.numel()) or hash_tensor(t))
    first = make_run(tmp_path / "first", tiny_model_dir, 4, schedule="ascending")
    run_rounds(first, InMemoryFederation(2, honest_answer(first)))
    x, partition = first.algorithm.global_params, first.algorithm.partition
    names = partition.all_names()
    block = sum(x[n].numel() for n in partition.names(0))
    assert sum(hashed) == sum(x[n].numel() for n in names) + 3 * block  # x^1 whole, then a block
    run_dir = first.run_dir
    checkpoint = load_checkpoint(run_dir)
    assert checkpoint.digest_format == "per-tensor"
    assert checkpoint.global_sha256 == core.model_digest(x, names)
    make_run(tmp_path / "resumed", tiny_model_dir, 6, schedule="ascending").resume(run_dir, checkpoint)

    state_file = next((run_dir / "checkpoint").glob("round-*")) / "state.json"
    state = json.loads(state_file.read_text())
    del state["digest_format"]
    state["global_sha256"] = core.digest(x, names)  # as written before
    state_file.write_text(json.dumps(state))
    make_run(tmp_path / "old", tiny_model_dir, 6, schedule="ascending").resume(run_dir, load_checkpoint(run_dir))
    state["global_sha256"] = "0" * 64
    state_file.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="does not give the checkpointed x\\^4"):
        make_run(tmp_path / "bad", tiny_model_dir, 6).resume(run_dir, load_checkpoint(run_dir))


@pytest.mark.parametrize("transfer_dtype", ["int8", "bf16", "fp32"])
def test_a_staged_pending_update_is_written_as_it_travelled_and_reads_back_with_its_bits(tmp_path, transfer_dtype):
    """The server stages each accepted ParaBlock update for the checkpoint as it came (its packed arrays in its own
    encoding: int8 a quarter of the fp32 bytes, never decoded to write it); read back, it has the staged values'
    bits and packs to the same bytes for the hand-back. A checkpoint staged in fp32 before still loads."""
    import numpy as np

    from parablock_flwr import checkpoint, wire
    from parablock_flwr.tensor_file import DIRECT_ALIGNMENT

    torch.manual_seed(0)
    shapes = {"a": (64, 100), "b": (77,)}
    update = {n: torch.randn(s) * 1e-3 for n, s in shapes.items()}
    came = wire.unpack(wire.pack(update, transfer_dtype), shapes, transfer_dtype, read_only=True, lazy=True)
    checkpoint.stage_pending(tmp_path, 3, core.PendingUpdate(1, 4, came))
    folder = tmp_path / "checkpoint" / checkpoint.STAGED
    per_value = {"int8": 1 + 4 / core.INT8_BLOCK, "bf16": 2, "fp32": 4}[transfer_dtype]  # values (and scales)
    numel, layout = sum(t.numel() for t in update.values()), 64  # and the layout's JSON, a short last int8 block
    padding = 3 * DIRECT_ALIGNMENT  # each array (layout, values, scales) from a page of its own, the last page whole
    assert numel * per_value <= (folder / "updates.bin").stat().st_size <= numel * per_value + layout + padding
    (entry,) = [json.loads(line) for line in (folder / "index.jsonl").read_text().splitlines()]
    back = checkpoint.read_pending(folder, entry)
    assert (back.block, back.base_version) == (1, 4)
    assert all(torch.equal(back.delta[n], came[n]) for n in shapes)
    again = wire.pack_pieces(back.delta, transfer_dtype)
    assert {k: wire.join(v).tobytes() for k, v in again.items()} == {
        k: wire.join(v).tobytes() for k, v in wire.pack_pieces(came, transfer_dtype).items()
    }
    old = tmp_path / "old"  # the fp32 format of checkpoints staged before 2026-12-05
    old.mkdir()
    (old / "updates.bin").write_bytes(b"".join(np.ascontiguousarray(came[n].numpy()).tobytes() for n in shapes))
    tensors = [["a", 0, [64, 100]], ["b", 64 * 100 * 4, [77]]]
    legacy = checkpoint.read_pending(old, {"block": 1, "base_version": 4, "tensors": tensors})
    assert all(torch.equal(legacy.delta[n], came[n]) for n in shapes)


def test_pending_updates_are_written_beside_the_loop_and_a_failed_write_stops_the_run_before_its_checkpoint(
    tmp_path, tiny_model_dir, monkeypatch
):
    """ParaBlock's pending updates (what a resumed server hands back) are written on a thread of their
    own, not between the round's last reply and the next messages; each round's checkpoint holds every
    accepted client's. A write that fails (a full disk) stops the run with the disk's error before
    that round's checkpoint: no checkpoint without its clients' updates."""
    from parablock_flwr import checkpoint
    from parablock_flwr.server_apps import durability
    from parablock_flwr.strategies import ParaBlock

    run = make_run(tmp_path / "ok", tiny_model_dir, 3, algorithm=ParaBlock)
    writers = []

    def stage(*args):  # the real write, noting the thread it runs on
        writers.append(threading.current_thread().name)
        checkpoint.stage_pending(*args)

    monkeypatch.setattr(durability, "stage_pending", stage)
    run_rounds(run, InMemoryFederation(2, honest_answer(run)))
    assert len(writers) == 6 and all(name.startswith("stage-pending") for name in writers), writers
    assert sorted(load_checkpoint(tmp_path / "ok").pending) == [0, 1]

    def full_disk(run_dir, partition_id, pending):
        if pending.base_version == 1:  # round 2's updates
            raise OSError(28, "No space left on device")
        checkpoint.stage_pending(run_dir, partition_id, pending)

    monkeypatch.setattr(durability, "stage_pending", full_disk)
    run = make_run(tmp_path / "full", tiny_model_dir, 3, algorithm=ParaBlock)
    with pytest.raises(OSError, match="No space left on device"):
        run_rounds(run, InMemoryFederation(2, honest_answer(run)))
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoint").glob("round-*")) == ["round-00001"]
    assert [r["round"] for r in RunRecorder(tmp_path / "full").read() if "num_accepted" in r] == [1]


def test_a_bounded_step_log_is_pruned_only_between_rounds_never_while_a_rounds_nodes_may_read_it(
    tmp_path, tiny_model_dir, monkeypatch
):
    """``snapshot-every = 2``: the step log is written while the next round's replies are outstanding,
    but what a snapshot lets it drop is dropped only after a round's aggregation and before the next
    messages (a lagging Ray actor of the round in flight may be reading those steps). The run ends
    with 2 snapshots and the steps after the older one."""

    events = []
    real_prune, real_push = StepLog.prune, RoundDriver.push
    monkeypatch.setattr(StepLog, "prune", lambda log, *keep: (events.append("prune"), real_prune(log, *keep))[1])
    monkeypatch.setattr(
        RoundDriver,
        "push",
        lambda driver, grid, messages, **kw: (events.append("push"), real_push(driver, grid, messages, **kw))[1],
    )
    run = make_run(tmp_path, tiny_model_dir, 5, snapshot_every=2)
    real_aggregate = run.algorithm.aggregate_train
    run.algorithm.aggregate_train = lambda *args: (events.append("aggregated"), real_aggregate(*args))[1]
    run_rounds(run, InMemoryFederation(2, honest_answer(run)))
    assert events.count("prune") == 2, events  # snapshot 2: before round 4's messages; snapshot 4: at the end
    for i, event in enumerate(events):
        if event == "prune":
            assert events[i - 1] == "aggregated" and events[i + 1 : i + 2] in (["push"], []), events
    log = StepLog(tmp_path)
    assert log.snapshots() == [2, 4] and log.steps() == [3, 4, 5]


def test_a_slow_finish_never_loses_replies_and_the_last_round_is_durable_before_its_evaluation(
    tmp_path, tiny_model_dir
):
    """Round 1's record and checkpoint take longer than ``round-timeout-s`` (a slow disk, a long evaluation): round 2's
    replies came in time, but its messages expired before the first pull, and Flower 1.42's SuperLink then
    answers each with its notice (``MESSAGE_UNAVAILABLE``), not the reply. The run pulls at least once all
    the same, counts those nodes missing (not rejected), and retries the round, whose replies it
    aggregates. And the nodes' evaluation of x^R comes after round R's checkpoint is durable (else a crash
    there would lose the aggregated round R)."""
    rounds, checkpointed_at_final_evaluation = 2, []

    class SlowRecord(Run):
        def save_checkpoint(self, server_round):
            if server_round == 1:
                time.sleep(2.0)
            super().save_checkpoint(server_round)

    run = make_run(tmp_path, tiny_model_dir, rounds, round_timeout_s=1.0, evaluation="clients")
    run.__class__ = SlowRecord
    honest = honest_answer(run)

    def answer(index, msg):
        if msg.metadata.message_type == MessageType.EVALUATE:
            checkpointed_at_final_evaluation.append((tmp_path / "checkpoint" / f"round-{rounds:05d}").exists())
        return honest(index, msg)

    records = {r["round"]: r for r in run_rounds(run, InMemoryFederation(2, answer))}
    assert records[2]["num_accepted"] == 2 and records[2]["num_rejected"] == 0, records[2]
    assert records[2]["replies_missing"] == 2 and records[2]["round_retries"] == 1, records[2]
    assert checkpointed_at_final_evaluation == [True, True]


def evaluator_for(run: Run, model_dir: Path, run_dir: Path) -> tuple[ServerEvaluator, object, object]:
    """The ServerApp's evaluator for ``run``'s run (its config names the tiny model: the evaluator
    process builds x^0 from it), with the tokenizer and held-out rows it evaluates on."""
    cfg = run.config
    tokenizer = load_tokenizer(str(model_dir))
    _, heldout = tokenized_splits(
        cfg.dataset, cfg.num_examples, cfg.heldout_examples, cfg.seed, tokenizer, cfg.max_seq_len
    )
    return ServerEvaluator(tokenizer, heldout, cfg, run_dir), tokenizer, heldout


def stalling(evaluator: ServerEvaluator, answer, seconds: float):
    """``answer``, which first stops the evaluator process (SIGSTOP) for ``seconds``: an evaluator far
    slower than the rounds, as a loaded server's is."""
    stalled = []

    def stall_then_answer(index, msg):
        if not stalled:
            stalled.append(threading.Timer(seconds, os.kill, (evaluator.pid, signal.SIGCONT)))
            os.kill(evaluator.pid, signal.SIGSTOP)
            stalled[0].start()
        return answer(index, msg)

    return stall_then_answer


def test_the_servers_evaluation_runs_beside_the_loop_and_evaluates_exactly_each_x_r(tmp_path, tiny_model_dir):
    """An evaluator stalled for 3 s from round 1 (its process stopped; the in-process nodes answer at
    once) never holds a round: the rounds go on while it is stopped; with ``eval-max-lag = 1`` it then
    skips the rounds more than one round behind the newest handed over, recorded as skipped; round 0
    and the last round are always evaluated, and the run's end waits for the last. What it evaluates
    is exactly ``x^r``: the loss equals that of the model rebuilt from the step log. Each round's
    evaluation part is appended after its training record."""
    rounds = 6
    run = make_run(tmp_path, tiny_model_dir, rounds, evaluation="server", eval_every=1,
                   num_examples=24, heldout_examples=8, generate_examples=0, eval_max_lag=1,
                   model=str(tiny_model_dir), layers_per_block=2)  # fmt: skip
    cfg = run.config
    evaluator, tokenizer, heldout = evaluator_for(run, tiny_model_dir, tmp_path)
    run.evaluator = evaluator
    started = time.perf_counter()
    records = run_rounds(run, InMemoryFederation(2, stalling(evaluator, honest_answer(run), 3.0)))
    took = time.perf_counter() - started
    evaluated = [r["round"] for r in records if "heldout_loss" in r]
    skipped = [r["round"] for r in records if r.get("evaluation_skipped")]
    assert 0 in evaluated and rounds in evaluated and skipped, (evaluated, skipped)
    assert sorted(evaluated + skipped) == list(range(rounds + 1))
    assert took > 3.0, "the run ended before its last evaluation"
    assert max(r["round_wall_s"] for r in records[1:]) < 3.0, [r["round_wall_s"] for r in records[1:]]

    replica = load_model(str(tiny_model_dir))
    replica_params = dict(replica.named_parameters())
    for version in range(1, rounds + 1):
        _, step = run.history.step_log.read(version)
        core.apply_step(replica_params, step)
        if version in evaluated:
            expected, _ = evaluate(replica, tokenizer, heldout, cfg, generate=False)
            assert records[version]["heldout_loss"] == expected["heldout_loss"], version
    parts = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for version in evaluated[1:]:
        order = [i for i, p in enumerate(parts) if p["round"] == version]
        assert "train_loss" in parts[order[0]] and "heldout_loss" in parts[order[-1]], version


def test_an_evaluation_that_fails_fails_the_run(tmp_path, tiny_model_dir):
    """An error in the evaluator process is not lost: the loop raises it in one line (the run ends as
    ``error``), and the process is gone. The fault is real: round 0's generated answers cannot be
    written (a file stands where the samples folder goes)."""
    run = make_run(tmp_path, tiny_model_dir, 3, evaluation="server", num_examples=12, heldout_examples=4,
                   generate_examples=1, max_new_tokens=2, model=str(tiny_model_dir),
                   layers_per_block=2)  # fmt: skip
    (tmp_path / "samples").write_text("not a folder")
    evaluator, _, _ = evaluator_for(run, tiny_model_dir, tmp_path)
    run.evaluator = evaluator
    with pytest.raises(RuntimeError, match=r"^the server's evaluation failed: FileExistsError: .*samples'$"):
        run_rounds(run, InMemoryFederation(2, honest_answer(run)))
    assert evaluator.pid is None  # closed: stopped and reaped


def test_an_evaluator_process_that_dies_fails_the_run_and_leaves_no_process(tmp_path, tiny_model_dir):
    """The evaluator process killed (SIGKILL, by its pid) in the middle of the run: the run fails with
    one line naming the process and how it ended, and no process is left behind. Until then every
    thread of it ran at ``SCHED_IDLE`` on ``eval-cpus`` (threads started later inherit both)."""
    eval_cpu = max(os.sched_getaffinity(0))
    run = make_run(tmp_path, tiny_model_dir, 4, evaluation="server", num_examples=12, heldout_examples=4,
                   generate_examples=0, model=str(tiny_model_dir), layers_per_block=2,
                   eval_cpus=str(eval_cpu))  # fmt: skip
    evaluator, _, _ = evaluator_for(run, tiny_model_dir, tmp_path)
    run.evaluator = evaluator
    honest, killed, placement = honest_answer(run), [], set()

    def answer(index, msg):
        if int(msg.content.config_records["round"]["server-round"]) == 2 and not killed:
            killed.append(evaluator.pid)
            for task in Path(f"/proc/{evaluator.pid}/task").iterdir():
                placement.add((frozenset(os.sched_getaffinity(int(task.name))), os.sched_getscheduler(int(task.name))))
            os.kill(evaluator.pid, signal.SIGKILL)
        return honest(index, msg)

    with pytest.raises(RuntimeError) as failed:
        run_rounds(run, InMemoryFederation(2, answer))
    assert placement == {(frozenset({eval_cpu}), os.SCHED_IDLE)}
    pid = killed[0]
    assert str(failed.value) == f"the server's evaluation failed: its process (pid {pid}) ended (killed by SIGKILL)"
    assert not Path(f"/proc/{pid}").exists(), "the evaluator process was not reaped"


def rounds_as_aggregated(run: Run) -> dict[int, dict]:
    """Each round's ``x^r`` as the loop held it once the round was aggregated (a copy of every tensor)."""
    strategy = run.algorithm
    models = {0: {n: t.detach().clone() for n, t in strategy.global_params.items()}}
    real_aggregate = strategy.aggregate_train

    def aggregate(server_round, *args):
        result = real_aggregate(server_round, *args)
        models[server_round] = {n: t.detach().clone() for n, t in strategy.global_params.items()}
        return result

    strategy.aggregate_train = aggregate
    return models


def test_by_default_every_round_is_evaluated_even_behind_a_pruned_step_log(tmp_path, tiny_model_dir, caplog):
    """The default policy (``eval-max-lag = 0``): an evaluator stalled for 4 s, far slower than the rounds,
    with ``snapshot-every = 2`` (the log pruned every other round): every round is still evaluated, exactly
    ``x^r``, none skipped, no round waits for it (only the run's end does), and each round's line carries
    its held-out loss, never ``nan``. The prune waits for the evaluator's version, and once the evaluator
    is done the log is as bounded as without it. (Before: the evaluator skipped rounds, and found the
    steps it needed pruned: FileNotFoundError, the run failed.)"""
    rounds = 8
    run = make_run(tmp_path, tiny_model_dir, rounds, evaluation="server", eval_every=1, snapshot_every=2,
                   num_examples=24, heldout_examples=8, generate_examples=0,
                   model=str(tiny_model_dir), layers_per_block=2)  # fmt: skip
    cfg = run.config
    models = rounds_as_aggregated(run)
    evaluator, tokenizer, heldout = evaluator_for(run, tiny_model_dir, tmp_path)
    run.evaluator = evaluator
    started = time.perf_counter()
    with caplog.at_level("INFO", logger="parablock_flwr"):
        records = run_rounds(run, InMemoryFederation(2, stalling(evaluator, honest_answer(run), 4.0)))
    took = time.perf_counter() - started
    assert took > 4.0, "the run ended before its queue of evaluations drained"
    assert max(r["round_wall_s"] for r in records[1:]) < 4.0, [r["round_wall_s"] for r in records[1:]]
    assert [r["round"] for r in records if "heldout_loss" in r] == list(range(rounds + 1))
    assert not any(r.get("evaluation_skipped") for r in records)
    assert max(r["evaluation_waited_s"] for r in records) > 2.0, "the evaluator never fell behind: no test"
    model = load_model(str(tiny_model_dir))
    params = dict(model.named_parameters())
    for version in range(rounds + 1):
        with torch.no_grad():
            for name, value in models[version].items():
                params[name].copy_(value)
        expected, _ = evaluate(model, tokenizer, heldout, cfg, generate=False)
        assert records[version]["heldout_loss"] == expected["heldout_loss"], version
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round ")]
    assert len([line for line in lines if " heldout_loss " in line]) == rounds + 1, lines
    assert not [line for line in lines if "nan" in line], lines
    log = run.history.step_log
    assert log.snapshots() == [6, 8] and log.steps() == [7, 8]


def test_handing_rounds_to_a_stopped_evaluator_never_blocks_the_loop(tmp_path, tiny_model_dir):
    """The loop hands over round numbers (a queue of integers, not of models) and goes on: 2,000 rounds
    handed to an evaluator whose process is stopped take well under a second (before: the pipe to the
    process filled after a few hundred rounds and the loop blocked until the evaluator read them)."""
    run = make_run(tmp_path, tiny_model_dir, 3000, evaluation="server", num_examples=12,
                   heldout_examples=4, generate_examples=0, model=str(tiny_model_dir),
                   layers_per_block=2)  # fmt: skip
    evaluator, _, _ = evaluator_for(run, tiny_model_dir, tmp_path)
    evaluator.begin(run)
    os.kill(evaluator.pid, signal.SIGSTOP)
    handed = threading.Thread(target=lambda: [evaluator.submit(r) for r in range(1, 2001)], daemon=True)
    try:
        started = time.perf_counter()
        handed.start()
        handed.join(10.0)
        assert not handed.is_alive(), "submit blocked the loop"
        assert time.perf_counter() - started < 1.0
    finally:
        os.kill(evaluator.pid, signal.SIGKILL)  # a stopped process takes no SIGTERM
        evaluator.close(raise_error=False)
        handed.join(30.0)
    assert evaluator.pid is None


def test_rounds_a_stopped_run_had_not_evaluated_are_counted_as_skipped_when_it_resumes(tmp_path, tiny_model_dir):
    """The evaluator lags the loop; a server stopped then leaves rounds with no evaluation before its
    checkpoint. The resumed run records them as skipped (their ``x^r`` may be pruned), so the last line
    counts them, instead of losing them without a word. Here the first run had no evaluator at all."""
    settings = dict(evaluation="server", eval_every=1, num_examples=24, heldout_examples=8, generate_examples=0,
                    model=str(tiny_model_dir), layers_per_block=2)  # fmt: skip
    first = make_run(tmp_path / "first", tiny_model_dir, 3, **settings)
    run_rounds(first, InMemoryFederation(2, honest_answer(first)))
    resumed = make_run(tmp_path / "resumed", tiny_model_dir, 4, **settings)
    evaluator, _, _ = evaluator_for(resumed, tiny_model_dir, tmp_path / "resumed")
    resumed.evaluator = evaluator
    first_step = resumed.resume(first.run_dir, load_checkpoint(first.run_dir))
    with InMemoryFederation(2, honest_answer(resumed)) as federation:
        resumed.start(federation.grid, first_step)
    records = RunRecorder(tmp_path / "resumed").read()
    assert [r["round"] for r in records if r.get("evaluation_skipped")] == [0, 1, 2]
    assert [r["round"] for r in records if "heldout_loss" in r] == [3, 4]  # the checkpoint's round, then on


def run_with_messages_ahead(
    folder: Path, model_dir: Path, num_nodes: int, ahead: bool, fail=(), replies: dict | None = None,
    landed_s: float = 0.0, reweighted=frozenset(), poisoned=frozenset(), **config
):  # fmt: skip
    """A run of 4 rounds on the direct stream, each node a thread answering its messages in order (as its
    SuperNode does), uploading its update and committing it; a message pushed a round ahead is answered once
    its content has come from the stream (as the ClientApp does), or with ``WITHDRAWN``; ``fail``: the (node,
    round) whose first message is answered with an error. ``replies`` (``transport-replies-on-stream``): each
    node uploads its reply's content on the stream too, and its Flower reply follows 0.2 s later, as Flower's
    relay would; (node, round) -> ``"malformed"`` (bytes that are no reply's uploaded instead; 0.6 s),
    ``"contradicted"`` (the Flower reply commits another update) or ``"reweighted"`` (it says another example
    count). ``landed_s``: each node replies that long after its upload (as a ParaBlock node, which uploads ahead,
    then corrects), with varied updates (``honest_answer``, as ``reweighted`` and ``poisoned``). Returns the
    records, the (node, round) of
    each message whose content came from the stream, and the step log."""
    from parablock_flwr.messages import MESSAGE_AHEAD, WITHDRAWN
    from parablock_flwr.transport.framing import unseal
    from parablock_flwr.transport.message_bytes import content_from_bytes, reply_to_bytes

    run = make_run(folder, model_dir, 4, transport_messages_ahead=ahead, **config)
    transport = RunTransport(StreamSettings("localhost:0", insecure=True), run_id=1, ttl_s=60)
    run.driver.channel = DirectChannel(transport, replies_on_stream=replies is not None)
    honest = honest_answer(run, varied=landed_s > 0, reweighted=reweighted, poisoned=poisoned)
    node, from_stream, failed = NodeTransport(), [], set()

    def answer(index: int, msg: Message):
        if MESSAGE_AHEAD in msg.content.config_records:
            offer = TransportOffer.from_config(dict(msg.content[MESSAGE_AHEAD]))
            if (data := node.message_content(offer)) is None:
                return Error(code=0, reason=f"{WITHDRAWN}round {offer.server_round}")
            msg.content = content_from_bytes(unseal(bytes.fromhex(offer.message_key), data))
            from_stream.append((index, offer.server_round))
        content = honest(index, msg)
        if msg.metadata.message_type != MessageType.TRAIN:  # the sampling's query of the node's partition
            return content
        at = (index, int(msg.content.config_records["round"]["server-round"]))
        if at in fail and at not in failed:
            failed.add(at)
            return Error(code=0, reason="state-intact: node worker failed: out of memory")
        offer = TransportOffer.from_config(dict(msg.content.config_records[OFFER]))
        commit = node.upload(offer, {name: bytes(a.data) for name, a in content.pop("update").items()})
        time.sleep(landed_s)
        content[COMMIT] = ConfigRecord(commit.to_config())
        if replies is not None and offer.reply_name:
            how = replies.get(at)
            node.upload_reply(offer, b"no reply's content" if how == "malformed" else reply_to_bytes(content))
            time.sleep(0.6 if how == "malformed" else 0.2)  # the round waits for it: other audits come first
            if how == "contradicted":
                content[COMMIT] = ConfigRecord({**commit.to_config(), "update-sha256": "0" * 64})
            if how == "reweighted":
                content["metrics"]["num-examples"] = 1000
        return content

    transport.start()
    try:
        records = run_rounds(run, InMemoryFederation(num_nodes, answer))
    finally:
        transport.stop()
        node.close()
    return records, from_stream, StepLog(folder)


def test_messages_pushed_a_round_ahead_take_their_content_from_the_stream_and_change_no_bit(tmp_path, tiny_model_dir):
    """``transport-messages-ahead``: once a node's reply has committed its update on the stream (round 1),
    its next message is pushed while the round before is in flight (round 3's during round 2, round 4's
    during round 3), and the node, answering its messages in order, waits on the stream for the content the
    server publishes once it has built it. Every global step is the one of the same run with each message
    pushed when built, and nothing is missing, late or rejected."""
    with_ahead, from_stream, log = run_with_messages_ahead(tmp_path / "ahead", tiny_model_dir, 2, ahead=True)
    without, none, reference = run_with_messages_ahead(tmp_path / "built", tiny_model_dir, 2, ahead=False)
    assert none == [] and sorted(from_stream) == [(0, 3), (0, 4), (1, 3), (1, 4)]
    assert [r.get("direct_messages_ahead") for r in with_ahead[1:]] == [0, 0, 2, 2]
    for records in (with_ahead, without):
        assert [r["num_accepted"] for r in records[1:]] == [2] * 4
        assert all(r["replies_missing"] == r["late_replies_dropped"] == r["direct_refusals"] == 0 for r in records[1:])
    for version in range(1, 5):
        (block_a, step_a), (block_b, step_b) = log.read(version), reference.read(version)
        assert block_a == block_b and all(torch.equal(step_a[n], step_b[n]) for n in step_a)


def test_replies_on_the_stream_are_aggregated_on_arrival_audited_by_flowers_and_change_no_bit(tmp_path, tiny_model_dir):
    """``transport-replies-on-stream``: each node uploads its reply's content on the stream after its update, and
    the server takes it as the node's reply at once (0.2 s before Flower's). Every reply of every round comes so;
    Flower's replies trail as their audits, all of them matching (the last round's before the run ends, in the
    final record); every global step is the one of the same run without."""
    on_stream, _, log = run_with_messages_ahead(tmp_path / "stream", tiny_model_dir, 2, ahead=True, replies={})
    _, _, reference = run_with_messages_ahead(tmp_path / "flower", tiny_model_dir, 2, ahead=True)
    rounds, final = on_stream[1:5], on_stream[-1]
    assert [r["num_accepted"] for r in rounds] == [2] * 4 and [r["direct_replies_on_stream"] for r in rounds] == [2] * 4
    assert sum(r["direct_replies_audited"] for r in rounds) + final["final_direct_replies_audited"] == 8
    assert all(r["direct_replies_contradicted"] == r["direct_replies_unaudited"] == 0 for r in rounds)
    assert final["final_direct_replies_unaudited"] == 0
    assert all(r["replies_missing"] == r["late_replies_dropped"] == r["direct_refusals"] == 0 for r in rounds)
    for version in range(1, 5):
        (block_a, step_a), (block_b, step_b) = log.read(version), reference.read(version)
        assert block_a == block_b and all(torch.equal(step_a[n], step_b[n]) for n in step_a)


def test_a_reply_on_the_stream_that_is_malformed_or_contradicted_by_flowers_is_counted_and_changes_no_bit(
    tmp_path, tiny_model_dir
):  # fmt: skip
    """Node 1's round-2 content on the stream is no reply's: refused (``direct_refused_bad_reply``), changing
    nothing, and its Flower reply is the one taken. Node 0's round-2 Flower reply commits another update than its
    reply on the stream, and node 2's says another example count (its weight): each counted
    (``direct_replies_contradicted``), and their replies go on Flower's path from then on. Every global step is
    the one of the same run without replies on the stream."""
    replies = {(0, 2): "contradicted", (1, 2): "malformed", (2, 2): "reweighted"}
    records, _, log = run_with_messages_ahead(tmp_path / "stream", tiny_model_dir, 3, ahead=True, replies=replies)
    _, _, reference = run_with_messages_ahead(tmp_path / "flower", tiny_model_dir, 3, ahead=True)
    rounds = records[1:5]
    assert [r["num_accepted"] for r in rounds] == [3] * 4
    assert rounds[1]["direct_refused_bad_reply"] == rounds[1]["direct_refusals"] == 1
    assert [r["direct_replies_on_stream"] for r in rounds] == [3, 2, 1, 1]  # nodes 0 and 2 off it from round 3
    assert sum(r["direct_replies_contradicted"] for r in rounds) == 2
    assert run_summary(records).endswith(
        "1 requests refused by the direct stream (bad_reply 1); "
        "2 replies taken from the direct stream contradicted by their Flower reply (direct_replies_contradicted)"
    )
    for version in range(1, 5):
        (block_a, step_a), (block_b, step_b) = log.read(version), reference.read(version)
        assert block_a == block_b and all(torch.equal(step_a[n], step_b[n]) for n in step_a)


def test_the_rounds_pass_runs_ahead_on_updates_that_land_before_their_replies_and_changes_no_bit(
    tmp_path, tiny_model_dir
):  # fmt: skip
    """Each node's update lands 1 s before its reply (as a ParaBlock node's, uploaded ahead while it corrects):
    from round 2 on (each node's weight known from round 1) the server runs the round's pass then
    (``server_apps/step_ahead.py``) and keeps it (``one_pass_ahead``). In round 3 node 1's update is not finite
    (the pass ahead reads it; its reply is rejected), and in round 4 node 0 says another example count: the
    pass that ran ahead read other inputs, so it is dropped (``one_pass_ahead_dropped``) and the round's pass runs
    again after the replies. Each reply's update norm is found as it landed, beside the pass (``PassAhead.run_norms``),
    the poisoned one's too (its reply rejected for the same reason as on Flower's path). Every global step is the one
    of the same run on Flower's path, bit for bit."""
    odd = {"reweighted": frozenset({(0, 4)}), "poisoned": frozenset({(1, 3)})}
    records, _, log = run_with_messages_ahead(tmp_path / "ahead", tiny_model_dir, 2, ahead=True, landed_s=1.0, **odd)
    flower = make_run(tmp_path / "flower", tiny_model_dir, 4)
    flower_records = run_rounds(flower, InMemoryFederation(2, honest_answer(flower, varied=True, **odd)))
    rounds = records[1:5]
    assert [r["num_accepted"] for r in rounds] == [2, 2, 1, 2]
    assert [r["update_norms_ahead"] for r in rounds] == [0, 2, 2, 2], rounds
    reasons = [[(r["partition_id"], r["reason"]) for r in one["rejected"]] for one in (rounds[2], flower_records[3])]
    assert reasons[0] == reasons[1] and "non-finite" in reasons[0][0][1], reasons
    assert [r["one_pass_ahead"] for r in rounds] == [0, 1, 0, 0], rounds
    assert [r["one_pass_ahead_dropped"] for r in rounds] == [0, 0, 1, 1], rounds
    assert rounds[1]["server_one_pass_ahead_s"] > 0 and "server_one_pass_ahead_s" not in rounds[2]
    reference = StepLog(tmp_path / "flower")
    for version in range(1, 5):
        (block_a, step_a), (block_b, step_b) = log.read(version), reference.read(version)
        assert block_a == block_b and all(torch.equal(step_a[n], step_b[n]) for n in step_a)
        assert any(step_a[n].abs().max() > 0 for n in step_a)


def test_a_message_pushed_ahead_to_a_node_not_sampled_is_withdrawn_and_its_reply_dropped(tmp_path, tiny_model_dir):
    """Under partial participation (2 of 3 nodes a round, fraction-train 0.5) a message pushed ahead to a node
    that the next round does not sample is withdrawn (its capability revoked while it waits): the node
    answers that it was, the server drops that reply uncounted, and every round still aggregates the nodes
    it sampled."""
    records, from_stream, _ = run_with_messages_ahead(tmp_path, tiny_model_dir, 3, ahead=True, fraction_train=0.5)
    assert [r["num_accepted"] for r in records[1:]] == [2] * 4
    assert all(r["replies_missing"] == r["late_replies_dropped"] == r["direct_refusals"] == 0 for r in records[1:])
    assert sum(r["direct_messages_ahead"] for r in records[1:]) == len(from_stream) > 0
    assert sum(r["direct_ahead_revoked"] + r["direct_messages_withdrawn"] for r in records[1:]) > 0


def test_a_round_re_sent_to_a_node_withdraws_its_next_message_pushed_ahead_first(tmp_path, tiny_model_dir):
    """Round 3 needs both nodes' replies (``min-accepted-replies = 2``) and node 1's first one is an error, so
    round 3 is re-sent to it. Its round-4 message, pushed ahead while round 3 was in flight, is ahead of the
    re-sent one in its queue: it is withdrawn first, so that the node answers it (``WITHDRAWN``, dropped) and
    then the re-sent round, instead of waiting on it for round 3 to end. Every round aggregates both nodes."""
    records, from_stream, _ = run_with_messages_ahead(tmp_path, tiny_model_dir, 2, ahead=True, fail={(1, 3)},
                                                      min_accepted_replies=2)  # fmt: skip
    assert [r["num_accepted"] for r in records[1:]] == [2] * 4
    assert records[3]["round_retries"] == 1 and records[3]["direct_messages_withdrawn"] == 1  # counted when done
    assert (1, 4) not in from_stream and (0, 4) in from_stream


def test_updates_the_round_holds_anyway_are_staged_without_waiting_for_the_writes_before_them(tmp_path, monkeypatch):
    """A slow disk (the writer thread held until released): updates staged with ``held`` (a round's updates in
    memory, which the server's one pass staged before it runs) queue behind an unfinished write; one staged
    without it, past ``MAX_STAGING`` outstanding, waits for the write that many back."""
    from parablock_flwr.server_apps import durability

    release = threading.Event()
    monkeypatch.setattr(durability, "stage_pending", lambda *args: release.wait(30))
    staging = durability.PendingStaging(tmp_path)
    for partition_id in range(durability.MAX_STAGING + 2):
        staging.stage(partition_id, None, held=True)
    assert len(staging.writes) == durability.MAX_STAGING + 2 and not staging.writes[0].done()
    bounded = threading.Thread(target=staging.stage, args=(99, None))
    bounded.start()
    bounded.join(0.5)
    assert bounded.is_alive() and not staging.writes[0].done()  # it waits on the first write, still held
    release.set()
    bounded.join(10)
    staging.wait()
    assert not bounded.is_alive()


def test_a_simulations_grid_is_told_from_a_deployments_without_importing_flowers_in_memory_grid():
    """``in_simulation`` looks Flower's in-memory Grid (a simulation's) up instead of importing it, a second of CPU a
    deployment's ServerApp never needs: a Flower release that moved the class would make a simulation look like a
    deployment (its workers' full syncs, the direct transport tried), which this catches."""
    from parablock_flwr.server_apps.app import in_simulation

    federation = InMemoryFederation(1, answer=None)  # never entered: its grid alone
    assert in_simulation(federation.grid) and not in_simulation(object())
