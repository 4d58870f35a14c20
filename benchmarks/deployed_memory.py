"""What a deployed node worker and its ServerApp really hold, against `parablock-flwr plan`.

Runs a real local deployment per algorithm and transfer dtype (``tools.launch.run_deployment``, the direct
stream on loopback, ``evaluation = "clients"``) and polls every process's resident memory (RSS) every
0.2 s. It prints each process's peak beside ``plan``'s figure for the same run config (a CPU node's
``cpu_total``, the ServerApp's ``server_total``) and their ratio, and the worker's own account of where its
memory went by round: the peak its replies reported (``node_peak_rss_bytes_max``, the worker's ``VmHWM`` when it
answered), which shows whether what it holds grows with rounds; and beside them the means of rounds 2..R of the
round's wall time and the node's compute, since how a process holds memory changes how fast it computes.

    .venv/bin/python -m benchmarks.deployed_memory --report                  # issue 51's model, both algorithms
    .venv/bin/python -m benchmarks.deployed_memory --hidden 1024 --rounds 6 --algorithms parablock --weights fp32
                                                                            # as CI runs it

The model is a wide, shallow Llama (``tools.tiny_model.build_tiny_model``: 8 layers, ``--hidden``, a vocabulary
of 512) in two 4-layer blocks, trained with bf16 weights and precision (``--weights``): at hidden 2048 that is 0.30 B
parameters and two blocks of 151 M, the shape an operator's 1B model has per block.

Reading the page: ParaBlock's worker holds more than BCD's, its pending update and the update sent while the
next block trains.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

import psutil

from benchmarks.common import PROJECT_DIR, read_records, write_report
from parablock_flwr.tools import launch
from parablock_flwr.tools.tiny_model import build_tiny_model

LAYERS, LAYERS_PER_BLOCK = 8, 4
POLL_S = 0.2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.deployed_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--algorithms", nargs="+", default=["fedbcd", "parablock"])
    parser.add_argument("--weights", default="bf16", choices=["bf16", "fp32"],
                        help="the weights' and the computation's dtype (default: issue 51's bf16; fp32 computes "
                             "several times faster on a CPU without bf16 instructions)")  # fmt: skip
    parser.add_argument("--transfer-dtypes", nargs="+", default=["int8"], choices=["fp32", "bf16", "fp16", "int8"])
    parser.add_argument("--workdir", type=Path, help="keep the runs' folders and logs here (default: a temporary one)")
    parser.add_argument("--report", action="store_true", help="write docs/results/deployed_memory.md")
    return parser.parse_args(argv)


def run_config(algorithm: str, transfer_dtype: str, model: Path, rounds: int, out: Path, weights: str) -> dict:
    """Issue 51's settings (bf16 weights and precision by default, two local steps), rows of at most 128 tokens."""
    return {
        "algorithm": algorithm, "model": str(model), "output-dir": str(out), "num-server-rounds": rounds,
        "layers-per-block": LAYERS_PER_BLOCK, "schedule": "ascending", "transfer-dtype": transfer_dtype,
        "weights": weights, "precision": weights, "dataset": "reasoning-gym:gsm_symbolic", "num-examples": 32,
        "heldout-examples": 4, "max-seq-len": 128, "batch-size": 2, "local-steps": 2, "generate-examples": 0,
        "eval-every": 1000, "evaluation": "clients", "torch-threads": 2,
        "transport": "direct", "transport-insecure": True,
    }  # fmt: skip


def kind_of(proc: psutil.Process) -> str | None:
    """The node worker or the ServerApp, from a process's command line; None for the others."""
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    if "parablock_flwr.worker" in line:
        return "worker"
    if "flwr-serverapp" in line:
        return "serverapp"
    return None


class PeakRss:
    """Polls the RSS of every worker and ServerApp under this process until stopped: the peak of each kind."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(POLL_S):
            for proc in me.children(recursive=True):
                if (kind := kind_of(proc)) is None:
                    continue
                try:
                    rss = proc.memory_info().rss
                except psutil.Error:
                    continue
                self.peak[kind] = max(self.peak.get(kind, 0), rss)


def planned(config: dict) -> tuple[int, int]:
    """``plan``'s figures for ``config``: a CPU node's peak and the ServerApp's, in bytes."""
    from parablock_flwr.config import RunConfig
    from parablock_flwr.plan import make_plan, model_config, model_shape

    cfg = RunConfig.from_flower({**config, "transport-address": "localhost:0"})  # as run_deployment sets it
    the_plan = make_plan(cfg, model_shape(cfg, model_config(config["model"])), num_nodes=1)
    return the_plan.cpu_total, the_plan.server_total


def deploy(config: dict, workdir: Path) -> tuple[dict[str, int], list[dict]]:
    """One deployment with one SuperNode: the peak RSS of each kind of process, and the run's records."""
    with PeakRss() as rss:
        proc = launch.run_deployment(workdir, config, num_supernodes=1, timeout_s=1800)
    if proc.returncode != 0 or proc.run_dir is None:
        sys.exit(f"the run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{proc.summary()}")
    return rss.peak, read_records(proc.run_dir)


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    results, rows = [], []
    with tempfile.TemporaryDirectory(prefix="parablock-memory-") as tmp:
        workdir = args.workdir or Path(tmp)
        model = build_tiny_model(workdir / "model", num_layers=LAYERS, hidden=args.hidden, vocab=512)
        for dtype in args.transfer_dtypes:
            for algorithm in args.algorithms:
                name = f"{algorithm}-{dtype}"
                config = run_config(algorithm, dtype, model, args.rounds, workdir / f"out-{name}", args.weights)
                plan_worker, plan_server = planned(config)
                peak, records = deploy(config, workdir / name)
                result = {"algorithm": algorithm, "transfer_dtype": dtype, "peak": peak,
                          "plan": {"worker": plan_worker, "serverapp": plan_server}, "records": records}  # fmt: skip
                results.append(result)
                key = "node_peak_rss_bytes_max"
                by_round = ", ".join(gb(r[key]) for r in records if key in r)
                later = [r for r in records if r.get("round", 0) >= 2 and "round_wall_s" in r]
                compute = sum(r["compute_s_max"] for r in later) / max(1, len(later))
                wall = sum(r["round_wall_s"] for r in later) / max(1, len(later))
                rows.append(
                    f"| {algorithm} | {dtype} | {wall:.1f} | {compute:.1f} | {gb(peak.get('worker', 0))} | "
                    f"{by_round} | {gb(plan_worker)} | "
                    f"{peak.get('worker', 0) / plan_worker:.2f} | {gb(peak.get('serverapp', 0))} | "
                    f"{gb(plan_server)} | {peak.get('serverapp', 0) / plan_server:.2f} |"
                )
                print(rows[-1], flush=True)
    table = "\n".join([
        "| algorithm | transfer | round s | compute s | worker peak GB | worker's peak by round GB | plan GB "
        "| peak / plan | ServerApp peak GB | plan GB | peak / plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|", *rows,
    ])  # fmt: skip
    print(table)
    if args.report:
        write_report("deployed_memory", "What a deployed worker holds, against plan", f"{table}\n", doc=__doc__)
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(PROJECT_DIR))
    main()
