"""What a load knows of each read item, looked up once; small whole chunks read many per system call.

A reader's passes over a plan (header check, verify, read) all need the same
facts of every item: its storage entry, the stored key, the chunk's sizes,
the bytes it reads. :class:`ItemFacts` looks them up once per item and load,
so a state of thousands of small tensors pays for each lookup once, not once
per pass. :func:`read_small_whole` reads the items that are whole small chunks
of a file with one ``preadv`` per run of adjacent chunks, straight into their
targets.
"""

from __future__ import annotations

import math
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.checksum import ALGORITHM
from hyper_parallel.core.distributed_checkpoint._format.consistency import storage_by_key
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import SAFETENSORS_DTYPES
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlanner, ReadItem
from hyper_parallel.core.distributed_checkpoint._whole_reads import SMALL_WHOLE_BYTES, WholeReads
from hyper_parallel.platform.dtypes import DTYPE_NAMES, numpy_dtype

__all__ = ["ColumnRow", "ItemFacts", "ItemIndex", "SMALL_ITEM_BYTES", "read_columns", "read_small_whole",
           "stored_dtype"]

#: Whole chunks up to this size (one flat checksum block) are read many per system call.
SMALL_ITEM_BYTES = SMALL_WHOLE_BYTES
#: Most buffers in one ``preadv`` (Linux ``IOV_MAX``).
_IOV_MAX = 1024


#: :func:`numpy_dtype` of a stored dtype name (itself cached per name).
stored_dtype = numpy_dtype


class ItemFacts(NamedTuple):
    """What the reader needs of one read item (immutable; a typed tuple: one is made per item and load, at a
    quarter of a frozen dataclass's cost).

    Attributes:
        info: The storage entry of the item's chunk.
        stored: The metadata's entry of the item's key (``None`` if it has none).
        sizes: The stored chunk's sizes when the key is a tensor; ``None`` otherwise.
        itemsize: Bytes per element of the stored dtype (1 for values).
        nbytes: Bytes the item reads (stored bytes for values and compressed chunks).
        small: A tensor chunk of at most :data:`SMALL_ITEM_BYTES`, uncompressed, with a
            known checksum algorithm, read whole: :func:`read_small_whole` reads it.
    """

    info: StorageInfo
    stored: Any
    sizes: tuple[int, ...] | None
    itemsize: int
    nbytes: int
    small: bool


class ColumnRow(NamedTuple):
    """One whole read of a plan's columns (:class:`._whole_reads.WholeReads`), with its storage entry.

    Attributes:
        offset: Byte offset of the chunk in its data file (``info.offset``).
        length: Its stored length (``info.length``; the target's bytes).
        fqn: The key.
        code: The safetensors dtype code of its stored dtype (``None`` if it has none).
        sizes: The chunk's sizes (the key's shape). The first five fields are the header entry the writer
            makes for the chunk (see ``_reader_headers``).
        view: The target's memory (writable, C-contiguous, of the stored dtype).
        info: The chunk's storage entry.
        stored: The key's item in the metadata.
    """

    offset: int
    length: int
    fqn: str
    code: str | None
    sizes: tuple[int, ...]
    view: np.ndarray
    info: StorageInfo
    stored: Any


_TENSOR = LoadItemType.TENSOR
_new_tuple = tuple.__new__  # ItemFacts(...) without its Python-level __new__
_FIRST, _LENGTH, _TARGET = itemgetter(0), itemgetter(1), itemgetter(3)  # a batch entry's offset, length, target


class ItemIndex:
    """The facts of one load's read items, each looked up once (reader threads share it).

    Args:
        metadata: The checkpoint's metadata (checked by ``check_consistency``).
        by_key: Its storage entries by ``(key, offset)`` (``consistency.storage_by_key``), if known.
        whole: ``check_consistency``'s ``whole`` table of the same metadata, if known: the facts of an item
            reading such a key whole are looked up by its key alone.
    """

    def __init__(self, metadata: Metadata, *, by_key: dict[tuple[str, tuple[int, ...]], StorageInfo] | None = None,
                 whole: dict[str, tuple[tuple[int, ...], StorageInfo, Any]] | None = None) -> None:
        self.metadata = metadata
        # key -> (chunk offsets, storage entry, item) of the keys stored whole, as check_consistency found them
        self._whole = whole if whole is not None else {}
        self._facts: dict[int, tuple[ReadItem, ItemFacts]] = {}  # id(item) -> (item, its facts)
        self._by_key = by_key if by_key is not None else storage_by_key(metadata)  # (key, offset) -> storage entry
        self._chunks: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}  # fqn -> chunk offsets -> sizes
        self._lists: dict[int, tuple[list[ReadItem], list[ItemFacts]]] = {}  # id(a by_file list) -> it, its facts

    def facts(self, item: ReadItem) -> ItemFacts:
        """The facts of ``item`` (a dict write is atomic across reading threads).

        Raises:
            CorruptCheckpointError: no storage entry or no chunk for the item (names the key and offset).
        """
        hit = self._facts.get(id(item))
        if hit is not None and hit[0] is item:
            return hit[1]
        return self._new_facts(item)

    def by_file(self, items: tuple[ReadItem, ...] | list[ReadItem], *, skip: set[int] | None = None) -> dict[str, list[ReadItem]]:
        """``items`` grouped by data file, in plan order within a file; items whose ``id`` is in ``skip`` left out.

        Raises:
            CorruptCheckpointError: as :meth:`facts`.
        """
        pairs: dict[str, tuple[list[ReadItem], list[ItemFacts]]] = {}  # file -> its items and their facts, in order
        cached = self._facts.get if self._facts else None  # (none known yet: the usual first pass)
        new_facts = self._new_facts
        for item in items:
            if skip is not None and id(item) in skip:
                continue
            hit = cached(id(item)) if cached is not None else None
            facts = hit[1] if hit is not None and hit[0] is item else new_facts(item)
            relative_path = facts.info.relative_path
            pair = pairs.get(relative_path)
            if pair is None:
                pairs[relative_path] = ([item], [facts])
            else:
                pair[0].append(item)
                pair[1].append(facts)
        groups: dict[str, list[ReadItem]] = {}
        for relative_path, pair in pairs.items():  # the lists live as long as this index: ids stay unique
            groups[relative_path] = pair[0]
            self._lists[id(pair[0])] = pair
        return groups

    def facts_list(self, items: list[ReadItem]) -> list[ItemFacts]:
        """The facts of ``items`` in order: kept from :meth:`by_file` when ``items`` is one of its lists.

        Raises:
            CorruptCheckpointError: as :meth:`facts`.
        """
        hit = self._lists.get(id(items))
        if hit is not None and hit[0] is items:
            return hit[1]
        return [self.facts(item) for item in items]

    def _new_facts(self, item: ReadItem) -> ItemFacts:
        index = item.storage_index
        hit = self._whole.get(index.fqn)
        if hit is not None and item.type is _TENSOR and index.offset == hit[0]:
            # A key stored as one whole chunk (check_consistency checked its entry: uncompressed, its length,
            # flat checksum blocks), read whole: the usual item.
            stored = hit[2]
            sizes = stored.size
            if item.lengths == sizes and type(sizes) is tuple and not any(item.storage_offsets):  # pylint: disable=unidiomatic-typecheck
                info = hit[1]
                length = info.length
                facts = _new_tuple(ItemFacts, (info, stored, sizes, DTYPE_NAMES[stored.properties.dtype], length,
                                               length <= SMALL_ITEM_BYTES))
                self._facts[id(item)] = (item, facts)
                return facts
        offset = index.offset if type(index.offset) is tuple else tuple(index.offset)  # pylint: disable=unidiomatic-typecheck
        info = self._by_key.get((index.fqn, offset))
        if info is None:
            info = self.info(index)
        stored = self.metadata.state_dict_metadata.get(index.fqn)
        if isinstance(stored, TensorStorageMetadata):
            chunks = stored.chunks
            if len(chunks) == 1 and chunks[0].offsets == offset and type(chunks[0].sizes) is tuple:  # pylint: disable=unidiomatic-typecheck
                sizes = chunks[0].sizes  # most keys: one chunk
            else:
                sizes = self.chunk_sizes(stored, index)
            itemsize = DTYPE_NAMES.get(stored.properties.dtype, 1)
        else:
            sizes, itemsize = None, 1
        kind = item.type
        tensor = kind is not LoadItemType.BYTE_IO and sizes is not None and not info.compression
        lengths = item.lengths
        nbytes = math.prod(lengths) * itemsize if tensor else info.length
        checksum = info.checksum
        small = (
            tensor
            and kind is LoadItemType.TENSOR
            and info.length <= SMALL_ITEM_BYTES
            and info.length == nbytes
            and (checksum is None or checksum.algorithm == ALGORITHM)
            and (lengths if type(lengths) is tuple else tuple(lengths)) == sizes
            and not any(item.storage_offsets)
        )
        facts = _new_tuple(ItemFacts, (info, stored, sizes, itemsize, nbytes, small))  # the fields in order
        self._facts[id(item)] = (item, facts)  # holding the item keeps its id unique
        return facts

    def columns_by_file(self, whole: WholeReads) -> tuple[dict[str, list[ColumnRow]], list[int]]:
        """The rows of ``whole`` by data file (in row order), and the rows that are no small whole chunk of a
        key stored whole (unusual: a compressed chunk, tile checksums, another chunk; read as items)."""
        table = self._whole
        files: dict[str, list[ColumnRow]] = {}
        others: list[int] = []
        for row, (fqn, offsets, sizes, view) in enumerate(whole.rows):
            hit = table.get(fqn)
            # check_consistency checked such a key's entry: uncompressed, flat checksum blocks, its length.
            if hit is None or hit[0] != offsets or hit[2].size != sizes or hit[1].length > SMALL_ITEM_BYTES:
                others.append(row)
                continue
            info, stored = hit[1], hit[2]
            rows = files.get(info.relative_path)
            if rows is None:
                rows = files[info.relative_path] = []
            rows.append(_new_tuple(ColumnRow, (info.offset, info.length, fqn, SAFETENSORS_DTYPES.get(
                stored.properties.dtype), sizes, view, info, stored)))
        return files, others

    def info(self, index: MetadataIndex) -> StorageInfo:
        """The storage entry of chunk ``index``.

        Raises:
            CorruptCheckpointError: the metadata has none (names the key and offset).
        """
        info = self._by_key.get((index.fqn, tuple(index.offset)))
        if info is None:
            raise CorruptCheckpointError(
                f"key '{index.fqn}': chunk at offset {list(index.offset)} has no storage entry in the metadata"
            )
        return info

    def chunk_sizes(self, stored: TensorStorageMetadata, index: MetadataIndex) -> tuple[int, ...]:
        """The sizes of the stored chunk at ``index``.

        Raises:
            CorruptCheckpointError: the key has no chunk there.
        """
        offset = index.offset if type(index.offset) is tuple else tuple(index.offset)
        chunks = stored.chunks
        if len(chunks) == 1 and chunks[0].offsets == offset:  # most keys: one chunk, no table
            return tuple(chunks[0].sizes)
        table = self._chunks.get(index.fqn)
        if table is None:
            table = self._chunks[index.fqn] = {tuple(chunk.offsets): tuple(chunk.sizes) for chunk in chunks}
        sizes = table.get(offset)
        if sizes is None:
            raise CorruptCheckpointError(f"key '{index.fqn}': no chunk at offset {list(index.offset)}")
        return sizes


def read_small_whole(
    source: Any,
    path: Path | str,
    file_size: int,
    items: list[ReadItem],
    index: ItemIndex,
    planner: LoadPlanner,
    *,
    verified: bool,
    facts: list[ItemFacts] | None = None,
) -> tuple[int, list[tuple[ReadItem, np.ndarray | None]]]:
    """Read the small whole chunks of ``items`` (one file) many per system call, straight into their targets.

    A chunk qualifies when :attr:`ItemFacts.small` holds, it lies inside the
    file, and its target region is contiguous, writable and of the stored
    dtype. A target the planner names in its ``direct_targets()``
    is read into as it is, without ``acquire_tensor`` / ``apply_tensor``; the
    others are asked for. Chunks adjacent in the file are read by one ``preadv`` (one buffer
    per target, up to ``IOV_MAX``). The bytes must be verified before (the
    verify pass) when the load verifies. Called by the reader, per file.

    Args:
        verified: The chunks with checksums were verified and counted by the verify pass.
        facts: The facts of ``items`` in order, when the caller has them.

    Returns:
        The bytes read (not counting verified ones) and the other items, each
        with its target when it was acquired already (``None`` otherwise).

    Raises:
        CorruptCheckpointError: the file ends early (names the file and key).
    """
    # Offset, length, item, target, whether the planner is told (apply_tensor), whether the item has a checksum.
    batch: list[tuple[int, int, ReadItem, np.ndarray, bool, bool]] = []
    rest: list[tuple[ReadItem, np.ndarray | None]] = []
    applied = False  # some target was acquired (apply_tensor follows its read)
    hook = getattr(planner, "direct_targets", None)  # a planner not derived from LoadPlanner may lack it
    direct = hook() if hook is not None else {}  # targets known writable, contiguous, of the stored dtype
    for item, facts in zip(items, facts if facts is not None else index.facts_list(items)):
        info = facts.info
        if not facts.small or info.offset + info.length > file_size:
            rest.append((item, None))
            continue
        hit = direct.get(id(item))
        if hit is not None and hit[0] is item:
            batch.append((info.offset, info.length, item, hit[1], False, info.checksum is not None))
            continue
        dest = planner.acquire_tensor(item)
        flags = dest.flags
        if dest.dtype != stored_dtype(facts.stored.properties.dtype) or not (flags.c_contiguous and flags.writeable):
            rest.append((item, dest))
            continue
        batch.append((info.offset, info.length, item, dest, True, info.checksum is not None))
        applied = True
    _read_sorted(source, path, batch, _TARGET, lambda entry: entry[2].storage_index.fqn)
    if applied:  # a target acquired from the planner is handed back once read
        for _, _, item, dest, apply, _ in batch:
            if apply:
                planner.apply_tensor(item, dest)
    if not verified:
        return sum(map(_LENGTH, batch)), rest
    return sum(entry[1] for entry in batch if not entry[5]), rest  # verified bytes were counted by the verify pass


def read_columns(source: Any, path: Path | str, rows: list[ColumnRow], *, verified: bool) -> int:
    """Read a file's whole reads kept as columns straight into their targets, one ``preadv`` per run of adjacent
    chunks (up to ``IOV_MAX`` buffers). The header check passed for them (each lies in the file, as its header
    says); with ``verified``, the verify pass verified those with checksums. Called by the reader, per file.

    Returns:
        The bytes read (not counting verified ones).

    Raises:
        CorruptCheckpointError: the file ends early (names the file and key).
    """
    _read_sorted(source, path, list(rows), _VIEW, _FQN)
    if not verified:
        return sum(map(_LENGTH, rows))
    return sum(row.length for row in rows if row.info.checksum is None)


_FQN, _VIEW = itemgetter(2), itemgetter(5)  # a ColumnRow's key and target


def _read_sorted(source: Any, path: Path | str, batch: list[tuple], target_of: Any, fqn_of: Any) -> None:
    """Read ``batch`` (tuples of file offset, length, ...; ``target_of(entry)`` the array to fill) sorted by
    offset: one ``preadv`` per run of adjacent chunks, up to ``IOV_MAX`` buffers.

    Raises:
        CorruptCheckpointError: the file ends early (names the file and the key ``fqn_of(entry)``).
    """
    batch.sort(key=_FIRST)
    start = 0
    count = len(batch)
    while start < count:
        end = start + 1
        following = batch[start][0] + batch[start][1]
        while end < count and end - start < _IOV_MAX and batch[end][0] == following:
            following += batch[end][1]
            end += 1
        group = batch[start:end]
        length = following - group[0][0]
        if length and source.readinto_many(list(map(target_of, group)), group[0][0]) != length:
            raise CorruptCheckpointError(f"data file {path} is truncated while reading key '{fqn_of(group[0])}'")
        start = end
