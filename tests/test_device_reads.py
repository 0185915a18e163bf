"""Resharded loads read from the device about the bytes they need (``/proc/self/io`` read_bytes)."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint._device_reads import _ranges, page_amplification
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import DATA_ALIGNMENT
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import read_header
from device_io import device_counts, drop_cache, fewest_device_bytes, read_bytes


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
    if not device_counts(tmp_path):
        pytest.skip("the filesystem of tmp_path does not count device reads (tmpfs)")
    layout = Layout((2,), (-1, 0))
    for rank in range(2):
        targets = {name: DTensor(ms.Tensor(np.zeros((1024, values.shape[1] // 2), values.dtype)), layout,
                                 values.shape, rank=rank) for name, values in full.items()}
        needed = sum(values.nbytes // 2 for values in full.values())
        fetched = fewest_device_bytes(tmp_path, lambda t=targets: dcp.load(
            t, storage_reader=dcp.FileSystemReader(tmp_path, verify_checksums=verify), no_dist=True))
        for name, values in full.items():
            half = values.shape[1] // 2
            assert np.array_equal(targets[name].to_local().asnumpy(), values[:, rank * half:(rank + 1) * half])
        # The metadata file is read too: a few KiB on top of 6 MiB.
        assert fetched <= 1.05 * needed, (rank, verify, fetched / needed)


def test_readahead_kept_on_request_reads_much_more(tmp_path):
    """The measurement can fail: with readahead (``no_readahead=False``) the same kind of load reads 2x or more."""
    values = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)
    dcp.save({"w": ms.Tensor(values), "v": ms.Tensor(values)}, checkpoint_id=tmp_path, no_dist=True)
    if not device_counts(tmp_path):
        pytest.skip("the filesystem of tmp_path does not count device reads (tmpfs)")
    target = DTensor(ms.Tensor(np.zeros((1024, 512), np.float32)), Layout((2,), (-1, 0)), values.shape, rank=0)
    drop_cache(tmp_path)
    before = read_bytes()
    dcp.load({"w": target}, storage_reader=dcp.FileSystemReader(tmp_path, no_readahead=False), no_dist=True)
    assert read_bytes() - before >= 2 * values.nbytes // 2
    assert np.array_equal(target.to_local().asnumpy(), values[:, :512])


def test_chunks_of_whole_pages_start_on_pages(tmp_path):
    """Chunks whose size is a multiple of 4096 come first in a file, so each starts on a page."""
    state = {
        "odd_a": ms.Tensor(np.ones((3, 5), np.float32)),  # 60 bytes
        "pages_a": ms.Tensor(np.ones((2, 1024), np.float32)),  # 8 KiB
        "odd_b": ms.Tensor(np.ones((5000,), np.float16)),  # 10,000 bytes: larger than pages_a
        "pages_b": ms.Tensor(np.ones((1024,), np.float32)),  # 4 KiB
        "pages_c": ms.Tensor(np.ones((3, 4096), np.float16)),  # 24 KiB
    }
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=1))
    entries, data_start = read_header(next(tmp_path.glob("*.safetensors")))
    starts = {name.split("#")[0]: data_start + entry["data_offsets"][0] for name, entry in entries.items()}
    for name in ("pages_a", "pages_b", "pages_c"):
        assert starts[name] % DATA_ALIGNMENT == 0, (name, starts[name])
    assert max(starts[n] for n in ("pages_a", "pages_b", "pages_c")) < min(starts["odd_a"], starts["odd_b"])
    loaded = {name: ms.Tensor(np.zeros(value.shape, value.asnumpy().dtype)) for name, value in state.items()}
    dcp.load(loaded, checkpoint_id=tmp_path, no_dist=True)
    for name, value in state.items():
        assert np.array_equal(loaded[name].asnumpy(), value.asnumpy()), name


def test_private_budget_goes_to_the_narrowest_regions_first(tmp_path):
    """With room for one of two narrow regions, the one the page cache would read most wastefully is kept.

    ``a``: rows of 2 KiB, halves of 1 KiB (through the page cache 2.0x); ``b``: rows of 12 KiB, halves of
    6 KiB (1.33x). Kept, ``a`` is read once with exact reads; ``b`` goes through the page cache.
    """
    full = {"b": (np.arange(342 * 3072) % 2039).reshape(342, 3072).astype(np.float32),
            "a": (np.arange(2048 * 1024) % 2039).reshape(2048, 1024).astype(np.float16)}
    dcp.save({name: ms.Tensor(values) for name, values in full.items()}, checkpoint_id=tmp_path, no_dist=True)
    if not device_counts(tmp_path):
        pytest.skip("the filesystem of tmp_path does not count device reads (tmpfs)")
    needed = {name: values.nbytes // 2 for name, values in full.items()}
    targets = {name: DTensor(ms.Tensor(np.zeros((values.shape[0], values.shape[1] // 2), values.dtype)),
                             Layout((2,), (-1, 0)), values.shape, rank=0) for name, values in full.items()}
    # Room for either region (b's is the larger, its chunk and its item come first), not for both.
    assert needed["b"] > needed["a"]
    fetched = fewest_device_bytes(tmp_path, lambda: dcp.load(
        targets, storage_reader=dcp.FileSystemReader(tmp_path, thread_count=1, max_inflight_bytes=needed["b"] + 4096),
        no_dist=True))
    for name, values in full.items():
        half = values.shape[1] // 2
        assert np.array_equal(targets[name].to_local().asnumpy(), values[:, :half])
    kept_a = needed["a"] + needed["b"] * 4 / 3  # the choice made
    kept_b = needed["a"] * 2 + needed["b"]  # the other choice
    assert fetched <= kept_a * 1.02 + (64 << 10), (fetched, kept_a, kept_b)
    assert kept_a * 1.02 + (64 << 10) < kept_b
