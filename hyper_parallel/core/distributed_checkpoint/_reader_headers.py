"""Each touched data file's safetensors header, checked against the metadata before a byte of it lands."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.header_check import (
    HeaderSpan,
    expected_span,
    header_entries,
    header_is_exactly,
    span_problem,
)
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import SAFETENSORS_DTYPES, read_header_text
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint._read_items import ColumnRow, ItemFacts
from hyper_parallel.core.distributed_checkpoint._whole_reads import whole_read_item
from hyper_parallel.core.distributed_checkpoint._reader_verify import check_within
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.planner import ReadItem

__all__ = ["HeaderCheck"]

#: First read of a data file's header: the writer starts the data region at 4096.
_HEADER_READ_BYTES = 4096


def _writer_row(item: ReadItem, facts: ItemFacts) -> tuple[int, int, str, str | None, tuple[int, ...]] | None:
    """``(offset, length, name, safetensors dtype code, shape)``: the header entry the writer makes for ``item``
    when it is a whole uncompressed tensor chunk (the usual item); ``None`` for a value, a compressed chunk or a
    shard of a tensor (their entries are checked by the full comparison). Its last four fields are in the order of
    a ``header_check.header_entries`` value. Pure.
    """
    info, stored, sizes = facts.info, facts.stored, facts.sizes
    if sizes is None or info.compression or sizes != stored.size:
        return None
    return (info.offset, info.length, item.storage_index.fqn, SAFETENSORS_DTYPES.get(stored.properties.dtype), sizes)


#: :func:`_writer_row` of a whole read kept as a column (a whole uncompressed tensor chunk): its first five fields.
_column_row = itemgetter(slice(0, 5))


def _keys(items: list[ReadItem], columns: list[ColumnRow] | None) -> list[str]:
    """The keys of ``items`` and ``columns`` (named when a header does not parse)."""
    return [item.storage_index.fqn for item in items] + [row.fqn for row in columns or ()]


class HeaderCheck:
    """The header check of :class:`~.filesystem_reader.FileSystemReader` (a mixin; all ranks run it).

    Uses the reader's ``path``, ``_items``, ``_headers`` (file -> its header entries, or its raw header
    when one comparison proved all its items; read once per load), ``_header_checked`` (items checked),
    ``_header_lists`` (file -> the last list of its items checked whole), and the plan's whole reads kept as
    columns (``_columns``: file -> rows; ``_columns_unchecked``: the files whose rows await the check).
    """

    def _check_header(self, source: Any, path: Any, size: int, relative_path: str, items: list[ReadItem]) -> None:
        """Refuse ``items`` (and the plan's whole reads of the file kept as columns) whose entry in their file's
        safetensors header differs from the metadata's.

        The header is read once per file and load (one small read); an item is
        checked once. Runs before any byte of the file reaches a target.

        Raises:
            CorruptCheckpointError: names the file, the key, both descriptions and the fix.
        """
        columns = self._columns.get(relative_path) if relative_path in self._columns_unchecked else None
        if self._header_lists.get(relative_path) is items and columns is None:  # this very list (the read pass)
            return
        checked = self._header_checked
        todo = [item for item in items if id(item) not in checked] if checked else items
        if not todo and columns is None:
            return
        if len(todo) == len(items):  # none checked yet (another file's were): the list itself, its facts kept
            todo = items
        entries = self._headers.get(relative_path)
        if entries is None or type(entries) is bytes:  # pylint: disable=unidiomatic-typecheck
            entries = self._header_entries(source, path, size, relative_path, items, todo, entries, columns)
            if entries is None:  # every item of the file, proven by one comparison
                checked.update(map(id, todo))
                self._header_lists[relative_path] = items
                self._columns_unchecked.discard(relative_path)
                return
        facts_of = self._items.facts
        for item in todo:
            facts = facts_of(item)
            info = facts.info
            if info.offset + info.length > size:
                check_within(path, size, item.storage_index.fqn, info)
            found = entries.get(info.offset)
            row = _writer_row(item, facts)
            # The usual item, a whole uncompressed tensor chunk: the very entry the writer made for it.
            if found is None or row is None or found != row[1:]:
                self._check_entry(path, item, facts, found)
            checked.add(id(item))
        for column in columns or ():
            if column.offset + column.length > size:
                check_within(path, size, column.fqn, column.info)
            found = entries.get(column.offset)
            if found is None or found != column[1:5]:
                stored = column.stored
                item = whole_read_item(column.fqn, (0,) * len(stored.size), stored.size)
                self._check_entry(path, item, self._items.facts(item), found)
        self._header_lists[relative_path] = items
        self._columns_unchecked.discard(relative_path)

    def _header_entries(self, source: Any, path: Any, size: int, relative_path: str, items: list[ReadItem],
                        todo: list[ReadItem], text: bytes | None,
                        columns: list[ColumnRow] | None = None) -> dict[int, tuple[Any, ...]] | None:
        """Read (or take) the file's header once per load; ``None`` when it proves every item of ``todo`` (and
        every row of ``columns``) at once.

        ``text``: the raw header kept by an earlier call (``self._headers``), else ``None``. When ``todo`` is
        every item of ``items`` and the header is exactly the writer's for them and ``columns``, only the raw
        header is kept (parsed later if another item of the file comes); otherwise the header is parsed into
        its entries.

        Raises:
            CorruptCheckpointError: an unreadable header (names the file and keys).
        """
        if text is None:
            head = np.empty(min(size, _HEADER_READ_BYTES), dtype=np.uint8)
            head = head[: source.readinto(head, 0)].tobytes()  # one read holds the usual header (data at 4096)

            def pread(count: int, offset: int) -> bytes:
                if offset + count <= len(head):
                    return head[offset : offset + count]
                buffer = np.empty(count, dtype=np.uint8)
                return buffer[: source.readinto(buffer, offset)].tobytes()

            try:
                text = read_header_text(str(path), size, pread)
            except CheckpointError:  # header_entries says what is wrong, naming the keys
                return header_entries(str(path), size, pread, keys=_keys(todo, columns))
            if len(todo) == len(items) and self._whole_file_matches(size, text, todo, columns):
                self._headers[relative_path] = text
                return None
        raw = len(text).to_bytes(8, "little") + text
        entries = header_entries(str(path), size, lambda count, offset: raw[offset : offset + count],
                                 keys=_keys(todo, columns))
        self._headers[relative_path] = entries
        return entries

    def _whole_file_matches(self, size: int, text: bytes, items: list[ReadItem],
                            columns: list[ColumnRow] | None = None) -> bool:
        """Whether ``items`` and ``columns`` are every item of the file, each a whole uncompressed tensor chunk, and
        the file's header ``text`` is exactly the writer's for them (``header_check.header_is_exactly``).
        ``False`` proves nothing.
        """
        rows = list(map(_column_row, columns)) if columns else []
        for item, facts in zip(items, self._items.facts_list(items)):
            row = _writer_row(item, facts)
            if row is None:
                return False
            rows.append(row)
        rows.sort()
        return header_is_exactly(text, size, rows)

    def _check_entry(self, path: Any, item: ReadItem, facts: ItemFacts, found: tuple[Any, ...] | None) -> None:
        """The full comparison of ``item``'s header entry (``found``, ``None`` if there is none) with the metadata.

        Raises:
            CorruptCheckpointError: they differ (names the file, the key, both descriptions and the fix).
        """
        index, info = item.storage_index, facts.info
        expected = expected_span(index, info, facts.stored, facts.sizes)
        spans = {info.offset: HeaderSpan(*found)} if found is not None else {}
        problem = span_problem(spans, info.offset, expected)
        if problem is not None:
            raise CorruptCheckpointError(
                f"data file {path}, key '{index.fqn}' (chunk at offset {list(index.offset)}): {problem}. The "
                f"metadata and the data file disagree (damaged or edited); nothing was loaded from the file. "
                f"Run `hp-ckpt verify {self.path}` to list every problem"
            )
