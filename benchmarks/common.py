"""What the benchmarks share: launching a simulation, reading a run's records, writing a results
file under docs/results/, and the settings their tables were measured with."""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from parablock_flwr.metrics import RunRecorder
from parablock_flwr.tools.app_config import find_project_dir
from parablock_flwr.tools.launch import run_simulation

PROJECT_DIR = find_project_dir(Path(__file__).resolve().parent)
RESULTS_DIR = PROJECT_DIR / "docs" / "results"

# The data and evaluation the SmolLM2 tables in docs/results/ were measured on (the run-config defaults
# of 2026-11-29/30): their scripts pin them, so that their commands still reproduce them.
GSM_AS_MEASURED = {
    "dataset": "reasoning-gym:gsm_symbolic",
    "heldout-examples": 16,
    "generate-examples": 8,
    "max-new-tokens": 128,
}


def read_records(run_dir: Path) -> list[dict]:
    """A run's records, one merged dict per round (round 0: before training)."""
    return RunRecorder(run_dir).read()


def simulate(
    flower_dir: Path, config: dict, clients: int, cpus_per_client: int = 1, timeout_s: float = 3600
) -> tuple[Path, list[dict]]:
    """One `flwr run` on Flower's simulation engine: its run folder and records; a failed run stops
    the benchmark with the run's last output."""
    proc = run_simulation(
        flower_dir, config, num_supernodes=clients, cpus_per_client=cpus_per_client, timeout_s=timeout_s
    )
    if proc.returncode != 0 or proc.run_dir is None:
        sys.exit(f"the run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{proc.summary()}")
    return proc.run_dir, read_records(proc.run_dir)


def command(module: str) -> str:
    """How this benchmark was run, as its results file quotes it."""
    return f"python -m benchmarks.{module} {shlex.join(sys.argv[1:])}".strip()


def write_report(
    name: str, title: str, report: str, doc: str = "", how: str | None = None, measured: dict | None = None
) -> Path:
    """The whole of docs/results/<name>.md: ``title``, the command that writes it (``how``; default:
    this process's ``python -m benchmarks.<name> ...``), the date, commit and machine, the first
    paragraph of ``doc`` (a benchmark's docstring: what it measures), then ``report``. Written by
    the benchmark alone, so rerunning it replaces the file and nothing else. ``measured``: the
    ``date``, ``commit`` and ``machine`` of the run the report reads (its tables written again from
    its results), not this process's; a key it lacks is this process's."""
    how, measured = how or command(name), measured or {}
    date, at = measured.get("date") or time.strftime("%Y-%m-%d"), measured.get("commit") or commit()
    head = f"# {title}\n\nWritten by `{how}` (rerun it to replace this file).  \n"
    head += f"Date: {date}  \nCommit: {at}  \nMachine: {machine_line(measured.get('machine'))}\n\n"
    lead = doc.strip().split("\n\n")[0] + "\n\n" if doc.strip() else ""
    path = RESULTS_DIR / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + lead + report.rstrip() + "\n")
    write_index(path)
    return path


def replace_doc_section(heading: str, body: str, dated: bool = False, doc: Path | None = None) -> Path:
    """Replace (or append) the section headed ``heading`` (or ``heading (...)``) in ``doc``, a results
    file holding several sections (default: docs/results/<the heading's first clause, as a slug>.md);
    the other sections stay. ``dated``: the heading ends with today's date, ``## Heading (2026-11-30)``."""
    doc = doc or RESULTS_DIR / f"{slug(heading)}.md"
    title = f"{heading} ({time.strftime('%Y-%m-%d')})" if dated else heading
    section = f"{title}\n\n{body.rstrip()}\n"
    text = doc.read_text() if doc.exists() else f"# {heading.lstrip('#').strip()}\n"
    lines = text.splitlines(keepends=True)
    ours = [i for i, line in enumerate(lines) if line.rstrip("\n") == heading or line.startswith(f"{heading} (")]
    start = ours[0] if ours else None
    doc.parent.mkdir(parents=True, exist_ok=True)
    if start is None:
        doc.write_text(text.rstrip("\n") + "\n\n" + section)
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        tail = "".join(lines[end:])
        doc.write_text("".join(lines[:start]) + section + ("\n" + tail if tail else ""))
    write_index(doc)
    return doc


def write_index(page: Path) -> None:
    """docs/results.md written again from the pages (``results_index``) once ``page`` is, so that a rerun leaves
    it current; only for the project's own pages (a test writes its pages elsewhere)."""
    from benchmarks.results_index import INDEX, PAGES, index  # it reads this module's helpers

    if page.resolve().parent == PAGES.resolve():
        INDEX.write_text(index())


def slug(heading: str) -> str:
    """``## Many virtual clients in simulation, hidden 256`` -> ``many-virtual-clients-in-simulation``."""
    words = heading.lstrip("#").split(",")[0].lower()
    return "-".join("".join(c if c.isalnum() else " " for c in words).split())


def machine() -> dict:
    """This machine, as the benchmarks' sections describe it."""
    mem_kb = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    return {
        "nproc": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "cpu": cpu,
        "arch": platform.machine(),
        "gpu": "none" if not shutil.which("nvidia-smi") else "see nvidia-smi",
    }


def commit() -> str:
    """The checkout's commit, short, ``-dirty`` when it has changes (what a results file was measured at)."""
    git = ["git", "-C", str(PROJECT_DIR)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def machine_line(m: dict | None = None) -> str:
    """A machine (default: this one, ``machine()``) in one line, as the results files give it."""
    m = m or machine()
    return f"{m['arch']}, {m['cpu']}, {m['nproc']} CPUs, {m['memory_gib']} GiB, GPU: {m['gpu']}"


def fit(xs: list[float], ys: list[float]) -> dict:
    """``y = fixed + x / throughput`` by least squares (x in bytes, y in s); throughput in MB/s
    (None where the per-byte cost is not positive)."""
    if len(set(xs)) < 2:
        raise ValueError(f"fit: {len(set(xs))} distinct sizes; expected at least 2")
    slope, fixed = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return {"fixed_s": float(fixed), "throughput_mbs": float(1e-6 / slope) if slope > 0 else None}
