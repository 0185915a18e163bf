"""One data file of a save: its safetensors layout, its checksums, and its bytes on disk.

:func:`lay_out` turns a file's items into the safetensors header and each
item's absolute offset (sizes only: no byte of the data is read), offsets by
one running sum. :func:`write_hashed` then checksums each item and writes it
run by run (about a MiB, or a row slab of tiles): every source byte is read
once, hashed and written while it is still in the CPU cache, and a source
larger than the page cache (memory-mapped rank files of an import) is not
read twice. :class:`LocalDataFile` streams the bytes to disk in order through the
writer's :class:`._file_ops.FileOps`: small pieces many per ``writev``, and,
when the file is to be fsynced, the device is asked to start writing every
:data:`WRITEBACK_BYTES` (``sync_file_range``), so the final ``fsync`` waits
for the last few MiB instead of the whole file. Durability is unchanged: a
byte is durable only after the ``fsync``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from hyper_parallel.core.distributed_checkpoint._file_ops import FileOps, write_all
from hyper_parallel.core.distributed_checkpoint._format.checksum import ALGORITHM, chunk_checksum, digest, tile_shape
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import header_bytes
from hyper_parallel.core.distributed_checkpoint.metadata import ChunkChecksum, MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import WriteItem, WriteItemType
from hyper_parallel.platform.dtypes import DTYPE_NAMES

__all__ = [
    "WRITEBACK_BYTES",
    "CoalescingWriter",
    "FileLayout",
    "LocalDataFile",
    "StoredShape",
    "byte_view",
    "lay_out",
    "write_hashed",
]

#: A file that is to be fsynced asks the device to start writing after every this many bytes.
WRITEBACK_BYTES = 8 << 20


@dataclass(frozen=True)
class StoredShape:
    """How an item is stored as a typed tensor (what its tile checksums follow).

    Attributes:
        sizes: The chunk's shape.
        itemsize: Bytes per element.
    """

    sizes: tuple[int, ...]
    itemsize: int


@dataclass(frozen=True)
class FileLayout:
    """Where each item of one data file goes.

    Attributes:
        header: The safetensors header (length prefix included).
        offsets: Each item's absolute offset in the file, in item order.
        shapes: Each item's stored shape, ``None`` for an item stored as bytes, in item order.
    """

    header: bytes
    offsets: list[int]
    shapes: list[StoredShape | None]


def _tensor_name(index: MetadataIndex, whole: bool) -> str:
    if whole or not index.offset:
        return index.fqn
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}"


def lay_out(
    items: tuple[WriteItem, ...],
    lengths: list[int],
    *,
    file_metadata: dict[str, str],
    align: int,
    stored_as_bytes: bool,
) -> FileLayout:
    """The header and offsets of a data file holding items of ``lengths`` stored bytes. The writing rank.

    Args:
        items: The file's items, in file order.
        lengths: Each item's stored length in bytes.
        file_metadata: The header's ``__metadata__`` strings.
        align: The data region starts at a multiple of this.
        stored_as_bytes: Every item stored as ``uint8`` bytes (compressed).

    Raises:
        CheckpointValueError: a tensor name a safetensors file cannot hold.
    """
    names: list[str] = []
    used = {"__metadata__"}  # the safetensors header's reserved key
    tensors: list[tuple[str, StoredShape] | None] = []
    for item in items:
        name = _tensor_name(item.index, item.type == WriteItemType.TENSOR)
        while name in used:  # a key that itself looks like "fqn@offsets"
            name += "#"
        used.add(name)
        names.append(name)
        data = item.tensor_data
        tensors.append(None if data is None or stored_as_bytes else (
            data.properties.dtype, StoredShape(sizes=data.chunk.sizes, itemsize=DTYPE_NAMES[data.properties.dtype])))
    relative = [0, *accumulate(lengths)]
    entries = {}
    for name, tensor, begin, end in zip(names, tensors, relative, relative[1:]):
        dtype, shape = ("uint8", (end - begin,)) if tensor is None else (tensor[0], tensor[1].sizes)
        entries[name] = (dtype, shape, begin, end)
    header = header_bytes(entries, file_metadata, align=align)
    base = len(header)
    return FileLayout(header=header, offsets=[base + r for r in relative[:-1]],
                      shapes=[None if tensor is None else tensor[1] for tensor in tensors])


def write_hashed(
    out: "CoalescingWriter", view: memoryview, shape: StoredShape | None, *, block_bytes: int, tiles: bool
) -> ChunkChecksum:
    """Checksum one item's stored bytes ``view`` and append them to ``out``, each run right after it is hashed.

    The writing rank. An item of at most ``block_bytes`` without tiles is one
    digest, then one write; a larger one is hashed and written in the runs of
    :func:`.chunk_checksum` (``after``), so each byte is read from its source once.

    Args:
        out: The file being written (at this item's offset).
        view: The item's stored bytes.
        shape: Its stored shape (tiles follow it), ``None`` for bytes.
        block_bytes: Checksum block size.
        tiles: Tile checksums for wide 2-D and larger chunks.
    """
    if len(view) <= block_bytes and (shape is None or not tiles or len(shape.sizes) < 2
                                     or not tile_shape(shape.sizes, shape.itemsize, block_bytes)):
        checksum = ChunkChecksum(algorithm=ALGORITHM, block_bytes=block_bytes, digests=(digest(view),))
        out.write(view)
        return checksum
    written = 0

    def write_run(end: int) -> None:
        nonlocal written
        out.write(view[written:end])
        written = end

    return chunk_checksum(view, block_bytes, sizes=None if shape is None else shape.sizes,
                          itemsize=1 if shape is None else shape.itemsize, tiles=tiles, after=write_run)


class LocalDataFile:
    """Destination of one data file on disk: ``write`` in order, then ``commit`` (durable) or ``abort``.

    Every call goes through the writer's :class:`._file_ops.FileOps`. With
    ``sync`` the device is asked to start writing every
    :data:`WRITEBACK_BYTES` (no durability promise: ``commit`` fsyncs).
    """

    def __init__(self, path: os.PathLike | str, ops: FileOps, *, sync: bool, drop_page_cache: bool) -> None:
        self.ops = ops
        self.fd = ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.sync, self.drop_page_cache = sync, drop_page_cache
        self.position = 0
        self.started = 0  # bytes before this offset are being (or have been) written back

    def _wrote(self, count: int) -> None:
        self.position += count
        if self.sync and self.position - self.started >= WRITEBACK_BYTES:
            self.ops.start_writeback(self.fd, self.started, self.position - self.started)
            self.started = self.position

    def write(self, view: memoryview) -> None:
        """Append ``view`` (a synced file: in steps of :data:`WRITEBACK_BYTES`, each then sent to the device)."""
        if not self.sync:
            write_all(self.fd, view, self.ops)
            return
        for start in range(0, len(view), WRITEBACK_BYTES):
            piece = view[start : start + WRITEBACK_BYTES]
            write_all(self.fd, piece, self.ops)
            self._wrote(len(piece))

    def write_many(self, views: list[memoryview], nbytes: int) -> None:
        """Append ``views`` (``nbytes`` in all) with one ``writev``, uncopied."""
        written = self.ops.writev(self.fd, views)
        if written != nbytes:  # a short write (rare): write the rest piece by piece
            for view in views:
                if written >= len(view):
                    written -= len(view)
                    continue
                write_all(self.fd, view[written:], self.ops)
                written = 0
        self._wrote(nbytes)

    def commit(self) -> None:
        """fsync (when asked), then close."""
        try:
            if self.sync:
                self.ops.fsync(self.fd)
                if self.drop_page_cache:
                    # The pages are clean now: let them go rather than evict the job's working set.
                    self.ops.drop_cache(self.fd)
        finally:
            self.ops.close(self.fd)

    def abort(self) -> None:
        """Close; the writer removes the file."""
        self.ops.close(self.fd)


class CoalescingWriter:
    """Sequential writes to one destination; small pieces go many per ``write_many`` call, uncopied."""

    SMALL = 256 << 10
    FLUSH = 4 << 20
    #: Most buffers in one ``writev`` (Linux ``IOV_MAX``).
    MAX_BUFFERS = 1024

    def __init__(self, sink: LocalDataFile) -> None:
        self.sink = sink
        self.pending: list[memoryview] = []
        self.pending_bytes = 0

    def write(self, view: memoryview) -> None:
        """Append ``view`` (held until a flush when it is small)."""
        if len(view) < self.SMALL:
            if len(view):
                self.pending.append(view)
                self.pending_bytes += len(view)
            if self.pending_bytes >= self.FLUSH or len(self.pending) >= self.MAX_BUFFERS:
                self.flush()
            return
        self.flush()
        self.sink.write(view)

    def flush(self) -> None:
        """Write what is held."""
        if not self.pending:
            return
        self.sink.write_many(self.pending, self.pending_bytes)
        self.pending, self.pending_bytes = [], 0


def byte_view(data: np.ndarray | bytes) -> memoryview:
    """A flat byte view of an item's data (an array, made contiguous if it is not, or bytes)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).cast("B")
    array = np.ascontiguousarray(data)
    return memoryview(array.reshape(-1).view(np.uint8))
