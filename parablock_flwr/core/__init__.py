"""ParaBlock's math, as defined by this project (see docs/algorithm.md), framework-free.

No Flower here, only torch tensors keyed by parameter name: strategies, the node runtime and the
plain-PyTorch reference (``parablock_flwr/reference.py``) are thin adapters around it, and read like
the spec through this package's names (``core.aggregate(...)``, ``core.PendingUpdate``).

Notation (as in the spec): global model ``x``, blocks ``B_1..B_M``, schedule
``b_1..b_R``, client update ``Δ_i^r``, aggregate ``Δ̄^r``, server learning rate
``η_s``. We call ``g^r = η_s Δ̄^r`` the *global step* of round r: the server
applies ``x^r[b_r] = x^{r-1}[b_r] + g^r`` and clients apply the very same
float operation, which is what keeps every copy of ``x`` bit-identical.

=========================  ==================================================================
module                     holds
=========================  ==================================================================
``blocks``                 ``BlockPartition``, ``partition_blocks``, ``find_decoder_layers``,
                           ``one_block``, ``block_schedule``: the blocks and which one a round trains
``algorithm``              ``Tensors``, ``snapshot``, ``delta``, ``aggregate``, ``global_step``,
                           ``apply_step(_keeping)``, ``all_finite``, ``PendingUpdate``, ``parablock_base``,
                           ``correct_in_place``, ``uncorrected_offset``: the spec's arithmetic
``digests``                ``digest``, ``tensor_sha256``, ``TensorHashes``, ``model_digest``, ``update_sha256``:
                           proof that two copies of ``x`` (or of a local model) hold the same bits
``transfer_precision``     ``TRANSFER_DTYPES``, ``INT8_BLOCK``, ``int8_blocks``, ``quantize_int8``,
                           ``dequantize_int8``, ``encode``, ``round_for_transfer``, ``round_with_feedback(_encoded)``,
                           ``applied_mean_step`` (the server's mean, step and ``x + g`` in one pass),
                           ``EncodedTensors``, ``kept_encoded``
``time_model``             ``LinkModel``, ``modeled_round_seconds``: what a round would cost
``privacy``                ``l2_norm``, ``clip``, ``clip_scale``, ``gaussian``, ``add_noise``, ``noise_seed``:
                           differential privacy's clipping and noise
=========================  ==================================================================

Every name is re-exported here; callers write ``core.X``, never a submodule's path.
"""

from .algorithm import (
    PendingUpdate,
    Tensors,
    add_scaled,
    added,
    aggregate,
    all_finite,
    apply_step,
    apply_step_keeping,
    correct_in_place,
    delta,
    global_step,
    parablock_base,
    read_chunks,
    snapshot,
    sum_of_squares,
    uncorrected_offset,
)
from .blocks import BlockPartition, block_schedule, find_decoder_layers, one_block, partition_blocks
from .digests import TensorHashes, digest, model_digest, tensor_sha256, update_sha256
from .privacy import add_noise, clip, clip_scale, gaussian, l2_norm, noise_seed
from .time_model import LinkModel, modeled_round_seconds
from .transfer_precision import (
    INT8_BLOCK,
    TRANSFER_DTYPES,
    Encoded,
    EncodedTensors,
    applied_mean_step,
    decoded_chunks,
    dequantize_int8,
    encode,
    encoded_sum_of_squares,
    int8_blocks,
    kept_encoded,
    quantize_int8,
    round_for_transfer,
    round_with_feedback,
    round_with_feedback_encoded,
)

__all__ = [
    "INT8_BLOCK",
    "TRANSFER_DTYPES",
    "BlockPartition",
    "LinkModel",
    "TensorHashes",
    "PendingUpdate",
    "Tensors",
    "add_noise",
    "add_scaled",
    "aggregate",
    "apply_step",
    "added",
    "all_finite",
    "applied_mean_step",
    "apply_step_keeping",
    "block_schedule",
    "clip",
    "clip_scale",
    "correct_in_place",
    "decoded_chunks",
    "delta",
    "dequantize_int8",
    "digest",
    "find_decoder_layers",
    "gaussian",
    "global_step",
    "int8_blocks",
    "l2_norm",
    "model_digest",
    "modeled_round_seconds",
    "noise_seed",
    "one_block",
    "parablock_base",
    "partition_blocks",
    "read_chunks",
    "quantize_int8",
    "round_for_transfer",
    "round_with_feedback",
    "round_with_feedback_encoded",
    "encode",
    "encoded_sum_of_squares",
    "Encoded",
    "EncodedTensors",
    "kept_encoded",
    "snapshot",
    "sum_of_squares",
    "tensor_sha256",
    "update_sha256",
    "uncorrected_offset",
]
