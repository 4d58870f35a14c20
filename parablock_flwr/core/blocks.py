"""The blocks ``B_1..B_M`` of a model and the schedule ``b_1..b_R`` that picks one each round.

Kept apart from the arithmetic because it reads a model's structure (``nn.Module``) once, at the
start, while everything else in ``core`` works on plain tensors keyed by parameter name.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..config import NON_LAYER_MODES, SCHEDULES  # the choices live with the other settings (no torch there)


@dataclass(frozen=True)
class BlockPartition:
    """The trainable parameters of a model, split into blocks.

    ``blocks[b]`` holds the parameter names of block ``b``; every parameter
    not in any block is frozen and never moves.
    """

    blocks: tuple[tuple[str, ...], ...]
    labels: tuple[str, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def names(self, block: int) -> tuple[str, ...]:
        return self.blocks[block]

    def all_names(self) -> tuple[str, ...]:
        return tuple(name for block in self.blocks for name in block)


def find_decoder_layers(model: nn.Module) -> str:
    """Return the qualified name of the model's list of decoder layers.

    Architectures keep their layers under different paths (``model.layers``,
    ``transformer.h``, ``gpt_neox.layers``, ``model.decoder.layers``...), so
    we look for the ``ModuleList`` whose length is the configured number of
    hidden layers instead of hard-coding paths.
    """
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0
    ]
    if num_layers is not None:
        matching = [(n, m) for n, m in candidates if len(m) == num_layers]
        if matching:
            return matching[0][0]
    if not candidates:
        raise ValueError(
            f"cannot find decoder layers in {type(model).__name__}: expected an nn.ModuleList of decoder layers"
        )
    return max(candidates, key=lambda item: len(item[1]))[0]


def partition_blocks(
    model: nn.Module,
    layers_per_block: int,
    non_layer_params: str = "frozen",
    trainable: Callable[[str], bool] = lambda name: True,
) -> BlockPartition:
    """Split the model into blocks of ``layers_per_block`` consecutive layers.

    Parameters outside the decoder layers (embeddings, final norm, LM head)
    are frozen, or form one extra block when ``non_layer_params="block"``.
    Tied weights appear once (``named_parameters`` de-duplicates them).
    Only names for which ``trainable(name)`` holds enter a block: with LoRA,
    a block is the adapters of its layers and the base weights stay frozen.
    """
    if non_layer_params not in NON_LAYER_MODES:
        raise ValueError(f"non-layer-params={non_layer_params!r}: expected one of {NON_LAYER_MODES}")
    layers_name = find_decoder_layers(model)
    num_layers = len(model.get_submodule(layers_name))
    if not 1 <= layers_per_block <= num_layers:
        raise ValueError(
            f"layers-per-block={layers_per_block}: expected 1..{num_layers} (the model has {num_layers} decoder layers)"
        )
    prefix = layers_name + "."
    per_layer: list[list[str]] = [[] for _ in range(num_layers)]
    others: list[str] = []
    for name, _ in model.named_parameters():
        if not trainable(name):
            continue
        if name.startswith(prefix):
            per_layer[int(name[len(prefix) :].split(".", 1)[0])].append(name)
        else:
            others.append(name)
    blocks, labels = [], []
    for start in range(0, num_layers, layers_per_block):
        stop = min(start + layers_per_block, num_layers)
        blocks.append(tuple(n for layer in per_layer[start:stop] for n in layer))
        labels.append(f"layers {start}-{stop - 1}")
    if non_layer_params == "block" and others:
        blocks.append(tuple(others))
        labels.append("non-layer")
    for names, label in zip(blocks, labels):
        if not names:
            raise ValueError(f"block {label!r} of {type(model).__name__} has no trainable parameter")
    return BlockPartition(tuple(blocks), tuple(labels))


def one_block(partition: BlockPartition) -> BlockPartition:
    """All blocks merged into one: FedAvg is BCD whose only block is everything."""
    return BlockPartition((partition.all_names(),), ("all",))


def block_schedule(policy: str, num_blocks: int, num_rounds: int, seed: int) -> list[int]:
    """The block ``b_r`` of each round r = 1..R (list index r-1), seeded."""
    if policy not in SCHEDULES:
        raise ValueError(f"schedule={policy!r}: expected one of {SCHEDULES}")
    rng = random.Random(seed)
    if policy == "ascending":
        return [r % num_blocks for r in range(num_rounds)]
    if policy == "descending":
        return [num_blocks - 1 - r % num_blocks for r in range(num_rounds)]
    if policy == "uniform-random":
        return [rng.randrange(num_blocks) for _ in range(num_rounds)]
    schedule: list[int] = []  # random permutation per epoch over the blocks
    while len(schedule) < num_rounds:
        epoch = list(range(num_blocks))
        rng.shuffle(epoch)
        schedule.extend(epoch)
    return schedule[:num_rounds]
