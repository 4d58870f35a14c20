"""Crash-consistent files: what a resume or a report reads survives a killed process or a power loss.

Every such file is written by one of three functions here, and by nothing else (the bytes of a block-sized file
come from ``tensor_file``, past the page cache; its rename and its folder's fsync are these functions' or the
same steps in ``node.state.ResidualStore``):

- ``replace_file``: a whole file, written beside its final name, fsynced, renamed over it, and
  its folder fsynced (the rename itself is then on disk). A reader sees the old file or the new
  one, never a mix, and never an empty file after a power loss.
- ``replace_folder``: the same for a folder (a checkpoint): every file in it and the folder
  fsynced, renamed, the parent fsynced.
- ``append_line``: one JSON line appended and fsynced. A crash can leave a torn last line;
  ``read_jsonl`` skips such a line with a warning naming the file and line, and loses nothing else.
- ``make_dirs``: the folders these go in, each new one's parent fsynced once it is created.

A new entry (a file, a folder, a renamed one) is on disk only once its parent folder is fsynced:
fsyncing the entry itself is not enough. So every entry these functions create has its parent
fsynced before anything is written durably below it, from the run folder down.

``crash_point`` is the fault injection the crash tests use: with ``PARABLOCK_CRASH_AT=<stage>@<round>``
in its environment the server SIGKILLs itself there (stages: ``step-log``, ``checkpoint``,
``evaluation``, ``record``). Unset, it costs one dictionary lookup.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

CRASH_ENV = "PARABLOCK_CRASH_AT"


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path, mode: int = 0o777) -> Path:
    """``mkdir -p`` that makes each folder it creates durable: created top-down, each one's parent
    fsynced right after (``mode``, less the umask, for each)."""
    path = Path(path)
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, mode)
        except FileExistsError:
            if folder.is_dir():  # another thread made it: it fsyncs the parent
                continue
            raise  # a file stands where the folder goes
        fsync_path(folder.parent)
    return path


def replace_file(path: Path, write: Callable[[Path], None] | bytes | str) -> Path:
    """Write ``path`` atomically and durably: ``write(tmp)`` (or the bytes/text given) fills a
    temporary file beside it, which is fsynced, renamed over ``path``, and the folder fsynced."""
    path = Path(path)
    make_dirs(path.parent)
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(write, (bytes, str)):
        data = write.encode() if isinstance(write, str) else write
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    else:
        write(tmp)
        fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)
    return path


def replace_folder(tmp: Path, final: Path) -> Path:
    """Make the filled folder ``tmp`` durable, rename it to ``final`` (which must not exist) and
    fsync the parent: a crash leaves ``tmp`` (ignored by readers) or the complete ``final``."""
    for path in sorted(Path(tmp).rglob("*")):
        fsync_path(path)
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(Path(final).parent)
    return Path(final)


def append_line(path: Path, record: dict, crash_stage: tuple[str, int] | None = None) -> None:
    """Append one JSON line and fsync it. ``crash_stage``: the crash test's point in the middle of
    this write (half the line reaches the disk, then the process dies: a torn last line)."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    new = not os.path.exists(path)
    with open(path, "ab") as f:
        if new:  # the file's entry first: an fsynced line in a file the folder does not list is lost
            fsync_path(Path(path).parent)
        if crash_stage is not None and crash_requested(*crash_stage):
            f.write(line[: len(line) // 2])
            f.flush()
            os.fsync(f.fileno())
            crash_point(*crash_stage)
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; a torn last line (a write cut short) is skipped with a
    warning that names the file and line. A bad line elsewhere is not a torn write: it raises."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # after the last "\n": empty unless the last write was cut
    records = []
    for number, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as err:
            raise ValueError(f"{path}: line {number} is not valid JSON ({err}); expected one record per line") from err
    if tail.strip():
        log.warning(
            "%s: line %d is torn (%d bytes without an end of line: a write cut short); skipped it",
            path,
            len(complete) + 1,
            len(tail),
        )
    return records


def crash_requested(stage: str, server_round: int) -> bool:
    return os.environ.get(CRASH_ENV) == f"{stage}@{server_round}"


def crash_point(stage: str, server_round: int) -> None:
    """The crash tests' fault injection: SIGKILL this process if ``PARABLOCK_CRASH_AT`` names this point."""
    if crash_requested(stage, server_round):
        log.warning("%s=%s@%d: killing the server here (crash test)", CRASH_ENV, stage, server_round)
        os.kill(os.getpid(), signal.SIGKILL)
