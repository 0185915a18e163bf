"""MindSpore's own checkpoint files, read without MindSpore (written by :mod:`._ms_write`).

Two formats, both as ``mindspore.save_checkpoint`` writes them:

- ``.ckpt``: serialized protobuf ``Checkpoint`` messages
  (``mindspore/train/checkpoint.proto``) written one after the other, each
  holding one ``Value`` (``tag`` = parameter name, ``tensor`` = ``TensorProto``
  with ``dims``, ``tensor_type`` such as ``"Float32"`` and the raw
  little-endian ``tensor_content``). A tensor above 512 MiB is split into
  several consecutive values with the same tag whose contents concatenate. A
  file saved with ``crc_check=True`` ends with ``b"crc_num"`` and 10 bytes
  (the crc32 of the bytes before them).
  A string is a value of type ``"str"`` holding numpy UTF-32 text.
- ``.safetensors``: a safetensors file with ``{"format": "ms"}`` metadata
  (and ``"crc_num"`` when saved with ``crc_check=True``).

The ``.ckpt`` reader walks the protobuf wire format itself: it reads the
small field headers and skips every ``tensor_content``, recording where it
lies, so indexing a file reads a few bytes per tensor. Tensors are then
mapped from the file (no copy, no MindSpore, no unpickling). Only regular
files are opened (a FIFO or device is refused instead of blocking). A
stored crc is checked as the contents are read (:mod:`._ms_crc`).
"""

from __future__ import annotations

import math
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hyper_parallel.cli._ms_crc import StoredCrc, ckpt_crc, safetensors_crc
from hyper_parallel.cli._ms_read_budget import ReadBudget, read_ahead_window
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import (
    DTYPE_FROM_SAFETENSORS,
    read_header_and_metadata,
)
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)
from hyper_parallel.platform.dtypes import DTYPE_NAMES

__all__ = [
    "MS_DTYPE_NAMES",
    "STRING_DTYPE",
    "MsEntry",
    "MsFile",
    "open_regular",
    "open_ms_file",
]

#: MindSpore ``tensor_type`` string -> stored dtype name of this library.
MS_DTYPE_NAMES: dict[str, str] = {
    "Bool": "bool", "Int8": "int8", "UInt8": "uint8", "Int16": "int16", "UInt16": "uint16",
    "Int32": "int32", "UInt32": "uint32", "Int64": "int64", "UInt64": "uint64",
    "Float16": "float16", "BFloat16": "bfloat16", "Float32": "float32", "Float64": "float64",
}
#: dtype of an entry holding a string (MindSpore ``tensor_type`` ``"str"``).
STRING_DTYPE = "str"
_CRC_TRAILER = b"crc_num"
_CRC_TRAILER_BYTES = 17
_WINDOW = 512
#: Fewest bytes announced by one ``MADV_WILLNEED`` (the read-ahead window where it is larger): one
#: call makes the kernel read at most max(read-ahead window, the device's largest request, 128 KiB
#: or more), the rest of a longer range is left to one single-page fault after another.
_ANNOUNCE_BYTES = 128 * 1024


def open_regular(path: str | os.PathLike) -> int:
    """Open ``path`` read-only, refusing anything but a regular file.

    The file is opened non-blocking and checked on the open descriptor, so a
    FIFO never blocks and a file swapped after a check is still caught.

    Raises:
        CheckpointNotFoundError: the file does not exist.
        UnsupportedFormatError: not a regular file (FIFO, device, directory).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{path} does not exist") from exc
    except IsADirectoryError as exc:
        raise UnsupportedFormatError(f"{path} is a directory, not a checkpoint file") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsupportedFormatError(f"{path} is not a regular file (a directory, FIFO or device); refused")
    return fd


@dataclass(frozen=True)
class MsEntry:
    """One tensor (or string) of a MindSpore file.

    Attributes:
        name: Parameter name (the ``.ckpt`` tag / safetensors key).
        dtype: Stored dtype name (``"float32"``...), or :data:`STRING_DTYPE`.
        shape: Shape of the tensor as stored in this file (a slice on a rank).
        segments: ``(absolute offset, length)`` of the content, in order.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    segments: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the content."""
        return sum(length for _, length in self.segments)


class MsFile:
    """An indexed MindSpore ``.ckpt`` or ``.safetensors`` file; tensors mapped on demand.

    Build it with :func:`open_ms_file`. Single process.

    Attributes:
        path: The file.
        entries: Name -> :class:`MsEntry`, in file order.
        file_metadata: The safetensors ``__metadata__`` (empty for ``.ckpt``).
        crc: The crc MindSpore stored in the file (``crc_check=True``), checked
            as contents are read; None when the file has none.
    """

    def __init__(self, path: Path, fd: int, entries: dict[str, MsEntry], file_metadata: dict[str, str],
                 crc: StoredCrc | None = None) -> None:
        self.path = path
        self.entries = entries
        self.file_metadata = file_metadata
        self.crc = crc
        info = os.fstat(fd)
        self._window = read_ahead_window(info.st_dev)
        self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if info.st_size else None
        os.close(fd)
        if self._map is not None and hasattr(mmap, "MADV_RANDOM"):
            # No read-around on a fault: only the contents asked for (see raw) are read.
            self._map.madvise(mmap.MADV_RANDOM)

    def raw(self, name: str, *, budget: ReadBudget | None = None) -> np.ndarray:
        """Return the content bytes of ``name`` as a read-only uint8 array.

        A single-segment entry is a view of the mapped file (no copy); a
        ``.ckpt`` tensor split into several values is joined into a new array.
        The device reads the pages of the content, once, and nothing else:

        - the content is announced (``MADV_WILLNEED``) one read-ahead window
          (at least 128 KiB) per call, so the kernel reads it all at once,
          exactly, in requests as large as readahead's (one call reads at most
          the larger of the read-ahead window and the device's largest
          request: a single call for a whole tensor left the rest of it to
          one 4 KiB fault after another, a 256 MiB import 2.6-3.3 s instead
          of 0.4-0.5 s; docs/guide.md, "MindSpore parallel jobs");
        - past ``budget`` (bytes announced before the writer uses them), the
          content is read ahead by the kernel as it is used
          (``MADV_SEQUENTIAL``) except its last two read-ahead windows, which
          are announced, so no readahead crosses its end; past the budget
          even for those, the whole content is read ahead (the device may
          read up to a window past its end).

        The map reads nothing around a fault elsewhere, so entries never
        asked for are not read. With a stored :attr:`crc`, each segment's crc
        is taken here, the first time it is asked for; the last one checks
        the file.

        Args:
            name: The entry.
            budget: Bytes that may still be announced (the import's; spent
                here). None: announce the whole content.

        Raises:
            CorruptCheckpointError: this was the file's last content not yet
                read, and the file's stored crc does not match its bytes.
        """
        entry = self.entries[name]
        if not entry.segments or entry.nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        if hasattr(mmap, "MADV_WILLNEED"):
            for offset, length in entry.segments:
                self._advise(offset - offset % mmap.PAGESIZE, offset + length, budget)
        parts = [np.frombuffer(self._map, dtype=np.uint8, count=length, offset=offset)
                 for offset, length in entry.segments]
        if self.crc is not None:
            for (offset, _), part in zip(entry.segments, parts):
                self.crc.read(offset, part)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def peek(self, name: str, starts: tuple[int, ...], length: int) -> bytes:
        """Return the ``length`` bytes of ``name``'s content at each of ``starts`` (positions in the content), joined.

        Only the pages of these bytes are read (announced together, so the
        device reads them at once); the content is not announced and its crc
        not accounted: what peeks at a copy reads it whole later (``raw``),
        from the page cache for the pages read here.
        """
        entry = self.entries[name]
        wanted = []  # (file offset, length) of every window's part, in order
        for start in starts:
            at, left = start, length
            for offset, size in entry.segments:
                if at < size and left:
                    take = min(left, size - at)
                    wanted.append((offset + at, take))
                    left -= take
                    at = 0
                else:
                    at -= size
        if hasattr(mmap, "MADV_WILLNEED"):
            for offset, size in wanted:
                first = offset - offset % mmap.PAGESIZE
                self._map.madvise(mmap.MADV_WILLNEED, first, offset + size - first)
        return b"".join(self._map[offset:offset + size] for offset, size in wanted)

    def check_crc_except(self, names: set[str]) -> None:
        """Read, for the stored crc only, every content not of ``names`` and not read yet. Single process.

        The import reads the entries it stores (``names``) as it writes them;
        a file whose other entries (replicas not compared, with
        ``--no-check-replicas``) are never read could not be checked
        otherwise. They are read once, streamed; nothing without a crc.

        Raises:
            CorruptCheckpointError: every content is now read and the stored crc does not match.
        """
        if self.crc is None:
            return
        for name, entry in self.entries.items():
            if name not in names and any(self.crc.pending(offset) for offset, _ in entry.segments):
                self.raw(name, budget=ReadBudget(0))

    def _advise(self, start: int, end: int, budget: ReadBudget | None) -> None:
        """Have the kernel read the pages of ``[start, end)`` (``start`` page-aligned) and no other."""
        if budget is None or budget.take(end - start):
            self._announce(start, end)
            return
        tail = 2 * self._window if self._window else end - start
        cut = max(start, (end - tail) // mmap.PAGESIZE * mmap.PAGESIZE)
        if budget.take(end - cut):
            self._announce(cut, end)
            end = cut
        if end > start:
            self._map.madvise(mmap.MADV_SEQUENTIAL, start, end - start)

    def _announce(self, start: int, end: int) -> None:
        step = max(_ANNOUNCE_BYTES, self._window or 0)
        for at in range(start, end, step):
            self._map.madvise(mmap.MADV_WILLNEED, at, min(step, end - at))

    def text(self, name: str) -> str:
        """Return the string held by a ``"str"`` entry (numpy UTF-32 text)."""
        data = self.raw(name).tobytes()
        if len(data) % 4:
            raise CorruptCheckpointError(f"{self.path}: string value '{name}' is not UTF-32 text")
        return data.decode("utf-32-le").rstrip("\0")

    def __repr__(self) -> str:
        return f"MsFile({str(self.path)!r}, {len(self.entries)} entries)"


class _Cursor:
    """Reads the small protobuf fields of a file by ``pread`` into a small window."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path
        self.base, self.data = 0, b""

    def take(self, position: int, count: int) -> bytes:
        end = position + count
        if not (self.base <= position and end <= self.base + len(self.data)):
            self.data = os.pread(self.fd, max(count, _WINDOW), position)
            self.base = position
        start = position - self.base
        chunk = self.data[start:start + count]
        if len(chunk) != count:
            raise CorruptCheckpointError(f"{self.path}: truncated .ckpt file (field at byte {position})")
        return chunk

    def varint(self, position: int, end: int) -> tuple[int, int]:
        value, shift = 0, 0
        while True:
            if position >= end or shift > 63:
                raise CorruptCheckpointError(f"{self.path}: malformed protobuf varint at byte {position}")
            byte = self.take(position, 1)[0]
            position += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value, position

    def field(self, position: int, end: int) -> tuple[int, int, int, int]:
        """Return ``(field number, wire type, value or length, position after the header)``."""
        key, position = self.varint(position, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, position = self.varint(position, end)
            return number, wire, value, position
        if wire == 2:
            length, position = self.varint(position, end)
            if position + length > end:
                raise CorruptCheckpointError(f"{self.path}: protobuf field at byte {position} overruns its message")
            return number, wire, length, position
        if wire in (1, 5):
            return number, wire, 8 if wire == 1 else 4, position
        raise CorruptCheckpointError(
            f"{self.path}: protobuf wire type {wire} at byte {position} is not used by MindSpore checkpoints; "
            "not a .ckpt file (or an encrypted one: decrypt it with mindspore.load_checkpoint(dec_key=...) first)"
        )


def _skip(wire: int, value: int, position: int) -> int:
    return position if wire == 0 else position + value


def _parse_tensor(cursor: _Cursor, start: int, end: int, name: str) -> tuple[list[int], str, tuple[int, int]]:
    dims: list[int] = []
    tensor_type, content = None, (start, 0)
    position = start
    while position < end:
        number, wire, value, position = cursor.field(position, end)
        if number == 1 and wire == 0:
            dims.append(value)
        elif number == 1 and wire == 2:  # packed dims
            inner, stop = position, position + value
            while inner < stop:
                dim, inner = cursor.varint(inner, stop)
                dims.append(dim)
        elif number == 2 and wire == 2:
            tensor_type = cursor.take(position, value).decode("utf-8", "replace")
        elif number == 3 and wire == 2:
            content = (position, value)
        position = _skip(wire, value, position)
    if tensor_type is None:
        raise CorruptCheckpointError(f"{cursor.path}: value '{name}' has no tensor_type")
    return dims, tensor_type, content


def _parse_value(cursor: _Cursor, start: int, end: int) -> tuple[str, list[int], str, tuple[int, int]]:
    name, tensor = None, None
    position = start
    while position < end:
        number, wire, value, position = cursor.field(position, end)
        if number == 1 and wire == 2:
            name = cursor.take(position, value).decode("utf-8", "replace")
        elif number == 2 and wire == 2:
            tensor = (position, position + value)
        elif number == 3 and wire == 2:
            raise UnsupportedFormatError(
                f"{cursor.path}: value '{name}' is a MapParameter (maptensor), which cannot be imported"
            )
        position = _skip(wire, value, position)
    if name is None or tensor is None:
        raise CorruptCheckpointError(f"{cursor.path}: a value at byte {start} lacks its tag or tensor")
    dims, tensor_type, content = _parse_tensor(cursor, tensor[0], tensor[1], name)
    return name, dims, tensor_type, content


def _entry_shape(path: Path, name: str, dims: list[int], dtype: str, nbytes: int) -> tuple[int, ...]:
    if dtype == STRING_DTYPE:
        return ()
    itemsize = DTYPE_NAMES[dtype]
    shape = tuple(dims)
    if shape == (0,) and nbytes == itemsize:  # MindSpore writes a scalar's dims as [0]
        shape = ()
    if math.prod(shape) * itemsize != nbytes:
        raise CorruptCheckpointError(
            f"{path}: value '{name}' holds {nbytes} bytes but dims {list(dims)} of {dtype} need "
            f"{math.prod(shape) * itemsize}"
        )
    return shape


def _index_ckpt(fd: int, path: Path) -> tuple[dict[str, MsEntry], StoredCrc | None]:
    size = os.fstat(fd).st_size
    cursor = _Cursor(fd, path)
    end, expected = size, None
    if size >= _CRC_TRAILER_BYTES:
        trailer = os.pread(fd, _CRC_TRAILER_BYTES, size - _CRC_TRAILER_BYTES)
        if trailer.startswith(_CRC_TRAILER):
            end, expected = size - _CRC_TRAILER_BYTES, int.from_bytes(trailer[len(_CRC_TRAILER):], "big")
    found: dict[str, tuple[list[int], str, list[tuple[int, int]]]] = {}
    last = None
    position = 0
    while position < end:
        number, wire, value, position = cursor.field(position, end)
        if number == 1 and wire == 2:
            name, dims, tensor_type, content = _parse_value(cursor, position, position + value)
            if name == last and found[name][:2] == (dims, tensor_type):
                found[name][2].append(content)
            elif name in found:
                raise CorruptCheckpointError(f"{path}: parameter '{name}' appears twice")
            else:
                found[name] = (dims, tensor_type, [content])
            last = name
        position = _skip(wire, value, position)
    entries = {}
    for name, (dims, tensor_type, segments) in found.items():
        if tensor_type != STRING_DTYPE and tensor_type not in MS_DTYPE_NAMES:
            raise UnsupportedFormatError(
                f"{path}: parameter '{name}' has MindSpore type {tensor_type!r}, which cannot be imported "
                f"(supported: {', '.join(sorted(MS_DTYPE_NAMES))}, str)"
            )
        dtype = MS_DTYPE_NAMES.get(tensor_type, STRING_DTYPE)
        nbytes = sum(length for _, length in segments)
        entries[name] = MsEntry(name, dtype, _entry_shape(path, name, dims, dtype, nbytes), tuple(segments))
    if expected is None:
        return entries, None
    segments = [segment for entry in entries.values() for segment in entry.segments]
    return entries, ckpt_crc(path, cursor.take, segments, end, expected)


def _index_safetensors(fd: int, path: Path) -> tuple[dict[str, MsEntry], dict[str, str], StoredCrc | None]:
    header, data_start, file_metadata = read_header_and_metadata(path, fd=fd)
    quantized = sorted(name for name, value in file_metadata.items() if value == "Int4" and name in header)
    if quantized:
        raise UnsupportedFormatError(f"{path}: parameter '{quantized[0]}' is MindSpore Int4 (qint4x2); not supported")
    entries = {}
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        entries[name] = MsEntry(name, DTYPE_FROM_SAFETENSORS[info["dtype"]], tuple(info["shape"]),
                                ((data_start + begin, end - begin),))
    stored = file_metadata.get("crc_num", "") if file_metadata.get("format") == "ms" else ""
    if not stored.isdigit():
        return entries, file_metadata, None
    segments = {name: entry.segments[0] for name, entry in entries.items()}
    counted = {name: entry.dtype for name, entry in entries.items() if entry.shape == () and "int" in entry.dtype}
    return entries, file_metadata, safetensors_crc(path, segments, counted, int(stored))


def open_ms_file(path: str | os.PathLike) -> MsFile:
    """Index a MindSpore ``.ckpt`` or ``.safetensors`` file (its tensors stay on disk).

    Raises:
        CheckpointNotFoundError: the file does not exist.
        UnsupportedFormatError: not a regular file, another suffix, or an
            unsupported entry (MapParameter, Int4).
        CorruptCheckpointError: a malformed file (names the file and byte).
    """
    file_path = Path(os.fspath(path))
    if file_path.suffix not in (".ckpt", ".safetensors"):
        raise UnsupportedFormatError(f"{file_path}: expected a MindSpore .ckpt or .safetensors file")
    fd = open_regular(file_path)
    if hasattr(os, "posix_fadvise"):  # headers are read by small preads: no read-ahead into tensor content
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    try:
        if file_path.suffix == ".ckpt":
            (entries, crc), file_metadata = _index_ckpt(fd, file_path), {}
        else:
            entries, file_metadata, crc = _index_safetensors(fd, file_path)
    except BaseException:
        os.close(fd)
        raise
    return MsFile(file_path, fd, entries, file_metadata, crc)
