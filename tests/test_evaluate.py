"""`parablock-flwr evaluate` on a user's own benchmark: any data file and format a run reads, every
row when asked, a device and a precision, task accuracy on exact answers and exact match on chat rows
with a single answer turn. The tiny real model on CPU, small local files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from parablock_flwr.cli import main


def _rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _evaluate(capsys, model: Path, *args: str) -> dict:
    assert main(["evaluate", str(model), "--max-new-tokens", "4", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _chat(i: int, answer: str, turns: int = 1) -> dict:
    messages = [{"role": "system", "content": "Answer briefly."}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"question {i} part {t}"}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def test_every_row_of_an_alpaca_file_in_bf16(tmp_path, tiny_model_dir, capsys):
    """Free-text answers: loss and perplexity on all 80 rows (not the first heldout-examples = 64), with
    the model's weights in bf16; no task accuracy."""
    data = _rows(tmp_path / "bench.jsonl", [{"instruction": f"say {i}", "output": f"{i} it is"} for i in range(80)])
    out = _evaluate(capsys, tiny_model_dir, "--dataset", f"alpaca:{data}", "--all-rows", "--precision", "bf16")
    assert out["examples"] == 80 and out["dataset"] == f"alpaca:{data}" and out["precision"] == "bf16"
    assert math.isfinite(out["heldout_loss"]) and "task_accuracy" not in out and out["device"] == "cpu"
    first = _evaluate(capsys, tiny_model_dir, "--dataset", f"alpaca:{data}")
    assert first["examples"] == 64 and first["precision"] == "fp32" and first["heldout_loss"] != out["heldout_loss"]


def test_exact_match_on_chat_rows_with_a_single_answer_turn(tmp_path, tiny_model_dir, capsys):
    """Rows with one answer turn are answered from the turns before it and matched exactly; rows with
    two are counted as skipped. A reference set to what the model answers scores, the others do not."""
    rows = [_chat(i, "zebra") for i in range(6)] + [_chat(100 + i, "zebra", turns=2) for i in range(2)]
    data = _rows(tmp_path / "chat.jsonl", rows)
    samples = tmp_path / "samples.jsonl"
    args = ["--dataset", f"messages:{data}", "--all-rows", "--samples", str(samples)]
    out = _evaluate(capsys, tiny_model_dir, *args)
    assert out["examples"] == 8 and out["task_examples"] == 6 and out["task_skipped_not_single_answer"] == 2
    generated = {json.loads(line)["prompt"]: json.loads(line)["generated"] for line in samples.read_text().splitlines()}
    assert len(generated) == 6
    # One row's reference becomes what the model answered to it: exactly that row is now right.
    prompt, answer = next(iter(generated.items()))
    i = int(prompt.split()[1])
    rows[i] = _chat(i, answer.strip() or ".")  # the tiny model may answer blank lines: "." normalises to ""
    _rows(data, rows)
    out = _evaluate(capsys, tiny_model_dir, *args)
    scored = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [s["correct"] for s in scored].count(True) == 1
    assert next(s for s in scored if s["prompt"] == prompt)["correct"]
    assert out["task_accuracy"] == pytest.approx(1 / 6)


def test_task_accuracy_on_exact_answers_of_a_mathinstruct_file(tmp_path, tiny_model_dir, capsys):
    rows = [{"source": "s", "instruction": f"What is {i} + 1?", "output": f"{i} + 1 = {i + 1}"} for i in range(12)]
    data = _rows(tmp_path / "math.jsonl", rows)
    out = _evaluate(capsys, tiny_model_dir, "--dataset", f"mathinstruct:{data}", "--all-rows", "--device", "cpu")
    assert out["examples"] == 12 and out["task_examples"] == 12 and 0 <= out["task_accuracy"] <= 1
    assert out["task_accuracy_constant"] == pytest.approx(1 / 12)


def test_a_dataset_that_cannot_be_read_is_one_line_and_exit_2(tmp_path, tiny_model_dir, capsys):
    data = _rows(tmp_path / "bad.jsonl", [{"question": "q", "answer": "a"}] * 3)
    assert main(["evaluate", str(tiny_model_dir), "--dataset", f"alpaca:{data}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parablock-flwr evaluate: dataset=") and "missing columns" in err and "\n" not in err
