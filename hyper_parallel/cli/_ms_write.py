"""MindSpore's own checkpoint files written without MindSpore: ``.ckpt`` protobuf values or ``.safetensors``.

The formats are described in :mod:`._ms_files` (which reads them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from hyper_parallel.cli._common import atomic_output
from hyper_parallel.cli._ms_files import MS_DTYPE_NAMES, STRING_DTYPE
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import HeaderEntry, build_header
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError

__all__ = ["CKPT_CHUNK_BYTES", "ckpt_value_bytes", "MsItem", "string_item", "scalar_item", "write_ms_file"]

#: MindSpore splits a tensor's content into values of at most this many bytes.
CKPT_CHUNK_BYTES = 512 * 1024 * 1024
_MS_TYPE_OF = {name: ms for ms, name in MS_DTYPE_NAMES.items()}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_field(number: int, length: int) -> bytes:
    return _varint(number << 3 | 2) + _varint(length)


def ckpt_value_bytes(name: str, dtype: str, shape: tuple[int, ...],
                     content: memoryview) -> Iterable[memoryview | bytes]:
    """Yield the bytes of one ``.ckpt`` value (several for content above 512 MiB).

    Args:
        name: Parameter name.
        dtype: Stored dtype name or :data:`STRING_DTYPE`.
        shape: The tensor's shape (``()`` for a scalar or string).
        content: Raw little-endian content (UTF-32 text for a string).
    """
    tag = name.encode("utf-8")
    tensor_type = (STRING_DTYPE if dtype == STRING_DTYPE else _MS_TYPE_OF[dtype]).encode("ascii")
    dims = b"".join(_varint(1 << 3) + _varint(d) for d in (shape if shape or dtype != STRING_DTYPE else (0,)))
    starts = range(0, len(content), CKPT_CHUNK_BYTES) if len(content) else [0]
    for start in starts:
        piece = content[start:start + CKPT_CHUNK_BYTES]
        tensor = dims + _length_field(2, len(tensor_type)) + tensor_type + _length_field(3, len(piece))
        value = _length_field(1, len(tag)) + tag + _length_field(2, len(tensor) + len(piece)) + tensor
        yield _length_field(1, len(value) + len(piece)) + value
        yield piece


@dataclass(frozen=True)
class MsItem:
    """One tensor (or string) to write into a MindSpore file.

    Attributes:
        name: Parameter name.
        dtype: Stored dtype name or :data:`STRING_DTYPE`.
        shape: Shape (``()`` for a scalar or a string).
        nbytes: Bytes of the content.
        content: Returns the raw little-endian content (UTF-32 text for a
            string); called once, when the item is written.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    content: Callable[[], np.ndarray | bytes]


def string_item(name: str, value: str) -> MsItem:
    """Return the :class:`MsItem` of a string value (as numpy stores ``np.array(value)``)."""
    data = np.array(value).tobytes()
    return MsItem(name, STRING_DTYPE, (), len(data), lambda: data)


def scalar_item(name: str, value: np.ndarray) -> MsItem:
    """Return the :class:`MsItem` of a 0-d array of a MindSpore dtype (how ``mindspore.save_checkpoint`` stores
    an ``append_dict`` number)."""
    return MsItem(name, value.dtype.name, (), value.nbytes, lambda: value)


def _content_view(item: MsItem) -> memoryview:
    data = item.content()
    view = memoryview(data).cast("B") if isinstance(data, (bytes, bytearray, memoryview)) else memoryview(
        np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if len(view) != item.nbytes:
        raise CorruptCheckpointError(f"'{item.name}': {len(view)} bytes to write, {item.nbytes} expected")
    return view


def write_ms_file(path: Path, items: list[MsItem], *, fmt: str) -> None:
    """Write a MindSpore ``.ckpt`` or ``.safetensors`` file atomically. Single process.

    Each item's content is produced, written and dropped before the next
    (memory holds one tensor). A string item is a ``"str"`` value in
    ``.ckpt``; safetensors files hold no strings (the caller leaves them
    out). The file is written as ``.<name>.<random>.partial``, fsynced and
    renamed.

    Args:
        path: The file to write.
        items: What to write, in order.
        fmt: ``"ckpt"`` or ``"safetensors"``.
    """
    with atomic_output(path) as handle:
        if fmt == "safetensors":
            header, _ = build_header([HeaderEntry(i.name, i.dtype, i.shape, i.nbytes) for i in items], {"format": "ms"})
            handle.write(header)
        for item in items:
            view = _content_view(item)
            if fmt == "ckpt":
                for part in ckpt_value_bytes(item.name, item.dtype, item.shape, view):
                    handle.write(part)
            else:
                handle.write(view)
            del view
