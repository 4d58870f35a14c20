"""`metrics-sink = "tensorboard"`: each round's numbers also as TensorBoard scalars; the package is an
optional extra, so a run that asks for it without the package is refused before it starts."""

from __future__ import annotations

import importlib.util

import pytest

from parablock_flwr.config import ConfigError, RunConfig
from parablock_flwr.metrics import RunRecorder

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def test_an_unknown_sink_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match="metrics-sink='wandb'"):
        RunConfig.from_flower({"metrics-sink": "wandb"})
    assert RunConfig.from_flower({}).metrics_sink == ""  # off by default


@pytest.mark.skipif(HAS_TENSORBOARD, reason="tensorboard is installed here")
def test_the_tensorboard_sink_without_its_package_is_refused_naming_the_extra():
    with pytest.raises(
        ConfigError,
        match=r"the tensorboard package is not installed; expected `pip install 'parablock-flwr\[tensorboard\]'`",
    ):
        RunConfig.from_flower({"metrics-sink": "tensorboard"})


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="needs the tensorboard extra")
def test_each_rounds_numbers_read_back_from_the_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recorder = RunRecorder(tmp_path, "tensorboard")
    recorder.write({"round": 0, "heldout_loss": 2.5, "task_accuracy": 0.25})
    recorder.write({"round": 1, "train_loss": 2.0, "heldout_loss": 1.75, "block_label": "layers 25-29", "ok": True})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["heldout_loss", "task_accuracy", "train_loss"]
    assert [(e.step, e.value) for e in events.Scalars("heldout_loss")] == [(0, 2.5), (1, 1.75)]
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [(1, 2.0)]
    assert len(recorder.read()) == 2  # metrics.jsonl stays the record
