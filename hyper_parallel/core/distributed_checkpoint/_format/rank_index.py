"""A rank's storage index file: the ``storage_data`` entries of the chunks one rank stored.

In the indexed form of the metadata (docs/format.md section 12.1) the
storage entries of grid tensors are not in ``metadata.json`` but in one small
JSON file per rank, ``r<rank:05d>_index.<save id>.json``, beside that rank's
data files. ``metadata.json`` lists each index file with its byte length and
the xxh3-64 digest of its bytes (:class:`IndexRecord`), so every digest a load
trusts is reached from the committed metadata. The entries use exactly the
``storage_data`` entry schema (section 6.2) and its decoder.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable

from hyper_parallel.core.distributed_checkpoint._format.checksum import digest
from hyper_parallel.core.distributed_checkpoint._format.storage_entry import (
    storage_entry_from_json,
    storage_entry_to_json,
)
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex, StorageInfo

__all__ = [
    "INDEX_FORMAT_NAME",
    "MAX_INDEX_BYTES",
    "IndexRecord",
    "index_file_name",
    "encode_rank_index",
    "decode_rank_index",
    "records_to_json",
    "records_from_json",
]

#: Value of an index file's ``"format"`` member.
INDEX_FORMAT_NAME = "hyper_parallel.distributed_checkpoint.rank_index"
#: Largest index file a reader accepts (larger is refused as hostile).
MAX_INDEX_BYTES = 1 << 30
_DIGEST = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True, slots=True)
class IndexRecord:
    """What ``metadata.json`` says of one rank's index file.

    Attributes:
        rank: The rank whose chunks the file lists.
        file: Its name, :func:`index_file_name` of the rank and the save id.
        length: Its size in bytes.
        digest: xxh3-64 hex digest of its bytes.
    """

    rank: int
    file: str
    length: int
    digest: str


def index_file_name(rank: int, save_id: str) -> str:
    """The index file name of ``rank`` in save ``save_id``."""
    return f"r{rank:05d}_index.{save_id}.json"


def encode_rank_index(
    *, save_id: str, rank: int, entries: Iterable[tuple[MetadataIndex, StorageInfo]]
) -> tuple[bytes, IndexRecord]:
    """The bytes of ``rank``'s index file and its record. Called by the rank that writes the file; pure."""
    document = {
        "format": INDEX_FORMAT_NAME,
        "save_id": save_id,
        "rank": rank,
        "storage_data": [storage_entry_to_json(index, info) for index, info in entries],
    }
    data = json.dumps(document, separators=(",", ":")).encode("utf-8")
    return data, IndexRecord(rank=rank, file=index_file_name(rank, save_id), length=len(data), digest=digest(data))


def decode_rank_index(data: bytes, *, record: IndexRecord, save_id: str, source: str,
                      listed_in: str = "the metadata") -> dict[tuple[str, tuple[int, ...]], StorageInfo]:
    """Check ``data`` against its record and decode its entries, keyed by ``(key, offset)``. Any rank; pure.

    ``source`` (the index file) and ``listed_in`` (the metadata file recording it) are named in errors.

    Raises:
        UnsafeCheckpointError: over :data:`MAX_INDEX_BYTES`.
        CorruptCheckpointError: another length or digest than the record's, not an index of this rank and
            save, an entry that does not decode (the usual ``storage_data`` checks), a chunk listed twice.
    """
    if len(data) > MAX_INDEX_BYTES:
        raise UnsafeCheckpointError(f"{source}: index file of {len(data):,} bytes is larger than allowed; refused")
    if len(data) != record.length or digest(data) != record.digest:
        raise CorruptCheckpointError(
            f"{source}: the index file of rank {record.rank} does not match its length and digest recorded in "
            f"{listed_in} (one of the two is damaged or replaced): restore the checkpoint from a copy, or load an "
            "earlier one")
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{source}: not a valid index file ({exc})") from exc
    # pylint: disable-next=unidiomatic-typecheck
    if (type(document) is not dict or document.get("format") != INDEX_FORMAT_NAME
            or document.get("save_id") != save_id or document.get("rank") != record.rank):
        raise CorruptCheckpointError(f"{source}: not the index file of rank {record.rank} of save {save_id}")
    raw_entries = document.get("storage_data")
    if type(raw_entries) is not list:  # pylint: disable=unidiomatic-typecheck
        raise CorruptCheckpointError(f"{source}: storage_data must be a list")
    entries: dict[tuple[str, tuple[int, ...]], StorageInfo] = {}
    for position, raw in enumerate(raw_entries):
        index, info = storage_entry_from_json(raw, position=position, source=source)
        key = (index.fqn, tuple(index.offset))
        if key in entries:
            raise CorruptCheckpointError(f"{source}: key '{index.fqn}' at offset {list(index.offset)} is listed twice")
        entries[key] = info
    return entries


def records_to_json(records: Iterable[IndexRecord]) -> list[dict[str, Any]]:
    """The ``rank_indexes`` member of ``metadata.json``."""
    return [{"rank": r.rank, "file": r.file, "length": r.length, "digest": r.digest} for r in records]


def records_from_json(raw: Any, *, save_id: str, world_size: int, source: str) -> tuple[IndexRecord, ...]:
    """Decode and check ``rank_indexes``: each rank once, within the world, named by the rule. Any rank; pure.

    Raises:
        CorruptCheckpointError: a member of the wrong type, a rank twice or outside the world, another name.
    """
    if type(raw) is not list:  # pylint: disable=unidiomatic-typecheck
        raise CorruptCheckpointError(f"{source}: rank_indexes must be a list")
    records = []
    seen: set[int] = set()
    for position, item in enumerate(raw):
        where = f"{source}: rank_indexes[{position}]"
        if type(item) is not dict:  # pylint: disable=unidiomatic-typecheck
            raise CorruptCheckpointError(f"{where}: expected an object")
        rank, name, length, hexdigest = item.get("rank"), item.get("file"), item.get("length"), item.get("digest")
        if type(rank) is not int or not 0 <= rank < world_size or rank in seen:  # pylint: disable=unidiomatic-typecheck
            raise CorruptCheckpointError(f"{where}: rank {rank!r} is not a new rank of the save's {world_size}")
        if name != index_file_name(rank, save_id):
            raise UnsafeCheckpointError(
                f"{where}: index file {name!r} is not named {index_file_name(rank, save_id)!r}; refused")
        if type(length) is not int or not 0 <= length <= MAX_INDEX_BYTES:  # pylint: disable=unidiomatic-typecheck
            raise CorruptCheckpointError(f"{where}: length must be an integer up to {MAX_INDEX_BYTES}")
        if type(hexdigest) is not str or not _DIGEST.match(hexdigest):  # pylint: disable=unidiomatic-typecheck
            raise CorruptCheckpointError(f"{where}: digest must be 16 lowercase hex digits")
        seen.add(rank)
        records.append(IndexRecord(rank=rank, file=name, length=length, digest=hexdigest))
    return tuple(records)
