"""The per-byte work of a round outside the transport, leg by leg, in one process, for blocks of the sizes users train
(Llama-3.2-1B's 4-layer block is 243 M parameters, 247 MB in int8): what a node does between its computation and its
upload, and what the server does between the last reply and the next message, each in MB/s of the block's wire bytes,
beside a bare TLS socket moving the same bytes with a SHA-256 at the receiver (``benchmarks.transport.socket_path``), in
the same run.

A node's legs: the round's step applied to its replica as it came (``core.apply_step``: read from its payload chunk by
chunk), beside it decoded whole first (what it ran before); the update rounded with error feedback
(``core.round_with_feedback_encoded``: what it sends is its encoding), its new residual written durably
(``ResidualStore.save``: fp32, fsynced, past the page cache, under the system's temporary folder; the reply waits for
it, the upload runs beside it; beside it written through the page cache, as before; each in wall and CPU seconds),
packed for the wire (``wire.pack_pieces`` from that encoding), its SHA-256, and with ``verify-invariant`` its local
model's digest (``core.model_digest``) as the node makes it: its replica's tensors from their cache
(``ModelReplica.hashes``) but a block's, which the round's step moved, hashed again, and the update in its encoding;
beside it the whole model hashed. The server's, for ``--nodes`` replies, as its critical path runs them: each reply's
norm and finiteness read from its payload (``reply_checks.checked_norm``: int8's from its integers and scales), the
mean, ``g`` rounded as it travels and ``x + g`` in one pass over the block (``core.applied_mean_step``, each update read
from its payload chunk by chunk, and ``wire.pack_encoded``); beside it, as the server runs them where that pass cannot
run (left out of its sum), the aggregate of the updates as they came (``core.aggregate``: each read from its payload
chunk by chunk into the sum), ``g`` rounded and packed (``wire.round_and_pack``, its values read back from the pieces),
``g`` applied to ``x`` from its pieces chunk by chunk (``core.added``); with differential privacy (central mode) each
reply's clip scale (``core.clip_scale``: its norm, as the reply is checked), the mean's noise drawn (``core.gaussian``,
ahead of the last reply) and the one pass with each reply clipped and the noise added in it (``applied_mean_step``'s
``clip_scales`` and ``noise``); and each reply's invariant digest (``core.model_digest``: ``x``'s tensors from their
cache, which the checkpoint's digest filled while the replies were outstanding, and the reply's update hashed as it
came). The sum and the new ``x`` go into buffers made and touched before the leg, as the server makes them while the
replies are outstanding (``RoundBuffers``). The model is ``--blocks`` blocks, so that the whole-model digest costs what
it costs on a model of that many blocks. Best of ``--repeats``; torch's threads: ``--threads``. Each size runs in a
process of its own that maps its large buffers on huge pages (``memory.map_large_buffers``,
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``), as ``tools.launch`` and the units start the worker and the ServerApp.

    .venv/bin/python -m benchmarks.byte_legs --params-m 61.8 243 --repeats 5 --report
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.common import write_report
from benchmarks.transport import socket_path
from parablock_flwr import core
from parablock_flwr.durable import fsync_path
from parablock_flwr.memory import map_large_buffers, with_huge_pages
from parablock_flwr.node.state import ResidualStore
from parablock_flwr.strategies.reply_checks import checked_norm
from parablock_flwr.strategies.round_buffers import touched_pairs
from parablock_flwr.tensor_file import takes_direct_io
from parablock_flwr.tools.credentials import make_tls
from parablock_flwr.wire import join_pieces, pack_encoded, pack_pieces, round_and_pack, unpack

WIDTH = 2048  # the rows of a block's tensors: Llama-3.2-1B's hidden size
RESIDUAL_WRITE = "residual's durable write (fp32, fsynced)"
RESIDUAL_WRITE_BEFORE = "residual's durable write, through the page cache"
CPU = ", CPU s"  # a leg's CPU seconds, beside its wall time (left out of the sum)
# What the node ran before, measured beside what replaced it (left out of the node's sum).
BEFORE = {"invariant digest, whole model", "apply g to its replica, decoded whole", RESIDUAL_WRITE_BEFORE}
# The legs the server runs only with differential privacy, central mode (docs/privacy.md; left out of its sum): the
# replies' norms for their clip scales, each as its reply is checked (the last one's on the critical path), and the
# one pass with the clipping and the noise in it, on it; the noise's draw, on a thread of its own from when the
# round's messages are built (off it).
WITH_DP = "DP: "
NOISE_DRAW = "the noise's draw (ahead, while the nodes train)"
# The server's mean, rounding and x + g each apart, as it runs them only where the one pass cannot run (a subclass's
# combine or server_update, more replies than the spill holds in memory; left out of its sum).
APART = " (apart)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-m", type=float, nargs="+", default=[61.8, 243.0],
                        help="block sizes, in millions of parameters")  # fmt: skip
    parser.add_argument("--dtypes", nargs="+", default=["int8", "bf16"], choices=list(core.TRANSFER_DTYPES))
    parser.add_argument("--nodes", type=int, default=2, help="replies the server aggregates")
    parser.add_argument("--blocks", type=int, default=4, help="blocks in the model (the whole-model digest)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--report", action="store_true", help="write docs/results/byte_legs.md")
    return parser.parse_args(argv)


def block(params_m: float, seed: int, scale: float = 1e-3) -> core.Tensors:
    """A block of about ``params_m`` million fp32 values in four tensors of ``WIDTH`` rows."""
    gen = torch.Generator().manual_seed(seed)
    cols = max(1, round(params_m * 1e6 / 4 / WIDTH))
    return {f"w{i}": torch.randn(WIDTH, cols, generator=gen) * scale for i in range(4)}


def best(fn, repeats: int, clock=time.perf_counter) -> tuple[float, object]:
    """The fastest of ``repeats`` calls by ``clock`` (default: wall time), and the last call's result (each call's
    result is dropped before the next, as a round drops the last one's)."""
    seconds, out = float("inf"), None
    for _ in range(repeats):
        out = None
        started = clock()
        out = fn()
        seconds = min(seconds, clock() - started)
    return seconds, out


def node_legs(update: core.Tensors, residual: core.Tensors, model: core.Tensors, dtype: str, repeats: int) -> dict:
    """A node's per-byte work between its computation and its upload, in seconds per leg."""
    legs = {}
    legs["round with feedback"], (sent, kept, encoded) = best(
        lambda: core.round_with_feedback_encoded(update, residual, dtype), repeats
    )
    legs["pack"], pieces = best(lambda: pack_pieces(sent, dtype, encoded), repeats)
    legs["SHA-256 of the wire bytes"], _ = best(lambda: sha256_of(pieces), repeats)
    names = list(model)
    hashes = core.TensorHashes()
    core.model_digest(model, names, hashes=hashes)  # the replica's cache, as the node holds it

    def digest():  # the block the round's step moved (here: the update's, the same size) hashed again
        hashes.changed(sent)
        return core.model_digest(model, names, sent, hashes)

    legs["invariant digest, cached"], _ = best(digest, repeats)
    legs["invariant digest, whole model"], _ = best(lambda: core.model_digest(model, names, sent), repeats)
    # The round's first leg, before its computation: g (here the same bytes) applied to the replica as it came.
    arrays, replica = join_pieces(pieces), {n: model[n].clone() for n in update}

    def step():
        return unpack(arrays, transfer_dtype=dtype, read_only=True, lazy=True)

    legs["apply g to its replica"], _ = best(lambda: core.apply_step(replica, step()), repeats)
    legs["apply g to its replica, decoded whole"], _ = best(
        lambda: [replica[n].add_(t) for n, t in step().items()], repeats
    )
    return legs, pieces, sent, kept


def residual_writes(kept: core.Tensors, repeats: int) -> dict:
    """The node's new residual written durably (``Node.feed_back``: the reply waits for it), past the page cache
    (``tensor_file.write_tensors``), beside it written through the page cache as it was before
    (``safetensors``' ``save_file``, then ``fsync``), timed last: the gigabytes that leaves in the page cache would
    slow every leg timed after it. Each also in CPU seconds (the process's, best of ``repeats``): the write runs
    beside the upload, where its CPU, not its wall time, is what it takes from the round."""
    legs = {}
    with tempfile.TemporaryDirectory() as folder:
        store, rounds = ResidualStore(folder), itertools.count(1)

        def through_the_page_cache():
            save_file(kept, f"{folder}/page-cache.safetensors")
            fsync_path(Path(folder) / "page-cache.safetensors")

        for leg, write in ((RESIDUAL_WRITE, lambda: store.save(next(rounds), 0, kept)),
                           (RESIDUAL_WRITE_BEFORE, through_the_page_cache)):  # fmt: skip
            legs[leg], _ = best(write, repeats)
            legs[leg + CPU], _ = best(write, repeats, clock=time.process_time)
    return legs


def server_legs(arrays: dict, sent: core.Tensors, model: core.Tensors, nodes: int, dtype: str, repeats: int) -> dict:
    """The server's per-byte work from the last reply to the next message, in seconds per leg (``nodes``
    replies of the same bytes)."""
    legs = {}

    def lazy():
        return unpack(arrays, transfer_dtype=dtype, read_only=True, lazy=True)

    one, _ = best(lambda: checked_norm(lazy()), repeats)
    legs[f"check {nodes} replies (norm, finite)"] = nodes * one
    sums, new_x = touched_pairs({n: model[n] for n in sent})  # made ahead, as the server's RoundBuffers
    x = {n: model[n].clone() for n in sent}
    legs[f"mean, g rounded and packed, x + g: one pass, {nodes} replies"], _ = best(
        lambda: pack_encoded(core.applied_mean_step([lazy() for _ in range(nodes)], [1.0] * nodes, 1.0, x, dtype,
                                                    new_x)[0], {n: tuple(t.shape) for n, t in x.items()}, dtype),
        repeats,
    )  # fmt: skip
    legs[f"aggregate {nodes}{APART}"], mean = best(
        lambda: core.aggregate([lazy() for _ in range(nodes)], [1.0] * nodes, out=sums), repeats
    )
    clip_norm = core.l2_norm(lazy()) / 2  # each reply clipped to half its norm
    one, _ = best(lambda: core.clip_scale(lazy(), clip_norm), repeats)
    legs[f"DP: clip scales of {nodes} replies (their norms, as each is checked)"] = nodes * one
    legs[f"{WITH_DP}{NOISE_DRAW}"], noise = best(lambda: core.gaussian(mean, 1), repeats)
    legs[f"DP: mean, clip, noise, g rounded and packed, x + g: one pass, {nodes} replies"], _ = best(
        lambda: pack_encoded(core.applied_mean_step([lazy() for _ in range(nodes)], [1.0] * nodes, 1.0, x, dtype,
                                                    new_x, [0.5] * nodes, noise, 1e-3)[0],  # each to half its norm
                             {n: tuple(t.shape) for n, t in x.items()}, dtype),
        repeats,
    )  # fmt: skip
    legs[f"round and pack g{APART}"], (step, _) = best(lambda: round_and_pack(mean, dtype, lazy=True), repeats)
    legs[f"apply g to x{APART}"], _ = best(
        lambda: {n: core.added(x[n], core.read_chunks(step, n), new_x[n]) for n in step}, repeats
    )
    names, hashes = list(model), core.TensorHashes()
    core.model_digest(model, names, hashes=hashes)  # as the checkpoint's digest leaves it
    one, _ = best(lambda: core.model_digest(model, names, lazy(), hashes), repeats)
    legs[f"{nodes} invariant digests, cached"] = nodes * one
    return legs


def sha256_of(pieces: dict) -> str:
    digest = hashlib.sha256()
    for parts in pieces.values():
        for part in parts:
            digest.update(part)
    return digest.hexdigest()


def measure(params_m: float, dtype: str, args, tls) -> dict:
    """Both sides' legs for one block size and dtype (in a process of its own, ``main``)."""
    map_large_buffers()  # as the node worker and a deployment's ServerApp run
    if args.threads:
        torch.set_num_threads(args.threads)
    update, residual = block(params_m, 1), block(params_m, 2, 1e-6)
    model = {f"b{b}.{n}": t for b in range(args.blocks) for n, t in block(params_m, 10 + b, 1.0).items()}
    first = {f"b0.{n}": t for n, t in update.items()}  # the block the round trained: the model's first
    node, pieces, sent, kept = node_legs(first, {f"b0.{n}": t for n, t in residual.items()}, model, dtype, args.repeats)
    arrays = join_pieces(pieces)
    wire_bytes = sum(a.nbytes for a in arrays.values())
    server = server_legs(arrays, sent, model, args.nodes, dtype, args.repeats)
    data = b"".join(a.tobytes() for a in arrays.values())
    send, close = socket_path(tls, data)
    socket_s, _ = best(send, args.repeats)
    close()
    node.update(residual_writes(kept, args.repeats))
    return {"params_m": params_m, "dtype": dtype, "wire_mb": wire_bytes / 1e6, "socket_s": socket_s,
            "node": node, "server": server}  # fmt: skip


def table(results: list[dict]) -> str:
    """One row per leg and size: seconds, MB/s of the wire bytes, and that rate over the TLS socket's."""
    lines = ["| block | dtype | side | leg | s | MB/s (wire bytes) | / TLS socket |", "|---|---|---|---|---|---|---|"]
    for r in results:
        socket_rate = r["wire_mb"] / r["socket_s"]
        head = f"{r['params_m']:g} M params ({r['wire_mb']:.0f} MB)"
        lines.append(f"| {head} | {r['dtype']} | both | TLS socket + SHA-256 at the receiver | {r['socket_s']:.3f} "
                     f"| {socket_rate:,.0f} | 1.00 |")  # fmt: skip
        for side in ("node", "server"):
            legs = r[side]
            beside = {k for k in legs if k in BEFORE or k.startswith(WITH_DP) or CPU in k or APART in k}
            counted = {k: v for k, v in legs.items() if k not in beside}
            for leg, s in [*legs.items(), ("all it runs now", sum(counted.values()))]:
                rate = r["wire_mb"] / s
                lines.append(f"| {head} | {r['dtype']} | {side} | {leg} | {s:.3f} | {rate:,.0f} "
                             f"| {rate / socket_rate:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    results = []
    spawn = multiprocessing.get_context("spawn")
    os.environ.update(with_huge_pages(dict(os.environ)))  # the children's glibc reads it as they start
    with tempfile.TemporaryDirectory() as tmp:
        tls = make_tls(Path(tmp))
        for params_m in args.params_m:
            for dtype in args.dtypes:
                # Each size and dtype in a process of its own: its heap (kept, as a worker's) starts empty.
                with ProcessPoolExecutor(1, mp_context=spawn) as child:
                    results.append(child.submit(measure, params_m, dtype, args, tls).result())
                print(table(results[-1:]), flush=True)
    report = table(results)
    threads = args.threads or torch.get_num_threads()
    report += (
        f"\n\ntorch threads: {threads}; {args.nodes} replies; a model of {args.blocks} blocks (whole-model digest).\n"
        f"The residual written under {tempfile.gettempdir()}: O_DIRECT "
        f"{'taken' if takes_direct_io(tempfile.gettempdir()) else 'refused (both writes through the page cache)'}.\n"
    )
    if args.report:
        print(write_report("byte_legs", "Per-byte legs of a round, outside the transport", report, __doc__))
    return results


if __name__ == "__main__":
    main()
