"""What tests import: a tiny run config, Flower runs through the project's launcher, and the
process helpers that kill a run's server. Fixtures are in conftest.py."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from parablock_flwr.durable import CRASH_ENV
from parablock_flwr.metrics import RunRecorder
from parablock_flwr.replica import StepLog
from parablock_flwr.run_status import read_status
from parablock_flwr.tools.launch import run_deployment, run_simulation
from parablock_flwr.wire import pack

# Functions that start Flower processes: a test that calls one (directly, or through a function or
# fixture of its own module) is marked `e2e` by conftest.py even without a marker of its own.
STARTS_FLOWER: set = {run_simulation, run_deployment}


def succeeded(run: FinishedRun) -> FinishedRun:
    """``run``, once it is known to have ended well with its folder made (else its output's tail)."""
    assert run.returncode == 0 and run.run_dir is not None, run.stdout[-4000:] + run.stderr[-3000:]
    return run


def npy_bytes(array: np.ndarray) -> bytes:
    """``array`` as an npy payload (what Flower's ``Array.data`` and the stream's framing carry)."""
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def relayed(records: dict[str, dict[str, torch.Tensor]], transfer_dtype: str = "fp32") -> dict:
    """The arrays a ClientApp relays to its node worker for these records: ``{"record/array": array}``,
    each record packed as it travels (``wire.pack``)."""
    packed = {record: pack(tensors, transfer_dtype) for record, tensors in records.items()}
    return {f"{record}/{name}": a for record, arrays in packed.items() for name, a in arrays.items()}


def starts_flower(func):
    """Register ``func`` as starting Flower processes (see ``STARTS_FLOWER``)."""
    STARTS_FLOWER.add(func)
    return func


def tiny_config(model_dir: Path, output_dir: Path, **overrides) -> dict:
    """A run config small enough for a few seconds per round on a CPU."""
    config = {
        "model": str(model_dir),
        "output-dir": str(output_dir),
        "dataset": "reasoning-gym:gsm_symbolic",  # prompts the tiny tokenizer (trained on it) keeps short
        "num-examples": 64,
        "heldout-examples": 8,
        "layers-per-block": 2,
        "num-server-rounds": 3,
        "local-steps": 4,
        "batch-size": 4,
        "max-seq-len": 128,
        "learning-rate": 3e-3,
        "torch-threads": 1,
        "latency-ms": 5.0,
        "generate-examples": 2,
        "max-new-tokens": 8,
    }
    config.update(overrides)
    return config


def worker_request(
    config: dict, run_id: int, server_round: int, block: int, next_block: int, partition_id: int = 0,
    num_partitions: int = 1, **round_extra,
) -> dict:  # fmt: skip
    """The header of a ``train`` request as the ClientApp relays it to a node worker
    (``NodeWorker.serve_request``): round ``server_round`` of run ``run_id`` trains ``block``, the
    next one ``next_block`` (-1: none); ``round_extra`` adds message keys (``sync-version``, catch-up...)."""
    return {
        "op": "train",
        "run-id": run_id,
        "run-config": config,
        "partition-id": partition_id,
        "num-partitions": num_partitions,
        "node": {},  # the node config's own data and device: none
        "round": {
            "server-round": server_round,
            "block": block,
            "step-block": 0 if server_round > 1 else -1,
            "next-block": next_block,
            "algorithm": "parablock",
            "run-dir": "unused",
            **round_extra,
        },
    }


@dataclass
class FinishedRun:
    returncode: int  # the launcher's exit code: the run's status record's (docs/usage.md, "Exit codes")
    stdout: str
    stderr: str
    run_dir: Path | None
    status: dict | None = None  # the run folder's status.json (None: not written)

    @property
    def records(self) -> list[dict]:
        return RunRecorder(self.run_dir).read()  # one merged dict per round

    def step(self, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        return StepLog(self.run_dir).read(version)

    def final_model(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.run_dir / "final-model" / "model.safetensors"))


@starts_flower
def simulate(
    tmp_path: Path, model_dir: Path, *, num_supernodes: int = 3, cpus_per_client: int = 1, **overrides
) -> FinishedRun:
    """Run the app through `flwr run` on Flower's Ray simulation engine."""
    out = tmp_path / "out"
    config = tiny_config(model_dir, out, **{k.replace("_", "-"): v for k, v in overrides.items()})
    result = run_simulation(
        tmp_path / "flower", config, num_supernodes=num_supernodes, cpus_per_client=cpus_per_client, timeout_s=900
    )
    return finished(result, out)


def finished(result, out: Path) -> FinishedRun:
    """The finished run (a ``launch.RunResult``) and its run folder: the one the launcher found from
    the run id, else the newest under ``out`` (None if none)."""
    run_dir = getattr(result, "run_dir", None)
    if run_dir is None:
        run_dirs = sorted(p for p in out.glob("*") if p.is_dir()) if out.exists() else []
        run_dir = run_dirs[-1] if run_dirs else None
    return FinishedRun(result.returncode, result.stdout, result.stderr, run_dir, getattr(result, "status", None))


def side_by_side(runs: dict[str, Callable[[], FinishedRun]]) -> dict[str, FinishedRun]:
    """Runs that each start processes of their own (``simulate``, ``simulate_in_process``), all at once: a run's
    start-up (imports, the evaluator's process, the model's load) and Flower's polls leave the machine's cores
    idle much of the time, so a few runs side by side take far less than one after the other (tests/
    test_reference.py's five: about 70 s on 2 cores, against about 25 s each). Each keeps its own folders."""
    with ThreadPoolExecutor(len(runs)) as pool:
        started = {label: pool.submit(run) for label, run in runs.items()}
        return {label: future.result() for label, future in started.items()}


@starts_flower
def simulate_in_process(
    tmp_path: Path,
    model_dir: Path,
    *,
    num_supernodes: int = 3,
    crash_at: str = "",
    node_configs: list[dict] | None = None,
    reject: str = "",
    **overrides,
) -> FinishedRun:
    """The ServerApp and ``num_supernodes`` nodes running the real ClientApp in one subprocess, over
    Flower's in-memory LinkState and Grid (tests/federation.py): the simulation's code paths without
    Ray or a SuperLink, seconds of start-up instead of a minute. ``crash_at`` (``stage@round``,
    ``durable.crash_point``): the process SIGKILLs itself there, server and nodes together, as if
    their machine had died (returncode -9, no status record). ``node_configs``: each node's own
    node-config keys (a site's ``dataset``). ``reject``
    (``node@round``): that node's reply of that round is made one the server rejects (tests/federation.py,
    ``rejecting``)."""
    out = tmp_path / "out"
    config = tiny_config(model_dir, out, **{k.replace("_", "-"): v for k, v in overrides.items()})
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "run-config.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k not in (CRASH_ENV, "PARABLOCK_TEST_REJECT")}
    env |= ({CRASH_ENV: crash_at} if crash_at else {}) | ({"PARABLOCK_TEST_REJECT": reject} if reject else {})
    script = Path(__file__).with_name("federation.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run-config.json"), str(num_supernodes)]
        + ([json.dumps(node_configs)] if node_configs else []),
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    run_dirs = sorted(p for p in out.glob("*") if p.is_dir()) if out.exists() else []
    run_dir = run_dirs[-1] if run_dirs else None
    status = read_status(run_dir) if run_dir else None
    return FinishedRun(proc.returncode, proc.stdout, proc.stderr, run_dir, status)


def kill_server_after_round(flwr_home: Path, out: Path, after_round: int) -> threading.Thread:
    """A thread that waits until round ``after_round`` is checkpointed under ``out``, then SIGKILLs
    the server process (`flwr-simulation`, which also drives Ray, or `flwr-serverapp` in a
    deployment), what it leaves behind, and the `flwr run` waiting on it: the run stops as if the
    server's machine had died in the next round."""

    def kill_all() -> None:
        deadline = time.monotonic() + 600
        while not list(out.glob(f"*/checkpoint/round-{after_round:05d}")) and time.monotonic() < deadline:
            time.sleep(0.1)
        servers = flower_pids(flwr_home, lambda argv: argv[1].endswith((b"flwr-simulation", b"flwr-serverapp")))
        left = [child for pid in servers for child in descendants(pid)]
        for pid in servers:
            kill(pid)
        time.sleep(3)
        for pid in left + flower_pids(flwr_home, lambda argv: argv[1].endswith(b"/flwr") and argv[2:3] == [b"run"]):
            kill(pid)

    thread = threading.Thread(target=kill_all, daemon=True)
    thread.start()
    return thread


@starts_flower
def simulate_and_kill_server(tmp_path: Path, model_dir: Path, *, after_round: int, **overrides) -> FinishedRun:
    """`simulate`, with the server killed once round ``after_round`` is checkpointed."""
    killer = kill_server_after_round(tmp_path / "flower" / "flwr-home", tmp_path / "out", after_round)
    run = simulate(tmp_path, model_dir, **overrides)
    killer.join()
    return run


def flower_pids(flwr_home: Path, match) -> list[int]:
    """Processes started for this FLWR_HOME whose argv matches."""
    marker, found = f"FLWR_HOME={flwr_home}".encode(), []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if len(argv) > 1 and match(argv) and marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill(pid: int) -> None:
    """SIGKILL one process by its PID, if it still runs."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
