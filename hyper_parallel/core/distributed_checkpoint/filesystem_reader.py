"""Reading a checkpoint directory: only the byte ranges a rank needs, verified.

For each region of a load plan the reader computes the byte runs of the box
inside its stored chunk (:mod:`._format.byte_ranges`) and reads exactly those with
``preadv``, straight into the target tensor's memory when dtype and layout
allow. With checksum verification on (the default) it first verifies every
checksum block or tile the plan's regions touch (:mod:`._verify_reads`,
hashing the bytes where they lie, in windows bounded by
``max_inflight_bytes``), and only then reads the regions into the targets:
a corrupt byte never reaches a target, and a load that fails on corruption
changes no target. The run-level reading is in :mod:`._run_reads`.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import threading
from collections import defaultdict
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from hyper_parallel.core.distributed_checkpoint._device_reads import MAX_PAGE_AMPLIFICATION, page_amplification
from hyper_parallel.core.distributed_checkpoint._format.byte_ranges import Runs, box_runs, split_box
from hyper_parallel.core.distributed_checkpoint._format.checksum import ALGORITHM
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import SAFETENSORS_DTYPES
from hyper_parallel.core.distributed_checkpoint._format.header_check import (
    HeaderSpan,
    expected_span,
    header_spans,
    span_problem,
)
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CheckpointValueError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import METADATA_FILE, rank_metadata_file
from hyper_parallel.core.distributed_checkpoint.metadata import (
    Metadata,
    StorageInfo,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint._format.metadata_json import check_consistency, metadata_from_json
from hyper_parallel.core.distributed_checkpoint._options import check_option
from hyper_parallel.core.distributed_checkpoint._read_items import ItemFacts, ItemIndex, read_small_whole, stored_dtype
from hyper_parallel.core.distributed_checkpoint._run_reads import (
    FileSource,
    read_runs,
    read_runs_verified,
    read_tiles,
    release_scratch,
    run_rows,
    scratch,
)
from hyper_parallel.core.distributed_checkpoint._verify_reads import RegionCheck, verify_regions
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointId, StorageReader
from hyper_parallel.platform.tensor import DTYPE_NAMES, numpy_dtype

__all__ = ["FileSystemReader", "MAX_METADATA_BYTES", "DEFAULT_MAX_INFLIGHT_BYTES"]

#: Metadata files larger than this are refused as hostile.
MAX_METADATA_BYTES = 1 << 30
#: Default bound on bytes buffered at once per I/O thread. With verification on, ``thread_count`` times
#: this holds the verified narrow regions of a resharded load (read once, exactly); narrow bytes beyond it
#: are read twice from the device (see ``FileSystemReader._keep_buffer``).
DEFAULT_MAX_INFLIGHT_BYTES = 128 << 20
#: First read of a data file's header: the writer starts the data region at 4096.
_HEADER_READ_BYTES = 4096
#: A file of which a rank needs at least this share is read with kernel readahead.
_SEQUENTIAL_SHARE = 0.95


def _check_within(path: Any, file_size: int, fqn: str, info: StorageInfo) -> None:
    """Refuse an item whose stored bytes end past its data file's end."""
    if info.offset + info.length > file_size:
        raise CorruptCheckpointError(
            f"data file {path} is truncated: key '{fqn}' needs bytes {info.offset}..{info.offset + info.length} "
            f"but the file has {file_size}"
        )


def _kept_rows(kept: np.ndarray, item: ReadItem) -> int:
    """Leading rows of ``item``'s region a private buffer holds (all of a 0-d region)."""
    return kept.shape[0] if kept.ndim else (item.lengths[0] if item.lengths else 0)


def _leading_rows(item: ReadItem, rows: int) -> ReadItem:
    """``item`` cut to its first ``rows`` rows (the whole item if it has as many)."""
    if not item.lengths or rows == item.lengths[0]:
        return item
    return dataclasses.replace(item, lengths=(rows,) + tuple(item.lengths[1:]))


def _rows_after(check: RegionCheck, rows: int) -> RegionCheck:
    """The part of ``check``'s region after its first ``rows`` rows."""
    return dataclasses.replace(check, offsets=(check.offsets[0] + rows,) + tuple(check.offsets[1:]),
                               lengths=(check.lengths[0] - rows,) + tuple(check.lengths[1:]))


def _fitting_rows(check: RegionCheck, item: ReadItem, room: int) -> int:
    """Leading rows of a tiled region that fit ``room`` bytes and end on a slab edge of its tile grid; 0 if none.

    Flat-verified regions are kept whole or not at all (their blocks cut across rows).
    """
    info = check.info
    if room <= 0 or check.sizes is None or info.checksum is None or not info.checksum.block_shape:
        return 0
    row_bytes = math.prod(item.lengths[1:]) * check.itemsize
    slab = info.checksum.block_shape[0]
    first = item.storage_offsets[0]
    end = (first + room // max(row_bytes, 1)) // slab * slab
    return max(0, min(end - first, item.lengths[0] - 1))


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


def _not_a_directory(path: Path) -> str:
    """The message for a checkpoint_id that is a file: a MindSpore file names its converter."""
    if path.suffix in (".ckpt", ".safetensors"):
        return (
            f"checkpoint {path} is a file, not a directory: a MindSpore {path.suffix} file? "
            f"Convert it once with `hp-ckpt import {path} OUT_DIR` and load OUT_DIR, or read it with "
            "mindspore.load_checkpoint"
        )
    return f"checkpoint {path} is a file, not a directory; pass the checkpoint directory (it holds metadata.json)"


def _committed_subdirectories(path: Path, metadata_file: str) -> list[str]:
    """Names of ``path``'s subdirectories that are committed checkpoints (a manager root), sorted."""
    try:
        entries = sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return []
    return [name for name in entries if (path / name / metadata_file).is_file()]


class FileSystemReader(StorageReader):
    """Reads a checkpoint from a local or shared-filesystem directory.

    Args:
        path: The checkpoint directory.
        verify_checksums: Verify the checksum of every block read.
        thread_count: I/O threads per rank.
        max_inflight_bytes: Bound on the bytes one thread buffers at once.
        metadata_file: Name of the metadata file (default ``metadata.json``).
        no_readahead: ``None`` (default): files this rank reads only in part
            (a resharded load) are read without kernel readahead and with
            scattered runs prefetched exactly, or read with ``O_DIRECT`` when
            they are narrower than pages (:mod:`._device_reads`), so the device
            reads about the bytes needed; files read (almost) whole keep
            readahead. ``True``: every file so; ``False``: never.
    """

    def __init__(
        self,
        path: CheckpointId,
        *,
        verify_checksums: bool = True,
        thread_count: int = 2,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        metadata_file: str | None = None,
        no_readahead: bool | None = None,
    ) -> None:
        check_option("thread_count", thread_count, int, minimum=1)
        check_option("max_inflight_bytes", max_inflight_bytes, int, minimum=1)
        self.path = Path(os.fspath(path))
        self.verify_checksums = verify_checksums
        self.thread_count = thread_count
        self.max_inflight_bytes = max_inflight_bytes
        self.metadata_file = metadata_file or METADATA_FILE
        self._configured_metadata_file = self.metadata_file
        self.no_readahead = no_readahead
        self.metadata: Metadata | None = None
        #: Bytes this reader took from storage (verified blocks, plus unverified reads).
        self.bytes_read = 0
        #: Bytes hashed by the verify passes.
        self.bytes_verified = 0
        self._verified: set[int] = set()  # id() of the read items verified (alive until the load ends)
        self._kept: dict[ReadItem, np.ndarray] = {}  # verified regions kept for the read pass
        self._kept_bytes = 0
        self._kept_lock = threading.Lock()
        self._headers: dict[str, dict[int, HeaderSpan]] = {}  # data file -> its header, read once per load
        self._header_checked: set[int] = set()  # id() of the read items checked against their file's header
        self._items: ItemIndex | None = None  # the read items' facts, looked up once per load
        self._in_part: dict[str, bool] = {}  # data file -> read without readahead (decided once per load)

    def reset(self, checkpoint_id: CheckpointId | None = None) -> None:
        """Start a new load, optionally from another directory. All ranks."""
        if checkpoint_id is not None:
            self.path = Path(os.fspath(checkpoint_id))
        self.metadata_file = self._configured_metadata_file
        self.metadata = None
        self.bytes_read = 0

    def read_metadata(self, *, rank: int | None = None) -> Metadata:
        """Read and check the committed metadata. Any rank; no collectives.

        Args:
            rank: Set when this rank loads on its own (``use_collectives=False``
                in a job of several ranks): its rank-local metadata
                ``metadata.rank<rank>.json`` is read if the directory holds
                one, the shared metadata otherwise.

        Raises:
            CheckpointNotFoundError: the directory does not exist.
            IncompleteCheckpointError: the directory has no committed metadata.
            CorruptCheckpointError / UnsafeCheckpointError: malformed or hostile metadata.
        """
        if not self.path.exists():
            raise CheckpointNotFoundError(f"checkpoint {self.path} does not exist")
        if not self.path.is_dir():
            raise CheckpointValueError(_not_a_directory(self.path))
        if rank is not None and (self.path / rank_metadata_file(rank)).is_file():
            self.metadata_file = rank_metadata_file(rank)
        meta_path = self.path / self.metadata_file
        if not meta_path.is_file():
            steps = _committed_subdirectories(self.path, self.metadata_file)
            if steps:
                raise IncompleteCheckpointError(
                    f"{self.path} is a CheckpointManager root (it holds the checkpoints {', '.join(steps[-3:])}), "
                    f"not one checkpoint: pass a step directory such as {self.path / steps[-1]} (the newest), or "
                    f"load with CheckpointManager({str(self.path)!r}).load(state_dict)"
                )
            raise IncompleteCheckpointError(
                f"checkpoint {self.path} has no {self.metadata_file}: the save did not commit (it crashed or "
                "is still running); load an earlier checkpoint"
            )
        root = os.path.realpath(self.path)
        if os.path.commonpath([root, os.path.realpath(meta_path)]) != root:
            raise UnsafeCheckpointError(f"{meta_path} is a link leading outside checkpoint {self.path}; refused")
        try:
            fd = os.open(meta_path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{meta_path} was deleted while being opened (another process removed or replaced checkpoint "
                f"{self.path}); load it again"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size > MAX_METADATA_BYTES:
                raise UnsafeCheckpointError(f"{meta_path}: metadata of {size} bytes is larger than allowed; refused")
            # An anonymous map, handed to the decoder, which unmaps it once decoded (lower peak memory).
            # One byte more than the fstat said tells a file that grew since.
            raw = mmap.mmap(-1, size + 1)
            with os.fdopen(os.dup(fd), "rb") as handle:
                count = handle.readinto(raw)
        finally:
            os.close(fd)
        if count > size:
            raw.close()
            raise UnsafeCheckpointError(f"{meta_path}: metadata grew past the size allowed while being read; refused")
        if count == 0:
            raw.close()
            return metadata_from_json(b"", source=str(meta_path))
        raw.resize(count)
        return metadata_from_json(raw, source=str(meta_path))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        """Take the metadata, after checking its items and storage entries match. All ranks call it.

        Raises:
            CorruptCheckpointError: a chunk without its storage entry, or the like (names the file and key).
        """
        check_consistency(metadata, source=f"{self.path}/{self.metadata_file}")
        self.metadata = metadata
        self._verified.clear()
        self._headers.clear()
        self._header_checked.clear()
        self._items = ItemIndex(metadata)
        self._in_part.clear()
        self._kept.clear()
        self._kept_bytes = 0

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Nothing to adjust. All ranks call it."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Nothing to adjust. Coordinator only."""
        return plans

    def resolve(self, relative_path: str, fqn: str) -> Path:
        """Return the data file path, refusing anything outside the directory.

        Raises:
            UnsafeCheckpointError: a symlink or path escaping the checkpoint.
            CorruptCheckpointError: the data file is missing.
            CheckpointNotFoundError: the checkpoint was deleted or re-saved since its metadata was read.
        """
        root = os.path.realpath(self.path)
        full = os.path.realpath(os.path.join(root, relative_path))
        if os.path.commonpath([root, full]) != root:
            raise UnsafeCheckpointError(
                f"key '{fqn}': data file {relative_path!r} resolves outside checkpoint {self.path}; refused"
            )
        if not os.path.isfile(full):
            if self._replaced():
                raise CheckpointNotFoundError(
                    f"checkpoint {self.path} was deleted or replaced by another save while loading (data file "
                    f"{relative_path} of key '{fqn}' is gone); load it again"
                )
            raise CorruptCheckpointError(
                f"key '{fqn}': data file {relative_path} (listed in {self.metadata_file}) is missing from {self.path}"
            )
        return Path(full)

    def _replaced(self) -> bool:
        """True when the metadata this load started from is no longer the committed one."""
        if self.metadata is None:
            return False
        try:
            current = metadata_from_json((self.path / self.metadata_file).read_bytes())
        except (OSError, CheckpointError):
            return not (self.path / self.metadata_file).is_file()
        return current.storage_meta.save_id != self.metadata.storage_meta.save_id

    def verify_data(self, plan: LoadPlan) -> "Future[None]":
        """Check what ``plan`` needs before any byte of it is copied. All ranks call it.

        Every touched data file's safetensors header must describe each item
        as the metadata does (name, dtype, shape, byte range; one small read
        per file, also with ``verify_checksums=False``), and with
        ``verify_checksums`` the checksum of every stored byte the plan needs
        must match. ``load`` runs it on every rank before any rank reads into
        a target, so a corrupt checkpoint fails the load with every target
        unchanged. ``read_data`` checks what was not checked yet by itself.

        Raises (through the future):
            CorruptCheckpointError: a header that disagrees with the metadata, a
                checksum mismatch or a truncated file (names file and key).
        """
        return self._run_per_file(plan, "verify", self._verify_group)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        """Read every region of this rank's plan into the planner, after verifying it. All ranks call it."""
        future = self.verify_data(plan)
        if future.exception() is not None:
            return future
        return self._run_per_file(plan, "read", lambda group: self._read_group(group, planner))

    def _run_per_file(self, plan: LoadPlan, verb: str, work_fn: Any) -> "Future[None]":
        """Run ``work_fn`` on the plan's items grouped by file, on up to ``thread_count`` threads."""
        future: Future[None] = Future()
        try:
            if self.metadata is None or self.metadata.storage_data is None:
                raise CheckpointValueError(f"{verb} called before set_up_storage_reader")
            by_file: dict[str, list[ReadItem]] = defaultdict(list)
            for item in plan.items:
                if verb == "verify" and id(item) in self._verified:
                    continue
                by_file[self._items.facts(item).info.relative_path].append(item)
            groups: list[list[tuple[str, list[ReadItem]]]] = [[] for _ in range(self.thread_count)]
            for position, entry in enumerate(sorted(by_file.items())):
                groups[position % self.thread_count].append(entry)
            work = [g for g in groups if g]
            if len(work) <= 1:
                counts = [work_fn(g) for g in work]
            else:
                with ThreadPoolExecutor(max_workers=len(work), thread_name_prefix=f"hp-ckpt-{verb}") as pool:
                    counts = list(pool.map(work_fn, work))
            if verb == "read":
                self.bytes_read += sum(counts)
            else:
                self.bytes_verified += sum(counts)
                self.bytes_read += sum(counts)
                self._verified.update(id(item) for group in work for _, items in group for item in items)
            release_scratch()  # do not keep the caller thread's scratch after the load
            future.set_result(None)
        except OSError as exc:
            if isinstance(exc, CheckpointError):  # already says what went wrong (a CheckpointNotFoundError)
                future.set_exception(exc)
            else:
                future.set_exception(CheckpointIOError(f"{verb}ing checkpoint {self.path} failed: {exc}"))
        except BaseException as exc:  # pylint: disable=broad-except
            future.set_exception(exc)
        return future

    def _verify_group(self, files: list[tuple[str, list[ReadItem]]]) -> int:
        total = 0
        for relative_path, items in files:
            with self._open_source(relative_path, items) as (source, path, size):  # checks the file's header
                if not self.verify_checksums:
                    continue
                checks = []
                checked = [(item, self._region_check(path, size, item)) for item in items]
                if isinstance(source, FileSource) and not source.exact:
                    # Read with readahead: no region gains from a private buffer (see _keep_priority).
                    total += verify_regions(source, path, [check for _, check in checked], self.max_inflight_bytes)
                    continue
                regions = [(self._keep_priority(check, item, source), item, check) for item, check in checked]
                # The regions the page cache would read most wastefully get the private budget first
                # (the sort is stable: file order among equals).
                for priority, item, check in sorted(regions, key=lambda entry: -entry[0]):
                    kept = self._keep_buffer(check, item) if priority else None
                    if kept is None:
                        checks.append(check)
                        continue
                    rows = _kept_rows(kept, item)
                    total += self._read_kept(source, path, check, _leading_rows(item, rows), kept)
                    with self._kept_lock:
                        self._kept[item] = kept
                    if item.lengths and rows < item.lengths[0]:  # the rest of the region is verified in place
                        checks.append(_rows_after(check, rows))
                total += verify_regions(source, path, checks, self.max_inflight_bytes)
        return total

    def _read_kept(self, source: FileSource, path: Path, check: RegionCheck, item: ReadItem, kept: np.ndarray) -> int:
        """Read ``item``'s region into the private buffer ``kept``, verifying every block or tile it touches."""
        if check.info.checksum.block_shape:
            return read_tiles(source, path, check.fqn, check.info, check.sizes, kept.dtype, item, kept,
                              exact=source.exact)
        runs = box_runs(check.sizes, check.itemsize, tuple(item.storage_offsets), tuple(item.lengths))
        rows = kept.reshape(-1).view(np.uint8).reshape(runs.starts.size, runs.length)
        return read_runs_verified(source, path, check.fqn, check.info, runs, rows, self.max_inflight_bytes)

    def _keep_priority(self, check: RegionCheck, item: ReadItem, source: FileSource) -> float:
        """How much a private buffer saves for ``item``'s region: 0 for none, else the device reads saved.

        Regions that gain: tiled regions of a file read with exact device reads
        whose rows share pages with bytes not needed (a narrow column split:
        the page cache would read whole pages, ``O_DIRECT`` reads only the
        region but skips the page cache, so the bytes would be read twice),
        and every tensor region of a source without a page cache (object
        storage). The value is the page amplification avoided (object storage: 1).
        """
        info = check.info
        if check.sizes is None or info.checksum is None or not math.prod(item.lengths):
            return 0.0
        if not isinstance(source, FileSource):
            return 1.0
        if not source.exact or not info.checksum.block_shape or item.lengths[-1] == check.sizes[-1]:
            return 0.0  # whole rows: contiguous pages, the page cache wastes nothing
        sample = (min(item.lengths[0], 256),) + tuple(item.lengths[1:])  # the first rows tell the pattern
        runs = box_runs(check.sizes, check.itemsize, tuple(item.storage_offsets), sample)
        waste = page_amplification(info.offset + runs.starts, runs.length)
        return waste if waste > MAX_PAGE_AMPLIFICATION else 0.0

    def _keep_buffer(self, check: RegionCheck, item: ReadItem) -> np.ndarray | None:
        """A private buffer for the region of ``item``, within ``max_inflight_bytes`` per I/O thread; else ``None``.

        Its bytes are read once, verified, and kept until the read pass copies
        them into the target (see :meth:`_keep_priority` for which regions).
        When the whole region does not fit what is left of the budget, a tiled
        region gets a buffer for its leading rows up to a slab edge of its tile
        grid (so no tile is read both ways); the caller verifies the other rows
        in place.
        """
        nbytes = math.prod(item.lengths) * check.itemsize
        shape = tuple(item.lengths)
        with self._kept_lock:  # max_inflight_bytes per I/O thread
            room = self.max_inflight_bytes * self.thread_count - self._kept_bytes
            if nbytes > room:
                rows = _fitting_rows(check, item, room)
                if not rows:
                    return None
                shape = (rows,) + shape[1:]
                nbytes = math.prod(shape) * check.itemsize
            self._kept_bytes += nbytes
        stored = self.metadata.state_dict_metadata[check.fqn]
        return np.empty(shape, dtype=numpy_dtype(stored.properties.dtype))

    def _region_check(self, path: Path, file_size: int, item: ReadItem) -> RegionCheck:
        """What to verify for ``item``, after checking it fits its file and chunk."""
        fqn = item.storage_index.fqn
        facts = self._items.facts(item)
        info = facts.info
        _check_within(path, file_size, fqn, info)
        if info.checksum is not None and info.checksum.algorithm != ALGORITHM:
            raise CorruptCheckpointError(f"key '{fqn}': unknown checksum algorithm {info.checksum.algorithm!r}")
        if info.compression is not None or item.type == LoadItemType.BYTE_IO or facts.sizes is None:
            return RegionCheck(fqn=fqn, info=info, sizes=None, itemsize=1)
        chunk_sizes, itemsize = facts.sizes, facts.itemsize
        if info.length != math.prod(chunk_sizes) * itemsize:
            raise CorruptCheckpointError(
                f"key '{fqn}': stored length {info.length} does not match chunk sizes {list(chunk_sizes)}"
            )
        return RegionCheck(fqn=fqn, info=info, sizes=chunk_sizes, itemsize=itemsize,
                           offsets=tuple(item.storage_offsets), lengths=tuple(item.lengths))

    def _read_group(self, files: list[tuple[str, list[ReadItem]]], planner: LoadPlanner) -> int:
        total = 0
        for relative_path, items in files:
            with self._open_source(relative_path, items) as (source, path, size):
                count, rest = read_small_whole(source, path, size, items, self._items, planner,
                                               verified=self.verify_checksums)
                total += count
                for item, dest in rest:
                    total += self._read_item(source, path, size, item, planner, dest)
        return total

    @contextmanager
    def _open_source(self, relative_path: str, items: list[ReadItem]) -> Iterator[tuple[FileSource, Path, int]]:
        """Open data file ``relative_path`` for ``items``: its byte source, its name for messages, its size."""
        fqn = items[0].storage_index.fqn
        path = self.resolve(relative_path, fqn)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # deleted right after resolve() saw it
            raise CheckpointNotFoundError(
                f"data file {relative_path} of key '{fqn}' was deleted while loading checkpoint {self.path} "
                "(deleted or replaced by another save); load it again"
            ) from None
        try:
            source = FileSource(fd)
            size = os.fstat(fd).st_size
            if self._reads_in_part(relative_path, items, size) and hasattr(os, "posix_fadvise"):
                # Kernel readahead would also fetch the ranges a reshard skips.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                source.exact = True
            self._check_header(source, path, size, relative_path, items)
            yield source, path, size
        finally:
            os.close(fd)

    def _reads_in_part(self, relative_path: str, items: list[ReadItem], file_size: int) -> bool:
        """Whether a file is read without readahead (see ``no_readahead``); decided once per file and load."""
        if self.no_readahead is not None:
            return self.no_readahead
        decided = self._in_part.get(relative_path)
        if decided is not None:
            return decided
        facts = self._items.facts
        needed = sum(facts(item).nbytes for item in items)
        self._in_part[relative_path] = decided = needed < _SEQUENTIAL_SHARE * file_size
        return decided

    def _read_item(
        self, source: FileSource, path: Path, file_size: int, item: ReadItem, planner: LoadPlanner, dest: np.ndarray | None = None
    ) -> int:
        fqn = item.storage_index.fqn
        check = self._region_check(path, file_size, item)
        info = check.info
        if info.compression is not None:
            return self._read_compressed(source, path, fqn, info, item, planner)
        if item.type == LoadItemType.BYTE_IO:
            buffer = np.empty((1, info.length), dtype=np.uint8)
            runs = Runs(starts=np.zeros(1 if info.length else 0, dtype=np.int64), length=info.length)
            count = self._fill(source, path, fqn, info, runs, buffer)
            planner.apply_bytes(item, buffer.tobytes())
            return count
        stored = self.metadata.state_dict_metadata.get(fqn)
        if check.sizes is None:
            raise CorruptCheckpointError(f"key '{fqn}' is read as a tensor but stored as a value")
        chunk_sizes, itemsize = check.sizes, check.itemsize
        if dest is None:
            dest = planner.acquire_tensor(item)
        with self._kept_lock:
            kept = self._kept.pop(item, None)
            self._kept_bytes -= kept.nbytes if kept is not None else 0
        skip = 0  # leading rows of the region read by the verify pass
        if kept is not None:  # verified and read by the verify pass
            skip = _kept_rows(kept, item)
            np.copyto(dest[:skip] if dest.ndim else dest, kept, casting="unsafe")
            if skip == (item.lengths[0] if item.lengths else 0):
                planner.apply_tensor(item, dest)
                return 0
        rest = _leading_rows(item, item.lengths[0] - skip).lengths if skip else item.lengths
        dtype = stored_dtype(stored.properties.dtype)
        count = 0
        # Pieces of at most max_inflight_bytes: a cast or scattered target never
        # needs a staging buffer larger than that, whatever the tensor size.
        for sub_offsets, sub_lengths in split_box(rest, itemsize, self.max_inflight_bytes):
            sub_offsets = (sub_offsets[0] + skip,) + tuple(sub_offsets[1:]) if skip else sub_offsets
            offsets = tuple(o + s for o, s in zip(item.storage_offsets, sub_offsets))
            runs = box_runs(chunk_sizes, itemsize, offsets, sub_lengths)
            if runs.total == 0:
                continue
            region = dest[tuple(slice(o, o + n) for o, n in zip(sub_offsets, sub_lengths))] if dest.ndim else dest
            rows = run_rows(region, runs, dtype)
            if rows is not None:
                count += self._fill(source, path, fqn, info, runs, rows)
                continue
            staging = scratch(runs.total).reshape(runs.starts.size, runs.length)
            count += self._fill(source, path, fqn, info, runs, staging)
            np.copyto(region, staging.view(dtype).reshape(sub_lengths), casting="unsafe")
        planner.apply_tensor(item, dest)
        return count

    def _read_compressed(
        self, source: FileSource, path: Path, fqn: str, info: StorageInfo, item: ReadItem, planner: LoadPlanner
    ) -> int:
        """Read, verify and decompress a whole compressed item, then apply its region."""
        stored_bytes = np.empty((1, info.length), dtype=np.uint8)
        runs = Runs(starts=np.zeros(1 if info.length else 0, dtype=np.int64), length=info.length)
        count = self._fill(source, path, fqn, info, runs, stored_bytes)
        raw_length = info.raw_length or 0
        try:
            import zstandard  # pylint: disable=import-outside-toplevel

            raw = zstandard.ZstdDecompressor().decompress(stored_bytes.tobytes(), max_output_size=raw_length)
        except ImportError as exc:
            raise CheckpointValueError("this checkpoint is zstd-compressed: pip install zstandard") from exc
        except zstandard.ZstdError as exc:
            raise CorruptCheckpointError(f"data file {path}, key '{fqn}': zstd data does not decompress ({exc})") from exc
        if len(raw) != raw_length:
            raise CorruptCheckpointError(
                f"data file {path}, key '{fqn}': decompressed {len(raw)} bytes, metadata says {raw_length}"
            )
        if item.type == LoadItemType.BYTE_IO:
            planner.apply_bytes(item, raw)
            return count
        stored = self.metadata.state_dict_metadata.get(fqn)
        if not isinstance(stored, TensorStorageMetadata):
            raise CorruptCheckpointError(f"key '{fqn}' is read as a tensor but stored as a value")
        chunk_sizes = self._items.chunk_sizes(stored, item.storage_index)
        if raw_length != math.prod(chunk_sizes) * DTYPE_NAMES[stored.properties.dtype]:
            raise CorruptCheckpointError(f"key '{fqn}': raw length {raw_length} does not match its chunk")
        chunk = np.frombuffer(raw, dtype=numpy_dtype(stored.properties.dtype)).reshape(chunk_sizes)
        region = chunk[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))] if chunk.ndim else chunk
        dest = planner.acquire_tensor(item)
        np.copyto(dest, region, casting="unsafe")
        planner.apply_tensor(item, dest)
        return count

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
            _check_within(path, size, index.fqn, info)
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

    def _fill(self, source: FileSource, path: Path, fqn: str, info: StorageInfo, runs: Runs, target: np.ndarray) -> int:
        """Fill ``target`` (``uint8``, one row per run) with the runs (verified before); return bytes read.

        Verified bytes are in the page cache already (the verify pass put
        them there): they are read from it, never again from the device.
        """
        if runs.total == 0:
            return 0
        verified = self.verify_checksums and info.checksum is not None
        count = read_runs(source, path, fqn, info, runs, target, exact=source.exact and not verified)
        return 0 if verified else count  # verified bytes were counted by the verify pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: CheckpointId) -> bool:
        """Any local path string or ``os.PathLike`` is a filesystem checkpoint id."""
        if isinstance(checkpoint_id, os.PathLike):
            return True
        return isinstance(checkpoint_id, str) and bool(checkpoint_id) and "://" not in checkpoint_id
