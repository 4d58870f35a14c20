"""Crash-consistent files (parablock_flwr/durable.py) and the records built on them: what a
resume or a report reads survives a write cut short."""

import json
import logging

import pytest

from parablock_flwr.durable import append_line, read_jsonl, replace_file
from parablock_flwr.metrics import RunRecorder
from parablock_flwr.report import report


def test_a_whole_file_is_replaced_at_once(tmp_path):
    path = tmp_path / "state.json"
    replace_file(path, '{"round": 1}\n')
    replace_file(path, lambda tmp: tmp.write_text('{"round": 2}\n'))
    assert json.loads(path.read_text()) == {"round": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary file left


def test_a_torn_last_line_is_skipped_with_a_warning_naming_file_and_line(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    append_line(path, {"round": 0, "heldout_loss": 2.0})
    append_line(path, {"round": 1, "train_loss": 1.5})
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) - 7])  # the second line cut mid-write
    with caplog.at_level(logging.WARNING):
        assert read_jsonl(path) == [{"round": 0, "heldout_loss": 2.0}]
    assert f"{path}: line 2 is torn" in caplog.text
    path.write_bytes(b'{"round": 0}\n{"round": 1\n{"round": 2}\n')  # a bad line that is not the last
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not valid JSON"):
        read_jsonl(path)


def test_records_are_completed_by_appending_and_read_merged(tmp_path, caplog):
    """A round's parts (training, evaluation, the nodes' evaluation later) and its per-node detail
    (nodes.jsonl) come back as one dict per round; a resumed run copies rounds 0..R and nothing
    torn; `report` reads a torn file too."""
    recorder = RunRecorder(tmp_path / "a")
    recorder.write({"round": 0, "heldout_loss": 3.0, "elapsed_s": 1.0})
    sizes = {"bytes_up_per_client": 10, "bytes_down_per_client": 10}
    recorder.write({"round": 1, "train_loss": 2.0, "client_weights": [{"partition_id": 0}], "elapsed_s": 2.0, **sizes})
    recorder.write({"round": 1, "heldout_loss": 2.5})
    recorder.write({"round": 2, "train_loss": 1.0, "elapsed_s": 3.0, **sizes})
    recorder.write({"round": 2, "heldout_loss": 2.2})
    assert "client_weights" not in (tmp_path / "a" / "metrics.jsonl").read_text()  # per node: nodes.jsonl
    assert recorder.read()[1] == {"round": 1, "train_loss": 2.0, "heldout_loss": 2.5, "elapsed_s": 2.0, **sizes,
                                  "client_weights": [{"partition_id": 0}]}  # fmt: skip
    metrics = tmp_path / "a" / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes()[:-10])  # round 2's evaluation torn
    resumed = RunRecorder(tmp_path / "b")
    resumed.copy_rounds(tmp_path / "a", up_to=1)
    assert [r["round"] for r in resumed.read()] == [0, 1] and resumed.read()[1]["heldout_loss"] == 2.5
    with caplog.at_level(logging.WARNING):
        text = report(tmp_path / "a")
    assert "status: unknown" in text and f"{metrics}: line 5 is torn" in caplog.text
    assert len(text.splitlines()) >= 4  # status, header, rounds 0-2 (round 2 without its evaluation)


def test_a_checkpoint_save_cut_short_is_cleaned_up_by_the_next_one(tmp_path, tiny_model_dir):
    """A save killed after the weights were written (the tokenizer's save raises here, as a kill
    would stop it) leaves ``.round-00002.tmp``; the next successful save removes it (before: it
    stayed, a partial copy of the model per killed save) and leaves only complete folders."""
    from parablock_flwr.model import load_model, load_tokenizer, save_model

    model, tokenizer = load_model(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))

    class KilledHere:
        def save_pretrained(self, _folder):
            raise KeyboardInterrupt("the process dies while saving round 2")

    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(KeyboardInterrupt):
        save_model(model, KilledHere(), checkpoints / "round-00002")
    assert [p.name for p in checkpoints.iterdir()] == [".round-00002.tmp"]
    save_model(model, tokenizer, checkpoints / "round-00004")
    assert [p.name for p in checkpoints.iterdir()] == ["round-00004"]
    assert (checkpoints / "round-00004" / "model.safetensors").exists()
