"""benchmarks/staleness.py's arithmetic: the nodes' disagreement read from their pending-update files as the nodes
write them, and the table and reading it prints from a run's figures."""

from __future__ import annotations

import pytest
import torch

from benchmarks import staleness
from parablock_flwr.core import PendingUpdate
from parablock_flwr.node.state import PendingStore


def _save(run_dir, partition: int, delta: dict[str, torch.Tensor]) -> None:
    PendingStore(run_dir / "node-state" / f"partition-{partition}").save(PendingUpdate(1, 3, delta), "fp32")


def test_the_disagreement_is_read_from_both_nodes_pending_updates(tmp_path):
    a = {"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([1.0])}
    b = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([1.0])}
    _save(tmp_path, 0, a)
    assert staleness.disagreement(tmp_path) is None  # one node kept none (BCD, or the ablation's offset)
    _save(tmp_path, 1, b)
    # in sorted name order (b, then w): Δ_1 − Δ_2 = (0, 2, -2), Δ_1 + Δ_2 = (2, 4, 2): √8 / √24
    assert staleness.disagreement(tmp_path) == pytest.approx((8 / 24) ** 0.5)
    _save(tmp_path, 1, a)
    assert staleness.disagreement(tmp_path) == 0.0


def test_the_table_and_the_reading_follow_the_figures():
    runs = {
        "fedbcd": {"heldout": [5.0, 2.0, 1.0], "disagreement": None},
        "parablock at-end": {"heldout": [5.0, 2.0, 1.5], "disagreement": 0.25},
        "parablock on-receipt": {"heldout": [5.0, 2.0, 0.9], "disagreement": 0.5},
        "parablock none": {"heldout": [5.0, 2.2, 2.0], "disagreement": None},
    }
    results = {(1e-3, 0): runs}
    table = staleness.table(results)
    assert "| 0.001 | 0 | parablock at-end | 5.000 | 2.000 | 1.500 | +0.500 | 0.25 |" in table
    assert "| 0.001 | 0 | fedbcd | 5.000 | 2.000 | 1.000 |  |  |" in table
    reading = staleness.reading(results)
    assert "parablock at-end: +0.500 to +0.500; its nodes' last updates 0.25 to 0.25 apart" in reading
    assert "parablock on-receipt: -0.100 to -0.100; its nodes' last updates 0.50 to 0.50 apart" in reading
    assert "parablock none: +1.000 to +1.000." in reading  # no disagreement: its pending is an offset
    runs["parablock none"]["heldout"] = [5.0, 2.0]
    with pytest.raises(ValueError, match=r"evaluated \[2, 3\] rounds"):
        staleness.table(results)


def test_the_ablations_offset_is_no_update_and_gets_no_disagreement(tmp_path, monkeypatch):
    """``correction = "none"`` keeps an offset over several blocks in the same file: ``run_one`` reads no
    disagreement from it; a run kept under the workdir is read again, not run."""
    run_dir = tmp_path / "runs" / "name" / "20261207-000000-parablock-1"
    (run_dir).mkdir(parents=True)
    (run_dir / "status.json").write_text('{"kind": "completed"}')
    (run_dir / "metrics.jsonl").write_text('{"round": 0, "heldout_loss": 5.0}\n{"round": 1, "heldout_loss": 4.0}\n')
    for i in range(2):
        _save(run_dir, i, {"w": torch.tensor([1.0 + i, 0.0])})
    monkeypatch.setattr(staleness, "simulate", lambda *a, **kw: pytest.fail("a kept run was run again"))
    args = type("Args", (), {"workdir": tmp_path})
    assert staleness.run_one(args, "name", {}, corrected=False) == {"heldout": [5.0, 4.0], "disagreement": None}
    assert staleness.run_one(args, "name", {}, corrected=True)["disagreement"] == pytest.approx(1 / 3)


def test_a_learning_rate_that_is_not_positive_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        staleness.main(["--learning-rates", "0"])
    assert stopped.value.code == 2 and "--learning-rates [0.0]: expected positive numbers" in capsys.readouterr().err
