"""What a checkpoint holds: typed, frozen descriptions of every stored item.

Only dataclasses live here; JSON encoding is in :mod:`._format.metadata_json`.
Coordinates follow one rule everywhere: an item is a box in its global tensor,
given by ``offsets`` (first element of each dim) and ``sizes``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

__all__ = [
    "FORMAT_VERSION",
    "BACKEND_NAME",
    "S3_BACKEND_NAME",
    "FSSPEC_BACKEND_NAME",
    "SAME_FORMAT_BACKENDS",
    "MetadataIndex",
    "ChunkStorageMetadata",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkChecksum",
    "StorageInfo",
    "StorageMeta",
    "Metadata",
    "STATE_DICT_TYPE",
]

#: Version of the on-disk format written by this code (docs/format.md section 12).
#: 2.0 added tile checksums (``checksum.block_shape``) and zstd compression,
#: which a 1.0 reader would misread; 2.1 the indexed form (grid tensors, rank
#: index files) for large saves; 2.2 flat block digests next to the tiles of a
#: tiled chunk (``checksum.flat_digests``); 1.0, 2.0 and 2.1 checkpoints still load.
FORMAT_VERSION = "2.2"
#: Name of the storage backend of the filesystem format (a local or shared directory).
BACKEND_NAME = "filesystem"
#: Backend recorded by a save to S3 (``s3://``, through fsspec): the same files as a directory.
S3_BACKEND_NAME = "s3"
#: Backend recorded by a save to another fsspec filesystem: the same files as a directory.
FSSPEC_BACKEND_NAME = "fsspec"
#: The backends this package writes. They store the same format, so one load strategy reads them all
#: (a checkpoint copied from S3 to a directory still loads).
SAME_FORMAT_BACKENDS = (BACKEND_NAME, S3_BACKEND_NAME, FSSPEC_BACKEND_NAME)

#: A flat or nested state dict as given by the caller.
STATE_DICT_TYPE = dict[str, Any]


@dataclass(frozen=True, slots=True)
class MetadataIndex:
    """Names one stored item: a whole tensor, a shard of one, or a value.

    Attributes:
        fqn: Fully qualified name of the item in the flattened state dict (or
            the global key of a ``ShardedTensor``/``ShardedObject``).
        offset: Global offset of the shard (empty for whole values).
        index: A hint: the position of the item in a plan or chunk list. It is
            left out of equality and hashing.
    """

    fqn: str
    offset: tuple[int, ...] = ()
    index: int | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True, slots=True)
class ChunkStorageMetadata:
    """One stored box of a tensor.

    Attributes:
        offsets: Global offset of the box in each dim.
        sizes: Extent of the box in each dim.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TensorProperties:
    """Properties of a stored tensor.

    Attributes:
        dtype: Framework-neutral dtype name (``"float32"``, ``"bfloat16"``...).
    """

    dtype: str


@dataclass(frozen=True, slots=True)
class TensorStorageMetadata:
    """A tensor in the checkpoint: its properties, global shape and chunks.

    Attributes:
        properties: dtype and other properties.
        size: Global shape.
        chunks: The distinct stored boxes; together they cover ``size``
            exactly. A tuple; for a tensor a save split evenly by a layout,
            a ``GridChunks`` sequence of the same chunks made on access (it
            equals the tuple and is written as the same list).
    """

    properties: TensorProperties
    size: tuple[int, ...]
    chunks: Sequence[ChunkStorageMetadata]


@dataclass(frozen=True, slots=True)
class BytesStorageMetadata:
    """A non-tensor value stored as bytes by a type handler.

    Attributes:
        type_name: The type handler's type string (``"int"``, ``"pickle"``...).
        global_shape: For a ``ShardedObject``, the shape of the grid of
            per-rank objects; empty for a plain value.
        shard_offsets: For a ``ShardedObject``, the stored grid positions;
            ``((),)`` for a plain value.
    """

    type_name: str = ""
    global_shape: tuple[int, ...] = ()
    shard_offsets: tuple[tuple[int, ...], ...] = ((),)


@dataclass(frozen=True, slots=True)
class ChunkChecksum:
    """Checksums of one stored chunk, block by block.

    The chunk's stored bytes are cut into consecutive blocks of
    ``block_bytes`` bytes (the last may be shorter); ``digests[i]`` is the hex
    digest of block ``i``. Loading a part of a chunk reads and verifies only
    the blocks it touches.

    Attributes:
        algorithm: Hash name (``"xxh3_64"``).
        block_bytes: Size of each block in bytes (> 0).
        digests: One lowercase hex digest per block.
        block_shape: Empty for flat blocks; else the tile shape, blocks are
            a grid of boxes of the chunk (see :mod:`.checksum`).
        flat_digests: With tiles (``block_shape`` set), also the digests of
            the chunk's flat blocks of ``block_bytes`` (format 2.2; empty in
            older checkpoints): a load reading the chunk whole verifies these,
            one hash pass over bytes as they lie in the file, instead of
            gathering each tile. Always empty for flat blocks.
    """

    algorithm: str
    block_bytes: int
    digests: tuple[str, ...]
    block_shape: tuple[int, ...] = ()
    flat_digests: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StorageInfo:
    """Where the bytes of one item live.

    Attributes:
        relative_path: Data file, relative to the checkpoint directory.
        offset: Byte offset of the item in that file.
        length: Stored length in bytes.
        checksum: Block checksums of the stored bytes, if any.
        compression: Codec of the stored bytes (``None`` when raw).
        raw_length: Uncompressed length when ``compression`` is set.
    """

    relative_path: str
    offset: int
    length: int
    checksum: ChunkChecksum | None = None
    compression: str | None = None
    raw_length: int | None = None


@dataclass(frozen=True)
class StorageMeta:
    """Facts about the save itself, recorded in the metadata.

    Attributes:
        backend: Name of the storage backend that wrote the checkpoint.
        save_id: Unique id of the save (part of every data file name).
        world_size: Number of ranks that took part.
        bytes_per_rank: Bytes written by each rank.
    """

    backend: str = BACKEND_NAME
    save_id: str = ""
    world_size: int = 1
    bytes_per_rank: tuple[int, ...] = ()


@dataclass(frozen=True)
class Metadata:
    """The committed description of a checkpoint.

    Attributes:
        state_dict_metadata: For every stored fqn its tensor or bytes metadata.
        planner_data: JSON-compatible data of the save planner (the nesting
            structure of the saved state dict).
        storage_data: Where each item is stored (set by the storage writer).
        version: Format version (:data:`FORMAT_VERSION` when written here).
        storage_meta: Backend name and facts about the save.
    """

    state_dict_metadata: dict[str, Union[TensorStorageMetadata, BytesStorageMetadata]]
    planner_data: Any = None
    storage_data: dict[MetadataIndex, StorageInfo] | None = None
    version: str = FORMAT_VERSION
    storage_meta: StorageMeta = field(default_factory=StorageMeta)

    def replace(self, **changes: Any) -> "Metadata":
        """Return a copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)
