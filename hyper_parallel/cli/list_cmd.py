"""``hp-ckpt list ROOT``: the steps of a ``CheckpointManager`` (or ``CheckpointCallback``) root.

One row per step directory (``<prefix><digits>``, e.g. ``step_00000120``):
its status, ``committed`` (metadata present and readable), ``in progress``
(a save holds its lease right now), ``uncommitted`` (a crashed or abandoned
save) or ``damaged`` (metadata present but unreadable); the bytes on disk;
and, from the root's record of its prefix (``manager.json``, or
``manager.<prefix>.json`` for a prefix other than ``step_``), whether it is kept forever, when it
was saved and its metrics. Only metadata is read.

An object-store root (``s3://bucket/prefix``) lists its step prefixes the
same way; there a step without metadata is ``in progress`` while its newest
object is younger than the manager's grace period (no lease exists on object
storage), ``uncommitted`` after it; its record is the object ``manager.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from hyper_parallel.cli._common import format_bytes, format_table
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import is_object_url
from hyper_parallel.core.distributed_checkpoint._manager_record import (
    ManagerRecord,
    read_object_record,
    read_record,
    record_name,
)
from hyper_parallel.core.distributed_checkpoint._object_steps import ObjectStepRoot
from hyper_parallel.core.distributed_checkpoint._save_lease import live_lease_in
from hyper_parallel.core.distributed_checkpoint.api import read_metadata
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointValueError,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import METADATA_FILE

__all__ = ["StepEntry", "list_steps", "format_list", "register"]

_STEP_NAME = re.compile(r"(?P<prefix>[^.].*?)(?P<step>\d+)")


@dataclass(frozen=True)
class StepEntry:
    """One step directory of a manager root.

    Attributes:
        name: The directory name.
        step: The step number (the trailing digits).
        status: ``"committed"``, ``"in progress"``, ``"uncommitted"`` or ``"damaged"``.
        size: Bytes of the files in the directory.
        keep_forever: The manager record promises to keep it.
        saved_at: Commit time from the record (seconds since the epoch), or ``None``.
        metrics: The metrics given to ``CheckpointManager.save``, or ``None``.
        detail: Who holds an in-progress save, or why a step is damaged.
    """

    name: str
    step: int
    status: str
    size: int
    keep_forever: bool = False
    saved_at: float | None = None
    metrics: dict[str, Any] | None = None
    detail: str = ""


def _size(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def _status(path: Path) -> tuple[str, str]:
    if (path / METADATA_FILE).is_file():
        try:
            read_metadata(path)
        except (CheckpointError, OSError) as exc:
            return "damaged", str(exc)
        return "committed", ""
    holder = live_lease_in(path)
    if holder is not None:
        return "in progress", holder.describe()
    return "uncommitted", ""


class _Records:
    """The manager record of each step prefix, read once (a damaged record does not hide the steps)."""

    def __init__(self, read: Callable[[str], ManagerRecord]) -> None:
        self._read = read
        self._records: dict[str, ManagerRecord] = {}

    def of(self, prefix: str) -> ManagerRecord:
        """The record of the managers of ``prefix``."""
        if prefix not in self._records:
            try:
                self._records[prefix] = self._read(record_name(prefix))
            except CheckpointError:
                self._records[prefix] = ManagerRecord()
        return self._records[prefix]


def _object_steps(url: str) -> tuple[StepEntry, ...]:
    objects = ObjectStepRoot(url, METADATA_FILE)
    records = _Records(lambda name: read_object_record(objects.fs, objects.root, objects.url, name))
    entries = []
    for entry in objects.entries():
        match = _STEP_NAME.fullmatch(entry.name)
        if match is None:
            continue
        location = objects.location(entry.name)
        if entry.tag is not None:
            try:
                read_metadata(location)
                status, detail = "committed", ""
            except (CheckpointError, OSError) as exc:
                status, detail = "damaged", str(exc)
        else:
            status, detail = ("uncommitted", "") if objects.is_abandoned(entry) else ("in progress", "recent objects")
        size = int(objects.fs.du(f"{objects.root}/{entry.name}"))
        step = int(match.group("step"))
        known = records.of(match.group("prefix")).steps.get(step) if status == "committed" else None
        entries.append(StepEntry(name=entry.name, step=step, status=status, size=size, detail=detail,
                                 keep_forever=bool(known and known.keep_forever),
                                 saved_at=known.saved_at if known else None,
                                 metrics=known.metrics if known else None))
    return tuple(sorted(entries, key=lambda e: (e.step, e.name)))


def list_steps(root: str | os.PathLike) -> tuple[StepEntry, ...]:
    """List the step directories (or, under an ``s3://`` root, step prefixes) of a manager root, by step.

    Raises:
        CheckpointNotFoundError: ``root`` does not exist.
        CheckpointValueError: ``root`` is one checkpoint (or a file), not a manager root.
    """
    if is_object_url(root):
        return _object_steps(str(root))
    path = Path(os.fspath(root))
    if not path.exists():
        raise CheckpointNotFoundError(f"manager root {path} does not exist")
    if not path.is_dir() or (path / METADATA_FILE).is_file():
        raise CheckpointValueError(
            f"{path} is one checkpoint, not a manager root holding step directories; use `hp-ckpt inspect {path}`"
        )
    records = _Records(lambda name: read_record(path, name))
    entries = []
    for entry in os.scandir(path):
        match = _STEP_NAME.fullmatch(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        step = int(match.group("step"))
        status, detail = _status(Path(entry.path))
        known = records.of(match.group("prefix")).steps.get(step) if status == "committed" else None
        entries.append(StepEntry(
            name=entry.name, step=step, status=status, size=_size(Path(entry.path)),
            keep_forever=bool(known and known.keep_forever), saved_at=known.saved_at if known else None,
            metrics=known.metrics if known else None, detail=detail,
        ))
    return tuple(sorted(entries, key=lambda e: (e.step, e.name)))


def format_list(root: str | os.PathLike, entries: tuple[StepEntry, ...]) -> str:
    """Render :func:`list_steps` as a table plus a summary line."""
    if not entries:
        return f"no step directories in {root}"
    rows = []
    for e in entries:
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.saved_at)) if e.saved_at is not None else "-"
        rows.append([e.name, e.status + (f" ({e.detail})" if e.detail else ""), format_bytes(e.size),
                     "yes" if e.keep_forever else "-", saved,
                     json.dumps(e.metrics, sort_keys=True) if e.metrics is not None else "-"])
    committed = [e for e in entries if e.status == "committed"]
    newest = f"; newest committed: {committed[-1].name}" if committed else ""
    summary = (f"{len(committed)} committed of {len(entries)} step(s), "
               f"{format_bytes(sum(e.size for e in entries))} in {root}{newest}")
    return format_table(["step", "status", "size", "kept forever", "saved (UTC)", "metrics"], rows) + "\n\n" + summary


def _run(args: argparse.Namespace) -> int:
    entries = list_steps(args.root)
    if args.json:
        print(json.dumps([asdict(e) for e in entries], indent=2))
    else:
        print(format_list(args.root, entries))
    return 0


def register(subparsers: Any) -> None:
    """Add the ``list`` subcommand to the ``hp-ckpt`` parser."""
    parser = subparsers.add_parser(
        "list", help="list a CheckpointManager root's steps: committed, in progress, size",
        description="One row per step directory of a manager root (metadata only).",
    )
    parser.add_argument("root", help="the manager root (CheckpointManager root / CheckpointCallback directory, "
                                     "or s3://bucket/prefix)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    parser.set_defaults(func=_run)
