"""``tensor_file.write_tensors``: the safetensors files a run writes every round (a node's residual, the server's step
log), read back by ``safetensors`` bit for bit, written past the page cache where the file system allows it."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from parablock_flwr import tensor_file
from parablock_flwr.tensor_file import DIRECT_ALIGNMENT, STAGING_BYTES, append_pieces, write_tensors


def assert_read_back(path, tensors, metadata=None):
    back = load_file(str(path))
    assert list(back) == list(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name], tensor), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == metadata


def test_every_dtype_and_layout_is_read_back_by_safetensors_bit_for_bit(tmp_path):
    """Views of one array (the step's int8 values), a transposed tensor, a scalar, an empty tensor, every dtype the
    format names, and a tensor longer than the staging buffer with a length off the page: all as written."""
    base = torch.randn(300, 77)
    tensors = {"view a": base[:10], "view b": base[10:20], "transposed": base.t(), "scalar": torch.tensor(2.5),
               "empty": torch.empty(0, 5), "long": torch.randn(STAGING_BYTES // 4 + 1031)}  # fmt: skip
    for dtype in tensor_file.SAFETENSORS_DTYPES:
        tensors[str(dtype)] = (torch.randn(513) * 100).to(dtype)
    write_tensors(tmp_path / "a.safetensors", tensors, {"block": "3"})
    assert_read_back(tmp_path / "a.safetensors", tensors, {"block": "3"})
    header_bytes = int.from_bytes((tmp_path / "a.safetensors").read_bytes()[:8], "little")
    assert (8 + header_bytes) % DIRECT_ALIGNMENT == 0  # the data starts on a page, where O_DIRECT writes it from
    write_tensors(tmp_path / "none.safetensors", {})
    assert_read_back(tmp_path / "none.safetensors", {})


def test_a_dtype_it_does_not_name_or_metadata_that_is_not_text_is_refused_before_any_write(tmp_path):
    """Refused when written, naming what is wrong, not when a resume reads the file (safetensors refuses metadata
    that is not text only then)."""
    with pytest.raises(ValueError, match="tensor z: dtype torch.complex64; expected one of"):
        write_tensors(tmp_path / "a.safetensors", {"ok": torch.zeros(2), "z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match=r"metadata \{'block': 3\}: expected text keys and values"):
        write_tensors(tmp_path / "a.safetensors", {"ok": torch.zeros(2)}, {"block": 3})
    assert not (tmp_path / "a.safetensors").exists()


def cached_pages(path) -> int:
    """How many of the file's pages are in the page cache (``mincore`` over a mapping that touches none)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0, os.strerror(ctypes.get_errno())
        resident = sum(v & 1 for v in vec)
        del address  # the mapping may close once nothing exports it
    return resident


def direct_io_refused(folder) -> bool:
    return not tensor_file.takes_direct_io(folder)


def test_a_file_system_in_memory_is_not_taken_for_one_past_the_page_cache():
    """tmpfs opens files with O_DIRECT from Linux 6.6, yet its files are page-cache pages: the probe the tests and
    ``benchmarks.byte_legs`` rely on says so."""
    if tensor_file.file_system("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    assert not tensor_file.takes_direct_io("/dev/shm")


def test_a_block_is_written_past_the_page_cache(tmp_path):
    """The point of the module: the kernel copies none of the bytes into its cache (the worker's residual, a block in
    fp32 every round, cost a CPU second there), where the test's file system takes O_DIRECT."""
    if direct_io_refused(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    block = {"w": torch.randn(3 * STAGING_BYTES // 4 + 99)}
    write_tensors(tmp_path / "r.safetensors", block)
    assert cached_pages(tmp_path / "r.safetensors") <= 2  # at most where the kernel reads the file's ends back
    assert_read_back(tmp_path / "r.safetensors", block)


def test_a_file_system_that_refuses_the_alignment_gets_the_bytes_through_the_page_cache(tmp_path, monkeypatch):
    """A write refused for its alignment (``EINVAL``: a disk whose logical block is over a page; a fault this machine
    cannot make, so ``pwrite`` raises it once) goes on through the page cache, and the file is whole."""
    if direct_io_refused(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    refused = []
    pwrite = os.pwrite

    def refuse_direct_once(fd, data, offset):
        if not refused and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_direct_once)
    block = {"w": torch.randn(STAGING_BYTES // 2)}
    write_tensors(tmp_path / "r.safetensors", block)
    assert refused == [0]
    assert_read_back(tmp_path / "r.safetensors", block)


def test_writers_at_once_each_write_their_own_file_whole(tmp_path):
    """Several threads write at once (a residual staged beside the server's step log in inline simulation): each
    takes a staging buffer of its own; 32 files, every one read back as written."""
    files = {i: {"w": torch.full((STAGING_BYTES // 4 + i,), float(i)), "i": torch.tensor([i])} for i in range(32)}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: write_tensors(tmp_path / f"{i}.safetensors", files[i]), files))
    for i, tensors in files.items():
        assert_read_back(tmp_path / f"{i}.safetensors", tensors)


def test_pieces_appended_each_from_a_page_are_read_back_where_it_says(tmp_path):
    """``append_pieces`` (the checkpoint's staged pending updates, one client after another): each key's parts read
    back at the offset it returned, every offset on a page, earlier entries intact, none of it in the page cache
    where the file system takes O_DIRECT."""
    path, entries = tmp_path / "updates.bin", []
    for client in range(3):
        values = [np.arange(1000 * client + 777, dtype=np.int8), np.full(STAGING_BYTES + 5, client, dtype=np.int8)]
        pieces = {"layout": [np.frombuffer(b"x" * (client + 1), dtype=np.uint8)], "values": values,
                  "scales": [np.full(33, client + 0.5, dtype=np.float32)]}  # fmt: skip
        entries.append((pieces, append_pieces(path, pieces)))
    if not direct_io_refused(tmp_path):  # before anything reads it back
        assert cached_pages(path) <= 2
    for pieces, offsets in entries:
        assert all(offset % DIRECT_ALIGNMENT == 0 for offset in offsets.values()), offsets
        for key, parts in pieces.items():
            joined = np.concatenate(parts)
            back = np.fromfile(path, dtype=joined.dtype, count=joined.size, offset=offsets[key])
            assert np.array_equal(back, joined), key
