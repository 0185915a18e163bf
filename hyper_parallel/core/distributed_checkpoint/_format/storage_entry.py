"""One ``storage_data`` entry (docs/format.md section 6.2) as JSON, strict on the way in.

Used for the entries of ``metadata.json`` (:mod:`.metadata_json`) and of the
rank index files of the indexed form (:mod:`.rank_index`): one decoder and its
hostile-input checks for both. Also the typed field readers every decoder of
the format uses.
"""

from __future__ import annotations

import posixpath
from typing import Any

from hyper_parallel.core.distributed_checkpoint._format.checksum import is_digest
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import naturals
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    ChunkChecksum,
    MetadataIndex,
    StorageInfo,
)

__all__ = [
    "MAX_TENSOR_BYTES",
    "storage_entry_to_json",
    "storage_entry_from_json",
    "storage_entry",
    "check_relative_path",
    "read_ints",
    "read_int",
    "read_str",
]

#: Largest tensor (in bytes) a checkpoint may declare; larger is refused as hostile.
MAX_TENSOR_BYTES = 1 << 50


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
        if info.checksum.flat_digests:
            entry["checksum"]["flat_digests"] = list(info.checksum.flat_digests)
    if info.compression is not None:
        entry["compression"] = info.compression
        entry["raw_length"] = info.raw_length
    return entry


def storage_entry_from_json(raw: Any, *, position: int, source: str) -> tuple[MetadataIndex, StorageInfo]:
    """Decode and check one ``storage_data`` entry (as :func:`metadata_from_json` does each).

    Raises:
        CorruptCheckpointError / UnsafeCheckpointError: as :func:`metadata_from_json`.
    """
    return storage_entry(raw, position, source, {})


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


# _records: the usual storage entry's three records, one of each per entry of thousands, are built by
# setting their slots directly (about half the cost of a frozen dataclass's __init__; none of these classes
# has a __post_init__). tests/test_load_flat.py checks the result equals the full decode's.
_new_object = object.__new__
_set_algorithm, _set_block_bytes, _set_digests, _set_block_shape, _set_flat_digests = (
    ChunkChecksum.algorithm.__set__, ChunkChecksum.block_bytes.__set__, ChunkChecksum.digests.__set__,
    ChunkChecksum.block_shape.__set__, ChunkChecksum.flat_digests.__set__)
_set_relative_path, _set_offset, _set_length, _set_checksum, _set_compression, _set_raw_length = (
    StorageInfo.relative_path.__set__, StorageInfo.offset.__set__, StorageInfo.length.__set__,
    StorageInfo.checksum.__set__, StorageInfo.compression.__set__, StorageInfo.raw_length.__set__)
_set_fqn, _set_chunk_offset, _set_index = (
    MetadataIndex.fqn.__set__, MetadataIndex.offset.__set__, MetadataIndex.index.__set__)


def _flat_checked_entry(raw: Any, shared: dict) -> tuple[MetadataIndex, StorageInfo] | None:
    """A storage entry of the usual form (uncompressed, flat checksum blocks, a data file seen before); else ``None``.

    A fast path of :func:`storage_entry`: it accepts only what that function's
    checks would, and returns ``None`` for everything else (which then takes
    the full checks and their messages).
    """
    if type(raw) is not dict or len(raw) != 6:  # pylint: disable=unidiomatic-typecheck
        return None
    try:  # subscripts (cheaper than .get per field); a missing field is not the usual form
        fqn, offset, start, length, chk, path = (
            raw["fqn"], raw["offset"], raw["byte_offset"], raw["length"], raw["checksum"], raw["file"])
        # pylint: disable-next=unidiomatic-typecheck
        if (type(fqn) is not str or type(offset) is not list or type(start) is not int
                # pylint: disable-next=unidiomatic-typecheck
                or type(length) is not int or type(chk) is not dict or len(chk) != 3):
            return None
        algorithm, block, digests = chk["algorithm"], chk["block_bytes"], chk["digests"]
    except KeyError:
        return None
    path = shared.get(("file", path)) if type(path) is str else None  # pylint: disable=unidiomatic-typecheck
    if (path is None or not 0 <= start <= MAX_TENSOR_BYTES or not 0 <= length <= MAX_TENSOR_BYTES
            # pylint: disable-next=unidiomatic-typecheck
            or type(algorithm) is not str or type(block) is not int or block <= 0
            or type(digests) is not list or not naturals(offset)):  # pylint: disable=unidiomatic-typecheck
        return None
    for digest in digests:
        if not is_digest(digest):
            return None
    offset = tuple(offset)
    # The records of checked fields, built without their frozen __init__ (see _new_object above).
    checksum = _new_object(ChunkChecksum)
    _set_algorithm(checksum, shared.setdefault(algorithm, algorithm))
    _set_block_bytes(checksum, block)
    _set_digests(checksum, tuple(digests))
    _set_block_shape(checksum, ())
    _set_flat_digests(checksum, ())
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


def _check_digests(digests: list, where: str, fqn: str, member: str) -> None:
    """Refuse a digest list member that is not 16 lowercase hex digits, naming the entry, key and member."""
    for position, value in enumerate(digests):
        if not is_digest(value):
            raise CorruptCheckpointError(
                f"{where}: malformed checksum for key '{fqn}': {member}[{position}] is {value!r:.40}, not 16 "
                "lowercase hex digits"
            )


def _flat_digests(raw: Any, where: str, fqn: str, block_shape: tuple[int, ...]) -> tuple[str, ...]:
    """The ``flat_digests`` member of a checksum (format 2.2; ``()`` when absent or null), checked.

    Raises:
        CorruptCheckpointError: not a list of digests, or given with flat blocks (no ``block_shape``).
    """
    if raw is None:
        return ()
    if type(raw) is not list or not raw:  # pylint: disable=unidiomatic-typecheck
        raise CorruptCheckpointError(f"{where}: malformed checksum for key '{fqn}': flat_digests must be a "
                                     f"non-empty list of digests, got {raw!r:.80}")
    if not block_shape:
        raise CorruptCheckpointError(f"{where}: malformed checksum for key '{fqn}': flat_digests given with flat "
                                     "blocks (they belong to tiled checksums only)")
    _check_digests(raw, where, fqn, "flat_digests")
    return tuple(raw)


def storage_entry(raw: Any, position: int, source: str, shared: dict) -> tuple[MetadataIndex, StorageInfo]:
    """Decode and check entry ``position`` of a ``storage_data`` list; ``shared`` keeps equal strings once.

    Raises:
        CorruptCheckpointError / UnsafeCheckpointError: a field of the wrong type, a path leaving the directory,
            an absurd offset or length, an unknown compression.
    """
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
        if block <= 0 or not isinstance(digests, list):
            raise CorruptCheckpointError(f"{where}: malformed checksum for key '{fqn}'")
        _check_digests(digests, where, fqn, "digests")
        block_shape = _ints(chk.get("block_shape", []), where, "block_shape", minimum=1)
        algorithm = _str(chk.get("algorithm"), where, "algorithm")
        flat = _flat_digests(chk.get("flat_digests"), where, fqn, block_shape)
        # Positional (cheaper per entry): algorithm, block_bytes, digests, block_shape, flat_digests.
        checksum = ChunkChecksum(shared.setdefault(algorithm, algorithm), block, tuple(digests), block_shape, flat)
    compression = raw.get("compression")
    if compression is not None and compression != "zstd":
        raise CorruptCheckpointError(f"{where}: unknown compression {compression!r} for key '{fqn}'")
    # Positional (cheaper per entry): relative_path, offset, length, checksum, compression, raw_length.
    info = StorageInfo(
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




#: The typed field readers, for the other decoders of the format.
read_ints, read_int, read_str = _ints, _int, _str
