"""Columnar decode of the metadata's regular entries: a run of them per regular-expression call, no JSON tree.

Almost every ``state_dict_metadata`` member and ``storage_data`` entry this
package writes has one fixed form (a tensor item's dtype, size and chunk
lists; a storage entry with one flat checksum block). A window of such
entries is matched by one ``findall`` of a pattern for that form, the
fields come back as columns of strings, and the records are built column by
column in C loops (``map`` over the record classes' slot setters), instead
of a JSON object per entry and Python per field. What varies little is
decoded once per distinct text (a dtype-shape-chunks text, a file name, an
offset list) by the full checks of :mod:`.metadata_json`, whose decoders are
passed in. An entry of another form in the window (a value, tile checksums,
compression) is matched as a whole object and decoded by those full checks,
in its place.

The pattern admits only the writer's compact spelling of valid JSON, and a
third alternative captures the rest of the window from any other character
on (one match, not a tuple per character), so a window either decodes
exactly as the JSON decoder would read it, or the run is given up
(``None``) and :mod:`.metadata_json` decodes the whole member again by its
streaming path, which also raises the error (the run never raises one
itself). The caller first checks (:func:`plain_text`) that the text holds
no backslash and no control character, so a string's text is its value.
"""

from __future__ import annotations

import json
import mmap
import re
from collections import deque
from itertools import compress, count, repeat
from operator import not_
from typing import Any, Callable, NamedTuple

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.checksum import ALGORITHM
from hyper_parallel.core.distributed_checkpoint._format.json_stream import Cursor
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    ChunkChecksum,
    MetadataIndex,
    StorageInfo,
)

__all__ = ["plain_text", "items_by_runs", "storage_by_runs", "items_run", "storage_run", "StorageRows"]

#: Characters per window (a bounded batch: the columns of one window are alive at a time).
_WINDOW = 1 << 16
#: The longest window: a text with no entry boundary for this long is not decoded by runs.
_WINDOW_MAX = 1 << 20
_NUMBER = r"(0|[1-9][0-9]*)"
_ITEM = re.compile(
    r',"([^"]*)":\{"kind":"tensor","dtype":"([^"]*","size":\[[0-9,]*\],"chunks":\[\[\[[0-9,]*\],\[[0-9,]*\]\]'
    r'(?:,\[\[[0-9,]*\],\[[0-9,]*\]\])*\])\}'
    r'|,("[^"]*":\{[^{}]*\})'  # any other member (a value's), decoded whole
    r"|([\s\S]+)"  # anything else: not the writer's form, the run is given up (one match: the rest of the window)
)
_ENTRY = re.compile(
    r',\{"fqn":"([^"]*)","offset":\[([0-9,]*)\],"file":"([^"]*)","byte_offset":' + _NUMBER + ',"length":' + _NUMBER
    + r',"checksum":\{"algorithm":"xxh3_64","block_bytes":' + _NUMBER + r',"digests":\["([0-9a-f]{16})"\]\}\}'
    r'|,(\{"fqn":[^{}]*(?:\{[^{}]*\}[^{}]*)*\})'  # any other entry (tiles, compression, blocks), decoded whole
    r"|([\s\S]+)"
)
_new_object = object.__new__
# The usual entry's three records, built by setting their slots (a frozen dataclass's __init__ costs about
# twice as much; none of these classes has a __post_init__). tests/test_metadata_runs.py checks the records
# equal those of the full decode.
_CHECKSUM_SLOTS = (ChunkChecksum.algorithm.__set__, ChunkChecksum.block_bytes.__set__, ChunkChecksum.digests.__set__,
                   ChunkChecksum.block_shape.__set__, ChunkChecksum.flat_digests.__set__)
_INFO_SLOTS = (StorageInfo.relative_path.__set__, StorageInfo.offset.__set__, StorageInfo.length.__set__,
               StorageInfo.checksum.__set__, StorageInfo.compression.__set__, StorageInfo.raw_length.__set__)
_INDEX_SLOTS = (MetadataIndex.fqn.__set__, MetadataIndex.offset.__set__, MetadataIndex.index.__set__)


def plain_text(data: bytes | bytearray | mmap.mmap) -> bool:
    """Whether ``data`` holds no control character and no backslash (every JSON string in it is its own text)."""
    if not data or data.find(b"\\") >= 0:
        return False
    codes = np.frombuffer(data, np.uint8)
    try:
        return int(codes.min()) >= 0x20
    finally:
        del codes  # an mmap can be closed only once no view of it is left


def _windows(text: str, start: int, end: int, boundary: str) -> Any:
    """``(begin, stop)`` windows of about ``_WINDOW`` characters of ``text[start:end]``, each cut before a ``boundary``.

    Raises:
        ValueError: no ``boundary`` within ``_WINDOW_MAX`` characters (an entry that long, or not this form):
            the run is given up, so the columns of one window stay bounded whatever the text.
    """
    while start < end:
        limit = min(end, start + _WINDOW_MAX)
        stop = text.find(boundary, start + _WINDOW, limit)
        if stop < 0 and limit < end:
            raise ValueError(f"no entry boundary within {_WINDOW_MAX} characters")
        stop = end if stop < 0 else stop + 1
        yield start, stop
        start = stop


def _set_all(records: list, setters: tuple, columns: tuple) -> None:
    for setter, column in zip(setters, columns):
        deque(map(setter, records, column), 0)


def _in_order(fast: list, others: tuple, slow: Callable[[str], Any]) -> list:
    """``fast`` (the rows that matched the usual form, in order) with each other row's ``slow`` result in its place."""
    merged: list = []
    taken = 0
    for done, row in enumerate(compress(count(), others)):
        merged += fast[taken : row - done]
        taken = row - done
        merged.append(slow(others[row]))
    merged += fast[taken:]
    return merged


def items_run(text: str, start: int, end: int, shared: dict, item: Callable[[str, Any], Any]) -> dict | None:
    """Decode ``state_dict_metadata``'s members in ``text[start:end]`` (each preceded by its comma); ``None``: give up.

    Args:
        shared: The decode's table of shared strings and tuples (names are kept once through it).
        item: The full decoder of one member (``fqn, raw -> record``); may raise.
    """
    records: dict[str, Any] = {"": None}  # a dtype-shape-chunks text -> its record, decoded once
    items: dict[str, Any] = {}
    setdefault = shared.setdefault

    def other(member: str) -> tuple[str, Any]:
        (fqn, raw), = json.loads("{" + member + "}").items()
        return setdefault(fqn, fqn), item(fqn, raw)

    try:
        for begin, stop in _windows(text, start, end, '},"'):
            names, shapes, others, junk = zip(*_ITEM.findall(text, begin, stop))
            if any(junk):
                return None
            for shape in set(shapes).difference(records):
                records[shape] = item("", json.loads('{"kind":"tensor","dtype":"' + shape + "}"))
            if any(others):
                fast = list(zip(compress(map(setdefault, names, names), map(not_, others)),
                                compress(map(records.__getitem__, shapes), map(not_, others))))
                items.update(_in_order(fast, others, other))
            else:
                items.update(zip(map(setdefault, names, names), map(records.__getitem__, shapes)))
    except (CheckpointError, ValueError, RecursionError, TypeError):
        return None
    return items


def storage_run(text: str, start: int, end: int, shared: dict, entry: Callable[[Any], tuple],
                check_path: Callable[[str], str], max_bytes: int) -> list | None:
    """Decode ``storage_data``'s entries in ``text[start:end]`` (each preceded by its comma); ``None``: give up.

    Returns the ``(MetadataIndex, StorageInfo)`` pairs in order, a window of usual entries only as one
    :class:`StorageRows` in its place (its records made when asked for).

    Args:
        shared: The decode's table of shared strings and tuples.
        entry: The full decoder of one entry (``raw -> (index, info)``); may raise.
        check_path: Checks a data file name (raises for one leaving the directory).
        max_bytes: The largest byte offset or length accepted.
    """
    offsets: dict[str, tuple[int, ...]] = {}
    files: dict[str, str] = {}
    blocks: dict[str, int] = {}
    pairs: list = []
    setdefault = shared.setdefault
    try:
        for begin, stop in _windows(text, start, end, '},{"fqn":'):
            fqns, offset_texts, paths, starts, lengths, block_texts, digests, others, junk = zip(
                *_ENTRY.findall(text, begin, stop))
            if any(junk):
                return None
            if any(others):
                keep = list(map(not_, others))
                fqns, offset_texts, paths, starts, lengths, block_texts, digests = (
                    list(compress(column, keep)) for column in (fqns, offset_texts, paths, starts, lengths,
                                                                 block_texts, digests))
            for text_ in set(offset_texts).difference(offsets):
                values = tuple(json.loads("[" + text_ + "]"))
                offsets[text_] = setdefault(values, values)  # JSON integers >= 0 by the pattern
            for path in set(paths).difference(files):
                files[path] = setdefault(("file", path), check_path(path))
            for block in set(block_texts).difference(blocks):
                blocks[block] = int(block)
                if blocks[block] <= 0:
                    return None
            starts, lengths = list(map(int, starts)), list(map(int, lengths))
            if starts and max(max(starts), max(lengths)) > max_bytes:
                return None
            rows = StorageRows(list(map(setdefault, fqns, fqns)), list(map(offsets.__getitem__, offset_texts)),
                               list(map(files.__getitem__, paths)), starts, lengths,
                               list(map(blocks.__getitem__, block_texts)), digests)
            if any(others):
                pairs += _in_order(rows.pairs(), others, lambda raw: entry(json.loads(raw)))
            else:  # records made when first asked for (see StorageRows)
                pairs.append(rows)
    except (CheckpointError, ValueError, RecursionError, TypeError):
        return None
    return pairs


class StorageRows(NamedTuple):
    """A window of ``storage_data``'s usual entries, decoded and checked, as columns; their records are made by
    :meth:`pairs` (about a third of the decode's time), when the metadata's ``storage_data`` is first asked for.

    Attributes:
        fqns: Each entry's key (shared strings).
        offsets: Its chunk offsets (shared tuples).
        files: Its data file (checked, shared).
        starts: Its byte offset in the file.
        lengths: Its stored length.
        blocks: Its checksum's block size (> 0).
        digests: Its one digest.
    """

    fqns: list[str]
    offsets: list[tuple[int, ...]]
    files: list[str]
    starts: list[int]
    lengths: list[int]
    blocks: list[int]
    digests: tuple[str, ...]

    def keys(self) -> Any:
        """Each entry's ``(key, offsets)``."""
        return zip(self.fqns, self.offsets)

    def infos(self) -> list[StorageInfo]:
        """The ``StorageInfo`` of each entry (its ``ChunkChecksum`` in it), in order: equal to the full decode's."""
        count = len(self.fqns)
        checksums = list(map(_new_object, repeat(ChunkChecksum, count)))
        _set_all(checksums, _CHECKSUM_SLOTS,
                 (repeat(ALGORITHM), self.blocks, zip(self.digests), repeat(()), repeat(())))
        infos = list(map(_new_object, repeat(StorageInfo, count)))
        _set_all(infos, _INFO_SLOTS, (self.files, self.starts, self.lengths, checksums, repeat(None), repeat(None)))
        return infos

    def indexes(self) -> list[MetadataIndex]:
        """The ``MetadataIndex`` of each entry, in order: equal to the full decode's."""
        indexes = list(map(_new_object, repeat(MetadataIndex, len(self.fqns))))
        _set_all(indexes, _INDEX_SLOTS, (self.fqns, self.offsets, repeat(None)))
        return indexes

    def pairs(self) -> list[tuple[MetadataIndex, StorageInfo]]:
        """The ``(MetadataIndex, StorageInfo)`` of each entry, in order: equal to the full decode's."""
        return list(zip(self.indexes(), self.infos()))


def _after_first(cursor: Cursor, marker: str, first: Callable[[], Any], run: Callable[[int, int], Any]) -> Any:
    """``(first(), run(start, end))`` for the member just opened at ``cursor``, which ``marker`` follows; else ``None``.

    ``first`` decodes the first element at the cursor (it may raise); ``run`` the rest up to ``marker``,
    each element after its comma. On success the cursor is past the member's closing character; on
    ``None`` it is back where it was.
    """
    text, start = cursor.text, cursor.position
    end = text.find(marker, start)
    try:
        head = first() if end > start else None
    except CheckpointError:
        head = None
    rest = run(cursor.position, end) if head is not None and cursor.position <= end else None
    if rest is None:
        cursor.position = start
        return None
    cursor.position = end + 1
    return head, rest


def items_by_runs(cursor: Cursor, shared: dict, item: Callable[[str, Any], Any]) -> dict | None:
    """The ``state_dict_metadata`` object just opened, in the writer's form, decoded by runs; else ``None``.

    Args:
        cursor: At the first member (after the ``{``); left past the ``}`` (else where it was).
        shared: The decode's table of shared strings and tuples.
        item: The full decoder of one member (``fqn, raw -> record``); may raise.
    """
    setdefault = shared.setdefault

    def first() -> tuple[str, Any]:
        fqn = cursor.key()
        return setdefault(fqn, fqn), item(fqn, cursor.value())

    found = _after_first(cursor, '},"storage_data":', first,
                         lambda start, end: items_run(cursor.text, start, end, shared, item))
    if found is None:
        return None
    (fqn, record), rest = found
    items = {fqn: record}
    items.update(rest)
    return items


def storage_by_runs(cursor: Cursor, shared: dict, entry: Callable[[Any], tuple], check_path: Callable[[str], str],
                    max_bytes: int) -> list | None:
    """The ``storage_data`` list just opened, in the writer's form, decoded by runs: its (index, info) pairs (and
    :class:`StorageRows`, as :func:`storage_run`'s); else ``None``.

    Args: as :func:`storage_run`; ``cursor`` as :func:`items_by_runs`'.
    """
    found = _after_first(cursor, '],"planner_data":', lambda: entry(cursor.value()),
                         lambda start, end: storage_run(cursor.text, start, end, shared, entry, check_path, max_bytes))
    return None if found is None else [found[0], *found[1]]
