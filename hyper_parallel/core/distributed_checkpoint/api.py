"""``save``, ``load`` and ``read_metadata``: the steps of a checkpoint, in order.

``save`` calls the save strategy registered for this package's backend and
format version; ``load`` reads the checkpoint's metadata (on every rank, one
step) and calls the load strategy registered for the backend and format
version recorded there (:mod:`.strategies`). The built-in strategies run the
steps of :mod:`._engine`: every rank plans, the coordinator merges, every
rank writes (or reads), the coordinator commits.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel import platform
from hyper_parallel.core.distributed_checkpoint._engine import (
    LoadOptions,
    SaveOptions,
    read_checkpoint_metadata,
    reader_for,
    writer_for,
)
from hyper_parallel.core.distributed_checkpoint._gc_pause import gc_paused
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
) -> Metadata:
    """Save ``state_dict`` as a checkpoint. All ranks call it.

    Args:
        state_dict: The (nested) state to save; see docs for accepted values.
        checkpoint_id: The checkpoint directory.
        storage_writer: Storage to use instead of a :class:`FileSystemWriter`.
        planner: Save planner (default :class:`StandardSavePlanner`).
        no_dist: One process, no collectives.
        use_collectives: ``False``: each rank saves alone, rank-local metadata.
        remove_redundancy: Write each replicated item once (balanced).
        save_to_minimum_rank: Give replicated items to their lowest rank.

    Returns:
        The committed metadata (on every rank).

    Raises:
        CheckpointError: on every rank, if any rank failed (names the ranks).
    """
    return save_strategy().save(
        state_dict,
        storage_writer=writer_for(checkpoint_id, storage_writer),
        planner=planner or StandardSavePlanner(),
        options=SaveOptions(
            no_dist=no_dist,
            use_collectives=use_collectives,
            remove_redundancy=remove_redundancy,
            save_to_minimum_rank=save_to_minimum_rank,
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
) -> None:
    """Load a checkpoint into ``state_dict`` in place. All ranks call it.

    Tensors keep their identity and dtype and receive the values of their own
    region, whatever layout or world size saved them. Non-tensor values are
    replaced in the dict.

    Raises:
        CheckpointNotFoundError: no such directory.
        IncompleteCheckpointError: the directory holds no committed checkpoint.
        MissingKeyError / ShapeMismatchError: the target does not match.
        CorruptCheckpointError: a checksum mismatch (names file and key).
    """
    reader = reader_for(checkpoint_id, storage_reader)
    options = LoadOptions(no_dist=no_dist, use_collectives=use_collectives)
    metadata = read_checkpoint_metadata(reader, options)
    strategy = check_load_compatible(metadata)
    strategy.load(
        state_dict,
        storage_reader=reader,
        planner=planner or StandardLoadPlanner(),
        metadata=metadata,
        options=options,
    )


def read_metadata(checkpoint_id: CheckpointId) -> Metadata:
    """Return a checkpoint's committed metadata. No collectives, no data read.

    Raises:
        CheckpointNotFoundError / IncompleteCheckpointError / CorruptCheckpointError.
    """
    reader = reader_for(checkpoint_id, None)
    try:
        return reader.read_metadata()
    except IncompleteCheckpointError:
        # A checkpoint saved with use_collectives=False has rank-local metadata only.
        return reader.read_metadata(rank=platform.get_rank())
