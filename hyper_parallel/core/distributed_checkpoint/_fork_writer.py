"""Async staging by ``fork``: the kernel's copy-on-write snapshot as the staging buffer.

``async_save(..., staging="fork")`` forks a child process right after
planning. The child sees the state exactly as it was at the fork (pages the
training later changes are copied by the kernel, lazily) and writes the data
files; the parent returns at once. The caller therefore blocks only for
planning and the ``fork`` itself, whatever the state's size.

Safety: every tensor is resolved to a numpy view in the parent before the
fork, so the child never calls into the framework (whose threads and locks do
not survive a fork); it only runs the storage writer (numpy, xxhash, file
I/O) and exits with ``os._exit``. The child reports its write results (or its
error) through a pipe; unpickling them is safe, the data comes from our own
child, never from a checkpoint. POSIX only.
"""

from __future__ import annotations

import os
import pickle
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError, CheckpointIOError
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import StorageWriter, WriteResult

__all__ = ["fork_run", "fork_write", "fork_write_and_hash"]


@dataclass(frozen=True)
class _ChildOutcome:
    """What the writer process reports through its pipe.

    Attributes:
        results: The write results (``None`` when the write failed).
        error: ``"<type>: <message>"`` of the failure, else ``""``.
        traceback: The failure's formatted traceback, else ``""``.
        io_error: The failure was an ``OSError`` (disk full, I/O error).
    """

    results: list[WriteResult] | None = None
    error: str = ""
    traceback: str = ""
    io_error: bool = False


def _child(work: Callable[[], Any], writer: StorageWriter, out_fd: int) -> None:
    try:
        payload = pickle.dumps(_ChildOutcome(results=work()))
    except BaseException as exc:  # pylint: disable=broad-except
        payload = pickle.dumps(_ChildOutcome(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                                             io_error=isinstance(exc, OSError)))
    view = memoryview(payload)
    while view:
        view = view[os.write(out_fd, view):]
    os.close(out_fd)
    wait_page_drop = getattr(writer, "wait_page_drop", None)
    if wait_page_drop is not None:  # the results are reported: give the page cache advice before leaving
        wait_page_drop()


def fork_write(writer: StorageWriter, plan: SavePlan, planner: SavePlanner, *, rank: int) -> Callable[[], Any]:
    """Fork a child that writes ``plan``; return the function that waits for its results.

    Called on the caller's thread; the returned function runs on the
    background thread and returns the write results, or raises the child's
    error (a :class:`CheckpointIOError` for I/O errors).
    """
    return fork_run(lambda: writer.write_data(plan, planner).result(), writer, rank=rank)


def fork_write_and_hash(
    writer: StorageWriter, plan: SavePlan, planner: SavePlanner, digests: Callable[[], Any], *, rank: int,
    replicas: list[Any],
) -> Callable[[], Any]:
    """:func:`fork_write`, whose child also returns ``digests()`` (the replica digests of its snapshot).

    The returned function (background thread) returns the write results and
    appends the digests to ``replicas``. Caller's thread.
    """
    wait = fork_run(lambda: (writer.write_data(plan, planner).result(), digests()), writer, rank=rank)

    def results() -> Any:
        written, found = wait()
        replicas.append(found)
        return written

    return results


def fork_run(work: Callable[[], Any], writer: StorageWriter, *, rank: int) -> Callable[[], Any]:
    """Fork a child that runs ``work`` (which writes with ``writer``); return the function that waits for its result.

    As :func:`fork_write`; ``work`` returns a picklable value (the write
    results, and what else the parent needs). Caller's thread.
    """
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:  # no memory or process slot for the child (a strict overcommit policy)
        os.close(read_fd)
        os.close(write_fd)
        raise CheckpointIOError(
            f"rank {rank}: cannot fork the async save writer process: {exc}; pass staging='copy' to async_save"
        ) from exc
    if pid == 0:  # the child: write, report, leave without running any parent cleanup
        status = 0
        try:
            os.close(read_fd)
            _child(work, writer, write_fd)
        except BaseException:  # pylint: disable=broad-except
            status = 1
        os._exit(status)  # pylint: disable=protected-access
    os.close(write_fd)

    def wait() -> Any:
        chunks = []
        try:
            while True:
                chunk = os.read(read_fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(read_fd)
            _, status = os.waitpid(pid, 0)
        if not chunks:
            raise CheckpointIOError(f"rank {rank}: the async save writer process {pid} died (wait status {status})")
        outcome: _ChildOutcome = pickle.loads(b"".join(chunks))  # from our own child process
        if outcome.results is not None:
            return outcome.results
        cls = CheckpointIOError if outcome.io_error else CheckpointError
        raise cls(f"rank {rank}: async save writer process failed: {outcome.error}\n{outcome.traceback}")

    return wait
