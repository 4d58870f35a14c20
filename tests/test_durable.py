"""Crash-consistent files (parablock_flwr/durable.py) and the records built on them: what a
resume or a report reads survives a write cut short."""

import json
import logging
import os
import struct
import threading
from pathlib import Path

import pytest

from parablock_flwr.cli import main as cli_main
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


# ---------------------------------------------------------------- every new entry's parent fsynced
class CreationWatch:
    """What a process makes durable under ``root``, checked at every ``os.fsync``.

    inotify (Linux) reports every entry created or renamed into a folder under ``root``, in the
    kernel's order; ``os.fsync`` is wrapped, so that at each fsync the events so far are read first.
    An entry is *pending* from its creation until its parent folder is fsynced. The rule checked: an
    fsync of anything under ``root`` is only durable if every entry on its path from ``root`` down is
    not pending, itself included (except a temporary ``*.tmp`` or ``*.staged`` entry and everything inside
    one: it becomes visible whole by its rename, then its parent's fsync). At the end nothing may be pending."""

    CREATED, MOVED_TO, MOVED_FROM, DELETED = 0x100, 0x80, 0x40, 0x200  # inotify's event bits
    IGNORED, OVERFLOW, IS_DIR = 0x8000, 0x4000, 1 << 30

    def __init__(self, root: Path):
        import ctypes

        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0
        self.root = Path(root)
        self.folders: dict[int, tuple[int, int]] = {}  # watch descriptor -> (device, inode) of its folder
        self.pending: dict[tuple[int, int], set[str]] = {}  # folder -> names created since its last fsync
        self.violations: list[str] = []
        self.lock = threading.RLock()
        self.watch(self.root)

    def watch(self, folder: Path) -> None:
        mask = self.CREATED | self.MOVED_TO | self.MOVED_FROM | self.DELETED
        try:
            st = os.stat(folder)
        except FileNotFoundError:
            return
        key = (st.st_dev, st.st_ino)
        if key in self.folders.values():
            return  # renamed: already watched (a watch follows its inode)
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(folder), mask)
        if wd < 0:
            return  # gone meanwhile
        self.folders[wd] = key
        for entry in os.scandir(folder):  # made before the watch: pending as well
            self.pending.setdefault(key, set()).add(entry.name)
            if entry.is_dir(follow_symlinks=False):
                self.watch(Path(entry.path))

    def drain(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            offset = 0
            while offset < len(data):
                wd, mask, _, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16 : offset + 16 + length].split(b"\0", 1)[0].decode()
                offset += 16 + length
                assert not mask & self.OVERFLOW, "inotify queue overflowed"
                key = self.folders.get(wd)
                if key is None or mask & self.IGNORED:
                    continue
                if mask & (self.CREATED | self.MOVED_TO):
                    self.pending.setdefault(key, set()).add(name)
                    if mask & self.IS_DIR:
                        self.watch(self._path_of(key) / name)
                elif mask & (self.MOVED_FROM | self.DELETED):
                    self.pending.get(key, set()).discard(name)

    def _path_of(self, key: tuple[int, int]) -> Path:
        for folder in (self.root, *(p for p in self.root.rglob("*") if p.is_dir())):
            st = os.stat(folder)
            if (st.st_dev, st.st_ino) == key:
                return folder
        raise FileNotFoundError(key)

    def fsynced(self, fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path != self.root and self.root not in path.parents:
            return
        with self.lock:
            self.drain()
            parts = path.relative_to(self.root).parts
            folder = self.root
            for name in parts:
                if name.endswith((".tmp", ".staged")):
                    break  # not visible yet: its rename, then its parent's fsync, make it so whole
                st = os.stat(folder)
                if name in self.pending.get((st.st_dev, st.st_ino), set()):
                    self.violations.append(f"{path} fsynced while {folder / name} is not durable in {folder}")
                folder = folder / name
            if path.is_dir():
                st = os.stat(path)
                self.pending.pop((st.st_dev, st.st_ino), None)

    def not_durable(self) -> list[str]:
        with self.lock:
            self.drain()
            out = []
            for folder in (self.root, *(p for p in self.root.rglob("*") if p.is_dir())):
                st = os.stat(folder)
                out += [str(folder / n) for n in sorted(self.pending.get((st.st_dev, st.st_ino), ()))]
            return out


def test_every_entry_a_run_creates_has_its_parent_fsynced_before_anything_below_it(
    tmp_path, tiny_model_dir, monkeypatch
):
    """A whole run in this process (the real ServerApp and ClientApp of 2 nodes over Flower's in-memory
    Grid, tests/federation.py), bf16 transfer (so each node keeps durable residuals under
    ``node-state/partition-P``), a final model saved: every file and folder it creates, the run folder,
    ``global-steps/``, ``checkpoint/``, ``metrics.jsonl``, ``nodes.jsonl``, ``node-state/partition-P``
    among them, has its parent folder fsynced after its creation and before anything below it is
    fsynced (before: ``global-steps/``, ``checkpoint/``, the jsonl files and ``node-state/`` were
    created and written under without their parent's fsync)."""
    from federation import run_server_app

    from helpers import tiny_config

    out = tmp_path / "out"
    out.mkdir()
    watch = CreationWatch(out)
    real_fsync = os.fsync

    def fsync(fd):
        watch.fsynced(fd)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    config = tiny_config(tiny_model_dir, out, **{"num-server-rounds": 3, "transfer-dtype": "bf16",
                         "evaluation": "clients", "save-final-model": True, "local-steps": 1})  # fmt: skip
    run_server_app(config, 2)
    (run_dir,) = out.iterdir()
    assert (run_dir / "status.json").exists() and (run_dir / "node-state" / "partition-1").is_dir()
    assert watch.violations == []
    assert watch.not_durable() == []


def test_report_jsonl_gives_one_object_per_round_where_metrics_jsonl_has_a_line_per_part(tmp_path, capsys):
    """metrics.jsonl appends a round's training record and its evaluation as each finishes (two lines, both
    with the round's number); ``report --jsonl`` merges them: one object per round, what pandas reads as
    one row per round."""
    recorder = RunRecorder(tmp_path)
    recorder.write({"round": 0, "heldout_loss": 3.0, "elapsed_s": 0.0})
    for r in (1, 2):
        recorder.write({"round": r, "train_loss": 2.0 / r, "elapsed_s": float(r)})
        recorder.write({"round": r, "heldout_loss": 2.5 / r})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
    assert cli_main(["report", str(tmp_path), "--jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows == [{"round": 0, "heldout_loss": 3.0, "elapsed_s": 0.0},
                    {"round": 1, "train_loss": 2.0, "elapsed_s": 1.0, "heldout_loss": 2.5},
                    {"round": 2, "train_loss": 1.0, "elapsed_s": 2.0, "heldout_loss": 1.25}]  # fmt: skip
    with pytest.raises(SystemExit, match=r"nothing-here: no metrics.jsonl; expected a run folder"):
        cli_main(["report", str(tmp_path / "nothing-here"), "--jsonl"])
