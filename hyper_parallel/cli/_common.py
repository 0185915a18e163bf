"""Helpers shared by the ``hp-ckpt`` subcommands.

Opening a checkpoint (metadata only), assembling one full tensor at a time
from its stored chunks, reading a stored value's raw bytes, and the small
text formatting every subcommand uses (tables, byte counts, size parsing).
"""

from __future__ import annotations

import math
import os
import re
import sys
import uuid
from pathlib import Path
from contextlib import contextmanager
from typing import Any, BinaryIO, Iterable, Iterator, Sequence

import numpy as np

from hyper_parallel.core.distributed_checkpoint.api import read_metadata
from hyper_parallel.core.distributed_checkpoint._format.checksum import ALGORITHM, bad_blocks
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointExistsError,
    CheckpointValueError,
    CorruptCheckpointError,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_reader import FileSystemReader
from hyper_parallel.core.distributed_checkpoint._fsspec_reader import FsspecReader
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import is_object_url
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import DATA_FILE_PATTERN, METADATA_FILE
from hyper_parallel.core.distributed_checkpoint._format.cover import check_exact_cover
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from hyper_parallel.core.distributed_checkpoint.strategies import check_load_compatible
from hyper_parallel.core.distributed_checkpoint.type_handlers import deserialize_value
from hyper_parallel.platform.dtypes import DTYPE_NAMES, numpy_dtype

__all__ = [
    "open_checkpoint",
    "checkpoint_reader",
    "open_data_file",
    "tensor_nbytes",
    "read_full_tensor",
    "read_region",
    "read_stored_bytes",
    "rank_of_file",
    "format_table",
    "format_bytes",
    "parse_size",
    "progress",
    "prepare_output_dir",
    "atomic_output",
    "TEXT_VALUE_TYPES",
    "plain_value",
    "plain_value_text",
]

#: Stored value types decoded for display (no code runs: built-in handlers only).
TEXT_VALUE_TYPES = ("int", "float", "bool", "str", "none", "numpy.scalar")
#: Largest stored payload decoded for display.
MAX_SHOWN_VALUE_BYTES = 4096

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def open_checkpoint(path: str | os.PathLike) -> tuple[Path | str, Metadata]:
    """Read and check a checkpoint's metadata (no data is read).

    Args:
        path: The checkpoint directory, or an ``s3://bucket/prefix`` URL.

    Returns:
        The directory as a ``Path`` (a URL stays a ``str``) and its committed metadata.

    Raises:
        CheckpointError: not a directory, no committed metadata, malformed
            metadata, or an unsupported backend / format version.
    """
    location: Path | str = str(path) if is_object_url(path) else Path(os.fspath(path))
    metadata = read_metadata(location)
    check_load_compatible(metadata)
    return location, metadata


def checkpoint_reader(location: Path | str, *, verify_checksums: bool = True) -> FileSystemReader:
    """The reader of a checkpoint location: :class:`FsspecReader` for a URL, else :class:`FileSystemReader`."""
    if isinstance(location, str) and is_object_url(location):
        return FsspecReader(location, verify_checksums=verify_checksums)
    return FileSystemReader(location, verify_checksums=verify_checksums)


@contextmanager
def open_data_file(reader: FileSystemReader, name: str, fqn: str) -> Iterator[tuple[BinaryIO, int, str]]:
    """Open data file ``name`` of the reader's checkpoint for reading: handle, size, full name.

    Raises:
        CheckpointError: a name leaving the checkpoint, or a missing file (as the reader reports them).
    """
    full = reader.resolve(name, fqn)
    if isinstance(reader, FsspecReader):
        with reader.fs.open(full, "rb", cache_type="none") as handle:
            yield handle, int(handle.size), f"{reader.path}/{name}"
        return
    with open(full, "rb") as handle:
        yield handle, os.fstat(handle.fileno()).st_size, str(full)


def tensor_nbytes(stored: TensorStorageMetadata) -> int:
    """Bytes of the full (unsharded) tensor."""
    return math.prod(stored.size) * DTYPE_NAMES[stored.properties.dtype]


class _RegionPlanner(LoadPlanner):
    """Plans the read of one box of one tensor from every stored chunk it overlaps.

    Built directly from the metadata (no state-dict flattening), so nothing
    outlives the read but the returned array.
    """

    def __init__(self, fqn: str, stored: TensorStorageMetadata, offsets: tuple[int, ...], target: np.ndarray) -> None:
        self.fqn, self.stored, self.offsets, self.target = fqn, stored, offsets, target

    def configure_planner(
        self, state_dict: dict[str, Any], metadata: Metadata, *, rank: int = 0, world_size: int = 1,
        is_coordinator: bool = True,
    ) -> None:
        """Nothing to configure: the target was given to the constructor. Single process."""

    def build_local_plan(self) -> LoadPlan:
        """One read item per stored chunk overlapping the box. Single process."""
        dest = MetadataIndex(self.fqn, ())
        items = []
        sizes = self.target.shape
        for chunk in self.stored.chunks:
            lo = tuple(max(a, b) for a, b in zip(self.offsets, chunk.offsets))
            hi = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offsets, sizes, chunk.offsets, chunk.sizes))
            if math.prod(chunk.sizes) == 0 or any(h <= l for l, h in zip(lo, hi)):
                continue
            items.append(ReadItem(
                LoadItemType.TENSOR, dest, tuple(l - o for l, o in zip(lo, self.offsets)),
                MetadataIndex(self.fqn, tuple(chunk.offsets)), tuple(l - c for l, c in zip(lo, chunk.offsets)),
                tuple(h - l for l, h in zip(lo, hi)),
            ))
        return LoadPlan(items=tuple(items))

    def build_global_plan(self, all_plans: list[LoadPlan]) -> list[LoadPlan]:
        """Keep the plan. Single process."""
        return all_plans

    def finalize_plan(self, plan: LoadPlan) -> LoadPlan:
        """Keep the plan. Single process."""
        return plan

    def acquire_tensor(self, read_item: ReadItem) -> np.ndarray:
        """Return the item's region of the box. Called by the reader."""
        slices = tuple(slice(o, o + n) for o, n in zip(read_item.dest_offsets, read_item.lengths))
        return self.target[slices] if slices else self.target[...]

    def apply_tensor(self, read_item: ReadItem, tensor: np.ndarray) -> None:
        """The region was filled in place. Called by the reader."""

    def apply_bytes(self, read_item: ReadItem, value: bytes) -> None:
        """Never called: only tensor chunks are planned."""
        raise CheckpointValueError(f"key '{read_item.dest_index.fqn}' is not a tensor")


def read_region(
    directory: Path | str, metadata: Metadata, fqn: str, offsets: Sequence[int], sizes: Sequence[int], *,
    verify_checksums: bool = True,
) -> np.ndarray:
    """Read one box of a stored tensor (the chunks it overlaps, nothing else).

    Args:
        directory: The checkpoint directory.
        metadata: Its metadata (from :func:`open_checkpoint`).
        fqn: The tensor's key.
        offsets: Global offset of the box.
        sizes: Extent of the box.
        verify_checksums: Verify the checksum of every block read.

    Returns:
        A new array of the stored dtype and shape ``sizes``.

    Raises:
        CheckpointValueError: ``fqn`` is not a tensor, or the box leaves it.
        CorruptCheckpointError: chunks that do not tile the tensor, a checksum
            mismatch or a truncated file (names file and key).
    """
    stored = metadata.state_dict_metadata.get(fqn)
    if not isinstance(stored, TensorStorageMetadata):
        raise CheckpointValueError(f"key '{fqn}' is not a tensor of checkpoint {directory}")
    offsets, sizes = tuple(int(o) for o in offsets), tuple(int(n) for n in sizes)
    if len(offsets) != len(stored.size) or any(o < 0 or o + n > s for o, n, s in zip(offsets, sizes, stored.size)):
        raise CheckpointValueError(
            f"key '{fqn}': box at {list(offsets)} of {list(sizes)} leaves the global shape {list(stored.size)}"
        )
    problems = check_exact_cover(fqn, tuple(stored.size), stored.chunks)
    if problems:
        raise CorruptCheckpointError(f"checkpoint {directory}: {'; '.join(problems)}")
    target = np.empty(sizes, dtype=numpy_dtype(stored.properties.dtype))
    reader = checkpoint_reader(directory, verify_checksums=verify_checksums)
    reader.set_up_storage_reader(metadata, True)
    planner = _RegionPlanner(fqn, stored, offsets, target)
    try:
        reader.read_data(planner.build_local_plan(), planner).result()
    finally:
        reader.finish_load()  # closes the data files the read kept open
    return target


def read_full_tensor(
    directory: Path | str, metadata: Metadata, fqn: str, *, verify_checksums: bool = True
) -> np.ndarray:
    """Assemble one full tensor from its stored chunks.

    Only this tensor's chunks are read, by :class:`FileSystemReader` (which
    verifies checksums) into a new array of the stored dtype (bfloat16 uses
    MindSpore's numpy ``bfloat16``), so memory is bounded by this tensor plus
    one chunk.

    Args:
        directory: The checkpoint directory.
        metadata: Its metadata (from :func:`open_checkpoint`).
        fqn: The tensor's key.
        verify_checksums: Verify the checksum of every block read.

    Returns:
        The full tensor, with the stored global shape.

    Raises:
        CheckpointValueError: ``fqn`` is not a tensor of the checkpoint.
        CorruptCheckpointError: chunks that do not tile the tensor, a checksum
            mismatch or a truncated file (names file and key).
    """
    stored = metadata.state_dict_metadata.get(fqn)
    if not isinstance(stored, TensorStorageMetadata):
        raise CheckpointValueError(f"key '{fqn}' is not a tensor of checkpoint {directory}")
    return read_region(directory, metadata, fqn, (0,) * len(stored.size), stored.size,
                       verify_checksums=verify_checksums)


def read_stored_bytes(directory: Path | str, metadata: Metadata, index: MetadataIndex) -> bytes:
    """Return the raw stored bytes of one item, checksum verified.

    Used for non-tensor values, whose payload is compared or shown without
    decoding (so a pickled payload is never unpickled).

    Raises:
        CorruptCheckpointError: no storage entry, a truncated file or a checksum mismatch.
    """
    info = (metadata.storage_data or {}).get(MetadataIndex(index.fqn, index.offset))
    if info is None:
        raise CorruptCheckpointError(f"key '{index.fqn}': no storage entry in the metadata of {directory}")
    with open_data_file(checkpoint_reader(directory), info.relative_path, index.fqn) as (handle, _, path):
        handle.seek(info.offset)
        data = handle.read(info.length)
    if len(data) != info.length:
        raise CorruptCheckpointError(f"data file {path} is truncated while reading key '{index.fqn}'")
    checksum = info.checksum
    if checksum is not None and checksum.algorithm == ALGORITHM and bad_blocks(data, checksum, None, 1):
        raise CorruptCheckpointError(f"checksum mismatch in data file {path}, key '{index.fqn}'")
    return data


def rank_of_file(name: str) -> int | None:
    """Return the rank that wrote data file ``name`` (from its name), or ``None``."""
    match = DATA_FILE_PATTERN.match(os.path.basename(name))
    return int(match.group(1)) if match else None


def format_bytes(count: int) -> str:
    """Return ``count`` bytes in a short human form (``"1.5 MiB"``)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"  # pragma: no cover


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Return a plain-text table: a header line, a rule, one line per row.

    Columns holding only numbers are right-aligned.
    """
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) and bool(rows) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [c.rjust(w) if n else c.ljust(w) for c, w, n in zip(row, widths, numeric)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def parse_size(text: str | int) -> int:
    """Parse a size such as ``"5GB"`` (10**9), ``"500MiB"`` (2**20) or ``1024``.

    Raises:
        CheckpointValueError: not a positive size.
    """
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_PATTERN.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise CheckpointValueError(
                f"cannot parse size {text!r}: use a number with an optional unit (KB, MB, GB, KiB, MiB, GiB)"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise CheckpointValueError(f"size must be positive, got {text!r}")
    return value


def progress(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str,
    unit: str = "it",
    total: int | None = None,
    enabled: bool | None = None,
    unit_scale: bool = False,
    leave: bool = False,
) -> Any:
    """A ``tqdm`` progress bar on stderr over ``iterable`` (or updated by hand with ``.update(n)``).

    Args:
        iterable: What to iterate; ``None`` for a bar advanced with ``update``.
        desc: The label in front of the bar.
        unit: What one step counts (``"B"`` with ``unit_scale`` shows kB, MB...).
        total: The number of steps (taken from ``len(iterable)`` when it has one).
        enabled: ``None`` (default): only when stderr is a terminal; ``True`` / ``False`` force it.
        unit_scale: Scale counts with SI prefixes.
        leave: Keep the finished bar on screen.
    """
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel

    return tqdm(iterable, desc=desc, unit=unit, total=total, disable=None if enabled is None else not enabled,
                leave=leave, unit_scale=unit_scale, file=sys.stderr)


def plain_value(directory: Path, metadata: Metadata, fqn: str) -> tuple[bool, Any]:
    """Decode a small plain value (int, float, bool, str, None, numpy scalar). Never unpickles.

    Returns:
        ``(True, value)``, or ``(False, None)`` when ``fqn`` is not such a value
        (a tensor, a per-rank ShardedObject, another type, or too large).

    Raises:
        CorruptCheckpointError: As :func:`read_stored_bytes`.
    """
    stored = metadata.state_dict_metadata.get(fqn)
    info = (metadata.storage_data or {}).get(MetadataIndex(fqn, ()))
    if not isinstance(stored, BytesStorageMetadata) or stored.type_name not in TEXT_VALUE_TYPES or (
        stored.global_shape or info is None or info.length > MAX_SHOWN_VALUE_BYTES
    ):
        return False, None
    payload = read_stored_bytes(directory, metadata, MetadataIndex(fqn, ()))
    return True, deserialize_value(stored.type_name, payload, key=fqn)


def plain_value_text(directory: Path, metadata: Metadata, fqn: str, width: int = 60) -> str | None:
    """``repr`` of :func:`plain_value` (cut to ``width`` characters), or ``None``."""
    known, value = plain_value(directory, metadata, fqn)
    if not known:
        return None
    text = repr(value.item() if isinstance(value, np.generic) else value)
    return text if len(text) <= width else text[: width - 3] + "..."


def prepare_output_dir(out: Path) -> None:
    """Create ``out`` for a command's output, refusing anything but a new or empty directory.

    Raises:
        CheckpointExistsError: ``out`` is a file, a committed checkpoint, or a
            directory that is not empty (nothing is replaced).
    """
    if out.exists() and not out.is_dir():
        raise CheckpointExistsError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if (out / METADATA_FILE).exists():
            raise CheckpointExistsError(
                f"output directory {out} is a committed checkpoint; write into a new or empty directory "
                "(nothing was replaced)"
            )
        raise CheckpointExistsError(f"output directory {out} is not empty; choose a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)


@contextmanager
def atomic_output(path: Path) -> Iterator[BinaryIO]:
    """Write ``path`` atomically: a ``.<name>.<random>.partial`` file, fsynced, then renamed.

    On any exception the partial file is removed and ``path`` is untouched.
    """
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        with open(partial, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
