"""A storage backend that keeps a checkpoint's bytes in a dict: the proof that others can implement one.

Written only against the public extension points: :class:`StorageWriter` /
:class:`StorageReader`, the plan and metadata types, ``encode_metadata`` /
``decode_metadata`` / ``check_metadata`` for the committed metadata, and
``xxhash`` for checksums (one digest per stored item, docs/format.md 7.1).
Every item is one object ``<checkpoint>/<save id>/r<rank>/<n>`` holding its
raw bytes (a tensor chunk C-ordered); the metadata object
``<checkpoint>/metadata.json`` is written last, and is the commit.

The checkpoint records backend ``"memory"``; :func:`register_memory_backend`
registers the built-in strategies for it, so ``dcp.load`` can dispatch.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import xxhash

from hyper_parallel.core.distributed_checkpoint import (
    CheckpointNotFoundError,
    CheckpointValueError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    Metadata,
    MetadataIndex,
    SavePlan,
    SavePlanner,
    StorageInfo,
    StorageReader,
    StorageWriter,
    StrategyAction,
    TensorStorageMetadata,
    WriteItemType,
    WriteResult,
    register_default_strategy,
)
from hyper_parallel.core.distributed_checkpoint.metadata import FORMAT_VERSION, ChunkChecksum
from hyper_parallel.core.distributed_checkpoint.storage import check_metadata, decode_metadata, encode_metadata
from hyper_parallel.core.distributed_checkpoint.strategies import StandardLoadStrategy
from hyper_parallel.platform import numpy_dtype

__all__ = ["BACKEND", "MemoryStore", "MemoryWriter", "MemoryReader", "MemoryPlanData", "register_memory_backend"]

#: The backend name recorded in the metadata.
BACKEND = "memory"
_PREFIX = "memory://"


class MemoryStore:
    """Objects by key, shared by the writers and readers of simulated ranks (thread-safe)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` (replacing it atomically)."""
        with self._lock:
            self.objects[key] = bytes(data)

    def get(self, key: str) -> bytes | None:
        """The object at ``key``, or ``None``."""
        with self._lock:
            return self.objects.get(key)

    def has_prefix(self, prefix: str) -> bool:
        """Whether any object lives under ``prefix``."""
        with self._lock:
            return any(key.startswith(prefix) for key in self.objects)


def _name(checkpoint_id: Any) -> str:
    if not MemoryWriter.validate_checkpoint_id(checkpoint_id):
        raise CheckpointValueError(f"not a memory checkpoint id: {checkpoint_id!r} (expected memory://<name>)")
    return checkpoint_id[len(_PREFIX):]


def _digest(data: bytes) -> ChunkChecksum:
    return ChunkChecksum(algorithm="xxh3_64", block_bytes=max(1, len(data)),
                         digests=(xxhash.xxh3_64(data, seed=0).hexdigest(),))


@dataclass(frozen=True)
class MemoryPlanData:
    """A final save plan's storage data: the coordinator's save id."""

    save_id: str


class MemoryWriter(StorageWriter):
    """Writes items as objects of a :class:`MemoryStore`; the metadata object is the commit."""

    def __init__(self, checkpoint_id: str, *, store: MemoryStore) -> None:
        self.name = _name(checkpoint_id)
        self.store = store
        self.rank = 0
        self.rank_local = False
        self.save_id = ""

    def reset(self, checkpoint_id: str | None = None) -> None:
        """Start a new save. All ranks."""
        if checkpoint_id is not None:
            self.name = _name(checkpoint_id)

    def set_up_storage_writer(
        self, is_coordinator: bool, *, rank: int = 0, world_size: int = 1, rank_local: bool = False
    ) -> None:
        """Take this rank's place; the coordinator draws the save id. All ranks."""
        self.rank = rank
        self.rank_local = rank_local
        self.save_id = uuid.uuid4().hex[:12]

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Nothing to add. All ranks."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Hand every rank the coordinator's save id. Coordinator."""
        return [replace(plan, storage_data=MemoryPlanData(save_id=self.save_id)) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[list[WriteResult]]":
        """Store every item of this rank's plan as one object. All ranks."""
        future: Future[list[WriteResult]] = Future()
        if isinstance(plan.storage_data, MemoryPlanData):
            self.save_id = plan.storage_data.save_id
        results = []
        for position, item in enumerate(plan.items):
            data = planner.get_data(item)
            raw = bytes(data) if item.type == WriteItemType.BYTE_IO else np.ascontiguousarray(data).tobytes()
            key = f"{self.name}/{self.save_id}/r{self.rank}/{position}"
            self.store.put(key, raw)
            info = StorageInfo(relative_path=key, offset=0, length=len(raw), checksum=_digest(raw))
            results.append(WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=info))
        future.set_result(results)
        return future

    def finish(
        self, metadata: Metadata, results: list[list[WriteResult]], *, background_cleanup: bool = False
    ) -> Metadata:
        """Write the metadata object: the commit. Coordinator."""
        storage_data = {MetadataIndex(r.index.fqn, r.index.offset): r.storage_data for rs in results for r in rs}
        committed = metadata.replace(
            storage_data=storage_data,
            storage_meta=replace(metadata.storage_meta, backend=BACKEND, save_id=self.save_id),
        )
        self.store.put(f"{self.name}/{_metadata_key(self.rank if self.rank_local else None)}",
                       encode_metadata(committed))
        return committed

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """``memory://<name>`` ids."""
        return (isinstance(checkpoint_id, str) and checkpoint_id.startswith(_PREFIX)
                and len(checkpoint_id) > len(_PREFIX))


def _metadata_key(rank: int | None) -> str:
    return "metadata.json" if rank is None else f"metadata.rank{rank:05d}.json"


class MemoryReader(StorageReader):
    """Reads a checkpoint from a :class:`MemoryStore`, verifying every item before using it."""

    def __init__(self, checkpoint_id: str, *, store: MemoryStore) -> None:
        self.name = _name(checkpoint_id)
        self.store = store
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | None = None) -> None:
        """Start a new load. All ranks."""
        if checkpoint_id is not None:
            self.name = _name(checkpoint_id)
        self.metadata = None

    def read_metadata(self, *, rank: int | None = None) -> Metadata:
        """Read the committed metadata object. Any rank."""
        if not self.store.has_prefix(self.name + "/"):
            raise CheckpointNotFoundError(f"checkpoint memory://{self.name} does not exist")
        data = self.store.get(f"{self.name}/{_metadata_key(rank)}") if rank is not None else None
        data = data if data is not None else self.store.get(f"{self.name}/{_metadata_key(None)}")
        if data is None:
            raise IncompleteCheckpointError(f"checkpoint memory://{self.name} has no committed metadata")
        return decode_metadata(data, source=f"memory://{self.name}")

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        """Check and keep the metadata. All ranks."""
        check_metadata(metadata, source=f"memory://{self.name}")
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Nothing to add. All ranks."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Nothing to add. Coordinator."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        """Verify every object the plan needs, then copy its regions into the planner. All ranks."""
        future: Future[None] = Future()
        try:
            needed = {self._info(item.storage_index).relative_path: item for item in plan.items}
            verified = {key: self._verified(key, item.storage_index) for key, item in needed.items()}
            for item in plan.items:
                raw = verified[self._info(item.storage_index).relative_path]
                if item.type == LoadItemType.BYTE_IO:
                    planner.apply_bytes(item, raw)
                    continue
                stored = self.metadata.state_dict_metadata[item.storage_index.fqn]
                assert isinstance(stored, TensorStorageMetadata)
                sizes = next(c.sizes for c in stored.chunks if c.offsets == tuple(item.storage_index.offset))
                chunk = np.frombuffer(raw, dtype=numpy_dtype(stored.properties.dtype)).reshape(sizes)
                region = chunk[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))]
                target = planner.acquire_tensor(item)
                np.copyto(target, region, casting="unsafe")
                planner.apply_tensor(item, target)
            future.set_result(None)
        except BaseException as exc:  # pylint: disable=broad-except
            future.set_exception(exc)
        return future

    def _info(self, index: MetadataIndex) -> StorageInfo:
        return self.metadata.storage_data[MetadataIndex(index.fqn, index.offset)]

    def _verified(self, key: str, index: MetadataIndex) -> bytes:
        fqn, info = index.fqn, self._info(index)
        data = self.store.get(key)
        if data is None:
            raise CorruptCheckpointError(f"key '{fqn}': object {key} of memory://{self.name} is missing")
        if len(data) != info.length or _digest(data).digests != info.checksum.digests:
            raise CorruptCheckpointError(
                f"checksum mismatch in object {key} of memory://{self.name}, key '{fqn}': the checkpoint is corrupt"
            )
        return data

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """``memory://<name>`` ids."""
        return MemoryWriter.validate_checkpoint_id(checkpoint_id)


def register_memory_backend() -> None:
    """Let ``dcp.load`` dispatch checkpoints of backend ``"memory"`` to the built-in load strategy."""
    for action in (StrategyAction.LOAD_SHARDED, StrategyAction.LOAD_COMMON):
        register_default_strategy(action, BACKEND, FORMAT_VERSION, StandardLoadStrategy(BACKEND, FORMAT_VERSION))

