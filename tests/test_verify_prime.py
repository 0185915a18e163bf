"""Priming a cold file: the device reads a load's first bytes while the verify pass is prepared."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _read_priming, _verify_reads
from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource
from hyper_parallel.core.distributed_checkpoint._read_priming import PRIME_MIN_BYTES, page_cached, prime

from page_cache import evict, pinned

ms.set_device("CPU")

MIB = 1 << 20


def _state(seed: int) -> dict[str, ms.Parameter]:
    rng = np.random.default_rng(seed)
    state = {f"w{i}": ms.Parameter(ms.Tensor(rng.random((1024, 1024), dtype=np.float32)), name=f"w{i}")
             for i in range(6)}  # 24 MiB: over the priming threshold
    for i in range(200):
        dtype = ms.bfloat16 if i % 2 else ms.float32
        state[f"b{i}"] = ms.Parameter(ms.Tensor(rng.random((1000 + i,), dtype=np.float32), dtype), name=f"b{i}")
    return state


def _bytes(state: dict[str, ms.Parameter]) -> dict[str, np.ndarray]:
    return {name: p.asnumpy().reshape(-1).view(np.uint8).copy() for name, p in state.items()}


def _evict(path: Path) -> None:
    """Drop the data files' clean pages from the page cache (no root needed)."""
    evict(path.glob("*.safetensors"))


def _record_primes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int, str]]:
    """(file name, start, bytes, calling thread) of every priming read; the reads go through."""
    calls = []
    real = _read_priming._prime_read

    def recording(fd: int, start: int, count: int, ahead=None) -> None:
        calls.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), start, count * _read_priming._PRIME_PIECE,
                      threading.current_thread().name))
        real(fd, start, count, ahead)

    monkeypatch.setattr(_read_priming, "_prime_read", recording)
    return calls


@pytest.fixture(name="saved")
def _saved(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    state = _state(0)
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=1), no_dist=True)
    return path, _bytes(state)


@pytest.mark.parametrize("no_readahead", [None, False])  # False: readahead forced, decided by no file share
def test_cold_load_primes_its_first_bytes_once_and_is_bit_exact(saved, monkeypatch, no_readahead) -> None:
    path, expected = saved
    calls = _record_primes(monkeypatch)
    _evict(path)
    target = _state(1)
    reader = dcp.FileSystemReader(path, thread_count=2, no_readahead=no_readahead)
    dcp.load(target, storage_reader=reader, no_dist=True)
    for name, values in _bytes(target).items():
        assert np.array_equal(values, expected[name]), name
    (data,) = path.glob("*.safetensors")
    first = min(e["byte_offset"] for e in json.loads((path / "metadata.json").read_text())["storage_data"])
    # one priming read per file and load (the read pass's open finds the bytes cached), from the first
    # needed byte, bounded, on a helper thread
    assert [(name, start) for name, start, _, _ in calls] == [(data.name, first)]
    assert 16 * MIB <= calls[0][2] <= _read_priming._PRIME_BYTES and calls[0][3] == "hp-ckpt-prime"
    assert reader.bytes_verified == sum(v.nbytes for v in expected.values())


def test_warm_or_resharded_loads_are_not_primed(saved, monkeypatch) -> None:
    path, expected = saved
    calls = _record_primes(monkeypatch)
    chunks = json.loads((path / "metadata.json").read_text())["storage_data"]
    (data,) = path.glob("*.safetensors")
    data.read_bytes()  # warm (the writer may have dropped its pages)
    target = _state(1)
    # the reader probes a file's first needed byte to tell a warm file: the page of every chunk's first byte is
    # kept cached through the load, so memory pressure from other processes cannot make the warm file look cold
    with pinned(data, [entry["byte_offset"] for entry in chunks]):
        dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    _evict(path)
    part = {name: target[name] for name in ("w0", "b3")}  # a few keys: the file is read without readahead
    dcp.load(part, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    assert calls == []
    for name, values in _bytes(target).items():
        assert np.array_equal(values, expected[name]), name


@pytest.mark.parametrize("key, read_ahead", [("b101", False), ("w5", True)])
def test_corrupt_byte_in_a_primed_file_is_refused_with_every_target_unchanged(saved, monkeypatch, key, read_ahead):
    """A bad byte in the middle of a small chunk, or (``read_ahead``) the last byte of a matrix past the first
    priming read, which the priming thread read ahead of the verify pass."""
    path, _ = saved
    fetches: list = []
    if read_ahead:
        monkeypatch.setattr(_read_priming, "_PRIME_BYTES", 2 * MIB)
        monkeypatch.setattr(_read_priming, "_FOLLOW_STEP", MIB)
        fetches = _recorded_fetches(monkeypatch, gate=True)
    entry = next(e for e in json.loads((path / "metadata.json").read_text())["storage_data"] if e["fqn"] == key)
    data = path / entry["file"]
    raw = bytearray(data.read_bytes())
    raw[entry["byte_offset"] + (entry["length"] - 1 if read_ahead else entry["length"] // 2)] ^= 0x10
    data.write_bytes(bytes(raw))
    calls = _record_primes(monkeypatch)
    _evict(path)
    target = _state(2)
    before = _bytes(target)
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    assert f"key '{key}'" in str(caught.value) and data.name in str(caught.value)
    assert "no target was changed" in str(caught.value)
    assert calls and (len(fetches) > 1 or not read_ahead)
    for name, values in _bytes(target).items():
        assert np.array_equal(values, before[name]), name


def test_prime_skips_small_spans_exact_files_and_cached_bytes(tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(np.arange(PRIME_MIN_BYTES + MIB, dtype=np.uint8).tobytes())
    fd = os.open(data, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        source = FileSource(fd)
        assert not prime(source, 0, PRIME_MIN_BYTES - 1)  # too little needed
        source.exact = True
        assert not prime(source, 0, PRIME_MIN_BYTES + MIB)  # read without readahead: exactly, announced
        source.exact = False
        assert not prime(object(), 0, PRIME_MIN_BYTES + MIB)  # no file descriptor (object storage)
        assert not page_cached(source, 4096)
        os.pread(fd, 4096, 4096)  # the page is cached now (a warm load is not primed)
        assert page_cached(source, 4096) and page_cached(object(), 0)
        assert prime(source, MIB, PRIME_MIN_BYTES + MIB)  # cold
    finally:
        os.close(fd)


@pytest.mark.parametrize("sendfile", ["real", "refused"])
def test_priming_read_brings_the_bytes_into_the_page_cache(tmp_path: Path, monkeypatch, sendfile) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(np.arange(4 * MIB, dtype=np.uint8).tobytes())
    if sendfile == "refused":  # a platform or filesystem without it: one preadv over a throwaway buffer

        def refuse(*args):
            raise OSError(22, "Invalid argument")

        monkeypatch.setattr(_read_priming.os, "sendfile", refuse)
    fd = os.open(data, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        source = FileSource(fd)
        assert not page_cached(source, 3 * MIB)
        copy = os.dup(fd)
        _read_priming._prime_read(copy, MIB, 3 * MIB // _read_priming._PRIME_PIECE)
        assert page_cached(source, MIB) and page_cached(source, 4 * MIB - 1)
        assert os.pread(fd, 16, 2 * MIB) == bytes(range(16))  # the file itself is untouched
    finally:
        os.close(fd)


def _recorded_fetches(monkeypatch: pytest.MonkeyPatch, *, gate: bool = False) -> list[tuple[int, int]]:
    """(start, length) of every read that brings bytes into the page cache for the priming thread; they go through.

    ``gate``: the verify pass hashes its first window only after two such reads (the first bytes and one read
    ahead), so that a fast pass cannot end before the thread reads ahead.
    """
    fetches: list[tuple[int, int]] = []
    real = _read_priming._fetch
    two = threading.Event()

    def recording(fd: int, start: int, length: int) -> None:
        real(fd, start, length)
        fetches.append((start, length))
        if len(fetches) >= 2:
            two.set()

    monkeypatch.setattr(_read_priming, "_fetch", recording)
    if gate:
        hash_window = _verify_reads._hash_window

        def gated(*args):
            assert two.wait(timeout=60)
            return hash_window(*args)

        monkeypatch.setattr(_verify_reads, "_hash_window", gated)
    return fetches


def test_read_ahead_stays_within_its_lead_of_the_verify_pass(tmp_path: Path, monkeypatch) -> None:
    """After the first bytes, the thread reads ahead only while within the lead of the last byte hashed; it waits
    for the verify pass's progress, and ends when the pass leaves the file."""
    monkeypatch.setattr(_read_priming, "_FOLLOW_LEAD", 8 * MIB)
    monkeypatch.setattr(_read_priming, "_FOLLOW_STEP", 2 * MIB)
    fetches = _recorded_fetches(monkeypatch)
    data = tmp_path / "data.bin"
    data.write_bytes(np.zeros(32 * MIB, dtype=np.uint8).tobytes())
    ahead = _read_priming.ReadAhead(0, 32 * MIB)
    blocked = threading.Event()
    wait_room = ahead.wait_room

    def watched(position: int) -> bool:
        if position >= ahead.reached + 8 * MIB and not ahead.stopped:
            blocked.set()  # about to wait for the verify pass
        return wait_room(position)

    ahead.wait_room = watched
    fd = os.open(data, os.O_RDONLY)
    thread = threading.Thread(target=_read_priming._prime_read, args=(fd, 0, 4, ahead))  # first 1 MiB, then ahead
    thread.start()
    assert blocked.wait(timeout=60)
    assert fetches == [(0, MIB), (MIB, 2 * MIB), (3 * MIB, 2 * MIB), (5 * MIB, 2 * MIB), (7 * MIB, 2 * MIB)]
    blocked.clear()
    ahead.advance(10 * MIB)  # the verify pass hashed 10 MiB: room up to 18 MiB
    assert blocked.wait(timeout=60)
    assert fetches[5:] == [(start * MIB, 2 * MIB) for start in (9, 11, 13, 15, 17)]
    ahead.advance(5 * MIB)  # never backwards
    assert ahead.reached == 10 * MIB
    ahead.stop()
    thread.join(timeout=60)
    assert not thread.is_alive() and len(fetches) == 10  # stopped: nothing more read ahead
    done = _read_priming.ReadAhead(0, 7 * MIB)
    done.advance(7 * MIB)
    fetches.clear()
    _read_priming._prime_read(os.open(data, os.O_RDONLY), 0, 4, done)  # room for all: up to the end, no further
    assert fetches == [(0, MIB), (MIB, 2 * MIB), (3 * MIB, 2 * MIB), (5 * MIB, 2 * MIB)]


def test_cold_load_reads_ahead_of_its_verify_pass_each_byte_once(saved, monkeypatch) -> None:
    """A cold file needing more than the first priming read is read ahead of the verify pass, in file order, each
    needed byte at most once and none outside them; the load is bit-exact, the thread ends with the load."""
    path, expected = saved
    monkeypatch.setattr(_read_priming, "_PRIME_BYTES", 2 * MIB)
    monkeypatch.setattr(_read_priming, "_FOLLOW_LEAD", 4 * MIB)
    monkeypatch.setattr(_read_priming, "_FOLLOW_STEP", MIB)
    fetches = _recorded_fetches(monkeypatch, gate=True)
    _evict(path)
    target = _state(1)
    reader = dcp.FileSystemReader(path, thread_count=2)
    dcp.load(target, storage_reader=reader, no_dist=True)
    for name, values in _bytes(target).items():
        assert np.array_equal(values, expected[name]), name
    entries = json.loads((path / "metadata.json").read_text())["storage_data"]
    first = min(e["byte_offset"] for e in entries)
    end = max(e["byte_offset"] + e["length"] for e in entries)
    for thread in threading.enumerate():
        if thread.name == "hp-ckpt-prime":
            thread.join(timeout=60)
    assert fetches[0] == (first, 2 * MIB) and len(fetches) > 1  # the first bytes, then ahead of the pass
    assert all(a + n == b for (a, n), (b, _) in zip(fetches, fetches[1:]))  # in order, no byte twice
    assert fetches[-1][0] + fetches[-1][1] <= end
    assert reader.bytes_verified == sum(v.nbytes for v in expected.values())



def test_a_load_failing_at_the_header_of_a_primed_file_leaves_no_priming_thread_or_descriptor(saved) -> None:
    """The header check refuses a cold file while its priming thread still reads: the load returns only after
    that thread ended and closed its descriptor (no thread or descriptor left behind)."""
    path, _ = saved
    data = next(path.glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    at = raw.index(b'"data_offsets":[', 0, header_end) + len(b'"data_offsets":[')
    raw[at] = ord("9") if raw[at] != ord("9") else ord("8")  # one offset digit of the header changed
    data.write_bytes(bytes(raw))
    fds = set(os.listdir("/proc/self/fd"))
    for _ in range(2):
        _evict(path)
        target = _state(2)
        before = _bytes(target)
        with pytest.raises(dcp.CorruptCheckpointError, match=data.name):
            dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        assert not [t.name for t in threading.enumerate() if t.name.startswith("hp-ckpt-prime")]
        assert set(os.listdir("/proc/self/fd")) <= fds
        for name, values in _bytes(target).items():
            assert np.array_equal(values, before[name]), name
