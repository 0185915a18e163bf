"""The default load planner: where to load into.

:class:`StandardLoadPlanner` reads, for every piece of every target tensor,
the overlap with each stored chunk, straight into the target's memory when the
framework shares it (CPU), otherwise into a staging copy assigned back at the
end. Non-tensor values are replaced in the caller's (nested) dict.
Re-exported by :mod:`.standard_planner`. Matching the target's leaves to the
checkpoint's records is :mod:`._load_target_match`; the reads of one piece,
:mod:`._piece_reads`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint._device_targets import DeviceRegions
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointValueError,
    MissingKeyError,
    UnsafeCheckpointError,
)
from hyper_parallel.core.distributed_checkpoint._flatten import FlatStateDict, flatten_state_dict, set_by_path
from hyper_parallel.core.distributed_checkpoint._load_target_checks import view_target
from hyper_parallel.core.distributed_checkpoint._load_target_match import match_targets
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint._piece_reads import fitted, local_shape, overlap_reads, whole_dtype
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
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
from hyper_parallel.core.distributed_checkpoint.type_handlers import deserialize_value
from hyper_parallel.core.distributed_checkpoint._whole_reads import (
    SMALL_WHOLE_BYTES,
    WholeReadPlan,
    WholeReads,
    whole_read_item,
)
from hyper_parallel.platform.tensor import assign, to_numpy, writable_view, writable_views
from hyper_parallel.platform.dtypes import DTYPE_NAMES, numpy_dtype

__all__ = ["StandardLoadPlanner"]

_NO_READS = LoadPlan(items=())


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
        self._direct: dict[int, tuple[ReadItem, np.ndarray]] = {}  # see direct_targets(); by id() of the item
        #: The small whole reads of the last plan built, kept as columns (``None``: none are, see _whole_reads).
        self.whole_reads: WholeReads | None = None
        self._staged: set[str] = set()
        self._skipped: list[str] = []  # names of the SkipEntry leaves
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
        self._direct.clear()
        self._skipped.clear()
        self._staged.clear()
        self._device = DeviceRegions()
        self._pieces.clear()
        self._value_names.clear()
        self._values.clear()
        match_targets(self.flat, metadata, entries=self._entries, skipped=self._skipped,
                      missing_keys=self.missing_keys, rank=rank, allow_pickle=self.allow_pickle,
                      allow_partial_load=self.allow_partial_load)

    def build_local_plan(self) -> LoadPlan:
        """Return the overlap of every target piece with every stored chunk. All ranks.

        The small whole reads into host targets are kept as columns (a :class:`._whole_reads.WholeReadPlan`,
        also in :attr:`whole_reads`), whose ``items`` are made when first asked for; a subclass, or a
        planner sharing reads, gets a plain :class:`LoadPlan`.
        """
        items: list[ReadItem] = []
        entries = list(self._entries.items())  # _new_tensor_reads replaces entries while this runs
        # One pass over the targets: the memory of each tensor numpy can write in place (none: a device tensor),
        # in the order of the entries.
        tensors = [entry for _, entry in entries if isinstance(entry, TensorEntry)]
        views = iter(writable_views([entry.local for entry in tensors], [local_shape(entry) for entry in tensors]))
        stored_of = self.metadata.state_dict_metadata
        pieces_of, targets, direct = self._pieces, self._targets, self._direct
        # The small whole reads, as columns (no ReadItem each; see _whole_reads), when nothing of this planner
        # needs to see them one by one (a subclass may override a hook; shared reads exchange items).
        # pylint: disable-next=unidiomatic-typecheck
        whole = WholeReads(self, direct) if type(self) is StandardLoadPlanner and not self.shares_reads else None
        positions: list[int] = []  # the position among all reads of each of items (when whole reads are columns)
        append_whole = whole.rows.append if whole is not None else None
        # id(stored record) -> (the record, a target's pieces, the stored numpy dtype if those pieces read the record
        # whole, else None): records and pieces are shared by the keys of one dtype and shape, so the checks of a
        # whole read are made once for each (see _whole_dtype).
        wholes: dict[int, tuple[Any, Any, np.dtype | None]] = {}
        views_refused: list[str] = []  # MindSpore Tensors viewing another tensor's memory (see view_target)
        for name, entry in entries:
            fqn = entry.fqn
            tensor = isinstance(entry, TensorEntry)
            view = next(views) if tensor else None
            stored = stored_of[fqn] if tensor or not isinstance(entry, SkipEntry) else None
            if tensor and isinstance(stored, TensorStorageMetadata):
                pieces = entry.pieces
                known = wholes.get(id(stored)) if view is not None else None
                if view is not None and (known is None or known[0] is not stored or known[1] is not pieces):
                    known = wholes[id(stored)] = (stored, pieces, whole_dtype(pieces, stored))
                if known is not None and known[2] is not None:
                    # The common case: a whole host target stored as one chunk of its shape, one read.
                    piece = pieces[0]
                    offsets, sizes = piece.offsets, piece.sizes
                    key = (fqn, offsets)
                    if key not in pieces_of:
                        pieces_of[key] = (name, entry, piece)
                        same = view.dtype == known[2] and view.flags.c_contiguous
                        if whole is not None and same and view.nbytes <= SMALL_WHOLE_BYTES:
                            # (its target array is found by _target() if an item of it is ever acquired)
                            append_whole((fqn, offsets, sizes, view if view.shape == sizes else view.reshape(sizes)))
                            continue
                        shape = entry.local_shape
                        targets[name] = view if view.shape == shape else view.reshape(shape)
                        if whole is not None:
                            positions.append(len(items) + len(whole))
                        item = whole_read_item(fqn, offsets, sizes)
                        items.append(item)
                        if same:
                            direct[id(item)] = (item, view)
                        continue
                reads = self._tensor_reads(name, entry, stored)
                if view is None:  # device memory (or a copy): regions may go through host buffers
                    refused = view_target(fqn, entry.local)
                    if refused is not None:
                        views_refused.append(refused)
                    reads = self._device.plan(name, entry, reads, self.device_region_bytes)
                else:
                    targets[name] = fitted(view, entry)
                if whole is not None:
                    positions.extend(range(len(items) + len(whole), len(items) + len(whole) + len(reads)))
                items.extend(reads)
            elif isinstance(entry, ValueEntry) and isinstance(stored, BytesStorageMetadata):
                if entry.offset not in stored.shard_offsets:
                    raise MissingKeyError(
                        f"key '{fqn}': grid position {list(entry.offset)} is not in the checkpoint "
                        f"(stored: {[list(o) for o in stored.shard_offsets]})"
                    )
                index = MetadataIndex(fqn, entry.offset)
                self._value_names[(fqn, entry.offset)] = name
                if whole is not None:
                    positions.append(len(items) + len(whole))
                items.append(ReadItem(LoadItemType.BYTE_IO, index, (), index, (), ()))
            elif isinstance(entry, ValueEntry) and isinstance(stored, TensorStorageMetadata):
                reads = self._new_tensor_reads(name, fqn, stored)
                if whole is not None:
                    positions.extend(range(len(items) + len(whole), len(items) + len(whole) + len(reads)))
                items.extend(reads)
        if views_refused:
            raise CheckpointValueError(f"rank {self.rank}: " + "; ".join(views_refused) + "; no target was changed")
        self.whole_reads = whole
        if whole:
            return WholeReadPlan(rest=tuple(items), rest_positions=tuple(positions), whole=whole)
        return LoadPlan(items=tuple(items))

    def _tensor_reads(self, name: str, entry: TensorEntry, stored: TensorStorageMetadata) -> list[ReadItem]:
        reads = []
        for position, piece in enumerate(entry.pieces):
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
                    reads.append(whole_read_item(entry.fqn, tuple(piece.offsets), tuple(piece.sizes), position))
                continue
            reads.extend(overlap_reads(entry.fqn, piece, position, chunks))
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

    def value_reads(self, plan: LoadPlan) -> LoadPlan:
        """The value items of ``plan``, read and decoded before any tensor (see :meth:`LoadPlanner.value_reads`).
        All ranks."""
        if not self._value_names:
            return _NO_READS
        if type(plan) is WholeReadPlan:  # pylint: disable=unidiomatic-typecheck
            # (values are never whole reads: among the other items; the columns are left as they are)
            return LoadPlan(items=tuple(item for item in plan.rest if item.type is LoadItemType.BYTE_IO))
        return super().value_reads(plan)

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
            array = self._targets[name] = fitted(array, entry)
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
            dest = read_item.dest_index
            self._device.write(read_item, self._pieces[(dest.fqn, tuple(dest.offset))][1])

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

    def direct_targets(self) -> dict[int, tuple[ReadItem, np.ndarray]]:
        """The whole host targets this planner found writable, C-contiguous and of the stored dtype, by ``id`` of
        their item (see :meth:`LoadPlanner.direct_targets`). None when the load shares reads between ranks or a
        subclass overrides ``acquire_tensor`` or ``apply_tensor``: the reader then asks for every item. Called
        by the reader after ``finalize_plan``; all ranks.
        """
        kind = type(self)
        if self._exchange is not None or kind.acquire_tensor is not StandardLoadPlanner.acquire_tensor or (
                kind.apply_tensor is not StandardLoadPlanner.apply_tensor):
            return {}
        return self._direct

    def finish_load(self) -> None:
        """Assign staged tensors and put new values into the caller's dict. All ranks."""
        for name in self._staged:
            entry = self._entries[name]
            assign(entry.local, self._targets[name].reshape(np.shape(to_numpy(entry.local))))
        for name in self._skipped:
            set_by_path(self.state_dict, self.flat.paths[name], self._entries[name].value)
        for name, value in self._values.items():  # values decoded, tensors a placeholder received
            set_by_path(self.state_dict, self.flat.paths[name], value)
