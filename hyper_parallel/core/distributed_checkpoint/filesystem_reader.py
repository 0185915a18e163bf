"""Reading a checkpoint directory: only the byte ranges a rank needs, verified.

For each region of a load plan the reader computes the byte runs of the box
inside its stored chunk (:mod:`._format.byte_ranges`) and reads exactly those with
``preadv``, straight into the target tensor's memory when dtype and layout
allow. With checksum verification on (the default) it first verifies every
checksum block or tile the plan's regions touch, hashing the bytes where they
lie in windows bounded by ``max_inflight_bytes``, and only then reads the
regions into the targets: a corrupt byte never reaches a target, and a load
that fails on corruption changes no target.

The standard planner's small whole reads come as columns
(:class:`._whole_reads.WholeReadPlan`): they take the same header check,
verify pass and reads, file by file, without a ReadItem each; a subclass
overriding a per-file step is given the plan's items instead.

Where each part lives: the committed metadata file in :mod:`._metadata_file`,
the header check in :mod:`._reader_headers`, the verify pass in
:mod:`._reader_verify` (windows and hashing: :mod:`._verify_reads`), the read
pass in :mod:`._reader_reads` (run-level reading: :mod:`._run_reads`). This
module opens the files and runs the passes per file on the I/O threads.
"""

from __future__ import annotations

import os
import threading
import weakref
from operator import attrgetter
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.deferred_storage import has_storage
from hyper_parallel.core.distributed_checkpoint._format.consistency import storage_by_key
from hyper_parallel.core.distributed_checkpoint._format.metadata_json import check_consistency, metadata_from_json
from hyper_parallel.core.distributed_checkpoint._kept_files import KeptFiles, keep_cap
from hyper_parallel.core.distributed_checkpoint._metadata_file import (
    MAX_METADATA_BYTES,
    not_a_directory,
    read_committed_metadata,
)
from hyper_parallel.core.distributed_checkpoint._options import check_option
from hyper_parallel.core.distributed_checkpoint._read_items import ColumnRow, ItemIndex
from hyper_parallel.core.distributed_checkpoint._reader_headers import HeaderCheck
from hyper_parallel.core.distributed_checkpoint._reader_reads import ReadPass
from hyper_parallel.core.distributed_checkpoint._reader_verify import VerifyPass
from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource, release_scratch
from hyper_parallel.core.distributed_checkpoint._verify_reads import hash_taken
from hyper_parallel.core.distributed_checkpoint._verify_share import WindowShare
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CheckpointValueError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import METADATA_FILE, rank_metadata_file
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from hyper_parallel.core.distributed_checkpoint.storage import (
    CheckpointId,
    StorageReader,
    is_local_path,
    local_directory,
)
from hyper_parallel.core.distributed_checkpoint._whole_reads import WholeReadPlan, WholeReads

__all__ = ["FileSystemReader", "MAX_METADATA_BYTES", "DEFAULT_MAX_INFLIGHT_BYTES"]

#: Default bound on bytes buffered at once per I/O thread. With verification on, ``thread_count`` times
#: this holds the verified narrow regions of a resharded load (read once, exactly); narrow bytes beyond it
#: are read twice from the device (see ``_reader_verify.VerifyPass._keep_buffer``).
DEFAULT_MAX_INFLIGHT_BYTES = 128 << 20
#: A file of which a rank needs at least this share is read with kernel readahead.
_SEQUENTIAL_SHARE = 0.95
#: The bytes an item reads, of its ``ItemFacts`` (a C getter).
_NBYTES = attrgetter("nbytes")
#: The bytes of a column row (``ColumnRow.length``; a C getter).
_LENGTH = attrgetter("length")
#: The methods that read a plan's whole reads from its columns: a subclass overriding one of them (object
#: storage) is given every item instead.
_COLUMN_METHODS = ("_run_per_file", "_file_groups", "_open_source", "_reads_in_part", "_prime", "_check_header",
                   "_header_entries", "_whole_file_matches", "_verify_files", "_small_flat", "_read_groups",
                   "_read_small")
#: Reader class -> whether none of :data:`_COLUMN_METHODS` is overridden (weak: classes made on the fly are freed).
_READS_COLUMNS: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


class FileSystemReader(VerifyPass, ReadPass, HeaderCheck, StorageReader):
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
        self.path = local_directory(path)
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
        self._plan_checked: tuple[ReadItem, ...] | None = None  # the items of the last plan verify_data checked
        self._grouped: tuple[tuple[ReadItem, ...], list[Any]] | None = None  # a plan's items, by file and thread
        self._kept: dict[ReadItem, np.ndarray] = {}  # verified regions kept for the read pass
        self._kept_bytes = 0
        self._kept_lock = threading.Lock()
        self._headers: dict[str, dict[int, tuple[Any, ...]] | bytes] = {}  # data file -> header entries / raw header
        self._header_checked: set[int] = set()  # id() of the read items checked against their file's header
        self._header_lists: dict[str, list[ReadItem]] = {}  # data file -> the last list of its items checked whole
        self._items: ItemIndex | None = None  # the read items' facts, looked up once per load
        # The whole reads kept as columns (_whole_reads) of the plans of this load: ``_columns`` is those of the
        # plan being checked or read (data file -> rows; empty for a plan without), the others are kept across
        # the plans sharing one WholeReads (the verified plan, then its read rounds).
        self._columns: dict[str, list[ColumnRow]] = {}
        self._column_files: dict[str, list[ColumnRow]] = {}  # data file -> rows, of _column_source
        self._column_source: WholeReads | None = None
        self._column_items: tuple[ReadItem, ...] = ()  # its rows that are no small whole chunk, as items
        self._columns_unchecked: set[str] = set()  # data files whose rows await the header check
        self._columns_verified = False  # the verify pass hashed its rows
        self._split: tuple[LoadPlan, tuple[ReadItem, ...]] | None = None  # the last plan, the items it reads
        self._in_part: dict[str, bool] = {}  # data file -> read without readahead (decided once per load)
        self._resolved: dict[str, Path] = {}  # data file -> its checked path (resolved once per load)
        self._files = KeptFiles()  # the descriptors of the first pass, read by the read pass
        self._landing = False  # the read pass is running (a file found changed after it: targets may hold its bytes)
        self._aheads: list[Any] = []  # the load's priming threads (_read_priming.ReadAhead), ended by finish_load
        weakref.finalize(self, self._files.close_all)  # a reader dropped without finish_load

    def reset(self, checkpoint_id: CheckpointId | None = None) -> None:
        """Start a new load, optionally from another directory. All ranks."""
        if checkpoint_id is not None:
            self.path = local_directory(checkpoint_id)
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
            raise CheckpointValueError(not_a_directory(self.path))
        if rank is not None and (self.path / rank_metadata_file(rank)).is_file():
            self.metadata_file = rank_metadata_file(rank)
        meta_path = self.path / self.metadata_file
        return read_committed_metadata(self.path, self.metadata_file)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        """Take the metadata, after checking its items and storage entries match. All ranks call it.

        Raises:
            CorruptCheckpointError: a chunk without its storage entry, or the like (names the file and key).
        """
        by_key = storage_by_key(metadata)
        whole: dict[str, Any] = {}
        check_consistency(metadata, source=f"{self.path}/{self.metadata_file}", by_key=by_key, whole=whole)
        self.metadata = metadata
        self.finish_load()  # whatever an earlier load left
        self._items = ItemIndex(metadata, by_key=by_key, whole=whole)
        self._files.cap = keep_cap()

    def finish_load(self) -> None:
        """Close the data files the load kept open; drop its records (items, their facts, headers, groupings);
        keep ``metadata`` and the counters.

        All ranks; ``load`` calls it last, whether the load succeeded or not.
        A later ``verify_data`` or ``read_data`` needs ``set_up_storage_reader`` first.
        """
        while self._aheads:  # no priming thread (nor its descriptor) outlives the load
            self._aheads.pop().finish()
        self._files.close_all()
        self._verified.clear()
        self._plan_checked = None
        self._grouped = None
        self._headers.clear()
        self._header_checked.clear()
        self._header_lists.clear()
        self._items = None
        self._columns = self._column_files = {}
        self._column_source = None
        self._column_items = ()
        self._columns_unchecked.clear()
        self._columns_verified = False
        self._split = None
        self._in_part.clear()
        self._resolved.clear()
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
        return self._run_per_file(plan, "verify", self._verify_groups)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        """Read every region of this rank's plan into the planner, after verifying it. All ranks call it.

        Reads the files the verify pass opened through the descriptors it
        kept (up to a cap, see :mod:`._kept_files`): a data file deleted or
        replaced since it was verified is read as verified. A data file
        written to in place (its size or modification time changed) since
        the verify pass opened it fails the load.

        Raises (through the future):
            CheckpointNotFoundError: a data file beyond the cap of kept files
                was deleted or replaced since it was verified (names it).
            CorruptCheckpointError: a data file was written to in place since
                the verify pass opened it (names it; says whether targets may
                hold its unverified bytes: found after the read pass read it).
        """
        future = self.verify_data(plan)
        if future.exception() is not None:
            return future
        return self._run_per_file(plan, "read", lambda work: self._read_checked(work, planner))

    def _read_checked(self, work: list[list[tuple[str, list[ReadItem]]]], planner: LoadPlanner) -> int:
        """The read pass, after the files beyond the cap of kept ones proved to be those verified."""
        self._files.check_before_read(self.path)
        self._landing = True
        try:
            return self._read_groups(work, planner)
        finally:
            self._landing = False

    def _verify_groups(self, work: list[list[tuple[str, list[ReadItem]]]]) -> int:
        """Run the verify pass over the groups of files, one I/O thread per group; return the bytes read.

        The threads share their files' windows, so that they end together;
        with fewer groups than ``thread_count`` (a rank reading one file), the
        other threads only help (see :mod:`._verify_share`).
        """
        # Without checksums the verify pass is the header check: one small read per file and Python per
        # item, which threads would only contend for (the GIL); it runs on this thread.
        if not work or self.thread_count <= 1 or not self.verify_checksums:
            return sum(self._verify_group(group) for group in work)
        share = WindowShare(len(work))
        helpers = self.thread_count - len(work) if len(work) < self.thread_count else 0
        with ThreadPoolExecutor(max_workers=len(work) + helpers, thread_name_prefix="hp-ckpt-verify") as pool:
            helping = [pool.submit(share.help, hash_taken) for _ in range(helpers)]
            try:
                return sum(pool.map(self._verify_group, work, [share] * len(work))) + sum(
                    future.result() for future in helping)
            except BaseException:
                share.fail()  # the helpers stop at their next window (the pool waits for them)
                raise

    def _run_per_file(self, plan: LoadPlan, verb: str, run: Any) -> "Future[None]":
        """Run ``run`` on the plan's items grouped by file and dealt to ``thread_count`` groups (it returns the
        bytes it read)."""
        future: Future[None] = Future()
        try:
            if self.metadata is None or self._items is None or not has_storage(self.metadata):
                raise CheckpointValueError(f"{verb} called before set_up_storage_reader")
            items = self._plan_items(plan)
            if verb == "verify" and items is self._plan_checked:  # read_data after verify_data of this plan
                future.set_result(None)
                return future
            groups = self._file_groups(items, skip=self._verified if verb == "verify" else None)
            work = [g for g in groups if g]
            count = run(work)
            self.bytes_read += count
            if verb == "verify":
                self.bytes_verified += count
                for group in work:
                    for _, file_items in group:
                        self._verified.update(map(id, file_items))
                if work or self._plan_checked is None:  # a part of a checked plan (its values) keeps the plan
                    self._plan_checked = items
                self._columns_verified = self._columns_verified or bool(self._columns)
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

    def _plan_items(self, plan: LoadPlan) -> tuple[ReadItem, ...]:
        """The items of ``plan`` this reader reads one by one; a :class:`WholeReadPlan`'s whole reads are kept as
        columns by data file (``_columns``), read without a ReadItem each (the split is made once per plan)."""
        split = self._split
        if split is not None and split[0] is plan:
            self._columns = self._column_files if type(plan) is WholeReadPlan else {}  # pylint: disable=unidiomatic-typecheck
            return split[1]
        kind = type(self)
        reads_columns = _READS_COLUMNS.get(kind)
        if reads_columns is None:
            reads_columns = _READS_COLUMNS[kind] = all(
                getattr(kind, name) is getattr(FileSystemReader, name) for name in _COLUMN_METHODS)
        if type(plan) is not WholeReadPlan or not reads_columns:  # pylint: disable=unidiomatic-typecheck
            self._columns = {}
            return plan.items
        if plan.whole is not self._column_source:  # (a read round shares the verified plan's columns)
            files, others = self._items.columns_by_file(plan.whole)
            self._column_files, self._column_source = files, plan.whole
            self._column_items = tuple(plan.whole.read_items(others)) if others else ()
            self._columns_unchecked, self._columns_verified = set(files), False
        self._columns = self._column_files
        items = plan.rest + self._column_items if self._column_items else plan.rest
        self._split = (plan, items)
        return items

    def _file_groups(self, items: tuple[ReadItem, ...], *, skip: set[int] | None) -> list[list[tuple[str, list[ReadItem]]]]:
        """``items`` (but those whose ``id`` is in ``skip``) by data file, the files dealt to ``thread_count`` groups;
        a file holding only whole reads of the plan's columns comes with no item.

        The grouping of a whole plan is kept for the next pass over the same plan (verify, then read).
        """
        cached = self._grouped
        if not skip and cached is not None and cached[0] is items:
            return cached[1]
        by_file = self._items.by_file(items, skip=skip or None)
        for relative_path in self._columns if skip is None or not self._columns_verified else ():
            if relative_path not in by_file:  # a file of column rows only (verified ones: only read)
                by_file[relative_path] = []
        groups: list[list[tuple[str, list[ReadItem]]]] = [[] for _ in range(self.thread_count)]
        for position, entry in enumerate(sorted(by_file.items())):
            groups[position % self.thread_count].append(entry)
        if not skip:
            self._grouped = (items, groups)
        return groups

    @contextmanager
    def _open_source(self, relative_path: str, items: list[ReadItem]) -> Iterator[tuple[FileSource, Path, int]]:
        """Open data file ``relative_path`` for ``items`` (and the plan's column rows of it): its byte source, its
        name for messages, its size."""
        columns = self._columns.get(relative_path, ())
        fqn = items[0].storage_index.fqn if items else columns[0].fqn
        path = self._resolved.get(relative_path)
        first_open = path is None  # of this file in this load, whatever decides its readahead
        if first_open:  # resolved once per file and load (the verify pass, then the read pass)
            path = self._resolved[relative_path] = self.resolve(relative_path, fqn)
        kept_source = self._files.get(relative_path)
        if kept_source is not None:  # opened by the first pass: the file it checked, even if deleted since
            source, size = kept_source
            self._check_header(source, path, size, relative_path, items)
            yield source, path, size
            self._files.check_unchanged(relative_path, source.fd, fqn, self.path, landed=self._landing)
            return
        if not first_open:  # beyond the cap of kept files: must still be the file the first pass checked
            fd = self._files.reopen(relative_path, path, fqn, self.path)
        else:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # deleted right after resolve() saw it
                raise CheckpointNotFoundError(
                    f"data file {relative_path} of key '{fqn}' was deleted while loading checkpoint {self.path} "
                    "(deleted or replaced by another save); load it again"
                ) from None
        kept = False
        source = None
        try:
            source = FileSource(fd)
            stat = os.fstat(fd)
            size = stat.st_size
            if self._reads_in_part(relative_path, items, size) and hasattr(os, "posix_fadvise"):
                # Kernel readahead would also fetch the ranges a reshard skips.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                source.exact = True
            elif first_open:  # a cold file: the device starts while the header and the verify pass are prepared
                self._prime(source, size, items, columns)
            self._check_header(source, path, size, relative_path, items)
            kept = first_open and self._files.keep(relative_path, source, path, fqn, stat)
            yield source, path, size
            self._files.check_unchanged(relative_path, fd, fqn, self.path, landed=self._landing)
        finally:
            if source is not None and source.ahead is not None:
                source.ahead.stop()  # nothing more is read ahead of this pass
            if not kept:
                os.close(fd)

    def _reads_in_part(self, relative_path: str, items: list[ReadItem], file_size: int) -> bool:
        """Whether a file is read without readahead (see ``no_readahead``); decided once per file and load."""
        if self.no_readahead is not None:
            return self.no_readahead
        decided = self._in_part.get(relative_path)
        if decided is not None:
            return decided
        needed = sum(map(_NBYTES, self._items.facts_list(items))) + sum(map(_LENGTH, self._columns.get(relative_path, ())))
        self._in_part[relative_path] = decided = needed < _SEQUENTIAL_SHARE * file_size
        return decided
    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: CheckpointId) -> bool:
        """Any local path string or ``os.PathLike`` is a filesystem checkpoint id."""
        return is_local_path(checkpoint_id)
