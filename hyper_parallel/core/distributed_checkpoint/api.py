"""``save``, ``load`` and ``read_metadata``: the steps of a checkpoint, in order.

``save`` calls the save strategy registered for this package's backend and
format version; ``load`` reads the checkpoint's metadata (on every rank, one
step) and calls the load strategy registered for the backend and format
version recorded there (:mod:`.strategies`). The built-in strategies run the
steps of :mod:`._engine` and :mod:`._load_engine`: every rank plans, the coordinator merges, every
rank writes (or reads), the coordinator commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyper_parallel import platform
from hyper_parallel.core.distributed_checkpoint._background_commit import (
    await_own_commits,
    failed_commit_to,
    finish_own_saves_to,
)
from hyper_parallel.core.distributed_checkpoint._collectives import collectives_on
from hyper_parallel.core.distributed_checkpoint._engine import SaveOptions
from hyper_parallel.core.distributed_checkpoint._load_engine import LoadOptions, read_checkpoint_metadata
from hyper_parallel.core.distributed_checkpoint._gc_pause import gc_paused
from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import LayoutArgument
from hyper_parallel.core.distributed_checkpoint._storage_choice import reader_for, writer_for
from hyper_parallel.core.distributed_checkpoint.async_checkpoint import finish_async_saves_using
from hyper_parallel.core.distributed_checkpoint.errors import IncompleteCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlanner, SavePlanner
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardLoadPlanner, StandardSavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointId, StorageReader, StorageWriter
from hyper_parallel.core.distributed_checkpoint.strategies import check_load_compatible, save_strategy

__all__ = ["save", "load", "read_metadata"]


@gc_paused
def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: CheckpointId | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    remove_redundancy: bool = True,
    save_to_minimum_rank: bool = False,
    strategy_file: LayoutArgument = None,
    check_replicas: bool = True,
) -> Metadata:
    """Save ``state_dict`` as a checkpoint. All ranks call it.

    An async save of this process still running with the same
    ``storage_writer`` object is finished (committed) first: a writer holds
    one save's state at a time (a save without collectives in a job of
    several ranks refuses, with :class:`ConcurrentSaveError`, when that async
    save is a collective one). So is one still writing to the same
    checkpoint, with collectives or in a process alone (as :func:`load`
    does): the save then replaces it. A save without collectives in a job of
    several ranks does not finish it (the other ranks may not reach its
    ``result()`` step) and fails with :class:`ConcurrentSaveError`: call
    ``result()`` first.

    Args:
        state_dict: The (nested) state to save; see docs for accepted values.
        checkpoint_id: The checkpoint directory.
        storage_writer: Storage to use instead of a :class:`FileSystemWriter`.
        planner: Save planner (default :class:`StandardSavePlanner`).
        no_dist: One process, no collectives.
        use_collectives: ``False``: each rank saves alone, rank-local metadata.
        remove_redundancy: Write each replicated item once (balanced).
        save_to_minimum_rank: Give replicated items to their lowest rank.
        strategy_file: Layouts of Parameters MindSpore sliced: its strategy
            file, a list of per-stage files (or their directory), or
            ``{name: Layout}``. A Cell whose ``parameter_layout_dict`` is
            non-empty is used by itself. A Parameter with ``sliced`` set and no
            known layout is refused (:class:`SlicedParameterError`), as is one
            without ``sliced`` that its layout splits (it may be whole).
        check_replicas: Compare a digest of every replicated tensor across
            the ranks holding it; a difference fails the save naming the key
            and ranks. Applies to the default planner (a planner passed in
            keeps its own setting).

    Returns:
        The committed metadata (on every rank). On ranks other than the
        coordinator, with the filesystem and fsspec writers, it is read from
        the checkpoint when first used (the commit sends them a receipt only).

    Raises:
        CheckpointError: on every rank, if any rank failed (names the ranks); or the
            async save finished first failed and its failure was not raised yet.
    """
    writer = writer_for(checkpoint_id, storage_writer)
    collective = collectives_on(no_dist=no_dist, use_collectives=use_collectives)
    # A writer holds one save's state: never two saves at once (refused alone if finishing needs every rank).
    finish_async_saves_using(writer, collective=collective)
    # This process's async save to the same id is finished first, where every rank decides alike (see there):
    # it would hold the id's lease, and this save would fail as a concurrent one.
    finish_own_saves_to(getattr(writer, "path", None), collective=collective)
    return save_strategy().save(
        state_dict,
        storage_writer=writer,
        planner=planner or StandardSavePlanner(check_replicas=check_replicas),
        options=SaveOptions(
            no_dist=no_dist,
            use_collectives=use_collectives,
            remove_redundancy=remove_redundancy,
            save_to_minimum_rank=save_to_minimum_rank,
            strategy_file=strategy_file,
        ),
    )


@gc_paused
def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: CheckpointId | None = None,
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    strategy_file: LayoutArgument = None,
) -> None:
    """Load a checkpoint into ``state_dict`` in place. All ranks call it.

    Tensors keep their identity and dtype and receive the values of their own
    region, whatever layout or world size saved them. Non-tensor values are
    replaced in the dict. Parameters MindSpore sliced receive their own slice:
    their layouts come from ``strategy_file`` (as in :func:`save`) or from the
    ``parameter_layout_dict`` of the Cell holding them. With collectives, or
    in a process alone, an async save of this process still writing to the
    checkpoint is finished first (as its ``result()``), so a load right after
    ``async_save`` reads it. Without collectives, the coordinator waits for
    its own background commit of the checkpoint when that save's ``result()``
    has returned (no other rank is waited for).

    Raises:
        CheckpointNotFoundError: no such directory.
        IncompleteCheckpointError: the directory holds no committed checkpoint.
        MissingKeyError / ShapeMismatchError: the target does not match.
        CorruptCheckpointError: a checksum mismatch (names file and key).
    """
    options = LoadOptions(no_dist=no_dist, use_collectives=use_collectives, strategy_file=strategy_file)
    load_opened(state_dict, open_checkpoint(checkpoint_id, storage_reader, options), planner=planner)


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint whose committed metadata every rank has read once: a load of it uses that one save.

    Attributes:
        reader: The storage reader.
        options: How the load runs.
        metadata: The metadata read (the same save on every rank).
    """

    reader: StorageReader
    options: LoadOptions
    metadata: Metadata


def open_checkpoint(
    checkpoint_id: CheckpointId | None, storage_reader: StorageReader | None, options: LoadOptions
) -> OpenedCheckpoint:
    """Read the committed metadata for a load (one collective step, as :func:`load`'s first). All ranks.

    A caller that looks at the metadata before loading (``load_checkpoint``) passes the result to
    :func:`load_opened`, so what it checked is what is loaded: a save landing in between is not read.
    """
    reader = reader_for(checkpoint_id, storage_reader)
    return OpenedCheckpoint(reader=reader, options=options, metadata=read_checkpoint_metadata(reader, options))


@gc_paused
def load_opened(state_dict: dict[str, Any], opened: OpenedCheckpoint, *, planner: LoadPlanner | None) -> None:
    """:func:`load` of the save whose metadata :func:`open_checkpoint` read. All ranks."""
    strategy = check_load_compatible(opened.metadata)
    strategy.load(
        state_dict,
        storage_reader=opened.reader,
        planner=planner or StandardLoadPlanner(),
        metadata=opened.metadata,
        options=opened.options,
    )


def read_metadata(checkpoint_id: CheckpointId) -> Metadata:
    """Return a checkpoint's committed metadata. No collectives, no data read.

    On the coordinator, an async save of this process to the checkpoint is
    waited for first; if its background commit failed, the
    ``IncompleteCheckpointError`` names that failure.

    Raises:
        CheckpointNotFoundError / IncompleteCheckpointError / CorruptCheckpointError.
    """
    reader = reader_for(checkpoint_id, None)
    committing_elsewhere = await_own_commits(getattr(reader, "path", None))
    try:
        return reader.read_metadata()
    except IncompleteCheckpointError as exc:
        try:
            # A checkpoint saved with use_collectives=False has rank-local metadata only.
            return reader.read_metadata(rank=platform.get_rank())
        except IncompleteCheckpointError:
            failure = failed_commit_to(getattr(reader, "path", None))
            if failure is not None:
                raise IncompleteCheckpointError(f"{exc}; {failure}") from failure
            if not committing_elsewhere:
                raise
            raise IncompleteCheckpointError(
                f"{exc}; an async save of this process may still be committing it in the background on "
                f"rank 0 (rank {platform.get_rank()} cannot see that without a collective step): call "
                "CheckpointManager.wait() or hyper_parallel.load (on every rank) first, or read it on rank 0"
            ) from exc
