"""Resharded loads read from the device about the bytes they need (``/proc/self/io`` read_bytes)."""

from __future__ import annotations

import os

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint._device_reads import _ranges, page_amplification
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import DATA_ALIGNMENT
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import read_header


def _read_bytes() -> int:
    with open("/proc/self/io", encoding="ascii") as handle:
        return int(dict(line.split(": ") for line in handle.read().splitlines())["read_bytes"])


def _drop_cache(directory) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _device_counts(directory) -> bool:
    """Whether a cold read of this directory's files shows in read_bytes (not on tmpfs)."""
    path = next(directory.glob("*.safetensors"))
    _drop_cache(directory)
    before = _read_bytes()
    path.read_bytes()
    return _read_bytes() - before >= path.stat().st_size // 2


def test_merged_ranges_and_page_amplification_by_hand():
    lo, hi = _ranges(np.array([0, 5, 20, 30]), np.array([10, 12, 30, 40]))
    assert lo.tolist() == [0, 20] and hi.tolist() == [12, 40]
    # Runs of 8 KiB every 16 KiB from a page boundary: exactly their pages.
    assert page_amplification(np.arange(0, 1 << 20, 16384), 8192) == 1.0
    # Shifted by 100 bytes: each run touches 3 pages for 2 pages of bytes.
    assert page_amplification(np.arange(100, 1 << 20, 16384), 8192) == 1.5
    # 2 KiB halves of 4 KiB rows: one page per 2 KiB.
    assert page_amplification(np.arange(0, 1 << 20, 4096), 2048) == 2.0


def test_data_region_starts_on_a_page(tmp_path):
    dcp.save({"a": ms.Tensor(np.ones((3, 5), np.float32))}, checkpoint_id=tmp_path, no_dist=True)
    _, data_start = read_header(next(tmp_path.glob("*.safetensors")))
    assert data_start % DATA_ALIGNMENT == 0


#: (columns, dtype): rows of 16 KiB (halves of whole pages), 4 KiB and 2 KiB (halves narrower than a page).
SHAPES = [(4096, np.float32), (1024, np.float32), (1024, np.float16)]


@pytest.mark.parametrize("verify", [True, False])
def test_column_shard_of_row_major_chunks_reads_about_the_needed_bytes(tmp_path, verify):
    full = {f"w{cols}_{np.dtype(dtype).name}": (np.arange(1024 * cols, dtype=np.float32) % 2039).reshape(1024, cols)
            .astype(dtype) for cols, dtype in SHAPES}
    dcp.save({name: ms.Tensor(values) for name, values in full.items()}, checkpoint_id=tmp_path, no_dist=True)
    if not _device_counts(tmp_path):
        pytest.skip("the filesystem of tmp_path does not count device reads (tmpfs)")
    layout = Layout((2,), (-1, 0))
    for rank in range(2):
        targets = {name: DTensor(ms.Tensor(np.zeros((1024, values.shape[1] // 2), values.dtype)), layout,
                                 values.shape, rank=rank) for name, values in full.items()}
        needed = sum(values.nbytes // 2 for values in full.values())
        _drop_cache(tmp_path)
        before = _read_bytes()
        dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path, verify_checksums=verify), no_dist=True)
        fetched = _read_bytes() - before
        for name, values in full.items():
            half = values.shape[1] // 2
            assert np.array_equal(targets[name].to_local().asnumpy(), values[:, rank * half:(rank + 1) * half])
        # The metadata file is read too: a few KiB on top of 6 MiB.
        assert fetched <= 1.05 * needed, (rank, verify, fetched / needed)


def test_readahead_kept_on_request_reads_much_more(tmp_path):
    """The measurement can fail: with readahead (``no_readahead=False``) the same kind of load reads 2x or more."""
    values = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)
    dcp.save({"w": ms.Tensor(values), "v": ms.Tensor(values)}, checkpoint_id=tmp_path, no_dist=True)
    if not _device_counts(tmp_path):
        pytest.skip("the filesystem of tmp_path does not count device reads (tmpfs)")
    target = DTensor(ms.Tensor(np.zeros((1024, 512), np.float32)), Layout((2,), (-1, 0)), values.shape, rank=0)
    _drop_cache(tmp_path)
    before = _read_bytes()
    dcp.load({"w": target}, storage_reader=dcp.FileSystemReader(tmp_path, no_readahead=False), no_dist=True)
    assert _read_bytes() - before >= 2 * values.nbytes // 2
    assert np.array_equal(target.to_local().asnumpy(), values[:, :512])
