"""Aggregation: coordinate-wise trimmed mean of the client updates.

Drops the ``trim_fraction`` largest and smallest values of every coordinate
before averaging (unweighted), so that a few outlying clients cannot drag the
block far. An example of overriding ``combine``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import core
from ..strategies.parablock.server import ParaBlock


class TrimmedMeanParaBlock(ParaBlock):
    trim_fraction = 0.2  # per side; a subclass may change it

    def combine(self, updates: Iterable[core.Tensors], weights: list[float]) -> core.Tensors:
        updates = list(updates)  # a coordinate-wise order statistic needs every update at once
        k = int(self.trim_fraction * len(updates))
        if k == 0:
            return super().combine(updates, weights)
        out = {}
        for name in updates[0]:
            stacked = torch.stack([u[name] for u in updates])
            ordered, _ = stacked.sort(dim=0)
            out[name] = ordered[k : len(updates) - k].mean(dim=0)
        return out
