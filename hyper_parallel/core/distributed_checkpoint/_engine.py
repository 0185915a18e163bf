"""The steps of a save, in order: the one place they run.

Save (:func:`run_save`, or :func:`plan_save` + :func:`commit_save` around
the background write of an async save):

1. plan, all ranks: every rank plans its items, the coordinator merges the
   plans (deduplication, validation, metadata) and hands each rank its final
   plan (:func:`plan_save`);
2. write, all ranks: the storage writer writes this rank's plan durably;
3. commit, coordinator: the storage writer's ``finish`` records every rank's
   write results; every rank returns after it (:func:`commit_save`). Sync
   and async saves share this step; an async save runs it with the results
   its background write produced.

When any step of a save fails, every rank calls the writer's ``abort``.

The load steps are in :mod:`._load_engine`; the blocking part of an async
save (planning, then staging the snapshot) in :mod:`._async_engine`; the
choice of the storage from a ``checkpoint_id`` in :mod:`._storage_choice`.

Every step runs through :class:`._collectives.DistWrapper`, so a failure on
any rank raises the same error on every rank. This module knows storage only
through the :class:`.StorageWriter` methods.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Any, Callable

from hyper_parallel import platform
from hyper_parallel.core.distributed_checkpoint._background_commit import (
    raise_commit_failures,
    raise_local_commit_failures,
    take_pending_commits,
)
from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper
from hyper_parallel.core.distributed_checkpoint._commit_receipt import (
    CommitReceipt,
    commit_answers,
    metadata_of_answer,
    metadata_reader_of,
)
from hyper_parallel.core.distributed_checkpoint._deferred_save import DeferredPlan, PlannedSave
from hyper_parallel.core.distributed_checkpoint._index_plan import IndexPlan, bind_held, own_index, plan_index
from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import LayoutArgument, apply_mindspore_layouts
from hyper_parallel.core.distributed_checkpoint._one_checkpoint import same_save_location, sent_with_location
from hyper_parallel.core.distributed_checkpoint._plan_cache import (
    PlanCache,
    PlanDecision,
    PlanMessage,
    check_cached_replicas,
    exchange_digest,
    plan_cache_for,
)
from hyper_parallel.core.distributed_checkpoint._save_layout import LayoutListener
from hyper_parallel.core.distributed_checkpoint._storage_choice import rank_alone
from hyper_parallel.core.distributed_checkpoint._unwritten_keys import name_refusal
from hyper_parallel.core.distributed_checkpoint.errors import PlanValidationError
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import StorageWriter, WriteResult

__all__ = [
    "SaveOptions",
    "SaveSession",
    "plan_save",
    "finalize_rank_plan",
    "write_local",
    "commit_save",
    "run_save",
]


@dataclass(frozen=True)
class SaveOptions:
    """How a save runs (the arguments of ``dcp.save`` besides state and storage).

    Attributes:
        no_dist: One process, no collectives.
        use_collectives: ``False``: each rank saves alone, with rank-local metadata.
        remove_redundancy: Write each replicated item once (balanced over ranks).
        save_to_minimum_rank: Give each replicated item to its lowest rank.
        strategy_file: Layouts of Parameters MindSpore sliced (``strategy_file=``).
    """

    no_dist: bool = False
    use_collectives: bool = True
    remove_redundancy: bool = True
    save_to_minimum_rank: bool = False
    strategy_file: LayoutArgument = None


@dataclass(frozen=True)
class _PlanDelta:
    """A rank's final plan as positions in its own local plan (small to send)."""

    keep: bytes
    storage_data: Any
    planner_data: Any


def _compress(local: SavePlan, final: SavePlan) -> _PlanDelta | SavePlan:
    """``final`` as a keep mask over ``local``, or ``final`` itself when it is no subsequence of ``local`` (its
    items in another order, or new ones): the rank must receive its items in the order the coordinator planned
    (:attr:`._index_plan.RankIndexPlan.held` marks them by position)."""
    positions = {item: position for position, item in enumerate(local.items)}
    mask = bytearray((len(local.items) + 7) // 8)
    last = -1
    for item in final.items:
        position = positions.get(item)
        if position is None or position <= last:
            return final
        last = position
        mask[position // 8] |= 1 << (position % 8)
    return _PlanDelta(keep=bytes(mask), storage_data=final.storage_data, planner_data=final.planner_data)


def _expand(local: SavePlan, received: _PlanDelta | SavePlan) -> SavePlan:
    if isinstance(received, SavePlan):
        return received
    keep = received.keep
    items = tuple(item for position, item in enumerate(local.items) if keep[position // 8] >> (position % 8) & 1)
    return SavePlan(items=items, storage_data=received.storage_data, planner_data=received.planner_data)


def _layout_exchange(planner: SavePlanner, writer: StorageWriter) -> bool:
    """Whether the plan exchange may use the layout form (:mod:`._layout_plan`).

    Only for the standard planner (a subclass may plan otherwise) and a
    writer whose global plan step does not look at the items (the
    filesystem and fsspec writers stamp one save id on every plan).
    """
    return (
        type(planner) is StandardSavePlanner  # pylint: disable=unidiomatic-typecheck
        and type(writer).prepare_global_plan is FileSystemWriter.prepare_global_plan
    )


def _to_send(planner: SavePlanner, local: SavePlan, compact: bool) -> Any:
    """What this rank sends to the coordinator: its local plan, in layout form when ``compact``."""
    return planner.compact_local_plan(local) if compact else local


def _merge_layout_form(
    planner: StandardSavePlanner,
    writer: StorageWriter,
    all_plans: list[Any],
    merged: list[Metadata],
    all_final: list[list[SavePlan]],
    all_local: list[list[Any]],
    options: SaveOptions,
    index_plans: list[Callable[[], IndexPlan | None]],
) -> list[_PlanDelta]:
    """The coordinator's merge of layout-form plans: each rank's keep mask and storage data. Coordinator."""
    masks, metadata = planner.build_global_masks(all_plans)
    stamped = writer.prepare_global_plan([SavePlan(items=()) for _ in all_plans])  # items unused (see above)
    holders = functools.cache(lambda: plan_index(metadata, all_plans, masks, replicas=not options.remove_redundancy))
    index_plans.append(holders)
    stamped = rank_indexes(writer, metadata, stamped, holders)
    merged.append(metadata)
    all_final.append(stamped)
    all_local.append(all_plans)
    return [_PlanDelta(keep=mask, storage_data=plan.storage_data, planner_data=None)
            for mask, plan in zip(masks, stamped)]


def finalize_rank_plan(planner: SavePlanner, plan: SavePlan) -> SavePlan:
    """This rank's final plan after its planner's ``finalize_plan``, the items it holds in its own index file
    first resolved from their positions to their keys (:func:`._index_plan.bind_held`), so a ``finalize_plan``
    that reorders or filters its items cannot change which chunks the index lists. All ranks."""
    return planner.finalize_plan(bind_held(plan))


def _named_refusal(exc: BaseException, planner: SavePlanner, dist: DistWrapper) -> PlanValidationError | None:
    """The plan step's refusal of keys no rank writes, each named by the ranks holding it (they sent the
    coordinator only hashes: :mod:`._unwritten_keys`), or ``None``. All ranks, when the plan step raised."""
    names_of = getattr(planner, "unwritten_names", None)
    if names_of is None:
        return None
    return name_refusal(exc, gather=lambda fn: dist.all_gather("name unwritten keys", fn), names_of=names_of)


def rank_indexes(writer: StorageWriter, metadata: Metadata, stamped: list[SavePlan],
                 index_plan: Callable[[], IndexPlan | None]) -> list[SavePlan]:
    """``stamped`` (the final plans), each also telling its rank to write its own index, when the save commits the
    indexed form from rank summaries (:mod:`._index_plan`). Coordinator.

    Only the filesystem and fsspec writers; ``index_plan`` (the holders from the merged plan) is computed only
    when the indexed form is wanted. Otherwise ``stamped`` unchanged.
    """
    if not (isinstance(writer, FileSystemWriter) and writer.wants_rank_indexes(metadata)):
        return stamped
    plan = index_plan()
    return stamped if plan is None else writer.use_index_plan(stamped, plan)


def _rank_results(session: "SaveSession", results: list[WriteResult]) -> Any:
    """What this rank sends the commit: its write results, or, when its plan says so, the summary of the index
    file it writes now (its data is durable). All ranks."""
    summary = own_index(session.writer, session.plan, results)
    return results if summary is None else summary


@dataclass(frozen=True)
class SaveSession:
    """A save between planning and commit.

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


#: Variables msrun (and other MindSpore launchers) set in every worker of a job.
_JOB_SIZE_VARIABLES = ("MS_WORKER_NUM", "RANK_SIZE")


def _uninitialised_communication(world_size: int, options: SaveOptions) -> str | None:
    """Explain a one-process save inside what looks like a distributed job, or ``None``."""
    if world_size > 1:
        return None
    for name in _JOB_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            if options.no_dist or not options.use_collectives:
                chosen = "no_dist=True" if options.no_dist else "use_collectives=False"
                return (
                    f"this save was asked to run alone ({chosen}) in a job of {value} workers ({name}={value}): "
                    "it checks its plan as rank 0 of 1, so a sharded tensor (DTensor, ShardedTensor, sliced "
                    "Parameter) with only this rank's shard does not cover its global shape. Save sharded "
                    "state with collectives (every rank calls save), or save this rank's shard as a plain "
                    "tensor under a key of its own"
                )
            return (
                f"MindSpore communication was not initialised, although this process runs in a job of {value} "
                f"workers ({name}={value}): it saved alone, as rank 0 of 1, so sharded tensors miss the other "
                "ranks' shards. Call mindspore.communication.init() on every rank before saving"
            )
    return None


def plan_save(
    state_dict: dict[str, Any],
    *,
    writer: StorageWriter,
    planner: SavePlanner,
    options: SaveOptions,
    listener: LayoutListener | None = None,
    may_defer: bool = False,
) -> SaveSession | DeferredPlan:
    """Plan a save: local plans, the coordinator's merge, final plans. All ranks call it.

    Its first step also shares the outcome of an earlier async save's
    background commit (the coordinator waits for it before taking the
    lease), so a failed one raises on every rank.

    A planner whose plans are cached (:mod:`._plan_cache`) first digests its
    layout; when every rank repeats the previous save's layout, the cached
    plans are reused and no local plan is built.

    Args:
        listener: Told about this rank's layout as the layout pass meets it
            (the staging of an async save copies tensors meanwhile); cached planners only.
        may_defer: A save without collectives whose layout is not cached returns a
            :class:`DeferredPlan` after the layout pass instead of planning now.
    """
    dist = DistWrapper(use_dist=not options.no_dist and options.use_collectives)
    pending = take_pending_commits() if dist.use_dist else []
    alone = rank_alone(options.no_dist, options.use_collectives)
    local_plans: list[SavePlan] = []
    merged: list[Metadata] = []

    def set_up() -> None:
        raise_commit_failures(pending)  # inside the first step: a failed earlier commit raises on every rank
        if not dist.use_dist:
            raise_local_commit_failures()  # no step to share it: the coordinator raises it here, once
        writer.set_up_storage_writer(
            dist.is_coordinator,
            rank=dist.rank if alone is None else alone,
            world_size=dist.world_size,
            rank_local=alone is not None,
        )
        planner.configure_planner(
            apply_mindspore_layouts(state_dict, source=options.strategy_file, rank=platform.get_rank()),
            rank=dist.rank,
            world_size=dist.world_size,
            is_coordinator=dist.is_coordinator,
            remove_redundancy=options.remove_redundancy,
            save_to_minimum_rank=options.save_to_minimum_rank,
        )

    def build_local() -> Any:
        local_plans.append(writer.prepare_local_plan(planner.build_local_plan()))
        return _to_send(planner, local_plans[0], compact)

    def local_step() -> Any:
        set_up()
        return build_local()

    layouts: list[Any] = []

    def layout_step() -> PlanMessage:
        set_up()
        layouts.append(planner.describe_layout(listener))
        return cache.message(layouts[0])

    compact = dist.use_dist and _layout_exchange(planner, writer)
    cache = plan_cache_for(writer, planner, options, rank=dist.rank, world_size=dist.world_size)
    all_final: list[list[SavePlan]] = []
    all_local: list[list[SavePlan]] = []
    index_plans: list[Callable[[], IndexPlan | None]] = []  # the holders of the merged plan, computed when first asked

    def global_step(all_plans: list[Any]) -> list[Any]:
        try:
            if compact:
                return _merge_layout_form(planner, writer, all_plans, merged, all_final, all_local, options,
                                          index_plans)
            final_plans, metadata = planner.build_global_plan(all_plans)
        except PlanValidationError as exc:
            hint = _uninitialised_communication(dist.world_size, options)
            if hint is None:
                raise
            raise PlanValidationError(f"{hint}. The plan check said: {exc}") from exc
        final_plans = writer.prepare_global_plan(final_plans)
        holders = functools.cache(lambda planned=final_plans: plan_index(metadata, planned,
                                                                         replicas=not options.remove_redundancy))
        index_plans.append(holders)
        final_plans = rank_indexes(writer, metadata, final_plans, holders)
        merged.append(metadata)
        all_final.append(final_plans)
        all_local.append(all_plans)
        return [_compress(local, final) for local, final in zip(all_plans, final_plans)]

    def make_plan() -> PlannedSave:  # a deferred plan: one rank, no collective (the merge runs here)
        received = dist.reduce_scatter("plan", build_local, global_step)
        plan = _expand(local_plans[0], received)
        return PlannedSave(plan=plan, metadata=merged[0], all_final=all_final[0], local_plans=all_local[0],
                           sources=planner.sources_for(plan.items))

    try:
        if cache is None:
            received = dist.reduce_scatter("plan", sent_with_location(writer, local_step),
                                           same_save_location(global_step))
            plan = _expand(local_plans[0], received)
        else:
            # A digest round first: a save repeating the last layout reuses its plans (see _plan_cache). The
            # coordinator decides from every rank's message; each rank receives the decision only.
            decision = dist.reduce_scatter("plan digest", sent_with_location(writer, layout_step),
                                           same_save_location(lambda messages: _decide(cache, writer, messages,
                                                                                       merged)))
            if decision.reuse:
                cached = cache.take(decision.exchange)
                plan = replace(cached.final, storage_data=decision.storage_data)
                planner.bind_sources(plan.items, cached.sources, cached.source_of)
            elif may_defer and not dist.use_dist:
                return _deferred(dist, writer, planner, cache, decision.exchange, layouts[0], make_plan, index_plans)
            else:
                received = dist.reduce_scatter("plan", build_local, global_step)
                plan = _expand(local_plans[0], received)
                cache.store(decision.exchange, plan, all_final[0] if all_final else None,
                            merged[0] if merged else None, all_local[0] if all_local else None,
                            sources=planner.sources_for(plan.items), index_plan=index_plans[0] if index_plans else None)
        plan = finalize_rank_plan(planner, plan)
    except BaseException as exc:
        try:
            named = _named_refusal(exc, planner, dist)
        finally:
            writer.abort()
        if named is None:
            raise
        raise named from exc
    return SaveSession(dist=dist, writer=writer, planner=planner, plan=plan, metadata=merged[0] if merged else None)


def _deferred(
    dist: DistWrapper,
    writer: StorageWriter,
    planner: SavePlanner,
    cache: PlanCache,
    exchange: str,
    layout: Any,
    make_plan: Callable[[], PlannedSave],
    index_plans: list[Callable[[], IndexPlan | None]],
) -> DeferredPlan:
    """The rest of a one-rank :func:`plan_save`, to run later (see :class:`DeferredPlan`). ``index_plans`` receives
    the holders of the plan ``make_plan`` merges."""

    def adopt(planned: PlannedSave) -> SaveSession:
        cache.store(exchange, planned.plan, planned.all_final, planned.metadata, planned.local_plans,
                    sources=planned.sources, index_plan=index_plans[0] if index_plans else None)
        return SaveSession(dist=dist, writer=writer, planner=planner, plan=finalize_rank_plan(planner, planned.plan),
                           metadata=planned.metadata)

    return DeferredPlan(writer=writer, planner=planner, layout=layout, make=make_plan, adopt=adopt)


def _decide(
    cache: PlanCache, writer: StorageWriter, messages: list[PlanMessage], merged: list[Metadata]
) -> list[PlanDecision]:
    """Whether every rank reuses its cached plan, with each rank's storage data on a reuse. Coordinator only.

    A reuse first compares this save's replica digests (a reused plan is checked as a new one).
    """
    exchange = exchange_digest([m.local_digest for m in messages])
    cached = cache.lookup(messages)
    if cached is None:
        return [PlanDecision(exchange=exchange, reuse=False)] * len(messages)  # one object: sent as a broadcast
    check_cached_replicas(cached, messages)
    merged.append(cached.metadata)
    stamped = writer.prepare_global_plan(list(cached.all_final))
    stamped = rank_indexes(writer, cached.metadata, stamped,
                           cached.index_plan if cached.index_plan is not None else lambda: None)
    return [PlanDecision(exchange=exchange, reuse=True, storage_data=plan.storage_data) for plan in stamped]


def write_local(session: SaveSession, planner: SavePlanner | None = None) -> list[WriteResult]:
    """Write this rank's plan (data from ``planner``, default the session's). All ranks."""
    return session.writer.write_data(session.plan, planner or session.planner).result()


def commit_save(
    session: SaveSession,
    local_results: Callable[[], list[WriteResult]],
    *,
    step: str = "write and commit",
    background_cleanup: bool = False,
) -> Metadata:
    """Gather every rank's write results, commit on the coordinator, return the metadata. All ranks.

    Only the commit's receipt goes back to the ranks when the writer can read
    its commit back (:mod:`._commit_receipt`): the other ranks return a view
    that reads the committed metadata when first used, so the bytes they
    receive do not grow with the world size.

    Args:
        session: The planned save.
        local_results: Returns this rank's write results (writing now, or
            handing over what a background write produced), or raises.
        step: Name of the step in errors.
        background_cleanup: Let the writer finish its after-commit work
            (deleting files of older saves) off the caller's thread.
    """

    read_back = metadata_reader_of(session.writer) if session.dist.use_dist else None
    kept: list[Metadata] = []

    def commit_step(all_results: list[list[WriteResult]]) -> list[Metadata | CommitReceipt]:
        committed = session.writer.finish(session.metadata, all_results, background_cleanup=background_cleanup)
        kept.append(committed)
        return commit_answers(committed, world_size=len(all_results), location=getattr(session.writer, "path", ""),
                              read_back=read_back)

    try:
        answer = session.dist.reduce_scatter(step, lambda: _rank_results(session, local_results()), commit_step)
    except BaseException:
        session.writer.abort()
        raise
    if kept:
        return kept[0]  # the coordinator: the metadata it committed
    return metadata_of_answer(answer, read_back=read_back)


def run_save(
    state_dict: dict[str, Any], *, writer: StorageWriter, planner: SavePlanner, options: SaveOptions
) -> Metadata:
    """Plan, write and commit a save. All ranks call it; returns after the commit."""
    session = plan_save(state_dict, writer=writer, planner=planner, options=options)
    return commit_save(session, lambda: write_local(session), step="write")
