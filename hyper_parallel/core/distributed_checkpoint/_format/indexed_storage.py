"""``storage_data`` of an indexed checkpoint: a read-only mapping that loads a rank's index when asked.

The entries of grid tensors live in per-rank index files
(:mod:`.rank_index`). A lookup of ``(key, offset)`` computes the grid index
by division, its holder rank by :class:`.GridHolders`, loads that rank's
index file once (through the opener the reader binds: path confinement and
the size cap are the reader's; length, digest and entries are checked here)
and returns the entry. Iterating loads every index (``hp-ckpt verify``,
``inspect``...). ``len`` is computed without loading anything.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator, Mapping

from hyper_parallel.core.distributed_checkpoint._format.entry_checks import check_chunk_entry, check_disjoint_bytes
from hyper_parallel.core.distributed_checkpoint._format.grid_holders import GridHolders, grid_position
from hyper_parallel.core.distributed_checkpoint._format.rank_index import IndexRecord, decode_rank_index
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError, CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex, StorageInfo, TensorStorageMetadata
from hyper_parallel.platform.dtypes import DTYPE_NAMES

__all__ = ["IndexedStorage"]

_Key = tuple[str, tuple[int, ...]]


class _ByKey:
    """The entries keyed by plain ``(key, offset)`` tuples (what ``consistency.storage_by_key`` returns)."""

    __slots__ = ("_storage",)

    def __init__(self, storage: "IndexedStorage") -> None:
        self._storage = storage

    def get(self, key: _Key, default: StorageInfo | None = None) -> StorageInfo | None:
        """The entry of ``key``; ``default`` if no chunk starts there (a listed chunk without entry raises)."""
        found = self._storage.lookup(key[0], tuple(key[1]))
        return default if found is None else found

    def __len__(self) -> int:
        return len(self._storage)


class IndexedStorage(Mapping[MetadataIndex, StorageInfo]):
    """The storage entries of an indexed checkpoint (docs/format.md section 12.1).

    Args:
        inline: The entries listed in ``metadata.json`` itself (values, tensors that are not grids).
        grids: For each grid tensor, its metadata and chunk holders.
        records: The index files ``metadata.json`` lists.
        save_id: The save's id (index files must name it).
        source: The metadata file, named in errors.
    """

    def __init__(self, *, inline: dict[MetadataIndex, StorageInfo],
                 grids: dict[str, tuple[TensorStorageMetadata, GridHolders]],
                 records: tuple[IndexRecord, ...], save_id: str, source: str) -> None:
        self.inline = inline
        self.grids = grids
        self.records = {record.rank: record for record in records}
        self.save_id = save_id
        self.source = source
        self._opener: Callable[[str, int], bytes] | None = None
        self._loaded: dict[int, dict[_Key, StorageInfo]] = {}
        self._inline_by_file: dict[str, dict[MetadataIndex, StorageInfo]] | None = None
        self._lock = threading.Lock()
        self._count = len(inline) + sum(len(item.chunks) for item, _ in grids.values())

    def bind(self, opener: Callable[[str, int], bytes]) -> None:
        """Set how an index file's bytes are read: ``opener(name, limit)`` returns at most ``limit`` bytes of it
        (confined, size-capped; a file longer than its record is refused without reading it whole). The reader;
        any rank."""
        self._opener = opener

    def __eq__(self, other: object) -> bool:
        """Two indexed storages are equal when their ``metadata.json`` parts are: equal index records (digests
        included) mean equal index files, so nothing is read. Against another mapping, entry by entry."""
        if isinstance(other, IndexedStorage):
            return (self.inline == other.inline and self.grids == other.grids and self.records == other.records
                    and self.save_id == other.save_id)
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]  # a mapping

    def __reduce__(self) -> tuple:
        """Pickles as its metadata.json part (the entries loaded so far stay behind: O(tensors + ranks) bytes), with
        its opener if that pickles (a directory's; a reader's bound method does not, the copy is then unbound)."""
        opener = self._opener if getattr(self._opener, "picklable", False) else None
        return (_restore, (self.inline, self.grids, tuple(self.records.values()), self.save_id, self.source, opener))

    def adopt(self, entries: dict[int, dict[_Key, StorageInfo]]) -> None:
        """Take the entries of each rank's index as already loaded (the writer that encoded them). Coordinator."""
        self._loaded.update(entries)

    def by_key(self) -> _ByKey:
        """A view keyed by plain ``(key, offset)`` tuples."""
        return _ByKey(self)

    def lookup(self, fqn: str, offset: tuple[int, ...]) -> StorageInfo | None:
        """The entry of chunk ``(fqn, offset)``, loading its holder's index once; ``None`` if no item has it.

        Any rank, any thread.

        Raises:
            CorruptCheckpointError: the holder's index is missing, damaged, or lacks the chunk (names the key,
                the rank and the index file).
        """
        info = self.inline.get(MetadataIndex(fqn, offset))
        if info is not None:
            return info
        grid = self.grids.get(fqn)
        if grid is None:
            return None
        item, holders = grid
        position = grid_position(offset, item.chunks[0].sizes, holders.splits)
        if position is None:
            return None
        rank = holders.holder(position)
        info = self._index(rank).get((fqn, offset))
        if info is None:
            raise CorruptCheckpointError(
                f"{self.source}: key '{fqn}' chunk at offset {list(offset)} is held by rank {rank}, but the index "
                f"file {self._file_of(rank)} does not list it: the checkpoint is damaged; restore it from a copy "
                "or load an earlier one")
        return info

    def __getitem__(self, index: MetadataIndex) -> StorageInfo:
        info = self.lookup(index.fqn, tuple(index.offset))
        if info is None:
            raise KeyError(index)
        return info

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[MetadataIndex]:
        self.load_all()
        yield from self.inline
        for rank in sorted(self._loaded):
            for fqn, offset in self._loaded[rank]:
                yield MetadataIndex(fqn, offset)

    def load_all(self) -> None:
        """Load and check every index; then every grid chunk must have its entry. Any rank.

        Raises:
            CorruptCheckpointError: as :meth:`lookup`, or a chunk that no index lists.
        """
        for rank in sorted(self.records):
            self._index(rank)
        found = sum(len(entries) for entries in self._loaded.values())
        if found != self._count - len(self.inline):
            for fqn, (item, holders) in self.grids.items():
                for chunk in item.chunks:
                    rank = holders.holder(grid_position(chunk.offsets, chunk.sizes, holders.splits))
                    if (fqn, chunk.offsets) not in self._loaded.get(rank, {}):
                        self.lookup(fqn, chunk.offsets)  # raises, naming the key, rank and index file

    def _file_of(self, rank: int) -> str:
        record = self.records.get(rank)
        return record.file if record is not None else f"(none listed for rank {rank})"

    def _index(self, rank: int) -> dict[_Key, StorageInfo]:
        loaded = self._loaded.get(rank)
        if loaded is not None:
            return loaded
        with self._lock:
            loaded = self._loaded.get(rank)
            if loaded is None:
                loaded = self._loaded[rank] = self._load(rank)
        return loaded

    def _load(self, rank: int) -> dict[_Key, StorageInfo]:
        record = self.records.get(rank)
        if record is None:
            raise CorruptCheckpointError(
                f"{self.source}: rank {rank} holds chunks of grid tensors but the metadata lists no index file of "
                "it: the checkpoint is damaged; load an earlier one")
        if self._opener is None:
            raise CheckpointValueError(
                f"{self.source}: the index file {record.file} cannot be read: this metadata was decoded without "
                "its checkpoint; read it with dcp.read_metadata(checkpoint_id)")
        source = f"{self.source.rsplit('/', 1)[0]}/{record.file}" if "/" in self.source else record.file
        # One byte past the recorded length tells a longer file (refused by the length check) without reading it.
        entries = decode_rank_index(self._opener(record.file, record.length + 1), record=record, save_id=self.save_id,
                                    source=source, listed_in=self.source)
        prefix = f"r{rank:05d}_"
        for (fqn, offset), info in entries.items():
            where = f"{source}: key '{fqn}'"
            grid = self.grids.get(fqn)
            position = None if grid is None else grid_position(offset, grid[0].chunks[0].sizes, grid[1].splits)
            if position is None or grid[1].holder(position) != rank:
                raise CorruptCheckpointError(
                    f"{where}: the entry at offset {list(offset)} is no chunk of rank {rank} (the metadata gives it "
                    "to another rank, or to no chunk): the index is damaged or forged; load an earlier checkpoint")
            if not info.relative_path.startswith(prefix):
                raise CorruptCheckpointError(
                    f"{where}: data file {info.relative_path} is not a file of rank {rank}; refused")
            item = grid[0]
            check_chunk_entry(info, fqn, offset, item.chunks[0].sizes, DTYPE_NAMES[item.properties.dtype], where)
        self._check_disjoint(entries, source)
        return entries

    def _check_disjoint(self, entries: dict[_Key, StorageInfo], source: str) -> None:
        """No two items share a byte: the entries of this index, and the in-line entries of its files."""
        if self._inline_by_file is None:
            by_file: dict[str, dict[MetadataIndex, StorageInfo]] = {}
            for index, info in self.inline.items():
                by_file.setdefault(info.relative_path, {})[index] = info
            self._inline_by_file = by_file
        combined = {MetadataIndex(fqn, offset): info for (fqn, offset), info in entries.items()}
        for path in {info.relative_path for info in entries.values()}:
            combined.update(self._inline_by_file.get(path, {}))
        check_disjoint_bytes(combined, source)


def _restore(inline: dict, grids: dict, records: tuple, save_id: str, source: str,
             opener: Callable[[str, int], bytes] | None) -> IndexedStorage:
    """An :class:`IndexedStorage` from its pickled parts."""
    storage = IndexedStorage(inline=inline, grids=grids, records=records, save_id=save_id, source=source)
    if opener is not None:
        storage.bind(opener)
    return storage
