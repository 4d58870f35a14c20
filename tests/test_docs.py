"""Documentation whose code runs: every ```python block in README.md and docs/*.md either is an
excerpt of a tested source file, marked on the line just before it with ``<!-- from: PATH -->``
(each non-blank line of the block is a line of that file, in order, whitespace inside a line aside;
the file is a module the tests import), or runs as it is (exec in a fresh namespace). docs/deploy-8b.md's bash
blocks: each is run on loopback (tests/test_deploy_recipe.py) or needs what this machine lacks (below).
The results page is the index ``benchmarks.results_index`` writes from the files under docs/results/; its
commands name benchmarks whose ``--help`` runs, and its links, and those of the files under docs/results/,
resolve."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from parablock_flwr.tools.app_config import find_project_dir

PROJECT_DIR = find_project_dir(Path(__file__).resolve().parent)
DOCS = [PROJECT_DIR / "README.md", *sorted((PROJECT_DIR / "docs").glob("*.md"))]
FROM = re.compile(r"^<!--\s*from:\s*(\S+)\s*-->$")


def python_blocks(doc: Path) -> list[tuple[int, str | None, list[str]]]:
    """(line number of the fence, the ``from:`` path or None, the block's lines) of every ```python block."""
    lines, blocks, i = doc.read_text().splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            source = FROM.match(lines[i - 1].strip()) if i else None
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append((i + 1, source.group(1) if source else None, lines[i + 1 : end]))
            i = end
        i += 1
    return blocks


BLOCKS = [
    pytest.param(doc, line, source, body, id=f"{doc.name}:{line}")
    for doc in DOCS
    for line, source, body in python_blocks(doc)
]


def test_the_docs_have_python_blocks_to_check():
    assert len(BLOCKS) >= 2  # at least docs/extending.md's two examples: the parser found them


@pytest.mark.parametrize("doc, line, source, body", BLOCKS)
def test_python_block_is_an_excerpt_of_tested_code_or_runs(doc, line, source, body):
    where = f"{doc.relative_to(PROJECT_DIR)}:{line}"
    if source is None:
        exec(compile("\n".join(body), where, "exec"), {"__name__": "__doc_example__"})
        return
    path = PROJECT_DIR / source
    assert path.is_file(), f"{where}: <!-- from: {source} --> names no file"
    module = source.removesuffix(".py").replace("/", ".")
    tests = [t for t in (PROJECT_DIR / "tests").glob("test_*.py") if module in t.read_text()]
    assert tests, f"{where}: {source} is not imported by any test (tests/test_*.py)"
    file_lines, at = [same_code(ln) for ln in path.read_text().splitlines()], 0
    for excerpt_line in (ln for ln in body if ln.strip()):
        try:
            at = file_lines.index(same_code(excerpt_line), at) + 1
        except ValueError:
            pytest.fail(f"{where}: this line is not in {source} (after line {at}): {excerpt_line.strip()!r}")


def same_code(line: str) -> tuple[int, str]:
    """A line as compared: its indentation and its text without whitespace (a formatter may
    respace `x[a:b - c]` as `x[a : b - c]`; the excerpt stays an excerpt)."""
    return len(line) - len(line.lstrip()), "".join(line.split())


def test_the_usage_page_lists_every_exit_code():
    from parablock_flwr.run_status import EXIT_CODES

    usage = (PROJECT_DIR / "docs" / "usage.md").read_text()
    for kind, code in EXIT_CODES.items():
        assert f"| {code} | `{kind}` |" in usage, f"docs/usage.md's exit-code table lacks {code} ({kind})"


def test_the_readme_is_short_and_links_what_it_names():
    """The README says what this is, its two commands, what a run prints, the layout and where to read on: at
    most 150 lines, every local link resolving, no test count written by hand (pytest prints them)."""
    readme = (PROJECT_DIR / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        assert target.startswith("http") or (PROJECT_DIR / target).exists(), target
    assert not re.search(r"\b\d+ tests\b", readme)


RESULTS = PROJECT_DIR / "docs" / "results.md"
BENCHMARK = re.compile(r"python -m (benchmarks(?:\.\w+)+)")


def results_commands() -> list[str]:
    """Every benchmark module a command on docs/results.md runs."""
    return sorted(set(BENCHMARK.findall(RESULTS.read_text())))


def test_the_results_page_has_commands_to_check():
    assert len(results_commands()) >= 8  # the parser found the page's commands


@pytest.mark.parametrize("module", results_commands())
def test_every_results_command_names_a_benchmark_whose_help_runs(module, monkeypatch, capsys):
    """The module exists, and ``--help`` prints its docstring's first line (what it measures) and
    exits 0: an import and argparse, nothing measured."""
    found = importlib.import_module(module)
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as stopped:
        found.main()
    assert stopped.value.code == 0, f"docs/results.md: python -m {module} --help exited {stopped.value.code}"
    first_line = found.__doc__.strip().splitlines()[0]
    assert first_line in capsys.readouterr().out, f"python -m {module} --help does not say what it measures"


def test_the_results_page_is_the_index_written_from_the_generated_pages():
    """Issue 46: no figure is typed into docs/results.md by hand. It is what ``benchmarks.results_index`` writes
    from docs/results/*.md, so every page is listed with the command, commit and machine the page gives."""
    from benchmarks.results_index import index

    assert RESULTS.read_text() == index(), "docs/results.md is stale: run python -m benchmarks.results_index"


def test_the_results_pages_links_resolve():
    for doc in [RESULTS, *sorted((PROJECT_DIR / "docs" / "results").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.relative_to(PROJECT_DIR)}: {target} does not exist"


# ---------------------------------------------------------------- docs/deploy-8b.md's shell blocks
RECIPE = PROJECT_DIR / "docs" / "deploy-8b.md"
# What a loopback CPU machine lacks, by a command only such blocks hold. Every other bash block of the
# recipe carries a ``<!-- loopback: PHASE -->`` mark and tests/test_deploy_recipe.py runs it.
NOT_ON_LOOPBACK = {
    "hf download": "the model hub is not reachable from this machine",
    "git clone": "a fresh clone and install (CI runs scripts/install.sh on one)",
    "systemctl": "systemd itself (tests/test_systemd_units.py stands in for it, running each unit's ExecStart)",
    "split -n": "a site with two GPUs",
    "nft ": "a firewall on the server",
}


def recipe_bash_blocks() -> list[tuple[int, str | None, str]]:
    from test_deploy_recipe import bash_blocks

    return bash_blocks(RECIPE)


def test_every_recipe_block_runs_on_loopback_or_says_what_it_needs():
    blocks = recipe_bash_blocks()
    assert {mark for _, mark, _ in blocks} >= {"plan", "setup", "register", "run"}
    for line, mark, body in blocks:
        if mark is None:
            assert any(cmd in body for cmd in NOT_ON_LOOPBACK), (
                f"docs/deploy-8b.md:{line}: a bash block neither marked <!-- loopback: PHASE --> (run by "
                f"tests/test_deploy_recipe.py) nor needing one of {sorted(NOT_ON_LOOPBACK)}"
            )


def test_the_recipe_run_config_passes_the_run_config_checks():
    """The section 6 run config (the file its command writes and runs, and a resume runs again), parsed by
    Flower's own parser, holds only the app's keys with values of their types, and passes RunConfig's checks."""
    from flwr.common.config import parse_config_args

    from parablock_flwr.config import RunConfig
    from parablock_flwr.tools.app_config import app_config, check_overrides

    (run,) = [body for _, mark, body in recipe_bash_blocks() if mark == "run"]
    overrides = parse_config_args([re.search(r"echo '([^']*)' > /etc/parablock/run-config", run, re.S).group(1)])
    check_overrides(overrides, app_config(PROJECT_DIR))
    cfg = RunConfig.from_flower({**app_config(PROJECT_DIR), **overrides})
    assert (cfg.weights, cfg.evaluation, cfg.min_available_nodes) == ("bf16", "clients", 3)


def test_the_recipe_and_the_units_name_each_file_at_one_path():
    """Each file the units read is where the recipe puts it, and the CA certificate has one path."""
    recipe = RECIPE.read_text()
    for unit in sorted((PROJECT_DIR / "deploy").glob("*.service")):
        text = "\n".join(ln for ln in unit.read_text().splitlines() if not ln.startswith("#"))
        for path in re.findall(r"/etc/parablock/[\w./%-]+", text):
            named = {path.replace("%i", "0"), path.replace("%i", "N")}
            assert any(p in recipe for p in named), f"{unit.name} reads {path}; docs/deploy-8b.md never names it"
    ca_paths = set(re.findall(r"(/[\w/.-]*ca\.crt)", recipe))
    assert ca_paths == {"/etc/parablock/ca/ca.crt"}, ca_paths
    assert "huggingface-cli" not in recipe and "hf download" in recipe
