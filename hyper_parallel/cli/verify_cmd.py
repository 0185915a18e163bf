"""``hp-ckpt verify DIR``: re-read every stored byte and check the checkpoint.

Three checks, every problem collected (none stops the others):

- each data file is a valid safetensors file, and every stored item sits at
  a header entry of the right name, dtype, shape and byte length;
- every block of every stored chunk matches its recorded checksum (a file
  too short is reported as truncated, naming the keys it loses);
- the chunks of each tensor tile its global shape exactly, and every chunk
  and value has a storage entry of the right length.
"""

from __future__ import annotations

import argparse
import math
import os
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from hyper_parallel.cli._common import checkpoint_reader, format_bytes, open_checkpoint, open_data_file
from hyper_parallel.cli._common import progress as show_progress
from hyper_parallel.core.distributed_checkpoint._format.checksum import (
    ALGORITHM,
    bad_blocks,
    expected_blocks,
    flat_count,
)
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint._format.cover import check_exact_cover
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint._format.header_check import expected_span, header_spans, span_problem
from hyper_parallel.platform.dtypes import DTYPE_NAMES

__all__ = ["VerifyProblem", "VerifyReport", "verify_checkpoint", "format_verify", "register"]


@dataclass(frozen=True)
class VerifyProblem:
    """One problem found by :func:`verify_checkpoint`.

    Attributes:
        file: The data file concerned (relative to the checkpoint), if any.
        key: The checkpoint key concerned, if any.
        message: What is wrong.
    """

    file: str | None
    key: str | None
    message: str

    def __str__(self) -> str:
        where = [f"file {self.file}"] if self.file else []
        where += [f"key '{self.key}'"] if self.key is not None else []
        return f"{', '.join(where) or 'checkpoint'}: {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify_checkpoint`.

    Attributes:
        path: The checkpoint directory.
        problems: Every problem found (empty when the checkpoint is sound).
        files_checked: Data files whose header was checked.
        chunks_checked: Stored items whose bytes were re-hashed.
        bytes_checked: Bytes re-read and hashed.
        unchecked: Stored items that carry no checksum (their bytes were not verified).
    """

    path: str
    problems: tuple[VerifyProblem, ...]
    files_checked: int
    chunks_checked: int
    bytes_checked: int
    unchecked: int = 0

    @property
    def ok(self) -> bool:
        """``True`` when no problem was found."""
        return not self.problems


def verify_checkpoint(path: str | os.PathLike, progress: bool | None = None) -> VerifyReport:
    """Re-read and check every data file, chunk checksum and tensor coverage.

    Args:
        path: The checkpoint directory.
        progress: Draw a progress bar on stderr; ``None`` (the default) draws
            it only when stderr is a terminal.

    Returns:
        A report listing every problem, each naming its file and key.

    Raises:
        CheckpointError: the metadata itself cannot be read (not a checkpoint).
    """
    directory, metadata = open_checkpoint(path)
    storage = metadata.storage_data or {}
    problems = _check_coverage(metadata)
    by_file: dict[str, list[tuple[MetadataIndex, StorageInfo]]] = defaultdict(list)
    for index, info in storage.items():
        by_file[info.relative_path].append((index, info))
    bar = show_progress(desc="verify", total=sum(info.length for info in storage.values()), unit="B",
                        unit_scale=True, enabled=progress, leave=True)
    chunk_sizes = {
        MetadataIndex(fqn, tuple(chunk.offsets)): tuple(chunk.sizes)
        for fqn, stored in metadata.state_dict_metadata.items()
        if isinstance(stored, TensorStorageMetadata)
        for chunk in stored.chunks
    }
    reader = checkpoint_reader(directory)
    files_checked = chunks_checked = bytes_checked = unchecked = 0
    try:
        for name in sorted(by_file):
            items = sorted(by_file[name], key=lambda pair: pair[1].offset)
            with ExitStack() as stack:
                try:
                    handle, size, full = stack.enter_context(open_data_file(reader, name, items[0][0].fqn))
                except (CheckpointError, FileNotFoundError) as exc:
                    keys = ", ".join(sorted({f"'{index.fqn}'" for index, _ in items}))
                    problems.append(VerifyProblem(name, None, f"{exc} (holds key(s) {keys})"))
                    bar.update(sum(info.length for _, info in items))
                    continue
                files_checked += 1
                problems.extend(_check_header(name, handle, size, full, items, metadata, chunk_sizes))
                for index, info in items:
                    found, hashed = _check_chunk(name, handle, size, index, info, metadata, chunk_sizes)
                    problems.extend(found)
                    chunks_checked += hashed is not None
                    unchecked += info.checksum is None
                    bytes_checked += hashed or 0
                    bar.update(info.length)
    finally:
        bar.close()
    return VerifyReport(str(directory), tuple(problems), files_checked, chunks_checked, bytes_checked, unchecked)


def _check_coverage(metadata: Metadata) -> list[VerifyProblem]:
    storage = metadata.storage_data or {}
    problems: list[VerifyProblem] = []
    expected: set[MetadataIndex] = set()
    for fqn in sorted(metadata.state_dict_metadata):
        stored = metadata.state_dict_metadata[fqn]
        if isinstance(stored, TensorStorageMetadata):
            for message in check_exact_cover(fqn, tuple(stored.size), stored.chunks):
                problems.append(VerifyProblem(None, fqn, f"coverage: {message}"))
            itemsize = DTYPE_NAMES.get(stored.properties.dtype)
            if itemsize is None:
                problems.append(VerifyProblem(None, fqn, f"unknown dtype {stored.properties.dtype!r}"))
            for chunk in stored.chunks:
                index = MetadataIndex(fqn, tuple(chunk.offsets))
                expected.add(index)
                info = storage.get(index)
                if info is None:
                    problems.append(VerifyProblem(None, fqn,
                                                  f"chunk at offset {list(chunk.offsets)} has no storage entry"))
                    continue
                length = info.raw_length if info.compression else info.length
                want = math.prod(chunk.sizes) * (itemsize or 0)
                if itemsize is not None and length != want:
                    problems.append(VerifyProblem(
                        info.relative_path, fqn,
                        f"chunk at offset {list(chunk.offsets)} stores {length} bytes, its sizes "
                        f"{list(chunk.sizes)} need {want}",
                    ))
        elif isinstance(stored, BytesStorageMetadata):
            for offset in stored.shard_offsets:
                index = MetadataIndex(fqn, tuple(offset))
                expected.add(index)
                if index not in storage:
                    problems.append(VerifyProblem(None, fqn, f"value at {list(offset)} has no storage entry"))
    for index, info in storage.items():
        if MetadataIndex(index.fqn, index.offset) not in expected:
            problems.append(VerifyProblem(
                info.relative_path, index.fqn, f"storage entry at offset {list(index.offset)} belongs to no item"
            ))
    return problems


def _check_header(
    name: str,
    handle: Any,
    size: int,
    full: str,
    items: list[tuple[MetadataIndex, StorageInfo]],
    metadata: Metadata,
    chunk_sizes: dict[MetadataIndex, tuple[int, ...]],
) -> list[VerifyProblem]:
    try:
        spans = header_spans(full, size, lambda count, offset: _pread(handle, count, offset),
                             keys=[index.fqn for index, _ in items])
    except CheckpointError as exc:
        return [VerifyProblem(name, None, f"invalid safetensors header: {exc}")]
    problems = []
    for index, info in items:
        stored = metadata.state_dict_metadata.get(index.fqn)
        expected = expected_span(index, info, stored, chunk_sizes.get(MetadataIndex(index.fqn, tuple(index.offset))))
        problem = span_problem(spans, info.offset, expected)
        if problem is not None:
            problems.append(VerifyProblem(name, index.fqn, f"{problem} (chunk at offset {list(index.offset)})"))
    return problems


def _pread(handle: Any, count: int, offset: int) -> bytes:
    handle.seek(offset)
    return handle.read(count)


def _check_chunk(
    name: str,
    handle: Any,
    size: int,
    index: MetadataIndex,
    info: StorageInfo,
    metadata: Metadata,
    chunk_sizes: dict[MetadataIndex, tuple[int, ...]],
) -> tuple[list[VerifyProblem], int | None]:
    """Re-hash one stored item; return its problems and the bytes hashed (``None``: not hashed)."""
    fqn = index.fqn
    where = f"chunk at offset {list(index.offset)}" if index.offset else "stored value"
    if info.offset + info.length > size:
        return [VerifyProblem(
            name, fqn,
            f"file is truncated: {where} needs bytes {info.offset}..{info.offset + info.length}, "
            f"the file has {size}",
        )], None
    checksum = info.checksum
    if checksum is None:
        return [], None
    stored = metadata.state_dict_metadata.get(fqn)
    sizes = chunk_sizes.get(MetadataIndex(fqn, tuple(index.offset))) if not info.compression else None
    itemsize = DTYPE_NAMES.get(stored.properties.dtype, 1) if isinstance(stored, TensorStorageMetadata) else 1
    if checksum.algorithm != ALGORITHM or checksum.block_bytes <= 0:
        return [VerifyProblem(name, fqn, f"{where}: unsupported checksum {checksum.algorithm!r}")], None
    blocks = expected_blocks(checksum, sizes, info.length)
    flat = flat_count(info.length, checksum.block_bytes)
    if len(checksum.digests) != blocks or (checksum.block_shape and sizes is None):
        return [VerifyProblem(
            name, fqn, f"{where}: metadata lists {len(checksum.digests)} checksums for {blocks} blocks"
        )], None
    if checksum.flat_digests and len(checksum.flat_digests) != flat:
        return [VerifyProblem(
            name, fqn, f"{where}: metadata lists {len(checksum.flat_digests)} flat_digests for {flat} flat blocks"
        )], None
    handle.seek(info.offset)
    data = handle.read(info.length)
    problems = []
    # A tiled chunk's tiles, then (format 2.2) its flat blocks: a load may verify either.
    for kind, bad in (("tile" if checksum.block_shape else "block", bad_blocks(data, checksum, sizes, itemsize)),
                      ("flat block", bad_blocks(data, checksum, sizes, itemsize, flat=True)
                       if checksum.flat_digests else [])):
        if bad:
            shown = ", ".join(str(b) for b in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            problems.append(VerifyProblem(name, fqn, f"checksum mismatch in {where} ({kind}(s) {shown})"))
    return problems, info.length


def format_verify(report: VerifyReport) -> str:
    """Render a :class:`VerifyReport` for people: a summary, then every problem."""
    summary = (
        f"{report.files_checked} file(s), {report.chunks_checked} chunk(s), "
        f"{format_bytes(report.bytes_checked)} checked"
    )
    if report.unchecked:
        summary += f"; {report.unchecked} item(s) carry no checksum"
    if report.ok:
        return f"OK: {report.path}: {summary}"
    lines = [f"FAILED: {report.path}: {len(report.problems)} problem(s); {summary}"]
    lines += [f"  {problem}" for problem in report.problems]
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    report = verify_checkpoint(args.dir, progress=False if args.no_progress else None)
    print(format_verify(report))
    return 0 if report.ok else 1


def register(subparsers: Any) -> None:
    """Add the ``verify`` subcommand to the ``hp-ckpt`` parser."""
    parser = subparsers.add_parser(
        "verify", help="re-read every chunk and check checksums, file headers and coverage",
        description="Re-read every stored byte; exit 1 naming every problem (file and key), 0 when sound.",
    )
    parser.add_argument("dir", help="the checkpoint directory")
    parser.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    parser.set_defaults(func=_run)
