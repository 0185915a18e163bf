"""The cost of each protection of a save and a load, and of the commit; ``scripts/benchmark.py`` runs it.

Every protection stays on in the library; to price one, this script times the
step it adds, or runs the same save with it switched off inside this process
only (never offered by the library):

- checksums of a save: ``dcp.save`` with the xxh3 block checksums replaced by
  a constant (benchmark-only patch of the data file layout), alternating with
  normal saves, so both figures come from the same minutes;
- the commit: :meth:`FileSystemWriter.finish` (metadata encoded, written to a
  temporary file, fsynced, renamed, directory fsynced, lease released), timed
  inside every normal save of the paired runs;
- the save lease: taking it (inside the saves) and a take + release on its own;
- the header check of a load: the time the reader spends checking data file
  headers against the metadata during a warm load without checksum
  verification (where it weighs most), against that load's time.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _data_file
from hyper_parallel.core.distributed_checkpoint._save_lease import SaveLease
from hyper_parallel.core.distributed_checkpoint.metadata import ChunkChecksum

__all__ = ["TimedWriter", "no_checksums", "phase_protections", "plain_write_early_writeback", "verified_read_floor"]


class TimedWriter(dcp.FileSystemWriter):
    """A real :class:`FileSystemWriter` that records how long its commit and its lease take, and on which thread."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.commit_seconds: list[float] = []
        self.commit_threads: list[str] = []
        self.lease_seconds: list[float] = []

    def finish(self, metadata: Any, results: Any, **kwargs: Any) -> Any:
        import threading  # pylint: disable=import-outside-toplevel

        start = time.perf_counter()
        try:
            return super().finish(metadata, results, **kwargs)
        finally:
            self.commit_seconds.append(time.perf_counter() - start)
            self.commit_threads.append(threading.current_thread().name)

    def _take_lease(self) -> None:
        start = time.perf_counter()
        try:
            super()._take_lease()
        finally:
            self.lease_seconds.append(time.perf_counter() - start)


class _HeaderTimedReader(dcp.FileSystemReader):
    """A real :class:`FileSystemReader` that adds up the time spent in its header checks."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.header_seconds: list[float] = []  # one per check (list.append is safe from the reader's threads)

    def _check_header(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            super()._check_header(*args, **kwargs)
        finally:
            self.header_seconds.append(time.perf_counter() - start)


@contextlib.contextmanager
def no_checksums() -> Iterator[None]:
    """Inside: data files are laid out with a constant in place of every checksum (benchmark only)."""
    constant = ChunkChecksum(algorithm="xxh3_64", block_bytes=1 << 20, digests=("0" * 16,))
    saved = _data_file.digest, _data_file.chunk_checksum

    def constant_checksum(data: Any, *args: Any, after: Callable[[int], None] | None = None, **kwargs: Any) -> Any:
        del args, kwargs
        if after is not None:  # the writer writes what it is told is hashed: all of it
            after(len(data))
        return constant

    _data_file.digest = lambda data: "0" * 16
    _data_file.chunk_checksum = constant_checksum
    try:
        yield
    finally:
        _data_file.digest, _data_file.chunk_checksum = saved


def plain_write_early_writeback(path: Path, source: Any, nbytes: int) -> Callable[[], None]:
    """A plain single-stream write + fsync that asks for writeback every 8 MiB, as the save's writer does."""
    import os  # pylint: disable=import-outside-toplevel

    # pylint: disable-next=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint._file_ops import OS_FILE_OPS

    step = _data_file.WRITEBACK_BYTES

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for start in range(0, nbytes, step):
                view = memoryview(source)[start:start + step]
                while view:  # os.write may write less than asked
                    view = view[os.write(fd, view):]
                OS_FILE_OPS.start_writeback(fd, start, min(step, nbytes - start))
            os.fsync(fd)
        finally:
            os.close(fd)

    return write


def verified_read_floor(path: Path, target: Any, *, threads: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """The least work of a warm load into ``target`` without and with verify-before-land, on ``threads`` threads.

    Returns ``(read, verified)``. ``read``: each thread ``pread``\ s its share
    of the file into ``target`` in 8 MiB windows (one page-cache read).
    ``verified``: a hash pass first (each thread reads its share 1 MiB at a
    time into one buffer that stays in its core's cache and hashes each 1 MiB
    block with xxh3, as the load's verify pass does for flat blocks: the
    least work of any safe way measured on this VM; 8 MiB reads took 1.15x as
    long, and only hashing a mapping of the file is cheaper, 0.85x, which a
    truncation by another process turns into ``SIGBUS``), then the same read.
    Tiles cost more (about 1.5x the CPU): a tile's rows are strided in the
    file and must be gathered (by the kernel's scatter read or by a copy)
    before they are hashed. Holding every verified byte instead would need
    memory the size of the load: with
    memory bounded by the in-flight limit, a load that lands no byte before
    every byte is verified reads the page cache twice. The ratio of these two
    to a memcpy is this machine's floor for the contract's warm-load figure.
    """
    import os  # pylint: disable=import-outside-toplevel
    from concurrent.futures import ThreadPoolExecutor  # pylint: disable=import-outside-toplevel

    import numpy as np  # pylint: disable=import-outside-toplevel
    import xxhash  # pylint: disable=import-outside-toplevel

    nbytes = target.nbytes
    window, block = 8 << 20, 1 << 20  # the read's windows; the hash pass reads and hashes a block at a time
    bounds = [(nbytes * i // threads // block * block, nbytes * (i + 1) // threads // block * block)
              for i in range(threads)]
    bounds[-1] = (bounds[-1][0], nbytes)
    scratch = [np.empty(block, np.uint8) for _ in range(threads)]
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bench-floor")

    def part(fd: int, index: int, hashing: bool) -> None:
        low, high = bounds[index]
        flat = target.reshape(-1).view(np.uint8)
        if hashing:
            for start in range(low, high, block):
                buffer = scratch[index][:min(block, high - start)]
                os.preadv(fd, [buffer], start)
                xxhash.xxh3_64_intdigest(buffer)
            return
        for start in range(low, high, window):
            os.preadv(fd, [flat[start:start + min(window, high - start)]], start)

    def run(hashing: bool) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if hashing:
                list(pool.map(lambda i: part(fd, i, True), range(threads)))
            list(pool.map(lambda i: part(fd, i, False), range(threads)))
        finally:
            os.close(fd)

    return (lambda: run(False)), (lambda: run(True))


def phase_protections(state: dict[str, Any], work: Path, load_path: Path, *, threads: int, runs: int,
                      before_each: Callable[[], None], remove: Callable[[Path], None],
                      warm: Callable[[], None]) -> dict[str, list[float]]:
    """Paired saves with checksums on and off, the commit and lease inside them, the header check of a load.

    Args:
        state: The state to save.
        work: Scratch directory.
        load_path: A checkpoint of ``state`` (``threads`` data files) for the header-check load.
        threads: ``thread_count`` of the saves and the load.
        runs: Pairs of saves (and loads) timed.
        before_each: Run untimed before each timed run (the benchmark's pretouch).
        remove: Deletes a file or directory.
        warm: Reads ``load_path``'s data files into the page cache.
    """
    path = work / "protections"
    times: dict[str, list[float]] = {}
    on_label = f"dcp.save (thread_count={threads}), checksums on (paired)"
    off_label = f"dcp.save (thread_count={threads}), checksums off (paired, benchmark-only patch)"
    commit, lease = [], []
    for run in range(runs):
        for checksums in ((True, False) if run % 2 == 0 else (False, True)):
            remove(path)
            before_each()
            writer = TimedWriter(path, thread_count=threads)
            start = time.perf_counter()
            with contextlib.nullcontext() if checksums else no_checksums():
                dcp.save(state, storage_writer=writer, no_dist=True)
            times.setdefault(on_label if checksums else off_label, []).append(time.perf_counter() - start)
            if checksums:
                commit += writer.commit_seconds
                lease += writer.lease_seconds
    remove(path)
    times[f"commit (writer.finish) of dcp.save (thread_count={threads})"] = commit
    times["save lease taken (inside dcp.save)"] = lease
    with tempfile.TemporaryDirectory(dir=work) as scratch:
        take_release = []
        for _ in range(max(runs, 5)):
            start = time.perf_counter()
            held, _ = SaveLease.acquire(Path(scratch), "metadata.json", uuid.uuid4().hex[:12])
            held.release()
            take_release.append(time.perf_counter() - start)
    times["save lease take + release"] = take_release
    headers, loads = [], []
    for _ in range(runs):
        warm()
        before_each()
        reader = _HeaderTimedReader(load_path, verify_checksums=False, thread_count=threads)
        start = time.perf_counter()
        dcp.load(state, storage_reader=reader, no_dist=True)
        loads.append(time.perf_counter() - start)
        headers.append(sum(reader.header_seconds))
    times[f"header check inside a warm load, verify off ({threads} threads)"] = headers
    times[f"warm load with timed header check, verify off ({threads} threads)"] = loads
    return times

