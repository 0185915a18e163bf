"""JSON encoding of :class:`Metadata`, strict on the way in.

The metadata file is plain JSON (never pickle). Decoding checks every field's
type and range and refuses paths that leave the checkpoint directory, so a
hostile file is rejected before anything is read or allocated;
:func:`check_consistency` (:mod:`.consistency`, re-exported here) then checks
that items and storage entries match one to one (loading runs both). The
large members are decoded as a stream (:mod:`.json_stream`), their usual
entries by runs (:mod:`.regular_runs`). The format is
specified in ``docs/format.md``.
"""

from __future__ import annotations

import json
import math
import mmap
import re
from typing import Any

from hyper_parallel.core.distributed_checkpoint._format.consistency import check_consistency
from hyper_parallel.core.distributed_checkpoint._format.indexed_json import (
    grid_item_from_json,
    grid_item_to_json,
    grid_members,
    indexed_parts,
    indexed_storage_from_json,
)
from hyper_parallel.core.distributed_checkpoint._format.json_stream import Cursor, batches
from hyper_parallel.core.distributed_checkpoint._format.deferred_storage import DecodedMetadata, PendingStorage
from hyper_parallel.core.distributed_checkpoint._format.regular_runs import (
    StorageRows,
    items_by_runs,
    plain_text,
    storage_by_runs,
)
from hyper_parallel.core.distributed_checkpoint._format.storage_entry import (
    MAX_TENSOR_BYTES,
    check_relative_path,
    read_int as _int,
    read_ints as _ints,
    read_str as _str,
    storage_entry,
    storage_entry_from_json,
    storage_entry_to_json,
)
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointValueError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from hyper_parallel.platform.dtypes import DTYPE_NAMES

__all__ = [
    "FORMAT_NAME",
    "MAX_METADATA_BYTES",
    "MAX_TENSOR_BYTES",
    "metadata_to_json",
    "metadata_from_json",
    "storage_entry_to_json",
    "storage_entry_from_json",
    "check_relative_path",
    "check_consistency",
    "save_id_from_head",
    "save_id_of",
]

#: Value of the top-level ``"format"`` field.
FORMAT_NAME = "hyper_parallel.distributed_checkpoint"
#: Largest metadata file a reader accepts (larger is refused as hostile), so the largest a save commits.
MAX_METADATA_BYTES = 1 << 30


def metadata_to_json(metadata: Metadata, *, source: str = "metadata") -> bytes:
    """Encode ``metadata`` as UTF-8 JSON bytes. Called by the rank that commits, before it writes them.

    Args:
        metadata: The committed metadata.
        source: The file the bytes are for (named in errors).

    Raises:
        CheckpointValueError: the bytes are over :data:`MAX_METADATA_BYTES`, which every reader
            refuses: committing them would leave a checkpoint nobody can load, so nothing is
            committed (names the size, the chunk count and the fix).
    """
    tensors: dict[str, Any] = {}
    indexed = indexed_parts(metadata.storage_data)
    grids = indexed[0] if indexed is not None else {}
    for fqn, item in metadata.state_dict_metadata.items():
        grid = grids.get(fqn)
        if grid is not None:
            tensors[fqn] = grid_item_to_json(item, grid[1])
        elif isinstance(item, TensorStorageMetadata):
            tensors[fqn] = {
                "kind": "tensor",
                "dtype": item.properties.dtype,
                "size": list(item.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks],
            }
        else:
            tensors[fqn] = {
                "kind": "bytes",
                "type": item.type_name,
                "global_shape": list(item.global_shape),
                "shard_offsets": [list(o) for o in item.shard_offsets],
            }
    inline = indexed[1] if indexed is not None else (metadata.storage_data or {})
    storage = [storage_entry_to_json(index, info) for index, info in inline.items()]
    meta = metadata.storage_meta
    document = {
        "format": FORMAT_NAME,
        "version": metadata.version,
        "backend": meta.backend,
        "save_id": meta.save_id,
        "world_size": meta.world_size,
        "bytes_per_rank": list(meta.bytes_per_rank),
    }
    if indexed is not None:  # before the large members: their runs decoders look for what follows them
        document["rank_indexes"] = indexed[2]
    document.update({
        "state_dict_metadata": tensors,
        "storage_data": storage,
        "planner_data": metadata.planner_data,
    })
    data = json.dumps(document, separators=(",", ":")).encode("utf-8")
    if len(data) > MAX_METADATA_BYTES:
        chunks = len(metadata.storage_data or {})
        raise CheckpointValueError(
            f"{source}: this save's metadata is {len(data):,} bytes ({len(tensors):,} keys stored as {chunks:,} "
            f"chunks), over the {MAX_METADATA_BYTES:,} bytes any reader of this format accepts "
            "(MAX_METADATA_BYTES), so it was not committed (an earlier checkpoint at this id is kept). The metadata "
            "holds one record per stored chunk: save fewer, larger chunks (shard the large tensors over fewer ranks, "
            "or save groups of keys, e.g. the optimizer state, as separate checkpoints)"
        )
    return data


def _whole_tensor_key(raw: dict) -> tuple[Any, ...] | None:
    """For a tensor item stored as one whole chunk (most items): a key its decoded record is shared under.

    Items with equal keys decode to equal records (records are immutable), so
    only the first of them takes :func:`_tensor_entry`'s checks. ``None`` for
    anything else (every item then takes the full checks).
    """
    dtype, size, chunks = raw.get("dtype"), raw.get("size"), raw.get("chunks")
    if (type(size) is not list or type(chunks) is not list or len(chunks) != 1  # pylint: disable=unidiomatic-typecheck
            or type(dtype) is not str):  # pylint: disable=unidiomatic-typecheck
        return None
    pair = chunks[0]
    if type(pair) is not list or len(pair) != 2:  # pylint: disable=unidiomatic-typecheck
        return None
    offsets, sizes = pair
    # pylint: disable-next=unidiomatic-typecheck
    if (type(offsets) is not list or type(sizes) is not list or len(offsets) != len(size)
            or len(sizes) != len(size)):
        return None
    # Each dim an int >= 0 in both lists and equal (a float or bool would compare equal), every offset 0.
    for full, part, offset in zip(size, sizes, offsets):
        # pylint: disable-next=unidiomatic-typecheck
        if (type(full) is not int or type(part) is not int or type(offset) is not int
                or full != part or full < 0 or offset):
            return None
    return ("whole tensor", dtype, tuple(size))


def _tensor_entry(fqn: str, raw: dict, where: str, shared: dict) -> TensorStorageMetadata:
    dtype = shared.setdefault(_str(raw.get("dtype"), where, "dtype"), raw["dtype"])
    if dtype not in DTYPE_NAMES:
        raise CorruptCheckpointError(f"{where}: unknown dtype {dtype!r}")
    size = shared.setdefault(size := _ints(raw.get("size"), where, "size"), size)
    if math.prod(size) * DTYPE_NAMES[dtype] > MAX_TENSOR_BYTES:
        raise UnsafeCheckpointError(f"{where}: declared size {list(size)} is absurdly large; refused")
    chunks = []
    raw_chunks = raw.get("chunks")
    if not isinstance(raw_chunks, list):
        raise CorruptCheckpointError(f"{where}: chunks must be a list")
    for position, pair in enumerate(raw_chunks):
        if not isinstance(pair, list) or len(pair) != 2:
            raise CorruptCheckpointError(f"{where}: chunk {position} must be [offsets, sizes]")
        offsets = _ints(pair[0], where, ("chunk", position, "offsets"))
        offsets = shared.setdefault(offsets, offsets)
        sizes = _ints(pair[1], where, ("chunk", position, "sizes"))
        sizes = shared.setdefault(sizes, sizes)
        if len(offsets) != len(size) or len(sizes) != len(size) or (
            sizes != size or any(offsets)) and any(o + s > full for o, s, full in zip(offsets, sizes, size)):
            raise CorruptCheckpointError(f"{where}: chunk {position} {offsets}+{sizes} lies outside {list(size)}")
        chunks.append(ChunkStorageMetadata(offsets, sizes))  # positional: cheaper per entry
    properties = shared.get(("properties", dtype))
    if properties is None:  # one record per dtype (records are immutable)
        properties = shared[("properties", dtype)] = TensorProperties(dtype)
    return TensorStorageMetadata(properties, size, tuple(chunks))  # properties, size, chunks


def _item(fqn: str, raw: Any, source: str, shared: dict) -> TensorStorageMetadata | BytesStorageMetadata:
    """Decode and check one ``state_dict_metadata`` member."""
    key = None
    if type(raw) is dict and raw.get("kind") == "tensor" and len(raw) == 4:  # pylint: disable=unidiomatic-typecheck
        key = _whole_tensor_key(raw)
        record = shared.get(key) if key is not None else None
        if record is not None:
            return record
    where = f"{source}: key '{fqn}'"
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{where}: expected an object")
    if raw.get("kind") == "tensor" and "grid" in raw:  # format 2.1: a grid tensor of an indexed checkpoint
        return grid_item_from_json(fqn, raw, where, shared, _tensor_entry)
    if raw.get("kind") == "tensor":
        record = _tensor_entry(fqn, raw, where, shared)
        if key is not None:
            shared[key] = record
        return record
    if raw.get("kind") == "bytes":
        offsets = raw.get("shard_offsets", [[]])
        if not isinstance(offsets, list):
            raise CorruptCheckpointError(f"{where}: shard_offsets must be a list")
        return BytesStorageMetadata(
            type_name=_str(raw.get("type"), where, "type"),
            global_shape=_ints(raw.get("global_shape", []), where, "global_shape"),
            shard_offsets=tuple(_ints(o, where, "shard offset") for o in offsets),
        )
    raise CorruptCheckpointError(f"{where}: unknown kind {raw.get('kind')!r}")


def _decode_items(cursor: Cursor, shared: dict, plain: bool) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
    source = cursor.source
    if cursor.skip() != "{":
        raise CorruptCheckpointError(f"{source}: state_dict_metadata must be an object")
    cursor.position += 1
    items = items_by_runs(cursor, shared, lambda fqn, raw: _item(fqn, raw, source, shared)) if plain else None
    if items is not None:
        return items
    items = {}
    for batch in batches(cursor, '},"', "{}"):
        for fqn, raw in batch.items():
            fqn = shared.setdefault(fqn, fqn)
            items[fqn] = _item(fqn, raw, source, shared)
    for _ in cursor.members("}"):
        fqn = cursor.key()
        fqn = shared.setdefault(fqn, fqn)
        items[fqn] = _item(fqn, cursor.value(), source, shared)
    return items


def _decode_storage(cursor: Cursor, shared: dict, plain: bool) -> dict[MetadataIndex, StorageInfo] | PendingStorage:
    source = cursor.source
    if cursor.skip() != "[":
        raise CorruptCheckpointError(f"{source}: storage_data must be a list")
    cursor.position += 1
    storage: dict[MetadataIndex, StorageInfo] = {}
    count = 0
    pairs = storage_by_runs(
        cursor, shared, lambda raw: storage_entry(raw, count, source, shared),
        lambda path: check_relative_path(path, f"{source}: storage_data"), MAX_TENSOR_BYTES) if plain else None
    if pairs is not None:
        # pylint: disable-next=unidiomatic-typecheck
        keys = [(index.fqn, index.offset) for index, _ in (part for part in pairs if type(part) is not StorageRows)]
        rows = [part for part in pairs if type(part) is StorageRows]  # pylint: disable=unidiomatic-typecheck
        count = len(keys) + sum(len(part.fqns) for part in rows)
        unique = set(keys)
        for part in rows:
            unique.update(part.keys())
        if len(unique) != count:
            raise CorruptCheckpointError(f"{source}: storage_data lists a chunk twice")
        return PendingStorage(pairs) if rows else dict(pairs)
    for batch in batches(cursor, '},{"fqn":', "[]"):
        for raw in batch:
            index, info = storage_entry(raw, count, source, shared)
            storage[index] = info
            count += 1
    for _ in cursor.members("]"):
        index, info = storage_entry(cursor.value(), count, source, shared)
        storage[index] = info
        count += 1
    if len(storage) != count:
        raise CorruptCheckpointError(f"{source}: storage_data lists a chunk twice")
    return storage


def metadata_from_json(data: bytes | bytearray | mmap.mmap, *, source: str = "metadata") -> Metadata:
    """Decode and check metadata written by :func:`metadata_to_json`.

    The two large members (``state_dict_metadata``, ``storage_data``) are
    decoded a bounded window of entries at a time: by runs (:mod:`.regular_runs`)
    while the text is this writer's compact form without escapes, else
    ``json_stream._BATCH`` per JSON call or one at a time,
    each entry turned into its typed record at once,
    so the whole JSON document never exists as Python objects: peak memory is
    the text plus the records, and time is linear. A ``bytearray`` is emptied
    and an anonymous ``mmap`` closed as soon as it is decoded to text (the
    caller hands its buffer over), so the raw bytes are not held while the
    records are built: about 3x the file size at the peak instead of 4x (the
    whole document tree took 6.3x). An ``mmap``'s pages go back to the system
    at once whatever the allocator keeps (``read_metadata`` reads into one).

    Raises:
        CorruptCheckpointError: not JSON, or a field of the wrong type.
        UnsafeCheckpointError: a path leaving the directory or an absurd size.
    """
    plain = plain_text(data)  # no escapes or control characters: the writer's regular entries decode by runs
    try:
        text = str(data, "utf-8")
    except ValueError as exc:
        raise CorruptCheckpointError(f"{source}: not valid JSON metadata ({exc})") from exc
    finally:  # a buffer handed over: its memory goes back before the records are built
        if isinstance(data, bytearray):
            data.clear()
        elif isinstance(data, mmap.mmap):
            data.close()
    cursor = Cursor(text, source)
    if cursor.skip() != "{":
        cursor.value()  # says "not valid JSON" when it is not
        raise CorruptCheckpointError(f"{source}: not a hyper_parallel checkpoint metadata file")
    cursor.position += 1
    # Equal strings and tuples (key names, file names, offsets) are kept once.
    shared: dict = {}
    document: dict[str, Any] = {}
    items = storage = None
    for _ in cursor.members("}"):
        name = cursor.key()
        if name == "state_dict_metadata":
            items = _decode_items(cursor, shared, plain)
        elif name == "storage_data":
            storage = _decode_storage(cursor, shared, plain)
        else:
            document[name] = cursor.value()
    if cursor.skip():
        raise CorruptCheckpointError(f"{source}: not valid JSON metadata (extra data at char {cursor.position})")
    raw_grids = grid_members(shared)
    del shared, cursor, text
    if document.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{source}: not a hyper_parallel checkpoint metadata file")
    if items is None:
        raise CorruptCheckpointError(f"{source}: state_dict_metadata must be an object")
    if storage is None:
        raise CorruptCheckpointError(f"{source}: storage_data must be a list")
    storage_meta = StorageMeta(
        backend=_str(document.get("backend"), source, "backend"),
        save_id=_str(document.get("save_id", ""), source, "save_id"),
        world_size=_int(document.get("world_size", 1), source, "world_size"),
        bytes_per_rank=_ints(document.get("bytes_per_rank", []), source, "bytes_per_rank"),
    )
    if raw_grids or "rank_indexes" in document:
        if type(storage) is PendingStorage:  # pylint: disable=unidiomatic-typecheck
            storage = storage.records()
        storage = indexed_storage_from_json(items, storage, raw_grids, document.get("rank_indexes"),
                                            meta=storage_meta, source=source)
    return (DecodedMetadata if type(storage) is PendingStorage else Metadata)(  # pylint: disable=unidiomatic-typecheck
        state_dict_metadata=items,
        planner_data=document.get("planner_data"),
        storage_data=storage,
        version=_str(document.get("version"), source, "version"),
        storage_meta=storage_meta,
    )


# metadata_to_json writes format, version, backend and save_id first, so the
# save id can be read from the head of a large document without decoding it.
_SAVE_ID_HEAD = re.compile(
    rb'^\{"format":"[^"\\]{0,64}","version":"[^"\\]{0,16}","backend":"[^"\\]{0,64}","save_id":"([0-9a-f]{12})"'
)
_SAVE_ID = re.compile(r"^[0-9a-f]{12}$")


def save_id_from_head(head: bytes) -> str | None:
    """The save id in the first bytes of metadata this code wrote.

    ``None``: not found there; decode the whole with :func:`save_id_of`.
    """
    match = _SAVE_ID_HEAD.match(head)
    return match.group(1).decode("ascii") if match else None


def save_id_of(data: bytes) -> str | None:
    """The save id a whole metadata document records; ``None`` if it records none.

    Raises:
        ValueError / RecursionError: not JSON.
    """
    document = json.loads(data)
    save_id = document.get("save_id") if isinstance(document, dict) else None
    return save_id if isinstance(save_id, str) and _SAVE_ID.match(save_id) else None
