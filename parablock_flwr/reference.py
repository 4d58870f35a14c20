"""ParaBlock, sequential BCD and the no-correction ablation as the spec defines them: one plain loop.

This is the clearest statement of the algorithm in the project; read it beside docs/algorithm.md.
tests/test_reference.py holds the Flower app to it bit for bit.

No Flower, no server, no node runtime: the clients are a list, a round is a loop over the
sampled ones, the server is one short function (``server_step``). What it takes from
the app defines the *data and settings*, so that both compute on the same numbers: the model
and its blocks (``load_for_training``), the block schedule, the rows and each client's
Dirichlet partition, the seeded batches of a client's round (``round_seed``,
``sample_batches``), and ``training.train_block``, the app's local loop (fresh AdamW over
the block, ``lr-schedule``): reused rather than rewritten so that a difference can only
come from the rounds, not from a second optimizer loop.

Participation is drawn over the clients' partition ids (``sample``), the app's rule with
its node ids replaced by the clients' stable identities: the app samples sorted Flower
node ids, which the simulation engine draws at random, so which partitions the app samples
is not the same from one run to the next. ``run(..., participants=...)`` takes them from
an app run instead (tests/test_reference.py).

Start points (``START``): a sampled client trains block ``b_r`` from

- ``fedbcd``: ``x^{r-1}``;
- ``parablock``: ``x^{r-2} + Δ_i^{r-1}`` when it trained round r-1, else ``x^{r-1}``
  (the correction after round r leaves ``y_i = x^{r-1} + Δ_i^r``: the invariant);
- ``none``: its own model ``y_i = x^{r_0-1} + Σ_s Δ_i^s`` (it never takes in the
  aggregate; ``x^{r-1}`` before its first round);
- for finding what makes ParaBlock differ, one thing switched at a time
  (``x^{r-2} + Δ_i^{r-1} = x^{r-1} + (Δ_i^{r-1} − g^{r-1})``, on block ``b_{r-1}``):
  ``fresh-plus-own``: ``x^{r-1} + Δ_i^{r-1}``; ``stale``: ``x^{r-2}``.

Its study of the alpha 0.1 gap was made by an experiment no longer in the tree
(git history: benchmarks/reference_gap.py).
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from parablock_flwr import core
from parablock_flwr.config import RunConfig
from parablock_flwr.core import block_schedule
from parablock_flwr.data import client_partition, in_order_batches, sample_batches, tokenized_splits
from parablock_flwr.evaluation import heldout_loss
from parablock_flwr.model import load_for_training, load_tokenizer
from parablock_flwr.runtime import round_seed, setup_torch
from parablock_flwr.training import TrainSettings, train_block

Tensors = dict[str, torch.Tensor]
START = ("fedbcd", "parablock", "none", "fresh-plus-own", "stale")


@dataclass
class Client:
    rows: object  # its partition of the training rows
    last_round: int = 0  # the last round it trained (0: never)
    own: Tensors = field(default_factory=dict)  # Δ_i of that round
    model: Tensors | None = None  # ``none`` only: its own model y_i


@dataclass
class Round:
    """What one round did: x^r, its block, who trained, and what each client computed on."""

    block: int
    participants: list[int]
    x: Tensors
    heldout_loss: float | None = None
    train_loss: float = 0.0
    steps: dict[int, int] = field(default_factory=dict)  # client -> local steps taken
    examples: dict[int, int] = field(default_factory=dict)  # client -> examples its batches held
    batches: dict[int, str] = field(default_factory=dict)  # client -> SHA-256 of its batches' token ids
    stale_start: int = 0  # clients that started from their own previous update

    def note_batches(self, client: int, batches: list[dict]) -> None:
        """What a client's round computed on, which tests/test_reference.py compares with the app's records."""
        self.steps[client] = len(batches)
        self.examples[client] = sum(len(b["input_ids"]) for b in batches)
        self.batches[client] = hashlib.sha256(b"".join(b["input_ids"].numpy().tobytes() for b in batches)).hexdigest()


@functools.cache
def _rows(model: str, dataset: str, num_examples: int, heldout: int, seed: int, max_len: int):
    return tokenized_splits(dataset, num_examples, heldout, seed, load_tokenizer(model), max_len)


def rows(cfg: RunConfig):
    """(training rows, held-out rows), as the app's server and nodes make them; kept for the next run."""
    return _rows(cfg.model, cfg.dataset, cfg.num_examples, cfg.heldout_examples, cfg.seed, cfg.max_seq_len)


def sample(cfg: RunConfig, num_clients: int, server_round: int) -> list[int]:
    """``fraction-train`` of the clients (at least one), seeded by the round, as the app's server."""
    if cfg.fraction_train >= 1.0:
        return list(range(num_clients))
    k = max(1, math.ceil(cfg.fraction_train * num_clients))
    return sorted(random.Random(cfg.seed * 1_000_003 + server_round).sample(range(num_clients), k))


def settings(cfg: RunConfig, server_round: int) -> TrainSettings:
    """The local loop's settings in round r, as a node builds them."""
    run_scope = cfg.lr_schedule_scope == "run"
    return TrainSettings(
        cfg.local_steps, cfg.learning_rate, cfg.weight_decay, cfg.lr_schedule, cfg.warmup_steps, cfg.max_grad_norm,
        cfg.precision, micro_batch_size=cfg.micro_batch_size, gradient_checkpointing=cfg.gradient_checkpointing,
        schedule_steps=cfg.num_server_rounds * cfg.local_steps if run_scope else 0,
        schedule_offset=(server_round - 1) * cfg.local_steps if run_scope else 0,
    )  # fmt: skip


def plus(x: Tensors, update: Tensors) -> Tensors:
    """A copy of ``x`` with ``update`` added in place (``x[b] += Δ``, the app's float operation)."""
    out = {n: t.clone() for n, t in x.items()}
    for n, t in update.items():
        out[n].add_(t)
    return out


def start_point(start: str, client: Client, r: int, x: Tensors, x_before: Tensors) -> tuple[Tensors, bool]:
    """(the model round r trains from, whether it is a stale start); ``x`` is x^{r-1}, ``x_before`` x^{r-2}."""
    if start == "none":
        return (client.model if client.model is not None else x), client.model is not None
    if start == "fedbcd" or client.last_round != r - 1 or r == 1:
        return x, False  # BCD, or a client that missed round r-1: resynchronised
    if start == "parablock":
        return plus(x_before, client.own), True
    if start == "fresh-plus-own":
        return plus(x, client.own), True
    if start == "stale":
        return x_before, True
    raise ValueError(f"start={start!r}: expected one of {START}")


def server_step(updates: list[Tensors], weights: list[float], cfg: RunConfig, server_round: int) -> Tensors:
    """The server: ``Δ̄ = Σ (w_i / Σw) Δ_i`` in the clients' order, then ``g^r = η_s Δ̄``. With differential
    privacy in central mode (docs/privacy.md), each ``Δ_i`` is clipped again first, and ``Δ̄`` gets Gaussian
    noise of std ``σ C / n`` from round r's seed (``dp-noise-seed``: the reference knows no secret)."""
    central = cfg.dp and cfg.dp_mode == "central"
    if central:
        updates = [core.clip(u, cfg.dp_clip_norm)[0] for u in updates]
    total = sum(weights)
    mean = {n: (weights[0] / total) * t for n, t in updates[0].items()}
    for update, w in zip(updates[1:], weights[1:]):
        for n, t in update.items():
            mean[n].add_(t, alpha=w / total)
    if central and cfg.dp_noise_multiplier > 0:
        noise = core.gaussian(mean, core.noise_seed(cfg.dp_noise_seed, server_round))
        core.add_noise(mean, noise, cfg.dp_noise_multiplier * cfg.dp_clip_norm / len(updates))
    return mean if cfg.server_lr == 1.0 else {n: cfg.server_lr * t for n, t in mean.items()}


def client_update(delta: Tensors, cfg: RunConfig, server_round: int, client: int) -> Tensors:
    """What a client sends: its update, with differential privacy clipped to ``dp-clip-norm`` and, in local
    mode, noised with std ``σ C`` from its own seed."""
    if not cfg.dp:
        return delta
    delta, _ = core.clip(delta, cfg.dp_clip_norm)
    if cfg.dp_mode == "local" and cfg.dp_noise_multiplier > 0:
        noise = core.gaussian(delta, core.noise_seed(cfg.dp_noise_seed, server_round, client))
        core.add_noise(delta, noise, cfg.dp_noise_multiplier * cfg.dp_clip_norm)
    return delta


def run(
    cfg: RunConfig,
    num_clients: int,
    start: str | None = None,
    participants: Callable[[int], list[int]] | None = None,
    evaluate_every: int = 0,
) -> list[Round]:
    """Rounds 1..R of ``start`` (default: the algorithm of ``cfg``; ``correction = "none"``: ``none``)."""
    start = start or ("none" if cfg.correction == "none" else cfg.algorithm)
    setup_torch(cfg)
    model, partition = load_for_training(cfg)
    tokenizer, (train, heldout) = load_tokenizer(cfg.model), rows(cfg)
    clients = [
        Client(client_partition(train, i, num_clients, cfg.partitioning, cfg.dirichlet_alpha, cfg.seed))
        for i in range(num_clients)
    ]
    params = dict(model.named_parameters())
    x = {n: params[n].detach().clone() for n in partition.all_names()}  # x^0
    x_before = x  # x^{r-2}
    schedule = block_schedule(cfg.schedule, partition.num_blocks, cfg.num_server_rounds, cfg.seed)
    pad = tokenizer.pad_token_id

    def load(values: Tensors) -> None:
        with torch.no_grad():
            for n, t in values.items():
                params[n].copy_(t)

    rounds = []
    for r in range(1, cfg.num_server_rounds + 1):
        block, names = schedule[r - 1], partition.names(schedule[r - 1])
        sampled = participants(r) if participants else sample(cfg, num_clients, r)
        done = Round(block, sampled, x)
        updates, weights, losses = [], [], []
        for i in sampled:  # in partition order, as the server sorts the replies
            client = clients[i]
            y, stale = start_point(start, client, r, x, x_before)
            done.stale_start += stale
            load(y)
            seed = round_seed(cfg, r, i)
            torch.manual_seed(seed)
            batches = list(sample_batches(client.rows, cfg.local_steps, cfg.batch_size, seed, pad))
            result = train_block(model, names, batches, settings(cfg, r))
            done.note_batches(i, batches)
            result.delta = client_update(result.delta, cfg, r, i)
            updates.append(result.delta)
            weights.append(float(len(client.rows)) if cfg.weighting == "examples" else 1.0)
            losses.append(result.mean_loss)
            if start == "none":
                client.model = plus(y, result.delta)  # its own updates only
            client.last_round, client.own = r, result.delta
        x_before, x = x, plus(x, server_step(updates, weights, cfg, r))  # x^r[b_r] = x^{r-1}[b_r] + g^r
        done.x, done.train_loss = x, sum(losses) / len(losses)
        if evaluate_every and (r % evaluate_every == 0 or r == cfg.num_server_rounds):
            load(x)
            done.heldout_loss = heldout_loss(model, in_order_batches(heldout, cfg.eval_batch_size, pad), cfg.precision)
        rounds.append(done)
    return rounds


def initial_loss(cfg: RunConfig) -> float:
    """The held-out loss of x^0."""
    setup_torch(cfg)
    model, _ = load_for_training(cfg)
    tokenizer, (_, heldout) = load_tokenizer(cfg.model), rows(cfg)
    return heldout_loss(model, in_order_batches(heldout, cfg.eval_batch_size, tokenizer.pad_token_id), cfg.precision)


# ------------------------------------------------------------------ an app run, to compare with
def app_participants(records: list[dict]) -> dict[int, list[int]]:
    """Round -> the partitions whose updates an app run aggregated (its records' ``client_weights``)."""
    return {r["round"]: sorted(w["partition_id"] for w in r["client_weights"]) for r in records if r["round"] > 0}


def app_models(run_dir, cfg: RunConfig) -> list[Tensors]:
    """x^1..x^R of an app run: x^0 plus the global steps it logged (``RUN_DIR/global-steps/v{k}``),
    added as every copy of x adds them (each step read as the log keeps it: ``replica.StepLog``)."""
    from .replica import StepLog

    model, partition = load_for_training(cfg)
    params = dict(model.named_parameters())
    x = {n: params[n].detach().clone() for n in partition.all_names()}
    out, log = [], StepLog(run_dir)
    for version in range(1, cfg.num_server_rounds + 1):
        x = plus(x, log.read(version)[1])
        out.append(x)
    return out


def largest_difference(a: Tensors, b: Tensors) -> float:
    """max |a − b| over every tensor (0.0: the same bits, up to the sign of zero)."""
    return max(float((a[n] - b[n]).abs().max()) for n in a)
