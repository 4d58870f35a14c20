"""What a block-sized buffer made fresh costs, against writing one the process holds already: the first touch of
its pages, as the ServerApp and the node workers make them (``memory.map_large_buffers``: a mapping of its own,
given back when freed; with and without the huge pages that ``tools.launch`` and the units ask for).

A round makes blocks on both sides (the server's sum and new ``x[b]``, a node's residual and the bytes it receives),
and frees each before the next; made afresh each round (before ``kept_blocks`` kept them), what that costs depends
on where the kernel finds the pages. A block freed moments before is cheap to make again; one freed some seconds
before may cost ten times more: on a virtual machine whose balloon reports free pages to its host (virtio's free
page reporting; this machine's, as the run prints), the host takes the pages back about 2 s after they are freed,
and each touch faults them in from the host again. That cost falls on whichever process asks next, so a change that
frees less on one side can make the other side's rounds slower: a round's CPU is read on both sides together. The
``resident`` row is what a buffer kept across rounds costs: memory speed.

Each case runs in a process of its own, started as the deployment starts its processes; the figures are the
median of ``--repeats`` touches of one block of ``--mb`` MB (a numpy fill, single-threaded, as
``kept_blocks.empty(touched=True)`` writes a fresh one)::

    python -m benchmarks.fresh_memory --mb 944 --report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import write_report
from parablock_flwr.memory import HUGE_PAGES, with_huge_pages

PAUSES_S = (0.0, 1.0, 3.0, 8.0)  # how long before its touch the block's predecessor was freed
BALLOON = Path("/sys/bus/virtio/drivers/virtio_balloon")
REPORTING_BIT = 5  # VIRTIO_BALLOON_F_REPORTING (linux/virtio_balloon.h)


def touch_s(nbytes: int) -> tuple[float, object]:
    """Seconds to make a block of ``nbytes`` and write every byte once, and the block."""
    import torch

    start = time.perf_counter()
    block = torch.empty(nbytes, dtype=torch.uint8)
    block.numpy().fill(1)
    return time.perf_counter() - start, block


def child(nbytes: int, repeats: int, pauses: list[float]) -> dict:
    """The cases' median seconds, in this process (started with the environment under test), and whether it
    asked for huge pages."""
    from parablock_flwr.memory import huge_pages_asked, map_large_buffers

    map_large_buffers()
    first, block = touch_s(nbytes)
    cases = {"never used": [first]}
    cases["resident"] = []
    for _ in range(repeats):
        start = time.perf_counter()
        block.numpy().fill(2)
        cases["resident"].append(time.perf_counter() - start)
    for pause in pauses:
        runs = cases.setdefault(f"freed {pause:g} s before", [])
        for _ in range(repeats):
            del block
            time.sleep(pause)
            seconds, block = touch_s(nbytes)
            runs.append(seconds)
    return {
        "huge_pages": huge_pages_asked(),
        "seconds": {case: statistics.median(runs) for case, runs in cases.items()},
    }


def free_page_reporting() -> str:
    """Whether this machine's balloon reports free pages to its host: yes, no, or no balloon."""
    devices = sorted(BALLOON.glob("virtio*")) if BALLOON.is_dir() else []
    if not devices:
        return "no virtio balloon"
    features = (devices[0] / "features").read_text().strip()
    on = len(features) > REPORTING_BIT and features[REPORTING_BIT] == "1"
    return "yes (virtio_balloon: free page reporting)" if on else "no (virtio_balloon without free page reporting)"


def measure(nbytes: int, repeats: int, pauses: list[float], huge: bool) -> dict:
    """``child`` in a fresh process, with or without the launch's huge pages."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env = with_huge_pages(env) if huge else env
    cmd = [sys.executable, "-m", "benchmarks.fresh_memory", "--child", str(nbytes), "--repeats", str(repeats),
           "--pauses", *map(str, pauses)]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def table(nbytes: int, results: dict[bool, dict]) -> str:
    """One row a case: seconds and MB/s, with and without huge pages, and each against ``resident``."""
    lines = [
        "| the block's pages | huge pages: s | MB/s | × resident | 4 KiB pages: s | MB/s | × resident |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in results[True]["seconds"]:
        row = [case]
        for huge in (True, False):
            seconds = results[huge]["seconds"]
            row += [f"{seconds[case]:.3f}", f"{nbytes / seconds[case] / 1e6:,.0f}",
                    f"{seconds[case] / seconds['resident']:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=944, help="the block's size in MB (default 944: 236 M fp32 values)")
    p.add_argument("--repeats", type=int, default=3, help="touches a case (default 3; their median is shown)")
    p.add_argument(
        "--pauses",
        type=float,
        nargs="+",
        default=list(PAUSES_S),
        help=f"seconds between freeing a block and making the next (default: {' '.join(f'{x:g}' for x in PAUSES_S)})",
    )
    p.add_argument("--report", action="store_true", help="write docs/results/fresh_memory.md")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one process of the run, the block's bytes
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.repeats, args.pauses)))
        return {}
    if args.mb < 1 or args.repeats < 1 or min(args.pauses) < 0:
        p.error(f"--mb {args.mb} --repeats {args.repeats} --pauses {args.pauses}: expected at least 1, 1 and 0")
    nbytes = args.mb * 10**6
    results = {huge: measure(nbytes, args.repeats, args.pauses, huge) for huge in (True, False)}
    reporting = free_page_reporting()
    text = (
        f"A block of {args.mb} MB, the median of {args.repeats} touches a case; free pages reported to a host: "
        f"{reporting}. Huge pages: `GLIBC_TUNABLES={HUGE_PAGES}`, as `tools.launch` starts the ServerApp and "
        f"the node workers.\n\n{table(nbytes, results)}\n"
    )
    print(text)
    if args.report:
        print(f"wrote {write_report('fresh_memory', 'A block made fresh, against one kept', text, __doc__)}")
    return {"reporting": reporting, "results": results}


if __name__ == "__main__":
    main()
