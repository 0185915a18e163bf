"""Which rank writes each chunk of a layout-form save merge (:mod:`._layout_merge`).

The rule of :func:`.assign_writers` (largest first, to the least-loaded holder,
lowest rank on ties; the lowest holder with ``save_to_minimum``), applied per
replica group of a regular tensor's layout instead of per item, with one
lazily refreshed heap per holder group. Coordinator only; pure.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hyper_parallel.platform.dtypes import DTYPE_NAMES

__all__ = ["ChunkWriters", "LayoutMerge", "RegularTensor"]


@dataclass
class RegularTensor:
    """A regular tensor of a layout merge: how its declarations agree, and where its ranks' entries are."""

    fqn: str
    dtype: str
    size: tuple[int, ...]
    layout: Any  # the canonical Layout, or None (whole on every declaring rank)
    digest: bool
    tables: list[int] = field(default_factory=list)
    columns: list[int] = field(default_factory=list)  # the digest column in each table (-1: none)
    positions: list[int] = field(default_factory=list)  # the entry position in each table


class LayoutMerge(Protocol):
    """What :class:`ChunkWriters` reads of the merge (:class:`._layout_merge._Merge`)."""

    world: int
    remove_redundancy: bool
    save_to_minimum: bool
    tensors: dict[str, RegularTensor]
    general: dict[int, Any]  # per rank, its general items by position (``.items``)

    def grid(self, layout: Any) -> Any:
        """The shard grid of ``layout`` (``shard_of_rank``, ``replicas``)."""


class ChunkWriters:
    """Which rank writes each chunk: the rule of :func:`.assign_writers`, per holder group.

    Args:
        merge: The merge whose regular tensors and general items are chosen for.
        groups: Every general item as its holders ``(rank, position)``, by ``(fqn, offset)``.
        ranks_of: The sorted ranks declaring each regular tensor, by fqn.
    """

    def __init__(self, merge: LayoutMerge, groups: dict[Any, list[tuple[int, int]]], ranks_of: dict[str, np.ndarray]):
        self.merge = merge
        self.groups = groups
        self.ranks_of = ranks_of
        self.load = np.zeros(merge.world, dtype=np.int64)
        self.heaps: dict[Any, list[tuple[int, int]]] = {}

    def _size(self, tensor: RegularTensor) -> int:
        local = tensor.layout.local_shape(tensor.size) if tensor.layout is not None else tensor.size
        return math.prod(local) * DTYPE_NAMES[tensor.dtype]

    def choose(self) -> tuple[dict[str, np.ndarray], dict[int, set[int]], tuple[int, ...]]:
        """Per regular tensor the writer of each rank's chunk (``None``-less: every rank), general keeps, bytes."""
        merge = self.merge
        writers: dict[str, np.ndarray] = {}
        written = np.zeros(merge.world, dtype=np.int64)
        units: list[tuple[Any, ...]] = []
        for tensor in merge.tensors.values():
            ranks = self.ranks_of[tensor.fqn]
            size = self._size(tensor)
            replicas = len(ranks) if tensor.layout is None else self.merge.grid(tensor.layout).replicas
            if replicas == 1 or not merge.remove_redundancy:
                written[ranks] += size
                self.load[ranks] += size
                continue
            units.append((-size, tensor.fqn, (), tensor))
        general_keep: dict[int, set[int]] = defaultdict(set)
        for key, holders in self.groups.items():
            item = merge.general[holders[0][0]].items[holders[0][1]]
            size = item.storage_size()
            ranks = sorted({rank for rank, _ in holders})
            if len(holders) == 1:
                self.load[ranks[0]] += size
            elif merge.remove_redundancy:
                units.append((-size, key[0], key[1], holders))
                continue
            self._keep(general_keep, holders, ranks, size, written)
        units.sort(key=lambda unit: unit[:3])
        load = self.load.tolist()
        for size, _, _, what in units:
            if isinstance(what, RegularTensor):
                writers[what.fqn] = self._tensor_writers(what, -size, load, written)
            else:
                ranks = sorted({rank for rank, _ in what})
                best = ranks[0] if merge.save_to_minimum else min(ranks, key=lambda r: (load[r], r))
                load[best] += -size
                self._keep(general_keep, what, [best], -size, written)
        return writers, general_keep, tuple(int(b) for b in written)

    @staticmethod
    def _keep(keep: dict[int, set[int]], holders: list[tuple[int, int]], ranks: list[int], size: int,
              written: np.ndarray) -> None:
        position_of: dict[int, int] = {}
        for rank, position in holders:
            position_of.setdefault(rank, position)
        for rank in ranks:
            keep[rank].add(position_of[rank])
            written[rank] += size

    def _tensor_writers(self, tensor: RegularTensor, size: int, load: list[int], written: np.ndarray) -> np.ndarray:
        """The writer of every rank's chunk of a replicated tensor (shards in offset order)."""
        merge = self.merge
        ranks = self.ranks_of[tensor.fqn]
        chosen = np.full(merge.world, -1, dtype=np.int64)
        if tensor.layout is None:
            groups = [(("whole", tuple(tensor.tables)), ranks)]
        else:
            shard = merge.grid(tensor.layout).shard_of_rank[ranks]
            order = np.argsort(shard, kind="stable")
            bounds = np.flatnonzero(np.diff(shard[order])) + 1
            groups = [((id(tensor.layout), int(shard[part[0]])), ranks[part])
                      for part in np.split(order, bounds)]
        for key, holders in groups:
            if merge.save_to_minimum:
                best = int(holders.min())
            else:
                best = self._least_loaded(key, holders, load)
            load[best] += size
            written[best] += size
            chosen[holders] = best
        return chosen

    def _least_loaded(self, key: Any, holders: np.ndarray, load: list[int]) -> int:
        """The holder with the least load (lowest rank on ties), by a lazily refreshed heap."""
        heap = self.heaps.get(key)
        if heap is None:
            heap = self.heaps[key] = [(load[r], r) for r in holders.tolist()]
            heapq.heapify(heap)
        while True:
            stored, rank = heap[0]
            if stored == load[rank]:
                break
            heapq.heapreplace(heap, (load[rank], rank))
        return rank  # its entry turns stale when the caller adds to its load; refreshed on a later look
