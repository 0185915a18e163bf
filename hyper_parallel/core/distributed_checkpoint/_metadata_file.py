"""A checkpoint's committed metadata file, read and refused when it is missing, hostile or too large."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Iterable, Sequence, TypeVar

from hyper_parallel.core.distributed_checkpoint._format.metadata_json import MAX_METADATA_BYTES, metadata_from_json
from hyper_parallel.core.distributed_checkpoint._commit_cleanup import DATA_FILE_PATTERN, committed_save_id
from hyper_parallel.core.distributed_checkpoint._format.deferred_storage import DecodedMetadata
from hyper_parallel.core.distributed_checkpoint._format.indexed_storage import IndexedStorage
from hyper_parallel.core.distributed_checkpoint._format.rank_index import MAX_INDEX_BYTES
from hyper_parallel.core.distributed_checkpoint._gc_pause import gc_paused
from hyper_parallel.core.distributed_checkpoint._safe_files import open_regular
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata

__all__ = ["MAX_METADATA_BYTES", "NEWEST_NOTE", "IndexFiles", "bind_index_files", "mindspore_files", "newest_file",
           "not_a_directory", "rank_local_names", "read_committed_metadata", "read_index_file", "uncommitted_message"]

_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
#: Metadata files smaller than this are read into a bytearray, larger ones into an anonymous map.
_HEAP_READ_BYTES = 16 << 20


def not_a_directory(path: Path) -> str:
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


#: Said after the command importing the newest of several ``.ckpt`` files (:func:`newest_file`).
NEWEST_NOTE = " (the newest; each .ckpt file is a checkpoint of its own)"
_File = TypeVar("_File", Path, os.DirEntry)


def newest_file(files: Sequence[_File]) -> _File:
    """The file of ``files`` written last (``ModelCheckpoint``'s latest step): by modification time, then name."""
    return max(files, key=lambda file: (file.stat().st_mtime, file.name))


def mindspore_files(path: Path) -> list[str]:
    """MindSpore checkpoint files in ``path`` or in its ``rank_<i>`` directories (a MindSpore job's output), as
    paths relative to ``path``, sorted; at most a few looked at."""
    found: list[str] = []
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)[:1000]
        for entry in entries:
            if entry.name.startswith("rank_") and entry.is_dir():
                found.extend(f"{entry.name}/{name}" for name in sorted(os.listdir(entry.path))
                             if name.endswith((".ckpt", ".safetensors")))
            elif entry.name.endswith((".ckpt", ".safetensors")) and not DATA_FILE_PATTERN.match(entry.name):
                found.append(entry.name)
            if len(found) >= 3:
                break
    except OSError:
        return []
    return found


def _flat_import(path: Path) -> str:
    """The ``hp-ckpt import`` command for MindSpore files directly in ``path``: the directory when it holds
    safetensors files (a model's shards, imported together), else its one ``.ckpt`` file, or the newest of
    several (each is a checkpoint of its own: ModelCheckpoint writes one per save). Both kinds of file: a
    command for each (``hp-ckpt import`` refuses the directory, it cannot know which one is meant)."""
    try:
        files = [entry for entry in sorted(os.scandir(path), key=lambda e: e.name)[:1000]
                 if entry.name.endswith((".ckpt", ".safetensors")) and not DATA_FILE_PATTERN.match(entry.name)]
        ckpts = [entry for entry in files if entry.name.endswith(".ckpt")]
        if not ckpts:
            return f"`hp-ckpt import {path} OUT_DIR`"
        newest = newest_file(ckpts)
        indexes = sorted(path.glob("*.safetensors.index.json"))
    except OSError:
        return f"`hp-ckpt import {path} OUT_DIR`"
    ckpt = f"`hp-ckpt import {path / newest.name} OUT_DIR`" + (NEWEST_NOTE if len(ckpts) > 1 else "")
    safetensors = [entry.name for entry in files if entry.name.endswith(".safetensors")]
    if not safetensors:
        return ckpt
    if len(indexes) == 1 or len(safetensors) == 1:
        model = f"`hp-ckpt import {indexes[0] if len(indexes) == 1 else path / safetensors[0]} OUT_DIR`"
    else:
        model = f"`hp-ckpt import {path} OUT_DIR` after moving its .ckpt files out"
    return (f"{model} for the .safetensors files, or {ckpt} for the .ckpt file (the directory itself holds both "
            "kinds and is not imported whole)")


def _rank_local_metadata(path: Path, metadata_file: str) -> list[str]:
    """Names of the rank-local metadata files (``metadata.rank<r>.json``) beside a missing ``metadata_file``, sorted."""
    try:
        return rank_local_names((e.name for e in os.scandir(path) if e.is_file()), metadata_file)
    except OSError:
        return []


def rank_local_names(names: Iterable[str], metadata_file: str) -> list[str]:
    """Those of ``names`` (a checkpoint's files or objects) that are rank-local metadata of ``metadata_file``
    (``metadata.rank<r>.json``: a save with ``use_collectives=False``), sorted."""
    stem, _, suffix = metadata_file.rpartition(".")
    return sorted(name for name in names if name.startswith(f"{stem}.rank") and name.endswith(f".{suffix}"))


def uncommitted_message(location: str, metadata_file: str, rank_local: list[str]) -> str:
    """Why a checkpoint without ``metadata_file`` does not load: only rank-local saves (``rank_local``, their
    names), or a save that did not commit. For every storage."""
    if rank_local:
        return (
            f"checkpoint {location} has no {metadata_file}, only rank-local saves ({', '.join(rank_local[:3])}"
            f"{', ...' if len(rank_local) > 3 else ''}: saved with use_collectives=False, each rank alone): "
            "load them with dcp.load(..., use_collectives=False) on each rank (each reads its own file, in "
            "the layout it saved), or save with collectives to load collectively or reshard"
        )
    return (f"checkpoint {location} has no {metadata_file}: the save did not commit (it crashed or is still "
            "running); load an earlier checkpoint")


@gc_paused  # thousands of records, no cycles: a collection meanwhile only walks them (measured 25% of the decode)
def read_committed_metadata(path: Path, metadata_file: str) -> Metadata:
    """Read and decode ``path / metadata_file``. Any rank; no collectives.

    Raises:
        IncompleteCheckpointError: no committed metadata (names the newest step of a manager root).
        CheckpointNotFoundError: the file was deleted while being opened.
        UnsafeCheckpointError: a link leading outside the checkpoint, or a file larger than allowed.
        CorruptCheckpointError: metadata that does not decode.
    """
    meta_path = path / metadata_file
    if not meta_path.is_file():
        steps = _committed_subdirectories(path, metadata_file)
        if steps:
            raise IncompleteCheckpointError(
                f"{path} is a CheckpointManager root (it holds the checkpoints {', '.join(steps[-3:])}), "
                f"not one checkpoint: pass a step directory such as {path / steps[-1]} (the newest), or "
                f"load with CheckpointManager({str(path)!r}).load(state_dict)"
            )
        theirs = mindspore_files(path)
        if theirs:
            convert = (f"`hp-ckpt import {path} OUT_DIR --strategy FILE` (the job's strategy file)"
                       if "/" in theirs[0] else _flat_import(path))
            raise IncompleteCheckpointError(
                f"{path} holds MindSpore checkpoint files ({', '.join(theirs)}), not a checkpoint of "
                f"hyper_parallel (no {metadata_file}): read them with mindspore.load_checkpoint, or convert "
                f"them once with {convert} and load OUT_DIR"
            )
        raise IncompleteCheckpointError(uncommitted_message(str(path), metadata_file,
                                                            _rank_local_metadata(path, metadata_file)))
    root = os.path.realpath(path)
    if os.path.commonpath([root, os.path.realpath(meta_path)]) != root:
        raise UnsafeCheckpointError(f"{meta_path} is a link leading outside checkpoint {path}; refused")
    try:
        fd = os.open(meta_path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{meta_path} was deleted while being opened (another process removed or replaced checkpoint "
            f"{path}); load it again"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_METADATA_BYTES:
            raise UnsafeCheckpointError(f"{meta_path}: metadata of {size} bytes is larger than allowed; refused")
        # A buffer handed to the decoder, which frees it once decoded (lower peak memory): up to
        # _HEAP_READ_BYTES a bytearray (heap memory the allocator reuses: no fresh page to fault in, as a
        # map of each load's metadata took, about 1 us per 4 KiB page here), above it an anonymous map
        # (unmapped at once). One byte more than the fstat said tells a file that grew since.
        # MAP_POPULATE: the map's pages are made in one call instead of one fault each (half the cost here).
        raw = bytearray(size + 1) if size < _HEAP_READ_BYTES else mmap.mmap(
            -1, size + 1, flags=_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        with os.fdopen(os.dup(fd), "rb") as handle:
            count = handle.readinto(raw)
    finally:
        os.close(fd)
    if count > size:
        _release(raw)
        raise UnsafeCheckpointError(f"{meta_path}: metadata grew past the size allowed while being read; refused")
    if count == 0:
        _release(raw)
        return metadata_from_json(b"", source=str(meta_path))
    if isinstance(raw, bytearray):
        del raw[count:]
    else:
        raw.resize(count)
    return bind_index_files(metadata_from_json(raw, source=str(meta_path)), path)


class IndexFiles:
    """Reads the rank index files of checkpoint directory ``path`` (:func:`read_index_file`); pickles as its path.

    Args:
        path: The checkpoint directory.
        save_id: The save whose metadata lists the files (tells a checkpoint replaced meanwhile).
    """

    picklable = True

    def __init__(self, path: Path, save_id: str) -> None:
        self.path = Path(path)
        self.save_id = save_id

    def __call__(self, name: str, limit: int = MAX_INDEX_BYTES) -> bytes:
        return read_index_file(self.path, name, save_id=self.save_id, limit=limit)


def bind_index_files(metadata: Metadata, path: Path) -> Metadata:
    """Let an indexed checkpoint's ``storage_data`` read its rank index files from directory ``path``. Any rank."""
    if isinstance(metadata, DecodedMetadata):  # its storage entries are all in metadata.json (none indexed)
        return metadata
    storage = metadata.storage_data
    if isinstance(storage, IndexedStorage):
        storage.bind(IndexFiles(path, metadata.storage_meta.save_id))
    return metadata


def read_index_file(path: Path, name: str, *, save_id: str | None = None, limit: int = MAX_INDEX_BYTES) -> bytes:
    """The first ``limit`` bytes of rank index file ``name`` of checkpoint ``path``: inside it, a regular file,
    size-capped. Any rank.

    Raises:
        UnsafeCheckpointError: a link (or anything but a regular file), or a file over the size cap.
        CheckpointNotFoundError: the file is gone because the checkpoint was deleted or replaced by another save
            (its ``metadata.json`` no longer records ``save_id``).
        CorruptCheckpointError: the file is missing from the checkpoint.
        CheckpointIOError: it cannot be read.
    """
    full = path / name
    root = os.path.realpath(path)
    if os.path.commonpath([root, os.path.realpath(full)]) != root:
        raise UnsafeCheckpointError(f"{full}: index file is a link leading outside checkpoint {path}; refused")
    try:
        fd = open_regular(full, limit=MAX_INDEX_BYTES)
        try:  # one read of the file's size (no larger buffer), at most limit bytes
            return os.pread(fd, min(os.fstat(fd).st_size, limit), 0)
        finally:
            os.close(fd)
    except FileNotFoundError:
        if save_id is not None and committed_save_id(path / "metadata.json") != save_id:
            raise CheckpointNotFoundError(
                f"checkpoint {path} was deleted or replaced by another save while loading (its rank index file "
                f"{name} is gone); load it again") from None
        raise CorruptCheckpointError(
            f"{full}: the rank index file listed in the metadata is missing (deleted or not copied with the "
            "checkpoint): copy the whole checkpoint directory, or load an earlier checkpoint") from None
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointIOError(f"reading index file {full} failed: {exc}") from exc


def _release(raw: bytearray | mmap.mmap) -> None:
    """Free a read buffer not handed to the decoder."""
    if isinstance(raw, bytearray):
        raw.clear()
    else:
        raw.close()
