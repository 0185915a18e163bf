"""The safetensors container of every data file: header building and parsing.

A safetensors file is an 8-byte little-endian header length ``N``, ``N``
bytes of JSON (padded with spaces to a multiple of 8), then the data region.
Each JSON entry gives ``dtype``, ``shape`` and ``data_offsets`` (begin, end)
relative to the data region; entries tile the region with no gap. The header
is built before any data is written, so every tensor streams straight to its
precomputed offset.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Callable, Iterable

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError, CorruptCheckpointError

__all__ = [
    "SAFETENSORS_DTYPES",
    "DTYPE_FROM_SAFETENSORS",
    "MAX_HEADER_BYTES",
    "HeaderEntry",
    "build_header",
    "header_bytes",
    "header_json",
    "read_header",
    "read_header_and_metadata",
    "read_header_at",
    "read_header_text",
    "naturals",
]

#: Stored dtype name -> safetensors dtype code.
SAFETENSORS_DTYPES: dict[str, str] = {
    "bool": "BOOL",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
}
DTYPE_FROM_SAFETENSORS = {code: name for name, code in SAFETENSORS_DTYPES.items()}

#: Headers larger than this are refused as hostile (safetensors uses 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors file.

    Attributes:
        name: Tensor name in the file.
        dtype: Stored dtype name (``"float32"``...).
        shape: Shape as stored.
        nbytes: Byte length in the data region.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def build_header(
    entries: list[HeaderEntry], file_metadata: dict[str, str], *, align: int = 8
) -> tuple[bytes, list[int]]:
    """Return the header bytes (length prefix included) and each entry's absolute offset.

    Entries are laid out in the given order with no gaps, as safetensors requires.
    A name ``__metadata__`` (reserved by safetensors) or a name given twice
    raises :class:`CheckpointValueError` (the file would be unreadable).
    The JSON is padded with spaces so that the data region starts at a
    multiple of ``align`` (a multiple of 8): with 4096, chunks whose sizes are
    multiples of pages start on page boundaries, so a partial read of them
    costs the device no partly needed pages.
    """
    spans: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    position = 0
    relative = []
    for entry in entries:
        if entry.name in spans or entry.name == "__metadata__":
            what = "is the header's reserved key" if entry.name == "__metadata__" else "appears twice"
            raise CheckpointValueError(
                f"tensor name '{entry.name}' {what}: a safetensors file cannot hold it; rename the key"
            )
        spans[entry.name] = (entry.dtype, entry.shape, position, position + entry.nbytes)
        relative.append(position)
        position += entry.nbytes
    header = header_bytes(spans, file_metadata, align=align)
    return header, [len(header) + r for r in relative]


def header_bytes(
    spans: dict[str, tuple[str, tuple[int, ...], int, int]], file_metadata: dict[str, str], *, align: int = 8
) -> bytes:
    """The header bytes (length prefix included) of tensors laid out by the caller.

    Args:
        spans: Tensor name -> (stored dtype name, shape, begin, end), ``begin``
            and ``end`` relative to the data region, tiling it in order. The
            caller keeps names unique and never ``__metadata__``.
        file_metadata: The ``__metadata__`` strings.
        align: The data region starts at a multiple of this (a multiple of 8).
    """
    codes = SAFETENSORS_DTYPES
    text = header_json(file_metadata, ((name, codes[dtype], shape, begin, end)
                                       for name, (dtype, shape, begin, end) in spans.items())).encode("ascii")
    text += b" " * (-(len(text) + 8) % align)
    return struct.pack("<Q", len(text)) + text


def header_json(file_metadata: dict[str, str], entries: Iterable[tuple[str, str, tuple[int, ...], int, int]]) -> str:
    """The header JSON this package writes, unpadded: the one spelling both the writer and the load's whole-header
    check (``header_check.header_is_exactly``) use. Pure; any rank.

    ``__metadata__`` first, then one entry per ``(name, safetensors dtype code, shape, begin, end)`` in order,
    spelled as ``json.dumps(..., separators=(",", ":"))`` spells them (every non-ASCII character escaped).
    """
    quoted = encode_basestring_ascii
    parts = ['{"__metadata__":', json.dumps(file_metadata, separators=(",", ":"))]
    spelled: dict[tuple[str, tuple[int, ...]], str] = {}  # (dtype code, shape) -> its text (most entries share one)
    for name, code, shape, begin, end in entries:
        key = (code, shape if type(shape) is tuple else tuple(shape))  # pylint: disable=unidiomatic-typecheck
        middle = spelled.get(key)
        if middle is None:
            middle = spelled[key] = f'{{"dtype":"{code}","shape":[{",".join(map(str, shape))}],"data_offsets":['
        parts.append(f",{quoted(name)}:{middle}{begin},{end}]}}")
    parts.append("}")
    return "".join(parts)


def naturals(value: object, count: int | None = None) -> bool:
    """True for a list of integers >= 0 (of ``count`` items when given)."""
    if type(value) is not list or (count is not None and len(value) != count):
        return False
    for v in value:
        if type(v) is not int or v < 0:
            return False
    return True


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
    """Parse and check a safetensors header.

    Returns:
        The tensor entries (without ``__metadata__``) and the absolute offset
        where the data region starts.

    Raises:
        CorruptCheckpointError: a header that is too large, not JSON, or whose
            entries do not tile the data region (names the file).
    """
    header, data_start, _ = read_header_and_metadata(path)
    return header, data_start


def read_header_text(path: str | os.PathLike, size: int, pread: Callable[[int, int], bytes]) -> bytes:
    """A file's raw header JSON (its padding included; the data region starts 8 bytes after it), unparsed.

    Raises:
        CorruptCheckpointError: the file is too short for it, or its length is absurd (names the file).
    """
    raw = pread(8, 0)
    if len(raw) < 8:
        raise CorruptCheckpointError(f"{path}: file too short for a safetensors header ({size} bytes)")
    (length,) = struct.unpack("<Q", raw)
    if length > MAX_HEADER_BYTES or length + 8 > size:
        raise CorruptCheckpointError(
            f"{path}: safetensors header length {length} is larger than the file or the "
            f"{MAX_HEADER_BYTES}-byte limit"
        )
    return pread(length, 8)


def read_header_and_metadata(
    path: str | os.PathLike, *, fd: int | None = None
) -> tuple[dict[str, dict], int, dict[str, str]]:
    """Parse and check a safetensors header, keeping its ``__metadata__``.

    Args:
        path: The file (named in errors; opened when ``fd`` is ``None``).
        fd: An open descriptor of the file to read instead of opening ``path``.

    Returns:
        The tensor entries, the absolute offset of the data region, and the
        ``__metadata__`` strings (empty when absent).

    Raises:
        CorruptCheckpointError: as :func:`read_header`.
    """
    if fd is None:
        with open(path, "rb") as handle:
            return read_header_and_metadata(path, fd=handle.fileno())
    return read_header_at(path, os.fstat(fd).st_size, lambda count, offset: os.pread(fd, count, offset))


def read_header_at(
    path: str | os.PathLike, size: int, pread: Callable[[int, int], bytes]
) -> tuple[dict[str, dict], int, dict[str, str]]:
    """:func:`read_header_and_metadata` of a file read through ``pread(count, offset)`` (an object, a stream).

    Args:
        path: The file's name, for messages.
        size: The file's size in bytes.
        pread: Returns up to ``count`` bytes from byte ``offset``.
    """
    text = read_header_text(path, size, pread)
    length = len(text)
    try:
        header = json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, too deep, an integer too long
        raise CorruptCheckpointError(f"{path}: safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not a JSON object")
    file_metadata = header.pop("__metadata__", {})
    if not isinstance(file_metadata, dict) or not all(isinstance(v, str) for v in file_metadata.values()):
        raise CorruptCheckpointError(f"{path}: safetensors __metadata__ must map strings to strings")
    data_start = 8 + length
    from hyper_parallel.platform.dtypes import DTYPE_NAMES  # pylint: disable=import-outside-toplevel

    sizes = {code: DTYPE_NAMES[name] for code, name in DTYPE_FROM_SAFETENSORS.items()}
    spans = []
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if type(entry) is dict else None
        shape = entry.get("shape") if offsets is not None else None
        dtype = entry.get("dtype") if shape is not None else None
        itemsize = sizes.get(dtype) if type(dtype) is str else None
        if itemsize is None or not naturals(offsets, 2) or not naturals(shape):
            raise CorruptCheckpointError(
                f"{path}: malformed safetensors entry '{name}' (needs a known dtype, a shape and two data "
                "offsets, as integers >= 0)"
            )
        begin, end = offsets
        if end - begin != math.prod(shape) * itemsize or begin > end:
            raise CorruptCheckpointError(f"{path}: entry '{name}' offsets {begin}..{end} do not match its shape")
        spans.append((begin, end))
    spans.sort()
    position = 0
    for begin, end in spans:
        if begin != position:
            raise CorruptCheckpointError(f"{path}: safetensors entries leave a gap or overlap at byte {position}")
        position = end
    if data_start + position != size:
        raise CorruptCheckpointError(
            f"{path}: data region holds {size - data_start} bytes but the header describes {position}"
        )
    return header, data_start, file_metadata
