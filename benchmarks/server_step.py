"""The server's work on the critical path after a round's last reply: the weighted mean of the
clients' updates, the step ``g^r`` rounded to the transfer dtype, applied to ``x`` (keeping
``x^{r-1}[b]`` for a full sync), and packed into the next message's record. Side by side in one
process, alternating, on one synthetic block: the path as it was (``g`` copied, rounded, ``x[b]``
copied then added to in place, ``g`` converted again to pack it) and as it is (``wire.round_and_pack``:
one conversion; ``core.apply_step_keeping``: the add into new storage, the old kept uncopied).
Then the node's side of the same block: its rounded update packed for the worker's socket, joined
into one array per record (as it was) or written as its pieces, one per tensor (as it is,
``wire.pack_pieces``). Prints the medians per transfer dtype and what they give for Llama-3.1-8B's
largest block (linear in its bytes).

    .venv/bin/python -m benchmarks.server_step               # 1 GiB block, 3 clients: about 3 min
    .venv/bin/python -m benchmarks.server_step --gib 0.25 --no-write
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import PROJECT_DIR, write_report
from parablock_flwr import core
from parablock_flwr.config import RunConfig
from parablock_flwr.plan import model_config, model_shape
from parablock_flwr.records import pieces_record, to_record
from parablock_flwr.wire import pack, pack_pieces, round_and_pack

SECTION = "## The server's step after the last reply: one conversion, no copies"
LLAMA_8B = PROJECT_DIR / "docs" / "model-configs" / "llama-3.1-8b"
TENSORS = 8  # the block's tensors (an 8B layer has 9 of 14-58M values)


def before(x: core.Tensors, updates: list[core.Tensors], weights: list[float], dtype: str):
    """The path as it was (255453c): ``global_step`` copied ``Δ̄``, ``NodeSync.applying`` copied ``x[b]``."""
    mean = core.aggregate(iter(updates), weights)
    step = core.round_for_transfer({n: t.clone() for n, t in mean.items()}, dtype)
    kept = {n: x[n].detach().clone() for n in step}
    core.apply_step(x, step)
    return to_record(step, dtype), kept


def after(x: core.Tensors, updates: list[core.Tensors], weights: list[float], dtype: str):
    """The path as it is (``FedBCD.aggregate_train``)."""
    mean = core.aggregate(iter(updates), weights)
    step, pieces = round_and_pack(core.global_step(mean, 1.0), dtype)
    kept = core.apply_step_keeping(x, step)
    return pieces_record(pieces), kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="the block's size in fp32")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", default="fp32,bf16,int8")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    numel = int(args.gib * 2**30 / 4 / TENSORS)
    g = torch.Generator().manual_seed(0)
    x = {f"t{i}": torch.randn(numel, generator=g) for i in range(TENSORS)}
    updates = [{n: torch.randn(numel, generator=g) * 1e-3 for n in x} for _ in range(args.clients)]
    weights = [float(i + 1) for i in range(args.clients)]
    block_bytes = TENSORS * numel * 4
    big = max(model_shape(RunConfig(), model_config(str(LLAMA_8B))).blocks) * 4
    scale = big / block_bytes

    def table(what: str, paths: dict) -> list[str]:
        """``paths``: before/after -> a function of the dtype; each timed ``--repeats`` times, alternating."""
        lines = [
            f"| transfer dtype | {what}: before, s | after, s | after / before | 8B's largest block "
            f"({big / 2**30:.2f} GiB), before, s | after, s |",
            "|---|---|---|---|---|---|",
        ]
        for dtype in args.dtypes.split(","):
            times = {"before": [], "after": []}
            for _ in range(args.repeats):
                for name, path in paths.items():
                    start = time.perf_counter()
                    out = path(dtype)
                    times[name].append(time.perf_counter() - start)
                    del out  # freed as a round frees it, before the next
            b, a = statistics.median(times["before"]), statistics.median(times["after"])
            spread = [f"{min(t):.2f}-{max(t):.2f}" for t in times.values()]
            print(f"{what}, {dtype}: before {b:.2f} s ({spread[0]}), after {a:.2f} s ({spread[1]})", flush=True)
            lines.append(f"| {dtype} | {b:.2f} ({spread[0]}) | {a:.2f} ({spread[1]}) | {a / b:.2f} "
                         f"| {b * scale:.1f} | {a * scale:.1f} |")  # fmt: skip
        return lines

    server = table(
        f"the server's step ({block_bytes / 2**30:.2f} GiB block, {args.clients} clients)",
        {"before": lambda d: before(x, updates, weights, d), "after": lambda d: after(x, updates, weights, d)},
    )
    rounded = {d: core.round_for_transfer(updates[0], d) for d in args.dtypes.split(",")}
    node = table(
        "the node's update packed for its socket",
        {"before": lambda d: pack(rounded[d], d), "after": lambda d: pack_pieces(rounded[d], d)},
    )
    lines = [
        *server,
        "",
        *node,
        "",
        f"Medians (min-max) of {args.repeats} alternating repeats; torch threads: {torch.get_num_threads()}. "
        "The 8B columns scale the medians by the bytes (linear in the block; a server with more cores runs both "
        "faster). The spread is the allocator: a block-sized buffer is fresh pages, faulted in on first touch, "
        "or pages a freed buffer left; the old path made three such buffers more per round. int8's quantisation "
        "itself was cut too (both columns use the new one). The node's pieces are views of its update's "
        "memory for fp32 (nothing copied until the socket) and one conversion for the others.",
    ]
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        write_report("server_step", SECTION, __doc__, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
