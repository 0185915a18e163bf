"""The verify pass's I/O threads share their files' windows: a thread done with its own file hashes windows from
the back of another's, each window once, and a load stays all or nothing (a bad tile a helper finds is refused by
file and key with no target changed)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from tile_only import strip_flat_digests
from hyper_parallel.core.distributed_checkpoint import _read_priming, _reader_verify, _verify_reads
from hyper_parallel.core.distributed_checkpoint._verify_share import SharedFile, WindowShare

from page_cache import evict

ms.set_device("CPU")

MIB = 1 << 20
#: With blocks of 64 KiB, "big" (2048, 1024) float32 has tiles of (64, 256): 32 slabs (windows) of 4 tiles.
BLOCK = 64 << 10


def _state(seed: int) -> dict[str, ms.Parameter]:
    rng = np.random.default_rng(seed)
    return {"big": ms.Parameter(ms.Tensor(rng.standard_normal((2048, 1024)).astype(np.float32)), name="big"),
            "bias": ms.Parameter(ms.Tensor(rng.standard_normal(512).astype(np.float32)), name="bias")}


def _bytes(state: dict[str, ms.Parameter]) -> dict[str, np.ndarray]:
    return {name: p.asnumpy().reshape(-1).view(np.uint8).copy() for name, p in state.items()}


def _save(path: Path, threads: int) -> tuple[Path, dict, dict[str, np.ndarray]]:
    """Save the state with ``threads`` writer threads (data files); its directory, storage entries by key, bytes."""
    state = _state(0)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads, checksum_block_bytes=BLOCK),
             no_dist=True)
    assert strip_flat_digests(path) == 1  # "big" is verified by its tiles, as a format 2.1 checkpoint
    entries = {e["fqn"]: e for e in json.loads((path / "metadata.json").read_text())["storage_data"]}
    assert entries["big"]["checksum"]["block_shape"] == [64, 256]
    return path, entries, _bytes(state)


@pytest.fixture(name="saved")
def _saved(tmp_path: Path) -> tuple[Path, dict, dict[str, np.ndarray]]:
    """Two data files: "big" alone in one (32 windows), "bias" in the other (one small block)."""
    saved = _save(tmp_path / "ckpt", 2)
    assert saved[1]["big"]["file"] != saved[1]["bias"]["file"]
    return saved


def _record_windows(monkeypatch, big_file: str, first_start: int) -> list[tuple[str, int]]:
    """Record (thread, window start) of every window of the big file hashed; the big file's owner waits at its
    first window until another thread hashed one of the file's windows (a helper, which takes from the back)."""
    seen: list[tuple[str, int]] = []
    helped = threading.Event()
    hash_window = _verify_reads._hash_window

    def recording(source, path, window, blocks):
        if Path(path).name != big_file:
            return hash_window(source, path, window, blocks)
        if window.start == first_start:
            assert helped.wait(timeout=60)
        seen.append((threading.current_thread().name, window.start))
        try:
            return hash_window(source, path, window, blocks)
        finally:
            if window.start != first_start:
                helped.set()

    monkeypatch.setattr(_verify_reads, "_hash_window", recording)
    return seen


def test_a_thread_done_with_its_file_hashes_the_back_of_the_other_each_window_once(saved, monkeypatch) -> None:
    path, entries, expected = saved
    big = entries["big"]
    seen = _record_windows(monkeypatch, big["file"], big["byte_offset"])
    reader = dcp.FileSystemReader(path, thread_count=2)
    target = _state(1)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert all(np.array_equal(got, expected[name]) for name, got in _bytes(target).items())
    slab = 64 * 1024 * 4
    starts = [start for _, start in seen]
    assert sorted(starts) == [big["byte_offset"] + k * slab for k in range(32)]  # every window once
    owner = next(name for name, start in seen if start == big["byte_offset"])
    helped = [start for name, start in seen if name != owner]
    assert helped and helped[0] == big["byte_offset"] + 31 * slab  # the helper started at the back
    assert max(start for name, start in seen if name == owner) < min(helped)  # owner from the front, helper back
    assert reader.bytes_verified == sum(v.nbytes for v in expected.values())


@pytest.mark.parametrize("where", ["back", "front"])
def test_bad_tile_found_with_a_helper_refused_by_file_and_key_no_target_changed(saved, monkeypatch, where) -> None:
    """A bad last tile (hashed by the helper) or first tile (by the owner, while the helper works the back)."""
    path, entries, _ = saved
    big = entries["big"]
    data_file = path / big["file"]
    raw = bytearray(data_file.read_bytes())
    raw[big["byte_offset"] + (big["length"] - 1 if where == "back" else 0)] ^= 0x40
    data_file.write_bytes(bytes(raw))
    _record_windows(monkeypatch, big["file"], big["byte_offset"])
    before_threads = {t.name for t in threading.enumerate()}
    target = _state(2)
    before = _bytes(target)
    with pytest.raises(dcp.CorruptCheckpointError) as info:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path, thread_count=2), no_dist=True)
    tile = "tile 31,3" if where == "back" else "tile 0,0"
    assert f"key 'big' ({tile} of the chunk" in str(info.value)
    assert big["file"] in str(info.value) and "no target was changed" in str(info.value)
    assert all(np.array_equal(got, before[name]) for name, got in _bytes(target).items())
    assert not {t.name for t in threading.enumerate()} - before_threads  # no verify thread left behind


def test_owner_waits_for_windows_taken_from_its_file_before_it_closes() -> None:
    """Leaving ``offered`` blocks while a helper still hashes a window of the file; then nothing more is taken."""
    share = WindowShare(1)
    shared = SharedFile(None, "f", list(range(4)), None, [4, 4, 4, 4])
    took, started, release, left = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    hashed: list[int] = []

    def slow(_shared, index, announce):
        hashed.append(index)
        assert announce is False  # the owner announced every window up to its lookahead limit
        started.set()
        assert release.wait(timeout=60)
        return 1

    def owner() -> None:
        with share.offered(shared):
            assert share.take_front(shared) == (0, 0, 4)
            took.set()
            assert started.wait(timeout=60)
        left.set()
        share.owner_done()

    helper = threading.Thread(target=lambda: share.help(slow))
    owning = threading.Thread(target=owner)
    owning.start()
    assert took.wait(timeout=60)
    helper.start()
    assert started.wait(timeout=60)
    assert not left.wait(timeout=0.2)  # the owner is held while the helper hashes window 3
    release.set()
    owning.join(timeout=60)
    helper.join(timeout=60)
    assert left.is_set() and hashed == [3] and shared.back == shared.front == 1


def test_windows_taken_from_a_file_read_without_readahead_are_announced_once(saved, monkeypatch) -> None:
    """Without readahead every hashed byte is announced (POSIX_FADV_WILLNEED) once: the owner announces the windows
    ahead that no helper took, a helper the ones it takes past them."""
    path, entries, expected = saved
    big = entries["big"]
    monkeypatch.setattr(_verify_reads, "_LOOKAHEAD_BYTES", 0)  # the owner announces only the window it hashes
    _record_windows(monkeypatch, big["file"], big["byte_offset"])
    calls: list[tuple[str, int, int]] = []
    fadvise = os.posix_fadvise

    def recording(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            calls.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length))
        return fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    target = _state(3)
    dcp.load(target, storage_reader=dcp.FileSystemReader(path, thread_count=2, no_readahead=True), no_dist=True)
    assert all(np.array_equal(got, expected[name]) for name, got in _bytes(target).items())
    announced = sorted((offset, offset + length) for name, offset, length in calls if name == big["file"])
    assert all(a[1] <= b[0] for a, b in zip(announced, announced[1:]))  # no byte announced twice
    assert sum(end - start for start, end in announced) == big["length"]  # every hashed byte
    assert announced[0][0] == big["byte_offset"] and announced[-1][1] == big["byte_offset"] + big["length"]


@pytest.fixture(name="one_file")
def _one_file(tmp_path: Path) -> tuple[Path, dict, dict[str, np.ndarray]]:
    """The same state in one data file (saved with one thread)."""
    saved = _save(tmp_path / "one", 1)
    assert saved[1]["big"]["file"] == saved[1]["bias"]["file"]
    return saved


@pytest.mark.parametrize("corrupt", [False, True])
def test_one_file_is_verified_by_every_thread_all_or_nothing(one_file, monkeypatch, corrupt) -> None:
    """A rank reading one file with two threads: the second thread hashes windows from the back (it has no file of
    its own); a bad last tile it finds is refused by file and key with no target changed."""
    path, entries, expected = one_file
    big = entries["big"]
    if corrupt:
        data_file = path / big["file"]
        raw = bytearray(data_file.read_bytes())
        raw[big["byte_offset"] + big["length"] - 1] ^= 0x40
        data_file.write_bytes(bytes(raw))
    seen = _record_windows(monkeypatch, big["file"], big["byte_offset"])
    before_threads = {t.name for t in threading.enumerate()}
    target = _state(4)
    before = _bytes(target)
    reader = dcp.FileSystemReader(path, thread_count=2)
    if corrupt:
        with pytest.raises(dcp.CorruptCheckpointError) as info:
            dcp.load(target, storage_reader=reader, no_dist=True)
        assert "key 'big' (tile 31,3 of the chunk" in str(info.value) and big["file"] in str(info.value)
        assert all(np.array_equal(got, before[name]) for name, got in _bytes(target).items())
        assert not {t.name for t in threading.enumerate()} - before_threads
        return
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert all(np.array_equal(got, expected[name]) for name, got in _bytes(target).items())
    tiles = [(name, start) for name, start in seen if start < big["byte_offset"] + big["length"]]  # not bias
    assert sorted(start for _, start in tiles) == [big["byte_offset"] + k * 64 * 1024 * 4 for k in range(32)]
    assert len({name for name, _ in tiles}) == 2  # the owner and the helper
    assert reader.bytes_verified == sum(v.nbytes for v in expected.values())


def test_a_cold_file_read_ahead_of_its_owner_is_left_to_it(saved, monkeypatch) -> None:
    """A primed cold file (read ahead by its priming thread) gets no helper: the device limits it, and a reader at
    its back would disturb the kernel's readahead of the file."""
    path, entries, expected = saved
    big = entries["big"]
    monkeypatch.setattr(_read_priming, "PRIME_MIN_BYTES", MIB)
    monkeypatch.setattr(_reader_verify, "PRIME_MIN_BYTES", MIB)
    primed = []
    prime = _read_priming.prime
    monkeypatch.setattr(_reader_verify, "prime", lambda *args: primed.append(args[1]) or prime(*args))
    seen: list[tuple[str, int]] = []
    hash_window = _verify_reads._hash_window

    def recording(source, data, window, blocks):
        if Path(data).name == big["file"]:
            seen.append((threading.current_thread().name, window.start))
        return hash_window(source, data, window, blocks)

    monkeypatch.setattr(_verify_reads, "_hash_window", recording)
    evict(path.glob("*.safetensors"))  # cold
    target = _state(5)
    dcp.load(target, storage_reader=dcp.FileSystemReader(path, thread_count=2), no_dist=True)
    assert all(np.array_equal(got, expected[name]) for name, got in _bytes(target).items())
    assert primed == [big["byte_offset"]]  # the big file was primed (the small one is under the threshold)
    assert len(seen) == 32 and len({name for name, _ in seen}) == 1  # every window by its owner
