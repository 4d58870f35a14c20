"""Shared fixtures: a tiny real Llama with a locally trained tokenizer, and Flower runs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parablock_flwr.launch import run_simulation
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
