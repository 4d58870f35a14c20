"""Measures `parablock-flwr plan`'s wall time on a cold and on a warm cache, side by side.

Each repetition runs the console script in a fresh process with an empty ``$PARABLOCK_CACHE`` (cold:
the first plan on a machine), then again with the cache the first left behind (warm). The cases are
docs/deploy-8b.md's plan of Llama-3.1-8B, Llama-3.1-70B with LoRA and the fits' search, and GPT-2
(124M), an architecture whose shapes plan does not compute but builds on the meta device and caches.
With ``--against COMMIT`` the same runs are made with that commit's ``parablock_flwr`` (extracted by
``git archive``), taking turns with this checkout's, to compare before and after under one load.
Writes docs/results/plan_time.md (the medians, and the spread of the repetitions).

    .venv/bin/python -m benchmarks.plan_time --repeats 5 --against afd82fa
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from benchmarks.common import PROJECT_DIR, write_report

TITLE = "`parablock-flwr plan`: wall time on a cold and a warm cache"
CONFIGS = PROJECT_DIR / "docs" / "model-configs"
# GPT-2 small's config.json as the hub ships it (the keys that shape the model).
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 12, "n_embd": 768, "n_head": 12,
        "n_positions": 1024, "vocab_size": 50257, "bos_token_id": 50256, "eos_token_id": 50256}  # fmt: skip
DEPLOY_8B = ['weights="bf16"', 'precision="bf16"', "max-seq-len=1024", "batch-size=8", "layers-per-block=8",
             "--gpu-memory-gb", "24", "--num-nodes", "3"]  # fmt: skip


def cases(workdir: Path) -> dict[str, list[str]]:
    """Each case's ``plan`` arguments, by name."""
    gpt2 = workdir / "gpt2"
    gpt2.mkdir(exist_ok=True)
    (gpt2 / "config.json").write_text(json.dumps(GPT2))
    return {
        "Llama-3.1-8B, docs/deploy-8b.md's plan": [str(CONFIGS / "llama-3.1-8b"), *DEPLOY_8B],
        "Llama-3.1-70B, LoRA, fits an 80 GB GPU": [
            str(CONFIGS / "llama-3.1-70b"), 'train="lora"', "--gpu-memory-gb", "80"
        ],
        "GPT-2, built on the meta device, fits a 24 GB GPU": [
            str(gpt2), "layers-per-block=4", 'lora-target-modules="c_attn"', "--gpu-memory-gb", "24"
        ],
    }  # fmt: skip


def checkout(commit: str, workdir: Path) -> Path:
    """``parablock_flwr`` as it was at ``commit``, in a folder to put first on PYTHONPATH."""
    archive = subprocess.run(["git", "-C", str(PROJECT_DIR), "archive", commit, "parablock_flwr"],
                             capture_output=True, check=True).stdout  # fmt: skip
    folder = workdir / f"at-{commit}"
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def one_plan(code: Path, args: list[str], cache: Path) -> float:
    """Seconds one ``parablock-flwr plan`` takes, process start to exit; a failure stops the benchmark."""
    script = Path(sys.executable).parent / "parablock-flwr"
    env = {**os.environ, "PYTHONPATH": str(code), "PARABLOCK_CACHE": str(cache)}
    started = time.perf_counter()
    proc = subprocess.run([str(script), "plan", *args], env=env, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"plan {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return elapsed


def measure(codes: dict[str, Path], args: list[str], repeats: int, workdir: Path) -> dict[str, dict[str, list]]:
    """Per code, ``repeats`` cold runs, each in an empty cache and followed by a warm run in the cache it
    left; the codes take turns, so that each sees the same load on a shared machine."""
    times = {label: {"cold": [], "warm": []} for label in codes}
    for _ in range(repeats):
        for label, code in codes.items():
            cache = Path(tempfile.mkdtemp(dir=workdir, prefix="cache-"))
            times[label]["cold"].append(one_plan(code, args, cache))
            times[label]["warm"].append(one_plan(code, args, cache))
    return times


def torch_import_seconds(repeats: int) -> list[float]:
    """A Python that imports torch and nothing else, start to exit: the floor of a plan that imports
    torch (core's time model and partitioning do)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.perf_counter() - started)
    return times


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.plan_time", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=5, help="cold and warm runs per case and code (median)")
    p.add_argument("--against", help="a commit to measure beside this checkout (e.g. the one before a change)")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats}: expected at least 1")
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan-time-") as tmp:
        workdir = Path(tmp)
        codes = {"this checkout": PROJECT_DIR}
        if args.against:
            codes[f"at {args.against}"] = checkout(args.against, workdir)
        for case, plan_args in cases(workdir).items():
            print(f"[{time.strftime('%H:%M:%S')}] {case} ...", flush=True)
            for label, times in measure(codes, plan_args, args.repeats, workdir).items():
                rows.append(f"| {case} | {label} | {cell(times['cold'])} | {cell(times['warm'])} |")
    floor = torch_import_seconds(args.repeats)
    body = "\n".join([
        f"{args.repeats} repetitions of each; seconds, median (min-max); load average (1 min) "
        f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after: the machine is shared, so timings carry noise.",
        f"A Python that only imports torch takes {cell(floor)} s here.",
        "",
        "| case | code | cold cache s | warm cache s |",
        "|---|---|---|---|",
        *rows,
    ])  # fmt: skip
    print(body)
    if not args.no_write:
        print(f"wrote {write_report('plan_time', TITLE, body, doc=__doc__)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
