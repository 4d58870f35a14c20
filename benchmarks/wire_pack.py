"""One array per record against one per tensor: encode, Flower's serialisation and decode of a block.

A SmolLM2-135M block of 5 decoder layers (45 tensors, 17.7 M values: 70.8 MB in fp32; random
values, the shapes are what matter) goes through what one exchange does to it on the CPU,
without a network:

- sender: ``records.to_record`` (the ArrayRecord), then what Flower does before pushing a message:
  every nested object (record, arrays, 5 MiB chunks) deflated and its object id (SHA-256) computed;
- receiver: the objects inflated back into an ArrayRecord, then ``records.to_tensors``.

"per tensor" is the encoding before issue 23 (one Flower ``Array`` per tensor, rebuilt here as it was);
"packed" is ``wire.pack``: one ``values`` array (and a ``layout``; int8 adds ``scales``). Prints the
median of ``--repeats`` runs and the number of Flower objects, and writes the table to docs/benchmarks.md.

    .venv/bin/python -m benchmarks.wire_pack              # about 1 min here
    .venv/bin/python -m benchmarks.wire_pack --repeats 3 --no-write
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from flwr.app import Array, ArrayRecord
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from benchmarks.common import command, machine, replace_doc_section
from parablock_flwr import core
from parablock_flwr.records import to_record, to_tensors

SECTION = "## One array per record: encode, serialise, decode a block"
# SmolLM2-135M's decoder layer (hidden 576, MLP 1536, 9 query and 3 key/value heads of 64).
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)


def smollm2_block(layers: int = 5, seed: int = 0) -> core.Tensors:
    """``layers`` SmolLM2 decoder layers' parameters, named as in the model, random fp32 values."""
    torch.manual_seed(seed)
    config = LlamaConfig(**SMOLLM2, num_hidden_layers=layers)
    block = {}
    for i in range(layers):
        for name, p in LlamaDecoderLayer(config, i).named_parameters():
            block[f"model.layers.{i}.{name}"] = torch.randn_like(p) * 1e-3  # an update's size
    return block


def per_tensor_record(tensors: core.Tensors, transfer_dtype: str) -> ArrayRecord:
    """The encoding before issue 23: one Array per tensor (fp32 from torch, bf16 as int16 patterns)."""
    if transfer_dtype == "fp32":
        return ArrayRecord({n: t.detach().contiguous() for n, t in tensors.items()})
    dtype = core.TRANSFER_DTYPES[transfer_dtype]
    arrays = {}
    for n, t in tensors.items():
        t = t.to(dtype).contiguous()
        arrays[n] = Array((t.view(torch.int16) if dtype == torch.bfloat16 else t).numpy())
    return ArrayRecord(arrays)


def per_tensor_decode(record: ArrayRecord) -> core.Tensors:
    out = {}
    for n, array in record.items():
        t = torch.from_numpy(array.numpy())
        out[n] = t.view(torch.bfloat16).float() if t.dtype == torch.int16 else t.float()
    return out


def exchange(block: core.Tensors, encoding: str, transfer_dtype: str) -> dict:
    """One pass: seconds of each stage, the objects Flower handles, the bytes they carry."""
    times = {}
    start = time.perf_counter()
    record = per_tensor_record(block, transfer_dtype) if encoding == "per tensor" else to_record(block, transfer_dtype)
    times["encode"] = time.perf_counter() - start
    start = time.perf_counter()
    objects = get_all_nested_objects(record)
    contents = {object_id: obj.deflate() for object_id, obj in objects.items()}
    times["serialise"] = time.perf_counter() - start
    start = time.perf_counter()
    received = inflate_object_from_contents(record.object_id, dict(contents))
    times["deserialise"] = time.perf_counter() - start
    start = time.perf_counter()
    out = per_tensor_decode(received) if encoding == "per tensor" else to_tensors(received)
    times["decode"] = time.perf_counter() - start
    assert out.keys() == block.keys()
    times["objects"] = len(objects)
    times["bytes"] = sum(len(c) for c in contents.values())
    return times


def measure(block: core.Tensors, encoding: str, transfer_dtype: str, repeats: int) -> dict:
    exchange(block, encoding, transfer_dtype)  # warm-up
    runs = [exchange(block, encoding, transfer_dtype) for _ in range(repeats)]
    row = {k: statistics.median(r[k] for r in runs) for k in ("encode", "serialise", "deserialise", "decode")}
    row["total"] = statistics.median(sum(r[k] for k in ("encode", "serialise", "deserialise", "decode")) for r in runs)
    return {"encoding": encoding, "dtype": transfer_dtype, **row, "objects": runs[0]["objects"],
            "bytes": runs[0]["bytes"]}  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = [
        "| transfer-dtype | encoding | Flower objects | MB serialised | encode s | serialise s | deserialise s | "
        "decode s | total s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['encoding']} | {r['objects']} | {r['bytes'] / 1e6:.2f} | {r['encode']:.3f} | "
            f"{r['serialise']:.3f} | {r['deserialise']:.3f} | {r['decode']:.3f} | {r['total']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default=",".join(core.TRANSFER_DTYPES))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md alone")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    block = smollm2_block()
    size = sum(t.numel() for t in block.values())
    rows = []
    for dtype in args.dtypes.split(","):
        encodings = ("per tensor", "packed") if dtype in ("fp32", "bf16", "fp16") else ("packed",)
        rows += [measure(block, encoding, dtype, args.repeats) for encoding in encodings]
    text = table(rows)
    print(text)
    if not args.no_write:
        m = machine()
        replace_doc_section(
            SECTION,
            f"Command: `{command('wire_pack')}`  \nDate: {time.strftime('%Y-%m-%d')}, {m['nproc']} cores "
            f"({m['cpu']}), torch on 1 thread, median of {args.repeats}.\n\n"
            f"A SmolLM2-135M block of 5 decoder layers ({len(block)} tensors, {size / 1e6:.1f} M values, "
            f"{4 * size / 1e6:.1f} MB in fp32) through one exchange's CPU work, without the network: the "
            "sender's `to_record` (encode) and Flower's deflation of every nested object with its SHA-256 object "
            "id (serialise); the receiver's inflation (deserialise) and `to_tensors` (decode). *per tensor*: one "
            "Flower `Array` per tensor (the encoding before issue 23); *packed*: one `values` array, its "
            "`layout` and (int8) its `scales` (`wire.pack`). Flower cuts every array into 5 MiB chunks, each an "
            "object of its own; what packing removes is the per-tensor objects (each pushed, pulled and "
            "acknowledged separately over the network: the window benchmark of issue 23 measures that part).\n\n"
            + text
            + "\n",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
