"""Replicas of an import: the other ranks' copies of a stored box, compared with what the import writes.

A box the strategy gives several ranks (and a tensor the strategy does not
list, held whole by several ranks) is stored from its lowest rank's copy; the
other copies must hold the same bytes, else the import is refused (a
:class:`LayoutError` naming the parameter, the box and the ranks). The other
ranks' copies are read once, while the import is planned (:func:`box_copies`
keeps their block digests, 16 bytes per MiB). A box of at most
:data:`PLAN_CHECK_BYTES` (a ``global_step``, a bias) is compared there, its
stored copy read too (:func:`check_copies_while_planning`; it costs little),
so the usual mismatch, rank files of different steps, is refused before a
byte is written. A larger box is compared there by a sample:
:data:`SAMPLE_PAGES` pages spread over it, of the stored copy (read from the
device once: the writer finds them in the page cache) and of the other copies
(read whole already); the other copies are compared with each other whole.
Slices of another layout (a strategy that is not the job's) differ all over,
so a wrong strategy is refused before a byte is written. The whole box is
compared as it is written: :class:`ReplicaCheckingWriter` takes the same
block digests of the bytes it writes and compares them before the commit
(nothing committed, its data files removed), so its stored copy is not read a
second time to be compared whole.
"""

from __future__ import annotations

import mmap
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Mapping, Sequence

from hyper_parallel.cli._ms_files import MsFile
from hyper_parallel.core.distributed_checkpoint._format.checksum import (
    DEFAULT_BLOCK_BYTES,
    digest,
    flat_digests,
    flat_expected,
)
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError, LayoutError
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointId, WriteResult

__all__ = ["PLAN_CHECK_BYTES", "SAMPLE_PAGES", "BoxCopies", "box_copies", "check_copies_while_planning",
           "check_written_copies", "differing_ranks", "sample_starts", "ReplicaCheckingWriter"]

#: A listed box of at most this many bytes (one checksum block: biases, norms, a small share of a model's bytes)
#: has its copies compared while the import is planned, its stored copy read there and again when written.
PLAN_CHECK_BYTES = DEFAULT_BLOCK_BYTES
#: Pages of a larger box compared while the import is planned, spread evenly over it (64 KiB of a box of more
#: than 1 MiB, read from the device once: the writer finds them in the page cache).
SAMPLE_PAGES = 16


@dataclass(frozen=True)
class BoxCopies:
    """The copies of one stored box that other ranks hold, by the block digests of their bytes.

    Attributes:
        fqn: The parameter.
        offsets: Global offset of the box (its chunk's key in the checkpoint).
        global_shape: Shape of the global tensor.
        listed: The strategy lists the parameter (the box is a slice of its
            layout); else a tensor held whole by every rank holding it.
        stored_rank: The rank whose copy is stored.
        files: Rank -> its file, the stored rank first.
        digests: Rank -> the digests of its copy's flat blocks of
            :data:`DEFAULT_BLOCK_BYTES` (the checksum blocks of
            :class:`ReplicaCheckingWriter`), every rank but the stored one.
        starts: Where the sample pages lie in the box's bytes
            (:func:`sample_starts`); empty for a box compared whole while planning.
        samples: Rank -> the digest of its copy's sample pages, every rank but the stored one.
    """

    fqn: str
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    listed: bool
    stored_rank: int
    files: Mapping[int, MsFile]
    digests: Mapping[int, tuple[str, ...]]
    starts: tuple[int, ...] = ()
    samples: Mapping[int, str] | None = None


def sample_starts(nbytes: int, base: int) -> tuple[int, ...]:
    """Where :data:`SAMPLE_PAGES` pages spread evenly over a box of ``nbytes`` (more than that many pages) start,
    in its bytes; each on a page of the file the box starts at ``base`` in (the first at the box's start)."""
    page = mmap.PAGESIZE
    targets = (i * (nbytes - page) // (SAMPLE_PAGES - 1) for i in range(SAMPLE_PAGES))
    return tuple(max(0, (base + target) // page * page - base) for target in targets)


def box_copies(
    fqn: str, offsets: tuple[int, ...], global_shape: tuple[int, ...], ranks: Sequence[int],
    files: Mapping[int, MsFile], *, listed: bool,
) -> BoxCopies:
    """Read the copies of ``fqn`` of ``ranks[1:]`` once each (its crc accounted) and keep their digests, and those
    of their sample pages for a box of more than :data:`PLAN_CHECK_BYTES`.

    ``ranks[0]`` holds the copy stored; it is not read here.
    """
    stored = files[ranks[0]].entries[fqn]
    starts = sample_starts(stored.nbytes, stored.segments[0][0]) if stored.nbytes > PLAN_CHECK_BYTES else ()
    digests, samples = {}, {}
    for rank in ranks[1:]:
        data = memoryview(files[rank].raw(fqn))
        digests[rank] = flat_digests(data, DEFAULT_BLOCK_BYTES)
        samples[rank] = digest(b"".join(data[start:start + mmap.PAGESIZE] for start in starts))
    return BoxCopies(fqn, offsets, global_shape, listed, ranks[0], {rank: files[rank] for rank in ranks}, digests,
                     starts, samples)


def _copy_digests(file: MsFile, fqn: str) -> tuple[str, ...]:
    """The digests of the flat blocks of ``file``'s copy of ``fqn``, read here (its crc accounted)."""
    return flat_digests(memoryview(file.raw(fqn)), DEFAULT_BLOCK_BYTES)


#: A box whose copies differ: the box, the rank its copies were compared with, and the ranks whose copy differs.
_Mismatch = tuple[BoxCopies, int, list[int]]


def differing_ranks(copies: BoxCopies, stored: tuple[str, ...]) -> list[int]:
    """The ranks whose copy differs from the stored one, whose flat block digests are ``stored``."""
    return sorted(rank for rank, digests in copies.digests.items() if digests != stored)


def _files(copies: BoxCopies, ranks: Sequence[int]) -> str:
    """The files of ``ranks`` (at most four), for a message."""
    shown = ", ".join(f"rank {rank} {copies.files[rank].path}" for rank in ranks[:4])
    return shown + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")


def _refusal(copies: BoxCopies, reference: int, differ: Sequence[int]) -> str:
    """The message of a refused box whose copies on ``differ`` differ from ``reference``'s."""
    first = copies.files[copies.stored_rank].entries[copies.fqn]
    files = _files(copies, [reference, *differ])
    if not copies.listed:
        return (
            f"parameter '{copies.fqn}' is not in the strategy file but ranks {list(differ)} hold other values than "
            f"rank {reference} ({first.dtype} {list(first.shape)} on each; files: {files}), so it is no replica: "
            f"either it is sliced (slices of one shape; rank {reference}'s would be stored as the whole tensor): "
            "pass the strategy file(s) that list it with --strategy (one per pipeline stage), not --whole-tensors; or "
            "the rank files are of different steps (a global_step, a learning rate): take every rank's file of one step"
        )
    return (f"ranks {list(differ)} hold other values than rank {reference} for the box at {list(copies.offsets)} "
            f"(files: {files})")


def check_copies_while_planning(all_copies: Sequence[BoxCopies]) -> list[BoxCopies]:
    """Compare now the copies of the boxes of at most :data:`PLAN_CHECK_BYTES`, their stored copy read here; of
    the larger boxes, the sample pages of every copy (the stored copy's read here) and the other copies with each
    other. Return the larger boxes, to be compared whole as they are written. The importing process, while it
    plans.

    Raises:
        LayoutError: copies that differ, for the first parameter (by name) holding some: every box of it named.
        CorruptCheckpointError: copies differ and a file involved fails its stored crc (damage, not a strategy or
            step problem).
    """
    mismatches: list[_Mismatch] = []
    later = []
    for copies in all_copies:
        if not copies.starts:
            stored = _copy_digests(copies.files[copies.stored_rank], copies.fqn)
            mismatches.append((copies, copies.stored_rank, differing_ranks(copies, stored)))
            continue
        later.append(copies)
        sample = digest(copies.files[copies.stored_rank].peek(copies.fqn, copies.starts, mmap.PAGESIZE))
        differ = sorted(rank for rank, other in (copies.samples or {}).items() if other != sample)
        if not differ:  # the others, whole, with the lowest of them
            reference = min(copies.digests)
            mismatches.append((copies, reference, differing_ranks(copies, copies.digests[reference])))
            continue
        mismatches.append((copies, copies.stored_rank, differ))
    _refuse(mismatches)
    return later


def check_written_copies(all_copies: Sequence[BoxCopies], results: Sequence[WriteResult]) -> None:
    """Compare every box's other copies with the checksums of the stored copy just written. The importing process.

    Raises:
        LayoutError: copies that differ, for the first parameter (by name) holding some: every box of it named.
        CorruptCheckpointError: copies differ and a file involved fails its stored crc.
    """
    written = {(result.index.fqn, result.index.offset): result.storage_data.checksum for result in results}
    _refuse([(copies, copies.stored_rank,
              differing_ranks(copies, flat_expected(written[(copies.fqn, copies.offsets)])))
             for copies in all_copies])


def _refuse(mismatches: Sequence[_Mismatch]) -> None:
    """Refuse the first parameter (by name) one of whose boxes has copies that differ (a non-empty list of ranks
    of ``mismatches``); first check the crc of the files involved."""
    problems: dict[str, list[_Mismatch]] = {}
    for copies, reference, differ in mismatches:
        if differ:
            problems.setdefault(copies.fqn, []).append((copies, reference, differ))
    if not problems:
        return
    for copies, reference, differ in (box for boxes in problems.values() for box in boxes):
        for rank in (reference, *differ):
            copies.files[rank].check_crc_except(set())
    fqn = min(problems)
    boxes = problems[fqn]
    if not boxes[0][0].listed:
        raise LayoutError(_refusal(*boxes[0]))
    raise LayoutError(
        f"parameter '{fqn}' (global shape {list(boxes[0][0].global_shape)}): the strategy makes replicas of ranks' "
        f"slices that differ: {'; '.join(_refusal(*box) for box in boxes)}. Either the strategy file is not the "
        "one of the job that wrote these files (pass that job's strategy file(s), one per pipeline stage), or the "
        "rank files are of different steps (take every rank's file of one step)"
    )


class ReplicaCheckingWriter(FileSystemWriter):
    """A :class:`FileSystemWriter` that compares the replicas of what it wrote before the save commits.

    Single process (the import). Its checksum blocks are the digests' blocks.

    Args:
        path: The checkpoint directory.
        copies: Every box whose other copies are to be compared.
    """

    def __init__(self, path: CheckpointId, copies: Sequence[BoxCopies]) -> None:
        super().__init__(path, checksum_block_bytes=DEFAULT_BLOCK_BYTES)
        self._copies = tuple(copies)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[list[WriteResult]]":
        """Write, then compare the replicas with the written checksums; a difference fails the write.

        The save then aborts: its data files are removed, nothing is committed.
        """
        future = super().write_data(plan, planner)
        if future.exception() is not None or not self._copies:
            return future
        try:
            check_written_copies(self._copies, future.result())
        except CheckpointError as exc:
            failed: Future[list[WriteResult]] = Future()
            failed.set_exception(exc)
            return failed
        return future
