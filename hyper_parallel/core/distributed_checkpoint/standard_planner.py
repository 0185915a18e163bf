"""The default planners: what to write from a state dict, where to load into.

:class:`StandardSavePlanner` offers one write item per tensor piece (a whole
tensor, a DTensor shard, a ShardedTensor box) and one bytes item per value;
tensors stay in its cache, never in plans. The coordinator's merge is
:func:`._global_plan.build_global_save_plan`.

:class:`StandardLoadPlanner` reads, for every piece of every target tensor,
the overlap with each stored chunk, straight into the target's memory when the
framework shares it (CPU), otherwise into a staging copy assigned back at the
end. Non-tensor values are replaced in the caller's (nested) dict.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Iterator

import numpy as np

from hyper_parallel.core.distributed_checkpoint._device_targets import DeviceRegions
from hyper_parallel.core.distributed_checkpoint._format.checksum import digest
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointValueError,
    MissingKeyError,
    ShapeMismatchError,
    UnsafeCheckpointError,
    UnsupportedTypeError,
)
from hyper_parallel.core.distributed_checkpoint._chunk_search import overlapping_chunks
from hyper_parallel.core.distributed_checkpoint._flatten import FlatStateDict, flatten_state_dict, set_by_path
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
from hyper_parallel.core.distributed_checkpoint._layout_plan import LayoutSavePlan, compact_save_plan
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import (
    BytesWriteData,
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from hyper_parallel.core.distributed_checkpoint._replicated_read import (
    ReadExchange,
    plan_single_replica_reads,
    region_key,
)
from hyper_parallel.core.distributed_checkpoint._state_items import (
    SkipEntry,
    TensorEntry,
    TensorPiece,
    ValueEntry,
    make_entry,
    piece_view,
)
from hyper_parallel.core.distributed_checkpoint.type_handlers import deserialize_value, serialize_value
from hyper_parallel.platform.tensor import (
    DTYPE_NAMES,
    assign,
    dtype_name,
    numpy_dtype,
    to_numpy,
    writable_view,
    writable_views,
)

__all__ = ["AliasData", "StandardSavePlanner", "StandardLoadPlanner"]


@dataclass(frozen=True)
class AliasData:
    """A local save plan's planner data: Parameters this rank reached under several paths.

    The coordinator merges every rank's aliases into the metadata's
    ``planner_data["aliases"]`` (docs/format.md 6.3); loads read them back to
    find a Parameter stored once under its first path.

    Attributes:
        aliases: ``(dotted name, stored key)`` pairs, sorted.
    """

    aliases: tuple[tuple[str, str], ...]

_LOG = logging.getLogger(__name__)


def _shown(keys: list[str], limit: int = 20) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(f"'{k}'" for k in keys[:limit]) + more


def _classify(fqn: str, value: Any) -> TensorEntry | ValueEntry | SkipEntry:
    """:func:`make_entry`, with a tensor of a dtype no checkpoint stores reported against its key."""
    try:
        return make_entry(fqn, value)
    except TypeError as exc:
        if isinstance(exc, UnsupportedTypeError):
            raise
        raise UnsupportedTypeError(
            f"checkpoint item {fqn!r}: {exc}; convert it to bool, an integer or float dtype, or bfloat16"
        ) from exc


def _fitted(array: np.ndarray, entry: TensorEntry) -> np.ndarray:
    """A target's array in its local shape (a flat-range target keeps its flat array)."""
    if entry.pieces[0].flat_start is None and tuple(array.shape) != entry.local_shape:
        return array.reshape(entry.local_shape)
    return array


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
        """Flatten this rank's state dict. All ranks call it first."""
        self.flat = flatten_state_dict(state_dict)
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
        """Whether the layout pass keeps the possibly replicated pieces instead of hashing them. All ranks, before planning.

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
        return _classify(fqn, value)

    @staticmethod
    def classify_dtype(fqn: str, value: Any) -> str:
        """The stored dtype name of a whole tensor stored under ``fqn``.

        Raises:
            UnsupportedTypeError: A dtype no checkpoint stores (names the key).
        """
        try:
            return dtype_name(value)
        except TypeError as exc:
            raise UnsupportedTypeError(
                f"checkpoint item {fqn!r}: {exc}; convert it to bool, an integer or float dtype, or bfloat16"
            ) from exc

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
        self, items: tuple[WriteItem, ...], sources: tuple[LeafSource | None, ...], by_index: dict[MetadataIndex, LeafSource]
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
        entry = _classify(self.flat.storage_keys[source.name], self.flat.values[source.name])
        return piece_array(entry, entry.pieces[source.piece])

    def build_local_plan(self) -> SavePlan:
        """Return one item per tensor piece and per value. All ranks call it.

        Raises:
            UnsupportedTypeError: a value of a type with no handler (names the key).
        """
        if self.flat is None:
            raise CheckpointValueError("configure_planner must be called before build_local_plan")
        items: list[WriteItem] = []
        for name, value in self.flat.values.items():
            entry = _classify(self.flat.storage_keys[name], value)
            if isinstance(entry, SkipEntry) or not entry.write:
                continue
            if isinstance(entry, TensorEntry):
                items.extend(self._tensor_items(entry, name, plain_tensor(value)))
            else:
                items.append(self._bytes_item(entry))
        aliases = tuple(sorted(self.flat.aliases.items()))
        return SavePlan(items=tuple(items), planner_data=AliasData(aliases) if aliases else None)

    def _tensor_items(self, entry: TensorEntry, name: str, plain: bool) -> list[WriteItem]:
        items = []
        check = self.check_replicas and self.world_size > 1 and entry.may_be_replicated and self.later_replicas is None
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
        return build_global_save_plan(
            stripped,
            remove_redundancy=self.remove_redundancy,
            save_to_minimum_rank=self.save_to_minimum_rank,
            planner_data=_merged_aliases(all_plans),
        )

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
        return merge_layout_plans(
            all_plans,
            remove_redundancy=self.remove_redundancy,
            save_to_minimum_rank=self.save_to_minimum_rank,
            planner_data=_merged_aliases(all_plans),
        )

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


class StandardLoadPlanner(LoadPlanner):
    """Plans a load into a (nested) state dict, in place.

    Args:
        allow_partial_load: Skip target keys missing from the checkpoint
            instead of raising :class:`MissingKeyError`.
        allow_pickle: Unpickle stored pickled values (trusted checkpoints only).
        single_replica_read: A region several ranks need is read from storage
            by one of them and sent to the others over the collective.
        exchange_round_bytes: Most bytes a rank sends per exchange round
            (bounds the extra memory of ``single_replica_read``).
        device_region_bytes: For a target tensor in device memory (not
            shared with host memory, e.g. on Ascend): reads are cut into regions
            of at most this many bytes, each read into a host buffer and
            copied into its region of the tensor, so the host memory a load
            needs stays bounded whatever the tensor size.
    """

    def __init__(
        self,
        *,
        allow_partial_load: bool = False,
        allow_pickle: bool = False,
        single_replica_read: bool = False,
        exchange_round_bytes: int = 256 << 20,
        device_region_bytes: int = 16 << 20,
    ) -> None:
        if device_region_bytes < 1:
            raise CheckpointValueError(f"device_region_bytes must be >= 1, got {device_region_bytes}")
        self.allow_partial_load = allow_partial_load
        self.device_region_bytes = device_region_bytes
        self._device = DeviceRegions()
        self.allow_pickle = allow_pickle
        self.shares_reads = single_replica_read
        self.exchange_round_bytes = exchange_round_bytes
        self._exchange: ReadExchange | None = None
        self._outbox: dict[int, tuple[int, Any]] = {}
        self.state_dict: dict[str, Any] | None = None
        self.flat: FlatStateDict | None = None
        self.metadata: Metadata | None = None
        self.rank = 0
        self.missing_keys: list[str] = []
        # Everything below is keyed by the leaf's dotted name in the state dict
        # (several ShardedTensors/ShardedObjects may share one checkpoint key).
        self._entries: dict[str, TensorEntry | ValueEntry | SkipEntry] = {}
        self._targets: dict[str, np.ndarray] = {}
        self._staged: set[str] = set()
        self._pieces: dict[tuple[str, tuple[int, ...]], tuple[str, TensorEntry, TensorPiece]] = {}
        self._value_names: dict[tuple[str, tuple[int, ...]], str] = {}
        self._values: dict[str, Any] = {}

    def configure_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata,
        *,
        rank: int = 0,
        world_size: int = 1,
        is_coordinator: bool = True,
    ) -> None:
        """Flatten the target and check it against the metadata. All ranks call it.

        Raises:
            MissingKeyError: keys missing from the checkpoint (all listed).
            ShapeMismatchError: a global shape differs (names key and shapes).
        """
        self.state_dict = state_dict
        self.flat = flatten_state_dict(state_dict)
        self.metadata = metadata
        self.rank = rank
        self.missing_keys = []
        self._entries.clear()
        self._targets.clear()
        self._staged.clear()
        self._device = DeviceRegions()
        self._pieces.clear()
        self._value_names.clear()
        self._values.clear()
        problems = []
        stored_aliases = metadata.planner_data.get("aliases", {}) if isinstance(metadata.planner_data, dict) else {}
        for name, value in self.flat.values.items():
            fqn = self.flat.storage_keys[name]
            if fqn not in metadata.state_dict_metadata and stored_aliases.get(fqn) in metadata.state_dict_metadata:
                fqn = stored_aliases[fqn]  # a Parameter saved once under another path (e.g. the model's)
            entry = _classify(fqn, value)
            if isinstance(entry, SkipEntry):
                self._entries[name] = entry
                continue
            stored = metadata.state_dict_metadata.get(fqn)
            if stored is None:
                self.missing_keys.append(fqn)
                continue
            if isinstance(entry, TensorEntry):
                if not isinstance(stored, TensorStorageMetadata):
                    problems.append(f"key '{fqn}': the target is a tensor but the checkpoint stores a value")
                    continue
                if isinstance(entry.local, np.ndarray) and not entry.local.flags.writeable:
                    problems.append(f"key '{fqn}': the target numpy array is read-only; pass a writable array")
                    continue
                if tuple(stored.size) != entry.global_shape and not entry.allow_shape_mismatch:
                    raise ShapeMismatchError(
                        f"key '{fqn}': checkpoint global shape {list(stored.size)} differs from the target's "
                        f"global shape {list(entry.global_shape)}"
                    )
            self._entries[name] = entry
        if problems:
            raise CheckpointValueError("; ".join(problems))
        if self.missing_keys:
            self._report_missing(metadata, rank)

    def _report_missing(self, metadata: Metadata, rank: int) -> None:
        """Say what matched and what did not; refuse a load that would load nothing, even partial."""
        matched = sorted(e.fqn for e in self._entries.values() if not isinstance(e, SkipEntry))
        stored = sorted(metadata.state_dict_metadata)
        summary = (
            f"rank {rank}: {len(self.missing_keys)} of {len(self.missing_keys) + len(matched)} requested key(s) are "
            f"not in the checkpoint: {_shown(self.missing_keys)}; matched: {_shown(matched) or 'none'}; "
            f"the checkpoint holds {len(stored)} key(s), e.g. {_shown(stored, 5) or 'none'}"
        )
        if not matched:
            raise MissingKeyError(
                f"{summary}. Nothing would load, even with allow_partial_load=True: this checkpoint is of "
                "another model, or its keys carry another prefix (save and load the same structure, e.g. both "
                "{'model': net}, or use hyper_parallel.load_checkpoint(path, net), which matches MindSpore names)"
            )
        if not self.allow_partial_load:
            raise MissingKeyError(
                f"{summary}. Pass StandardLoadPlanner(allow_partial_load=True) to load only the matched keys"
            )
        _LOG.warning("%s; loading only the matched keys (allow_partial_load=True)", summary)

    def build_local_plan(self) -> LoadPlan:
        """Return the overlap of every target piece with every stored chunk. All ranks."""
        items: list[ReadItem] = []
        # One pass over the targets: the memory of each tensor numpy can write in place (none: a device tensor).
        tensors = [(name, entry) for name, entry in self._entries.items() if isinstance(entry, TensorEntry)]
        views = dict(zip((name for name, _ in tensors), writable_views([entry.local for _, entry in tensors])))
        for name, entry in list(self._entries.items()):
            fqn = entry.fqn
            stored = self.metadata.state_dict_metadata[fqn] if not isinstance(entry, SkipEntry) else None
            if isinstance(entry, TensorEntry) and isinstance(stored, TensorStorageMetadata):
                reads = self._tensor_reads(name, entry, stored)
                view = views[name]
                if view is None:  # device memory (or a copy): regions may go through host buffers
                    items.extend(self._device.plan(name, entry, reads, self.device_region_bytes))
                    continue
                self._targets[name] = _fitted(view, entry)
                items.extend(reads)
            elif isinstance(entry, ValueEntry) and isinstance(stored, BytesStorageMetadata):
                if entry.offset not in stored.shard_offsets:
                    raise MissingKeyError(
                        f"key '{fqn}': grid position {list(entry.offset)} is not in the checkpoint "
                        f"(stored: {[list(o) for o in stored.shard_offsets]})"
                    )
                index = MetadataIndex(fqn, entry.offset)
                self._value_names[(fqn, entry.offset)] = name
                items.append(ReadItem(LoadItemType.BYTE_IO, index, (), index, (), ()))
            elif isinstance(entry, ValueEntry) and isinstance(stored, TensorStorageMetadata):
                items.extend(self._new_tensor_reads(name, fqn, stored))
        return LoadPlan(items=tuple(items))

    def _tensor_reads(self, name: str, entry: TensorEntry, stored: TensorStorageMetadata) -> list[ReadItem]:
        reads = []
        for position, piece in enumerate(entry.pieces):
            dest = MetadataIndex(entry.fqn, piece.offsets, index=position)
            if (entry.fqn, piece.offsets) in self._pieces:
                other = self._pieces[(entry.fqn, piece.offsets)][0]
                raise CheckpointValueError(
                    f"state_dict entries '{other}' and '{name}' both ask for key '{entry.fqn}' at offset "
                    f"{list(piece.offsets)}; load it once"
                )
            self._pieces[(entry.fqn, piece.offsets)] = (name, entry, piece)
            chunks = stored.chunks
            if len(chunks) == 1 and chunks[0].offsets == piece.offsets and chunks[0].sizes == piece.sizes:
                if math.prod(piece.sizes):  # the common case, a piece stored as one chunk: read it whole
                    zero = (0,) * len(piece.sizes)
                    # Positional: type, dest_index, dest_offsets, storage_index, storage_offsets, lengths.
                    reads.append(ReadItem(LoadItemType.TENSOR, dest, zero, MetadataIndex(entry.fqn, chunks[0].offsets),
                                          zero, tuple(piece.sizes)))
                continue
            for chunk in overlapping_chunks(chunks, piece.offsets, piece.sizes):
                lo = tuple(max(a, b) for a, b in zip(piece.offsets, chunk.offsets))
                hi = tuple(
                    min(a + s, b + t) for a, s, b, t in zip(piece.offsets, piece.sizes, chunk.offsets, chunk.sizes)
                )
                if math.prod(piece.sizes) == 0 or any(h <= l for l, h in zip(lo, hi)):
                    continue
                reads.append(
                    ReadItem(
                        type=LoadItemType.TENSOR,
                        dest_index=dest,
                        dest_offsets=tuple(l - p for l, p in zip(lo, piece.offsets)),
                        storage_index=MetadataIndex(entry.fqn, chunk.offsets),
                        storage_offsets=tuple(l - c for l, c in zip(lo, chunk.offsets)),
                        lengths=tuple(h - l for l, h in zip(lo, hi)),
                    )
                )
        return reads

    def _new_tensor_reads(self, name: str, fqn: str, stored: TensorStorageMetadata) -> list[ReadItem]:
        """A non-tensor placeholder (e.g. ``None``) receives the whole stored tensor as numpy."""
        try:
            array = np.zeros(stored.size, dtype=numpy_dtype(stored.properties.dtype))
        except MemoryError as exc:  # sizes come from the checkpoint: refuse, do not crash
            raise UnsafeCheckpointError(
                f"key '{fqn}': the checkpoint declares a {stored.properties.dtype} tensor of shape "
                f"{list(stored.size)}, too large to allocate; pass a target tensor or check the checkpoint"
            ) from exc
        entry = make_entry(fqn, array)
        self._entries[name] = entry
        self._values[name] = array
        return self._tensor_reads(name, entry, stored)

    def build_global_plan(self, all_plans: list[LoadPlan]) -> list[LoadPlan]:
        """Keep every rank's plan, or share replicated reads. Coordinator only."""
        if not self.shares_reads:
            return all_plans
        return plan_single_replica_reads(all_plans, round_bytes=self.exchange_round_bytes, item_bytes=self._item_bytes)

    def _item_bytes(self, item: ReadItem) -> int:
        stored = self.metadata.state_dict_metadata[item.storage_index.fqn]
        if isinstance(stored, TensorStorageMetadata):
            return math.prod(item.lengths) * DTYPE_NAMES[stored.properties.dtype]
        info = (self.metadata.storage_data or {}).get(MetadataIndex(item.storage_index.fqn, item.storage_index.offset))
        return info.length if info is not None else 0

    def finalize_plan(self, plan: LoadPlan) -> LoadPlan:
        """Accept the final plan. All ranks call it."""
        self._exchange = plan.planner_data if isinstance(plan.planner_data, ReadExchange) else None
        self._outbox = {}
        return plan

    def read_rounds(self, plan: LoadPlan) -> list[LoadPlan]:
        """One plan per exchange round (items read in that round). All ranks."""
        if self._exchange is None:
            return [plan]
        rounds: list[list[ReadItem]] = [[] for _ in range(self._exchange.rounds)]
        for item, round_index in zip(plan.items, self._exchange.item_rounds):
            rounds[round_index].append(item)
        return [LoadPlan(items=tuple(items)) for items in rounds]

    def outgoing(self, round_index: int) -> dict[int, Any]:
        """The regions read for others in this round (stored dtype), by slot. All ranks."""
        out = {slot: value for slot, (rnd, value) in self._outbox.items() if rnd == round_index}
        for slot in out:
            del self._outbox[slot]
        return out

    def incoming(self, round_index: int, payloads: dict[int, Any]) -> None:
        """Apply the regions other ranks read for this one. All ranks."""
        if self._exchange is None:
            return
        for slot, rnd, item in self._exchange.receive:
            if rnd != round_index:
                continue
            value = payloads[slot]
            if item.type == LoadItemType.BYTE_IO:
                self.apply_bytes(item, value)
            else:
                self._fill(item, value)

    def _target(self, name: str, entry: TensorEntry) -> np.ndarray:
        array = self._targets.get(name)  # most were found by build_local_plan's pass
        if array is None:
            array = writable_view(entry.local)
            if array is None:
                array = np.array(to_numpy(entry.local), copy=True)
                self._staged.add(name)
            array = self._targets[name] = _fitted(array, entry)
        return array

    def acquire_tensor(self, read_item: ReadItem, shared: bool = True) -> np.ndarray:
        """Return the writable target region of ``read_item``. Called by the reader.

        A region this rank reads for others gets a buffer of the stored dtype
        instead (copied into the target by :meth:`apply_tensor`).
        """
        if shared and self._exchange is not None and region_key(read_item) in self._exchange.send:
            stored = self.metadata.state_dict_metadata[read_item.storage_index.fqn]
            return np.empty(read_item.lengths, dtype=numpy_dtype(stored.properties.dtype))
        name, entry, piece = self._pieces[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        if name in self._device:
            return self._device.buffer(read_item, entry)
        region = piece_view(self._target(name, entry), entry, piece)
        if tuple(read_item.lengths) == region.shape and not any(read_item.dest_offsets):  # the whole piece
            return region
        return region[tuple(slice(o, o + n) for o, n in zip(read_item.dest_offsets, read_item.lengths))]

    def apply_tensor(self, read_item: ReadItem, tensor: np.ndarray) -> None:
        """Keep a region read for others, copy a device target's region in; else it was filled in place.

        Called by the reader after the region is read (and verified).
        """
        if self._exchange is None and not self._device:  # a region read in place: nothing left to do
            return
        key = region_key(read_item) if self._exchange is not None else None
        if key is not None and key in self._exchange.send:
            self._fill(read_item, tensor)
            slot, round_index = self._exchange.send[key]
            self._outbox[slot] = (round_index, tensor)
        elif self._device.holds(read_item):
            self._device.write(read_item, self._pieces[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))][1])

    def _fill(self, read_item: ReadItem, value: np.ndarray) -> None:
        """Copy ``value`` into the target region of ``read_item`` (a device target: copied in)."""
        name, entry, _ = self._pieces[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        if name in self._device:
            self._device.write(read_item, entry, value)
        else:
            np.copyto(self.acquire_tensor(read_item, shared=False), value, casting="unsafe")

    def apply_bytes(self, read_item: ReadItem, value: bytes) -> None:
        """Decode a stored value with its type handler. Called by the reader."""
        fqn = read_item.dest_index.fqn
        stored = self.metadata.state_dict_metadata[fqn]
        if self._exchange is not None and region_key(read_item) in self._exchange.send:
            slot, round_index = self._exchange.send[region_key(read_item)]
            self._outbox[slot] = (round_index, value)
        name = self._value_names[(fqn, tuple(read_item.dest_index.offset))]
        self._values[name] = deserialize_value(
            stored.type_name, value, key=fqn, allow_pickle=self.allow_pickle
        )

    def finish_load(self) -> None:
        """Assign staged tensors and put new values into the caller's dict. All ranks."""
        for name in self._staged:
            entry = self._entries[name]
            assign(entry.local, self._targets[name].reshape(np.shape(to_numpy(entry.local))))
        for name, entry in self._entries.items():
            if isinstance(entry, SkipEntry):
                set_by_path(self.state_dict, self.flat.paths[name], entry.value)
            elif name in self._values:
                set_by_path(self.state_dict, self.flat.paths[name], self._values[name])
