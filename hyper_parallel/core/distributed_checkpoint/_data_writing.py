"""How one rank's items become data files: which file holds which item, and the writing of one file.

:func:`file_jobs` spreads a rank's items over its data files (one per I/O
thread; the largest items first, each to the least loaded file) and names
each file from the rank, a counter and the save id, never from tensor names.
:func:`write_data_file` lays out one file's safetensors header from the plan
(sizes and offsets: the checksums go to the metadata, not the header) before
any byte is written, then streams every item from its own memory to its
offset through the sink it is given (a local file, or an object upload),
hashing each run of about a MiB just before writing it: no second copy of
the state, and each source byte read once. Items are compressed one by one,
before the header, when asked (``compression="zstd"``).
:func:`drop_pages_in_background` advises the kernel that durable data files' pages may go.

The :class:`.FileSystemWriter` (and the object-store writer built on it)
drive these; the commit is theirs.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hyper_parallel.core.distributed_checkpoint._data_file import (
    CoalescingWriter,
    LocalDataFile,
    byte_view,
    lay_out,
    write_hashed,
)
from hyper_parallel.core.distributed_checkpoint._file_ops import FileOps
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError, CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.metadata import StorageInfo
from hyper_parallel.core.distributed_checkpoint.planner import SavePlanner, WriteItem
from hyper_parallel.core.distributed_checkpoint.storage import WriteResult

__all__ = [
    "AUTO_THREAD_BYTES",
    "DATA_ALIGNMENT",
    "FileJob",
    "zstd_module",
    "file_jobs",
    "write_data_file",
    "drop_pages_in_background",
]

#: The data region of every data file starts at a multiple of this (a page; see ``build_header``).
DATA_ALIGNMENT = 4096
#: With ``thread_count=None`` a rank writing at least this many bytes uses 2 files and threads.
AUTO_THREAD_BYTES = 64 << 20


def zstd_module():
    """The ``zstandard`` module, or the error that says how to install it."""
    try:
        import zstandard  # pylint: disable=import-outside-toplevel
    except ImportError as exc:
        raise CheckpointValueError(
            "compression='zstd' needs the zstandard package: pip install 'hyper_parallel[zstd]'"
        ) from exc
    return zstandard


@dataclass(frozen=True)
class FileJob:
    """One data file of a rank's save: its name and the items it holds, in file order.

    Attributes:
        name: The file name (``r<rank>_<counter>.<save id>.safetensors``).
        items: The items, in the order they are stored.
        sizes: Each item's storage size (from the plan).
    """

    name: str
    items: tuple[WriteItem, ...]
    sizes: tuple[int, ...] = ()


def file_jobs(
    items: tuple[WriteItem, ...], *, rank: int, save_id: str, thread_count: int | None, auto_thread_bytes: int
) -> list[FileJob]:
    """Spread a rank's items over its data files (one per I/O thread). The writing rank.

    Args:
        items: The items of this rank's final plan.
        rank: The writing rank (in the file names).
        save_id: The coordinator's save id (in the file names).
        thread_count: Number of files; ``None``: 2 when the items hold at
            least ``auto_thread_bytes``, else 1.
        auto_thread_bytes: The threshold of ``thread_count=None``.
    """
    threads = thread_count
    sized = sorted(((item.storage_size(), item) for item in items), key=lambda pair: -pair[0])
    if threads is None:
        threads = 2 if sum(size for size, _ in sized) >= auto_thread_bytes else 1
    bins: list[list[tuple[int, WriteItem]]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for pair in sized:
        target = loads.index(min(loads)) if threads > 1 else 0
        bins[target].append(pair)
        loads[target] += pair[0]
    jobs = []
    for counter, pairs in enumerate(b for b in bins if b):
        # Chunks of whole pages first: each then starts on a page (the data region does), so a
        # resharded load reads page-aligned rows; safetensors allows no padding between chunks.
        # Empty items stay last (they share the end offset).
        pairs.sort(key=lambda pair: (pair[0] == 0, pair[0] % DATA_ALIGNMENT != 0))
        name = f"r{rank:05d}_{counter:03d}.{save_id}.safetensors"
        jobs.append(FileJob(name=name, items=tuple(item for _, item in pairs),
                            sizes=tuple(size for size, _ in pairs)))
    return jobs


def _item_view(item: WriteItem, size: int, planner: SavePlanner) -> memoryview:
    """The stored (uncompressed) bytes of ``item``, checked against its planned ``size``."""
    view = byte_view(planner.get_data(item))
    if len(view) != size:
        raise CheckpointError(f"key '{item.index.fqn}': planner returned {len(view)} bytes, plan says {size}")
    return view


def _compressed_views(job: FileJob, planner: SavePlanner, compression_level: int) -> list[tuple[memoryview, int]]:
    """Each item's zstd-compressed bytes and its raw length (the header needs every stored length first)."""
    compressor = zstd_module().ZstdCompressor
    views = []
    for item, size in zip(job.items, job.sizes):
        view = _item_view(item, size, planner)
        views.append((memoryview(compressor(level=compression_level).compress(view)), len(view)))
    return views


def write_data_file(
    job: FileJob,
    planner: SavePlanner,
    open_sink: Callable[[str], LocalDataFile],
    *,
    save_id: str,
    compression: str | None,
    compression_level: int,
    block_bytes: int,
    tiles: bool,
) -> list[WriteResult]:
    """Write data file ``job.name`` whole (header, then every item) and return its write results. The writing rank.

    Each item's data is asked of the planner when its turn comes, and hashed
    run by run just before the run is written (:func:`.write_hashed`).

    Args:
        job: The file and its items.
        planner: Hands each item's data (``get_data``).
        open_sink: Opens the file for streaming; the sink is committed after
            the last byte, aborted on any failure.
        save_id: Recorded in the file's safetensors metadata.
        compression: ``None`` or ``"zstd"`` (items stored as ``U8`` arrays).
        compression_level: zstd level.
        block_bytes: Block size of the stored checksums.
        tiles: Checksum 2-D and larger chunks by tiles (never for compressed items).
    """
    if compression:
        compressed = _compressed_views(job, planner, compression_level)
        lengths, raw_lengths = [len(view) for view, _ in compressed], [raw for _, raw in compressed]
        views = iter([view for view, _ in compressed])
    else:
        lengths, raw_lengths = list(job.sizes), [None] * len(job.items)
        views = map(_item_view, job.items, job.sizes, [planner] * len(job.items))
    layout = lay_out(job.items, lengths, file_metadata={"format": "hyper_parallel", "save_id": save_id},
                     align=DATA_ALIGNMENT, stored_as_bytes=bool(compression))
    sink = open_sink(job.name)
    try:
        out = CoalescingWriter(sink)
        out.write(memoryview(layout.header))
        checksums = [write_hashed(out, view, shape, block_bytes=block_bytes, tiles=tiles and not compression)
                     for view, shape in zip(views, layout.shapes)]
        out.flush()
    except BaseException:
        sink.abort()
        raise
    sink.commit()
    return [
        WriteResult(index=item.index, size_in_bytes=length, storage_data=StorageInfo(
            relative_path=job.name, offset=offset, length=length, checksum=checksum,
            compression=compression, raw_length=raw_length,
        ))
        for item, length, raw_length, offset, checksum in zip(
            job.items, lengths, raw_lengths, layout.offsets, checksums)
    ]


def drop_pages_in_background(paths: list[Path], ops: FileOps) -> threading.Thread:
    """Advise the kernel, on a started background thread, that the (durable, clean) pages of ``paths`` may go.

    Advisory only: durability was settled by the fsyncs; a file removed
    meanwhile is skipped, and no error of the advice is raised.
    """

    def run() -> None:
        for path in paths:
            try:
                fd = ops.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                ops.drop_cache(fd)
            except OSError:
                pass
            finally:
                ops.close(fd)

    thread = threading.Thread(target=run, name="hp-ckpt-drop-pages", daemon=True)
    thread.start()
    return thread
