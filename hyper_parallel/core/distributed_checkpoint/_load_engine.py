"""The steps of a load, in order: the one place they run.

:func:`read_checkpoint_metadata` first (every rank reads the committed
metadata, after the outcome of an earlier async save's background commit is
shared), then :func:`run_load`: every rank plans the regions it needs, every
rank verifies every byte it will read, then reads them into its tensors in
place, in rounds when the planner shares reads between ranks.

Every step runs through :class:`._collectives.DistWrapper`, so a failure on
any rank raises the same error on every rank. This module knows storage only
through the :class:`.StorageReader` methods.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hyper_parallel import platform
from hyper_parallel.core.distributed_checkpoint._background_commit import (
    await_own_commits,
    finish_own_saves_to,
    settle_background_commits,
)
from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper
from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import (
    LayoutArgument,
    apply_mindspore_layouts,
    copy_back_values,
)
from hyper_parallel.core.distributed_checkpoint._one_checkpoint import one_save_read, sent_with_location
from hyper_parallel.core.distributed_checkpoint._storage_choice import rank_alone
from hyper_parallel.core.distributed_checkpoint.filesystem_reader import FileSystemReader
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardLoadPlanner
from hyper_parallel.core.distributed_checkpoint.storage import StorageReader
from hyper_parallel.core.distributed_checkpoint._whole_reads import WholeReadPlan

__all__ = ["LoadOptions", "read_checkpoint_metadata", "settle_before_load", "run_load"]



@dataclass(frozen=True)
class LoadOptions:
    """How a load runs (the arguments of ``dcp.load`` besides state and storage).

    Attributes:
        no_dist: One process, no collectives.
        use_collectives: ``False``: each rank loads alone (rank-local metadata first).
        strategy_file: Layouts of Parameters MindSpore sliced (``strategy_file=``).
    """

    no_dist: bool = False
    use_collectives: bool = True
    strategy_file: LayoutArgument = None


def settle_before_load(*, collective: bool, location: Any = None) -> None:
    """Share the outcome of earlier async saves' background commits before a load reads. All ranks.

    ``collective``: whether the load runs its steps with collectives (its
    :class:`._collectives.DistWrapper`'s ``use_dist``). A load with
    collectives first finishes this process's async save still writing to
    ``location`` (the checkpoint it loads; the collective step of its
    ``result()``, reached by every rank in the same load: each rank started
    that save), then runs :func:`settle_background_commits`: a step saved
    just before is then committed on every rank, or its failure raises on
    every rank. So a load right after ``async_save`` reads that save. A
    process alone (a world of one) finishes its save to ``location`` too:
    its ``result()`` needs no other rank. Otherwise, without collectives, no
    save is finished (another rank may not reach that save's collective
    step), but the coordinator waits for its own background commits to
    ``location`` whose ``result()`` returned (every rank's data and results
    record are written then: no other rank is waited for), as :func:`~.api.read_metadata` does:
    a load of its own just after ``async_save(...).result()`` reads that save,
    not the one before. Their outcome stays for the next collective step.
    """
    finish_own_saves_to(location, collective=collective)
    if collective:
        settle_background_commits()
    else:
        await_own_commits(location)


def read_checkpoint_metadata(reader: StorageReader, options: LoadOptions) -> Metadata:
    """Read the committed metadata on every rank (a step: one rank's failure fails all). All ranks.

    First shares the outcome of an earlier async save's background commit
    (:func:`settle_background_commits`): a step saved just before is committed.
    """
    dist = DistWrapper(use_dist=not options.no_dist and options.use_collectives)
    settle_before_load(collective=dist.use_dist, location=getattr(reader, "path", None))
    rank = rank_alone(options.no_dist, options.use_collectives)
    found: list[Metadata] = []

    def read() -> str | None:
        found.append(reader.read_metadata(rank=rank))
        return getattr(found[0].storage_meta, "save_id", None)

    # Each rank reads the metadata itself: a save that commits between two ranks' reads (its cleanup not done
    # yet, or the old files kept open) would have them load two saves, a mix no checksum tells. Only the save ids
    # travel (to the coordinator), as the failures of an agree step would.
    dist.reduce_scatter("read metadata", sent_with_location(reader, read), one_save_read)
    return found[0]


def run_load(
    state_dict: dict[str, Any],
    *,
    reader: StorageReader,
    planner: LoadPlanner,
    metadata: Metadata,
    options: LoadOptions,
) -> None:
    """Plan and read a load into ``state_dict`` in place. All ranks call it.

    The reader's ``finish_load`` runs last, whether the load succeeded or not.
    """
    try:
        _plan_and_read(state_dict, reader=reader, planner=planner, metadata=metadata, options=options)
    finally:
        reader.finish_load()


def _plan_and_read(
    state_dict: dict[str, Any],
    *,
    reader: StorageReader,
    planner: LoadPlanner,
    metadata: Metadata,
    options: LoadOptions,
) -> None:
    """The steps of :func:`run_load`. All ranks."""
    dist = DistWrapper(use_dist=not options.no_dist and options.use_collectives)
    local_plans: list[LoadPlan] = []
    targets: list[dict[str, Any]] = []

    def local_step() -> LoadPlan:
        reader.set_up_storage_reader(metadata, dist.is_coordinator)
        targets.append(apply_mindspore_layouts(state_dict, source=options.strategy_file, rank=platform.get_rank()))
        planner.configure_planner(
            targets[0], metadata, rank=dist.rank, world_size=dist.world_size, is_coordinator=dist.is_coordinator
        )
        local_plans.append(reader.prepare_local_plan(planner.build_local_plan()))
        return local_plans[0]

    def global_step(all_plans: list[LoadPlan]) -> list[Any]:
        final = reader.prepare_global_plan(planner.build_global_plan(all_plans))
        return [None if f is p else f for f, p in zip(final, all_plans)]

    if _plans_stay_local(planner, reader):
        # The coordinator would hand every rank its own plan back: only failures travel.
        dist.agree("load plan", local_step)
        received = None
    else:
        received = dist.reduce_scatter("load plan", local_step, global_step)
    plan = planner.finalize_plan(received if received is not None else local_plans[0])
    # Every rank verifies every byte it will read before any rank copies one:
    # a corrupt checkpoint fails the load with every target unchanged.
    # Then the values: one that cannot be decoded fails the load before any tensor lands (all or nothing).
    values = planner.value_reads(plan)

    def verify_step() -> None:
        reader.verify_data(plan).result()
        if values.items:
            reader.read_data(values, planner).result()

    dist.agree("verify", verify_step)
    rounds = _without(planner.read_rounds(plan), values.items)
    for index, round_plan in enumerate(rounds):
        _read_round(dist, reader, planner, round_plan, index, last=index == len(rounds) - 1)
    if targets[0] is not state_dict:
        copy_back_values(targets[0], state_dict)


def _without(rounds: list[LoadPlan], taken: tuple[ReadItem, ...]) -> list[LoadPlan]:
    """``rounds`` without the items already read (the values): every byte is read once.

    A plan of columns (:class:`.WholeReadPlan`) drops them from its other items and keeps its columns (no item
    made). Another plan holding none of them is kept as it is (the reader keeps its grouping of the verified
    plan for it).
    """
    if not taken:
        return rounds
    ids = {id(item) for item in taken}
    kept: list[LoadPlan] = []
    for plan in rounds:
        if type(plan) is WholeReadPlan:  # pylint: disable=unidiomatic-typecheck
            kept.append(plan.without(ids))
        elif any(id(item) in ids for item in plan.items):
            kept.append(dataclasses.replace(plan, items=tuple(item for item in plan.items if id(item) not in ids)))
        else:
            kept.append(plan)
    return kept


def _plans_stay_local(planner: LoadPlanner, reader: StorageReader) -> bool:
    """Whether the load plan's global step returns every rank's plan unchanged.

    True for the standard load planner without shared reads and a reader whose
    global step changes nothing (the filesystem and fsspec readers): then no
    plan needs to go to the coordinator.
    """
    return (
        type(planner) is StandardLoadPlanner  # pylint: disable=unidiomatic-typecheck
        and not planner.shares_reads
        and type(reader).prepare_global_plan is FileSystemReader.prepare_global_plan
    )


def _read_round(
    dist: DistWrapper, reader: StorageReader, planner: LoadPlanner, plan: LoadPlan, index: int, *, last: bool
) -> None:
    """Read one round; a planner that shares reads then hands regions between ranks. All ranks."""

    def read_step() -> None:
        reader.read_data(plan, planner).result()
        if last and not planner.shares_reads:
            planner.finish_load()

    dist.agree("read", read_step)
    if not planner.shares_reads:
        return
    shared = dist.all_gather("share reads", lambda: planner.outgoing(index))

    def receive_step() -> None:
        merged: dict[int, Any] = {}
        for payload in shared:
            merged.update(payload)
        planner.incoming(index, merged)
        if last:
            planner.finish_load()

    dist.agree("receive reads", receive_step)
