"""The coordinator's merge of every rank's save plan.

Pure functions over plans, so they can be driven for any number of simulated
ranks in one process. Three jobs, all linear in the number of items (plus a
sort of the replicated items by size):

- deduplicate: items with the same fqn and global offset on several ranks are
  replicas; exactly one rank writes each (balanced bytes, or the lowest rank);
- validate: same dtype, global shape and kind everywhere; the stored boxes of
  every tensor cover it exactly; replicated values agree. Every problem is
  reported in one :class:`PlanValidationError`;
- describe: the checkpoint :class:`Metadata` (without storage data).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from hyper_parallel.core.distributed_checkpoint._format.cover import MAX_REPORTED_PROBLEMS, check_exact_cover
from hyper_parallel.core.distributed_checkpoint._gc_pause import paused_gc
from hyper_parallel.core.distributed_checkpoint.errors import PlanValidationError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, WriteItem

__all__ = ["build_global_save_plan", "assign_writers", "replica_problems", "differing_replicas", "check_replicas_of",
           "describe_general", "refuse_problems"]

Holder = tuple[int, int]  # (rank, position of the item in that rank's plan)
ItemKey = tuple[str, tuple[int, ...]]  # (fqn, global offset): plain tuples hash fast


def assign_writers(
    groups: dict[ItemKey, list[Holder]],
    sizes: dict[ItemKey, int],
    *,
    world_size: int,
    remove_redundancy: bool,
    save_to_minimum_rank: bool,
) -> dict[ItemKey, list[int]]:
    """Choose which holder(s) write each item.

    Args:
        groups: For each item, every ``(rank, position)`` holding it.
        sizes: Byte size of each item.
        world_size: Number of ranks.
        remove_redundancy: ``False`` keeps every holder.
        save_to_minimum_rank: Give each replicated item to its lowest rank.

    Returns:
        For each item, the ranks that write it.
    """
    if not remove_redundancy:
        return {index: sorted({rank for rank, _ in holders}) for index, holders in groups.items()}
    if save_to_minimum_rank:
        return {index: [min(rank for rank, _ in holders)] for index, holders in groups.items()}
    load = [0] * world_size
    chosen: dict[ItemKey, list[int]] = {}
    replicated: list[ItemKey] = []
    for index, holders in groups.items():
        if len(holders) == 1:
            rank = holders[0][0]
            chosen[index] = [rank]
            load[rank] += sizes[index]
        else:
            replicated.append(index)
    # Largest first, each to the least-loaded holder (lowest rank on ties).
    replicated.sort(key=lambda idx: (-sizes[idx], idx))
    for index in replicated:
        ranks = {rank for rank, _ in groups[index]}
        best = min(ranks, key=lambda r: (load[r], r))
        chosen[index] = [best]
        load[best] += sizes[index]
    return chosen


def build_global_save_plan(
    all_plans: list[SavePlan],
    *,
    remove_redundancy: bool = True,
    save_to_minimum_rank: bool = False,
    planner_data: Any = None,
) -> tuple[list[SavePlan], Metadata]:
    """Deduplicate, validate and describe the plans of every rank. Coordinator only.

    Raises:
        PlanValidationError: listing every inconsistency found.
    """
    # Millions of small objects: pause the cyclic GC, whose full passes would
    # otherwise make the merge superlinear in the number of items.
    with paused_gc():
        return _build_global_save_plan(all_plans, remove_redundancy, save_to_minimum_rank, planner_data)


def _build_global_save_plan(
    all_plans: list[SavePlan], remove_redundancy: bool, save_to_minimum_rank: bool, planner_data: Any
) -> tuple[list[SavePlan], Metadata]:
    world_size = len(all_plans)
    groups: dict[ItemKey, list[Holder]] = defaultdict(list)
    first_item: dict[ItemKey, WriteItem] = {}
    for rank, plan in enumerate(all_plans):
        for position, item in enumerate(plan.items):
            key = (item.index.fqn, item.index.offset)
            holders = groups[key]
            if not holders:
                first_item[key] = item
            holders.append((rank, position))

    problems: list[str] = []
    sizes: dict[ItemKey, int] = {}
    by_fqn: dict[str, list[ItemKey]] = defaultdict(list)
    for key, holders in groups.items():
        by_fqn[key[0]].append(key)
        first = first_item[key]
        sizes[key] = first.storage_size()
        if len(holders) > 1:
            problems.extend(check_replicas_of(key, holders, all_plans))

    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, keys in by_fqn.items():
        problems.extend(describe_general(fqn, keys, groups, all_plans, state_dict_metadata))

    refuse_problems(problems, what="the global save plan is invalid")

    writers = assign_writers(
        groups,
        sizes,
        world_size=world_size,
        remove_redundancy=remove_redundancy,
        save_to_minimum_rank=save_to_minimum_rank,
    )
    keep: list[set[int]] = [set() for _ in range(world_size)]
    for key, ranks in writers.items():
        holders = groups[key]
        if len(holders) == 1:
            keep[holders[0][0]].add(holders[0][1])
            continue
        position_of = {}
        for holder_rank, position in holders:
            position_of.setdefault(holder_rank, position)
        for rank in ranks:
            keep[rank].add(position_of[rank])
    final_plans = [
        SavePlan(
            items=tuple(item for position, item in enumerate(plan.items) if position in keep[rank]),
            storage_data=plan.storage_data,
            planner_data=plan.planner_data,
        )
        for rank, plan in enumerate(all_plans)
    ]
    bytes_per_rank = tuple(sum(item.storage_size() for item in plan.items) for plan in final_plans)
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=planner_data,
        storage_meta=StorageMeta(world_size=world_size, bytes_per_rank=bytes_per_rank),
    )
    return final_plans, metadata


_MIXED_KINDS = "'{fqn}': saved as a tensor by some ranks and as a non-tensor value by others"


def describe_general(fqn: str, keys: list[ItemKey], groups: dict[ItemKey, list[Holder]], all_plans: Any,
                     out: dict[str, Any]) -> list[str]:
    """Check the items of ``fqn`` agree and put its metadata into ``out``; return the problems.

    ``all_plans[rank].items[position]`` is the item of each holder.
    """
    first = [all_plans[groups[k][0][0]].items[groups[k][0][1]] for k in keys]
    if len({item.tensor_data is not None for item in first}) > 1:
        return [_MIXED_KINDS.format(fqn=fqn)]
    if first[0].tensor_data is not None:
        return _describe_tensor(fqn, keys, groups, all_plans, out)
    return _describe_bytes(fqn, keys, groups, all_plans, out)


def check_replicas_of(key: ItemKey, holders: list[Holder], all_plans: Any) -> list[str]:
    """The problems of one item several ranks hold (``all_plans[rank].items[position]``)."""
    items = [(rank, all_plans[rank].items[position]) for rank, position in holders]
    first = items[0][1]
    if first.tensor_data is not None:
        shapes = defaultdict(list)
        for rank, item in items:
            sizes = item.tensor_data.chunk.sizes if item.tensor_data is not None else None
            shapes[sizes].append(rank)
        if len(shapes) > 1:
            detail = "; ".join(f"ranks {ranks} hold sizes {sizes}" for sizes, ranks in shapes.items())
            return [f"'{key[0]}': shards at offset {key[1]} differ in size ({detail}); they overlap"]
        if any(item.tensor_data.exclusive for _, item in items) and len({rank for rank, _ in items}) > 1:
            return [_two_main_replicas(key, items)]  # (one object under two paths of one rank is one box)
        return _check_replica_digests(key, items)

    digests = defaultdict(list)
    for rank, item in items:
        digest = item.bytes_io_data.digest if item.bytes_io_data is not None else None
        digests[digest].append(rank)
    if len(digests) > 1:
        groups = "; ".join(f"ranks {ranks}" for ranks in digests.values())
        where = f" at grid position {key[1]}" if key[1] else ""
        return [
            f"'{key[0]}'{where}: the value differs between ranks ({groups} each agree); a plain value must be "
            "equal on every rank: put per-rank values in a ShardedObject"
        ]
    return []


def _two_main_replicas(key: ItemKey, items: list[tuple[int, WriteItem]]) -> str:
    """The problem of a ShardedTensor box several ranks offer as its main replica (only one copy is written)."""
    ranks = sorted({rank for rank, _ in items})
    sizes = list(items[0][1].tensor_data.chunk.sizes)
    return (
        f"'{key[0]}': the box at global offset {list(key[1])} of sizes {sizes} is offered as the main replica "
        f"(replica_id 0) of a ShardedTensor by ranks {ranks}; only one copy is saved, so the others would be lost "
        "without a word if they differ: give the copies on all ranks but one a replica_id other than 0 (e.g. the "
        "rank's data-parallel index), or give each rank its own global offset"
    )


def _check_replica_digests(key: ItemKey, items: list[tuple[int, WriteItem]]) -> list[str]:
    """Replicas of one tensor chunk must hold the same bytes (when every holder sent a digest)."""
    if len({item.tensor_data.properties.dtype for _, item in items}) > 1:
        return []  # reported as a dtype difference
    found = [(rank, item.tensor_data.replica_digest) for rank, item in items]
    if any(d is None for _, d in found):
        return []
    return replica_problems(key, found)


def refuse_problems(problems: list[str], *, what: str) -> None:
    """Raise one error listing ``problems`` (the first :data:`.MAX_REPORTED_PROBLEMS`), if any. Coordinator.

    Raises:
        PlanValidationError: ``"<what> (<n> problem(s)):"`` and the problems, one a line.
    """
    if problems:
        shown = problems[:MAX_REPORTED_PROBLEMS]
        more = len(problems) - len(shown)
        text = "\n  ".join(shown) + (f"\n  ... and {more} more" if more else "")
        raise PlanValidationError(f"{what} ({len(problems)} problem(s)):\n  {text}")


def differing_replicas(found: Iterable[tuple[ItemKey, int, str]]) -> list[str]:
    """The problems of the chunks whose holders sent different digests (``found``: key, rank and digest of each
    holder). Coordinator; pure."""
    holders: dict[ItemKey, list[tuple[int, str]]] = {}
    for key, rank, digest in found:
        holders.setdefault(key, []).append((rank, digest))
    return [problem for key, held in holders.items() if len(held) > 1 for problem in replica_problems(key, held)]


def replica_problems(key: ItemKey, found: list[tuple[int, str]]) -> list[str]:
    """The problem (if any) of one chunk whose holders sent ``(rank, digest)``."""
    digests: dict[str, list[int]] = defaultdict(list)
    for rank, value in found:
        digests[value].append(rank)
    if len(digests) < 2:
        return []
    groups = "; ".join(f"ranks {ranks}" for ranks in sorted(digests.values()))
    where = f" (chunk at offset {list(key[1])})" if any(key[1]) else ""
    return [
        f"'{key[0]}'{where}: replicas differ between ranks ({groups} each agree); a tensor saved as replicated "
        "must be equal on every rank holding it: synchronise it, give it its layout (a DTensor or strategy_file=) "
        "if each rank holds a different part, or pass check_replicas=False to skip this check"
    ]


def _describe_tensor(fqn, keys, groups, all_plans, out) -> list[str]:
    problems: list[str] = []
    dtypes: dict[str, set[int]] = defaultdict(set)
    shapes: dict[tuple[int, ...], set[int]] = defaultdict(set)
    for key in keys:
        for rank, position in groups[key]:
            data = all_plans[rank].items[position].tensor_data
            if data is None:  # a later holder's item of the other kind (a numpy scalar here, a 0-d array there)
                return [_MIXED_KINDS.format(fqn=fqn)]
            dtypes[data.properties.dtype].add(rank)
            shapes[data.size].add(rank)
    if len(dtypes) > 1:
        detail = "; ".join(f"{name} on ranks {sorted(ranks)}" for name, ranks in dtypes.items())
        problems.append(f"'{fqn}': dtype differs between ranks ({detail})")
    if len(shapes) > 1:
        detail = "; ".join(f"{list(shape)} on ranks {sorted(ranks)}" for shape, ranks in shapes.items())
        problems.append(f"'{fqn}': global shape differs between ranks ({detail})")
    if problems:
        return problems
    size = next(iter(shapes))
    chunks = sorted(
        (all_plans[groups[k][0][0]].items[groups[k][0][1]].tensor_data.chunk for k in keys),
        key=lambda c: c.offsets,
    )
    problems.extend(check_exact_cover(fqn, size, chunks))
    out[fqn] = TensorStorageMetadata(
        properties=TensorProperties(dtype=next(iter(dtypes))), size=size, chunks=tuple(chunks)
    )
    return problems


def _describe_bytes(fqn, keys, groups, all_plans, out) -> list[str]:
    type_names: dict[str, list[int]] = defaultdict(list)
    grids: set[tuple[int, ...]] = set()
    for key in keys:
        for rank, position in groups[key]:
            data = all_plans[rank].items[position].bytes_io_data
            if data is None:
                return [_MIXED_KINDS.format(fqn=fqn)]
            type_names[data.type_name].append(rank)
            grids.add(data.global_shape)
    problems = []
    if len(type_names) > 1:
        detail = "; ".join(f"{name} on ranks {sorted(set(ranks))}" for name, ranks in type_names.items())
        problems.append(f"'{fqn}': value type differs between ranks ({detail})")
    if len(grids) > 1:
        problems.append(f"'{fqn}': ShardedObject global_shape differs between ranks ({sorted(grids)})")
    if problems:
        return problems
    out[fqn] = BytesStorageMetadata(
        type_name=next(iter(type_names)),
        global_shape=next(iter(grids)),
        shard_offsets=tuple(sorted(k[1] for k in keys)),
    )
    return []
