"""Replicas of an import: the other ranks' copies of a stored box, compared with what the import writes.

A box the strategy gives several ranks (and a tensor the strategy does not
list, held whole by several ranks) is stored from its lowest rank's copy; the
other copies must hold the same bytes, else the import is refused (a
:class:`LayoutError` naming the parameter, the box and the ranks). The other
ranks' copies are read once, while the import is planned (:func:`box_copies`
keeps their block digests, 16 bytes per MiB). A tensor the strategy does not
list and a box of at most :data:`PLAN_CHECK_BYTES` are compared there, their
stored copy read too (:func:`check_small_copies`; it costs little), so the
usual mismatch, rank files of different steps (a ``global_step``), is
refused before a byte is written. A larger box is compared as it is written:
:class:`ReplicaCheckingWriter` takes the same block digests of the bytes it
writes and compares them before the commit (nothing committed, its data files
removed), so its stored copy is not read a second time to be compared.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Mapping, Sequence

from hyper_parallel.cli._ms_files import MsFile
from hyper_parallel.core.distributed_checkpoint._format.checksum import DEFAULT_BLOCK_BYTES, flat_digests, flat_expected
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError, LayoutError
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointId, WriteResult

__all__ = ["PLAN_CHECK_BYTES", "BoxCopies", "box_copies", "check_small_copies", "check_written_copies",
           "differing_ranks", "ReplicaCheckingWriter"]

#: A listed box of at most this many bytes (one checksum block: biases, norms, a small share of a model's bytes)
#: has its copies compared while the import is planned, its stored copy read there and again when written.
PLAN_CHECK_BYTES = DEFAULT_BLOCK_BYTES


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
    """

    fqn: str
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    listed: bool
    stored_rank: int
    files: Mapping[int, MsFile]
    digests: Mapping[int, tuple[str, ...]]


def box_copies(
    fqn: str, offsets: tuple[int, ...], global_shape: tuple[int, ...], ranks: Sequence[int],
    files: Mapping[int, MsFile], *, listed: bool,
) -> BoxCopies:
    """Read the copies of ``fqn`` of ``ranks[1:]`` once each (its crc accounted) and keep their digests.

    ``ranks[0]`` holds the copy stored; it is not read here.
    """
    digests = {rank: _copy_digests(files[rank], fqn) for rank in ranks[1:]}
    return BoxCopies(fqn, offsets, global_shape, listed, ranks[0], {rank: files[rank] for rank in ranks}, digests)


def _copy_digests(file: MsFile, fqn: str) -> tuple[str, ...]:
    """The digests of the flat blocks of ``file``'s copy of ``fqn``, read here (its crc accounted)."""
    return flat_digests(memoryview(file.raw(fqn)), DEFAULT_BLOCK_BYTES)


def differing_ranks(copies: BoxCopies, stored: tuple[str, ...]) -> list[int]:
    """The ranks whose copy differs from the stored one, whose flat block digests are ``stored``.

    Raises:
        CorruptCheckpointError: copies differ and one of the files involved fails its stored crc (damage, not a
            strategy or step problem).
    """
    differ = sorted(rank for rank, digests in copies.digests.items() if digests != stored)
    for rank in (copies.stored_rank, *differ) if differ else ():
        copies.files[rank].check_crc_except(set())
    return differ


def _refusal(copies: BoxCopies, differ: Sequence[int]) -> str:
    """The message of a refused box whose copies on ``differ`` differ from the stored rank's."""
    first = copies.files[copies.stored_rank].entries[copies.fqn]
    if not copies.listed:
        return (
            f"parameter '{copies.fqn}' is not in the strategy file but ranks {list(differ)} hold other values than "
            f"rank {copies.stored_rank} ({first.dtype} {list(first.shape)} on each), so it is no replica: either it "
            f"is sliced (slices of one shape; rank {copies.stored_rank}'s would be stored as the whole tensor): pass "
            "the strategy file(s) that list it (one per pipeline stage); or the rank files are of different steps "
            "(a global_step, a learning rate): take every rank's file of one step"
        )
    return (f"ranks {list(differ)} hold other values than rank {copies.stored_rank} for the box at "
            f"{list(copies.offsets)}")


def check_small_copies(all_copies: Sequence[BoxCopies]) -> list[BoxCopies]:
    """Compare now the copies of the unlisted tensors and of the boxes of at most :data:`PLAN_CHECK_BYTES`, their
    stored copy read here; return the other boxes, to be compared as they are written. The importing process, while
    it plans.

    Raises:
        LayoutError: copies that differ, for the first parameter (by name) holding some: every box of it named.
        CorruptCheckpointError: a file involved fails its stored crc.
    """
    now = [copies for copies in all_copies if not copies.listed
           or copies.files[copies.stored_rank].entries[copies.fqn].nbytes <= PLAN_CHECK_BYTES]
    stored = {(copies.fqn, copies.offsets): _copy_digests(copies.files[copies.stored_rank], copies.fqn)
              for copies in now}
    _refuse_differing(now, stored)
    return [copies for copies in all_copies if (copies.fqn, copies.offsets) not in stored]


def check_written_copies(all_copies: Sequence[BoxCopies], results: Sequence[WriteResult]) -> None:
    """Compare every box's other copies with the checksums of the stored copy just written. The importing process.

    Raises:
        LayoutError: copies that differ, for the first parameter (by name) holding some: every box of it named.
        CorruptCheckpointError: a file involved fails its stored crc.
    """
    written = {(result.index.fqn, result.index.offset): result.storage_data.checksum for result in results}
    _refuse_differing(all_copies, {(copies.fqn, copies.offsets): flat_expected(written[(copies.fqn, copies.offsets)])
                                   for copies in all_copies})


def _refuse_differing(all_copies: Sequence[BoxCopies], stored: Mapping[tuple[str, tuple[int, ...]], tuple[str, ...]]
                      ) -> None:
    """Refuse the first parameter (by name) one of whose boxes has copies that differ from the stored copy, whose
    flat block digests ``stored`` holds by (parameter, offsets)."""
    problems: dict[str, list[tuple[BoxCopies, list[int]]]] = {}
    for copies in all_copies:
        differ = differing_ranks(copies, stored[(copies.fqn, copies.offsets)])
        if differ:
            problems.setdefault(copies.fqn, []).append((copies, differ))
    if not problems:
        return
    fqn = min(problems)
    boxes = problems[fqn]
    if not boxes[0][0].listed:
        raise LayoutError(_refusal(*boxes[0]))
    raise LayoutError(
        f"parameter '{fqn}' (global shape {list(boxes[0][0].global_shape)}): the strategy makes replicas of ranks' "
        f"slices that differ: {'; '.join(_refusal(c, d) for c, d in boxes)}. Either the strategy file is not the "
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
