"""The default save planner: what to write from a state dict.

:class:`StandardSavePlanner` offers one write item per tensor piece (a whole
tensor, a DTensor shard, a ShardedTensor box) and one bytes item per value;
tensors stay in its cache, never in plans. The coordinator's merge is
:func:`._global_plan.build_global_save_plan`. Re-exported by
:mod:`.standard_planner`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.checksum import digest
from hyper_parallel import platform
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError, UnsupportedTypeError
from hyper_parallel.core.distributed_checkpoint._flatten import (
    FlatStateDict,
    check_one_main_replica_per_box,
    flatten_state_dict,
)
from hyper_parallel.core.distributed_checkpoint._leaf_entry import classify_leaf, dtype_advice
from hyper_parallel.core.distributed_checkpoint._global_plan import build_global_save_plan
from hyper_parallel.core.distributed_checkpoint._save_layout import (
    LayoutDescription,
    LayoutListener,
    LeafSource,
    describe_layout,
    leaf_array,
    piece_array,
    plain_tensor,
)
from hyper_parallel.core.distributed_checkpoint._layout_merge import merge_layout_plans
from hyper_parallel.core.distributed_checkpoint._unwritten_keys import key_hash, pack_hashes, refuse_unwritten
from hyper_parallel.core.distributed_checkpoint._layout_plan import LayoutSavePlan, compact_save_plan
from hyper_parallel.core.distributed_checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from hyper_parallel.core.distributed_checkpoint.planner import (
    BytesWriteData, SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType,
)
from hyper_parallel.core.distributed_checkpoint._state_items import SkipEntry, TensorEntry, TensorPiece, ValueEntry
from hyper_parallel.core.distributed_checkpoint.type_handlers import serialize_value
from hyper_parallel.platform.dtypes import dtype_name

__all__ = ["AliasData", "StandardSavePlanner"]


@dataclass(frozen=True)
class AliasData:
    """A local save plan's planner data: Parameters this rank reached under several paths.

    The coordinator merges every rank's aliases into the metadata's
    ``planner_data["aliases"]`` (docs/format.md 6.3); loads read them back to
    find a Parameter stored once under its first path.

    Attributes:
        aliases: ``(dotted name, stored key)`` pairs, sorted.
        unwritten: Keys this rank holds only as replicas another rank writes (``replica_id`` not 0), as sorted
            8-byte hashes (:func:`._unwritten_keys.pack_hashes`): the coordinator refuses a key no rank writes.
    """

    aliases: tuple[tuple[str, str], ...]
    unwritten: bytes = b""


def _check_utf8_keys(keys: dict[str, list[str]]) -> None:
    """Refuse a key that is not valid UTF-8 (a lone surrogate such as ``"w\\udc80"``): the data file's JSON
    header would name it by an escape every other safetensors reader rejects. One encode of all keys."""
    try:
        "".join(keys).encode("utf-8")
    except UnicodeEncodeError:
        bad = next(key for key in keys if not _is_utf8(key))
        raise CheckpointValueError(
            f"checkpoint key {ascii(bad)} holds a lone surrogate (not valid UTF-8): a safetensors reader cannot "
            "open a file naming it; rename the key to valid Unicode (e.g. decode the bytes it came from with "
            "errors='replace' instead of 'surrogateescape')"
        ) from None


def _is_utf8(key: str) -> bool:
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _merged_aliases(all_plans: list[Any]) -> dict[str, Any] | None:
    """The metadata's planner data: every rank's aliases (first rank naming one wins)."""
    aliases: dict[str, str] = {}
    for plan in all_plans:
        if isinstance(plan.planner_data, AliasData):
            for name, key in plan.planner_data.aliases:
                aliases.setdefault(name, key)
    return {"aliases": dict(sorted(aliases.items()))} if aliases else None


class StandardSavePlanner(SavePlanner):
    """Plans a save of a (nested) state dict.

    Args:
        allow_pickle: Pickle values of types with no registered handler.
        check_replicas: With more than one rank, put an xxh3 digest of every
            possibly replicated tensor chunk into the plan; the coordinator
            fails the save if replicas of one chunk differ (naming key and ranks).
    """

    def __init__(self, *, allow_pickle: bool = False, check_replicas: bool = True) -> None:
        self.allow_pickle = allow_pickle
        self.check_replicas = check_replicas
        self.flat: FlatStateDict | None = None
        self.rank = 0
        self.world_size = 1
        self.is_coordinator = True
        self.remove_redundancy = True
        self.save_to_minimum_rank = False
        self._tensors: dict[MetadataIndex, tuple[TensorEntry, TensorPiece]] = {}
        self._bytes: dict[MetadataIndex, bytes] = {}
        self._serialized: dict[MetadataIndex, tuple[str, bytes]] = {}
        self._replica_digests: dict[tuple[str, tuple[int, ...]], str] = {}
        self._sources: dict[MetadataIndex, LeafSource] = {}
        self._bound: tuple[tuple[WriteItem, ...], tuple[LeafSource | None, ...]] | None = None
        self._bound_of: dict[MetadataIndex, LeafSource] = {}
        self.leaf_arrays: dict[str, np.ndarray] = {}
        self._layouts: dict[MetadataIndex, Any] = {}
        self._unwritten: dict[int, str] = {}  # hash -> key this rank holds only as non-main replicas
        #: ``None``: replicas are hashed while planning; else the pieces to hash later (:meth:`digest_replicas_later`).
        self.later_replicas: list[tuple[str, tuple[int, ...], np.ndarray]] | None = None

    def configure_planner(
        self,
        state_dict: dict[str, Any],
        *,
        rank: int = 0,
        world_size: int = 1,
        is_coordinator: bool = True,
        remove_redundancy: bool = True,
        save_to_minimum_rank: bool = False,
    ) -> None:
        """Flatten this rank's state dict. All ranks call it first.

        Raises:
            CheckpointValueError: a key a safetensors file cannot hold (not valid UTF-8: a lone surrogate), or
                two main replicas of one box of a ShardedTensor/ShardedObject key.
        """
        self.flat = flatten_state_dict(state_dict)
        _check_utf8_keys(self.flat.key_users)
        if self.flat.shared_keys:
            check_one_main_replica_per_box(self.flat)
        self.rank, self.world_size, self.is_coordinator = rank, world_size, is_coordinator
        self.remove_redundancy = remove_redundancy
        self.save_to_minimum_rank = save_to_minimum_rank
        self._tensors.clear()
        self._bytes.clear()
        self._serialized.clear()
        self._replica_digests.clear()
        self._sources.clear()
        self._bound, self._bound_of = None, {}
        self.leaf_arrays = {}
        self._layouts.clear()
        if self.later_replicas is not None:
            self.later_replicas = []

    def describe_layout(self, listener: LayoutListener | None = None) -> LayoutDescription:
        """Digest this rank's layout without building a plan (:mod:`._save_layout`). All ranks.

        Called after :meth:`configure_planner`; a save whose layout repeats the
        previous one's reuses its plan (:meth:`bind_sources`), else calls
        :meth:`build_local_plan`, which reuses the values serialised and the
        replicas hashed here.

        Args:
            listener: Told each whole tensor in host memory as it is met, then the result.

        Raises:
            UnsupportedTypeError: A value or dtype no checkpoint stores (names the key).
        """
        if self.flat is None:
            raise CheckpointValueError("configure_planner must be called before describe_layout")
        return describe_layout(self, listener)

    def digest_replicas_later(self, later: bool) -> None:
        """Whether the layout pass keeps the possibly replicated pieces unhashed. All ranks, before planning.

        With ``later``, the plans carry no replica digests: the writer hashes
        its snapshot of the kept pieces (:meth:`replica_digests`) and the
        coordinator compares them before it commits (a multi-rank async save
        with a forked writer, :mod:`._background_commit`).
        """
        self.later_replicas = [] if later else None

    def replica_digests(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """``(key, chunk offset, xxh3 digest)`` of each piece the layout pass kept (:meth:`digest_replicas_later`).

        Called by the writer that holds the snapshot (a forked writer process).
        """
        return tuple((fqn, offsets, digest(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))))
                     for fqn, offsets, array in self.later_replicas or ())

    def snapshot_leaves(self, arrays: dict[str, np.ndarray]) -> None:
        """Plan and serve the named whole tensors from ``arrays`` from now on (copies taken at call time).

        After :meth:`describe_layout`: a plan built later (off the blocking
        part of an async save) then sees the state as it was at the call,
        never the caller's tensors, which may have changed (or been replaced)
        since. Whoever plans the save calls it.
        """
        values = self.flat.values
        for name, array in arrays.items():
            values[name] = array
        self.leaf_arrays.update(arrays)

    def classify(self, fqn: str, value: Any) -> TensorEntry | ValueEntry | SkipEntry:
        """Classify one leaf stored under ``fqn`` (:func:`._state_items.make_entry`)."""
        return classify_leaf(fqn, value)

    @staticmethod
    def classify_dtype(fqn: str, value: Any) -> str:
        """The stored dtype name of a whole tensor stored under ``fqn``.

        Raises:
            UnsupportedTypeError: A dtype no checkpoint stores (names the key).
        """
        try:
            return dtype_name(value)
        except TypeError as exc:
            raise UnsupportedTypeError(f"checkpoint item {fqn!r}: {exc}; {dtype_advice(value)}") from exc

    def keep_replica_digest(self, fqn: str, offsets: tuple[int, ...], found: str) -> None:
        """Remember a replicated piece's digest for the local plan of this save."""
        self._replica_digests[(fqn, offsets)] = found

    def serialize(self, entry: ValueEntry) -> tuple[str, bytes]:
        """Serialise a value once per save; return ``(type name, payload)`` (kept for writing)."""
        index = MetadataIndex(entry.fqn, entry.offset)
        found = self._serialized.get(index)
        if found is None:
            found = serialize_value(entry.value, key=entry.fqn, allow_pickle=self.allow_pickle)
            self._serialized[index] = found
            self._bytes[index] = found[1]
        return found

    def sources_for(self, items: tuple[WriteItem, ...]) -> tuple[LeafSource | None, ...]:
        """The leaf of each item of a plan this planner built (``None`` for values), for a later reuse."""
        return tuple(self._sources.get(MetadataIndex(item.index.fqn, item.index.offset)) for item in items)

    def bind_sources(
        self,
        items: tuple[WriteItem, ...],
        sources: tuple[LeafSource | None, ...],
        by_index: dict[MetadataIndex, LeafSource],
    ) -> None:
        """Serve the items of a reused plan from this save's leaves (no local plan built). All ranks.

        Args:
            items: The reused plan's items.
            sources: The leaf of each item (``None`` for values), aligned with ``items``.
            by_index: The same by item index (for :meth:`get_data`).
        """
        self._bound, self._bound_of = (items, sources), by_index

    def stage_arrays(self, items: tuple[WriteItem, ...]) -> Iterator[np.ndarray | bytes]:
        """Yield the data of ``items`` in order, as :meth:`get_data` would (one tight loop for a reused plan)."""
        arrays = self.leaf_arrays
        for item, source in zip(items, self._item_sources(items)):
            if source is None or not source.plain:
                yield self.get_data(item)
            else:
                array = arrays.get(source.name)
                yield array if array is not None else leaf_array(self.flat.values[source.name])

    def _item_sources(self, items: tuple[WriteItem, ...]) -> tuple[LeafSource | None, ...]:
        if self._bound is not None and self._bound[0] is items:
            return self._bound[1]
        return self.sources_for(items)

    def leaf_names(self, items: tuple[WriteItem, ...]) -> tuple[str | None, ...]:
        """The whole-tensor leaf each item is (``None`` for pieces and values), in order."""
        return tuple(s.name if s is not None and s.plain else None for s in self._item_sources(items))

    def _leaf_piece(self, source: LeafSource) -> np.ndarray:
        entry = classify_leaf(self.flat.storage_keys[source.name], self.flat.values[source.name])
        return piece_array(entry, entry.pieces[source.piece])

    def build_local_plan(self) -> SavePlan:
        """Return one item per tensor piece and per value. All ranks call it.

        Raises:
            UnsupportedTypeError: a value of a type with no handler (names the key).
        """
        if self.flat is None:
            raise CheckpointValueError("configure_planner must be called before build_local_plan")
        items: list[WriteItem] = []
        unwritten: set[str] = set()
        for name, value in self.flat.values.items():
            entry = classify_leaf(self.flat.storage_keys[name], value)
            if isinstance(entry, SkipEntry):
                continue
            if not entry.write:
                unwritten.add(entry.fqn)
                continue
            if isinstance(entry, TensorEntry):
                items.extend(self._tensor_items(entry, name, plain_tensor(value)))
            else:
                items.append(self._bytes_item(entry))
        aliases = tuple(sorted(self.flat.aliases.items()))
        self._unwritten = {key_hash(key): key for key in unwritten}
        data = AliasData(aliases, pack_hashes(unwritten)) if aliases or unwritten else None
        return SavePlan(items=tuple(items), planner_data=data)

    def _tensor_items(self, entry: TensorEntry, name: str, plain: bool) -> list[WriteItem]:
        items = []
        check = self.check_replicas and self.world_size > 1 and entry.may_be_replicated and self.later_replicas is None
        exclusive = not entry.may_be_replicated and entry.layout is None  # a ShardedTensor's main replica
        for position, piece in enumerate(entry.pieces):
            index = MetadataIndex(entry.fqn, piece.offsets)
            whole = piece.sizes == entry.global_shape
            replica_digest = None
            if check:
                replica_digest = self._replica_digests.get((entry.fqn, piece.offsets))
                if replica_digest is None:
                    replica_digest = digest(memoryview(piece_array(entry, piece).reshape(-1).view(np.uint8)))
            items.append(
                WriteItem(
                    index=index,
                    type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=piece.offsets, sizes=piece.sizes),
                        properties=TensorProperties(dtype=entry.dtype),
                        size=entry.global_shape,
                        replica_digest=replica_digest,
                        exclusive=exclusive,
                    ),
                )
            )
            self._tensors[index] = (entry, piece)
            self._sources[index] = LeafSource(name=name, piece=position, plain=plain)
            if entry.layout is not None and len(entry.pieces) == 1:
                self._layouts[index] = entry.layout
            elif entry.may_be_replicated and whole and len(entry.pieces) == 1:
                self._layouts[index] = None  # held whole: every rank declaring it holds a replica
        return items

    def _bytes_item(self, entry: ValueEntry) -> WriteItem:
        type_name, payload = self.serialize(entry)
        index = MetadataIndex(entry.fqn, entry.offset)
        return WriteItem(
            index=index,
            type=WriteItemType.BYTE_IO,
            bytes_io_data=BytesWriteData(
                type_name=type_name, nbytes=len(payload), digest=digest(payload), global_shape=entry.grid_shape
            ),
        )

    def build_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Deduplicate, validate and describe. Coordinator only."""
        stripped = [replace(plan, planner_data=None) for plan in all_plans]
        plans, metadata = build_global_save_plan(
            stripped,
            remove_redundancy=self.remove_redundancy,
            save_to_minimum_rank=self.save_to_minimum_rank,
            planner_data=_merged_aliases(all_plans),
        )
        self._check_unwritten(all_plans, metadata)
        return plans, metadata

    def _check_unwritten(self, all_plans: list[Any], metadata: Metadata) -> None:
        """:func:`_refuse_unwritten`, unless each rank of a job of several saves alone (``use_collectives=False``:
        another rank's own checkpoint holds the main replica). Coordinator only."""
        if self.world_size > 1 or platform.get_world_size() == 1:
            blobs = [plan.planner_data.unwritten if isinstance(plan.planner_data, AliasData) else b""
                     for plan in all_plans]
            refuse_unwritten(blobs, metadata, names_of=self.unwritten_names)

    def unwritten_names(self, hashes: set[int]) -> dict[int, str]:
        """This rank's keys of ``hashes`` (:func:`._unwritten_keys.key_hash`): those it holds only as non-main
        replicas, else any it holds. All ranks, when the plan step refused keys no rank writes (the coordinator
        while refusing; every rank after, :func:`._unwritten_keys.name_refusal`)."""
        found = {h: key for h, key in self._unwritten.items() if h in hashes}
        for name, value in self.flat.values.items() if self.flat is not None and len(found) < len(hashes) else ():
            entry = classify_leaf(self.flat.storage_keys[name], value)
            if not isinstance(entry, SkipEntry) and key_hash(entry.fqn) in hashes:
                found.setdefault(key_hash(entry.fqn), entry.fqn)
        return found

    def compact_local_plan(self, plan: SavePlan) -> LayoutSavePlan | SavePlan:
        """``plan`` (this rank's local plan) with its layout items described by layout. All ranks.

        What a rank sends to the coordinator: see :mod:`._layout_plan`.
        """
        return compact_save_plan(plan, self._layouts, rank=self.rank, world_size=self.world_size)

    def build_global_masks(self, all_plans: list[LayoutSavePlan | SavePlan]) -> tuple[list[bytes], Metadata]:
        """:meth:`build_global_plan` for plans from :meth:`compact_local_plan`. Coordinator only.

        Returns:
            Each rank's final plan as a bitmask over its local plan's items
            (bit ``i % 8`` of byte ``i // 8``), and the metadata.
        """
        masks, metadata = merge_layout_plans(
            all_plans,
            remove_redundancy=self.remove_redundancy,
            save_to_minimum_rank=self.save_to_minimum_rank,
            planner_data=_merged_aliases(all_plans),
        )
        self._check_unwritten(all_plans, metadata)
        return masks, metadata

    def finalize_plan(self, plan: SavePlan) -> SavePlan:
        """Accept the final plan. All ranks call it."""
        return plan

    def get_data(self, item: WriteItem) -> np.ndarray | bytes:
        """Return the item's bytes or array (a view of the tensor when possible)."""
        key = item.index  # its ``index`` hint takes no part in lookups
        if item.type == WriteItemType.BYTE_IO:
            return self._bytes[key]
        source = self._sources.get(key)
        if source is not None and source.plain and source.name in self.leaf_arrays:
            return self.leaf_arrays[source.name]  # the layout pass resolved it already
        found = self._tensors.get(key)
        if found is None:  # a reused plan: no entries were built (bind_sources)
            source = self._bound_of[key]
            if not source.plain:
                return self._leaf_piece(source)
            array = self.leaf_arrays.get(source.name)
            return array if array is not None else leaf_array(self.flat.values[source.name])
        return piece_array(*found)

