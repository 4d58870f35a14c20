"""The embedded default is a real pretrained LLM that loads with no hub access."""

import os
from pathlib import Path

import pytest
import torch

from parablock_flwr.data import encode, generate_examples
from parablock_flwr.model import load_model, load_tokenizer, resolve_model

SPEC = "embedded:smollm2-135m-instruct"

pytestmark = pytest.mark.slow  # loads SmolLM2: 1-20 s (disk cache), 60 s more the first time (GGUF conversion)


@pytest.fixture(scope="module")
def offline():
    old = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_embedded_smollm2_converts_loads_and_answers(offline):
    """About 60 s the first time on a machine (GGUF conversion), a few seconds after."""
    model, tokenizer = load_model(SPEC), load_tokenizer(SPEC)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert (Path(resolve_model(SPEC)) / "model.safetensors").exists()  # the cached HF folder
    assert not any(p.requires_grad for p in model.parameters())
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])


def test_answer_only_labels_with_the_chat_template(offline):
    tokenizer = load_tokenizer(SPEC)
    row = generate_examples("reasoning-gym:gsm_symbolic", 1, seed=0)[0]
    enc = encode(tokenizer, row["prompt"], row["response"], max_len=1024)
    labelled = [t for t, label in zip(enc["input_ids"], enc["labels"]) if label != -100]
    assert labelled == [label for label in enc["labels"] if label != -100]
    text = tokenizer.decode(labelled)
    assert text.strip().startswith(row["response"][:20]) and "####" in text
    assert row["prompt"][:30] not in text  # the question is context, not target
