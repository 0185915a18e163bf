"""The verify pass: windows hashed in file order, announced ahead, mapped pages hashed in place."""

from __future__ import annotations

import json
import os
import threading

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from tile_only import strip_flat_digests
import xxhash

from hyper_parallel.core.distributed_checkpoint._verify_reads import _bad_block_read, announces, lookahead_limits
from hyper_parallel.core.distributed_checkpoint._verify_windows import Blocks, flat_windows
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError

ms.set_device("CPU")

MIB = 1 << 20


@pytest.mark.parametrize(
    "sizes, lookahead, expected",
    [
        ([], 10, []),
        ([4], 10, [1]),
        ([4, 4, 4, 4, 4], 0, [1, 2, 3, 4, 5]),  # no lookahead: each window when it is hashed
        ([4, 4, 4, 4, 4], 8, [3, 4, 5, 5, 5]),  # two windows of 4 bytes ahead
        ([4, 4, 4, 4, 4], 5, [3, 4, 5, 5, 5]),  # a window starting within the lookahead is announced whole
        ([100, 1, 1, 1], 2, [3, 4, 4, 4]),
    ],
)
def test_lookahead_limits(sizes, lookahead, expected):
    assert lookahead_limits(sizes, lookahead) == expected


def test_lookahead_limits_announce_each_window_once_and_in_time():
    rng = np.random.default_rng(3)
    sizes = [int(s) for s in rng.integers(1, 9 * MIB, size=200)]
    limits = lookahead_limits(sizes, 32 * MIB)
    ends = np.cumsum(sizes)
    assert all(a <= b for a, b in zip(limits, limits[1:]))  # non-decreasing: nothing announced twice
    for position, limit in enumerate(limits):
        assert limit > position  # the window being hashed was announced
        ahead = ends[limit - 1] - ends[position]
        last = sizes[limit - 1] if limit - 1 > position else 0
        assert ahead - last < 32 * MIB  # at most the lookahead, plus the window that crosses it
        if limit < len(sizes):
            assert ahead >= 32 * MIB or limit == len(sizes)


def _state(seed):
    rng = np.random.default_rng(seed)
    state = {
        # 24 MiB of tiled float32: 8 column tiles per slab, 12 slabs (several windows, lookahead spans some)
        "big": ms.Parameter(ms.Tensor(rng.random((1536, 4096), dtype=np.float32)), name="big"),
        # a wide bf16 matrix and a long vector of flat blocks
        "wide": ms.Parameter(ms.Tensor(rng.random((64, 8192), dtype=np.float32), ms.bfloat16), name="wide"),
        "vec": ms.Parameter(ms.Tensor(rng.random((3 * MIB,), dtype=np.float32)), name="vec"),
    }
    for i in range(40):
        state[f"small{i}"] = ms.Parameter(ms.Tensor(rng.random((257,), dtype=np.float32)), name=f"small{i}")
    return state


def _values(state):
    return {name: p.asnumpy().view(np.uint8).copy() for name, p in state.items()}


def _data_file_with(path, key):
    meta = json.loads((path / "metadata.json").read_text())
    entry = next(e for e in meta["storage_data"] if e["fqn"] == key)
    return path / entry["file"], entry


def test_multi_window_load_is_bit_exact_and_hashes_each_byte_once(tmp_path):
    saved = _state(0)
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt", thread_count=2), no_dist=True)
    target = _state(1)
    reader = dcp.FileSystemReader(tmp_path / "ckpt", thread_count=2)
    dcp.load(target, storage_reader=reader, no_dist=True)
    expected = _values(saved)
    for name, values in _values(target).items():
        assert np.array_equal(values, expected[name]), name
    assert reader.bytes_verified == sum(v.nbytes for v in expected.values())


@pytest.mark.parametrize("key, where", [("big", 0.99), ("vec", 0.5), ("wide", 0.9), ("small39", 0.5)])
def test_damage_in_a_later_window_leaves_every_target_unchanged(tmp_path, key, where):
    saved = _state(0)
    path = tmp_path / "ckpt"
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(path, thread_count=1), no_dist=True)
    data_file, entry = _data_file_with(path, key)
    position = entry["byte_offset"] + int(entry["length"] * where)
    raw = bytearray(data_file.read_bytes())
    raw[position] ^= 0x20
    data_file.write_bytes(bytes(raw))
    target = _state(2)
    before = _values(target)
    with pytest.raises(dcp.CorruptCheckpointError) as info:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path, thread_count=2), no_dist=True)
    assert f"key '{key}'" in str(info.value) and data_file.name in str(info.value)
    assert "no target was changed" in str(info.value)
    for name, values in _values(target).items():
        assert np.array_equal(values, before[name]), name
    # with verification off the same bytes load (the damage is only in the data, not the header)
    dcp.load(target, storage_reader=dcp.FileSystemReader(path, verify_checksums=False), no_dist=True)
    assert not np.array_equal(_values(target)[key], _values(saved)[key])


def test_announce_policy_leaves_whole_windows_to_kernel_readahead():
    # POSIX_FADV_WILLNEED fills the page cache with single pages (slow to read and to copy out of); the
    # kernel's own readahead uses large folios, so a window read whole from a readahead file is left to it
    assert not announces(whole=True, readahead=True)
    assert announces(whole=False, readahead=True)  # sparse: mapped without read-around
    assert announces(whole=True, readahead=False)  # a file read without readahead fetches nothing ahead
    assert announces(whole=False, readahead=False)


def _blocks(*spans):
    return Blocks(starts=np.array([s for s, _ in spans], dtype=np.int64),
                  ends=np.array([e for _, e in spans], dtype=np.int64), digests=[""] * len(spans), keys=[""] * len(spans))


def test_window_read_piece_by_piece_checks_every_block_against_its_own_bytes(tmp_path):
    # a window read whole: small blocks sharing 1 MiB pieces (one read and one hash loop each), a block
    # crossing a piece edge, whole 1 MiB blocks (a piece each); each digest is compared with xxh3 of the
    # block's own bytes, and a damaged byte is found in the block that holds it
    data = np.random.default_rng(5).integers(0, 256, size=6 * MIB, dtype=np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    spans = [(0, MIB)] + [(MIB + 4096 * k, MIB + 4096 * (k + 1)) for k in range(200)]
    spans += [(MIB + 200 * 4096, 2 * MIB + 5000), (2 * MIB + 5000, 3 * MIB), (3 * MIB, 4 * MIB),
              (4 * MIB, 5 * MIB + 512)]
    digests = [xxhash.xxh3_64_hexdigest(data[low:high].tobytes()) for low, high in spans]
    blocks = Blocks(starts=np.array([low for low, _ in spans], dtype=np.int64),
                    ends=np.array([high for _, high in spans], dtype=np.int64), digests=digests,
                    keys=[f"k{i}" for i in range(len(spans))])
    (window,) = flat_windows(blocks, 8 * MIB)
    assert window.whole and (window.first, window.stop) == (0, len(spans))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _bad_block_read(fd, path, window, blocks) is None
        for bad in (0, 8, 200, 201, 202, 204):  # whole blocks, small ones, the edge-crossing one
            damaged = data.copy()
            damaged[spans[bad][1] - 1] ^= 1
            path.write_bytes(damaged.tobytes())
            assert _bad_block_read(fd, path, window, blocks) == bad
        os.truncate(path, 5 * MIB)  # the last block ends past the file's end
        with pytest.raises(CorruptCheckpointError, match=r"data\.bin is truncated"):
            _bad_block_read(fd, path, window, blocks)
    finally:
        os.close(fd)


def test_flat_windows_span_small_gaps_but_not_a_window_hashed_apart():
    blocks = _blocks((0, 4 * MIB), (5 * MIB, 5 * MIB + 100), (5 * MIB + 200, 5 * MIB + 300))
    # gaps under 1 MiB are read along: one window, sparse (its hashed ranges are the blocks)
    (window,) = flat_windows(blocks, 8 * MIB)
    assert (window.start, window.end) == (0, 5 * MIB + 300)
    assert window.ranges == ((0, 4 * MIB), (5 * MIB, 5 * MIB + 100), (5 * MIB + 200, 5 * MIB + 300))
    # a tile slab hashed in its own window starts in the first gap: the flat windows stop there, and the
    # one before it is read whole (one range: left to kernel readahead, not mapped)
    first, second = flat_windows(blocks, 8 * MIB, [4 * MIB])
    assert first.ranges == ((0, 4 * MIB),) and (first.start, first.end) == (0, 4 * MIB)
    assert (second.start, second.end) == (5 * MIB, 5 * MIB + 300) and len(second.ranges) == 2
    # a window elsewhere does not split; the size bound still does
    assert len(flat_windows(blocks, 8 * MIB, [6 * MIB])) == 1
    assert [(w.start, w.end) for w in flat_windows(blocks, 4 * MIB)] == [(0, 4 * MIB), (5 * MIB, 5 * MIB + 300)]


def _willneed_in_verify_pass(monkeypatch, *, any_thread=False):
    """Record (file, offset, length) of every POSIX_FADV_WILLNEED the verify threads (``any_thread``: all threads)
    issue; the call goes through."""
    calls = []
    real = os.posix_fadvise

    def recording(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED and (any_thread or "verify" in threading.current_thread().name):
            calls.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    return calls


def _stored_bytes(path, keys):
    """(file name, start, end) of each key's stored bytes."""
    meta = json.loads((path / "metadata.json").read_text())
    return {e["fqn"]: (e["file"], e["byte_offset"], e["byte_offset"] + e["length"])
            for e in meta["storage_data"] if e["fqn"] in keys}


def test_whole_file_load_announces_nothing_and_is_bit_exact(tmp_path, monkeypatch):
    saved = _state(0)
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt", thread_count=2), no_dist=True)
    calls = _willneed_in_verify_pass(monkeypatch, any_thread=True)
    target = _state(1)
    reader = dcp.FileSystemReader(tmp_path / "ckpt", thread_count=2, no_readahead=False)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert calls == []  # every window is read whole: the kernel's readahead fetches ahead (nor does the read pass)
    expected = _values(saved)
    for name, values in _values(target).items():
        assert np.array_equal(values, expected[name]), name
    assert reader.bytes_verified == sum(v.nbytes for v in expected.values())


def test_without_readahead_every_hashed_byte_is_announced_once(tmp_path, monkeypatch):
    saved = _state(0)
    path = tmp_path / "ckpt"
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(path, thread_count=2), no_dist=True)
    calls = _willneed_in_verify_pass(monkeypatch)
    target = _state(1)
    reader = dcp.FileSystemReader(path, thread_count=2, no_readahead=True)
    dcp.load(target, storage_reader=reader, no_dist=True)
    expected = _values(saved)
    for name, values in _values(target).items():
        assert np.array_equal(values, expected[name]), name
    stored = _stored_bytes(path, set(saved))
    for name in {file for file, _, _ in stored.values()}:
        announced = sorted((offset, offset + length) for file, offset, length in calls if file == name)
        assert all(a[1] <= b[0] for a, b in zip(announced, announced[1:]))  # no byte announced twice
        keys = sorted((start, end) for file, start, end in stored.values() if file == name)
        assert sum(e - s for s, e in announced) == sum(e - s for s, e in keys)  # exactly the bytes hashed
        assert announced[0][0] == keys[0][0] and announced[-1][1] == keys[-1][1]


def test_sparse_window_of_a_readahead_file_announces_only_loaded_bytes(tmp_path, monkeypatch):
    saved = _state(0)
    path = tmp_path / "ckpt"
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(path, thread_count=2), no_dist=True)
    strip_flat_digests(path)  # "big" and "wide" in tile windows of their own, read whole (format 2.1)
    skipped = {f"small{i}" for i in range(1, 40, 2)}
    calls = _willneed_in_verify_pass(monkeypatch)
    target = _state(1)
    wanted = {name: p for name, p in target.items() if name not in skipped}
    before = _values(target)
    dcp.load(wanted, storage_reader=dcp.FileSystemReader(path, thread_count=2, no_readahead=False), no_dist=True)
    expected, loaded = _values(saved), _values(target)
    for name in target:
        assert np.array_equal(loaded[name], before[name] if name in skipped else expected[name]), name
    # the small keys left out make their window sparse (mapped without read-around): announced, but only
    # the loaded keys' bytes; windows read whole ("big", "wide") are left to the kernel's readahead
    stored = _stored_bytes(path, set(saved))
    assert calls
    for file, offset, length in calls:
        inside = [k for k, (f, s, e) in stored.items() if f == file and s < offset + length and offset < e]
        assert inside and not set(inside) & (skipped | {"big", "wide"}), inside
