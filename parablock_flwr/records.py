"""Conversions between Flower's ArrayRecord and the core's name->tensor dicts."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord

from .core import Tensors


def to_tensors(record: ArrayRecord) -> Tensors:
    """The record's arrays as tensors (``Array.numpy()`` deserialises into new memory: no copy needed)."""
    return {name: torch.from_numpy(array.numpy()) for name, array in record.items()}


def to_record(tensors: Tensors) -> ArrayRecord:
    return ArrayRecord({name: t.detach().cpu().contiguous() for name, t in tensors.items()})
