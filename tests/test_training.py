"""The shared local-training loop on a tiny real Llama."""

import pytest
import torch

from parablock_flwr import core
from parablock_flwr.data import sample_batches, tokenized_splits
from parablock_flwr.model import load_model, load_tokenizer
from parablock_flwr.training import TrainSettings, train_block


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_block_changes_only_the_block_and_returns_fp32_update(tiny_model_dir, precision):
    model, tokenizer = load_model(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))
    train, _ = tokenized_splits("reasoning-gym:gsm_symbolic", 40, 4, 0, tokenizer, 128)
    part = core.partition_blocks(model, layers_per_block=2)
    params = dict(model.named_parameters())
    before = core.snapshot(params, params)
    settings = TrainSettings(local_steps=3, learning_rate=1e-3, weight_decay=0.0, lr_schedule="constant",
                             warmup_steps=0, max_grad_norm=1.0, precision=precision)
    result = train_block(model, part.names(1), sample_batches(train, 3, 4, seed=0, pad_id=tokenizer.pad_token_id),
                         settings)
    assert set(result.delta) == set(part.names(1))
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in result.delta.values())
    assert any(t.abs().sum() > 0 for t in result.delta.values())
    for name, p in params.items():
        assert p.dtype == torch.float32 and not p.requires_grad
        if name in result.delta:
            assert torch.equal(p.detach(), before[name] + result.delta[name]) or torch.allclose(
                p.detach(), before[name] + result.delta[name], atol=1e-7)
        else:
            assert torch.equal(p.detach(), before[name]), name


def test_too_few_batches_is_an_error(tiny_model_dir):
    model, tokenizer = load_model(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))
    train, _ = tokenized_splits("reasoning-gym:gsm_symbolic", 40, 4, 0, tokenizer, 128)
    settings = TrainSettings(3, 1e-3, 0.0, "constant", 0, 1.0, "fp32")
    with pytest.raises(ValueError, match="local-steps=3: only 1 batches"):
        train_block(model, core.partition_blocks(model, 2).names(0),
                    sample_batches(train, 1, 4, seed=0, pad_id=tokenizer.pad_token_id), settings)
