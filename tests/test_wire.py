"""How tensors travel (wire.py, core's transfer rounding): packed records, int8 with its scales, error
feedback. Fast: no Flower process, no model (the malformed replies are tests/test_reply_properties.py's)."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from hypothesis import given, settings
from hypothesis import strategies as st

from parablock_flwr import core, wire
from parablock_flwr.node.state import ResidualStore
from parablock_flwr.records import flower_ready, payloads_record, pieces_record, to_tensors
from parablock_flwr.transport.framing import framed

SHAPES = {"w": (7, 300), "b": (300,), "s": (), "e": (0, 4)}  # a partial int8 block, a scalar, an empty tensor


def tensors(seed: int, scale: float = 1e-3) -> core.Tensors:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


magnitudes = st.sampled_from([0.0, 1e-42, 1e-30, 1e-8, 1e-3, 1.0, 1e6, 1e30])


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), magnitude=magnitudes, transfer_dtype=st.sampled_from(list(core.TRANSFER_DTYPES)))
def test_rounded_values_travel_bit_exact_and_rounding_twice_changes_nothing(seed, magnitude, transfer_dtype):
    """What makes every copy of x identical: the server applies ``round(g)`` and sends it, the client keeps
    ``round(Δ + e)`` and sends it; both arrive to the bit (``unpack(pack(round(t))) == round(t)``), and
    rounding a rounded value again (the server encodes the step it already rounded) is the identity. For
    int8 that holds because its scales are powers of two (a float scale would move by an ulp)."""
    values = tensors(seed, magnitude)
    if transfer_dtype == "fp16" and magnitude > 6e4:
        values = {n: t.clamp(-6e4, 6e4) for n, t in values.items()}  # beyond fp16's range: inf, refused
    rounded = core.round_for_transfer(values, transfer_dtype)
    again = core.round_for_transfer(rounded, transfer_dtype)
    arrived = wire.unpack(wire.pack(rounded, transfer_dtype), dict(SHAPES), transfer_dtype)
    read_when_used = wire.unpack(wire.pack(rounded, transfer_dtype), dict(SHAPES), transfer_dtype, lazy=True)
    assert isinstance(read_when_used, wire.Decoded) and list(read_when_used) == list(SHAPES)
    for name in SHAPES:
        assert rounded[name].shape == SHAPES[name] and arrived[name].dtype == torch.float32
        assert torch.equal(again[name], rounded[name]), name
        assert torch.equal(arrived[name], rounded[name]), name
        assert torch.equal(read_when_used[name], rounded[name]) and torch.equal(read_when_used[name], rounded[name])


def reference_int8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 as its definition reads (one pass per step, a padded copy, |v| copied): q, s, and q * s."""
    flat = tensor.reshape(-1).float()
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, core.int8_blocks(n) * core.INT8_BLOCK - n)).view(-1, core.INT8_BLOCK)
    bound = blocks.abs().amax(dim=1) / 127
    mantissa, exponent = torch.frexp(bound)
    scale = torch.pow(2.0, (exponent - (mantissa == 0.5).to(exponent.dtype)).double()).float()
    scale = torch.where(bound.isfinite(), torch.where(bound > 0, scale, 0.0), bound)
    q = (blocks / torch.where(scale > 0, scale, 1.0)[:, None]).round().clamp(-127, 127).nan_to_num(0.0)
    q = q.to(torch.int8).view(-1)[:n]
    return q, scale, q.float() * scale.repeat_interleave(core.INT8_BLOCK)[:n]


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    size=st.integers(0, 3 * core.INT8_BLOCK + 1),
    magnitude=magnitudes,
    special=st.sampled_from([None, "nan", "inf", "-inf", "half-zero"]),
)
def test_int8_with_fewer_passes_gives_its_definition_to_the_bit(seed, size, magnitude, special):
    """``quantize_int8`` and ``dequantize_int8`` skip copies (no padding for whole blocks, max|v| as
    max(max, -min), in-place rounding, scales broadcast, not repeated): the same q, s and values, bit
    for bit, as the definition computed step by step, partial blocks, zeros and non-finite values included."""
    t = torch.randn(size, generator=torch.Generator().manual_seed(seed)) * magnitude
    if size and special == "half-zero":
        t[: size // 2] = 0.0
    elif size and special is not None:
        t[seed % size] = float(special)
    q, scale = core.quantize_int8(t)
    ref_q, ref_scale, ref_values = reference_int8(t)
    assert torch.equal(q, ref_q) and torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))
    assert torch.equal(core.dequantize_int8(q, scale).view(torch.int32), ref_values.view(torch.int32))


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    size=st.integers(0, 5 * core.INT8_BLOCK + 3),
    magnitude=magnitudes,
    special=st.sampled_from([None, "nan", "inf", "half-zero"]),
    transfer_dtype=st.sampled_from(list(core.TRANSFER_DTYPES)),
)
def test_rounding_chunk_by_chunk_gives_the_whole_tensors_bits(seed, size, magnitude, special, transfer_dtype):
    """``quantize_int8`` and ``round_with_feedback`` work through a tensor in chunks of ``CHUNK_VALUES``
    values (here two int8 blocks, so that a few hundred values cross several chunks and a short last block):
    the same q, scales, sent values and residuals, bit for bit, as the definition over the whole tensor
    (``reference_int8``; ``Δ + e`` rounded, then ``Δ + e − sent``)."""
    gen = torch.Generator().manual_seed(seed)
    update, residual = torch.randn(size, generator=gen) * magnitude, torch.randn(size, generator=gen) * 1e-6
    if size and special == "half-zero":
        update[: size // 2], residual[: size // 2] = 0.0, 0.0
    elif size and special is not None:
        update[seed % size] = float(special)
    if transfer_dtype == "fp16":
        update = update.nan_to_num(0.0, 6e4, -6e4).clamp(-6e4, 6e4)
    corrected = update + residual
    expected = core.round_for_transfer({"t": corrected}, transfer_dtype)["t"]
    chunk = core.transfer_precision.CHUNK_VALUES
    try:
        core.transfer_precision.CHUNK_VALUES = 2 * core.INT8_BLOCK
        if transfer_dtype == "int8":
            q, scale = core.quantize_int8(update)
            ref_q, ref_scale, _ = reference_int8(update)
            assert torch.equal(q, ref_q) and torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))
        sent, kept = core.round_with_feedback({"t": update}, {"t": residual}, transfer_dtype)
    finally:
        core.transfer_precision.CHUNK_VALUES = chunk
    assert torch.equal(sent["t"].view(torch.int32), expected.view(torch.int32))
    assert torch.equal(kept["t"].view(torch.int32), (corrected - expected).view(torch.int32))


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    shape=st.sampled_from([(0,), (1,), (255,), (257,), (3, 300), (2, 2, 129)]),
    magnitude=magnitudes,
    transfer_dtype=st.sampled_from(list(core.TRANSFER_DTYPES)),
)
def test_an_update_kept_as_it_travelled_reads_back_as_the_very_bits_sent(seed, shape, magnitude, transfer_dtype):
    """A ParaBlock node keeps its pending update ``Δ_i^r`` as it travelled (``core.kept_encoded``: int8's values
    and scales, bf16, fp16), not in fp32: each read gives ``sent``'s bits and shape, every time, and the values it
    holds are the encoding's own (a quarter of fp32's bytes in int8). fp32 keeps ``sent`` itself."""
    gen = torch.Generator().manual_seed(seed)
    update = {"a": torch.randn(shape, generator=gen) * magnitude, "b": torch.randn(7, generator=gen)}
    sent, _, encoded = core.round_with_feedback_encoded(update, None, transfer_dtype)
    kept = core.kept_encoded(sent, encoded if transfer_dtype != "fp32" else None)
    if transfer_dtype == "fp32":
        assert kept is sent
        return
    assert isinstance(kept, core.EncodedTensors) and list(kept) == list(sent) and len(kept) == 2
    for _ in range(2):
        for name, t in kept.items():
            assert t.shape == sent[name].shape and torch.equal(t.view(torch.int32), sent[name].view(torch.int32))
    held = sum(v.nbytes + (s.nbytes if s is not None else 0) for v, s in encoded.values())
    assert held <= sum(t.nbytes for t in sent.values()) * (0.27 if transfer_dtype == "int8" else 0.5) + 8


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), magnitude=magnitudes, transfer_dtype=st.sampled_from(list(core.TRANSFER_DTYPES)))
def test_the_servers_step_rounded_and_packed_in_one_conversion_is_round_then_pack(seed, magnitude, transfer_dtype):
    """``round_and_pack`` (the server's step: one conversion) gives ``round_for_transfer``'s values to the
    bit and the very arrays ``pack`` writes for them, which decode to those values."""
    values = tensors(seed, magnitude)
    if transfer_dtype == "fp16" and magnitude > 6e4:
        values = {n: t.clamp(-6e4, 6e4) for n, t in values.items()}
    rounded, pieces = wire.round_and_pack(values, transfer_dtype)
    expected = core.round_for_transfer(values, transfer_dtype)
    assert list(rounded) == list(values)
    assert all(rounded[n].dtype == torch.float32 and torch.equal(rounded[n], expected[n]) for n in values)
    packed = wire.pack(expected, transfer_dtype)
    assert {k: wire.join(v).tobytes() for k, v in pieces.items()} == {k: v.tobytes() for k, v in packed.items()}
    decoded = wire.unpack({k: wire.join(v) for k, v in pieces.items()})
    assert all(torch.equal(decoded[n], expected[n]) for n in values)


@pytest.mark.parametrize("transfer_dtype", list(core.TRANSFER_DTYPES))
@pytest.mark.parametrize("server_lr,dp", [(1.0, False), (0.7, False), (1.0, True), (0.7, True)])
def test_the_servers_round_in_one_pass_is_the_mean_the_step_and_x_plus_g_one_after_another(
    transfer_dtype, server_lr, dp, monkeypatch
):
    """``core.applied_mean_step`` (the server's default round, one pass over the block) gives the bits of
    ``aggregate``, ``global_step``, ``round_and_pack`` and ``added`` one after another: the same wire bytes, the
    same step as read back, the same new ``x``; three updates as the server holds them (decoded when read), a
    tensor of several chunks and a short last one, a partial int8 block, a scalar, an empty tensor. With
    differential privacy (central), the same with ``clip`` before the mean and ``add_noise`` after it, two of the
    three updates outside the clip ball."""
    for chunk_values in ("CHUNK_VALUES", "ONE_PASS_CHUNK_VALUES"):  # several chunks of a small block, both ways
        monkeypatch.setattr(core.transfer_precision, chunk_values, 4 * core.INT8_BLOCK)
    shapes = {**SHAPES, "big": (4 * core.INT8_BLOCK * 2 + 300,)}
    g = torch.Generator().manual_seed(3)
    x = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    sent = [{n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes.items()} for _ in range(3)]
    updates = [wire.unpack(wire.pack(core.round_for_transfer(u, transfer_dtype), transfer_dtype), shapes, lazy=True)
               for u in sent]  # fmt: skip
    weights = [3.0, 1.0, 2.0]
    clip_norm = min(core.l2_norm(u) for u in updates)  # binds for the two others
    scales, noise, std = [None] * 3, None, 0.0
    if dp:
        scales, noise, std = [core.clip_scale(u, clip_norm) for u in updates], core.gaussian(x, 11), 0.02
    assert sum(s is not None for s in scales) == (2 if dp else 0)
    mean = core.aggregate([core.clip(u, clip_norm)[0] if dp else u for u in updates], weights)
    mean = core.add_noise(mean, noise, std) if dp else mean
    step, pieces = wire.round_and_pack(core.global_step(mean, server_lr), transfer_dtype, lazy=True)
    expected = {n: core.added(x[n], core.read_chunks(step, n)) for n in shapes}
    encoded, new, not_finite = core.applied_mean_step(
        updates, weights, server_lr, x, transfer_dtype, clip_scales=scales, noise=noise, noise_std=std
    )
    one_pass, one_pass_pieces = wire.pack_encoded(encoded, shapes, transfer_dtype)
    assert not_finite is None and list(new) == list(shapes)
    assert {k: wire.join(v).tobytes() for k, v in one_pass_pieces.items()} == {
        k: wire.join(v).tobytes() for k, v in pieces.items()
    }
    assert all(torch.equal(one_pass[n], step[n]) and torch.equal(new[n], expected[n]) for n in shapes)
    assert all(new[n].shape == x[n].shape for n in shapes)
    # Written where it travels from (the server's step): its record is the joined one, byte for byte, read where
    # the pass wrote it; Flower's own path gets bytes of it, the same object for Flower as the joined record.
    encoded_into, payloads = wire.encoding_payloads(shapes, transfer_dtype)
    in_place, _, _ = core.applied_mean_step(updates, weights, server_lr, x, transfer_dtype, clip_scales=scales,
                                            noise=noise, noise_std=std, encoded_into=encoded_into)  # fmt: skip
    assert all(in_place[n][0].data_ptr() == encoded_into[n][0].data_ptr() for n in shapes)
    record, joined = payloads_record(payloads), pieces_record(pieces)
    assert all(isinstance(a.data, memoryview) and a.data.readonly for a in record.values())
    assert {k: bytes(a.data) for k, a in record.items()} == {k: a.data for k, a in joined.items()}
    address = lambda buffer: np.frombuffer(buffer, np.uint8).ctypes.data  # noqa: E731
    assert address(payloads["values"]) in map(address, framed(record).parts)  # the stream sends them as they lie
    for field, value in {"_run_id": 1, "_task_id": 1, "_node_id": 0}.items():  # the ServerApp's, as Flower sets them
        monkeypatch.setattr(TaskIdentity, field, value)
    flower_ready(Message(RecordDict({"step": record}), dst_node_id=1, message_type=MessageType.TRAIN))
    assert all(type(a.data) is bytes for a in record.values()) and record.object_id == joined.object_id


def test_the_servers_round_in_one_pass_names_the_first_tensor_whose_new_values_are_not_finite():
    """A finite step can carry ``x`` past fp32's range: the pass says where (the server then rejects it)."""
    x = {"a": torch.ones(600), "b": torch.full((600,), 3e38), "c": torch.full((600,), 3e38)}
    update = {"a": torch.ones(600), "b": torch.full((600,), 3e38), "c": torch.full((600,), 3e38)}
    assert core.applied_mean_step([update], [1.0], 1.0, x, "fp32")[2] == "b"
    with pytest.raises(ValueError, match="2 updates, 1 weights and 2 clip scales"):
        core.applied_mean_step([update, update], [1.0], 1.0, x, "fp32")


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31), magnitude=magnitudes.filter(lambda m: m >= 1e-30))  # normal floats: exact q * s
def test_int8_rounds_each_block_to_nearest_within_half_its_scale(seed, magnitude):
    """Symmetric, round to nearest: each value moves by at most half its block's scale, and the scale is
    the smallest power of two that keeps the block's largest value within 127 steps (within a factor 2
    of max/127, the price of exact scales)."""
    t = torch.randn(5 * core.INT8_BLOCK + 3, generator=torch.Generator().manual_seed(seed)) * magnitude
    q, scale = core.quantize_int8(t)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and len(scale) == core.int8_blocks(t.numel()) == 6
    per_value = scale.repeat_interleave(core.INT8_BLOCK)[: t.numel()]
    assert torch.all((core.dequantize_int8(q, scale) - t).abs() <= per_value / 2)
    block_max = torch.nn.functional.pad(t.abs(), (0, 6 * core.INT8_BLOCK - t.numel())).view(6, -1).amax(1)
    assert torch.all((scale >= block_max / 127) & (scale < 2 * block_max / 127))


def test_int8_payload_is_a_quarter_of_fp32_plus_its_scales():
    block = {"w": torch.randn(576, 1536), "n": torch.randn(576)}
    fp32, int8 = wire.pack(block, "fp32"), wire.pack(block, "int8")
    assert int8["values"].nbytes * 4 == fp32["values"].nbytes
    assert int8["scales"].nbytes == 4 * (576 * 1536 // core.INT8_BLOCK + math.ceil(576 / core.INT8_BLOCK))
    assert wire.payload_bytes(block, "int8") == int8["values"].nbytes + int8["scales"].nbytes
    assert (int8["values"].nbytes + int8["scales"].nbytes) / fp32["values"].nbytes < 0.25 + 4 / core.INT8_BLOCK


@pytest.mark.parametrize("transfer_dtype", ["bf16", "fp16", "int8"])
def test_error_feedback_sends_in_total_what_was_computed(transfer_dtype):
    """Ten updates of one block, each sent as ``round(Δ + e)``: the client keeps exactly what it sent, and
    what rounding dropped is carried, so the sum of what was sent plus the last residual is the sum of the
    true updates up to fp32 rounding of the sums (the residual never grows: at most one rounding step)."""
    updates = [tensors(seed) for seed in range(10)]
    residual, sent_total = None, {n: torch.zeros(s) for n, s in SHAPES.items()}
    for update in updates:
        sent, residual = core.round_with_feedback(update, residual, transfer_dtype)
        again = core.round_for_transfer(sent, transfer_dtype)
        assert all(torch.equal(sent[n], again[n]) for n in SHAPES)  # what it keeps is what arrives
        for n in SHAPES:
            sent_total[n] += sent[n]
    true_total = {n: sum(u[n] for u in updates) for n in SHAPES}
    for n in SHAPES:
        assert torch.allclose(sent_total[n] + residual[n], true_total[n], rtol=0, atol=1e-8), n
    largest = max(float(t.abs().max()) for t in updates[0].values() if t.numel())
    assert max(float(r.abs().max()) for r in residual.values() if r.numel()) < largest / 50
    if transfer_dtype == "int8":
        without = core.round_for_transfer(updates[0], "int8")  # rounding alone loses something
        assert not all(torch.equal(without[n], updates[0][n]) for n in SHAPES if updates[0][n].numel())


def test_the_int8_residual_store_gives_back_the_residual_a_resume_continues_with(tmp_path):
    """int8's residuals go to the node's durable store as fp32; a resumed node that reads them back sends
    exactly the update the uninterrupted one sends (same residual, same rounding)."""
    store = ResidualStore(tmp_path / "partition-0")
    sent1, residual = core.round_with_feedback(tensors(1), None, "int8")
    store.save(1, 0, residual)
    uninterrupted, _ = core.round_with_feedback(tensors(2), residual, "int8")
    resumed, _ = core.round_with_feedback(tensors(2), store.as_of(1)[0], "int8")
    assert all(torch.equal(uninterrupted[n], resumed[n]) for n in SHAPES)
    assert any(bool(r.abs().max() > 0) for r in store.as_of(1)[0].values() if r.numel())


def test_unpack_decodes_by_what_the_payload_carries():
    """The receiver needs no setting: the payload's dtype says how to decode; a receiver that expects a
    dtype or shapes refuses what differs, with one line. A record without arrays (the server's first
    global step, ``ArrayRecord()``) holds no tensors, and is refused where tensors are expected."""
    assert to_tensors(ArrayRecord()) == {}
    with pytest.raises(wire.WireError, match=r"wrong parameters: missing \['b', 'e', 's'\]"):
        to_tensors(ArrayRecord(), SHAPES)
    rounded = core.round_for_transfer(tensors(3), "int8")
    arrays = wire.pack(rounded, "int8")
    assert all(torch.equal(wire.unpack(arrays)[n], rounded[n]) for n in SHAPES)  # no setting needed
    reordered = wire.unpack(wire.pack(dict(reversed(rounded.items())), "int8"), SHAPES)  # another order
    assert list(reordered) == list(SHAPES) and all(torch.equal(reordered[n], rounded[n]) for n in SHAPES)
    bad = arrays["scales"].copy()
    bad[2] = np.float32(3.0)
    for lazy in (False, True):  # a record read when used (a node's) is refused as soon as it is unpacked all the same
        with pytest.raises(wire.WireError, match=r"wrong dtype for values: int8, expected int16 \(transfer-dtype="):
            wire.unpack(arrays, transfer_dtype="bf16", lazy=lazy)
        with pytest.raises(wire.WireError, match=r"wrong shape for w: \(7, 300\), expected \(300, 7\)"):
            wire.unpack(arrays, {**SHAPES, "w": (300, 7)}, lazy=lazy)
        with pytest.raises(wire.WireError, match=r"scales: 11, expected 12 \(one per 256 values of each tensor\)"):
            wire.unpack({**arrays, "scales": arrays["scales"][:-1]}, lazy=lazy)
        with pytest.raises(wire.WireError, match=r"int8 scale 3.0: expected 0 or a power of two"):
            wire.unpack({**arrays, "scales": bad}, lazy=lazy)


@pytest.mark.parametrize("transfer_dtype", ["int8", "bf16", "fp16", "fp32"])
def test_the_aggregate_of_updates_read_as_they_came_has_the_bits_of_decoded_ones(transfer_dtype):
    """The server takes each accepted update from the round's spill as it came (``unpack(lazy=True)``): the
    first is scaled into the sum chunk by chunk (``core.scaled``), the others added chunk by chunk
    (``core.add_scaled``), none decoded whole; the sum has the bits of the same updates decoded first, for one
    reply and for three."""
    torch.manual_seed(3)
    shapes = {"a": (300, 701), "b": (5,)}
    updates = [{n: torch.randn(s) * 1e-3 for n, s in shapes.items()} for _ in range(3)]
    packed = [wire.pack(u, transfer_dtype) for u in updates]
    for count, weights in ((1, [2.0]), (3, [1.0, 3.0, 0.5])):
        eager = core.aggregate([wire.unpack(p, shapes) for p in packed[:count]], weights)
        lazy = [wire.unpack(p, shapes, lazy=True) for p in packed[:count]]
        with mock.patch.object(wire.Payload, "__call__", side_effect=AssertionError("an update decoded whole")):
            summed = core.aggregate(lazy, weights)
        assert all(torch.equal(summed[n], eager[n]) for n in shapes)


def test_an_update_of_another_shape_than_the_rounds_buffer_is_refused_not_resized_into_it():
    """``core.scaled`` writes the first update into the round's prepared buffer: an update of another shape is a
    ValueError naming it (torch.mul would resize the buffer), whether it reads in chunks or whole."""
    buffer = torch.empty(4, 5)
    with pytest.raises(ValueError, match=r"a: the update's shape is \(20,\), expected \(4, 5\)"):
        core.aggregate([{"a": torch.ones(20)}], [1.0], out={"a": buffer})
    lazy = wire.unpack(wire.pack({"a": torch.ones(21)}, "int8"), {"a": (21,)}, lazy=True)
    with pytest.raises(ValueError, match=r"a: the update's chunks hold 21 values, expected 20"):
        core.aggregate([lazy], [1.0], out={"a": buffer})
    assert buffer.shape == (4, 5)


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transfer_dtype", ["int8", "bf16", "fp32"])
def test_a_step_applied_from_its_payload_has_the_bits_of_the_decoded_step(transfer_dtype, weights):
    """A node applies ``g`` as it came (``unpack(lazy=True)``), chunk by chunk into its replica (``apply_step``,
    also ``apply_step_keeping``), never decoded whole: the bits of the decoded step added whole, in fp32 and bf16
    weights, across chunk boundaries and a short last int8 block."""
    torch.manual_seed(4)
    shapes = {"a": (3, 700_001), "b": (5,)}
    x = {n: torch.randn(s).to(weights) for n, s in shapes.items()}
    arrays = wire.pack({n: torch.randn(s) * 1e-3 for n, s in shapes.items()}, transfer_dtype)
    decoded = wire.unpack(arrays, shapes)
    expected = {n: x[n] + decoded[n].to(weights) for n in shapes}
    in_place, kept = {n: t.clone() for n, t in x.items()}, {n: t.clone() for n, t in x.items()}
    with mock.patch.object(wire.Payload, "__call__", side_effect=AssertionError("a step decoded whole")):
        core.apply_step(in_place, wire.unpack(arrays, shapes, lazy=True))
        before = core.apply_step_keeping(kept, wire.unpack(arrays, shapes, lazy=True))
    assert all(torch.equal(in_place[n], expected[n]) and torch.equal(kept[n], expected[n]) for n in shapes)
    assert all(torch.equal(before[n], x[n]) for n in shapes)
    other_layout = {"a": x["a"].clone(), "b": torch.zeros(5, 1)}  # as many values, another shape: refused, unwritten
    for apply in (core.apply_step, core.apply_step_keeping):
        with pytest.raises(ValueError, match=r"b: the update's shape is \(5,\), expected \(5, 1\)"):
            apply(other_layout, wire.unpack(arrays, shapes, lazy=True))
        assert torch.equal(other_layout["a"], x["a"]) and torch.equal(other_layout["b"], torch.zeros(5, 1))
    for apply in (core.apply_step, core.apply_step_keeping):  # a column-major target: the same bits
        strided = {"a": torch.empty(700_001, 3, dtype=weights).t().copy_(x["a"]), "b": x["b"].clone()}
        apply(strided, wire.unpack(arrays, shapes, lazy=True))
        assert all(torch.equal(strided[n], expected[n]) for n in shapes)


@pytest.mark.parametrize("transfer_dtype", ["int8", "bf16", "fp16"])
def test_a_nodes_rounded_update_is_its_encoding_and_packs_without_converting_again(transfer_dtype):
    """Error feedback writes no fp32 block of what it sends: ``sent`` is the encoding itself
    (``core.EncodedTensors``), reading back ``round_for_transfer(Δ + e)``, and packing it (the simulation's
    reply) takes the encoding as it is, converting nothing again."""
    torch.manual_seed(5)
    update = {"a": torch.randn(3, 1000) * 1e-3, "b": torch.randn(77) * 1e-3}
    residual = {n: torch.randn_like(t) * 1e-6 for n, t in update.items()}
    sent, kept, encoded = core.round_with_feedback_encoded(update, residual, transfer_dtype)
    assert isinstance(sent, core.EncodedTensors) and sent.encoded is encoded
    expected = core.round_for_transfer({n: update[n] + residual[n] for n in update}, transfer_dtype)
    assert all(torch.equal(sent[n], expected[n]) for n in update)
    assert all(torch.equal(kept[n], update[n] + residual[n] - expected[n]) for n in update)
    with mock.patch.object(core.transfer_precision, "quantize_int8", side_effect=AssertionError("converted again")):
        with mock.patch.object(wire, "encode", side_effect=AssertionError("converted again")):
            arrays = wire.pack(sent, transfer_dtype)
    assert all(torch.equal(t, expected[n]) for n, t in wire.unpack(arrays).items())
