"""What a ``CheckpointManager`` promised about its steps, persisted in its root.

``<root>/manager.json`` (JSON, no pickle; under an object-store root the
object ``<root>/manager.json``) holds the policy of the last manager that
saved there and, per committed step, when it was saved, its
metrics and whether it is kept forever. A manager re-created with another
policy reads it back, so a step once promised "keep forever" (by
``keep_every_n_steps`` or ``keep_time_interval_seconds``) is never deleted,
and best-k retention still knows the metrics of earlier steps. The file is
replaced atomically (``write_atomically``: write, fsync, rename, directory
fsync) under an advisory lock held by the coordinator for the whole
read-retain-write, so two managers on one root do not lose each other's
entries; the temporary file of a writer killed before its rename is removed
by the next holder of the lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from hyper_parallel.core.distributed_checkpoint._file_ops import write_atomically
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError

__all__ = [
    "DEFAULT_STEP_PREFIX",
    "RECORD_FILE",
    "record_name",
    "ManagerPolicy",
    "StepRecord",
    "ManagerRecord",
    "locked_record",
    "object_record",
    "read_object_record",
    "read_record",
]

#: File name of the record in a manager's root (of the managers with the default step prefix).
RECORD_FILE = "manager.json"
#: The default ``step_prefix`` of a ``CheckpointManager``.
DEFAULT_STEP_PREFIX = "step_"
_LOCK_FILE = ".manager.lock"
_VERSION = 1


@dataclass(frozen=True)
class ManagerPolicy:
    """The retention policy of one manager (recorded to tell a changed policy apart).

    Attributes:
        max_to_keep: Newest (or best) committed steps kept; ``None`` keeps all.
        keep_every_n_steps: Steps divisible by it are kept forever.
        keep_time_interval_seconds: One step per this many seconds is kept forever.
        best_mode: ``"max"`` / ``"min"`` when steps are ranked by a metric, else ``None``.
    """

    max_to_keep: int | None = None
    keep_every_n_steps: int | None = None
    keep_time_interval_seconds: float | None = None
    best_mode: str | None = None


@dataclass(frozen=True)
class StepRecord:
    """What is known about one committed step.

    Attributes:
        saved_at: Commit time (seconds since the epoch, coordinator's clock).
        keep_forever: Retention never deletes it, whatever the policy.
        metrics: The metrics given to ``save`` (JSON values), or ``None``.
    """

    saved_at: float
    keep_forever: bool = False
    metrics: dict[str, Any] | None = None


@dataclass(frozen=True)
class ManagerRecord:
    """The whole record: the last policy and every known step."""

    policy: ManagerPolicy | None = None
    steps: dict[int, StepRecord] = field(default_factory=dict)


def _decode(path: Path | str, text: str) -> ManagerRecord:
    try:
        document = json.loads(text)
        policy = document.get("policy")
        steps = {
            int(step): StepRecord(saved_at=float(entry["saved_at"]), keep_forever=bool(entry["keep_forever"]),
                                  metrics=entry.get("metrics"))
            for step, entry in document["steps"].items()
        }
        return ManagerRecord(policy=ManagerPolicy(**policy) if policy is not None else None, steps=steps)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"{path}: not a valid manager record ({exc}); it lists the steps kept forever and the metrics of "
            "best-k retention: restore it, or delete it to start a fresh record (no step data is in it)"
        ) from exc


def record_name(step_prefix: str) -> str:
    """The record file of the managers of ``step_prefix``: ``manager.json`` for the default ``step_``, else
    ``manager.<step_prefix>.json``. Managers of other prefixes in one root keep their own records (one record
    keyed by step number mixed their metrics and promises up: one's retention erased the other's)."""
    return RECORD_FILE if step_prefix == DEFAULT_STEP_PREFIX else f"manager.{step_prefix}.json"


def read_record(root: Path, name: str = RECORD_FILE) -> ManagerRecord:
    """Return the record ``name`` of ``root`` (empty if there is none). Coordinator; no lock.

    A prefix's own record that does not exist yet starts from ``manager.json`` (where versions before
    per-prefix records kept it), so the promises of a root managed with another prefix are kept.

    Raises:
        CorruptCheckpointError: The file exists but is not a record (names it and the fix).
    """
    for candidate in dict.fromkeys((name, RECORD_FILE)):
        path = root / candidate
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            continue
        return _decode(path, text)
    return ManagerRecord()


def _encode(record: ManagerRecord) -> bytes:
    document = {
        "version": _VERSION,
        "policy": dataclasses.asdict(record.policy) if record.policy is not None else None,
        "steps": {str(step): dataclasses.asdict(entry) for step, entry in sorted(record.steps.items())},
    }
    return json.dumps(document, indent=1, sort_keys=True).encode("utf-8")


def _write(root: Path, record: ManagerRecord, name: str) -> None:
    write_atomically(root / name, _encode(record))


def _sweep_partials(root: Path, name: str) -> None:
    """Remove temporary record files left by a writer killed before its rename (the lock is held)."""
    prefix = f".{name}."
    for entry in os.scandir(root):
        if entry.name.startswith(prefix) and entry.name.endswith(".partial"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


class _Session:
    """The record while the lock is held: read once, changed, written by :meth:`flush` and at the end."""

    def __init__(self, record: ManagerRecord, write: Callable[[ManagerRecord], None]) -> None:
        self.record = record
        self.written = record  # what the stored record holds
        self._write = write

    def update(self, **changes: Any) -> None:
        self.record = dataclasses.replace(self.record, **changes)

    def flush(self) -> None:
        """Write the record now if it changed (e.g. before steps are deleted: a crash then loses no promise)."""
        if self.record != self.written:
            self._write(self.record)
            self.written = self.record


@contextlib.contextmanager
def locked_record(root: Path, name: str = RECORD_FILE) -> Iterator[_Session]:
    """Hold ``root``'s record lock; yield the record ``name``; write it back if it changed. Coordinator only."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / _LOCK_FILE, "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            _sweep_partials(root, name)
            session = _Session(read_record(root, name), lambda record: _write(root, record, name))
            yield session
            session.flush()
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def object_record(fs: Any, root: str, url: str, name: str = RECORD_FILE) -> Iterator[_Session]:
    """The record object ``<root>/<name>`` of an object-store root; written back if it changed.

    Coordinator only. One object PUT replaces it whole (atomic on S3); there is no lock, so two managers
    retaining on one prefix at the same moment may lose one's update (one manager per root). Arguments and
    errors as :func:`read_object_record`.
    """
    session = _Session(read_object_record(fs, root, url, name),
                       lambda record: fs.pipe_file(f"{root}/{name}", _encode(record)))
    yield session
    session.flush()


def read_object_record(fs: Any, root: str, url: str, name: str = RECORD_FILE) -> ManagerRecord:
    """Return the record object ``name`` of an object-store root (empty if there is none). Coordinator; no lock.

    Args:
        fs: The fsspec filesystem of the root.
        root: The root's path in ``fs`` (``bucket/prefix``).
        url: The root's URL (named in errors).
        name: The record's name (:func:`record_name` of the manager's step prefix).

    Raises:
        CorruptCheckpointError: The object exists but is not a record (names it and the fix).
    """
    try:
        data = fs.cat_file(f"{root}/{name}")
    except FileNotFoundError:
        return ManagerRecord()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = ""  # not JSON either: refused by _decode with its message
    return _decode(f"{url}/{name}", text)
