"""The crc32 that ``mindspore.save_checkpoint(..., crc_check=True)`` stores, checked as the import reads.

MindSpore stores one CRC-32 (``binascii.crc32``) per file:

- ``.ckpt``: of every byte before the trailer (the serialized values, in file
  order), written as ``b"crc_num"`` and the value in 10 big-endian bytes;
- ``.safetensors`` (``{"format": "ms"}``): of each tensor's name (UTF-8) then
  ``bytes(array)``, tensors in sorted name order, kept as the decimal text of
  the ``__metadata__`` key ``"crc_num"``. ``bytes()`` of a 0-d integer array
  is not its bytes but that many zero bytes (Python takes it as a count);
  MindSpore's load checks the same way, so such a tensor is counted so here.

The import never reads a file in that order at once: each tensor's content is
read when the writer asks for it (mapped, in the writer's order, by up to two
threads). So the stored crc is split into parts: each part is a short prefix
(the protobuf fields before a content, or a tensor's name; read while indexing)
and one content segment. A part's crc is taken when its content is read, and
the parts are joined by CRC-32 combination (the remainder of ``x^(8n)``), which
costs a few microseconds per part, never a second read of the content.
"""

from __future__ import annotations

import binascii
import functools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError

__all__ = ["CrcPart", "StoredCrc", "crc32_combine", "ckpt_crc", "safetensors_crc"]

_POLY = 0xEDB88320  # CRC-32 (reflected), as binascii/zlib
_TOP = 1 << 31  # the polynomial 1 in the reflected representation


def _mult_mod_p(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial (both reflected)."""
    product = 0
    mask = _TOP
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> tuple[int, ...]:
    table = [1 << 30]  # x^1
    for _ in range(63):
        table.append(_mult_mod_p(table[-1], table[-1]))
    return tuple(table)  # x^(2^k) for k = 0..63


_X_2K = _powers()


@functools.lru_cache(maxsize=4096)
def _shift(nbytes: int) -> int:
    """``x^(8 * nbytes)`` modulo the polynomial (cached: tensors often share lengths)."""
    power, k, n = _TOP, 3, nbytes
    while n:
        if n & 1:
            power = _mult_mod_p(_X_2K[k % 64], power)
        n >>= 1
        k += 1
    return power


def crc32_combine(first: int, second: int, second_length: int) -> int:
    """The crc32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's ``crc32_combine``)."""
    return _mult_mod_p(_shift(second_length), first) ^ second


def _zeros_crc(start: int, count: int) -> int:
    """``binascii.crc32(bytes(count), start)`` without making the bytes."""
    return crc32_combine(start, _mult_mod_p(_shift(count), 0xFFFFFFFF) ^ 0xFFFFFFFF, count)


@dataclass(frozen=True)
class CrcPart:
    """One part of a file's crc: a prefix already read, then one content segment.

    Attributes:
        prefix_crc: crc32 of the prefix bytes.
        prefix_length: Bytes of the prefix.
        offset: Absolute file offset of the content segment.
        length: Bytes of the content segment.
        counted_dtype: Integer dtype of a 0-d tensor of a ``.safetensors``
            file, whose crc covers ``value`` zero bytes (see above); else None.
    """

    prefix_crc: int
    prefix_length: int
    offset: int
    length: int
    counted_dtype: str | None = None

    def crc(self, data: np.ndarray) -> tuple[int, int]:
        """The part's crc and the bytes it covers, given the content ``data``."""
        if self.counted_dtype is not None:
            count = int(data.view(np.dtype(self.counted_dtype).newbyteorder("<"))[0])
            if count >= 0:  # MindSpore cannot save a negative one with a crc (bytes(-1) fails)
                return _zeros_crc(self.prefix_crc, count), self.prefix_length + count
        return binascii.crc32(data, self.prefix_crc), self.prefix_length + self.length


class StoredCrc:
    """The crc a MindSpore file stores, checked part by part as contents are read. Thread-safe.

    Args:
        path: The file (for errors).
        expected: The stored crc32.
        parts: The parts in crc order (each content segment once).
        tail_crc: crc32 of the bytes after the last part (``.ckpt``: the
            fields after the last content), ``tail_length`` their count.
    """

    def __init__(self, path: Path, expected: int, parts: list[CrcPart], *, tail_crc: int = 0,
                 tail_length: int = 0) -> None:
        self.path = path
        self.expected = expected
        self._parts = parts
        self._tail = (tail_crc, tail_length)
        self._index = {part.offset: i for i, part in enumerate(parts) if part.length}
        self._crcs: list[tuple[int, int] | None] = [
            None if part.length else (part.prefix_crc, part.prefix_length) for part in parts]
        self._left = sum(1 for c in self._crcs if c is None)
        self._lock = threading.Lock()
        if not self._left:
            self._finish()

    @property
    def complete(self) -> bool:
        """Whether every content was read (and the crc checked)."""
        return self._left == 0

    def pending(self, offset: int) -> bool:
        """Whether the content segment at ``offset`` still has to be read for the crc."""
        i = self._index.get(offset)
        return i is not None and self._crcs[i] is None

    def read(self, offset: int, data: np.ndarray) -> None:
        """Account for the content segment at ``offset`` (its bytes ``data``); the last one checks the file.

        A segment already accounted for is skipped (its crc is not taken twice).

        Raises:
            CorruptCheckpointError: the last segment was read and the file's
                crc does not match (names the file and the fix).
        """
        i = self._index.get(offset)
        if i is None or self._crcs[i] is not None:
            return
        value = self._parts[i].crc(data)
        with self._lock:
            if self._crcs[i] is not None:
                return
            self._crcs[i] = value
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        total = 0
        for value, length in self._crcs:
            total = crc32_combine(total, value, length)
        total = crc32_combine(total, self._tail[0], self._tail[1])
        if total != self.expected:
            raise CorruptCheckpointError(
                f"{self.path}: the crc32 MindSpore stored in it ({self.expected}) does not match its bytes "
                f"({total}): the file is damaged; copy it again from where it was saved (or save it again "
                "with mindspore.save_checkpoint) and import that copy"
            )


def ckpt_crc(path: Path, read: Callable[[int, int], bytes], segments: list[tuple[int, int]], end: int,
             expected: int) -> StoredCrc:
    """The crc of a ``.ckpt`` file: the bytes between contents (``read`` by the indexing cursor) and the contents.

    Args:
        path: The file.
        read: ``read(position, count)``: bytes of the file (the indexer's cursor).
        segments: Every content segment ``(offset, length)`` of the file.
        end: Where the trailer starts.
        expected: The value of the trailer.
    """
    parts, at = [], 0
    for offset, length in sorted(segments):
        prefix = read(at, offset - at) if offset > at else b""
        parts.append(CrcPart(binascii.crc32(prefix), len(prefix), offset, length))
        at = offset + length
    tail = read(at, end - at) if end > at else b""
    return StoredCrc(path, expected, parts, tail_crc=binascii.crc32(tail), tail_length=len(tail))


def safetensors_crc(path: Path, named_segments: dict[str, tuple[int, int]], counted: dict[str, str],
                    expected: int) -> StoredCrc:
    """The crc of a MindSpore ``.safetensors`` file: each name then its bytes, in sorted name order.

    Args:
        path: The file.
        named_segments: Tensor name -> its ``(offset, length)``.
        counted: Name -> dtype of each 0-d integer tensor (see :class:`CrcPart`).
        expected: The ``crc_num`` of the file's ``__metadata__``.
    """
    parts = []
    for name in sorted(named_segments):
        prefix = name.encode("utf-8")
        offset, length = named_segments[name]
        parts.append(CrcPart(binascii.crc32(prefix), len(prefix), offset, length, counted.get(name)))
    return StoredCrc(path, expected, parts)
