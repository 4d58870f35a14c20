"""Where the direct transport's per-byte work goes on sequential BCD's critical path, step by step, in one
process: the ServerApp's side (``DirectChannel`` around real Flower messages, ``RunTransport`` with its
spill folder as the ServerApp sets it) and a node's (``NodeTransport``) on a real plaintext service on
loopback (as ``benchmarks.window`` runs it), for a block of SmolLM2-135M's decoder layers in fp32.

The legs, in the order a round of ``benchmarks.window`` meets them:
- ``dispatch``: the step packed into its record (``records.to_record``, as the algorithm does) and the
  message's records published (``DirectChannel.message_on_stream``: framing, SHA-256);
- ``fetch``: the published step downloaded ahead (``NodeTransport.prefetch``, waiting for its release),
  then read as the relay's arrays (``fetch_arrays`` with the prefetched bytes);
- ``upload``: the update packed (``wire.pack_pieces``), framed, hashed and uploaded
  (``NodeTransport.upload_pieces``), to the server's acceptance;
- ``claim``: the reply's update taken from the stream (``DirectChannel.incoming``), then the reply checks
  and ``wire.unpack`` (``reply_checks.parse_reply``): the part of ``aggregate`` that depends on the transport.

Both sides share this process's two cores (in a deployment the node worker has a core of its own), so a
leg's seconds are its CPU work plus the other side's where they overlap; the spans are for finding the
largest, ``benchmarks.window`` measures the window. Best of ``--repeats`` rounds per size.

    .venv/bin/python -m benchmarks.direct_legs --sizes-mb 70.8 212.4 --repeats 3
    .venv/bin/python -m benchmarks.direct_legs --sizes-mb 973 --allocators default,mapped,mapped-huge   # side by side

``--allocators``: each size in a fresh process per allocator, in turn: ``default`` (glibc's own threshold),
``mapped`` (``memory.map_large_buffers``: every buffer of 1 MiB or more mapped afresh and unmapped when freed),
``mapped-huge`` (the same on huge pages, ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, as the node worker and a
deployment's ServerApp run).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from parablock_flwr.memory import map_large_buffers, with_huge_pages
from parablock_flwr.messages import COMMIT, GLOBAL_STEP, METRICS, OFFER, TrainMetrics, TransportOffer, metrics_to_record
from parablock_flwr.records import to_record
from parablock_flwr.strategies.reply_checks import Expected, parse_reply
from parablock_flwr.strategies.update_spill import IN_MEMORY
from parablock_flwr.transport import NodeTransport, RunTransport, StreamSettings, update_bound
from parablock_flwr.transport.direct_channel import DirectChannel
from parablock_flwr.wire import pack_pieces

RUN = 1
LAYER = {"q": (576, 576), "k": (192, 576), "v": (192, 576), "o": (576, 576), "gate": (1536, 576),
         "up": (1536, 576), "down": (576, 1536), "in_norm": (576,), "post_norm": (576,)}  # fmt: skip
LAYER_BYTES = 4 * sum(torch.Size(s).numel() for s in LAYER.values())


def block(layers: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.{n}": torch.randn(s, generator=gen) for i in range(layers) for n, s in LAYER.items()}


def message(node: int, content: RecordDict) -> Message:
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = RUN, 5, 0
    return Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN)


def reply(msg: Message, content: RecordDict) -> Message:
    TaskIdentity.node_id = msg.metadata.dst_node_id
    return Message(content=content, reply_to=msg)


def metrics(server_round: int) -> MetricRecord:
    m = TrainMetrics(server_round=server_round, block=0, partition_id=0, base_version=server_round - 1,
                     num_examples=8.0, train_loss=0.5, compute_s=1.0)  # fmt: skip
    return MetricRecord(metrics_to_record(m))


class Span:
    """Each leg's wall seconds and this process's CPU seconds (every thread: both sides' work, which on a
    loaded machine varies less than the wall time)."""

    def __init__(self) -> None:
        self.legs: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def __call__(self, leg: str, fn, *args):
        start, cpu = time.perf_counter(), time.process_time()
        out = fn(*args)
        self.legs[leg] = self.legs.get(leg, 0.0) + time.perf_counter() - start
        self.cpu[leg] = self.cpu.get(leg, 0.0) + time.process_time() - cpu
        return out


def one_round(direct: DirectChannel, node: NodeTransport, tensors, update, r: int, ahead_offer) -> tuple:
    """Round ``r``: its step published and fetched ahead, the node's update uploaded and claimed; the spans
    and round r's offer (whose ahead capabilities round r+1 uses)."""
    span, node_id = Span(), 7
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    bound = update_bound(sum(t.numel() for t in tensors.values()), len(tensors))
    prefetched = None
    if ahead_offer is not None:  # the node waits for round r's step under round r-1's capability
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(1)
        waiting = pool.submit(node.prefetch, ahead_offer)
        time.sleep(0.2)  # the download is waiting on the server when the step is published
    record = span("dispatch: to_record", to_record, tensors, "fp32")
    msg = message(node_id, RecordDict({GLOBAL_STEP: record, "round": ConfigRecord({"x": 1})}))
    span("dispatch: publish (frame + SHA-256)", direct.message_on_stream, msg, r, bound, (bound, bound))
    span("dispatch: release", direct.transport.messaged, r, {node_id})
    offer = TransportOffer.from_config(dict(msg.content[OFFER]))
    if ahead_offer is not None:
        prefetched = span("fetch: prefetch (after release)", waiting.result)
        pool.shutdown()
    span("fetch: fetch_arrays", node.fetch_arrays, offer, prefetched)
    pieces = span("upload: pack_pieces", pack_pieces, update, "fp32")
    commit = span("upload: upload_pieces (frame, SHA-256, send, accept)", node.upload_pieces, offer, pieces)
    answer = reply(msg, RecordDict({METRICS: metrics(r), COMMIT: ConfigRecord(commit.to_config())}))
    taken = span("claim: incoming (claim, unframe, Arrays)", direct.incoming, answer, r, node_id)
    checked = span("claim: parse_reply (checks, wire.unpack)", parse_reply, taken, Expected(r, 0, shapes, 1e9), node_id)
    assert not isinstance(checked, str), checked
    direct.end_round(r)
    return span, offer


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[70.8, 212.4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--allocators", default="", help="comma-separated, of default, mapped, mapped-huge: a process each")
    p.add_argument("--map-large-buffers", action="store_true", help=argparse.SUPPRESS)  # one process of --allocators
    args = p.parse_args(argv)
    if args.allocators:
        for size in args.sizes_mb:
            for allocator in args.allocators.split(","):
                print(f"\n[{allocator}]", flush=True)
                flags = ["--map-large-buffers"] if allocator.startswith("mapped") else []
                cmd = [sys.executable, "-m", "benchmarks.direct_legs", "--sizes-mb", str(size), "--repeats",
                       str(args.repeats), *flags]  # fmt: skip
                env = with_huge_pages(dict(os.environ)) if allocator == "mapped-huge" else None
                subprocess.run(cmd, check=True, env=env)
        return
    if args.map_large_buffers and not map_large_buffers():
        sys.exit("direct_legs: --allocators mapped needs glibc")
    for size in args.sizes_mb:
        layers = max(1, round(size * 1e6 / LAYER_BYTES))
        tensors, update = block(layers, 1), block(layers, 2)
        best: dict[str, float] = {}
        cpu: dict[str, float] = {}
        with tempfile.TemporaryDirectory() as spill:
            run = RunTransport(StreamSettings("localhost:0", insecure=True), RUN, 600.0, spill_dir=Path(spill),
                               memory_uploads=IN_MEMORY)  # fmt: skip
            with run:
                direct, node, ahead = DirectChannel(run), NodeTransport(timeout_s=600), None
                for r in range(1, args.repeats + 2):
                    span, ahead = one_round(direct, node, tensors, update, r, ahead)
                    if r > 1:  # round 1 has no step fetched ahead
                        best = {k: min(v, best.get(k, v)) for k, v in span.legs.items()}
                        cpu = {k: min(v, cpu.get(k, v)) for k, v in span.cpu.items()}
                spilled = run.server.inbox.spilled
                node.close()
        print(f"\n{layers * LAYER_BYTES / 1e6:.1f} MB each way, best of {args.repeats} rounds "
              f"(uploads spilled to a file: {spilled}); wall s, CPU s (the process's threads):")  # fmt: skip
        for leg, seconds in best.items():
            print(f"  {leg:<58} {seconds:6.3f} {cpu[leg]:6.3f}")
        for group in ("dispatch", "fetch", "upload", "claim"):
            total = [sum(v for k, v in d.items() if k.startswith(group)) for d in (best, cpu)]
            print(f"  {group + ' (sum)':<58} {total[0]:6.3f} {total[1]:6.3f}")


if __name__ == "__main__":
    main()
