"""ParaBlock against sequential BCD in a real local deployment whose computation is a GPU's stand-in: each node
worker waits C seconds off the CPU per round (``benchmarks.stand_in_worker``), so that what is left of a round
is the app's own work over a block's bytes and the exchange, as beside a GPU, where compute is fast.

Each size is a wide Llama of two 4-layer blocks (``--hidden``: 2560 gives 236 M parameters a block, 240 MB in
int8, about Llama-3.2-1B's 4-layer block), deployed with ``transport = "direct"`` on loopback, one run per
algorithm, the same seed (with ``--verify-invariant``, ParaBlock once more with it on). It prints what
``benchmarks.round_compare`` prints of each setting (the legs of a round, ParaBlock/BCD beside the ideal
max(C, T_BCD - C) / T_BCD) and every target of a round beside a GPU as measured here, met or not.

    .venv/bin/python -m benchmarks.stand_in --hidden 1536 2560 --compute-s 2.5 --report   # a section each setting
    .venv/bin/python -m benchmarks.stand_in --hidden 512 --rounds 4          # the smallest, as CI runs it
    .venv/bin/python -m benchmarks.stand_in --hidden 2560 --pin               # workers on CPUs of their own
    .venv/bin/python -m benchmarks.stand_in --hidden 2560 --link-mbit 1000    # loopback shaped to 1 Gbit/s (root)

``--link-mbit`` limits loopback to that rate for the run (``tc`` ``tbf`` on ``lo``, removed after), so that an
update takes a link's time to land and the server's work as its bytes land shows: every loopback byte is counted,
both ways together (ParaBlock's upload and download ahead share the rate, as they would not on a full-duplex link),
and the targets' link is a block each way for each node at that rate (``tc qdisc del dev lo root`` removes a
shaping a run killed outright left; a run without ``--link-mbit`` refuses to start on a shaped loopback).

``--pin`` puts the node workers on the upper half of this machine's CPUs and everything else (the benchmark,
the SuperLink, the SuperNodes, the ServerApp) on the lower half, as on machines of their own: on a machine of
2 cores, a change that frees one side's CPU and one that shortens its path read alike otherwise, and an A/B of
two commits measures the machine's scheduling as much as the code.

Reading the page: the ideal counts all of BCD's time besides C as work ParaBlock cannot hide, so ParaBlock may come
out below it, where it hides some of that work too. Where ParaBlock's server critical path is longer than BCD's, two
suspects, of a 2-core machine as much as of the code: the worker's per-byte work for the next round (its update
rounded and uploaded ahead, its residual written) runs beside the server's aggregation, where BCD's worker is idle;
and ParaBlock's aggregation stages each client's pending update for the checkpoint (as it travelled, written on a
thread beside it). Buffers mapped afresh each round cost the rounds too (docs/transport.md, "What a fresh page costs
here": what is kept across rounds, what is still made fresh, and what a fresh block costs on this VM). On this
machine both sides' durable writes (the worker's fp32 residual, the server's step log) share one disk with the rest.
The CPU seconds a round costs the ServerApp and the worker (every thread; the stand-in's wait costs none) are the
per-byte work itself, less moved by what else the cores run than the wall times; on this VM they still vary from run
to run (a page's first touch costs what the host makes it cost), so compare two commits by several runs of each, one
after the other."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import PROJECT_DIR, RESULTS_DIR, command, commit, machine_line, replace_doc_section
from benchmarks.network import netlab
from benchmarks.round_compare import (
    TABLE_HEAD,
    block_bytes,
    compare,
    rounds_from_3,
    rows,
    targets,
    targets_table,
    window,
)
from parablock_flwr.tools.tiny_model import build_tiny_model

LAYERS, LAYERS_PER_BLOCK = 8, 4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stand_in", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--hidden", type=int, nargs="+", default=[512], help="model widths, one size each")
    parser.add_argument("--compute-s", type=float, default=2.5, help="C: the stand-in's compute per round")
    parser.add_argument("--rounds", type=rounds_from_3, default=6)
    parser.add_argument("--nodes", type=int, default=1, help="SuperNodes, each with its stand-in worker")
    parser.add_argument("--transfer-dtype", default="int8", choices=["int8", "bf16", "fp16"])
    parser.add_argument("--verify-invariant", action="store_true", help="ParaBlock with it on too: its cost")
    parser.add_argument("--pin", action="store_true", help="workers on the upper half of the CPUs, the rest below")
    parser.add_argument("--link-mbit", type=float, default=0.0, help="loopback shaped to this rate (root, tc)")
    parser.add_argument("--report", action="store_true", help="write docs/results/stand_in.md")
    args = parser.parse_args(argv)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0  # Linux's only
    if args.pin and (cpus < 2 or shutil.which("taskset") is None):
        parser.error(f"--pin: {cpus} CPU(s) to pin here, taskset {shutil.which('taskset')}; "
                     "expected 2 CPUs or more (Linux) and util-linux's taskset")  # fmt: skip
    rate = args.link_mbit
    if rate and not (math.isfinite(rate) and rate >= 1 and os.geteuid() == 0 and Path(netlab.TC).exists()):
        parser.error(f"--link-mbit {rate:g}: expected 0 (loopback as it is) or a rate of at least 1 Mbit/s, as root, "
                     f"with iproute2's tc ({netlab.TC})")  # fmt: skip
    if not rate and netlab.loopback_shaped():
        parser.error("loopback is shaped (tc qdisc show dev lo: tbf), left by a run killed outright; "
                     "remove it: tc qdisc del dev lo root")  # fmt: skip
    return args


def pinned_halves() -> tuple[list[int], list[int]]:
    """This process's CPUs split in two: (the rest's, the workers')."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[: len(cpus) // 2], cpus[len(cpus) // 2 :]


def run_config(model: Path, args) -> dict:
    """The run config of one size (the algorithm, ``verify-invariant`` and the folders: ``round_compare.compare``)."""
    return {
        "model": str(model), "num-server-rounds": args.rounds,
        "layers-per-block": LAYERS_PER_BLOCK, "schedule": "ascending", "transfer-dtype": args.transfer_dtype,
        "dataset": "reasoning-gym:gsm_symbolic", "num-examples": 32, "heldout-examples": 4, "max-seq-len": 128,
        "generate-examples": 0, "eval-every": 1000, "evaluation": "clients", "local-steps": 1, "batch-size": 1,
        "torch-threads": 1, "transport": "direct",  # on loopback, plaintext (``launch.direct_transport``)
    }  # fmt: skip


def link_seconds(wire_bytes: float, link_mbit: float) -> float:
    """A block's time on the link one way (0: loopback unshaped)."""
    return wire_bytes * 8 / (link_mbit * 1e6) if link_mbit else 0.0


def stand_in_worker(compute_s: float, cpus: list[int] | None = None):
    """The real worker's command, with the stand-in's module in its place (``cpus``: under taskset, on those)."""
    pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
    return lambda real: [*pin, real[0], "-m", "benchmarks.stand_in_worker", "--compute-s", str(compute_s), *real[3:]]


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.link_mbit:
        return run_pinned_or_not(args)
    netlab.stop_on_sigterm()  # the shaping goes with the run, however it ends
    with netlab.shaped_loopback(args.link_mbit):
        return run_pinned_or_not(args)


def run_pinned_or_not(args) -> dict:
    if not args.pin:
        return run_sizes(args, None)
    own_cpus = os.sched_getaffinity(0)
    rest, workers_cpus = pinned_halves()
    os.sched_setaffinity(0, rest)  # what this process starts inherits its CPUs; the workers' taskset overrides them
    try:
        return run_sizes(args, workers_cpus)
    finally:
        os.sched_setaffinity(0, own_cpus)


def run_sizes(args, workers_cpus: list[int] | None) -> dict:
    """Each ``--hidden`` size deployed once per algorithm; the table printed and, with ``--report``, written."""
    results, table, found = {}, [], []
    with tempfile.TemporaryDirectory(prefix="parablock-stand-in-") as tmp:
        workdir = Path(tmp)
        for hidden in args.hidden:
            model = build_tiny_model(workdir / f"model-{hidden}", num_layers=LAYERS, hidden=hidden, vocab=512)
            wire_bytes = block_bytes(str(model), LAYERS_PER_BLOCK, args.transfer_dtype)
            setting = f"{hidden} ({wire_bytes / 1e6:.0f} MB)"
            try:
                measured = compare(run_config(model, args), workdir / f"{hidden}",
                                   args.verify_invariant, nodes=args.nodes,
                                   worker=stand_in_worker(args.compute_s, workers_cpus))  # fmt: skip
            except SystemExit as err:  # a run that failed is a row of the table, with its last line
                last = str(err).strip().splitlines()[-1] if str(err).strip() else "failed"
                table.append(f"| {setting} | failed: {last[:300]} | | | | | | | |")
                continue
            results[hidden] = measured
            table += rows(setting, measured)
            link_s = 2 * args.nodes * link_seconds(wire_bytes, args.link_mbit)  # every node's bytes share lo's rate
            found += targets(setting, wire_bytes, measured, link_s=link_s)
            print("\n".join(table[-len(measured) - 1 :]), flush=True)
    link = (
        f"loopback at {args.link_mbit:g} Mbit/s, a block each way for each node"
        if args.link_mbit
        else "loopback, its time taken as 0"
    )
    body = f"{TABLE_HEAD}\n" + "\n".join(table) + f"\n\n{targets_table(found, link)}\n"
    print(body)
    if args.report:  # one section per setting: the file keeps the others
        heading = (f"## C = {args.compute_s:g} s, {args.nodes} SuperNode(s), {args.transfer_dtype}, "
                   f"verify-invariant {'off and on' if args.verify_invariant else 'off'}"
                   f"{', workers pinned' if args.pin else ''}"
                   f"{f', loopback at {args.link_mbit:g} Mbit/s' if args.link_mbit else ''}")  # fmt: skip
        shaped = f" shaped to {args.link_mbit:g} Mbit/s (tbf on lo: both ways together)" if args.link_mbit else ""
        body = (
            f"`{command('stand_in')}` at {commit()}, {time.strftime('%Y-%m-%d')}; {machine_line()}. "
            f"Transport direct on loopback{shaped} (plaintext), {args.rounds} rounds, "
            f"{window(list(results.values()))}.\n\n{body}"
        )
        doc = RESULTS_DIR / "stand_in.md"
        if not doc.exists():
            doc.write_text(f"# ParaBlock against BCD beside a GPU's stand-in\n\n{__doc__.split(chr(10) * 2)[0]}\n")
        replace_doc_section(heading, body, doc=doc)
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(PROJECT_DIR))
    main()
