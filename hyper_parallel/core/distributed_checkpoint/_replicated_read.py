"""Read once, share over the collective: single-replica loading (Orbax-style).

When many ranks load the same region of the same stored chunk (replicated
state, DTensor replicas), only one of them reads it from storage; the others
receive it over the collective. The coordinator assigns each shared region to
the requesting rank with the fewest bytes to read so far, and cuts the
exchange into rounds of at most ``round_bytes`` sent per rank, so the extra
memory held for sharing stays bounded.

Regions travel in the stored dtype (each receiver casts to its own target),
so ranks with different target dtypes get exact values.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, ReadItem

__all__ = ["ReadExchange", "RegionKey", "region_key", "plan_single_replica_reads"]

#: A stored region: (fqn, chunk offset, offsets in the chunk, lengths, kind).
RegionKey = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], str]
_VALUE = LoadItemType.BYTE_IO.value


def region_key(item: ReadItem) -> RegionKey:
    """The stored region an item reads (equal for identical reads on any rank)."""
    return (item.storage_index.fqn, tuple(item.storage_index.offset), tuple(item.storage_offsets),
            tuple(item.lengths), item.type.value)


@dataclass(frozen=True)
class ReadExchange:
    """One rank's part in the sharing (stored in ``LoadPlan.planner_data``).

    Attributes:
        rounds: Number of exchange rounds (equal on every rank).
        item_rounds: Round in which each item of the plan is read.
        send: Slot id of each region this rank reads for others, with its round.
        receive: ``(slot, round, item)`` of each region another rank reads for this one.
    """

    rounds: int
    item_rounds: tuple[int, ...]
    send: dict[RegionKey, tuple[int, int]]
    receive: tuple[tuple[int, int, ReadItem], ...]


def plan_single_replica_reads(all_plans: list[LoadPlan], *, round_bytes: int, item_bytes: Any) -> list[LoadPlan]:
    """Assign every shared region to one reader. Coordinator only.

    Args:
        all_plans: Every rank's local load plan.
        round_bytes: Most bytes a rank sends in one round.
        item_bytes: Function giving the stored byte size of a read item.

    Returns:
        Each rank's plan without the regions others read for it, with a
        :class:`ReadExchange` as ``planner_data``.
    """
    holders: dict[RegionKey, list[tuple[int, int]]] = defaultdict(list)
    for rank, plan in enumerate(all_plans):
        for position, item in enumerate(plan.items):
            holders[region_key(item)].append((rank, position))
    load = [0] * len(all_plans)
    reader: dict[RegionKey, int] = {}
    # Values are not shared: each rank decodes its own before any tensor lands (LoadPlanner.value_reads).
    shared = sorted((k for k, v in holders.items() if len({r for r, _ in v}) > 1 and k[4] != _VALUE),
                    key=lambda k: -item_bytes(all_plans[holders[k][0][0]].items[holders[k][0][1]]))
    for key, ranks in holders.items():
        if len({r for r, _ in ranks}) == 1:
            rank, position = ranks[0]
            load[rank] += item_bytes(all_plans[rank].items[position])
    for key in shared:
        size = item_bytes(all_plans[holders[key][0][0]].items[holders[key][0][1]])
        best = min({r for r, _ in holders[key]}, key=lambda r: (load[r], r))
        reader[key] = best
        load[best] += size
    # Rounds: each reader sends at most round_bytes per round (at least one region).
    sent = [0] * len(all_plans)
    current = [0] * len(all_plans)
    slots: dict[RegionKey, tuple[int, int]] = {}
    for slot, key in enumerate(shared):
        rank = reader[key]
        size = item_bytes(all_plans[holders[key][0][0]].items[holders[key][0][1]])
        if sent[rank] and sent[rank] + size > round_bytes:
            current[rank] += 1
            sent[rank] = 0
        sent[rank] += size
        slots[key] = (slot, current[rank])
    rounds = max(current) + 1 if shared else 1
    out = []
    for rank, plan in enumerate(all_plans):
        items, item_rounds, receive = [], [], []
        send: dict[RegionKey, tuple[int, int]] = {}
        for item in plan.items:
            key = region_key(item)
            if key not in reader:
                items.append(item)
                item_rounds.append(0)
            elif reader[key] == rank:
                items.append(item)
                item_rounds.append(slots[key][1])
                send[key] = slots[key]
            else:
                receive.append((slots[key][0], slots[key][1], item))
        exchange = ReadExchange(rounds=rounds, item_rounds=tuple(item_rounds), send=send, receive=tuple(receive))
        out.append(replace(plan, items=tuple(items), planner_data=exchange))
    return out
