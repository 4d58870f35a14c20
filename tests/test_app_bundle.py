"""tools/app_bundle.py: the folder the launchers give `flwr run` holds what the app's FAB holds, and Flower
builds the same FAB from it, byte for byte, without the walk through the app's ``.venv``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from parablock_flwr.tools import app_bundle
from parablock_flwr.tools.app_config import find_project_dir

PROJECT_DIR = find_project_dir(Path(__file__).resolve().parent)
# A Flower app without `fab-include`: its FAB holds every file Flower's own rules keep.
PYPROJECT = """[project]
name = "bundle-probe"
version = "1.0.0"
dependencies = []

[tool.flwr.app]
publisher = "probe"

[tool.flwr.app.components]
serverapp = "pkg.app:server"
clientapp = "pkg.app:client"

[tool.flwr.app.config]
rounds = 1
"""


def _app(root: Path, gitignore: str) -> Path:
    """A small Flower app: kept and dropped files, a symlink out of it."""
    files = {
        "pyproject.toml": PYPROJECT,
        ".gitignore": gitignore,
        "pkg/__init__.py": "",
        "pkg/app.py": "x = 1\n",
        "pkg/__pycache__/app.cpython-311.pyc": "compiled",
        "pkg/data/table.json": "{}",
        "pkg/weights.bin": "not a kind a FAB holds",
        "docs/guide.md": "# guide\n",
        "runs/keep.json": "{}",
        "runs/out/metrics.jsonl": "{}\n",
        ".venv/lib/site.py": "y = 2\n",
        ".flwr/config.toml": "",
        "build/lib/pkg/app.py": "x = 1\n",
    }
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    outside = root.parent / "outside.py"
    outside.write_text("z = 3\n")
    (root / "pkg" / "linked.py").symlink_to(outside)
    return root


@pytest.mark.parametrize(
    "gitignore",
    [".venv\n__pycache__/\nruns/\nbuild/\n", "runs/\n!runs/keep.json\nbuild/\n"],
    ids=["folders-ignored", "with-a-negation"],
)
def test_flower_builds_the_same_fab_from_the_staged_app(tmp_path, gitignore, monkeypatch):
    """With the ``.gitignore``'s folders dropped whole, the walk does not enter them; with a negation, which
    could keep a file below an ignored folder, it enters them (only Flower's own excluded folders are skipped),
    and the FAB is Flower's either way."""
    app = _app(tmp_path / "app", gitignore)
    walked = []
    real_walk = os.walk

    def walk(top, **kwargs):
        for folder, subfolders, names in real_walk(top, **kwargs):
            walked.append(Path(folder).relative_to(app).as_posix())
            yield folder, subfolders, names

    monkeypatch.setattr(app_bundle.os, "walk", walk)
    staged = app_bundle.stage_app(app, tmp_path / "staged")
    monkeypatch.undo()
    assert build_fab_from_disk(staged) == build_fab_from_disk(app)
    held = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    assert "pkg/app.py" in held and "docs/guide.md" in held and "pkg/linked.py" not in held, held
    assert not any(p.startswith((".venv/", "build/", ".flwr/")) or "__pycache__" in p for p in held), held
    assert not any(f.startswith((".venv", ".flwr", "pkg/__pycache__")) for f in walked), walked
    negated = "!" in gitignore
    assert ("runs/out" in walked) == negated and ("runs/keep.json" in held) == negated, (walked, held)


def test_the_copy_lives_outside_the_app_while_the_run_needs_it(tmp_path):
    """``bundled``: a new temporary folder (nothing of an earlier copy in it), gone afterwards; the app untouched."""
    app = _app(tmp_path / "app", ".venv\n")
    before = sorted(p.relative_to(app) for p in app.rglob("*"))
    with app_bundle.bundled(app) as folder:
        assert not folder.resolve().is_relative_to(app.resolve()) and (folder / "pkg" / "app.py").is_file()
        assert build_fab_from_disk(folder) == build_fab_from_disk(app)
    assert not folder.exists() and sorted(p.relative_to(app) for p in app.rglob("*")) == before


def test_an_app_flower_refuses_is_given_to_flower_as_it_is(tmp_path):
    """A path deeper than Flower allows (its ``AppPathDepthError``): `flwr run` gets the app itself, and says why."""
    app = _app(tmp_path / "app", ".venv\n")
    deep = app.joinpath(*[f"d{i}" for i in range(12)])
    deep.mkdir(parents=True)
    (deep / "x.py").write_text("")
    with app_bundle.bundled(app) as folder:
        assert folder == app


def test_a_symlinked_gitignore_is_no_gitignore_as_flower_reads_it(tmp_path):
    """Flower lists no symlink, its ``.gitignore`` included: then only its own exclusions drop a folder."""
    app = _app(tmp_path / "app", "")
    (app / ".gitignore").unlink()
    (tmp_path / "ignore").write_text("runs/\nbuild/\n")
    (app / ".gitignore").symlink_to(tmp_path / "ignore")
    with app_bundle.bundled(app) as folder:
        assert (folder / "runs" / "keep.json").is_file()
        assert build_fab_from_disk(folder) == build_fab_from_disk(app)


@pytest.mark.slow
def test_this_projects_staged_app_builds_the_fab_flower_builds_from_it(tmp_path):
    """The project itself (its ``.venv``, ``runs/`` and caches inside it, where the install puts them): Flower's
    own walk takes seconds here."""
    staged = app_bundle.stage_app(PROJECT_DIR, tmp_path / "staged")
    assert build_fab_from_disk(staged) == build_fab_from_disk(PROJECT_DIR)
