"""The files `flwr run` bundles into the app's FAB, copied into a folder of their own for it to run.

Flower 1.42's `flwr run DIR` (``flwr/cli/utils.py``, ``collect_files``) lists every file under DIR and
only then keeps those its rules keep: in a project with its ``.venv`` inside, 55,000 files for about 240
kept, 6 s of a 2-core machine's CPU before every run starts. ``stage_app`` walks the app without entering
a folder those rules drop whole (the ``.gitignore``'s and Flower's own excluded folders), keeps what
Flower's ``filter_paths_for_publish`` keeps of the rest, and copies it: the FAB `flwr run` builds from the
copy is the one it builds from the app, byte for byte (tests/test_app_bundle.py). The copy goes to a folder outside
the app (``bundled``), so that no later build finds it; Flower's own messages then name the copy's files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from flwr.cli.utils import (
    APP_PUBLISH_EXCLUDE_PATTERNS,
    build_pathspec,
    filter_paths_for_publish,
    load_gitignore_patterns,
)


def _dropped_whole(app_dir: Path):
    """A test of a folder's relative POSIX path: does Flower drop every file under it? A folder that a
    ``.gitignore`` or an exclude pattern names is dropped whole (gitignore's rule: what is below an ignored
    folder is ignored); with a negation (``!pattern``) in the ``.gitignore`` no folder is (it could keep a
    file below one)."""
    gitignore = app_dir / ".gitignore"  # as ``collect_files`` lists it: not a symlink; unreadable, no pattern
    patterns = load_gitignore_patterns(gitignore) if gitignore.is_file() and not gitignore.is_symlink() else []
    specs = [build_pathspec(APP_PUBLISH_EXCLUDE_PATTERNS)]
    gitignore_spec = build_pathspec(patterns)
    if all(p.include is not False for p in gitignore_spec.patterns):
        specs.append(gitignore_spec)
    return lambda folder: any(spec.match_file(folder + "/") for spec in specs)


def app_files(app_dir: Path) -> dict[str, Path]:
    """The app's files that its FAB holds, by relative POSIX path: Flower's ``collect_files`` (no symlink,
    nothing that resolves outside the app) without entering folders it drops whole, then Flower's filter."""
    root = Path(app_dir).expanduser().resolve()
    dropped = _dropped_whole(root)
    files: dict[str, Path] = {}
    for folder, subfolders, names in os.walk(root, followlinks=False):
        here = Path(folder)
        subfolders[:] = [d for d in subfolders if not dropped((here / d).relative_to(root).as_posix())]
        for name in names:
            path = here / name
            if not path.is_symlink() and path.resolve().is_relative_to(root):
                files[path.relative_to(root).as_posix()] = path
    return filter_paths_for_publish(files)


def stage_app(app_dir: Path, into: Path) -> Path:
    """``into`` (a new folder) holding a copy of the app's FAB files (``app_files``): the folder to give `flwr run`."""
    into = Path(into)
    into.mkdir()  # new: nothing of an earlier copy can stay in it
    for relative, source in app_files(app_dir).items():
        target = into / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    return into


@contextlib.contextmanager
def bundled(app_dir: Path) -> Iterator[Path]:
    """The folder to give `flwr run` while the context lasts: a copy of the app's FAB files in a temporary folder,
    removed afterwards, or the app itself where Flower's own rules refuse it (too deep a path, a bad pattern) or it
    cannot be read: `flwr run` then says why, as on the app."""
    with tempfile.TemporaryDirectory(prefix="parablock-app-") as tmp:
        try:
            folder = stage_app(app_dir, Path(tmp) / "app")
        except (ValueError, OSError):  # AppPathDepthError and pathspec's pattern errors are ValueErrors
            folder = Path(app_dir)
        yield folder
