"""The read pass's I/O threads share large verified runs, so that they end together.

A verified run of at least two pieces (``SHARE_PIECE_BYTES``, made small
here) is copied piece by piece: its owner takes pieces from the front, a
thread with no file of its own (or done with its own) from the back. The
loads below read real checkpoints into real Parameters and are compared bit
for bit with what was saved; which thread read which byte is recorded by a
wrapper around the file source's reads, which also holds the first piece until
a second thread read one (so a load that does not share fails the test instead
of racing it).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _reader_reads
from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource

_PIECE = 64 << 10


def _state(zero: bool = False) -> dict[str, ms.Parameter]:
    """A float32 and a bfloat16 Parameter of 2 MiB each (32 pieces of 64 KiB each)."""
    rng = np.random.default_rng(5)
    state = {}
    for name, rows, dtype in (("big.w", 512, ms.float32), ("half.w", 1024, ms.bfloat16)):
        values = rng.standard_normal((rows, 1024)).astype(np.float32)
        state[name] = ms.Parameter(ms.Tensor(np.zeros_like(values) if zero else values, dtype), name=name)
    return state


def _bits(state: dict[str, ms.Parameter]) -> dict[str, bytes]:
    return {name: value.asnumpy().tobytes() for name, value in state.items()}


class _Recording:
    """Wraps ``FileSource.readinto`` during the read pass: records (thread, offset, bytes) of each read, and holds
    the first reader until a second thread read too (at most 10 s)."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, int, int]] = []
        self.active = False
        self._second = threading.Event()
        self._lock = threading.Lock()
        self._real = FileSource.readinto

    def readinto(self, source: FileSource, buffer: np.ndarray, offset: int) -> int:
        got = self._real(source, buffer, offset)
        if self.active:
            name = threading.current_thread().name
            with self._lock:
                self.reads.append((name, offset, got))
                first = len({thread for thread, _, _ in self.reads}) == 1
                if not first:
                    self._second.set()
            if first:
                self._second.wait(10)
        return got


class _Reader(dcp.FileSystemReader):
    """A reader that switches the recording on for its read pass only."""

    recording: _Recording

    def _read_groups(self, work, planner):  # the read pass
        self.recording.active = True
        try:
            return super()._read_groups(work, planner)
        finally:
            self.recording.active = False


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> _Recording:
    recorder = _Recording()
    monkeypatch.setattr(_reader_reads, "SHARE_PIECE_BYTES", _PIECE)
    monkeypatch.setattr(FileSource, "readinto",
                        lambda source, buffer, offset: recorder.readinto(source, buffer, offset))
    return recorder


def test_a_single_file_is_copied_by_both_threads(tmp_path: Path, recording: _Recording) -> None:
    saved = _state()
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=1), no_dist=True)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    targets = _state(zero=True)
    reader = _Reader(tmp_path, thread_count=2)
    reader.recording = recording
    dcp.load(targets, storage_reader=reader, no_dist=True)
    assert _bits(targets) == _bits(saved)
    threads = {name for name, _, _ in recording.reads}
    assert len(threads) == 2 and all(name.startswith("hp-ckpt-read") for name in threads)
    # every piece read once, none larger than a piece: 4 MiB in 64 pieces
    assert all(got == _PIECE for _, _, got in recording.reads)
    assert len({offset for _, offset, _ in recording.reads}) == len(recording.reads) == 64
    # verified bytes are counted once, by the verify pass, whichever thread copied a piece
    assert reader.bytes_read == reader.bytes_verified == 4 << 20
    assert not [t for t in threading.enumerate() if t.name.startswith("hp-ckpt-read")]


def test_without_checksums_a_run_is_read_by_its_owner_alone(tmp_path: Path, recording: _Recording) -> None:
    """Unverified bytes come from the device: one thread per file keeps the kernel's readahead of it intact."""
    saved = _state()
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=1), no_dist=True)
    targets = _state(zero=True)
    reader = _Reader(tmp_path, thread_count=2, verify_checksums=False)
    reader.recording = recording
    recording._second.set()  # nothing to wait for
    dcp.load(targets, storage_reader=reader, no_dist=True)
    assert _bits(targets) == _bits(saved)
    assert not recording.reads  # whole runs, read by read_rows, not in pieces


def test_a_file_cut_short_in_the_read_pass_fails_and_every_thread_ends(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    saved = _state()
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=1), no_dist=True)
    monkeypatch.setattr(_reader_reads, "SHARE_PIECE_BYTES", _PIECE)
    (data_file,) = tmp_path.glob("*.safetensors")

    class Cutting(dcp.FileSystemReader):
        def _read_groups(self, work, planner):  # after the verify pass and its check that no file changed
            os.truncate(data_file, data_file.stat().st_size - 3 * _PIECE)
            return super()._read_groups(work, planner)

    with pytest.raises(dcp.CorruptCheckpointError, match=r"is truncated while reading key '(big|half)\.w'"):
        dcp.load(_state(zero=True), storage_reader=Cutting(tmp_path, thread_count=2), no_dist=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("hp-ckpt-read")]
