"""Drive the save and load steps for ranks 0..N-1 in one process.

This is the planner protocol of ``dcp.save`` run by hand: every simulated rank
plans, the coordinator (rank 0) merges, every rank writes, rank 0 commits.
It lets unit tests check planning and resharding without launching msrun.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyper_parallel.core.distributed_checkpoint._engine import finalize_rank_plan, rank_indexes as rank_indexes_of
from hyper_parallel.core.distributed_checkpoint._index_plan import plan_index
from hyper_parallel.core.distributed_checkpoint import (
    FileSystemWriter,
    Metadata,
    SavePlan,
    StandardSavePlanner,
)

__all__ = ["simulate_save", "plan_ranks"]


def plan_ranks(
    states: list[dict[str, Any]],
    *,
    remove_redundancy: bool = True,
    save_to_minimum_rank: bool = False,
    check_replicas: bool = True,
    planner_class: type = StandardSavePlanner,
) -> tuple[list[StandardSavePlanner], list[SavePlan]]:
    """Configure one planner per simulated rank (of ``planner_class``) and return them with their local plans."""
    planners, plans = [], []
    for rank, state in enumerate(states):
        planner = planner_class(check_replicas=check_replicas)
        planner.configure_planner(
            state,
            rank=rank,
            world_size=len(states),
            is_coordinator=rank == 0,
            remove_redundancy=remove_redundancy,
            save_to_minimum_rank=save_to_minimum_rank,
        )
        planners.append(planner)
        plans.append(planner.build_local_plan())
    return planners, plans


def simulate_save(
    states: list[dict[str, Any]],
    path: Path,
    *,
    writer_options: dict[str, Any] | None = None,
    layout_form: bool = False,
    writer_class: type = FileSystemWriter,
    rank_indexes: bool = False,
    sent: list[Any] | None = None,
    **kwargs: Any,
) -> tuple[Metadata, list[int]]:
    """Save the per-rank ``states`` as one checkpoint at ``path``.

    ``writer_options`` go to every rank's :class:`FileSystemWriter` (or ``writer_class``);
    ``layout_form`` sends the coordinator layout-form plans, as ``dcp.save``
    does under msrun (``compact_local_plan`` / ``build_global_masks``); the
    other keyword arguments go to the planners. ``rank_indexes``: as ``dcp.save``
    does, the coordinator decides the indexed form at plan time and each rank
    writes its own index file, sending the commit a summary
    (:mod:`._index_plan`); else the commit gets every rank's write results.
    ``sent`` receives what each rank sends the commit.

    Returns:
        The committed metadata and the bytes each rank wrote.
    """
    planners, _ = plan_ranks(states, **kwargs)
    writers = []
    plans = []
    for rank, planner in enumerate(planners):
        writer = writer_class(path, **(writer_options or {}))
        writer.set_up_storage_writer(rank == 0, rank=rank, world_size=len(states))
        writers.append(writer)
        plans.append(writer.prepare_local_plan(planner.build_local_plan()))
    if layout_form:
        compact = [planner.compact_local_plan(plan) for planner, plan in zip(planners, plans)]
        masks, metadata = planners[0].build_global_masks(compact)
        final = [SavePlan(items=tuple(item for i, item in enumerate(plan.items) if mask[i // 8] >> (i % 8) & 1))
                 for plan, mask in zip(plans, masks)]
    else:
        final, metadata = planners[0].build_global_plan(plans)
    final = writers[0].prepare_global_plan(final)
    if rank_indexes:
        replicas = not kwargs.get("remove_redundancy", True)
        index_plan = (lambda: plan_index(metadata, compact, masks, replicas=replicas)) if layout_form else (
            lambda: plan_index(metadata, final, replicas=replicas))
        final = rank_indexes_of(writers[0], metadata, final, index_plan)
    final = [finalize_rank_plan(planner, plan) for planner, plan in zip(planners, final)]  # each rank, as dcp.save
    results = [writers[r].write_data(final[r], planners[r]).result() for r in range(len(states))]
    messages = [writers[r].write_rank_index(final[r], results[r]) if getattr(final[r].storage_data, "index", None)
                else results[r] for r in range(len(states))]
    if sent is not None:
        sent.extend(messages)
    committed = writers[0].finish(metadata, messages)
    return committed, [sum(r.size_in_bytes for r in rank_results) for rank_results in results]
