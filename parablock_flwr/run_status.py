"""How a run ended: ``RUN_DIR/status.json``, written once, atomically and durably, at the end.

The ServerApp writes it whatever happens (completed, invalid configuration, too
few valid replies, a timeout, an unexpected error); the project's commands read
it to exit with the code below, and ``parablock-flwr report`` prints it first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .durable import replace_file

STATUS_FILE = "status.json"

# One exit code per way a run can end (documented in docs/usage.md, "Exit codes").
EXIT_CODES = {
    "completed": 0,
    "error": 1,  # an unexpected error
    "invalid-config": 2,  # a bad run-config value or key, a failed resume check
    "too-few-replies": 3,  # a round kept fewer valid replies than min-accepted-replies
    "timeout": 4,  # no node answered a round within round-timeout-s, or the launcher's limit passed
    # every round ran, but a node was left out: never aggregated, or not in max-consecutive-rejections
    # rounds in a row (status.json's excluded_nodes names each, and the run's last line)
    "completed-with-exclusions": 5,
    # a documented stop before num-server-rounds: the next round would have passed dp-target-epsilon (the
    # rounds run are complete, the model usable; status.json's reason says the epsilon)
    "privacy-budget": 6,
    # the command that launched it was stopped (SIGTERM: `kill`, systemd, a CI runner's cancel); it wrote this
    # once it had stopped the processes it started, the ServerApp among them (``record_stopped``)
    "stopped": 143,
}


STOPS = ("privacy-budget", "stopped")


def write_status(
    run_dir: Path, kind: str, reason: str, rounds_completed: int, num_rounds: int, excluded_nodes: list[str] = ()
) -> Path:
    """Write ``status.json``: ``kind`` is a key of ``EXIT_CODES``, ``reason`` one line,
    ``excluded_nodes`` one line per node the run left out."""
    if kind not in EXIT_CODES:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(EXIT_CODES)}")
    record = {
        # a documented stop (the privacy budget, a SIGTERM) is neither a completed run nor a failed one
        "status": kind if kind.startswith("completed") else "stopped" if kind in STOPS else "failed",
        "kind": kind,
        "exit_code": EXIT_CODES[kind],
        "reason": reason,
        "rounds_completed": rounds_completed,
        "num_rounds": num_rounds,
        "excluded_nodes": list(excluded_nodes),
    }
    return replace_file(Path(run_dir) / STATUS_FILE, json.dumps(record, indent=1, sort_keys=True) + "\n")


def read_status(run_dir: Path) -> dict | None:
    """The run's status record, or None if the run did not write one (still running, or killed)."""
    path = Path(run_dir) / STATUS_FILE
    return json.loads(path.read_text()) if path.exists() else None


def record_stopped(output_dir: Path, since: float, why: str, stop_began: float | None = None) -> Path | None:
    """The status of a run whose launcher was stopped: the first run folder under ``output_dir`` whose name says it
    was made at or after ``since`` (a ``time.time()``; ``<date>-<time>-<algorithm>-<run id>``, the ServerApp's
    local time) that has no status record gets one (``stopped``: how many rounds it completed, and how to
    continue). A record the run wrote once the stop had begun (``stop_began``, a ``time.time()``) is the stop's
    too, and is replaced: the launcher stops its processes one by one, and a ServerApp that sees one of its own
    end first (its evaluator) records that as its failure before it is stopped itself. None when there is no
    such folder (the run had not started), or the run recorded its own end before the stop."""
    started = time.strftime("%Y%m%d-%H%M%S", time.localtime(since - 1))
    folders = sorted(p for p in Path(output_dir).glob("*-*") if p.is_dir() and p.name[:15] >= started)
    if not folders:
        return None
    run_dir = folders[0]
    status = run_dir / STATUS_FILE
    if status.exists() and (stop_began is None or status.stat().st_mtime < stop_began):
        return None
    from .metrics import RunRecorder

    rounds = max((r["round"] for r in RunRecorder(run_dir).read() if "train_loss" in r), default=0)
    config = run_dir / "config.json"
    num_rounds = json.loads(config.read_text()).get("num-server-rounds", 0) if config.exists() else 0
    reason = f'{why} after round {rounds}; continue it with resume-from="{run_dir}"'
    return write_status(run_dir, "stopped", reason, rounds, num_rounds)
