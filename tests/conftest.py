"""Shared fixtures: a tiny real Llama with a locally trained tokenizer, and Flower runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parablock_flwr.launch import flower_env, flwr_run_command, local_superlink, run_simulation
from parablock_flwr.replica import StepLog
from parablock_flwr.testing import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def tiny_config(model_dir: Path, output_dir: Path, **overrides) -> dict:
    """A run config small enough for a few seconds per round on a CPU."""
    config = {
        "model": str(model_dir), "output-dir": str(output_dir), "num-examples": 64, "heldout-examples": 8,
        "layers-per-block": 2, "num-server-rounds": 3, "local-steps": 4, "batch-size": 4,
        "max-seq-len": 128, "learning-rate": 3e-3, "torch-threads": 1, "latency-ms": 5.0,
        "generate-examples": 2, "max-new-tokens": 8,
    }
    config.update(overrides)
    return config


@dataclass
class FinishedRun:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path | None

    @property
    def records(self) -> list[dict]:
        return [json.loads(l) for l in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    def step(self, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        return StepLog(self.run_dir).read(version)

    def final_model(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.run_dir / "final-model" / "model.safetensors"))


def simulate(tmp_path: Path, model_dir: Path, *, num_supernodes: int = 3, cpus_per_client: int = 1,
             **overrides) -> FinishedRun:
    """Run the app through `flwr run` on Flower's Ray simulation engine."""
    out = tmp_path / "out"
    config = tiny_config(model_dir, out, **{k.replace("_", "-"): v for k, v in overrides.items()})
    proc = run_simulation(tmp_path / "flower", config,
                          num_supernodes=num_supernodes, cpus_per_client=cpus_per_client, timeout_s=900)
    return finished(proc, out)


def finished(proc, out: Path) -> FinishedRun:
    """The finished `flwr run` and the run folder it made under ``out`` (None if none)."""
    run_dirs = sorted(out.glob("*")) if out.exists() else []
    return FinishedRun(proc.returncode, proc.stdout, proc.stderr, run_dirs[-1] if run_dirs else None)


def simulate_and_kill_server(tmp_path: Path, model_dir: Path, *, after_round: int, num_supernodes: int = 3,
                             **overrides) -> FinishedRun:
    """`flwr run` on the simulation engine; SIGKILL the server process once round ``after_round``
    is checkpointed (the next round is under way), then stop Flower."""
    out = tmp_path / "out"
    config = tiny_config(model_dir, out, **{k.replace("_", "-"): v for k, v in overrides.items()})
    workdir = tmp_path / "flower"
    workdir.mkdir(parents=True)
    flwr_home = workdir / "flwr-home"
    with local_superlink(workdir):
        cmd = flwr_run_command(workdir, config, extra=[
            "--federation-config", f"num-supernodes={num_supernodes} client-resources-num-cpus=1"])
        with open(tmp_path / "flwr-run.log", "w") as log:
            proc = subprocess.Popen(cmd, env=flower_env(flwr_home), stdout=log, stderr=subprocess.STDOUT)
        orphans: list[int] = []
        try:
            deadline = time.monotonic() + 600
            while not list(out.glob(f"*/checkpoint/round-{after_round:05d}")):
                assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
                time.sleep(0.1)
            server = _simulation_server_pid(flwr_home)
            orphans = _descendants(server)
            os.kill(server, signal.SIGKILL)  # the ServerApp and the simulation engine's Ray driver
            time.sleep(5)
        finally:
            for pid in (proc.pid, *orphans):  # `flwr run`, and what the killed driver leaves (Ray), by PID
                _kill(pid)
            proc.wait()
    return finished(subprocess.CompletedProcess(cmd, proc.returncode, (tmp_path / "flwr-run.log").read_text(), ""),
                    out)


def _simulation_server_pid(flwr_home: Path) -> int:
    """The `flwr-simulation` process (ServerApp + Ray driver) started for this FLWR_HOME."""
    marker = f"FLWR_HOME={flwr_home}".encode()
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if any(a.endswith(b"flwr-simulation") for a in argv[:2]) and marker in (proc / "environ").read_bytes():
                return int(proc.name)
        except (OSError, ValueError):
            continue
    raise AssertionError(f"no flwr-simulation process for {flwr_home}")


def _descendants(pid: int) -> list[int]:
    children = {}
    for proc in Path("/proc").iterdir():
        try:
            children.setdefault(int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
