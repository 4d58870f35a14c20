"""How a tensor travels as a numpy array (no Flower here: the node worker imports it).

Tensors travel as fp32, fp16, or bf16; numpy has no bf16, so bf16 travels as its raw
16-bit patterns in an ``int16`` array (no other tensor travels as int16). Decoding
reads the payload's own dtype, so a receiver needs no setting to decode.
"""

from __future__ import annotations

import numpy as np
import torch

from .core import TRANSFER_DTYPES

# The payload dtype each transfer precision uses on the wire, from core.TRANSFER_DTYPES (the one table):
# the same dtype in numpy, but bf16 (which numpy lacks) as its raw 16-bit patterns.
WIRE_DTYPES = {
    name: np.dtype(np.int16) if dtype == torch.bfloat16 else np.dtype(str(dtype).removeprefix("torch."))
    for name, dtype in TRANSFER_DTYPES.items()
}


def encode(tensor: torch.Tensor, transfer_dtype: str = "fp32") -> np.ndarray:
    """One tensor as the numpy array that travels (lossless for values already rounded)."""
    t = tensor.detach().cpu().to(TRANSFER_DTYPES[transfer_dtype]).contiguous()
    return t.view(torch.int16).numpy() if transfer_dtype == "bf16" else t.numpy()


def decode(array: np.ndarray) -> torch.Tensor:
    """The fp32 (or fp32-valued) tensor an array that travelled stands for."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if array.dtype == np.int16:
        return t.view(torch.bfloat16).to(torch.float32)
    if array.dtype == np.float16:
        return t.to(torch.float32)
    return t
