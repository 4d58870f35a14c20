"""Writes docs/results.md, the index of the pages under docs/results/, from those pages alone.

Every figure lives on a page a benchmark writes (``common.write_report``: the whole page; or
``common.replace_doc_section``: one section of it), beside the command, commit, date and machine it was
measured with (issue 46). A figure typed into an index by hand goes stale the day its benchmark is rerun;
so this index copies, for each page, its title, its first paragraph (what it measures) and each section's
heading and first line (its command, commit and machine), and nothing else. Rerun it after a benchmark.

    .venv/bin/python -m benchmarks.results_index
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

from benchmarks.common import PROJECT_DIR, machine_line

INDEX = PROJECT_DIR / "docs" / "results.md"
PAGES = INDEX.with_suffix("")  # docs/results/, from the project folder: a test's own pages are not indexed
INTRO = """# Results

Written by `python -m benchmarks.results_index` from the pages under [results/](results/); rerun it after a
benchmark. Each page holds what one benchmark measured, written whole by the command at its top or section by
section, each section under its own command. Rerunning that command from the project folder replaces its page
or its section and nothing else; `python -m benchmarks.<name> --help` says what it measures and how. Every
figure is on those pages, beside the commit and the machine it was measured at; none is typed here.

Most pages were measured on a small CPU-only virtual machine shared with other work (each page names its
machine): seconds there carry that work's noise, the spread of repeats is in the tables, and the claim is the
ratio of runs made side by side. Why the figures come out as they do is in each benchmark's docstring
(`--help`), in [transport.md](transport.md) for the direct transport and in [status.md](status.md).
"""


def paragraphs(text: str) -> list[str]:
    """A page's blocks separated by blank lines: headings, prose, tables."""
    return [block.strip() for block in text.split("\n\n") if block.strip()]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading. Not ``common.slug``, which names a page after a heading's first
    clause: GitHub keeps every word, drops punctuation and turns each space into a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")


def one_line(paragraph: str) -> str:
    """A paragraph's lines joined: pages wrap their prose and end lines with two spaces for a break."""
    return " ".join(line.strip() for line in paragraph.splitlines())


def lead(paragraph: str, sentences: int = 2) -> str:
    """A page's first paragraph cut to its first sentences: some pages open with a whole set-up."""
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", one_line(paragraph))
    return " ".join(parts[:sentences]) + (" …" if len(parts) > sentences else "")


def provenance(paragraph: str) -> str:
    """Where a page or section was measured, in one line: its command, commit, date and machine as the
    page says them; a machine the page wrote as a dict (older sections) in ``common.machine_line``'s words."""
    text = "; ".join(line.strip() for line in paragraph.splitlines())
    text = text.replace(" (rerun it to replace this file).", "")
    return re.sub(r"Machine: (\{.*?\})", lambda m: f"Machine: {machine_line(ast.literal_eval(m.group(1)))}", text)


def entry(page: Path) -> str:
    """One page's part of the index: its title linked, its lead, where it was measured, and each of its
    ``## `` sections linked with the line that says where that section was measured."""
    head, *sections = re.split(r"(?m)^(?=## )", page.read_text())
    title, *blocks = paragraphs(head)
    link = page.relative_to(INDEX.parent).as_posix()
    lines = [f"## [{title.removeprefix('# ')}]({link})", ""]
    prose = [b for b in blocks if not b.startswith(("Written by", "|", "!", "- ", "#"))]
    lines += [lead(prose[0]), ""] if prose else []
    lines += [f"- {provenance(b)}" for b in blocks if b.startswith("Written by")]
    for section in sections:
        heading, *rest = paragraphs(section)
        where = f": {provenance(rest[0])}" if rest else ""
        lines.append(f"- [{heading.removeprefix('## ')}]({link}#{anchor(heading)}){where}")
    return "\n".join(lines)


def index() -> str:
    """docs/results.md as it should read now: the introduction, then every page, by file name."""
    pages = sorted(PAGES.glob("*.md"))
    return INTRO + "".join(f"\n{entry(page)}\n" for page in pages)


def main(argv: list[str] | None = None) -> None:
    """Write the index; ``--help`` says what it is (as every benchmark's does)."""
    raw = argparse.RawDescriptionHelpFormatter
    argparse.ArgumentParser(
        prog="python -m benchmarks.results_index", description=__doc__, formatter_class=raw
    ).parse_args(argv)
    INDEX.write_text(index())
    print(f"wrote {INDEX.relative_to(PROJECT_DIR)}")


if __name__ == "__main__":
    main()
