"""Plan types and the abstract save and load planners.

A save runs in this order (``dcp.save``):

1. all ranks: ``configure_planner`` then ``build_local_plan``;
2. coordinator: ``build_global_plan`` over every rank's plan (deduplication,
   validation, metadata);
3. all ranks: ``finalize_plan`` on their own final plan, then the storage
   writer calls ``get_data`` for every item it writes.

A load runs the same steps with :class:`LoadPlanner`, and the storage reader
calls ``acquire_tensor`` / ``apply_tensor`` / ``apply_bytes`` for every item.
Tensors stay in the planner (keyed by index), never inside plans, so plans
stay small to gather.
"""

from __future__ import annotations

import abc
import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from hyper_parallel.platform.dtypes import DTYPE_NAMES

__all__ = [
    "WriteItemType",
    "LoadItemType",
    "TensorWriteData",
    "BytesWriteData",
    "WriteItem",
    "ReadItem",
    "SavePlan",
    "LoadPlan",
    "SavePlanner",
    "LoadPlanner",
]


class WriteItemType(enum.Enum):
    """Kind of a :class:`WriteItem`."""

    TENSOR = "tensor"
    SHARD = "shard"
    BYTE_IO = "byte_io"


class LoadItemType(enum.Enum):
    """Kind of a :class:`ReadItem`."""

    TENSOR = "tensor"
    BYTE_IO = "byte_io"


@dataclass(frozen=True)
class TensorWriteData:
    """What is written for a tensor item.

    Attributes:
        chunk: The box of the global tensor this item holds.
        properties: dtype of the stored bytes.
        size: Global shape of the tensor.
        replica_digest: xxh3 digest of the data, set when the chunk may be a
            replica of another rank's and replicas are checked (the
            coordinator compares the digests of every replica).
        exclusive: The box is a ``ShardedTensor``'s main replica (``replica_id``
            0): no other rank may offer it, since only one copy is written (the
            coordinator refuses a box two ranks offer so, naming key, box and ranks).
    """

    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: tuple[int, ...]
    replica_digest: str | None = None
    exclusive: bool = False


@dataclass(frozen=True)
class BytesWriteData:
    """What is written for a non-tensor item.

    Attributes:
        type_name: Type handler string of the value.
        nbytes: Length of the serialized value.
        digest: Hash of the serialized value, to check replicas agree.
        global_shape: Grid shape of a ``ShardedObject`` (empty otherwise).
    """

    type_name: str
    nbytes: int
    digest: str
    global_shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class WriteItem:
    """One item a rank offers to write.

    Attributes:
        index: Names the item (fqn and global offset).
        type: Tensor, shard of a tensor, or bytes.
        tensor_data: Set for tensor and shard items.
        bytes_io_data: Set for bytes items.
    """

    index: MetadataIndex
    type: WriteItemType
    tensor_data: TensorWriteData | None = None
    bytes_io_data: BytesWriteData | None = None

    def tensor_storage_size(self) -> int | None:
        """Return the stored byte size of a tensor item, ``None`` for bytes."""
        if self.tensor_data is None:
            return None
        itemsize = DTYPE_NAMES[self.tensor_data.properties.dtype]
        return math.prod(self.tensor_data.chunk.sizes) * itemsize

    def storage_size(self) -> int:
        """Return the byte size of the item whatever its type."""
        size = self.tensor_storage_size()
        if size is not None:
            return size
        return self.bytes_io_data.nbytes if self.bytes_io_data is not None else 0


@dataclass(frozen=True)
class ReadItem:
    """One region to copy from storage into the target.

    Attributes:
        type: Tensor or bytes.
        dest_index: The target item (fqn and global offset of the target shard).
        dest_offsets: Offset of the region inside the target shard.
        storage_index: The stored chunk (fqn and its global offset).
        storage_offsets: Offset of the region inside the stored chunk.
        lengths: Extent of the region in each dim.
    """

    type: LoadItemType
    dest_index: MetadataIndex
    dest_offsets: tuple[int, ...]
    storage_index: MetadataIndex
    storage_offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class SavePlan:
    """The items one rank writes.

    Attributes:
        items: Write items in writing order.
        storage_data: Set by the storage writer (file naming).
        planner_data: Set by the planner.
    """

    items: tuple[WriteItem, ...]
    storage_data: Any = None
    planner_data: Any = None


@dataclass(frozen=True)
class LoadPlan:
    """The regions one rank reads.

    Attributes:
        items: Read items.
        storage_data: Set by the storage reader.
        planner_data: Set by the planner.
    """

    items: tuple[ReadItem, ...]
    storage_data: Any = None
    planner_data: Any = None


class SavePlanner(abc.ABC):
    """Decides what each rank writes. Subclass to customise saving."""

    @abc.abstractmethod
    def configure_planner(
        self,
        state_dict: dict[str, Any],
        *,
        rank: int,
        world_size: int,
        is_coordinator: bool,
        remove_redundancy: bool = True,
        save_to_minimum_rank: bool = False,
    ) -> None:
        """Take this rank's state dict and the save options. All ranks call it first.

        Args:
            state_dict: The (nested) state dict to save.
            rank: This rank.
            world_size: Number of ranks saving.
            is_coordinator: Whether this rank merges plans and commits.
            remove_redundancy: Write each replicated item once.
            save_to_minimum_rank: Give replicated items to their lowest rank.
        """

    @abc.abstractmethod
    def build_local_plan(self) -> SavePlan:
        """Return every item this rank holds. All ranks call it."""

    @abc.abstractmethod
    def build_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Merge, deduplicate and validate every rank's plan. Coordinator only.

        Returns:
            The final plan of each rank (in rank order) and the checkpoint
            metadata without storage data.
        """

    @abc.abstractmethod
    def finalize_plan(self, plan: SavePlan) -> SavePlan:
        """Accept this rank's final plan. All ranks call it before writing."""

    @abc.abstractmethod
    def get_data(self, item: WriteItem) -> np.ndarray | bytes:
        """Return a C-contiguous array (tensor items) or bytes. Called by the writer."""


class LoadPlanner(abc.ABC):
    """Decides what each rank reads and where it goes. Subclass to customise loading."""

    @abc.abstractmethod
    def configure_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata,
        *,
        rank: int,
        world_size: int,
        is_coordinator: bool,
    ) -> None:
        """Take the flattened target state dict and the checkpoint metadata. All ranks."""

    @abc.abstractmethod
    def build_local_plan(self) -> LoadPlan:
        """Return the regions this rank needs. All ranks call it."""

    @abc.abstractmethod
    def build_global_plan(self, all_plans: list[LoadPlan]) -> list[LoadPlan]:
        """Adjust every rank's plan (e.g. read once, share). Coordinator only."""

    @abc.abstractmethod
    def finalize_plan(self, plan: LoadPlan) -> LoadPlan:
        """Accept this rank's final plan. All ranks call it before reading."""

    @abc.abstractmethod
    def acquire_tensor(self, read_item: ReadItem) -> np.ndarray:
        """Return a writable array of shape ``read_item.lengths`` to read into.

        Called by the storage reader. It may alias the target's own memory.
        The filesystem reader calls it, and :meth:`apply_tensor`, from several
        threads at once (its I/O threads read the large items while the
        calling thread reads the small ones, with ``thread_count=1`` too): a
        planner that keeps state across items guards it.
        """

    @abc.abstractmethod
    def apply_tensor(self, read_item: ReadItem, tensor: np.ndarray) -> None:
        """Take the array filled for ``read_item``. Called by the storage reader."""

    @abc.abstractmethod
    def apply_bytes(self, read_item: ReadItem, value: bytes) -> None:
        """Take the stored bytes of a non-tensor item. Called by the storage reader."""

    def finish_load(self) -> None:  # noqa: B027 - optional hook
        """Called on all ranks after every item was read (commit staged values)."""

    def value_reads(self, plan: LoadPlan) -> LoadPlan:
        """The non-tensor items of this rank's final plan, which ``load`` reads before any tensor item.

        ``load`` reads them (``read_data``, so ``apply_bytes`` decodes them) right after the verify step, so a
        value this load cannot decode (a type handler failing, a nested leaf of an unknown type) fails it on
        every rank before any target tensor changed. The read rounds then leave these items out: each is read
        once. Called on all ranks after ``finalize_plan``.
        """
        return LoadPlan(items=tuple(item for item in plan.items if item.type is LoadItemType.BYTE_IO))

    def direct_targets(self) -> dict[int, tuple[ReadItem, np.ndarray]]:
        """Optional hook: the final plan's items the reader may read straight into memory, by ``id`` of the item.

        Each value is the item and its target: a writable, C-contiguous host
        array of the stored dtype holding the whole stored chunk, filled by
        reading the chunk's bytes into it. The reader then calls neither
        :meth:`acquire_tensor` nor :meth:`apply_tensor` for that item, so a
        planner returns only items for which both do nothing else. Default:
        none (the reader asks for every item). Called by the storage reader
        after ``finalize_plan``, on every rank.
        """
        return {}

    # Optional hooks for planners that share reads between ranks (see
    # _replicated_read.py). ``dcp.load`` reads ``read_rounds(plan)`` one after
    # the other; after each, if ``shares_reads``, every rank's ``outgoing``
    # is gathered and handed to every rank's ``incoming``.
    shares_reads: bool = False

    def read_rounds(self, plan: LoadPlan) -> list[LoadPlan]:
        """Split this rank's final plan into rounds read in order. All ranks."""
        return [plan]

    def outgoing(self, round_index: int) -> dict[int, Any]:
        """Regions this rank read for others in round ``round_index``, by slot. All ranks."""
        return {}

    def incoming(self, round_index: int, payloads: dict[int, Any]) -> None:  # noqa: B027 - optional hook
        """Take the regions other ranks read for this one. All ranks."""
