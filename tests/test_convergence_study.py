"""The convergence study's arithmetic (benchmarks/convergence.py): curves, spreads over seeds, and
the claims it writes into docs/results/convergence.md, on records shaped like a run's metrics.jsonl."""

import pytest

from benchmarks import convergence


@pytest.fixture(scope="module")
def study():
    return convergence


def result(seed: int, losses: list[float], mb_per_round: float = 1.0) -> dict:
    """A run: round 0 then one record per round, every round evaluated, wire bytes counted each way."""
    half = int(mb_per_round * 1e6 / 2)
    records = [{"round": 0, "heldout_loss": losses[0], "wire_bytes_up": 0, "wire_bytes_down": 0}]
    records += [
        {"round": r, "heldout_loss": loss, "wire_bytes_up": half, "wire_bytes_down": half}
        for r, loss in enumerate(losses[1:], start=1)
    ]
    return {"config": {"seed": seed}, "wall_s": 10.0, "records": records}


def test_the_summary_and_the_claims_follow_the_runs(study):
    runs = {
        "s": {
            "fedbcd": [result(0, [5, 4, 3, 2]), result(1, [5, 4, 3, 2.2])],
            "parablock": [result(0, [5, 4.1, 3.03, 2.02]), result(1, [5, 4.1, 2.97, 2.2])],
            "parablock-no-correction": [result(0, [5, 4.2, 3.5, 2.5]), result(1, [5, 4.2, 3.4, 2.1])],
        }
    }
    summary = study.summarise(runs)["s"]
    assert summary["fedbcd"]["heldout_loss_mean"] == [5, 4, 3, 2.1]
    assert summary["parablock-no-correction"]["heldout_loss_min"][-1] == 2.1
    assert summary["parablock"]["mb_sent_mean"] == [0.0, 1.0, 2.0, 3.0]
    gaps = study.gaps_to_reference(summary, "parablock", skip=1)
    assert gaps == pytest.approx([0.0, 0.01 / 2.1])
    assert study.paired(summary, "parablock", "fedbcd") == pytest.approx([0.01, 0.0])
    claims = study.claims("s", summary, skip=1)
    assert "within 0.48% of sequential BCD's after round 1" in claims[0] and "holds" in claims[0]
    assert "+23.8%, -4.5% (not measurably worse: above on 1 of 2 seeds)" in claims[1]
    table = study.table("s", summary, skip=1)
    assert "| parablock | 2.1100 (2.0200–2.2000) | +0.48% / +0.00% | 3.0 |" in table


def test_the_section_writer_replaces_its_own_section_in_place(tmp_path):
    """benchmarks/common.py's writer of a results file of several sections: a section (dated or not) is
    replaced where it stands, the others stay byte for byte, a new one is appended; a heading that merely
    starts alike is not ours."""
    from benchmarks.common import replace_doc_section

    doc = tmp_path / "results.md"
    before = "# Benchmarks\n\nIntro.\n\n## A (2026-11-29)\n\nold A\n\n## A, hidden 256\n\nother\n\n## B\n\nold B\n"
    doc.write_text(before)
    replace_doc_section("## A", "new A\n", dated=True, doc=doc)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nIntro.\n\n## A (2") and "\n\nnew A\n\n## A, hidden 256\n\nother\n" in text
    assert "old A" not in text and text.endswith("## B\n\nold B\n")
    replace_doc_section("## B", "new B", doc=doc)
    replace_doc_section("## C", "c", doc=doc)
    assert doc.read_text().endswith("## B\n\nnew B\n\n## C\n\nc\n")


def test_a_results_file_is_written_whole_with_the_command_that_writes_it(tmp_path, monkeypatch):
    """``write_report``: docs/results/<name>.md is the benchmark's alone: its title, the command
    that reproduces it, the commit and machine, the docstring's first paragraph, the report; a rerun
    replaces all of it."""
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(common.sys, "argv", ["overlap.py", "--rates", "65"])
    path = common.write_report("overlap", "Overlap", "| a |\n|---|\n| 1 |", doc="Measures X.\n\nDetails.")
    text = path.read_text()
    assert path == tmp_path / "results" / "overlap.md"
    assert text.startswith("# Overlap\n\nWritten by `python -m benchmarks.overlap --rates 65` (rerun it")
    assert "\nCommit: " in text and "\nMachine: " in text and "Measures X.\n\n| a |" in text
    assert "Details." not in text and text.endswith("| 1 |\n")
    common.write_report("overlap", "Overlap", "| b |", how="python -m benchmarks.overlap --fast")
    text = path.read_text()
    assert "| a |" not in text and "`python -m benchmarks.overlap --fast`" in text and text.endswith("| b |\n")
