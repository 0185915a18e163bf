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
from hyper_parallel.core.distributed_checkpoint import _read_priming
from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource
from hyper_parallel.core.distributed_checkpoint._read_priming import PRIME_MIN_BYTES, page_cached, prime

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
    for data in path.glob("*.safetensors"):
        fd = os.open(data, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _record_primes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int, str]]:
    """(file name, start, bytes, calling thread) of every priming read; the reads go through."""
    calls = []
    real = _read_priming._prime_read

    def recording(fd: int, start: int, count: int) -> None:
        calls.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), start, count * _read_priming._PRIME_PIECE,
                      threading.current_thread().name))
        real(fd, start, count)

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
    for data in path.glob("*.safetensors"):
        data.read_bytes()  # warm (the writer may have dropped its pages)
    target = _state(1)
    dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    _evict(path)
    part = {name: target[name] for name in ("w0", "b3")}  # a few keys: the file is read without readahead
    dcp.load(part, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    assert calls == []
    for name, values in _bytes(target).items():
        assert np.array_equal(values, expected[name]), name


def test_corrupt_byte_in_a_primed_file_is_refused_with_every_target_unchanged(saved, monkeypatch) -> None:
    path, _ = saved
    entry = next(e for e in json.loads((path / "metadata.json").read_text())["storage_data"] if e["fqn"] == "b101")
    data = path / entry["file"]
    raw = bytearray(data.read_bytes())
    raw[entry["byte_offset"] + entry["length"] // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    calls = _record_primes(monkeypatch)
    _evict(path)
    target = _state(2)
    before = _bytes(target)
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    assert "key 'b101'" in str(caught.value) and data.name in str(caught.value)
    assert calls
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
