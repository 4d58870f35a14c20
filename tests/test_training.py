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
    settings = TrainSettings(
        local_steps=3,
        learning_rate=1e-3,
        weight_decay=0.0,
        lr_schedule="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        precision=precision,
    )
    result = train_block(
        model, part.names(1), sample_batches(train, 3, 4, seed=0, pad_id=tokenizer.pad_token_id), settings
    )
    assert set(result.delta) == set(part.names(1))
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in result.delta.values())
    assert any(t.abs().sum() > 0 for t in result.delta.values())
    for name, p in params.items():
        assert p.dtype == torch.float32 and not p.requires_grad
        if name in result.delta:
            assert torch.equal(p.detach(), before[name] + result.delta[name]) or torch.allclose(
                p.detach(), before[name] + result.delta[name], atol=1e-7
            )
        else:
            assert torch.equal(p.detach(), before[name]), name


def test_too_few_batches_is_an_error(tiny_model_dir):
    model, tokenizer = load_model(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))
    train, _ = tokenized_splits("reasoning-gym:gsm_symbolic", 40, 4, 0, tokenizer, 128)
    settings = TrainSettings(3, 1e-3, 0.0, "constant", 0, 1.0, "fp32")
    with pytest.raises(ValueError, match="local-steps=3: only 1 batches"):
        train_block(
            model,
            core.partition_blocks(model, 2).names(0),
            sample_batches(train, 1, 4, seed=0, pad_id=tokenizer.pad_token_id),
            settings,
        )


def test_on_receipt_correction_mid_training_keeps_delta_to_the_optimizer_changes(tiny_model_dir):
    """Same block as the pending one (b_r == b_{r-1}): the hardest case for the bookkeeping."""
    model, tokenizer = load_model(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))
    train, _ = tokenized_splits("reasoning-gym:gsm_symbolic", 40, 4, 0, tokenizer, 128)
    names = core.partition_blocks(model, layers_per_block=2).names(0)
    params = dict(model.named_parameters())
    x_prev = core.snapshot(params, names)  # x^{r-2} on the block
    torch.manual_seed(1)
    own = {n: 1e-3 * torch.randn_like(params[n]) for n in names}  # Δ^{r-1}, already in y
    step = {n: 0.5 * own[n] + 1e-4 * torch.randn_like(own[n]) for n in names}  # g^{r-1}
    core.apply_step(params, own)  # y = x^{r-2} + Δ^{r-1}
    applied = []

    def on_receipt(k, live, before):
        if k == 2:
            core.correct_in_place(live, before, step, own)
            applied.append(k)

    settings = TrainSettings(4, 1e-3, 0.0, "constant", 0, 1.0, "fp32")
    result = train_block(
        model,
        names,
        sample_batches(train, 4, 4, seed=0, pad_id=tokenizer.pad_token_id),
        settings,
        between_steps=on_receipt,
    )
    assert applied == [2]
    for n in names:
        # y = x^{r-1} + Δ^r with x^{r-1} = x^{r-2} + g: the correction is not part of Δ^r.
        assert torch.allclose(params[n].detach(), x_prev[n] + step[n] + result.delta[n], atol=1e-6), n
