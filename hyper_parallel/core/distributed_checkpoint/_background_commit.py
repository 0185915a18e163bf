"""A multi-rank ``async_save`` that commits in the background, through per-rank results records.

Each rank's background thread writes its data, then (other than the
coordinator) its durable results record, or a record of its failure
(:mod:`._rank_records`). The coordinator's background thread then goes on:
it waits for every other rank's record, commits with the writer's
:meth:`~.storage.StorageWriter.finish` (lease and ownership checks included)
and removes the records. No collective runs off the caller's thread, and the
step is durable whether or not ``result()`` is ever called.

``result()`` waits only for this rank's writing, then runs one collective
step, "async write": every rank's write results reach the coordinator (a
failure on any rank raises on every rank, naming it, and nothing is
committed), which answers each rank with the metadata being committed (with
the filesystem and fsspec writers: a receipt, and the other ranks return a
view that waits for the commit when first used). No rank waits there for the
commit itself. The commit's own outcome (a racing
save took the lease, the metadata could not be written) is shared by the
next collective step of the process: the plan step of the next save with
collectives (:func:`raise_commit_failures` in its map), or
:func:`settle_background_commits`, called first by every load with
collectives and by ``CheckpointManager.wait``; a failed commit raises there
on every rank. On the coordinator a failed commit also raises, once, from the
next save without collectives (:func:`raise_local_commit_failures`), and
``read_metadata`` of that checkpoint names it (:func:`failed_commit_to`). The
error names the checkpoint, the cause and the fix (:func:`explain_commit_failure`),
and is logged at once (the only report if the process ends before another
collective step).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from hyper_parallel import platform
from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncCallsQueue, AsyncRequest
from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper, collective_timeout
from hyper_parallel.core.distributed_checkpoint._commit_receipt import (
    CommitReceipt,
    CommitWait,
    commit_answers,
    metadata_of_answer,
    metadata_reader_of,
    record_probe_of,
)
from hyper_parallel.core.distributed_checkpoint._rank_records import (
    RankRecord,
    collect_rank_records,
    encode_rank_record,
    results_of,
)
from hyper_parallel.core.distributed_checkpoint._index_plan import RankIndexSummary, own_index
from hyper_parallel.core.distributed_checkpoint._global_plan import differing_replicas, refuse_problems
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError, CheckpointIOError
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan
from hyper_parallel.core.distributed_checkpoint.storage import StorageWriter, WriteResult

__all__ = [
    "BackgroundCommit",
    "await_own_commits",
    "background_commit_request",
    "check_record_replicas",
    "explain_commit_failure",
    "failed_commit_to",
    "finish_own_saves_to",
    "raise_local_commit_failures",
    "raise_commit_failures",
    "same_location",
    "settle_background_commits",
    "take_pending_commits",
]

_LOG = logging.getLogger(__name__)

#: Saves whose ``result()`` succeeded while their commit may still run (every rank holds the same list).
_PENDING: list["BackgroundCommit"] = []
_PENDING_LOCK = threading.Lock()


class BackgroundCommit:
    """One multi-rank async save of a backend with rank records: its write, its record, its commit.

    Args:
        dist: The save's collectives.
        writer: This rank's writer (keeps rank records).
        plan: This rank's final plan (its storage data names the save).
        metadata: The coordinator's planned metadata (``None`` elsewhere).
        write: Writes this rank's data (staged copies or a forked writer); returns its results.
        replicas: After ``write``, this rank's replica digests made by its writer (see
            :attr:`.RankRecord.replicas`): the coordinator compares them before it commits.
    """

    def __init__(
        self,
        *,
        dist: DistWrapper,
        writer: StorageWriter,
        plan: SavePlan,
        metadata: Metadata | None,
        write: Callable[[], list[WriteResult]],
        replicas: Callable[[], tuple[tuple[str, tuple[int, ...], str], ...]] | None = None,
    ) -> None:
        self.dist, self.writer, self.plan, self.metadata = dist, writer, plan, metadata
        self._write: Callable[[], list[WriteResult]] | None = write
        self._replicas = replicas
        self.replicas: tuple[tuple[str, tuple[int, ...], str], ...] = ()
        self.save_id: str = getattr(plan.storage_data, "save_id", "")
        self.written = threading.Event()  # this rank's data and record are durable, or failed
        self.finished = threading.Event()  # this rank's background work is over (the coordinator's commit too)
        self._wake = threading.Event()
        self._cancel = threading.Event()
        self._timeout = collective_timeout()
        self.results: list[WriteResult] | None = None
        self.summary: RankIndexSummary | None = None  # this rank's own index file, when its plan says so
        self.local_error: BaseException | None = None
        #: The commit's failure, explained (:func:`explain_commit_failure`); coordinator only.
        self.commit_error: BaseException | None = None
        self.reported_locally = False  # raised by raise_local_commit_failures (once)

    def run(self) -> Metadata | None:
        """The background function. Every rank, on its background thread; never runs a collective."""
        rank = self.dist.rank
        try:
            try:
                write, self._write = self._write, None  # the staged data is released with it
                assert write is not None, "a background commit runs once"
                self.results = write()
                self.replicas = self._replicas() if self._replicas is not None else ()
                self.summary = own_index(self.writer, self.plan, self.results)  # its index, after its data
                if not self.dist.is_coordinator:
                    record = RankRecord(self.save_id, rank, () if self.summary else tuple(self.results),
                                        replicas=self.replicas, summary=self.summary)
                    self.writer.write_rank_record(rank, encode_rank_record(record), plan=self.plan)
            except BaseException as exc:  # pylint: disable=broad-except
                self.local_error = exc
                if not self.dist.is_coordinator:
                    self._record_failure(exc)
            finally:
                self.written.set()
            if self.dist.is_coordinator:
                return self._commit()  # aborts if anything failed, its own writing included
            if self.local_error is not None:
                raise self.local_error
            return None
        finally:
            self.finished.set()

    def _record_failure(self, exc: BaseException) -> None:
        """Tell the coordinator's thread that this rank failed (best effort: ``result()`` tells it too)."""
        rank = self.dist.rank
        try:
            record = RankRecord(self.save_id, rank, None, f"{type(exc).__name__}: {exc}")
            self.writer.write_rank_record(rank, encode_rank_record(record), plan=self.plan)
        except BaseException as record_error:  # pylint: disable=broad-except
            _LOG.warning("rank %d: recording its failed write failed too: %s", rank, record_error)

    def _commit(self) -> Metadata | None:
        """Coordinator: wait for every rank's record (any outcome), then commit, or abort if any failed."""
        writer, world = self.writer, self.dist.world_size
        written_everywhere = False
        try:
            records = collect_rank_records(writer, save_id=self.save_id, ranks=range(1, world),
                                           timeout=self._timeout, wake=self._wake, cancel=self._cancel)
            if self.local_error is not None:
                raise self.local_error  # after every other rank's outcome: their files are complete to delete
            if self._cancel.is_set():
                return None  # result() raised another rank's write failure on every rank
            records[0] = RankRecord(self.save_id, 0, tuple(self.results or ()), replicas=self.replicas,
                                    summary=self.summary)
            all_results = results_of(records, save_id=self.save_id, world_size=world)
            written_everywhere = True  # from here a failure is the commit's own, which result() does not report
            check_record_replicas(records)
            return writer.finish(self.metadata, all_results)
        except BaseException as exc:
            if exc is not self.local_error:
                self.commit_error = exc
            if written_everywhere:
                location = getattr(writer, "path", None)
                self.commit_error = explain_commit_failure(exc, location=location, save_id=self.save_id)
                _LOG.error("rank %d: %s", self.dist.rank, self.commit_error)
            raise
        finally:
            if self.commit_error is not None or self.local_error is not None or self._cancel.is_set():
                writer.abort()
            writer.remove_rank_records(world)

    def confirm(self, _value: Any, _error: BaseException | None) -> Metadata:
        """Finalize on the caller's thread (``result()``): the "async write" step. All ranks.

        Raises every rank's write failure on every rank (nothing is then
        committed); otherwise returns the metadata the coordinator commits,
        without waiting for that commit. When the writer can read its commit
        back (:mod:`._commit_receipt`) the other ranks receive a receipt only
        and return a view that, when first used, waits for the commit and
        reads the committed metadata (or refuses, if the commit failed), so
        the bytes they receive do not grow with the world size.
        """
        dist = self.dist

        def local() -> list[WriteResult]:
            if self.local_error is not None:
                raise self.local_error
            return self.summary or self.results or []

        read_back = metadata_reader_of(self.writer)
        kept: list[Metadata] = []

        def reduce(all_results: list[list[WriteResult]]) -> list[Metadata | CommitReceipt]:
            self._wake.set()  # every record is stored: the commit need not wait for its next look
            kept.append(self.writer.committed_metadata(self.metadata, all_results))
            return commit_answers(kept[0], world_size=len(all_results), location=getattr(self.writer, "path", ""),
                                  read_back=read_back)

        try:
            answer = dist.reduce_scatter("async write", local, reduce)
        except BaseException:
            self._cancel.set()
            self._wake.set()
            if dist.is_coordinator:
                self.finished.wait()  # its abort is done before the error reaches the caller
            else:
                self.writer.abort()
            raise
        with _PENDING_LOCK:
            _PENDING.append(self)
        if kept:
            return kept[0]  # the coordinator: the metadata it commits
        probe = record_probe_of(self.writer, rank=dist.rank, save_id=self.save_id)
        wait = None if probe is None else CommitWait(pending=probe, rank=dist.rank, timeout=self._timeout)
        return metadata_of_answer(answer, read_back=read_back, wait=wait)

    def outcome(self) -> None:
        """Wait for the commit and raise its failure. Coordinator (other ranks return at once)."""
        if not self.dist.is_coordinator:
            return
        self.finished.wait()
        if self.commit_error is not None:
            raise self.commit_error


def explain_commit_failure(cause: BaseException, *, location: Any, save_id: str) -> CheckpointError:
    """The failure of a background commit, as an error naming the checkpoint, the cause and the fix.

    The error is of the cause's class when it is a :class:`CheckpointError`
    (a lost lease stays a :class:`ConcurrentSaveError`), a
    :class:`CheckpointIOError` for an ``OSError``, else a :class:`CheckpointError`;
    its ``__cause__`` is ``cause``. Pure.
    """
    message = (
        f"the async save to checkpoint {location} (save id {save_id}) did not commit: every rank wrote its data, "
        f"then its background commit on rank 0 failed: {type(cause).__name__}: {cause}. This step is not saved "
        "(unless read_metadata shows this save id, the checkpoint holds what it held before: its previous "
        "checkpoint or nothing). Fix the cause, then save this step again"
    )
    if isinstance(cause, CheckpointError):
        try:
            error: CheckpointError = type(cause)(message)
        except TypeError:  # a class with another constructor
            error = CheckpointError(message)
    elif isinstance(cause, OSError):
        error = CheckpointIOError(message)
    else:
        error = CheckpointError(message)
    error.__cause__ = cause
    return error


def background_commit_request(
    *,
    dist: DistWrapper,
    writer: StorageWriter,
    plan: SavePlan,
    metadata: Metadata | None,
    write: Callable[[], list[WriteResult]],
    replicas: Callable[[], tuple[tuple[str, tuple[int, ...], str], ...]] | None = None,
) -> AsyncRequest:
    """The :class:`AsyncRequest` of a multi-rank async save that commits in the background. All ranks.

    Arguments as :class:`BackgroundCommit`.
    """
    commit = BackgroundCommit(dist=dist, writer=writer, plan=plan, metadata=metadata, write=write,
                              replicas=replicas)
    return AsyncRequest(async_fn=commit.run, finalize_fns=(commit.confirm,), ready=commit.written)


def check_record_replicas(records: Any) -> None:
    """Compare the replica digests of every rank's record (rank -> :class:`.RankRecord`). Coordinator; pure.

    Raises:
        PlanValidationError: Replicas of a chunk differ (names the key, the chunk and the ranks).
    """
    problems = differing_replicas(((key, offsets), rank, found) for rank in sorted(records)
                                  for key, offsets, found in records[rank].replicas)
    refuse_problems(problems, what="the save was not committed: replicas differ")


def take_pending_commits() -> list[BackgroundCommit]:
    """The commits whose outcome no collective step shared yet; the list is emptied. All ranks alike."""
    with _PENDING_LOCK:
        pending = list(_PENDING)
        _PENDING.clear()
    return pending


def same_location(written: Any, read: Any) -> bool:
    """Whether a writer's ``path`` and a reader's name one checkpoint (a writer without one: assume so)."""
    if written is None or read is None:
        return True
    written, read = os.fspath(written), os.fspath(read)
    if "://" in written or "://" in read:
        return written.rstrip("/") == read.rstrip("/")
    return os.path.realpath(written) == os.path.realpath(read)


def finish_own_saves_to(location: Any, *, collective: bool) -> bool:
    """Finish (as ``result()``) this process's async saves if one still writes to ``location``. All ranks alike.

    For a load or a save of ``location`` that would otherwise meet that save
    half done. Run when every rank reaches this point together
    (``collective``: the save's ``result()`` step then runs on every rank,
    each having started that save in the same ``async_save`` and finished it
    only at such shared points, so every rank decides alike), or in a process
    alone (its ``result()`` needs no other rank). Otherwise nothing runs: a
    rank saving or loading alone in a job of several ranks cannot tell that
    the others will reach that save's collective step.

    Returns:
        Whether async saves were finished.
    """
    if location is None or not (collective or platform.get_world_size() <= 1):
        return False
    return AsyncCallsQueue.finish_all_queues_if(
        lambda writer: getattr(writer, "path", None) is not None and same_location(writer.path, location))


def await_own_commits(location: Any) -> bool:
    """Wait, without collectives, for what this rank can of the commits to ``location``.

    Returns True if such a commit may still run on another rank. The
    coordinator waits for its background commits to ``location`` to end
    (their outcome stays pending, for the next collective step to share);
    commits to other checkpoints are not waited for. Another rank cannot
    learn a commit's outcome without a collective step.

    Args:
        location: The checkpoint's path or URL (a reader's ``path``).
    """
    pending = _pending_to(location)
    for commit in pending:
        if commit.dist.is_coordinator:
            commit.finished.wait()
    return any(not commit.dist.is_coordinator for commit in pending)


def _pending_to(location: Any) -> list[BackgroundCommit]:
    """This rank's pending background commits whose writer writes to ``location``."""
    with _PENDING_LOCK:
        return [c for c in _PENDING if same_location(getattr(c.writer, "path", None), location)]


def failed_commit_to(location: Any) -> BaseException | None:
    """The failure of this rank's pending background commit to ``location``, if one failed. Coordinator.

    Other ranks (and commits still running) give ``None``; no waiting, no collectives.
    """
    for commit in _pending_to(location):
        if commit.dist.is_coordinator and commit.finished.is_set() and commit.commit_error is not None:
            return commit.commit_error
    return None


def raise_local_commit_failures() -> None:
    """Coordinator: raise a failed background commit not yet raised here. For saves without collectives.

    Waits for this rank's pending commits to end (their writing is over:
    only the commit runs). Each failure is raised here once; it stays
    pending, so the next collective step still raises it on every rank.
    Other ranks return at once.
    """
    with _PENDING_LOCK:
        pending = [c for c in _PENDING if c.dist.is_coordinator and not c.reported_locally]
    for commit in pending:
        commit.finished.wait()
        if commit.commit_error is not None:
            commit.reported_locally = True
            raise commit.commit_error


def raise_commit_failures(pending: list[BackgroundCommit]) -> None:
    """Coordinator: wait for these commits to end, raise the first failure. Other ranks: return at once.

    Run inside a collective step's map (the failure then raises on every rank).
    """
    for commit in pending:
        commit.outcome()


def settle_background_commits() -> None:
    """Share the outcome of commits still unconfirmed: one collective step if there are any. All ranks.

    Called first by every load with collectives and by
    ``CheckpointManager.wait`` (a save does it inside its plan step): the
    coordinator waits for its background commits to end. A failed commit
    raises on every rank (a :class:`CollectiveStepError` naming the
    coordinator and its error).
    """
    pending = take_pending_commits()
    if pending:
        pending[-1].dist.agree("background commit", lambda: raise_commit_failures(pending))
