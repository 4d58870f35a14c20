"""What large models need from the training loop, on the tiny real Llama: micro-batches with
gradient accumulation, gradient checkpointing, a learning-rate schedule over the whole run, and the
count of examples cut at max-seq-len."""

from __future__ import annotations

import pytest
import torch

from parablock_flwr import core, node
from parablock_flwr.config import ConfigError, RunConfig
from parablock_flwr.data import collate, tokenized_splits, truncated_in_batches
from parablock_flwr.model import load_for_training, load_model, load_tokenizer
from parablock_flwr.training import TrainSettings, accumulated_loss, run_schedule, train_block
from parablock_flwr.wire import join_pieces, unpack
from parablock_flwr.worker.server import NodeWorker

from helpers import relayed, tiny_config


def one_step_update(model_dir, batch, **settings) -> core.Tensors:
    torch.manual_seed(0)
    model = load_model(str(model_dir))
    names = core.partition_blocks(model, layers_per_block=2).names(0)  # the lowest block: backward runs through all
    base = TrainSettings(1, 1e-3, 0.0, "constant", 0, 1e9, "fp32")  # no clipping: it would hide a wrong scale
    fields = {**base.__dict__, **settings}
    return train_block(model, names, [batch], TrainSettings(**fields)).delta, model


def block_gradient(model_dir, batch, **settings) -> core.Tensors:
    """The gradient ``accumulated_loss`` leaves on the lowest block (backward runs through every layer)."""
    model = load_model(str(model_dir))
    names = core.partition_blocks(model, layers_per_block=2).names(0)
    params = dict(model.named_parameters())
    for n in names:
        params[n].requires_grad_(True)
    base = TrainSettings(1, 1e-3, 0.0, "constant", 0, 1e9, "fp32")
    if settings.get("gradient_checkpointing"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    accumulated_loss(model, batch, TrainSettings(**{**base.__dict__, **settings}), torch.device("cpu"))
    return {n: params[n].grad.clone() for n in names}


def test_k_micro_batches_give_the_update_of_one_batch_of_k_times_b(tiny_model_dir):
    """K = 4 micro-batches of b = 2 rows against one batch of 8 (rows of different lengths, so the
    micro-batches pad differently and hold different numbers of answer tokens): the same gradient up
    to float rounding, with and without gradient checkpointing, hence the same AdamW update (AdamW's
    first step is about lr·g/|g|: rounding in a near-zero gradient element moves it by a small part of lr)."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    train, _ = tokenized_splits("reasoning-gym:gsm_symbolic", 40, 4, 0, tokenizer, 128)
    batch = collate([train[i] for i in range(8)], tokenizer.pad_token_id)
    assert len({int((batch["labels"][i] != -100).sum()) for i in range(8)}) > 1
    whole = block_gradient(tiny_model_dir, batch)
    for settings in ({"micro_batch_size": 2}, {"micro_batch_size": 4, "gradient_checkpointing": True}):
        micro = block_gradient(tiny_model_dir, batch, **settings)
        for name in whole:
            torch.testing.assert_close(micro[name], whole[name], rtol=1e-4, atol=1e-4 * float(whole[name].abs().max()))
    half = block_gradient(tiny_model_dir, {k: v[:2] for k, v in batch.items()})  # the check can fail
    assert any(not torch.allclose(half[n], whole[n], rtol=1e-2) for n in whole)

    lr = 1e-3
    update, _ = one_step_update(tiny_model_dir, batch)
    for settings in ({"micro_batch_size": 2}, {"micro_batch_size": 4, "gradient_checkpointing": True}):
        micro, model = one_step_update(tiny_model_dir, batch, **settings)
        for name in update:
            torch.testing.assert_close(micro[name], update[name], rtol=0, atol=0.02 * lr)
    assert model.is_activation_checkpointing


def test_the_run_schedule_continues_across_rounds_instead_of_restarting():
    """linear with warm-up over R x K = 3 x 4 steps: round 2's local scheduler starts at step 4."""
    lrs = {}
    for server_round in (1, 2, 3):
        param = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.AdamW([param], lr=1.0)
        settings = TrainSettings(4, 1.0, 0.0, "linear", 2, 1.0, "fp32", schedule_steps=12,
                                 schedule_offset=(server_round - 1) * 4)  # fmt: skip
        scheduler = run_schedule(optimizer, settings)
        for _ in range(4):
            lrs[len(lrs)] = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
    # warm-up 0, 0.5, then linear decay 1.0 -> 0 over the remaining 10 steps of the run
    expected = [0.0, 0.5] + [(12 - s) / 10 for s in range(2, 12)]
    assert [round(lrs[s], 9) for s in range(12)] == [round(x, 9) for x in expected]


def test_truncated_examples_are_counted_in_the_rounds_batches(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    train, _ = tokenized_splits("reasoning-gym:gsm_symbolic", 40, 4, 0, tokenizer, 96)
    flags = list(train["truncated"])
    assert 0 < sum(flags) < len(flags)  # some worked answers are longer than 96 tokens, some are not
    assert all(len(row["input_ids"]) == 96 for row, cut in zip(train, flags) if cut)  # cut to max-seq-len
    # One permutation of the rows: every row drawn once, so every truncated one is counted once.
    assert truncated_in_batches(train, len(train), 1, seed=3) == sum(flags)
    assert truncated_in_batches(train, 2, 1, seed=3) <= 2


def test_micro_batch_size_must_divide_the_batch():
    with pytest.raises(ConfigError, match=r"micro-batch-size=3: expected 0 \(no accumulation\) or a divisor of "):
        RunConfig.from_flower({"batch-size": 4, "micro-batch-size": 3})
    with pytest.raises(ConfigError, match=r"lr-schedule-scope='epoch': expected one of round, run"):
        RunConfig.from_flower({"lr-schedule-scope": "epoch"})


@pytest.mark.slow
def test_bf16_weights_keep_every_copy_of_x_bit_identical_and_training_lowers_the_loss(tmp_path, tiny_model_dir):
    """A node worker with ``weights = "bf16"`` (one node, so the server's step is its update): its model
    on the device is bf16, its fp32 master of x equals the server's x^{r-1} bit for bit after every
    round, its local model is x^{r-1} + Δ_i^r to the bit (the digest the server checks), and the
    training loss falls."""
    config = tiny_config(tiny_model_dir, tmp_path, weights="bf16", **{"verify-invariant": True, "local-steps": 3})
    cfg = RunConfig.from_flower(config)
    server, partition = load_for_training(cfg)  # the server's fp32 x^0
    names = partition.all_names()
    x = {n: p.detach().clone() for n, p in server.named_parameters() if n in names}
    worker, losses, arrays = NodeWorker(), [], {}
    blocks = [1, 0, 1, 0, 1]
    for r, block in enumerate(blocks, start=1):
        header = {
            "op": "train", "run-id": 21, "run-config": config, "partition-id": 0, "num-partitions": 1, "node": {},
            "round": {"server-round": r, "block": block, "step-block": blocks[r - 2] if r > 1 else -1,
                      "next-block": blocks[r] if r < len(blocks) else -1, "algorithm": "parablock",
                      "run-dir": "unused"},
        }  # fmt: skip
        reply, update = worker.serve_request(header, arrays)
        delta = unpack(join_pieces(update), lazy=True)  # as the server reads it
        if worker.node.ahead is not None:  # round r+1 runs ahead on the replica: let it finish before reading it
            worker.node.ahead.future.result()
        replica = node.resources(cfg, 21).replica
        assert replica.version == r - 1 and all(torch.equal(replica.params[n], x[n]) for n in names)
        assert reply["trace"]["local-model-sha256"] == core.model_digest(x, names, delta)
        losses.append(reply["metrics"]["train-loss"])
        step = core.global_step(core.aggregate([delta], [1.0]), cfg.server_lr)  # one client: g^r = Δ^r
        core.apply_step(x, step)
        arrays = relayed({"global-step": step})
    frozen = [p for n, p in replica.model.named_parameters() if n not in names]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    assert all(p.dtype == torch.bfloat16 for n, p in replica.model.named_parameters() if n in names)
    assert all(t.dtype == torch.float32 for t in replica.params.values())
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("train", ["full", "lora"])
def test_bf16_weights_load_without_an_fp32_model_and_keep_x0_exact(tmp_path, tiny_model_dir, train):
    """``weights = "bf16"``: the frozen weights load in bf16 (no fp32 copy of the whole model), the
    trainable ones are exact fp32 values: those of the server's fp32 load, to the bit (LoRA's
    adapters too, although PEFT rounds them through a bf16 base's dtype)."""
    cfg = RunConfig.from_flower(tiny_config(tiny_model_dir, tmp_path, weights="bf16", train=train))
    server, partition = load_for_training(cfg)  # fp32, as the server loads it
    node_model, node_partition = load_for_training(cfg, "bf16")
    assert node_partition.blocks == partition.blocks
    trainable = set(partition.all_names())
    server_params = dict(server.named_parameters())
    for name, p in node_model.named_parameters():
        if name in trainable:
            assert p.dtype == torch.float32 and torch.equal(p, server_params[name]), name
        else:
            assert p.dtype == torch.bfloat16, name
