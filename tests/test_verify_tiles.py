"""Tile slabs read straight into tile order (scattered) and gathered from a whole slab: same verdicts, bad tiles
named, loads all or nothing."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from tile_only import strip_flat_digests
from hyper_parallel.core.distributed_checkpoint import _run_reads, _verify_tiles
from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource
from hyper_parallel.core.distributed_checkpoint import _verify_reads
from hyper_parallel.core.distributed_checkpoint._verify_tiles import (
    bad_tile,
    bad_tile_scattered,
    scatter_pieces,
    scatters,
    tile_problem,
)
from hyper_parallel.core.distributed_checkpoint._verify_windows import RegionCheck, Window, tile_windows

ms.set_device("CPU")

BLOCK = 15 * 1024
#: With blocks of 15 KiB: (300, 3, 1024) float32 has tiles of (5, 3, 256), 60 slabs of 4 tiles (rows of
#: 12 KiB); (48, 2048) bfloat16 has tiles of (15, 512), 4 slabs (the last of 3 rows) of 4 tiles (rows of 4 KiB).
SHAPES = {"cube": ((300, 3, 1024), ms.float32), "wide": ((48, 2048), ms.bfloat16)}


def _state(seed: int) -> dict[str, ms.Parameter]:
    rng = np.random.default_rng(seed)
    state = {name: ms.Parameter(ms.Tensor(rng.standard_normal(shape).astype(np.float32), dtype), name=name)
             for name, (shape, dtype) in SHAPES.items()}
    state["bias"] = ms.Parameter(ms.Tensor(rng.standard_normal(512).astype(np.float32)), name="bias")
    return state


def _bytes(state: dict[str, ms.Parameter]) -> dict[str, np.ndarray]:
    return {name: p.asnumpy().reshape(-1).view(np.uint8).copy() for name, p in state.items()}


@pytest.fixture(name="saved")
def _saved(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    state = _state(0)
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=1, checksum_block_bytes=BLOCK),
             no_dist=True)
    assert strip_flat_digests(path) == 2  # whole loads verify the tiles, as of a format 2.1 checkpoint
    return path, _bytes(state)


def _check(path: Path, key: str, offsets=None, lengths=None) -> tuple[Path, RegionCheck]:
    """The data file of ``key`` and a region check of it (the whole chunk by default), from the real metadata."""
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == key)
    sizes = tuple(metadata.state_dict_metadata[key].size)
    itemsize = 4 if SHAPES[key][1] == ms.float32 else 2
    check = RegionCheck(key, info, sizes, itemsize, offsets=offsets or (0,) * len(sizes),
                        lengths=lengths or sizes)
    assert index.fqn == key and info.checksum.block_shape == {"cube": (5, 3, 256), "wide": (15, 512)}[key]
    return path / info.relative_path, check


def _verdicts(data_file: Path, check: RegionCheck) -> tuple[list, list]:
    """Per window: the first bad column found reading the slab into tile order, and gathering from it whole."""
    windows = tile_windows(check, set())
    fd = os.open(data_file, os.O_RDONLY)
    try:
        scattered = []
        for window in windows:
            done, column = bad_tile_scattered(fd, window)
            assert done
            scattered.append(column)
        whole = []
        for window in windows:
            buffer = np.empty(window.end - window.start, dtype=np.uint8)
            assert FileSource(fd).readinto(buffer, window.start) == buffer.size
            whole.append(bad_tile(memoryview(buffer), window.slab))
    finally:
        os.close(fd)
    return scattered, whole


def test_scatter_pieces_put_each_row_piece_at_its_place_in_its_tile() -> None:
    # 3 rows of tiles 4, 4 and 2 bytes wide: tile 0 from 1000 (12 bytes), tile 1 from 1012, tile 2 from 1024
    pieces = scatter_pieces(1000, 3, (4, 4, 2))
    assert pieces.dtype == np.uint64 and pieces.shape == (9, 2)
    assert pieces[:, 0].tolist() == [1000, 1012, 1024, 1004, 1016, 1026, 1008, 1020, 1028]
    assert pieces[:, 1].tolist() == [4, 4, 2] * 3


# the C library's preadv takes up to IOV_MAX pieces: also in lists of 7 pieces (splitting rows)
@pytest.mark.parametrize("iov_max", [None, 7])
def test_scattered_slabs_find_every_bad_tile_the_whole_slab_finds(saved, monkeypatch, iov_max) -> None:
    if iov_max:
        monkeypatch.setattr(_verify_tiles, "_iov_max", lambda: iov_max)
    path, _ = saved
    data_file, check = _check(path, "cube")
    raw = bytearray(data_file.read_bytes())
    windows = tile_windows(check, set())
    assert len(windows) == 60 and all(w.whole and w.slab.columns == (0, 1, 2, 3) for w in windows)
    assert _verdicts(data_file, check) == ([None] * 60, [None] * 60)
    # one flipped byte in tile (slab 7, column 2), in its last row and middle plane; one in (41, 0), first byte;
    # one in the last tile (59, 3), last byte
    row_bytes = 3 * 1024 * 4
    for slab, column, row, plane, byte in ((7, 2, 4, 1, 3), (41, 0, 0, 0, 0), (59, 3, 4, 2, 1023)):
        raw[check.info.offset + (slab * 5 + row) * row_bytes + plane * 4096 + column * 1024 + byte] ^= 0x10
    data_file.write_bytes(bytes(raw))
    expected = [None] * 60
    expected[7], expected[41], expected[59] = 2, 0, 3
    assert _verdicts(data_file, check) == (expected, expected)
    assert tile_problem(windows[7].slab, 2) == f"key 'cube' (tile 7,2 of the chunk at byte {check.info.offset})"
    assert tile_problem(windows[7].slab, None) is None


def test_piece_lists_are_kept_per_slab_shape(saved) -> None:
    path, _ = saved
    data_file, check = _check(path, "wide")  # 3 slabs of 15 rows, then one of 3: two shapes
    fd = os.open(data_file, os.O_RDONLY)
    try:
        for window in tile_windows(check, set()):
            assert bad_tile_scattered(fd, window) == (True, None)
    finally:
        os.close(fd)
    kept = _verify_tiles._LOCAL.pieces
    shapes = sorted((pieces, widths) for _, pieces, widths in kept)
    assert ((3, (1024,) * 4) in shapes) and ((15, (1024,) * 4) in shapes)


def test_only_whole_slabs_of_every_column_from_a_file_are_scattered(saved) -> None:
    path, _ = saved
    data_file, every = _check(path, "wide")
    _, some = _check(path, "wide", offsets=(0, 1024), lengths=(48, 1024))  # columns 2 and 3 of 4
    fd = os.open(data_file, os.O_RDONLY)
    try:
        window = tile_windows(every, set())[0]
        assert scatters(FileSource(fd), window)
        assert [w.slab.columns for w in tile_windows(some, set())] == [(2, 3)] * 4
        assert not scatters(FileSource(fd), tile_windows(some, set())[0])
        sparse = Window(start=window.start, end=window.end, ranges=((window.start, window.start + 8),),
                        slab=window.slab)
        assert not scatters(FileSource(fd), sparse)
        assert not scatters(object(), window)  # a source without a file descriptor (object storage)
    finally:
        os.close(fd)


def test_a_short_read_leaves_the_slab_to_the_whole_read_which_reports_truncation(saved) -> None:
    path, _ = saved
    data_file, check = _check(path, "cube")
    last = tile_windows(check, set())[-1]
    os.truncate(data_file, last.end - 100)
    fd = os.open(data_file, os.O_RDONLY)
    try:
        assert bad_tile_scattered(fd, last) == (False, None)
        with pytest.raises(dcp.CorruptCheckpointError, match="is truncated"):
            _verify_reads.verify_regions(FileSource(fd), data_file, [check], 8 << 20)
    finally:
        os.close(fd)


@pytest.mark.parametrize("key, preadv", [("cube", True), ("wide", True), ("cube", False)])
def test_load_refuses_a_bad_tile_by_name_and_changes_no_target(saved, monkeypatch, key: str, preadv: bool) -> None:
    path, expected = saved
    calls = []
    scattered = _verify_reads.bad_tile_scattered
    monkeypatch.setattr(_verify_reads, "bad_tile_scattered", lambda fd, window: calls.append(window) or scattered(fd, window))
    if not preadv:  # a C library without preadv: every slab is read whole and gathered
        monkeypatch.setattr(_verify_tiles, "_LIBC", [None])
    target = _state(3)
    dcp.load(target, storage_reader=dcp.FileSystemReader(path, thread_count=2), no_dist=True)
    assert all(np.array_equal(got, expected[name]) for name, got in _bytes(target).items())
    assert len(calls) == 64  # every slab of both matrices went the scattered way
    entry = next(e for e in json.loads((path / "metadata.json").read_text())["storage_data"] if e["fqn"] == key)
    data_file = path / entry["file"]
    raw = bytearray(data_file.read_bytes())
    raw[entry["byte_offset"] + entry["length"] - 1] ^= 0x40  # last byte: the last tile of the last slab
    data_file.write_bytes(bytes(raw))
    target = _state(4)
    before = _bytes(target)
    with pytest.raises(dcp.CorruptCheckpointError) as info:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path, thread_count=2), no_dist=True)
    slabs, columns = (60, 4) if key == "cube" else (4, 4)
    assert f"key '{key}' (tile {slabs - 1},{columns - 1} of the chunk" in str(info.value)
    assert data_file.name in str(info.value) and "no target was changed" in str(info.value)
    assert all(np.array_equal(got, before[name]) for name, got in _bytes(target).items())


def test_piece_lists_are_c_iovec_arrays() -> None:
    """Each row of a piece list reads as a C ``struct iovec`` (pointer, size_t): pointer-sized fields."""

    class IoVec(ctypes.Structure):
        _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]

    pieces = scatter_pieces(1 << 20, 5, (8, 6))
    assert pieces.dtype.itemsize == ctypes.sizeof(ctypes.c_void_p) and pieces.strides[0] == ctypes.sizeof(IoVec)
    vectors = (IoVec * len(pieces)).from_buffer(pieces)
    assert [(v.iov_base, v.iov_len) for v in vectors] == [tuple(row) for row in pieces.tolist()]


@pytest.mark.parametrize("key", ["cube", "wide"])  # 3-D float32; bf16 with a short last slab (3 of 15 rows)
def test_scattered_reads_stay_inside_the_window_of_a_larger_kept_buffer(saved, key) -> None:
    """The slab is read into the first bytes of a kept scratch buffer larger than the window (a piece list kept
    for that address is reused): no byte past the window changes, and the tiles read are the file's."""
    path, _ = saved
    data_file, check = _check(path, key)
    windows = tile_windows(check, set())
    guard = 1 << 16
    buffer = np.full(max(w.end - w.start for w in windows) + guard, 0xA5, np.uint8)
    _run_reads.SCRATCH.buffers = {2: buffer}
    raw = np.frombuffer(data_file.read_bytes(), np.uint8)
    fd = os.open(data_file, os.O_RDONLY)
    try:
        for _ in range(2):  # the second time round reuses the kept piece lists
            for window in windows:
                size = window.end - window.start
                buffer[:] = 0xA5
                assert bad_tile_scattered(fd, window) == (True, None)
                assert (buffer[size:] == 0xA5).all(), window
                slab = window.slab
                rows = raw[window.start : window.end].reshape(-1, check.sizes[-1] * check.itemsize)
                expected = np.concatenate([rows[:, lo:hi].reshape(-1) for lo, hi in (
                    _verify_tiles._column_bytes(slab, column) for column in slab.columns)])
                assert np.array_equal(buffer[:size], expected)
    finally:
        os.close(fd)
        _run_reads.release_scratch()


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as handle:
        for line in handle:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_verify_scratch_of_a_huge_page_or_more_is_a_huge_page_mapping_within_its_size() -> None:
    """The verify pass's scratch (slabs of tiles scattered into it) is advised for transparent huge pages: fewer
    page faults and TLB misses for the kernel's scatter read. Smaller requests and other slots stay plain."""
    try:
        small = _run_reads.scratch(_run_reads.HUGE_PAGE_BYTES - 1, slot=2, huge=True)
        assert isinstance(small.base, np.ndarray) and small.base.base is None  # plain memory below a huge page
        buffer = _run_reads.scratch(8 << 20, slot=2, huge=True)
        assert buffer.size == 8 << 20 and buffer.ctypes.data != small.ctypes.data  # grown: a fresh buffer
        mapped = buffer
        while isinstance(mapped, np.ndarray):
            mapped = mapped.base
        mapped = mapped.obj if isinstance(mapped, memoryview) else mapped
        assert isinstance(mapped, mmap.mmap) and len(mapped) == 8 << 20  # never more memory than asked for
        buffer[:] = np.arange(buffer.size, dtype=np.uint64).view(np.uint8)[: buffer.size]
        assert int(buffer[8]) == 1 and int(buffer[-8]) == (buffer.size // 8 - 1) & 0xFF
        assert _run_reads.scratch(5 << 20, slot=2, huge=True).ctypes.data == buffer.ctypes.data  # kept, reused
        assert _run_reads.scratch(4 << 20, slot=3).base.base is None  # another slot without huge: plain
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as handle:
                offered = "[never]" not in handle.read()
        except OSError:
            offered = False
        if offered:  # the kernel backs the touched buffer with huge pages
            assert _anon_huge_kib(buffer.ctypes.data) >= 2048
    finally:
        _run_reads.release_scratch()
