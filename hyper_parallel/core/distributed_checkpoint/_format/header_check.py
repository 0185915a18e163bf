"""Cross-check a data file's safetensors header against what the metadata says it holds.

The metadata is the authority a load follows, and the checksums it records
prove only that the bytes are the ones the save wrote. A metadata entry that
names another dtype of the same size (float32 for int32 bytes), another shape
of the same byte count, or bytes at another position would still load, as
the wrong values. Every data file also describes its items in its own
safetensors header (docs/format.md, section "data files"): the load reads
each touched file's header once (one small read) and refuses an item whose
name, dtype, shape or byte range there differs from the metadata's, before
any target changes. ``hp-ckpt verify`` uses the same rules for every item.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import (
    SAFETENSORS_DTYPES,
    header_json,
    read_header_at,
)
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError, CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
)

__all__ = ["HeaderSpan", "expected_span", "header_entries", "header_is_exactly", "header_spans", "span_problem"]

#: Keys named in a message about a file whose header cannot be read.
_SHOWN_KEYS = 5
#: How every header this package writes starts (``safetensors_file.header_json``).
_HEAD = '{"__metadata__":'
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class HeaderSpan:
    """One item as a data file's header describes it (or as the metadata expects it).

    Attributes:
        length: Bytes of the item.
        name: The header entry's name (``key`` for a whole tensor, ``key@o0,o1`` for a shard).
        dtype: The safetensors dtype code (``U8`` for stored values and compressed items).
        shape: The entry's shape.
    """

    length: int
    name: str
    dtype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        """``'name' (F32, shape [2, 3], 24 bytes)``, for messages."""
        return f"'{self.name}' ({self.dtype}, shape {list(self.shape)}, {self.length} bytes)"


def expected_span(
    index: MetadataIndex,
    info: StorageInfo,
    stored: TensorStorageMetadata | BytesStorageMetadata | None,
    sizes: tuple[int, ...] | None,
) -> HeaderSpan:
    """The header entry the writer gives one stored item. Any rank; pure.

    Args:
        index: The item's key and chunk offset.
        info: Where the metadata says its bytes are.
        stored: The metadata's description of the key.
        sizes: The chunk's sizes (tensor chunks; ``None`` otherwise).
    """
    if isinstance(stored, TensorStorageMetadata):
        shape = tuple(sizes or ())
        whole = shape == tuple(stored.size)
        dtype = SAFETENSORS_DTYPES.get(stored.properties.dtype, "?")
    else:
        whole, dtype, shape = False, "U8", (info.length,)
    if info.compression:  # compressed items are U8 arrays of their compressed bytes
        dtype, shape = "U8", (info.length,)
    if whole or not index.offset:
        return HeaderSpan(info.length, index.fqn, dtype, shape)
    return HeaderSpan(info.length, f"{index.fqn}@{','.join(str(o) for o in index.offset)}", dtype, shape)


def header_spans(
    path: str, size: int, pread: Callable[[int, int], bytes], *, keys: list[str]
) -> dict[int, HeaderSpan]:
    """Read a data file's header: ``{absolute byte offset: entry}``. Any rank; one small read.

    Args:
        path: The file, for messages.
        size: Its size in bytes.
        pread: Returns up to ``count`` bytes from byte ``offset``.
        keys: Keys the caller needs from the file, named when the header is unreadable.

    Raises:
        CorruptCheckpointError: the header is too large, not JSON, or does not
            tile the file's data region (names the file and keys).
    """
    return {start: HeaderSpan(*entry) for start, entry in header_entries(path, size, pread, keys=keys).items()}


def header_entries(
    path: str, size: int, pread: Callable[[int, int], bytes], *, keys: list[str]
) -> dict[int, tuple[int, str, str, tuple[int, ...]]]:
    """:func:`header_spans` as plain tuples ``(length, name, dtype, shape)`` (the fields of a
    :class:`HeaderSpan`, cheaper for a file of thousands of entries). Any rank; one small read.

    Raises:
        CorruptCheckpointError: as :func:`header_spans`.
    """
    try:
        header, data_start, _ = read_header_at(path, size, pread)
    except CheckpointError as exc:
        shown = ", ".join(f"'{key}'" for key in sorted(set(keys))[:_SHOWN_KEYS])
        raise CorruptCheckpointError(
            f"{exc} (the file holds key(s) {shown}); nothing was loaded from it. Run `hp-ckpt verify` on the "
            "checkpoint to list every damaged file"
        ) from None
    entries = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        entries[data_start + begin] = (end - begin, name, entry["dtype"], tuple(entry["shape"]))
    return entries


def _same_entry(found: HeaderSpan, expected: HeaderSpan) -> bool:
    """Equal, allowing the ``#`` suffixes the writer appends to keep names unique in a file (section 4)."""
    suffix = found.name[len(expected.name):]
    return (found.name.startswith(expected.name) and set(suffix) <= {"#"}
            and (found.length, found.dtype, found.shape) == (expected.length, expected.dtype, expected.shape))


def span_problem(spans: dict[int, HeaderSpan], offset: int, expected: HeaderSpan) -> str | None:
    """What differs between the metadata's item at ``offset`` and the file's header, or ``None``. Pure."""
    found = spans.get(offset)
    if found is not None and _same_entry(found, expected):
        return None
    there = f"an entry {found.describe()}" if found is not None else "no entry starting"
    return f"the metadata says {expected.describe()} at byte {offset}, the file's safetensors header has {there} there"


def header_is_exactly(text: bytes, size: int, rows: list[tuple[int, int, str, str, tuple[int, ...]]]) -> bool:
    """Whether a data file's header is byte for byte the one the writer makes for ``rows``, which tile the file.

    The bulk form of the header check, for a file whose every item a load
    reads (one comparison of the whole text instead of parsing it and
    comparing entry by entry). ``True`` proves every row: the file's header
    has exactly these entries, with these names, dtypes, shapes and byte
    ranges, and nothing else, and they fill the file's data region. ``False``
    proves nothing (another writer's spelling, a name with ``#`` suffixes, a
    partial read, a damaged header): the caller then checks entry by entry
    and names what differs. Any rank; pure.

    Args:
        text: The file's raw header (``safetensors_file.read_header_text``).
        size: The file's size in bytes.
        rows: ``(absolute byte offset, length, name, safetensors dtype code, shape)`` of every item, sorted.
    """
    try:
        header = text.decode("ascii").rstrip(" ")  # the writer escapes every non-ASCII character
        if not header.startswith(_HEAD):
            return False
        file_metadata, _ = _DECODER.raw_decode(header, len(_HEAD))
    except ValueError:
        return False
    # pylint: disable-next=unidiomatic-typecheck
    if type(file_metadata) is not dict or not all(type(v) is str for v in file_metadata.values()):
        return False
    data_start = 8 + len(text)
    position = 0
    entries = []
    for offset, length, name, code, shape in rows:
        if offset - data_start != position or code is None:
            return False
        entries.append((name, code, shape, position, position + length))
        position += length
    return data_start + position == size and header_json(file_metadata, entries) == header
