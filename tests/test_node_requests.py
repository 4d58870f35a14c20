"""Requests to one node worker are serialised and ordered (issue 21): a real worker in process, behind a
real Unix socket, real tiny Llama, real training in its compute thread; requests sent from threads at
the same time, as a ClientApp still waiting past ``round-timeout-s`` and a retried round would."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from parablock_flwr import core, node
from parablock_flwr.client_apps.app import relay_to_worker
from parablock_flwr.client_apps.inline import train_inline
from parablock_flwr.config import RunConfig
from parablock_flwr.model import load_for_training
from parablock_flwr.wire import join_pieces, unpack
from parablock_flwr.worker.protocol import request
from parablock_flwr.worker.server import NodeWorker

from helpers import relayed, tiny_config, worker_request

TRIALS = 20  # the old code (6cca626) corrupted the replica in some of these; see test_two_copies...


class Served:
    """A NodeWorker answering on a real Unix socket from an event loop in its own thread."""

    def __init__(self, path) -> None:
        self.path, self.worker = str(path), NodeWorker()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def start():
            self.server = await asyncio.start_unix_server(self.worker.handle, path=self.path, limit=2**26)
            started.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()), self.loop.run_forever()))
        self.thread.start()
        started.wait(30)

    def send(self, message: dict, arrays: dict | None = None):
        return asyncio.run(request(self.path, message, arrays or {}, timeout_s=300))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.worker.compute_thread.shutdown(wait=True)


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path / "w.sock")
    yield s
    s.close()


@pytest.fixture(scope="module")
def x0_of(tiny_model_dir):
    """x^0 of the tiny model (every trainable tensor), as a server holds it."""
    cache = {}

    def get(config):
        if "x0" not in cache:
            model, partition = load_for_training(RunConfig.from_flower(config))
            cache["x0"] = {n: p.detach().clone() for n, p in model.named_parameters() if n in partition.all_names()}
        return cache["x0"]

    return get


@pytest.mark.e2e  # a node worker on its socket, TRIALS runs: about a minute, not for the fast tier
def test_two_copies_of_a_round_at_once_leave_the_replica_exactly_x1_with_one_computation(
    tmp_path, tiny_model_dir, served, x0_of
):
    """The issue's recipe, TRIALS times (a fresh run each time): round 1, which starts round 2 ahead,
    then two round-2 messages at once (two ClientApps, the second a retry). Both get the same reply
    (the same update and timestamps: one computation, not two), and the node's copy of the global
    model is bit-equal to x^1 = x^0 + g^1 afterwards. At 6cca626 (no lock; the second copy computed
    the round again beside the first) the replica was left off x^1 in 6 and 2 of 20 trials (two runs) and all 20
    computed round 2 twice."""
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 12})
    x0 = x0_of(config)
    corrupted, twice, errors = [], [], []
    for trial in range(TRIALS):
        run_id = 1000 + trial
        reply, update1 = served.send(worker_request(config, run_id, 1, block=0, next_block=1, num_partitions=2))
        assert "error" not in reply, reply
        g1 = {n: t * 0.5 for n, t in unpack(update1).items()}  # any step the server may take
        message = worker_request(config, run_id, 2, block=1, next_block=-1, num_partitions=2)
        arrays = relayed({"global-step": g1})
        with ThreadPoolExecutor(2) as pool:
            (r1, u1), (r2, u2) = [f.result() for f in [pool.submit(served.send, message, arrays) for _ in range(2)]]
        if "error" in r1 or "error" in r2:
            errors.append((trial, r1.get("error"), r2.get("error")))
            continue
        if r1["metrics"]["compute-start"] != r2["metrics"]["compute-start"] or any(
            not np.array_equal(u1[n], u2[n]) for n in u1
        ):
            twice.append(trial)
        replica = node.resources(RunConfig.from_flower(config), run_id).replica
        x1 = {n: t.clone() for n, t in x0.items()}
        core.apply_step(x1, g1)
        if replica.version != 1 or any(not torch.equal(replica.params[n].detach(), x1[n]) for n in x1):
            corrupted.append(trial)
    assert not errors and not corrupted and not twice, (
        f"of {TRIALS} trials: replica off x^1 in {corrupted}, round 2 computed twice in {twice}, errors {errors}"
    )


def test_an_older_round_a_foreign_partition_and_a_left_run_are_refused_and_change_nothing(tmp_path, tiny_model_dir):
    """An older round, another partition, a block the model does not have, a run the worker left: each
    refusal names what it was and what the node is at, starts the reason with `state-intact: `
    (relayed by the real ClientApp over the real socket), and leaves the node's state as it was."""
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2})
    worker = NodeWorker()
    try:
        reply, update1 = worker.serve_request(
            worker_request(config, 7, 1, block=0, next_block=-1, num_partitions=2), {}
        )
        assert reply["metrics"]["own-data"] == 0 and reply["metrics"]["oom-retries"] == 0
        g1 = relayed({"global-step": {n: t * 0.5 for n, t in unpack(join_pieces(update1)).items()}})
        reply, _ = worker.serve_request(worker_request(config, 7, 2, block=1, next_block=-1, num_partitions=2), g1)
        assert "error" not in reply
        replica = node.resources(RunConfig.from_flower(config), 7).replica
        before = (replica.version, core.digest(replica.params, replica.params), worker.node.state)

        stale, _ = worker.serve_request(worker_request(config, 7, 1, block=0, next_block=-1, num_partitions=2), {})
        assert stale["state-intact"] and "round 1 (train) refused" in stale["error"]
        assert "already answered round 2 of run 7" in stale["error"]
        foreign, _ = worker.serve_request(
            worker_request(config, 7, 3, block=0, next_block=-1, partition_id=1, num_partitions=2), g1
        )
        assert foreign["state-intact"] and "partition-id=1 refused" in foreign["error"]
        assert "serves partition-id=0" in foreign["error"]
        for block, next_block, named in ((9, -1, "block=9"), (0, -2, "next-block=-2")):
            outside, _ = worker.serve_request(
                worker_request(config, 7, 3, block=block, next_block=next_block, num_partitions=2), g1
            )
            assert outside["state-intact"] and f"{named} refused: this node's model has blocks 0..1" in outside["error"]
        assert (replica.version, core.digest(replica.params, replica.params), worker.node.state) == before

        worker.serve_request(
            worker_request(config, 8, 1, block=0, next_block=-1, num_partitions=2), {}
        )  # a new run (a resumed server)
        left, _ = worker.serve_request(worker_request(config, 7, 3, block=0, next_block=-1, num_partitions=2), g1)
        assert left["state-intact"] and "round 3 of run 7 refused: this worker left that run for run 8" in left["error"]
    finally:
        worker.compute_thread.shutdown(wait=True)


def test_a_refused_message_is_an_error_reply_that_says_the_state_is_intact(tmp_path, tiny_model_dir, served):
    """The real relay (the deployment's ClientApp) over the real socket: the worker's refusal (here of
    a second partition: two SuperNodes given one worker) becomes a Flower error reply whose reason
    starts with exactly `state-intact: `."""
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2})
    assert "error" not in served.send(worker_request(config, 9, 1, block=0, next_block=-1, num_partitions=2))[0]
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 9, 5, 0
    round_config = ConfigRecord(worker_request(config, 9, 1, 0, -1, num_partitions=2)["round"])
    msg = Message(content=RecordDict({"round": round_config}), dst_node_id=5, message_type=MessageType.TRAIN)
    TaskIdentity.node_id = 5
    context = Context(run_id=9, node_id=5, node_config={"worker-socket": served.path, "partition-id": 1,
                      "num-partitions": 2}, state=RecordDict(), run_config=config)  # fmt: skip
    reply = relay_to_worker(msg, context, served.path)
    assert reply.has_error()
    assert reply.error.reason.startswith("state-intact: node worker failed: partition-id=1 refused"), reply.error


def test_out_of_memory_retries_once_with_half_the_micro_batch_then_names_the_keys(
    tmp_path, tiny_model_dir, monkeypatch
):
    """CUDA out-of-memory cannot happen on a CPU: ``train_block`` raises ``torch.OutOfMemoryError``
    (a narrow monkeypatch of the one call) once, then always. Once: the round runs again with half the
    micro-batch and says so (`oom-retries`); always: an error reply, state intact, naming the keys."""
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2, "batch-size": 4})
    real, calls = node.compute.train_block, []

    def out_of_memory_first(model, names, batches, settings, slot=None):
        calls.append(settings.micro_batch_size)
        if len(calls) == 1 or fail_always:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return real(model, names, batches, settings, slot)

    monkeypatch.setattr(node.compute, "train_block", out_of_memory_first)
    fail_always = False
    worker = NodeWorker()
    try:
        reply, _ = worker.serve_request(worker_request(config, 5, 1, block=0, next_block=-1, num_partitions=2), {})
        assert "error" not in reply and reply["metrics"]["oom-retries"] == 1 and calls == [0, 2]
        replica = node.resources(RunConfig.from_flower(config), 5).replica
        before = core.digest(replica.params, replica.params)
        fail_always = True
        names = node.resources(RunConfig.from_flower(config), 5).partition.names(0)
        step = {n: torch.zeros_like(t) for n, t in replica.params.items() if n in names}
        request = worker_request(config, 5, 2, block=1, next_block=-1, num_partitions=2)
        reply, _ = worker.serve_request(request, relayed({"global-step": step}))
    finally:
        worker.compute_thread.shutdown(wait=True)
    assert reply["state-intact"] and "out of memory on cpu (micro-batch 2" in reply["error"]
    assert "Tried to allocate 2.00 GiB" in reply["error"]
    assert all(key in reply["error"] for key in ("micro-batch-size", "layers-per-block", "gradient-checkpointing"))
    assert calls[2:] == [0, 2] and core.digest(replica.params, replica.params) == before
    assert worker.node.state.last_round == 1  # round 2 did not happen: a retry of it may come


@pytest.mark.e2e  # a node worker in a fresh process (torch and transformers imported cold: 15-75 s here)
@pytest.mark.slow
def test_the_worker_process_imports_no_server_code(tmp_path, tiny_model_dir):
    """The node worker's process, after a real round, holds no Flower server code, no checkpointing and
    no strategy's server half (nor flwr.app, which imports flwr.serverapp in Flower 1.42)."""
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 1, "transfer-dtype": "bf16"})
    script = f"""
import json, sys
from parablock_flwr.worker.server import NodeWorker
from pathlib import Path
worker = NodeWorker(state_dir=Path({str(tmp_path / "state")!r}))
reply, _ = worker.serve_request({worker_request(config, 3, 1, block=0, next_block=1, num_partitions=2)!r}, {{}})
assert "error" not in reply, reply
worker.node.ahead.future.result()
server_code = ("flwr.serverapp", "flwr.app", "flwr.server", "parablock_flwr.checkpoint")
bad = [m for m in sys.modules if m.startswith(server_code)
       or (m.startswith("parablock_flwr.strategies.") and m.endswith(".server"))]
print(json.dumps(bad))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_inline_clientapp_replies_state_intact_errors_itself(tmp_path, tiny_model_dir, monkeypatch):
    """Simulation's adapter: out of memory twice and a repeated round are Flower error replies whose
    reasons start with `state-intact: `; the node's state in `context.state` is left as it was."""
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2})
    round_cfg = dict(
        worker_request(config, 4, 1, block=0, next_block=1, num_partitions=2)["round"],
        **{"run-dir": str(tmp_path / "run")},
    )
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 4, 6, 0
    msg = Message(content=RecordDict({"round": ConfigRecord(round_cfg)}), dst_node_id=6,
                  message_type=MessageType.TRAIN)  # fmt: skip
    TaskIdentity.node_id = 6
    context = Context(run_id=4, node_id=6, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                      run_config=config)  # fmt: skip
    real = node.compute.train_block

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")

    monkeypatch.setattr(node.compute, "train_block", out_of_memory)
    reply = train_inline(msg, context)
    assert reply.has_error() and reply.error.reason.startswith("state-intact: out of memory on cpu"), reply.error
    assert len(context.state) == 0  # nothing stored: the node is as before the message

    monkeypatch.setattr(node.compute, "train_block", real)
    reply = train_inline(msg, context)
    assert not reply.has_error() and reply.content["metrics"]["own-data"] == 0
    assert context.state["node-state"]["last-round"] == 1 and list(context.state) == ["node-state"]  # update: on disk
    assert (tmp_path / "run" / "node-state" / "partition-0" / "pending.safetensors").is_file()
    again = train_inline(msg, context)
    assert again.has_error() and again.error.reason.startswith("state-intact: round 1 (train) refused")


def test_a_repeat_is_answered_from_the_cache_but_a_retry_that_syncs_the_node_is_computed_again(tmp_path):
    """The worker's cache of its last reply answers a true repeat (the same round, nothing new); a
    retried round that carries a full sync or a hand-back replaces the node's state, so it must be
    computed from that state (before: the rejected reply came back from the cache, every retry)."""
    worker = NodeWorker(state_dir=tmp_path)
    calls = []
    worker.handle_request = lambda header, arrays, *_: calls.append(header) or ({"metrics": {}}, {})
    header = worker_request({}, 7, 3, block=0, next_block=-1)
    assert worker.serve_request(header, {}) == worker.serve_request(header, {}) and len(calls) == 1
    synced = worker_request({}, 7, 3, block=0, next_block=-1, **{"sync-version": 1})
    worker.serve_request(synced, {})
    worker.serve_request(header, {"resume-pending/w": np.zeros(1, np.float32)})
    assert len(calls) == 3
    reply, _ = worker.serve_request({"op": "train", "run-id": 7}, {})  # no partition, no round
    assert reply == {"error": "worker request: run-config missing", "state-intact": True}
    worker.compute_thread.shutdown()


def test_a_replica_whose_restore_failed_is_lost_until_a_full_sync_and_never_state_intact():
    """Out of device memory while restoring the replica after a computation (a fault that cannot be made
    real on a CPU: one narrow patch of the device move) leaves trained values in it: the error must not
    say the state is intact, and the replica refuses every use until a full sync."""
    from parablock_flwr.replica import ModelReplica, ReplicaLost

    model = torch.nn.Linear(2, 2)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    replica = ModelReplica(model, ["weight", "bias"], torch.bfloat16)  # x in an fp32 master, the model in casts
    trained_already = threading.Event()

    def fail_on_restore(names, fp32=()):
        if trained_already.is_set():  # the move after the computation: x back into the model
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    replica._to_device = fail_on_restore
    with pytest.raises(ReplicaLost), replica.local_model(0, None, ["weight"]) as trained:
        with torch.no_grad():
            trained.weight.add_(1.0)
        trained_already.set()
    with pytest.raises(ReplicaLost, match="needs a full sync"):
        replica.advance_to(1, lambda v: (0, {}))
    pool = ThreadPoolExecutor(1)
    with pytest.raises(ReplicaLost):  # not turned into StateIntact by the node runtime
        node.computed(pool.submit(replica.advance_to, 1, lambda v: (0, {})))
    pool.shutdown()
    del replica._to_device
    replica.reset_to(2, values)
    assert replica.version == 2 and not replica.lost
    assert all(torch.equal(replica.params[n], values[n]) for n in values)
    assert all(torch.equal(p, values[n].bfloat16()) for n, p in model.named_parameters())


def test_the_residual_is_written_beside_the_next_blocks_start_and_is_on_disk_before_the_reply(
    tmp_path, tiny_model_dir, monkeypatch
):
    """transfer-dtype bf16: the node's error-feedback residual (fp32, written durably) is written on a
    thread of its own while round r+1 starts ahead, not before it (an 8B block's fsync no longer holds
    the next block's compute), and it is on disk when the reply leaves. Ordered by events, not timing:
    the write waits until round r+1 has started, which the old order (write, then start) never saw."""
    from parablock_flwr.node.state import ResidualStore

    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 1, "transfer-dtype": "bf16"})
    worker = NodeWorker(state_dir=tmp_path / "state")
    ahead_started, seen = threading.Event(), {}
    real_save, real_start_ahead = ResidualStore.save, node.Node.start_ahead

    def save(store, server_round, block, residual):
        seen["thread"] = threading.current_thread().name
        seen["ahead_first"] = ahead_started.wait(60)
        real_save(store, server_round, block, residual)

    def start_ahead(self, *args):
        real_start_ahead(self, *args)
        ahead_started.set()

    monkeypatch.setattr(ResidualStore, "save", save)
    monkeypatch.setattr(node.Node, "start_ahead", start_ahead)
    try:
        reply, _ = worker.serve_request(worker_request(config, 3, 1, block=0, next_block=1, num_partitions=2), {})
        on_disk = sorted(p.name for p in (tmp_path / "state").rglob("r*.safetensors"))
        assert "error" not in reply, reply
        worker.node.ahead.future.result()
    finally:
        worker.compute_thread.shutdown(wait=True)
    assert seen == {"thread": "residual-write", "ahead_first": True}
    assert on_disk == ["r00001-b0.safetensors"]


def test_a_peer_never_chooses_the_workers_state_dir_and_a_store_removes_only_its_own_files(tmp_path, tiny_model_dir):
    """``state-dir`` comes from the worker's command line (or its default beside the socket): a message
    naming another one, whatever sent it, is refused with one line, state intact, before anything is
    loaded or changed (before: the worker kept and cleared residuals wherever a message said, and a
    resumed run's first message removed that folder whole). A store's ``clear`` removes its own files
    only, never the folder nor a file it did not write."""
    from parablock_flwr.node.state import ResidualStore

    victim = tmp_path / "elsewhere" / "partition-0"
    victim.mkdir(parents=True)
    (victim / "notes.txt").write_text("not the worker's")
    worker = NodeWorker(state_dir=tmp_path / "state")
    config = tiny_config(tiny_model_dir, tmp_path / "out", **{"transfer-dtype": "bf16"})
    header = worker_request(config, 7, 1, 0, 1, **{"resumed-after": 0})
    header["node"] = {"state-dir": str(tmp_path / "elsewhere")}
    reply, _ = worker.serve_request(header, {})
    assert reply == {
        "error": f"node config state-dir={str(tmp_path / 'elsewhere')!r} refused: this worker keeps its state in "
        f"{tmp_path / 'state'}, set when it started (start it with --state-dir {tmp_path / 'elsewhere'})",
        "state-intact": True,
    }
    assert worker.run_id is None and worker.partition_id is None  # nothing changed
    assert (victim / "notes.txt").read_text() == "not the worker's"
    header["node"] = {"state-dir": str(tmp_path / "state")}  # the worker's own: accepted
    assert worker.node_settings(header["node"]).state_dir == str(tmp_path / "state")
    worker.compute_thread.shutdown()

    store = ResidualStore(victim)
    store.save(1, 0, {"w": torch.ones(2)})
    store.reset(2)
    store.clear()
    assert sorted(p.name for p in victim.iterdir()) == ["notes.txt"]


def test_in_simulation_a_full_sync_repairs_a_lost_replica(tmp_path, tiny_model_dir, x0_of):
    """One Ray actor serves several nodes with one replica. Out of device memory while restoring it after
    a computation (the one narrow patch of the device move, as above: a fault a CPU cannot make real)
    loses it; the server answers that node's error with a full sync, and the next node this actor serves
    with one must leave with the replica repaired, exactly x^1 (before: the sync's values were not
    decoded, and the actor failed every node it served for the rest of the run)."""
    from flwr.app import Context

    from parablock_flwr.records import to_record

    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 1})
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 5, 6, 0

    def message(server_round: int, block: int, next_block: int, partition: int, **records):
        round_cfg = dict(worker_request(config, 5, server_round, block, next_block, partition, 2)["round"],
                         **{"run-dir": str(tmp_path / "run")})  # fmt: skip
        if "sync-values" in records:
            round_cfg["sync-version"] = server_round - 2
        content = RecordDict({"round": ConfigRecord(round_cfg), **records})
        return Message(content=content, dst_node_id=6, message_type=MessageType.TRAIN)

    contexts = [Context(run_id=5, node_id=6 + i, node_config={"partition-id": i, "num-partitions": 2},
                        state=RecordDict(), run_config=config) for i in range(2)]  # fmt: skip
    TaskIdentity.node_id = 6
    replica = node.resources(RunConfig.from_flower(config), 5).replica
    moves, real_move = [], replica._to_device

    def fail_on_restore(names, fp32=()):
        moves.append(fp32)
        if len(moves) == 1:  # round 1's only move: x back into the model after the computation
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        real_move(names, fp32)

    replica._to_device = fail_on_restore
    lost = train_inline(message(1, 0, 1, partition=0), contexts[0])
    del replica._to_device
    assert lost.has_error() and "ReplicaLost" in lost.error.reason and not lost.error.reason.startswith("state-")
    assert replica.lost

    x0 = x0_of(config)
    g1 = {n: torch.full_like(x0[n], 1e-3) for n in node.resources(RunConfig.from_flower(config), 5).partition.names(0)}
    synced = message(2, 1, -1, partition=1, **{"sync-values": to_record(x0), "global-step": to_record(g1)})
    reply = train_inline(synced, contexts[1])
    assert not reply.has_error(), reply.error
    x1 = {n: t.clone() for n, t in x0.items()}
    core.apply_step(x1, g1)
    assert not replica.lost and replica.version == 1
    assert all(torch.equal(replica.params[n].detach(), x1[n]) for n in x1)


def test_a_retry_carrying_a_full_sync_is_always_computed_never_answered_from_the_cache(tmp_path):
    """The same round carrying a full sync (or a hand-back) twice: the server has dropped what it knew of
    the node both times, so each is computed from the state it gives, never answered with the reply
    the node computed before (before: the second came back from the cache, keyed like the first)."""
    worker = NodeWorker(state_dir=tmp_path)
    calls = []
    worker.handle_request = lambda header, arrays, *_: calls.append(header) or ({"metrics": {}}, {})
    synced = worker_request({}, 7, 3, block=0, next_block=-1, **{"sync-version": 1})
    worker.serve_request(synced, {})
    worker.serve_request(synced, {})
    handed_back = worker_request({}, 7, 3, block=0, next_block=-1)
    worker.serve_request(handed_back, {"resume-pending/w": np.zeros(1, np.float32)})
    worker.serve_request(handed_back, {"resume-pending/w": np.zeros(1, np.float32)})
    assert len(calls) == 4
    worker.compute_thread.shutdown()


def test_a_residual_write_error_fails_the_reply_whatever_else_fails_in_the_round(tmp_path, tiny_model_dir):
    """transfer-dtype bf16, the round's residual file cannot be written (a folder in its place, in a
    store its run has begun on: a real error): the reply fails and names the write, also when something
    later in the round fails too (an evaluation of a version the node does not hold), and the write has
    ended before the reply leaves (before: that path replied the evaluation's error alone, the write's
    error lost, its thread left running beside the next request)."""
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 1, "transfer-dtype": "bf16"})
    store = tmp_path / "state" / "partition-0"
    (store / "r00001-b0.safetensors" / "in-the-way").mkdir(parents=True)
    for run_id in (8, 9):
        (store / f"run-{run_id}").write_bytes(b"")
    worker = NodeWorker(state_dir=tmp_path / "state")
    try:
        header = worker_request(config, 8, 1, block=0, next_block=1, num_partitions=2)
        reply, _ = worker.serve_request(header, {})
        assert reply["error"].startswith(("IsADirectoryError", "OSError")) and "state-intact" not in reply, reply
        header = worker_request(config, 9, 1, block=0, next_block=1, num_partitions=2, **{"evaluate-version": 5})
        reply, _ = worker.serve_request(header, {})
        assert "writing the residual" in reply["error"] and "x^5" in reply["error"], reply
        assert "state-intact" not in reply
        assert not [t for t in threading.enumerate() if t.name == "residual-write"]
    finally:
        worker.compute_thread.shutdown(wait=True)


class BcdRounds:
    """Sequential BCD rounds of a node worker in bf16, one local step each, as a server drives them: each round's
    global step is half its update (``steps``), sent with the next round; catch-up steps and x's values (in fp32,
    exactly) when asked. ``train`` gives back the round's update."""

    def __init__(self, tiny_model_dir, tmp_path, blocks: dict[int, int]):
        self.config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 1, "transfer-dtype": "bf16"})
        self.blocks, self.steps = blocks, {}

    def train(self, worker, run_id, server_round, values=None, catch_up=(), **extra):
        blocks, steps = self.blocks, self.steps
        arrays = {"global-step": steps[server_round - 1]} if server_round > 1 else {}
        if catch_up:
            arrays["catch-up"] = {f"v{v}/{n}": t for v in catch_up for n, t in steps[v].items()}
            extra.update({"catch-up-versions": list(catch_up), "catch-up-blocks": [blocks[v] for v in catch_up]})
        extra.update({"algorithm": "fedbcd", "step-block": blocks.get(server_round - 1, -1)})
        header = worker_request(self.config, run_id, server_round, blocks[server_round],
                                blocks.get(server_round + 1, -1), num_partitions=2, **extra)  # fmt: skip
        sent = relayed(arrays, "bf16") if arrays else {}
        sent |= relayed({"sync-values": values}) if values is not None else {}
        reply, pieces = worker.serve_request(header, sent)
        assert "error" not in reply, reply
        update = unpack(join_pieces(pieces))
        steps.setdefault(server_round, {n: t * 0.5 for n, t in update.items()})  # g^r, as a server might take it
        return update


def test_a_worker_restarted_in_a_resumed_run_goes_on_with_its_newest_residuals(tmp_path, tiny_model_dir):
    """bf16, sequential BCD (a round starts from x^{r-1}, so a restarted worker computes exactly what it
    would have): run 20 answers round 1 and stops; run 21 resumes after round 1 and the worker answers
    rounds 2-4; it is then restarted (a new worker on a copy of its state folder, as after a crash) and
    answers round 5, catching up from x^0. Its reply equals, bit for bit, that of the worker that kept
    running: it restored its residuals as of round 4, not of round 1, which the resume names (before: it
    went back to round 1's and deleted the newer ones)."""
    import shutil

    train = BcdRounds(tiny_model_dir, tmp_path, {1: 0, 2: 1, 3: 0, 4: 1, 5: 0}).train
    first = NodeWorker(state_dir=tmp_path / "state")
    try:
        train(first, 20, 1)
        for server_round in (2, 3, 4):
            train(first, 21, server_round, **{"resumed-after": 1})
        shutil.copytree(tmp_path / "state", tmp_path / "restarted")
        restarted = NodeWorker(state_dir=tmp_path / "restarted")
        try:
            after_restart = train(restarted, 21, 5, catch_up=(1, 2, 3), **{"resumed-after": 1})
        finally:
            restarted.compute_thread.shutdown(wait=True)
        kept_running = train(first, 21, 5, **{"resumed-after": 1})
    finally:
        first.compute_thread.shutdown(wait=True)
    assert all(torch.equal(after_restart[n], kept_running[n]) for n in kept_running)


def test_a_resumed_node_that_cannot_find_its_residuals_fails_naming_where_it_looked(tmp_path, tiny_model_dir):
    """bf16, a resumed run whose folder this node cannot see (`resume-dir` as the server resolved it): the
    node's reply is an error naming the folder, never a round computed with its residuals started from
    zero (before: a relative `resume-from` was looked up in the node's working directory, silently)."""
    from flwr.app import Context

    from parablock_flwr.records import to_record

    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 1, "transfer-dtype": "bf16"})
    missing = tmp_path / "no-such-run"
    round_cfg = dict(worker_request(config, 12, 2, block=1, next_block=-1, num_partitions=2)["round"],
                     **{"run-dir": str(tmp_path / "run"), "resumed-after": 1, "resume-dir": str(missing)})  # fmt: skip
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 12, 6, 6
    res = node.resources(RunConfig.from_flower(config), 12)
    g1 = {n: torch.zeros_like(res.replica.params[n]) for n in res.partition.names(0)}
    msg = Message(content=RecordDict({"round": ConfigRecord(round_cfg), "global-step": to_record(g1)}), dst_node_id=6,
                  message_type=MessageType.TRAIN)  # fmt: skip
    context = Context(run_id=12, node_id=6, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                      run_config=config)  # fmt: skip
    reply = train_inline(msg, context)
    assert reply.has_error() and reply.error.reason.startswith("ResidualsMissing"), reply.error
    assert str(missing) in reply.error.reason and not reply.error.reason.startswith("state-intact")


def test_a_kept_worker_takes_a_resumed_deployments_values_and_keeps_its_residuals(tmp_path, tiny_model_dir, x0_of):
    """bf16, sequential BCD: run 20 answers rounds 1-3 and its server stops; the worker keeps running. The
    resumed run (run 21, a new Flower run: the worker's copy starts at x^0) sends its round 4 with x^2's values
    that keep the node's state (``sync-keeps-state``) and g^3. The reply equals, bit for bit, that of a copy of
    the worker that went on with run 20 (a copy of it, restarted and caught up: the same bits, the test
    above): the values brought its copy to x^3, and its residuals of round 3 were
    kept (a full sync that drops them gives another update)."""
    import shutil

    rounds = BcdRounds(tiny_model_dir, tmp_path, {1: 0, 2: 1, 3: 0, 4: 1})
    train, config, steps = rounds.train, rounds.config, rounds.steps
    kept = NodeWorker(state_dir=tmp_path / "state")
    workers = [kept]
    try:
        for server_round in (1, 2, 3):
            train(kept, 20, server_round)
        shutil.copytree(tmp_path / "state", tmp_path / "uninterrupted")
        workers.append(NodeWorker(state_dir=tmp_path / "uninterrupted"))
        x2 = {n: t.clone() for n, t in x0_of(config).items()}
        for version in (1, 2):
            for n, t in steps[version].items():
                x2[n] = x2[n] + t.to(x2[n].dtype)
        resumed = train(kept, 21, 4, values=x2, **{"resumed-after": 3, "sync-version": 2, "sync-keeps-state": 1})
        went_on = train(workers[1], 20, 4, catch_up=(1, 2))  # a copy of the worker, caught up to x^3
        dropped = train(workers[1], 20, 4, values=x2, **{"sync-version": 2})  # its state dropped: not the same
    finally:
        for worker in workers:
            worker.compute_thread.shutdown(wait=True)
    assert all(torch.equal(resumed[n], went_on[n]) for n in went_on)
    assert not all(torch.equal(dropped[n], went_on[n]) for n in went_on)
