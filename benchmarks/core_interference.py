"""How much work at the lowest CPU priority on one core slows work on the other (issue 23's evaluator).

A probe of 1024x1024 fp32 matmuls (one torch thread) runs on ``--probe-cpu`` alone, then again while
the same loop runs on ``--load-cpu`` at ``SCHED_IDLE``; it prints the probe's matmuls/s both ways and
their ratio. Below 1.0, the cores share something no CPU priority arbitrates (cache, memory bandwidth):

    .venv/bin/python -m benchmarks.core_interference                 # CPU 1 probed, load on CPU 0, 8 s each
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

LOOP = """
import os, sys, time, torch
os.sched_setaffinity(0, {int(sys.argv[1])})
if sys.argv[3] == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
torch.set_num_threads(1)
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
count, end = 0, time.perf_counter() + float(sys.argv[2])
while time.perf_counter() < end:
    a @ b
    count += 1
print(count / float(sys.argv[2]))
"""


def matmuls_per_s(cpu: int, seconds: float, mode: str = "normal") -> subprocess.Popen:
    """The loop on ``cpu`` for ``seconds`` (``mode`` "idle": at SCHED_IDLE); its stdout is its rate."""
    cmd = [sys.executable, "-c", LOOP, str(cpu), str(seconds), mode]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probe-cpu", type=int, default=1)
    p.add_argument("--load-cpu", type=int, default=0)
    p.add_argument("--seconds", type=float, default=8.0)
    args = p.parse_args()
    alone = float(matmuls_per_s(args.probe_cpu, args.seconds).communicate()[0])
    load = matmuls_per_s(args.load_cpu, args.seconds + 2, "idle")
    time.sleep(1.0)  # the load is running before the probe starts
    beside = float(matmuls_per_s(args.probe_cpu, args.seconds).communicate()[0])
    load.communicate()
    print(
        f"load {os.getloadavg()[0]:.1f}; CPU {args.probe_cpu} alone: {alone:.1f} matmuls/s; beside a SCHED_IDLE "
        f"loop on CPU {args.load_cpu}: {beside:.1f} matmuls/s; ratio {beside / alone:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
