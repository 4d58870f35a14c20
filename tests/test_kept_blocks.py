"""``kept_blocks``: a block-sized host buffer comes back to the pool when the last thing over its memory goes
(a tensor, a view, a numpy array), never before, and the next buffer of its size takes it."""

import gc
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from parablock_flwr import core
from parablock_flwr.kept_blocks import KEPT_FROM_BYTES, KeptBlocks

SHAPE = (KEPT_FROM_BYTES // 4 // 1024, 1024)  # fp32: just the pool's smallest size


def test_a_buffer_freed_is_the_next_of_its_size_and_not_before_every_view_of_it_goes():
    pool = KeptBlocks()
    first = pool.empty(SHAPE)
    at, view, array = first.data_ptr(), first.view(-1)[5:9], first.numpy()
    del first
    assert pool.idle_bytes() == 0  # a view and a numpy array still hold its memory
    del view, array
    assert pool.idle_bytes() == KEPT_FROM_BYTES
    again = pool.empty((SHAPE[1], SHAPE[0]), torch.float32)  # another shape of the same bytes
    assert again.data_ptr() == at and again.shape == (SHAPE[1], SHAPE[0]) and again.is_contiguous()
    assert (pool.made, pool.reused) == (1, 1) and pool.idle_bytes() == 0


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float16, torch.float32])
def test_each_dtype_is_served_with_its_bytes_and_small_buffers_are_left_to_torch(dtype):
    pool = KeptBlocks()
    numel = KEPT_FROM_BYTES // dtype.itemsize
    block = pool.empty((numel,), dtype)
    assert block.dtype == dtype and block.numel() == numel and block.untyped_storage().nbytes() == KEPT_FROM_BYTES
    small = pool.empty((numel - 1,), dtype)
    assert pool.made == 1 and small.numel() == numel - 1
    del block, small
    assert pool.idle_bytes() == KEPT_FROM_BYTES  # only the block came back


def test_a_touched_buffer_is_written_once_when_made_and_not_again_when_the_pool_kept_it():
    """``touched``: the server's round buffers, faulted in ahead of the round. A fresh one is written (zeros); one
    the pool kept is faulted in already, and writing it again would be a pass over a block for nothing: it comes
    back as it was left. Below the pool's size, torch's heap serves it, zeroed."""
    pool = KeptBlocks()
    fresh = pool.empty(SHAPE, touched=True)
    assert torch.count_nonzero(fresh) == 0
    fresh.fill_(7.0)
    at = fresh.data_ptr()
    del fresh
    again = pool.empty(SHAPE, touched=True)
    assert again.data_ptr() == at and (pool.made, pool.reused) == (1, 1)
    assert bool((again == 7.0).all())  # not written again
    small = pool.empty((3, 5), torch.bfloat16, touched=True)
    assert small.dtype == torch.bfloat16 and torch.count_nonzero(small) == 0 and pool.made == 1


def test_trim_gives_back_what_lay_unused_from_one_trim_to_the_next():
    pool = KeptBlocks()
    a, b = pool.empty(SHAPE), pool.empty(SHAPE)
    del a, b
    assert pool.trim() == 0 and pool.idle_bytes() == 2 * KEPT_FROM_BYTES  # freed this round: kept for the next
    taken = pool.empty(SHAPE)  # the next round takes one of them
    assert pool.trim() == KEPT_FROM_BYTES and pool.idle_bytes() == 0  # the other lay unused a whole round
    del taken
    assert pool.idle_bytes() == KEPT_FROM_BYTES


def test_threads_that_take_and_free_buffers_together_never_share_one():
    """Many trials: buffers taken and freed from 8 threads at once; a buffer is written with its owner's mark
    and read back whole before it goes, so two owners of one buffer would see each other's marks."""
    pool, errors = KeptBlocks(), []

    def work(mark: int) -> None:
        for _ in range(40):
            block = pool.empty((KEPT_FROM_BYTES // 4,), torch.int32)
            block.fill_(mark)
            if not bool((block == mark).all()):
                errors.append(mark)
            del block

    threads = [threading.Thread(target=work, args=(m,)) for m in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and pool.made <= 8 and pool.made + pool.reused == 320


def test_bytes_received_come_back_once_the_last_memoryview_or_array_over_them_goes():
    """The stream's downloads: a record's bytes are read through memoryviews and numpy arrays over slices."""
    pool = KeptBlocks()
    data = pool.host_bytes(KEPT_FROM_BYTES)
    data[:4] = b"abcd"
    payload = np.frombuffer(data[2:], dtype=np.uint8)
    del data
    assert bytes(payload[:2]) == b"cd" and pool.idle_bytes() == 0
    view = payload[:8].view(np.int16)  # numpy's own view of the array: it holds the memoryview still
    del payload
    assert pool.idle_bytes() == 0 and view.nbytes == 8
    del view
    assert pool.idle_bytes() == KEPT_FROM_BYTES
    assert pool.host_bytes(KEPT_FROM_BYTES - 1).nbytes == KEPT_FROM_BYTES - 1 and pool.made == 1  # small: numpy's


def test_a_size_the_pool_lacks_is_made_only_after_idle_buffers_of_its_size_go():
    """The pool adds nothing to a process's peak: a block of another size (the embeddings' block after the
    layers') first gives back idle buffers of at least its bytes, the longest idle first."""
    pool = KeptBlocks()
    a, b = pool.empty(SHAPE), pool.empty(SHAPE)
    del a, b
    assert pool.idle_bytes() == 2 * KEPT_FROM_BYTES
    larger = pool.empty((SHAPE[0] + 1, SHAPE[1]))  # a little more than one idle buffer: both go
    assert pool.idle_bytes() == 0 and pool.made == 3
    del larger
    assert pool.clear() == KEPT_FROM_BYTES + SHAPE[1] * 4 and pool.idle_bytes() == 0


def test_a_buffer_that_ends_inside_the_pools_own_locked_code_comes_back_without_a_deadlock():
    """A tensor in a reference cycle ends when a garbage collection runs, which any allocation may start, the
    pool's own under its lock among them: its give-back must not wait on that lock."""
    pool = KeptBlocks()

    class Cycle:
        def __init__(self):
            self.me, self.block = self, pool.empty(SHAPE)

    gc.disable()
    try:
        Cycle()  # unreachable, freed only by a collection
        with pool._lock:  # what a collection inside trim's or host_bytes's locked code would meet
            gc.collect()
    finally:
        gc.enable()
    assert pool.trim() == 0 and pool.idle_bytes() == KEPT_FROM_BYTES


def test_the_pool_imports_no_torch_for_the_clientapps_transport():
    """The deployed ClientApp starts without torch (client_apps/app.py); its transport receives into kept bytes."""
    code = "import sys, parablock_flwr.transport.client, parablock_flwr.client_apps.app; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_the_update_and_snapshot_in_kept_memory_are_the_bits_of_plain_fp32_arithmetic():
    """``core.delta`` subtracts a bf16 ``after`` from fp32 ``before`` into a kept buffer: the bits of
    ``after.float() - before``."""
    torch.manual_seed(0)
    before = {"w": torch.randn(SHAPE)}
    after = {"w": (before["w"] + 0.01 * torch.randn(SHAPE)).bfloat16()}
    assert torch.equal(core.delta(after, before)["w"], after["w"].float() - before["w"])
    assert torch.equal(core.snapshot(after, ["w"])["w"], after["w"].float())
