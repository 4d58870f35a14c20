"""The server's checkpoint: what a run restarted with ``resume-from`` needs.

``x^R`` itself is not copied: it is ``x^0`` (loaded from the model, as at the
start) plus the global steps ``g^1..g^R`` of the step log, replayed with the
same float operation (with ``snapshot-every``: the newest snapshot before R plus
the steps after it), and its digest is stored to check that. The checkpoint
adds what the step log lacks:

- ``state.json``: the last complete round R, the blocks already decided
  (``b_1..b_{R+1}``), the strategy's own state, the run's clocks, the digest
  of ``x^R``;
- ``pending/`` (ParaBlock): each client's last update ``Δ_i^R`` by partition id, as it travelled (int8: a
  quarter of its fp32 bytes), in two files whatever the number of clients. In round R+1 a client computes from
  ``x^{R-1} + Δ_i^R``; after a restart nobody else holds it, and without it the run could not continue bit for
  bit.

``RUN_DIR/checkpoint/round-NNNNN`` is written as a ``.tmp`` folder, made durable and renamed
(``durable.replace_folder``); the older checkpoint is removed only after that, so a crash or a
power loss leaves the old checkpoint, the new one, or both, never neither.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .core import PendingUpdate
from .durable import crash_point, fsync_path, make_dirs, replace_folder
from .tensor_file import append_pieces
from .wire import kept_dtype, pack_pieces, unpack

STAGED = "pending.staged"
DIGEST_FORMAT = "per-tensor"


# Run-config keys that may change on resume: they do not change what is trained.
MAY_CHANGE_ON_RESUME = frozenset(
    {
        "resume-from",
        "output-dir",
        "round-timeout-s",
        "num-server-rounds",
        "min-available-nodes",
        "eval-every",
        "eval-max-lag",
        "eval-batch-size",
        "generate-examples",
        "generate-every",
        "max-new-tokens",
        "save-every",
        "save-final-model",
        "verify-invariant",
        "evaluation",
        "eval-device",
        "eval-cpus",
        "snapshot-every",
        "max-consecutive-rejections",
        # How a block's bytes travel (docs/transport.md): the same bytes either way, and a restarted server
        # may serve its stream elsewhere.
        "transport",
        "transport-address",
        "transport-certfile",
        "transport-keyfile",
        "transport-ca",
        "transport-client-ca",
        "transport-insecure",
        "transport-idle-timeout-s",
        "transport-messages-ahead",
        "transport-replies-on-stream",
    }
)


@dataclass
class Checkpoint:
    """The server's state after round ``round``."""

    round: int
    blocks: dict[int, int]  # server round -> block, as decided so far
    global_sha256: str  # digest of x^round over every trainable tensor (core.model_digest)
    elapsed_s: float
    modeled_wall_s: float
    strategy_state: dict = field(default_factory=dict)
    pending: dict[int, PendingUpdate] = field(default_factory=dict)  # partition id -> Δ_i^round (on load)
    participation: dict = field(default_factory=dict)  # who was left out so far (Participation.state)
    node_sync: dict = field(default_factory=dict)  # what the server knew of each node (NodeSync.by_partition)
    privacy: dict = field(default_factory=dict)  # differential privacy: the ledger, the noise's secret seed
    # "per-tensor": core.model_digest; "whole": core.digest (checkpoints written before 2026-12-01)
    digest_format: str = DIGEST_FORMAT


def clear_staged_pending(run_dir: Path) -> None:
    """A new round's aggregation starts: drop what an earlier, failed attempt staged."""
    shutil.rmtree(Path(run_dir) / "checkpoint" / STAGED, ignore_errors=True)


def stage_pending(run_dir: Path, partition_id: int, pending: PendingUpdate) -> None:
    """Append one client's pending update as soon as it is aggregated (the reply can then be
    freed): its packed arrays as it travelled (``wire.pack_pieces`` in its own encoding, ``wire.kept_dtype``:
    an int8 update is a quarter of its fp32 bytes, and is never decoded) to ``updates.bin``, past the page cache
    (``tensor_file.append_pieces``), their place to ``index.jsonl``. Two files whatever the number of clients;
    the round's checkpoint takes them once it is complete."""
    folder = make_dirs(Path(run_dir) / "checkpoint") / STAGED
    folder.mkdir(exist_ok=True)  # renamed into the checkpoint's folder, which is made durable whole
    pieces = pack_pieces(pending.delta, kept_dtype(pending.delta))
    offsets = append_pieces(folder / "updates.bin", pieces)  # past the page cache, each array from a page
    arrays = {key: [offsets[key], parts[0].dtype.str, sum(p.size for p in parts)] for key, parts in pieces.items()}
    entry = {"partition": partition_id, "block": pending.block, "base_version": pending.base_version, "arrays": arrays}
    with open(folder / "index.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def read_pending(folder: Path, entry: dict) -> PendingUpdate:
    """One staged pending update (``stage_pending``), as it travelled (``wire.unpack(lazy=True)``: each tensor
    decoded when read, to the very values that were staged), or, staged before 2026-12-05, fp32 tensors."""
    data = folder / "updates.bin"
    if "arrays" in entry:
        arrays = {key: np.fromfile(data, dtype=np.dtype(dtype), count=count, offset=offset)
                  for key, (offset, dtype, count) in entry["arrays"].items()}  # fmt: skip
        delta = unpack(arrays, lazy=True)
    else:
        delta = {
            name: torch.from_numpy(
                np.fromfile(data, dtype=np.float32, count=math.prod(shape), offset=offset).reshape(shape)
            )
            for name, offset, shape in entry["tensors"]
        }
    return PendingUpdate(entry["block"], entry["base_version"], delta)


def save_checkpoint(run_dir: Path, ckpt: Checkpoint) -> Path:
    """Write ``RUN_DIR/checkpoint/round-NNNNN`` atomically and durably, then drop older ones.

    Its size does not grow with the round: only the blocks of rounds R and later are kept
    (what rounds after R still name; the step log holds each earlier step's block)."""
    root = Path(run_dir) / "checkpoint"
    final = root / f"round-{ckpt.round:05d}"
    tmp = root / f"round-{ckpt.round:05d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    make_dirs(root)
    tmp.mkdir()
    state = {
        "round": ckpt.round,
        "blocks": {str(r): b for r, b in ckpt.blocks.items() if r >= ckpt.round},
        "global_sha256": ckpt.global_sha256,
        "digest_format": ckpt.digest_format,
        "elapsed_s": ckpt.elapsed_s,
        "modeled_wall_s": ckpt.modeled_wall_s,
        "strategy_state": ckpt.strategy_state,
        "participation": ckpt.participation,
        "node_sync": ckpt.node_sync,
        "privacy": ckpt.privacy,
    }
    if (root / STAGED).exists():
        os.replace(root / STAGED, tmp / "pending")
    (tmp / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    crash_point("checkpoint", ckpt.round)
    shutil.rmtree(final, ignore_errors=True)
    replace_folder(tmp, final)
    for old in root.glob("round-*"):
        if old != final and not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    fsync_path(root)
    return final


def load_checkpoint(run_dir: Path) -> Checkpoint:
    """The latest complete checkpoint of a run folder; a clear error if there is none."""
    folders = sorted(p for p in (Path(run_dir) / "checkpoint").glob("round-*") if not p.name.endswith(".tmp"))
    if not folders:
        raise FileNotFoundError(
            f"resume-from={str(run_dir)!r}: expected a run folder with checkpoint/round-NNNNN "
            f"(written after every complete round)"
        )
    folder = folders[-1]
    state = json.loads((folder / "state.json").read_text())
    pending = {}
    index = folder / "pending" / "index.jsonl"
    for line in index.read_text().splitlines() if index.exists() else []:
        entry = json.loads(line)
        pending[entry["partition"]] = read_pending(folder / "pending", entry)
    return Checkpoint(
        round=state["round"],
        blocks={int(r): b for r, b in state["blocks"].items()},
        global_sha256=state["global_sha256"],
        elapsed_s=state["elapsed_s"],
        modeled_wall_s=state["modeled_wall_s"],
        strategy_state=state["strategy_state"],
        pending=pending,
        participation=state.get("participation", {}),  # absent from checkpoints written before 2026-12-01
        node_sync=state.get("node_sync", {}),  # likewise
        privacy=state.get("privacy", {}),  # absent before 2026-12-04
        digest_format=state.get("digest_format", "whole"),  # likewise
    )


def check_resumable(run_dir: Path, run_config: dict[str, object]) -> Checkpoint:
    """The checkpoint to resume from, after checking that this run trains the same thing.

    Raises ``ValueError`` with one line naming the first key that differs (or the
    missing folder) before any work starts.
    """
    run_dir = Path(run_dir).expanduser()
    if not (run_dir / "config.json").exists():
        raise ValueError(f"resume-from={str(run_dir)!r}: expected a run folder (with config.json)")
    ckpt = load_checkpoint(run_dir)
    before = json.loads((run_dir / "config.json").read_text())
    for key in sorted(set(before) | set(run_config)):
        if key in MAY_CHANGE_ON_RESUME or before.get(key) == run_config.get(key):
            continue
        raise ValueError(
            f"resume-from={str(run_dir)!r}: {key}={run_config.get(key)!r} differs from the "
            f"checkpointed run's {before.get(key)!r}; expected the same training configuration"
        )
    rounds = int(run_config["num-server-rounds"])
    if rounds <= ckpt.round:
        raise ValueError(
            f"num-server-rounds={rounds}: expected more than the {ckpt.round} rounds "
            f"the checkpoint in {run_dir} already holds"
        )
    return ckpt


def replay_run(
    from_run_dir: Path,
    ckpt: Checkpoint,
    global_params: dict[str, torch.Tensor],
    names: tuple[str, ...],
    step_log,
    recorder,
    after_each_step=None,
) -> dict[str, torch.Tensor]:
    """Rebuild ``x^R`` in place as ``x^0`` plus the logged steps of ``from_run_dir`` (``replay_steps``),
    copying the steps and the records of rounds 0..R into this run's ``step_log`` and ``recorder``. Returns
    ``g^R``, the step round R+1's message carries."""
    step = replay_steps(from_run_dir, ckpt, global_params, names, after_each_step, copy_to=step_log)
    recorder.copy_rounds(from_run_dir, ckpt.round)
    return step


def replay_steps(
    from_run_dir: Path,
    ckpt: Checkpoint,
    global_params: dict[str, torch.Tensor],
    names: tuple[str, ...],
    after_each_step=None,
    copy_to=None,
) -> dict[str, torch.Tensor]:
    """Rebuild ``x^R`` in place as ``x^0`` plus the logged steps of ``from_run_dir``, from its newest snapshot
    before R when the log is bounded, checked against the checkpoint's digest; each step (and the snapshot)
    also written to the step log ``copy_to``. Returns ``g^R``."""
    from .core import apply_step_keeping, digest, model_digest
    from .replica import StepLog

    old_log = StepLog(from_run_dir)
    # A bounded log (snapshot-every) starts at a snapshot: the newest before R (g^R is replayed, so
    # after_each_step sees the values x^{R-1} had, which a full sync sends).
    start = old_log.latest_snapshot(ckpt.round - 1) or 0
    if start:
        values = old_log.read_snapshot(start)
        with torch.no_grad():
            for n, t in values.items():
                global_params[n].copy_(t)
        if copy_to is not None:
            copy_to.write_snapshot(start, values)
    step = {}
    for version in range(start + 1, ckpt.round + 1):
        block, step = old_log.read(version)
        before = apply_step_keeping(global_params, step)
        if after_each_step is not None:
            after_each_step(before)
        if copy_to is not None:
            copy_to.write(version, block, step)
    rebuild = model_digest if ckpt.digest_format == DIGEST_FORMAT else digest
    rebuilt = rebuild(global_params, names)
    if rebuilt != ckpt.global_sha256:
        raise ValueError(
            f"resume-from={str(from_run_dir)!r}: x^0 plus the logged steps does not give the "
            f"checkpointed x^{ckpt.round}; expected the same model files as the first run"
        )
    return step
