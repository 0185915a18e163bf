"""The steps of a save and of a load, in order: the one place they run.

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

Load (:func:`read_checkpoint_metadata`, then :func:`run_load`): every rank
reads the metadata, plans the regions it needs, and reads them into its
tensors in place, in rounds when the planner shares reads between ranks.

Every step runs through :class:`._collectives.DistWrapper`, so a failure on
any rank raises the same error on every rank. This module knows storage only
through the :class:`.StorageWriter` / :class:`.StorageReader` methods.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from hyper_parallel import platform
from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncRequest
from hyper_parallel.core.distributed_checkpoint._background_commit import (
    background_commit_request,
    raise_commit_failures,
    settle_background_commits,
    take_pending_commits,
)
from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper
from hyper_parallel.core.distributed_checkpoint._deferred_save import DeferredPlan, PlannedSave, deferred_request
from hyper_parallel.core.distributed_checkpoint._fork_writer import fork_write, fork_write_and_hash
from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import (
    LayoutArgument,
    apply_mindspore_layouts,
    copy_back_values,
)
from hyper_parallel.core.distributed_checkpoint._plan_cache import (
    PlanCache,
    PlanDecision,
    PlanMessage,
    check_cached_replicas,
    exchange_digest,
    plan_cache_for,
)
from hyper_parallel.core.distributed_checkpoint._save_layout import LayoutListener
from hyper_parallel.core.distributed_checkpoint._staging import StagedSavePlanner, StagingPool, staged_views
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError, PlanValidationError
from hyper_parallel.core.distributed_checkpoint.filesystem_reader import FileSystemReader
from hyper_parallel.core.distributed_checkpoint._fsspec_reader import FsspecReader
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import FsspecWriter
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardLoadPlanner, StandardSavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointId, StorageReader, StorageWriter, WriteResult

__all__ = [
    "SaveOptions",
    "LoadOptions",
    "SaveSession",
    "writer_for",
    "reader_for",
    "plan_save",
    "write_local",
    "commit_save",
    "run_save",
    "plan_async_save",
    "read_checkpoint_metadata",
    "settle_before_load",
    "run_load",
]

#: Storage classes tried in order when only a ``checkpoint_id`` is given.
WRITER_CLASSES: list[type[StorageWriter]] = [FsspecWriter, FileSystemWriter]
READER_CLASSES: list[type[StorageReader]] = [FsspecReader, FileSystemReader]


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


def _rank_alone(no_dist: bool, use_collectives: bool) -> int | None:
    """This rank's number when it saves or loads on its own in a job of several ranks."""
    if no_dist or use_collectives or platform.get_world_size() <= 1:
        return None
    return platform.get_rank()


def _pick(checkpoint_id: CheckpointId | None, storage: Any, classes: list[type], kind: str, verb: str) -> Any:
    if storage is not None:
        if checkpoint_id is not None:
            storage.reset(checkpoint_id)
        return storage
    if checkpoint_id is None:
        raise CheckpointValueError(f"{verb} needs a checkpoint_id (a directory path) or a {kind}")
    for cls in classes:
        if cls.validate_checkpoint_id(checkpoint_id):
            return cls(checkpoint_id)
    raise CheckpointValueError(
        f"checkpoint_id {checkpoint_id!r} is not a filesystem path nor a storage URL this installation "
        f"handles; pass a directory path or a {kind}"
    )


def writer_for(checkpoint_id: CheckpointId | None, storage_writer: StorageWriter | None) -> StorageWriter:
    """The caller's writer (reset to ``checkpoint_id``), or the first storage that takes the id."""
    return _pick(checkpoint_id, storage_writer, WRITER_CLASSES, "storage_writer", "save")


def reader_for(checkpoint_id: CheckpointId | None, storage_reader: StorageReader | None) -> StorageReader:
    """The caller's reader (reset to ``checkpoint_id``), or the first storage that takes the id."""
    return _pick(checkpoint_id, storage_reader, READER_CLASSES, "storage_reader", "load")


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
) -> list[_PlanDelta]:
    """The coordinator's merge of layout-form plans: each rank's keep mask and storage data. Coordinator."""
    masks, metadata = planner.build_global_masks(all_plans)
    stamped = writer.prepare_global_plan([SavePlan(items=()) for _ in all_plans])  # items unused (see above)
    merged.append(metadata)
    all_final.append(stamped)
    all_local.append(all_plans)
    return [_PlanDelta(keep=mask, storage_data=plan.storage_data, planner_data=None)
            for mask, plan in zip(masks, stamped)]


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


def _uninitialised_communication(world_size: int) -> str | None:
    """Explain a one-process save inside what looks like a distributed job, or ``None``."""
    if world_size > 1:
        return None
    for name in _JOB_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
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
    alone = _rank_alone(options.no_dist, options.use_collectives)
    local_plans: list[SavePlan] = []
    merged: list[Metadata] = []

    def set_up() -> None:
        raise_commit_failures(pending)  # inside the first step: a failed earlier commit raises on every rank
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

    def global_step(all_plans: list[Any]) -> list[Any]:
        try:
            if compact:
                return _merge_layout_form(planner, writer, all_plans, merged, all_final, all_local)
            final_plans, metadata = planner.build_global_plan(all_plans)
        except PlanValidationError as exc:
            hint = _uninitialised_communication(dist.world_size)
            if hint is None:
                raise
            raise PlanValidationError(f"{hint}. The plan check said: {exc}") from exc
        final_plans = writer.prepare_global_plan(final_plans)
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
            received = dist.reduce_scatter("plan", local_step, global_step)
            plan = _expand(local_plans[0], received)
        else:
            # A digest round first: a save repeating the last layout reuses its plans (see _plan_cache). The
            # coordinator decides from every rank's message; each rank receives the decision only.
            decision = dist.reduce_scatter("plan digest", layout_step,
                                           lambda messages: _decide(cache, writer, messages, merged))
            if decision.reuse:
                cached = cache.take(decision.exchange)
                plan = replace(cached.final, storage_data=decision.storage_data)
                planner.bind_sources(plan.items, cached.sources, cached.source_of)
            elif may_defer and not dist.use_dist:
                return _deferred(dist, writer, planner, cache, decision.exchange, layouts[0], make_plan)
            else:
                received = dist.reduce_scatter("plan", build_local, global_step)
                plan = _expand(local_plans[0], received)
                cache.store(decision.exchange, plan, all_final[0] if all_final else None,
                            merged[0] if merged else None, all_local[0] if all_local else None,
                            sources=planner.sources_for(plan.items))
        plan = planner.finalize_plan(plan)
    except BaseException:
        writer.abort()
        raise
    return SaveSession(dist=dist, writer=writer, planner=planner, plan=plan, metadata=merged[0] if merged else None)


def _deferred(
    dist: DistWrapper,
    writer: StorageWriter,
    planner: SavePlanner,
    cache: PlanCache,
    exchange: str,
    layout: Any,
    make_plan: Callable[[], PlannedSave],
) -> DeferredPlan:
    """The rest of a one-rank :func:`plan_save`, to run later (see :class:`DeferredPlan`)."""

    def adopt(planned: PlannedSave) -> SaveSession:
        cache.store(exchange, planned.plan, planned.all_final, planned.metadata, planned.local_plans,
                    sources=planned.sources)
        return SaveSession(dist=dist, writer=writer, planner=planner, plan=planner.finalize_plan(planned.plan),
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

    Args:
        session: The planned save.
        local_results: Returns this rank's write results (writing now, or
            handing over what a background write produced), or raises.
        step: Name of the step in errors.
        background_cleanup: Let the writer finish its after-commit work
            (deleting files of older saves) off the caller's thread.
    """

    def commit_step(all_results: list[list[WriteResult]]) -> list[Metadata]:
        committed = session.writer.finish(session.metadata, all_results, background_cleanup=background_cleanup)
        return [committed] * len(all_results)

    try:
        return session.dist.reduce_scatter(step, local_results, commit_step)
    except BaseException:
        session.writer.abort()
        raise


def run_save(
    state_dict: dict[str, Any], *, writer: StorageWriter, planner: SavePlanner, options: SaveOptions
) -> Metadata:
    """Plan, write and commit a save. All ranks call it; returns after the commit."""
    session = plan_save(state_dict, writer=writer, planner=planner, options=options)
    return commit_save(session, lambda: write_local(session), step="write")


#: Host buffers of ``staging="copy"``, kept for the next async save.
_POOL = StagingPool()


def plan_async_save(
    state_dict: dict[str, Any], *, writer: StorageWriter, planner: SavePlanner, options: SaveOptions, staging: str
) -> AsyncRequest:
    """Plan and stage a save; return the request that writes and then commits it. All ranks.

    The request's background function writes this rank's data (from staged
    copies, or in a forked process whose memory is the snapshot). A save
    without collectives (one process, or ``use_collectives=False``) commits
    in the background right after writing. With several ranks and a writer
    that keeps rank records, the coordinator's background thread commits
    from every rank's results record (:mod:`._background_commit`). With a
    writer without them, the finalize function is :func:`commit_save`, a
    collective step run on the caller's thread (``result()`` or the next
    async save). The background thread never runs a collective, which could
    interleave with the training job's own.
    """
    # A forked writer of a job of several ranks hashes the replicas of its snapshot; the coordinator compares
    # them before it commits (_background_commit): the blocking part hashes nothing.
    later = (staging == "fork" and type(planner) is StandardSavePlanner  # pylint: disable=unidiomatic-typecheck
             and planner.check_replicas and writer.supports_rank_records()
             and DistWrapper(use_dist=not options.no_dist and options.use_collectives).use_dist)
    if type(planner) is StandardSavePlanner:  # pylint: disable=unidiomatic-typecheck
        planner.digest_replicas_later(later)
    early = None
    if staging == "copy":  # tensors are copied into the arena while the plan is made (_stage_copies)
        alone = options.no_dist or not options.use_collectives or platform.get_world_size() <= 1
        early = _POOL.early_copies(every_leaf=alone)
    try:
        session = plan_save(state_dict, writer=writer, planner=planner, options=options, listener=early,
                            may_defer=True)
        if isinstance(session, DeferredPlan):  # one rank, a new layout: planned after the snapshot (_deferred_save)
            request = _deferred_or_none(session, early)
            if request is not None:
                return request
            session = _plan_now(session)
    except BaseException:
        if early is not None:
            early.abandon()
        raise
    background: list[Callable[[], list[WriteResult]]] = []
    replicas: list[Any] = []  # the replica digests a forked writer made (``later``)

    def stage_step() -> None:
        items = session.plan.items
        if early is not None:
            staged = StagedSavePlanner(session.planner, _POOL.stage(
                items, session.planner.get_data, lambda: _leaves(items, session.planner), early))
            background.append(lambda: write_local(session, staged))
        elif later:  # the forked writer also hashes the replicas of its snapshot
            views = staged_views(items, _sources(items, session.planner), session.planner)
            background.append(fork_write_and_hash(session.writer, session.plan, views, session.planner.replica_digests,
                                                  rank=session.dist.rank, replicas=replicas))
        else:
            views = staged_views(items, _sources(items, session.planner), session.planner)
            background.append(fork_write(session.writer, session.plan, views, rank=session.dist.rank))

    try:
        session.dist.agree("stage", stage_step)
    except BaseException:
        if early is not None:
            early.abandon()
        session.writer.abort()
        raise

    if not session.dist.use_dist:
        # No other rank takes part in the commit: the background thread commits right after writing,
        # so the step is durable as soon as done() is true, whether or not result() is ever called.
        write = background[0]

        def write_and_commit() -> Metadata:
            # The write runs inside the commit step, so a failed write aborts the save like any step.
            return commit_save(session, write, step="async write and commit")

        return AsyncRequest(async_fn=write_and_commit, finalize_fns=(_committed,))

    if session.writer.supports_rank_records():
        return background_commit_request(dist=session.dist, writer=session.writer, plan=session.plan,
                                         metadata=session.metadata, write=background[0],
                                         replicas=(lambda: replicas[0] if replicas else ()) if later else None)

    def commit(results: list[WriteResult], error: BaseException | None) -> Metadata:
        def local_results() -> list[WriteResult]:
            if error is not None:
                raise error
            return results

        return commit_save(session, local_results, step="async write and commit", background_cleanup=True)

    return AsyncRequest(async_fn=background[0], finalize_fns=(commit,))


def _deferred_or_none(deferred: DeferredPlan, early: Any) -> AsyncRequest | None:
    """:func:`._deferred_save.deferred_request`; the writer is aborted if taking the snapshot fails."""
    try:
        return deferred_request(deferred, early=early, pool=_POOL, finalize=_committed,
                                commit=lambda planned, write: commit_save(planned, write, step="async write and commit"))
    except BaseException:
        deferred.writer.abort()
        raise


def _plan_now(deferred: DeferredPlan) -> SaveSession:
    """Make a deferred plan at once (a state :mod:`._deferred_save` cannot snapshot). Caller's thread."""
    try:
        return deferred.adopt(deferred.make())
    except BaseException:
        deferred.writer.abort()
        raise


def _sources(items: tuple[Any, ...], planner: SavePlanner) -> Iterable[Any]:
    """The data of each item, in order: one loop over a reused plan's leaves for the standard planner."""
    if isinstance(planner, StandardSavePlanner):
        return planner.stage_arrays(items)
    return (planner.get_data(item) for item in items)


def _leaves(items: tuple[Any, ...], planner: SavePlanner) -> tuple[str | None, ...]:
    """The whole-tensor leaf each item is, for the standard planner (whose early copies can stand for it)."""
    if isinstance(planner, StandardSavePlanner):
        return planner.leaf_names(items)
    return (None,) * len(items)


def _committed(metadata: Metadata, error: BaseException | None) -> Metadata:
    """Finalize of an async save committed in the background: hand over its metadata or its error."""
    if error is not None:
        raise error
    return metadata


def settle_before_load(*, no_dist: bool, use_collectives: bool) -> None:
    """Share the outcome of earlier async saves' background commits before a load reads. All ranks.

    A load with collectives first runs :func:`settle_background_commits`: a
    step saved just before (``result()`` returned) is then committed on every
    rank, or its commit failure raises on every rank. Without collectives
    nothing runs.
    """
    if DistWrapper(use_dist=not no_dist and use_collectives).use_dist:
        settle_background_commits()


def read_checkpoint_metadata(reader: StorageReader, options: LoadOptions) -> Metadata:
    """Read the committed metadata on every rank (a step: one rank's failure fails all). All ranks.

    First shares the outcome of an earlier async save's background commit
    (:func:`settle_background_commits`): a step saved just before is committed.
    """
    dist = DistWrapper(use_dist=not options.no_dist and options.use_collectives)
    settle_before_load(no_dist=options.no_dist, use_collectives=options.use_collectives)
    rank = _rank_alone(options.no_dist, options.use_collectives)
    found: list[Metadata] = []
    dist.agree("read metadata", lambda: found.append(reader.read_metadata(rank=rank)))
    return found[0]


def run_load(
    state_dict: dict[str, Any],
    *,
    reader: StorageReader,
    planner: LoadPlanner,
    metadata: Metadata,
    options: LoadOptions,
) -> None:
    """Plan and read a load into ``state_dict`` in place. All ranks call it."""
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
    dist.agree("verify", lambda: reader.verify_data(plan).result())
    rounds = planner.read_rounds(plan)
    for index, round_plan in enumerate(rounds):
        _read_round(dist, reader, planner, round_plan, index, last=index == len(rounds) - 1)
    if targets[0] is not state_dict:
        copy_back_values(targets[0], state_dict)


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
