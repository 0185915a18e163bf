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
import posixpath
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
from hyper_parallel.core.distributed_checkpoint._format.regular_runs import items_by_runs, plain_text, storage_by_runs
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import naturals
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointValueError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkChecksum,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from hyper_parallel.platform.tensor import DTYPE_NAMES

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
#: Largest tensor (in bytes) a checkpoint may declare; larger is refused as hostile.
MAX_TENSOR_BYTES = 1 << 50
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


def storage_entry_to_json(index: MetadataIndex, info: StorageInfo) -> dict[str, Any]:
    """One ``storage_data`` entry as the JSON object of docs/format.md."""
    entry: dict[str, Any] = {
        "fqn": index.fqn,
        "offset": list(index.offset),
        "file": info.relative_path,
        "byte_offset": info.offset,
        "length": info.length,
    }
    if info.checksum is not None:
        entry["checksum"] = {
            "algorithm": info.checksum.algorithm,
            "block_bytes": info.checksum.block_bytes,
            "digests": list(info.checksum.digests),
        }
        if info.checksum.block_shape:
            entry["checksum"]["block_shape"] = list(info.checksum.block_shape)
    if info.compression is not None:
        entry["compression"] = info.compression
        entry["raw_length"] = info.raw_length
    return entry


def storage_entry_from_json(raw: Any, *, position: int, source: str) -> tuple[MetadataIndex, StorageInfo]:
    """Decode and check one ``storage_data`` entry (as :func:`metadata_from_json` does each).

    Raises:
        CorruptCheckpointError / UnsafeCheckpointError: as :func:`metadata_from_json`.
    """
    return _storage_entry(raw, position, source, {})


def check_relative_path(path: Any, where: str) -> str:
    """Return ``path`` if it is a plain relative path inside the directory.

    Raises:
        UnsafeCheckpointError: absolute, empty, backslash, ``..`` or NUL paths.
    """
    if not isinstance(path, str) or not path or "\x00" in path or "\\" in path:
        raise UnsafeCheckpointError(f"{where}: data file name {path!r} is not a plain relative path")
    norm = posixpath.normpath(path)
    if posixpath.isabs(path) or norm.startswith("..") or norm != path or path.startswith("./"):
        raise UnsafeCheckpointError(f"{where}: data file {path!r} leaves the checkpoint directory; refused")
    return path


def _field(where: str, what: Any) -> str:
    """``where`` and ``what`` (words, or a tuple of them), for a message; built only when one is raised."""
    return " ".join((where, *map(str, what))) if isinstance(what, tuple) else f"{where} {what}".rstrip()


def _ints(value: Any, where: str, what: Any = "", *, minimum: int = 0) -> tuple[int, ...]:
    if type(value) is not list:
        raise CorruptCheckpointError(f"{_field(where, what)}: expected a list of integers >= {minimum}, "
                                     f"got {value!r:.80}")
    for v in value:
        if type(v) is not int or v < minimum:
            raise CorruptCheckpointError(f"{_field(where, what)}: expected a list of integers >= {minimum}, "
                                         f"got {value!r:.80}")
    return tuple(value)


def _int(value: Any, where: str, what: Any = "") -> int:
    if type(value) is not int or value < 0:
        raise CorruptCheckpointError(f"{_field(where, what)}: expected an integer >= 0, got {value!r:.80}")
    return value


def _str(value: Any, where: str, what: Any = "") -> str:
    if not isinstance(value, str):
        raise CorruptCheckpointError(f"{_field(where, what)}: expected a string, got {value!r:.80}")
    return value


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
    if (type(offsets) is not list or type(sizes) is not list or len(offsets) != len(size)  # pylint: disable=unidiomatic-typecheck
            or len(sizes) != len(size)):
        return None
    # Each dim an int >= 0 in both lists and equal (a float or bool would compare equal), every offset 0.
    for full, part, offset in zip(size, sizes, offsets):
        if (type(full) is not int or type(part) is not int or type(offset) is not int  # pylint: disable=unidiomatic-typecheck
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


# _records: the usual storage entry's three records, one of each per entry of thousands, are built by
# setting their slots directly (about half the cost of a frozen dataclass's __init__; none of these classes
# has a __post_init__). tests/test_load_flat.py checks the result equals the full decode's.
_new_object = object.__new__
_set_algorithm, _set_block_bytes, _set_digests, _set_block_shape = (
    ChunkChecksum.algorithm.__set__, ChunkChecksum.block_bytes.__set__, ChunkChecksum.digests.__set__,
    ChunkChecksum.block_shape.__set__)
_set_relative_path, _set_offset, _set_length, _set_checksum, _set_compression, _set_raw_length = (
    StorageInfo.relative_path.__set__, StorageInfo.offset.__set__, StorageInfo.length.__set__,
    StorageInfo.checksum.__set__, StorageInfo.compression.__set__, StorageInfo.raw_length.__set__)
_set_fqn, _set_chunk_offset, _set_index = (
    MetadataIndex.fqn.__set__, MetadataIndex.offset.__set__, MetadataIndex.index.__set__)


def _flat_checked_entry(raw: Any, shared: dict) -> tuple[MetadataIndex, StorageInfo] | None:
    """A storage entry of the usual form (uncompressed, flat checksum blocks, a data file seen before); else ``None``.

    A fast path of :func:`_storage_entry`: it accepts only what that function's
    checks would, and returns ``None`` for everything else (which then takes
    the full checks and their messages).
    """
    if type(raw) is not dict or len(raw) != 6:  # pylint: disable=unidiomatic-typecheck
        return None
    try:  # subscripts (cheaper than .get per field); a missing field is not the usual form
        fqn, offset, start, length, chk, path = (
            raw["fqn"], raw["offset"], raw["byte_offset"], raw["length"], raw["checksum"], raw["file"])
        if (type(fqn) is not str or type(offset) is not list or type(start) is not int  # pylint: disable=unidiomatic-typecheck
                or type(length) is not int or type(chk) is not dict or len(chk) != 3):  # pylint: disable=unidiomatic-typecheck
            return None
        algorithm, block, digests = chk["algorithm"], chk["block_bytes"], chk["digests"]
    except KeyError:
        return None
    path = shared.get(("file", path)) if type(path) is str else None  # pylint: disable=unidiomatic-typecheck
    if (path is None or not 0 <= start <= MAX_TENSOR_BYTES or not 0 <= length <= MAX_TENSOR_BYTES
            or type(algorithm) is not str or type(block) is not int or block <= 0  # pylint: disable=unidiomatic-typecheck
            or type(digests) is not list or not naturals(offset)):  # pylint: disable=unidiomatic-typecheck
        return None
    for digest in digests:
        if type(digest) is not str:  # pylint: disable=unidiomatic-typecheck
            return None
    offset = tuple(offset)
    # The records of checked fields, built without their frozen __init__ (see _new_object above).
    checksum = _new_object(ChunkChecksum)
    _set_algorithm(checksum, shared.setdefault(algorithm, algorithm))
    _set_block_bytes(checksum, block)
    _set_digests(checksum, tuple(digests))
    _set_block_shape(checksum, ())
    info = _new_object(StorageInfo)
    _set_relative_path(info, path)
    _set_offset(info, start)
    _set_length(info, length)
    _set_checksum(info, checksum)
    _set_compression(info, None)
    _set_raw_length(info, None)
    index = _new_object(MetadataIndex)
    _set_fqn(index, shared.setdefault(fqn, fqn))
    _set_chunk_offset(index, shared.setdefault(offset, offset))
    _set_index(index, None)
    return index, info


def _storage_entry(raw: Any, position: int, source: str, shared: dict) -> tuple[MetadataIndex, StorageInfo]:
    found = _flat_checked_entry(raw, shared)
    if found is not None:
        return found
    where = f"{source}: storage_data[{position}]"
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{where}: expected an object")
    fqn = _str(raw.get("fqn"), where, "fqn")
    fqn = shared.setdefault(fqn, fqn)
    offset = _ints(raw.get("offset"), where, "offset")
    index = MetadataIndex(fqn, shared.setdefault(offset, offset))
    path = raw.get("file")
    checked = shared.get(("file", path)) if type(path) is str else None  # a file's entries share its name
    if checked is None:
        checked = shared[("file", path)] = check_relative_path(path, f"{where} (key '{fqn}')")
    path = checked
    checksum = None
    if raw.get("checksum") is not None:
        chk = raw["checksum"]
        if not isinstance(chk, dict):
            raise CorruptCheckpointError(f"{where}: checksum must be an object")
        block = _int(chk.get("block_bytes"), where, "block_bytes")
        digests = chk.get("digests")
        if block <= 0 or not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
            raise CorruptCheckpointError(f"{where}: malformed checksum for key '{fqn}'")
        block_shape = _ints(chk.get("block_shape", []), where, "block_shape", minimum=1)
        algorithm = _str(chk.get("algorithm"), where, "algorithm")
        # Positional (cheaper per entry): algorithm, block_bytes, digests, block_shape.
        checksum = ChunkChecksum(shared.setdefault(algorithm, algorithm), block, tuple(digests), block_shape)
    compression = raw.get("compression")
    if compression is not None and compression != "zstd":
        raise CorruptCheckpointError(f"{where}: unknown compression {compression!r} for key '{fqn}'")
    info = StorageInfo(  # positional (cheaper per entry): relative_path, offset, length, checksum, compression, raw_length
        path,
        _int(raw.get("byte_offset"), where, "byte_offset"),
        _int(raw.get("length"), where, "length"),
        checksum,
        compression,
        _int(raw.get("raw_length"), where, "raw_length") if compression else None,
    )
    if info.length > MAX_TENSOR_BYTES or info.offset > MAX_TENSOR_BYTES:
        raise UnsafeCheckpointError(f"{where}: absurd byte offset or length for key '{fqn}'; refused")
    return index, info


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


def _decode_storage(cursor: Cursor, shared: dict, plain: bool) -> dict[MetadataIndex, StorageInfo]:
    source = cursor.source
    if cursor.skip() != "[":
        raise CorruptCheckpointError(f"{source}: storage_data must be a list")
    cursor.position += 1
    storage: dict[MetadataIndex, StorageInfo] = {}
    count = 0
    pairs = storage_by_runs(
        cursor, shared, lambda raw: _storage_entry(raw, count, source, shared),
        lambda path: check_relative_path(path, f"{source}: storage_data"), MAX_TENSOR_BYTES) if plain else None
    if pairs is not None:
        storage.update(pairs)
        if len(storage) != len(pairs):
            raise CorruptCheckpointError(f"{source}: storage_data lists a chunk twice")
        return storage
    for batch in batches(cursor, '},{"fqn":', "[]"):
        for raw in batch:
            index, info = _storage_entry(raw, count, source, shared)
            storage[index] = info
            count += 1
    for _ in cursor.members("]"):
        index, info = _storage_entry(cursor.value(), count, source, shared)
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
        storage = indexed_storage_from_json(items, storage, raw_grids, document.get("rank_indexes"),
                                            meta=storage_meta, source=source)
    return Metadata(
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
    """The save id in the first bytes of metadata this code wrote; ``None``: decode the whole with :func:`save_id_of`."""
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
