"""``save``, ``load`` and ``read_metadata``: the steps of a checkpoint, in order.

Save: every rank plans its items; the coordinator merges the plans
(deduplication, validation, metadata) and hands every rank its final plan;
every rank writes durably; the coordinator commits; every rank returns only
after the commit. Load: every rank reads the metadata, plans the regions it
needs, reads them into its tensors in place. Each step runs through
:class:`._collectives.DistWrapper`, so a failure on any rank raises the same
error on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hyper_parallel import platform
from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper
from hyper_parallel.core.distributed_checkpoint._fsspec_reader import FsspecReader
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import FsspecWriter
from hyper_parallel.core.distributed_checkpoint._gc_pause import gc_paused
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.filesystem_reader import FileSystemReader
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemWriter, rank_metadata_file
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardLoadPlanner, StandardSavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointId, StorageReader, StorageWriter
from hyper_parallel.core.distributed_checkpoint.strategies import check_load_compatible

__all__ = ["save", "load", "read_metadata", "SaveSession", "prepare_save", "run_save_writes"]


@dataclass(frozen=True)
class _PlanDelta:
    """A rank's final plan as positions in its own local plan (small to send)."""

    keep: bytes
    storage_data: Any
    planner_data: Any


def _compress(local: SavePlan, final: SavePlan) -> _PlanDelta | SavePlan:
    positions = {item: position for position, item in enumerate(local.items)}
    mask = bytearray((len(local.items) + 7) // 8)
    for item in final.items:
        position = positions.get(item)
        if position is None:
            return final
        mask[position // 8] |= 1 << (position % 8)
    return _PlanDelta(keep=bytes(mask), storage_data=final.storage_data, planner_data=final.planner_data)


def _expand(local: SavePlan, received: _PlanDelta | SavePlan) -> SavePlan:
    if isinstance(received, SavePlan):
        return received
    items = tuple(item for position, item in enumerate(local.items) if received.keep[position // 8] >> (position % 8) & 1)
    return SavePlan(items=items, storage_data=received.storage_data, planner_data=received.planner_data)


#: Storage picked from the checkpoint id alone, in order: the first whose ``validate_checkpoint_id`` accepts it.
_WRITERS: tuple[type[StorageWriter], ...] = (FileSystemWriter, FsspecWriter)
_READERS: tuple[type[StorageReader], ...] = (FileSystemReader, FsspecReader)


def _storage_for(checkpoint_id: CheckpointId | None, storage: Any, kinds: tuple[type, ...], verb: str) -> Any:
    """The caller's storage (reset to ``checkpoint_id``), or the backend that accepts the id."""
    if storage is not None:
        if checkpoint_id is not None:
            storage.reset(checkpoint_id)
        return storage
    kind = "storage_writer" if verb == "save" else "storage_reader"
    if checkpoint_id is None:
        raise CheckpointValueError(f"{verb} needs a checkpoint_id (a directory path or s3:// URL) or a {kind}")
    for backend in kinds:
        if backend.validate_checkpoint_id(checkpoint_id):
            return backend(checkpoint_id)
    raise CheckpointValueError(
        f"checkpoint_id {checkpoint_id!r} is neither a filesystem path nor a URL; pass a directory path, an "
        f"s3://bucket/prefix URL or a {kind}"
    )


def _writer_for(checkpoint_id: CheckpointId | None, storage_writer: StorageWriter | None) -> StorageWriter:
    return _storage_for(checkpoint_id, storage_writer, _WRITERS, "save")


def _reader_for(checkpoint_id: CheckpointId | None, storage_reader: StorageReader | None) -> StorageReader:
    return _storage_for(checkpoint_id, storage_reader, _READERS, "load")


def _use_rank_metadata(reader: StorageReader) -> None:
    """Read this rank's rank-local metadata when the checkpoint has it (``use_collectives=False`` saves)."""
    local_name = rank_metadata_file(platform.get_rank())
    if isinstance(reader, FsspecReader):
        if not reader.has_object(reader.metadata_file) and reader.has_object(local_name):
            reader.metadata_file = local_name
    elif isinstance(reader, FileSystemReader):
        if not os.path.isfile(os.path.join(reader.path, reader.metadata_file)) and os.path.isfile(
            os.path.join(reader.path, local_name)
        ):
            reader.metadata_file = local_name


@dataclass
class SaveSession:
    """A save between planning and writing (used by ``save`` and ``async_save``).

    Attributes:
        dist: The step runner.
        writer: The storage writer.
        planner: The save planner (its cache holds the tensors to write).
        plan: This rank's final plan.
        metadata: The metadata built by the coordinator (``None`` elsewhere).
    """

    dist: DistWrapper
    writer: StorageWriter
    planner: SavePlanner
    plan: SavePlan
    metadata: Metadata | None


def prepare_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: CheckpointId | None,
    storage_writer: StorageWriter | None,
    planner: SavePlanner | None,
    no_dist: bool,
    use_collectives: bool,
    remove_redundancy: bool,
    save_to_minimum_rank: bool,
) -> SaveSession:
    """Plan a save on every rank (the collective part before writing). All ranks."""
    writer = _writer_for(checkpoint_id, storage_writer)
    planner = planner or StandardSavePlanner()
    dist = DistWrapper(use_dist=not no_dist and use_collectives)
    real_rank = platform.get_rank() if not no_dist else 0
    if not use_collectives and not no_dist and isinstance(writer, FileSystemWriter):
        writer.rank_local = platform.get_world_size() > 1
    holder: dict[str, Any] = {}

    def local_step() -> SavePlan:
        writer.set_up_storage_writer(dist.is_coordinator, rank=dist.rank if dist.use_dist else real_rank,
                                     world_size=dist.world_size)
        planner.configure_planner(
            state_dict,
            rank=dist.rank,
            world_size=dist.world_size,
            is_coordinator=dist.is_coordinator,
            remove_redundancy=remove_redundancy,
            save_to_minimum_rank=save_to_minimum_rank,
        )
        local = writer.prepare_local_plan(planner.build_local_plan())
        holder["local"] = local
        return local

    def global_step(all_plans: list[SavePlan]) -> list[Any]:
        final_plans, metadata = planner.build_global_plan(all_plans)
        final_plans = writer.prepare_global_plan(final_plans)
        holder["metadata"] = metadata
        return [_compress(local, final) for local, final in zip(all_plans, final_plans)]

    try:
        received = dist.reduce_scatter("plan", local_step, global_step)
        plan = planner.finalize_plan(_expand(holder["local"], received))
    except BaseException:
        writer.abort()
        raise
    return SaveSession(dist=dist, writer=writer, planner=planner, plan=plan, metadata=holder.get("metadata"))


def run_save_writes(session: SaveSession, step: str = "write") -> Metadata:
    """Write on every rank, commit on the coordinator, return the metadata. All ranks."""

    def write_step() -> Any:
        return session.writer.write_data(session.plan, session.planner).result()

    def commit_step(all_results: list[Any]) -> list[Metadata]:
        committed = session.writer.finish(session.metadata, all_results)
        return [committed] * len(all_results)

    try:
        return session.dist.reduce_scatter(step, write_step, commit_step)
    except BaseException:
        session.writer.abort()
        raise


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
        checkpoint_id: The checkpoint directory, or ``s3://bucket/prefix``
            (object storage through fsspec, see :class:`FsspecWriter`).
        storage_writer: Storage to use instead of the one picked from ``checkpoint_id``.
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
    session = prepare_save(
        state_dict,
        checkpoint_id=checkpoint_id,
        storage_writer=storage_writer,
        planner=planner,
        no_dist=no_dist,
        use_collectives=use_collectives,
        remove_redundancy=remove_redundancy,
        save_to_minimum_rank=save_to_minimum_rank,
    )
    return run_save_writes(session)


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
    reader = _reader_for(checkpoint_id, storage_reader)
    planner = planner or StandardLoadPlanner()
    dist = DistWrapper(use_dist=not no_dist and use_collectives)
    if not use_collectives and not no_dist:
        _use_rank_metadata(reader)

    def metadata_step() -> None:
        metadata = reader.read_metadata()
        check_load_compatible(metadata)
        holder["metadata"] = metadata

    holder: dict[str, Any] = {}
    dist.all_gather("read metadata", metadata_step)
    metadata = holder["metadata"]

    def local_step() -> LoadPlan:
        reader.set_up_storage_reader(metadata, dist.is_coordinator)
        planner.configure_planner(
            state_dict, metadata, rank=dist.rank, world_size=dist.world_size, is_coordinator=dist.is_coordinator
        )
        local = reader.prepare_local_plan(planner.build_local_plan())
        holder["local"] = local
        return local

    def global_step(all_plans: list[LoadPlan]) -> list[Any]:
        final = reader.prepare_global_plan(planner.build_global_plan(all_plans))
        return [None if f is p else f for f, p in zip(final, all_plans)]

    received = dist.reduce_scatter("load plan", local_step, global_step)
    plan = planner.finalize_plan(received if received is not None else holder["local"])

    rounds = planner.read_rounds(plan)
    for index, round_plan in enumerate(rounds):
        last = index == len(rounds) - 1

        def read_step(round_plan: LoadPlan = round_plan, last: bool = last) -> None:
            reader.read_data(round_plan, planner).result()
            if last and not planner.shares_reads:
                planner.finish_load()

        dist.all_gather("read", read_step)
        if planner.shares_reads:
            shared = dist.all_gather("share reads", lambda index=index: planner.outgoing(index))

            def receive_step(index: int = index, last: bool = last) -> None:
                merged: dict[int, Any] = {}
                for payload in shared:
                    merged.update(payload)
                planner.incoming(index, merged)
                if last:
                    planner.finish_load()

            dist.all_gather("receive reads", receive_step)


def read_metadata(checkpoint_id: CheckpointId) -> Metadata:
    """Return a checkpoint's committed metadata. No collectives, no data read.

    Raises:
        CheckpointNotFoundError / IncompleteCheckpointError / CorruptCheckpointError.
    """
    reader = _reader_for(checkpoint_id, None)
    _use_rank_metadata(reader)
    return reader.read_metadata()
