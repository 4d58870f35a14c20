"""``parablock-flwr export RUN_DIR``: a Hugging Face folder of a run's global model, rebuilt from its files.

A run without ``save-final-model`` (or stopped before its end) still holds everything its model is made of:
its config (``x^0``: the same model files), its step log and its latest checkpoint's digest. This rebuilds
``x^R`` exactly as a resumed server does (``checkpoint.replay_steps``, checked against the digest) and writes
it as the run's own export would: a full model folder, or the PEFT adapter folder of a LoRA run.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint import load_checkpoint, replay_steps
from .config import RunConfig
from .model import load_for_training, load_tokenizer, save_model


def export_run(run_dir: Path, out: Path | None = None) -> tuple[Path, int]:
    """Write the run's model as of its latest checkpoint to ``out`` (default: ``RUN_DIR/model-round-R``); the
    folder and R. Raises ``ValueError`` (one line) when the folder is not a run's or its files do not rebuild
    the checkpointed model."""
    run_dir = Path(run_dir).expanduser()
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"{str(run_dir)!r}: expected a run folder (with config.json)")
    try:
        ckpt = load_checkpoint(run_dir)
    except FileNotFoundError as err:
        raise ValueError(str(err).replace("resume-from=", "")) from None
    cfg = RunConfig.from_flower(json.loads((run_dir / "config.json").read_text()))
    model, partition = load_for_training(cfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        replay_steps(run_dir, ckpt, {n: params[n] for n in partition.all_names()}, partition.all_names())
    out = Path(out) if out is not None else run_dir / f"model-round-{ckpt.round:05d}"
    save_model(model, load_tokenizer(cfg.model, cfg.prompt_format), out)
    return out, ckpt.round
