"""Each touched data file's safetensors header, checked against the metadata before a byte of it lands."""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.header_check import (
    HeaderSpan,
    expected_span,
    header_spans,
    span_problem,
)
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import SAFETENSORS_DTYPES
from hyper_parallel.core.distributed_checkpoint._read_items import ItemFacts
from hyper_parallel.core.distributed_checkpoint._reader_verify import check_within
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import StorageInfo
from hyper_parallel.core.distributed_checkpoint.planner import ReadItem

__all__ = ["HeaderCheck"]

#: First read of a data file's header: the writer starts the data region at 4096.
_HEADER_READ_BYTES = 4096


def _whole_tensor_entry(found: HeaderSpan, info: StorageInfo, facts: ItemFacts) -> bool:
    """Whether ``found`` is exactly the header entry the writer makes for a whole uncompressed tensor chunk.

    A shortcut of ``found == expected_span(...)`` for the usual item (no record built); anything else
    takes the full comparison.
    """
    stored = facts.stored
    return (
        facts.sizes is not None
        and not info.compression
        and found.length == info.length
        and found.shape == facts.sizes
        and facts.sizes == tuple(stored.size)
        and found.dtype == SAFETENSORS_DTYPES.get(stored.properties.dtype)
    )


class HeaderCheck:
    """The header check of :class:`~.filesystem_reader.FileSystemReader` (a mixin; all ranks run it).

    Uses the reader's ``path``, ``_items``, ``_headers`` (file -> header spans,
    read once per load) and ``_header_checked`` (items checked).
    """

    def _check_header(self, source: Any, path: Any, size: int, relative_path: str, items: list[ReadItem]) -> None:
        """Refuse ``items`` whose entry in their file's safetensors header differs from the metadata's.

        The header is read once per file and load (one small read); an item is
        checked once. Runs before any byte of the file reaches a target.

        Raises:
            CorruptCheckpointError: names the file, the key, both descriptions and the fix.
        """
        todo = [item for item in items if id(item) not in self._header_checked]
        if not todo:
            return
        spans = self._headers.get(relative_path)
        if spans is None:
            head = np.empty(min(size, _HEADER_READ_BYTES), dtype=np.uint8)
            head = head[: source.readinto(head, 0)].tobytes()  # one read holds the usual header (data at 4096)

            def pread(count: int, offset: int) -> bytes:
                if offset + count <= len(head):
                    return head[offset : offset + count]
                buffer = np.empty(count, dtype=np.uint8)
                return buffer[: source.readinto(buffer, offset)].tobytes()

            spans = header_spans(str(path), size, pread, keys=[item.storage_index.fqn for item in todo])
            self._headers[relative_path] = spans
        facts_of = self._items.facts
        for item in todo:
            index = item.storage_index
            facts = facts_of(item)
            info = facts.info
            check_within(path, size, index.fqn, info)
            found = spans.get(info.offset)
            if found is not None and found.name == index.fqn and _whole_tensor_entry(found, info, facts):
                self._header_checked.add(id(item))  # the usual case: the very entry the writer made
                continue
            expected = expected_span(index, info, facts.stored, facts.sizes)
            problem = span_problem(spans, info.offset, expected)
            if problem is not None:
                raise CorruptCheckpointError(
                    f"data file {path}, key '{index.fqn}' (chunk at offset {list(index.offset)}): {problem}. The "
                    f"metadata and the data file disagree (damaged or edited); nothing was loaded from the file. "
                    f"Run `hp-ckpt verify {self.path}` to list every problem"
                )
            self._header_checked.add(id(item))
