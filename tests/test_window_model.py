"""The time model's per-byte cost: benchmarks/window.py's fit, the config key, and LinkModel using both."""

import pytest

from benchmarks.window import fit
from parablock_flwr import core
from parablock_flwr.config import ConfigError, RunConfig


def test_fitted_fixed_and_per_byte_cost_drive_the_time_model():
    # Windows of an exchange costing 2 s + bytes at 100 MB/s, measured at three sizes (with a repeat).
    sizes = [1e6, 1e6, 140e6, 420e6]
    fitted = fit(sizes, [2.0 + b / 100e6 for b in sizes])
    assert fitted["fixed_s"] == pytest.approx(2.0) and fitted["throughput_mbs"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="expected at least 2"):
        fit([1e6, 1e6], [2.0, 2.1])  # one size cannot separate the two terms

    cfg = RunConfig.from_flower({"message-overhead-s": 2.0, "message-throughput-mbs": 100.0, "latency-ms": 0.0})
    link = core.LinkModel.from_config(cfg)  # the link adds 8 * bytes / 50 Mbit/s each way
    assert link.comm_seconds(70e6, 70e6) == pytest.approx(2.0 + 1.4 + 2 * 8 * 70e6 / 50e6)
    assert core.LinkModel(50.0, 50.0, 0.0, 2.0).comm_seconds(70e6, 70e6) == pytest.approx(2.0 + 2 * 8 * 70e6 / 50e6)
    with pytest.raises(ConfigError, match=r"message-throughput-mbs=-1.0: expected a number >= 0"):
        RunConfig.from_flower({"message-throughput-mbs": -1.0})
