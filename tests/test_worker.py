"""The node worker in process (real tiny Llama, real training, its real compute thread): what it does
when the server replaces its state while a computation runs ahead, and the node-config check of
the ClientApp that relays to it."""

from __future__ import annotations

import inspect
import os
import socket
import threading
import time

import psutil
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from parablock_flwr import core, node
from parablock_flwr.cli import build_parser
from parablock_flwr.client_apps.app import relay_to_worker, unknown_node_config_key
from parablock_flwr.config import RunConfig
from parablock_flwr.model import load_for_training
from parablock_flwr.strategies.parablock.client import CorrectionSlot, ParaBlockClient
from parablock_flwr.wire import join_pieces, unpack
from parablock_flwr.worker.server import NodeWorker, run_worker

from helpers import relayed, tiny_config, worker_request


@pytest.mark.slow
def test_a_full_sync_during_a_computation_ahead_leaves_the_invariant_exact(tmp_path, tiny_model_dir):
    """Round 1 starts round 2's computation ahead; round 2's message is a full sync (the server
    lost track of the node) that arrives while that computation still runs. The worker lets it
    finish, drops it, takes the server's values and recomputes round 2 from x^1: its local model
    is x^1 + Δ^2 to the bit, and its copy of the global model is exactly x^1."""
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 40, "verify-invariant": True})
    worker = NodeWorker()
    reply, update1 = worker.serve_request(worker_request(config, 7, 1, block=0, next_block=1), {})
    assert worker.node.ahead is not None and worker.node.ahead.server_round == 2 and not worker.node.ahead.future.done()

    model, partition = load_for_training(RunConfig.from_flower(config))  # x^0, as the server holds it
    x0 = {n: p.detach().clone() for n, p in model.named_parameters() if n in partition.all_names()}
    g1 = {n: t * 0.5 for n, t in unpack(join_pieces(update1)).items()}  # any step the server may have taken
    arrays = relayed({"global-step": g1, "sync-values": x0})
    reply, update2 = worker.serve_request(
        worker_request(config, 7, 2, block=1, next_block=-1, **{"sync-version": 0}), arrays
    )

    assert reply["metrics"]["base-version"] == 1  # resynchronised: trained from x^1, nothing pending
    x1 = {n: t.clone() for n, t in x0.items()}
    core.apply_step(x1, g1)
    replica = node.resources(RunConfig.from_flower(config), 7).replica
    assert replica.version == 1
    assert all(torch.equal(replica.params[n].detach(), x1[n]) for n in x1)
    delta2 = unpack(join_pieces(update2), lazy=True)  # as the server reads it
    assert reply["trace"]["local-model-sha256"] == core.model_digest(x1, partition.all_names(), delta2)
    assert worker.node.state.pending.base_version == 1 and worker.node.ahead is None


@pytest.mark.parametrize("transfer_dtype", ["int8", "bf16"])
def test_a_node_keeps_its_pending_update_as_it_sent_it(tmp_path, tiny_model_dir, transfer_dtype):
    """ParaBlock's ``Δ_i^r`` lives on the node until the next step while the next block trains: it is kept as it
    travelled (``core.EncodedTensors``, a quarter of its fp32 bytes in int8, half in bf16), and reads back as the
    very values the server received."""
    config = tiny_config(tiny_model_dir, tmp_path, **{"transfer-dtype": transfer_dtype})
    worker = NodeWorker()
    reply, update = worker.serve_request(worker_request(config, 7, 1, block=0, next_block=1), {})
    assert "error" not in reply, reply
    pending = worker.node.state.pending
    assert isinstance(pending.delta, core.EncodedTensors) and pending.base_version == 0
    received = unpack(join_pieces(update))
    assert list(pending.delta) == list(received)
    assert all(torch.equal(pending.delta[n], t) for n, t in received.items())
    worker.node.drop_ahead()


def test_a_computation_ahead_of_another_block_is_dropped_and_the_round_trains_the_block_asked(tmp_path, tiny_model_dir):
    """Round 1 says round 2 trains block 1 and the worker starts it ahead; round 2's message asks for block 0
    (a server whose schedule moved on). The update is block 0's, trained now, never the block-1 update
    computed ahead under round 2's name (before: that one was replied, labelled block 0)."""
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 2})
    worker = NodeWorker()
    try:
        reply, update1 = worker.serve_request(worker_request(config, 7, 1, block=0, next_block=1), {})
        assert worker.node.ahead is not None and worker.node.ahead.job.block == 1
        g1 = relayed({"global-step": {n: t * 0.5 for n, t in unpack(join_pieces(update1)).items()}})
        reply, update2 = worker.serve_request(worker_request(config, 7, 2, block=0, next_block=-1), g1)
    finally:
        worker.compute_thread.shutdown(wait=True)
    assert reply["metrics"]["block"] == 0 and reply["metrics"]["waited-s"] == 0.0  # computed now, not ahead
    partition = node.resources(RunConfig.from_flower(config), 7).partition
    assert set(unpack(join_pieces(update2))) == set(partition.names(0))


def test_without_the_correction_a_node_back_from_a_skipped_round_keeps_its_own_model(tmp_path, tiny_model_dir):
    """correction = "none" in the worker: round 1 runs round 2 ahead, the node is not sampled in
    round 2, round 3's message brings g^1 (catch-up) and g^2. The worker drops the computation
    ahead, trains round 3 from its own model written on x^1, and keeps y = x^0 + Δ^1 + Δ^3."""
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 4, "correction": "none"})
    worker = NodeWorker()
    _, update1 = worker.serve_request(worker_request(config, 7, 1, block=0, next_block=1), {})
    model, partition = load_for_training(RunConfig.from_flower(config))
    x0 = {n: p.detach().clone() for n, p in model.named_parameters() if n in partition.all_names()}
    delta1 = unpack(join_pieces(update1))
    g1 = {n: t * 0.5 for n, t in delta1.items()}
    g2 = {n: torch.randn_like(x0[n]) * 1e-3 for n in partition.names(1)}
    arrays = relayed({"global-step": g2, "catch-up": {f"v1/{n}": t for n, t in g1.items()}})
    message = worker_request(config, 7, 3, block=0, next_block=-1, **{"catch-up-versions": [1], "catch-up-blocks": [0]})
    message["round"]["step-block"] = 1
    reply, update3 = worker.serve_request(message, arrays)

    assert reply["metrics"]["base-version"] == 1  # x^1 + its own offset, one round stale
    replica = node.resources(RunConfig.from_flower(config), 7).replica
    assert replica.version == 2 and worker.node.state.pending.base_version == 2
    own = {n: x0[n] + t for n, t in delta1.items()}
    for n, t in unpack(join_pieces(update3)).items():
        own[n] = own.get(n, x0[n]) + t
    for n, expected in own.items():
        assert torch.allclose(replica.params[n].detach() + worker.node.state.pending.delta[n], expected, atol=1e-6), n
    assert not torch.allclose(replica.params[partition.names(1)[0]], x0[partition.names(1)[0]])  # x moved on


def test_an_unknown_node_config_key_is_named_with_the_closest_known_one():
    assert unknown_node_config_key({"partition-id": 0, "worker-sockt": "/tmp/w.sock"}) == (
        "node config worker-sockt: unknown key; did you mean worker-socket?"
    )
    assert "unknown key; expected one of partition-id" in unknown_node_config_key({"colour": "blue"})
    assert unknown_node_config_key({"partition-id": 1, "num-partitions": 2}) is None


class HeldSlot(CorrectionSlot):
    """The real slot, with the computation held at step ``HOLD``'s boundary until the aggregate is posted:
    the aggregate lands mid-computation whatever the machine's speed."""

    HOLD = 3

    def __init__(self) -> None:
        super().__init__()
        self.reached, self.posted = threading.Event(), threading.Event()

    def post(self, step, own_update) -> None:
        super().post(step, own_update)
        self.posted.set()

    def __call__(self, k, params, before) -> None:
        if k == self.HOLD:
            self.reached.set()
            assert self.posted.wait(timeout=120), "the aggregate never reached the running computation"
        super().__call__(k, params, before)


def test_on_receipt_the_aggregate_lands_at_the_step_boundary_the_computation_is_at(
    tmp_path, tiny_model_dir, monkeypatch
):
    """on-receipt: round 2's message reaches the worker while round 2 runs ahead, held at step 3; the
    aggregate is applied in place at that very boundary (never inside a step), and the reply reports how far
    the live model the round finished on is from the exact x^1 + Δ^2: float rounding only."""
    held = HeldSlot()
    slots = iter([CorrectionSlot(), held])  # round 1's computation (nothing to receive), round 2's ahead
    monkeypatch.setattr(ParaBlockClient, "new_slot", lambda self: next(slots))
    config = tiny_config(tiny_model_dir, tmp_path, **{"local-steps": 6, "correction": "on-receipt"})
    worker = NodeWorker()
    _, update1 = worker.serve_request(worker_request(config, 7, 1, block=1, next_block=1), {})
    assert held.reached.wait(timeout=120), "round 2's computation ahead never reached step 3"
    g1 = relayed({"global-step": {n: t * 0.5 for n, t in unpack(join_pieces(update1)).items()}})
    reply, _ = worker.serve_request(worker_request(config, 7, 2, block=1, next_block=-1), g1)
    metrics = reply["metrics"]
    assert metrics["correction-after-step"] == HeldSlot.HOLD
    assert 0.0 <= metrics["correction-drift"] < 1e-5, metrics["correction-drift"]


def test_a_stuck_worker_is_an_error_reply_after_round_timeout_s(tmp_path):
    """The relay's wait for the worker is bounded by round-timeout-s: a worker that accepts the
    message and never answers (a fault a healthy worker cannot produce) gives an error reply."""
    path = tmp_path / "stuck.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 5, 0
    msg = Message(content=RecordDict({"round": ConfigRecord({"server-round": 1})}), dst_node_id=5,
                  message_type=MessageType.TRAIN)  # fmt: skip
    TaskIdentity.node_id = 5
    context = Context(run_id=1, node_id=5, node_config={"worker-socket": str(path)}, state=RecordDict(),
                      run_config={"round-timeout-s": 1.0})  # fmt: skip
    started = time.monotonic()
    try:
        reply = relay_to_worker(msg, context, str(path))
    finally:
        server.close()
    assert reply.has_error() and "did not answer within round-timeout-s=1" in reply.error.reason
    assert time.monotonic() - started < 10


def test_the_worker_lives_as_long_as_its_node_unless_asked():
    """No idle exit by default (a node not sampled for hours keeps its model and pending update)."""
    parser_default = build_parser().parse_args(["worker", "--socket", "/tmp/w.sock"]).idle_exit_s
    assert parser_default == 0 and inspect.signature(run_worker).parameters["idle_exit_s"].default == 0


def test_the_worker_logs_one_line_per_round(tmp_path, tiny_model_dir, caplog):
    """An operator at a site sees each round: round, block, loss, compute time, bytes in and out, and
    the wait for the server since the node's last reply (numbers only: nothing of the data)."""
    import logging
    import re

    config = tiny_config(tiny_model_dir, tmp_path)
    worker = NodeWorker()
    caplog.set_level(logging.INFO, logger="parablock_flwr.worker.server")
    _, update1 = worker.serve_request(worker_request(config, 9, 1, block=0, next_block=1), {})
    worker.last_reply_sent = time.time() - 2.0  # what serving over the socket records when the reply leaves
    step = {n: t * 0.5 for n, t in unpack(join_pieces(update1)).items()}
    arrays = relayed({"global-step": step})
    reply, update2 = worker.serve_request(worker_request(config, 9, 2, block=1, next_block=-1), arrays)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round ")]
    assert len(lines) == 2 and "waited for the server - (first request of this run)" in lines[0]
    pattern = (
        r"round 2 block 1: train-loss (\d+\.\d{4}), compute (\d+\.\d\d) s, in ([\d.]+) MB, out ([\d.]+) MB, "
        r"waited for the server (\d+\.\d\d) s, peak memory (\d+\.\d\d) GB"
    )
    loss, compute, mb_in, mb_out, waited, peak = map(float, re.fullmatch(pattern, lines[1]).groups())
    assert loss == pytest.approx(reply["metrics"]["train-loss"], abs=1e-4)
    assert compute == pytest.approx(reply["metrics"]["compute-s"], abs=0.01) and compute > 0
    assert mb_in == pytest.approx(sum(a.nbytes for a in arrays.values()) / 1e6, abs=0.01) and mb_in > 0
    assert mb_out == pytest.approx(sum(p.nbytes for ps in update2.values() for p in ps) / 1e6, abs=0.01)
    assert 2.0 <= waited < 60
    # The process's peak memory (VmHWM) so far: at least what it holds now, the figure a site is sized by.
    peak_bytes = reply["metrics"]["peak-rss-bytes"]
    assert peak_bytes >= psutil.Process().memory_info().rss * 0.9 and peak == pytest.approx(peak_bytes / 1e9, abs=0.01)


MAPPED_BUFFERS = """
import json
from parablock_flwr.memory import map_large_buffers

def rss_mib():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) // 1024

kept = []
def round_buffer(mib):  # a block's buffer, written through, then freed, as a round does
    buffer = bytearray(mib * 2**20)
    buffer[:: 4096] = b"x" * (len(buffer) // 4096)
    kept.append(bytearray(2 * 2**20))  # what lives on past the round (a residual, the pending update)
    del buffer

out = {"mapped": map_large_buffers(), "start": rss_mib()}
for mib in (256, 260, 264):  # blocks differ in size: a buffer freed cannot always take the next one
    round_buffer(mib)
out["after_three"] = rss_mib()
print(json.dumps(out))
"""


STREAM_MESSAGES = """
import json, resource, threading
from parablock_flwr.memory import map_large_buffers
from parablock_flwr.transport.service import CHUNK_BYTES

source = memoryview(bytearray(64 * 2**20))
faults = []

def messages():  # a record's messages as gRPC hands them over: each copied into bytes of its own, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for start in range(0, len(source), CHUNK_BYTES):
        message = bytes(source[start : start + CHUNK_BYTES])
        del message
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

mapped = map_large_buffers()
for _ in range(2):  # the main heap, then a thread's (gRPC's threads have heaps of their own)
    messages()
    thread = threading.Thread(target=messages)
    thread.start()
    thread.join()
print(json.dumps({"mapped": mapped, "faults": faults}))
"""


def test_a_process_that_maps_its_large_buffers_reuses_its_heaps_pages_for_the_streams_messages():
    """``memory.map_large_buffers`` keeps what a heap frees at its top (``HEAP_KEPT_BYTES``): a record's messages
    (``CHUNK_BYTES``, under the mapping threshold), each made and freed in turn, fault in a message's pages once,
    not each message's. With glibc's own 128 KiB kept, 64 MiB of messages faulted in most of their 64 MiB again."""
    import json
    import subprocess
    import sys

    from parablock_flwr.memory import _glibc

    if _glibc() is None:
        pytest.skip("glibc only: elsewhere map_large_buffers changes nothing")
    done = subprocess.run([sys.executable, "-c", STREAM_MESSAGES], capture_output=True, text=True, check=True)
    out = json.loads(done.stdout)
    assert out["mapped"] is True
    assert max(out["faults"][2:]) * 4096 < 4 * 2**20, out  # the second pass of each heap: pages in place


def test_a_process_that_maps_its_large_buffers_gives_each_back_when_freed_whatever_lives_on_beside_it():
    """``memory.map_large_buffers`` (the worker's entry calls it, and a deployment's ServerApp): three rounds of
    block-sized buffers of different sizes, each freed while a buffer allocated after it lives on, leave the
    process holding only what lives on. In one heap (glibc's threshold raised, or the heap kept), each buffer
    freed stays pinned below the one that lives on, and the process grows by a block a round. In a fresh
    process: the setting is the whole process's."""
    import json
    import subprocess
    import sys

    from parablock_flwr.memory import _glibc

    if _glibc() is None or not os.path.exists("/proc/self/status"):
        pytest.skip("glibc and /proc only: elsewhere map_large_buffers changes nothing")
    done = subprocess.run([sys.executable, "-c", MAPPED_BUFFERS], capture_output=True, text=True, check=True)
    rss = json.loads(done.stdout)
    assert rss["mapped"] is True  # glibc here
    assert rss["after_three"] < rss["start"] + 3 * 2 + 32, rss  # what lives on, and no block kept
