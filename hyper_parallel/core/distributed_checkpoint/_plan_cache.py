"""Reusing the global save plan when a save repeats the layout of the previous one.

A training job saves the same state layout again and again. Planning a save
costs a gather of every rank's local plan to the coordinator, the
coordinator's merge (deduplication, validation, metadata) and handing each
rank its final plan. When nothing changed, all of that gives the same result
as last time. So each rank keeps, per (rank, world size, options, writer and
planner class), what the previous save planned: a digest of its layout,
its final plan, and on the coordinator the final plans of all ranks and the
metadata. A save then exchanges only digests: every rank sends the
coordinator a :class:`PlanMessage` (its layout digest and the digest of the
whole exchange it has cached); when every rank's cached exchange equals the
digests of this exchange, the coordinator decides that every rank reuses its
final plan (and the coordinator its metadata: the merge's validation already
passed for exactly these plans). Each rank receives only that
:class:`PlanDecision` with its own storage data (a gather and a scatter), so
what a rank receives does not grow with the world size, and all ranks agree.
Otherwise the full exchange runs and refreshes the caches.

The layout digest (:func:`._save_layout.describe_layout`) is computed
without building the local plan: one row of plain tuples per leaf (keys,
shapes, dtypes, shardings), non-tensor values' digests included: a value that
changed (a step counter) makes a new exchange, so the coordinator's check
that replicas agree always sees current values. A rank builds its local plan
only when the exchange runs; on a reuse it serves the cached plan's items from
this save's leaves (:attr:`CachedPlan.sources`). The
xxh3 digests of replicated tensor chunks (``check_replicas``) are left out of
the layout digest, since weights change at every step: each rank sends them in
its :class:`PlanMessage` instead, and on a reuse the coordinator compares them
by the replica groups it kept from the full exchange
(:func:`check_cached_replicas`), so a reused plan is checked as a new one.
Only :class:`.StandardSavePlanner` plans are cached (a custom planner may
keep state outside its plans).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, is_dataclass, replace
from typing import Any

import xxhash

from hyper_parallel.core.distributed_checkpoint._global_plan import differing_replicas, refuse_problems
from hyper_parallel.core.distributed_checkpoint._layout_merge import merge_layout_plans
from hyper_parallel.core.distributed_checkpoint._layout_plan import DIGEST_BYTES, LayoutSavePlan, expand_save_plan
from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import LayoutSources
from hyper_parallel.core.distributed_checkpoint._save_layout import LayoutDescription, LeafSource
from hyper_parallel.core.distributed_checkpoint.errors import PlanValidationError
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import StorageWriter

__all__ = [
    "PlanMessage",
    "PlanDecision",
    "CachedPlan",
    "PlanCache",
    "PlanCacheStats",
    "STATS",
    "check_cached_replicas",
    "exchange_digest",
    "plan_cache_for",
    "clear_plan_cache",
]


@dataclass(frozen=True)
class PlanMessage:
    """What a rank sends in the digest round of a save.

    Attributes:
        local_digest: Digest of this rank's layout (:class:`.LayoutDescription`).
        cached_exchange: Digest of the exchange whose result this rank holds (``""``: none).
        replica_digests: This rank's replicated-chunk digests, in local plan order.
    """

    local_digest: str
    cached_exchange: str
    replica_digests: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlanDecision:
    """The coordinator's answer to the digest round, as each rank receives it.

    Attributes:
        exchange: Digest of this save's exchange (every rank's layout digest).
        reuse: Every rank reuses its cached plan of ``exchange``.
        storage_data: On a reuse, this rank's storage data for this save.
    """

    exchange: str
    reuse: bool
    storage_data: Any = None


@dataclass(frozen=True)
class CachedPlan:
    """A rank's result of one full plan exchange.

    Attributes:
        exchange: Digest of every rank's local plan digest, in rank order.
        final: This rank's final plan.
        all_final: Every rank's final plan (coordinator only, else ``None``).
        metadata: The merged metadata (coordinator only, else ``None``).
        replica_keys: Per rank, the (fqn, offset) of each chunk it sent a
            replica digest for, in order (coordinator only, else ``None``).
        local_plans: Instead of ``replica_keys`` after a layout-form
            exchange: every rank's plan as sent (coordinator only).
        sources: The leaf of each item of ``final`` (``None`` for values), aligned with its items.
        source_of: The same by item index.
        digested: Made by a save whose plans carried replica digests (else hashed later, see
            :meth:`.StandardSavePlanner.digest_replicas_later`): only such plans are reused by a save that hashes
            while planning, as only they let the coordinator compare this save's digests by the cached groups.
        index_plan: Returns the holders of the indexed form for these plans (:class:`._index_plan.IndexPlan`, or
            ``None`` when the plans give no chunk exactly one writer), computed once when first asked; coordinator
            only (``None`` elsewhere).
    """

    exchange: str
    final: SavePlan
    all_final: tuple[SavePlan, ...] | None
    metadata: Metadata | None
    replica_keys: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...] | None = None
    local_plans: tuple[LayoutSavePlan | SavePlan, ...] | None = None
    sources: tuple[LeafSource | None, ...] = ()
    source_of: dict[MetadataIndex, LeafSource] | None = None
    digested: bool = True
    index_plan: Any = None


def replica_keys(plans: list[SavePlan | LayoutSavePlan]) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]:
    """Per plan (rank order; layout-form plans expanded), the (fqn, offset) of every item with a replica digest."""
    return tuple(
        tuple(
            (item.index.fqn, tuple(item.index.offset)) for item in expand_save_plan(plan, rank=rank).items
            if item.tensor_data is not None and item.tensor_data.replica_digest
        )
        for rank, plan in enumerate(plans)
    )


def check_cached_replicas(cached: CachedPlan, messages: list[PlanMessage]) -> None:
    """Compare this save's replica digests by the cached replica groups. Coordinator only.

    Raises:
        PlanValidationError: Replicas of a chunk differ (names the key and the ranks).
    """
    if not any(message.replica_digests for message in messages):
        return  # nothing hashed (no replicas, or hashed later and compared before the commit)
    if cached.local_plans is not None:
        # The layout-form plans with this save's digests, merged again: the merge compares replicas per
        # layout (numpy), without a (fqn, offset) key per rank and item.
        merge_layout_plans([_with_digests(plan, message.replica_digests, rank)
                            for rank, (plan, message) in enumerate(zip(cached.local_plans, messages))])
        return
    if cached.replica_keys is None:
        return
    problems = differing_replicas((key, rank, found) for rank, (keys, message)
                                  in enumerate(zip(cached.replica_keys, messages))
                                  for key, found in zip(keys, message.replica_digests))
    refuse_problems(problems, what="the global save plan is invalid")


def _with_digests(plan: LayoutSavePlan | SavePlan, digests: tuple[str, ...], rank: int) -> LayoutSavePlan | SavePlan:
    """``plan`` carrying this save's replica digests (local plan order) instead of the cached ones."""
    if isinstance(plan, LayoutSavePlan) and len(digests) * DIGEST_BYTES == len(plan.digests) and not any(
        item.tensor_data is not None and item.tensor_data.replica_digest for item in plan.general
    ):
        try:
            return replace(plan, digests=bytes.fromhex("".join(digests)))
        except ValueError:
            pass  # not hex digests: the item form below compares them as they are
    fresh = iter(digests)
    items = tuple(
        replace(item, tensor_data=replace(item.tensor_data, replica_digest=next(fresh, None)))
        if item.tensor_data is not None and item.tensor_data.replica_digest else item
        for item in expand_save_plan(plan, rank=rank).items
    )
    return SavePlan(items=items, storage_data=plan.storage_data, planner_data=plan.planner_data)


def exchange_digest(local_digests: list[str]) -> str:
    """Digest of an exchange: every rank's local plan digest in rank order."""
    return xxhash.xxh3_128_hexdigest("\n".join(local_digests).encode("ascii"))


_LOCK = threading.Lock()
_CACHE: dict[tuple[Any, ...], CachedPlan] = {}


@dataclass
class PlanCacheStats:
    """Counts of this process's cached-plan lookups (for tests and benchmarks).

    Attributes:
        reused: Saves that reused a cached plan.
        exchanged: Saves that ran the full plan exchange.
    """

    reused: int = 0
    exchanged: int = 0


#: This process's counts.
STATS = PlanCacheStats()


class PlanCache:
    """One rank's cached plan exchange for one kind of save.

    Args:
        key: What the plans depend on besides the local plans (rank, world
            size, options, writer and planner class).
        digests_now: This save's plans carry replica digests (see :attr:`CachedPlan.digested`).
    """

    def __init__(self, key: tuple[Any, ...], *, digests_now: bool = True) -> None:
        self.key = key
        self.digests_now = digests_now
        self.local_digest = ""

    def _usable(self) -> CachedPlan | None:
        """The cached entry, if this save may reuse it (one that hashes now: only a digested one). Under ``_LOCK``."""
        cached = _CACHE.get(self.key)
        return cached if cached is not None and (cached.digested or not self.digests_now) else None

    def message(self, layout: LayoutDescription) -> PlanMessage:
        """Say which layout this rank saves and which exchange it holds. All ranks."""
        self.local_digest = layout.digest
        with _LOCK:
            cached = self._usable()
        return PlanMessage(local_digest=self.local_digest, cached_exchange=cached.exchange if cached else "",
                           replica_digests=layout.replica_digests)

    def lookup(self, messages: list[PlanMessage]) -> CachedPlan | None:
        """The cached result if every rank holds this very exchange, else ``None``. Coordinator only."""
        exchange = exchange_digest([m.local_digest for m in messages])
        if any(m.cached_exchange != exchange for m in messages):
            return None
        with _LOCK:
            cached = self._usable()
            return cached if cached is not None and cached.exchange == exchange else None

    def take(self, exchange: str) -> CachedPlan:
        """This rank's cached result of ``exchange``, which the coordinator decided to reuse. All ranks.

        Raises:
            PlanValidationError: This rank holds another exchange (the
                coordinator decides only for exchanges every rank reported).
        """
        with _LOCK:
            cached = _CACHE.get(self.key)
            if cached is None or cached.exchange != exchange:
                raise PlanValidationError(
                    f"rank {self.key[0]}: the coordinator reuses the cached plan of exchange {exchange}, which this "
                    "rank does not hold (its plan cache changed during the save?); save again"
                )
            STATS.reused += 1
            return cached

    def store(
        self,
        exchange: str,
        final: SavePlan,
        all_final: list[SavePlan] | None,
        metadata: Metadata | None,
        local_plans: list[SavePlan] | None = None,
        sources: tuple[LeafSource | None, ...] = (),
        index_plan: Any = None,
    ) -> None:
        """Keep the result of a full exchange. All ranks.

        Args:
            exchange: The digest of this save's exchange (:attr:`PlanDecision.exchange`).
            final: This rank's final plan.
            all_final: Every rank's final plan (coordinator only).
            metadata: The merged metadata (coordinator only).
            local_plans: Every rank's local plan (coordinator only).
            sources: The leaf of each item of ``final`` (``None`` for values).
            index_plan: Returns the indexed form's holders for these plans (coordinator only).
        """
        layout_form = local_plans is not None and any(isinstance(p, LayoutSavePlan) for p in local_plans)
        entry = CachedPlan(
            exchange=exchange,
            final=final,
            all_final=tuple(all_final) if all_final is not None else None,
            metadata=metadata,
            replica_keys=replica_keys(local_plans) if local_plans is not None and not layout_form else None,
            local_plans=tuple(local_plans) if layout_form else None,
            sources=sources,
            source_of={
                MetadataIndex(item.index.fqn, item.index.offset): source
                for item, source in zip(final.items, sources) if source is not None
            },
            digested=self.digests_now,
            index_plan=index_plan,
        )
        with _LOCK:
            _CACHE[self.key] = entry
            STATS.exchanged += 1


def plan_cache_for(
    writer: StorageWriter, planner: SavePlanner, options: Any, *, rank: int, world_size: int
) -> PlanCache | None:
    """The plan cache of this kind of save, or ``None`` when its plans are not cached."""
    if type(planner) is not StandardSavePlanner:  # pylint: disable=unidiomatic-typecheck
        return None
    # Plans made with replicas hashed later carry no replica digests: they are never reused for a save that hashes
    # now; a save hashing later reuses either (its replicas are compared before the commit).
    key = (rank, world_size, _hashable_options(options), type(writer), planner.allow_pickle, planner.check_replicas)
    try:
        hash(key)
    except TypeError:  # an option given as a mutable object (a dict of layouts): not cached
        return None
    return PlanCache(key, digests_now=planner.later_replicas is None)


def _frozen(value: Any) -> Any:
    """``value`` with its lists, tuples and mappings turned into tuples (keys sorted), recursively."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(entry) for entry in value)
    if isinstance(value, Mapping):
        return tuple(sorted(((str(name), _frozen(entry)) for name, entry in value.items()), key=lambda pair: pair[0]))
    if isinstance(value, LayoutSources):
        return replace(value, strategy_file=_frozen(value.strategy_file))
    return value


def _hashable_options(options: Any) -> Any:
    """Save options usable in a cache key: a strategy given as a list of per-stage files or a mapping is frozen.

    The key only selects the cache; whether a plan is reused is decided by the layout digest, which
    covers the layouts a strategy gives (so two strategies frozen alike can never share a plan).
    """
    if is_dataclass(options) and getattr(options, "strategy_file", None) is not None:
        return replace(options, strategy_file=_frozen(options.strategy_file))
    return options


def clear_plan_cache() -> None:
    """Forget every cached plan (tests; or to force a full exchange)."""
    with _LOCK:
        _CACHE.clear()
