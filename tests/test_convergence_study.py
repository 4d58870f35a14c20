"""The convergence study's arithmetic (benchmarks/convergence.py): curves, spreads over seeds, and
the claims it writes into docs/benchmarks.md, on records shaped like a run's metrics.jsonl."""

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
    """benchmarks/common.py's one writer: a section (dated or not) is replaced where it stands, the
    others stay byte for byte, a new one is appended; a heading that merely starts alike is not ours."""
    from benchmarks.common import replace_doc_section

    doc = tmp_path / "benchmarks.md"
    before = "# Benchmarks\n\nIntro.\n\n## A (2026-11-29)\n\nold A\n\n## A, hidden 256\n\nother\n\n## B\n\nold B\n"
    doc.write_text(before)
    replace_doc_section("## A", "new A\n", dated=True, doc=doc)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nIntro.\n\n## A (2") and "\n\nnew A\n\n## A, hidden 256\n\nother\n" in text
    assert "old A" not in text and text.endswith("## B\n\nold B\n")
    replace_doc_section("## B", "new B", doc=doc)
    replace_doc_section("## C", "c", doc=doc)
    assert doc.read_text().endswith("## B\n\nnew B\n\n## C\n\nc\n")
