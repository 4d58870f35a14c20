"""A tiny real Llama and a locally trained tokenizer, for tests and smoke runs.

Real transformers and tokenizers objects, built offline in about a second;
training it is 10-100x faster than SmolLM2 on a CPU.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ..data import generate_examples

log = logging.getLogger(__name__)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ``parablock-flwr simulate --tiny`` / ``deploy --tiny``: a smoke run of seconds per round on any machine, on
# the tiny model (made on the spot) and offline data; a user's KEY=VALUE overrides win.
# The keys as ``RunConfig`` names its fields (config.py spells the run config; some keys also name metrics).
_SMOKE = dict(dataset="reasoning-gym:gsm_symbolic", num_examples=64, heldout_examples=8, layers_per_block=2,
              num_server_rounds=2, local_steps=2, batch_size=4, max_seq_len=128, learning_rate=3e-3,
              generate_examples=2, max_new_tokens=8)  # fmt: skip
SMOKE_CONFIG = {name.replace("_", "-"): value for name, value in _SMOKE.items()}


def smoke_model(folder: Path) -> Path:
    """The tiny model in ``folder``, made once (a folder with its weights is reused)."""
    folder = Path(folder)
    if not (folder / "model.safetensors").exists():
        build_tiny_model(folder)
    return folder


def build_tiny_model(
    folder: Path,
    *,
    num_layers: int = 4,
    hidden: int = 64,
    vocab: int = 1024,
    seed: int = 0,
    chat_template: bool = True,
    texts: list[str] | None = None,
) -> Path:
    """Write a tiny Llama + BPE tokenizer to ``folder``: the tokenizer is trained on ``texts`` (default:
    the GSM-style data), and has a chat template unless ``chat_template`` is false (a base model)."""
    import torch

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if texts is None:
        rows = generate_examples("reasoning-gym:gsm_symbolic", 200, seed=1234)
        texts = list(rows["prompt"]) + list(rows["response"])
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    log.debug("tiny model: %d layers, hidden %d, vocab %d in %s", num_layers, hidden, len(tokenizer), folder)
    heads = max(4, hidden // 64)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder
