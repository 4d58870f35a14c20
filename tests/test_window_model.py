"""The time model's per-byte cost: the benchmarks' fit, the config key, LinkModel using both, and the
fit of a dtype sweep and of two run folders of one's own (``python -m benchmarks.time_model``)."""

import pytest

from benchmarks.common import fit
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


def test_the_dtype_sweep_calibrates_on_two_dtypes_and_predicts_the_other_rates():
    """benchmarks/network/dtypes.py on the records of an exchange costing exactly 3 s + bytes at 40 MB/s
    + the link: calibrated on the fastest rate's largest and smallest messages, it recovers both terms,
    and predicts every other run's rounds (compute + window) with no error."""
    from benchmarks.network import dtypes

    def run(dtype: str, rate: float, nbytes: float) -> dict:
        window = 3.0 + 2 * nbytes / 40e6 + 2 * 8 * nbytes / (rate * 1e6) + 2 * 0.005
        rounds = [{"round": r, "comm_s": None if r == 1 else window, "compute_s": 4.0,
                   "round_wall_s": 4.0 + (0 if r == 1 else window), "bytes_up_per_client": nbytes,
                   "bytes_down_per_client": nbytes} for r in (1, 2, 3)]  # fmt: skip
        return {"transfer_dtype": dtype, "rate_mbps": rate, "latency_ms": 5.0, "load_1min": 1.0, "rounds": rounds}

    sizes = {"fp32": 70.8e6, "bf16": 35.4e6, "int8": 18.0e6}
    runs = [run(dtype, rate, n) for rate in (100.0, 1000.0) for dtype, n in sizes.items()]
    analysis = dtypes.analyse(runs)
    assert analysis["model"]["fixed_s"] == pytest.approx(3.0)
    assert analysis["model"]["throughput_mbs"] == pytest.approx(40.0)
    assert analysis["model"]["calibrated_on"] == ["int8 at 1000 Mbit/s", "fp32 at 1000 Mbit/s"]
    predicted = {(r["transfer_dtype"], r["rate_mbps"]) for r in analysis["predictions"]}
    assert predicted == {("fp32", 100.0), ("bf16", 100.0), ("int8", 100.0), ("bf16", 1000.0)}
    assert max(abs(r["error"]) for r in analysis["predictions"]) < 1e-9
    assert "largest error 0%" in dtypes.tables(runs, analysis)


def _exchange_run(run_dir, nbytes: float, rounds: int = 4) -> None:
    """A run folder whose records show an exchange costing exactly 3 s + bytes at 40 MB/s beside a
    1000 Mbit/s, 5 ms link (round 0: before training)."""
    from parablock_flwr.metrics import RunRecorder

    window = 3.0 + 2 * nbytes / 40e6 + 2 * 8 * nbytes / 1e9 + 2 * 0.005
    recorder = RunRecorder(run_dir)
    recorder.write({"round": 0})
    for r in range(1, rounds + 1):
        recorder.write({"round": r, "measured_compute_s": 4.0, "measured_comm_s": None if r == 1 else window,
                        "round_wall_s": 4.0 + (0 if r == 1 else window), "bytes_up_per_client": nbytes,
                        "bytes_down_per_client": nbytes})  # fmt: skip


def test_the_time_model_is_fitted_to_two_run_folders_of_ones_own(tmp_path, capsys):
    """``python -m benchmarks.time_model RUN_DIR RUN_DIR --rate --latency-ms``: both keys recovered
    from two message sizes; a folder without a round 2 is named in one line, before any fit."""
    from benchmarks import time_model

    _exchange_run(tmp_path / "fp32", 70.8e6)
    _exchange_run(tmp_path / "int8", 18.0e6)
    model = time_model.fit_run_dirs([tmp_path / "fp32", tmp_path / "int8"], 1000.0, 5.0)
    assert model["fixed_s"] == pytest.approx(3.0) and model["throughput_mbs"] == pytest.approx(40.0)
    assert time_model.main([str(tmp_path / "fp32"), str(tmp_path / "int8"), "--rate", "1000", "--latency-ms", "5"]) == 0
    assert capsys.readouterr().out == "message-overhead-s = 3.00\nmessage-throughput-mbs = 40.0\n"

    _exchange_run(tmp_path / "short", 70.8e6, rounds=1)
    with pytest.raises(SystemExit) as stopped:
        time_model.main([str(tmp_path / "fp32"), str(tmp_path / "short"), "--rate", "1000"])
    message = str(stopped.value.code)
    assert len(message.splitlines()) == 1 and str(tmp_path / "short") in message and "expected >= 3 rounds" in message
