"""Each touched data file's safetensors header, checked against the metadata before a byte of it lands."""

from __future__ import annotations

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
from hyper_parallel.core.distributed_checkpoint._read_items import ItemFacts
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


class HeaderCheck:
    """The header check of :class:`~.filesystem_reader.FileSystemReader` (a mixin; all ranks run it).

    Uses the reader's ``path``, ``_items``, ``_headers`` (file -> its header entries, or its raw header
    when one comparison proved all its items; read once per load), ``_header_checked`` (items checked) and ``_header_lists`` (file -> the last list of
    its items checked whole).
    """

    def _check_header(self, source: Any, path: Any, size: int, relative_path: str, items: list[ReadItem]) -> None:
        """Refuse ``items`` whose entry in their file's safetensors header differs from the metadata's.

        The header is read once per file and load (one small read); an item is
        checked once. Runs before any byte of the file reaches a target.

        Raises:
            CorruptCheckpointError: names the file, the key, both descriptions and the fix.
        """
        if self._header_lists.get(relative_path) is items:  # this very list (the read pass after the verify pass)
            return
        checked = self._header_checked
        todo = [item for item in items if id(item) not in checked] if checked else items
        if not todo:
            return
        if len(todo) == len(items):  # none checked yet (another file's were): the list itself, its facts kept
            todo = items
        entries = self._headers.get(relative_path)
        if entries is None or type(entries) is bytes:  # pylint: disable=unidiomatic-typecheck
            entries = self._header_entries(source, path, size, relative_path, items, todo, entries)
            if entries is None:  # every item of the file, proven by one comparison
                checked.update(map(id, todo))
                self._header_lists[relative_path] = items
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
        self._header_lists[relative_path] = items

    def _header_entries(self, source: Any, path: Any, size: int, relative_path: str, items: list[ReadItem],
                        todo: list[ReadItem], text: bytes | None) -> dict[int, tuple[Any, ...]] | None:
        """Read (or take) the file's header once per load; ``None`` when it proves every item of ``todo`` at once.

        ``text``: the raw header kept by an earlier call (``self._headers``), else ``None``. When ``todo`` is
        every item of ``items`` and the header is exactly the writer's for them, only the raw header is kept
        (parsed later if another item of the file comes); otherwise the header is parsed into its entries.

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
                return header_entries(str(path), size, pread, keys=[item.storage_index.fqn for item in todo])
            if len(todo) == len(items) and self._whole_file_matches(size, text, todo):
                self._headers[relative_path] = text
                return None
        raw = len(text).to_bytes(8, "little") + text
        entries = header_entries(str(path), size, lambda count, offset: raw[offset : offset + count],
                                 keys=[item.storage_index.fqn for item in todo])
        self._headers[relative_path] = entries
        return entries

    def _whole_file_matches(self, size: int, text: bytes, items: list[ReadItem]) -> bool:
        """Whether ``items`` are every item of the file, each a whole uncompressed tensor chunk, and the file's
        header ``text`` is exactly the writer's for them (``header_check.header_is_exactly``). ``False`` proves
        nothing.
        """
        rows = []
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
