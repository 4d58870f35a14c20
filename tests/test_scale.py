"""What keeps a run's memory, disk and records from growing with its number of virtual clients: a node's
pending update on disk in its transfer dtype, the server's accepted updates spilled as they came, and one
record line per round of a fixed size (per-node detail in nodes.jsonl)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from parablock_flwr import core
from parablock_flwr.messages import TrainMetrics
from parablock_flwr.metrics import RunRecorder
from parablock_flwr.node.state import PendingStore
from parablock_flwr.strategies.reply_checks import Reply
from parablock_flwr.strategies.round_stats import RoundStats, round_record
from parablock_flwr.strategies.update_spill import UpdateSpill
from parablock_flwr.tensor_file import DIRECT_ALIGNMENT
from parablock_flwr.wire import pack


def block(seed: int = 0) -> core.Tensors:
    gen = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 48, generator=gen) * 1e-3, "a.bias": torch.randn(48, generator=gen)}


@pytest.mark.parametrize("dtype", ["int8", "bf16", "fp16", "fp32"])
def test_a_pending_update_is_kept_on_disk_in_its_transfer_dtype_and_read_back_bit_for_bit(tmp_path, dtype):
    sent = core.round_for_transfer(block(), dtype)  # what a node sends, and keeps
    store = PendingStore(tmp_path)
    store.save(core.PendingUpdate(3, 7, sent), dtype)
    back = store.load()
    assert (back.block, back.base_version) == (3, 7)
    assert all(torch.equal(back.delta[n], t) for n, t in sent.items())
    fp32_bytes = sum(t.numel() * 4 for t in sent.values())
    size = store.path.stat().st_size
    share = {"int8": 0.25, "bf16": 0.5, "fp16": 0.5, "fp32": 1.0}[dtype]
    header = DIRECT_ALIGNMENT  # the data starts on a page
    assert size < fp32_bytes * share * 1.1 + header, (size, fp32_bytes)  # values, scales, layout, the header
    store.save(None, dtype)
    assert store.load() is None and not store.path.exists()


@pytest.mark.parametrize("dtype", ["int8", "bf16", "fp16"])
def test_a_pending_update_kept_as_it_was_sent_is_stored_from_its_encoding_without_decoding_it(
    tmp_path, dtype, monkeypatch
):
    """A node's pending update as it keeps it (``core.kept_encoded``) goes to disk from its encoding: neither the
    store nor a membership test decodes a tensor, and what is read back is the very bits sent."""
    sent, _, encoded = core.round_with_feedback_encoded(block(), None, dtype)
    kept = core.kept_encoded(sent, encoded)
    decoded = []
    decode = core.EncodedTensors.__getitem__
    monkeypatch.setattr(core.EncodedTensors, "__getitem__", lambda self, n: decoded.append(n) or decode(self, n))
    store = PendingStore(tmp_path)
    store.save(core.PendingUpdate(3, 7, kept), dtype)
    assert "a.bias" in kept and "b" not in kept and decoded == []
    back = store.load()
    assert all(torch.equal(back.delta[n].view(torch.int32), t.view(torch.int32)) for n, t in sent.items())


def test_a_pending_update_the_transfer_dtype_cannot_hold_is_kept_in_fp32(tmp_path):
    """The ``correction = "none"`` ablation keeps an offset that is a sum of several sent updates."""
    offset = block(1)
    store = PendingStore(tmp_path)
    store.save(core.PendingUpdate(0, 1, offset), "int8")
    assert all(torch.equal(store.load().delta[n], t) for n, t in offset.items())


def test_the_spill_gives_back_each_update_as_it_was_checked(tmp_path):
    spill = UpdateSpill(tmp_path, in_memory=0)
    spill.start()
    shapes = {n: tuple(t.shape) for n, t in block().items()}
    sent = {node: core.round_for_transfer(block(node), "int8") for node in range(5)}
    for node in (3, 0, 4, 1, 2):  # in the order replies arrive
        spill.put(node, pack(sent[node], "int8"))
    assert spill.path.stat().st_size < 5 * sum(t.numel() for t in sent[0].values()) * 1.1 + 5 * 1024  # int8
    for node in range(5):  # in partition order
        back = spill.take(node, shapes)
        assert all(torch.equal(back[n], t) for n, t in sent[node].items())
    spill.start()
    assert spill.path.stat().st_size == 0


def record_line(tmp_path, clients: int) -> tuple[int, int]:
    """The bytes of round 1's line in metrics.jsonl and nodes.jsonl with ``clients`` accepted replies."""
    accepted = [
        Reply(
            node=10_000 + i,
            metrics=TrainMetrics(
                server_round=1,
                block=0,
                partition_id=i,
                base_version=0,
                num_examples=8,
                train_loss=1.5,
                compute_s=0.25,
                process_id=4242,
            ),  # fmt: skip
            update=None,
            payload_bytes=1000,
        )
        for i in range(clients)
    ]
    stats = RoundStats(1, nodes=[r.node for r in accepted], num_replies=clients)
    step = {"w": torch.zeros(10)}
    record = round_record(stats, "layers.0", 0, step, accepted, [8.0] * clients, core.LinkModel(50, 50, 50), True)
    run_dir = tmp_path / f"run-{clients}"
    RunRecorder(run_dir).write(record)
    return len((run_dir / "metrics.jsonl").read_bytes()), len((run_dir / "nodes.jsonl").read_bytes())


def test_a_round_record_line_does_not_grow_with_the_clients(tmp_path):
    small, small_nodes = record_line(tmp_path, 10)
    large, large_nodes = record_line(tmp_path, 1000)
    assert large - small <= 32, (small, large)  # only the counts' digits
    assert large_nodes > 50 * small_nodes  # the per-node detail went to nodes.jsonl
    detail = json.loads((tmp_path / "run-1000" / "nodes.jsonl").read_text())
    assert len(detail["served_by"]) == 1000 and detail["served_by"][0] == {"partition_id": 0, "process_id": 4242}


def test_wire_arrays_of_a_spill_are_numpy(tmp_path):
    """The spill writes what ``wire.pack`` gives: numpy arrays, any dtype it uses."""
    arrays = pack(core.round_for_transfer(block(), "bf16"), "bf16")
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
    spill = UpdateSpill(tmp_path, in_memory=0)
    spill.start()
    spill.put(1, arrays)
    back = spill.take(1, {n: tuple(t.shape) for n, t in block().items()})
    assert all(torch.equal(back[n], t) for n, t in core.round_for_transfer(block(), "bf16").items())


def test_a_round_of_a_few_sites_holds_its_updates_in_memory_and_spills_only_beyond(tmp_path):
    """A deployment's few sites never write and read their blocks back between the round's last reply
    and its step; a round of more clients than ``in_memory`` spills the rest, and each comes back exact."""
    spill = UpdateSpill(tmp_path, in_memory=2)
    spill.start()
    shapes = {"w": (3, 4)}
    updates = {node: torch.randn(3, 4) for node in range(5)}
    packed = {node: pack({"w": update}, "fp32") for node, update in updates.items()}
    for node, arrays in packed.items():
        spill.put(node, arrays)
    assert spill.path.stat().st_size == sum(a.nbytes for node in (2, 3, 4) for a in packed[node].values())
    for node, update in updates.items():
        assert torch.equal(spill.take(node, shapes)["w"], update)
