"""The save lease: at most one live save per checkpoint directory and metadata name.

A save's coordinator creates ``.<metadata name>.lease`` in the checkpoint
directory with ``O_CREAT | O_EXCL`` (atomic on local and shared filesystems:
NFSv3+, Lustre, GPFS) before any data file is written, and removes it after
its commit and cleanup. The file is a small JSON object naming the holder:
host, boot id, process id and start time, the save id, the committed save id
it supersedes (``base_save_id``, filled in just before the commit) and when it
was taken. A daemon thread refreshes its modification time every
``timeout / 8`` seconds while it is held.

A second save finding the lease judges it:

- held by this process for a save still running (an ``async_save`` not yet
  committed, another thread): live;
- held by a process of this host (same host name and boot id): live while
  that process exists and is the same one (start time), stale otherwise;
- held by another host: live while its modification time is younger than
  ``timeout`` seconds (the heartbeat keeps it young), stale after;
- unreadable (empty or not a lease): stale once older than
  :func:`unreadable_grace` (two heartbeats, at least 30 s, at most
  ``timeout``: 75 s by default). A live save's lease is unreadable only
  between its creation and its one write, microseconds (on NFS, until the
  writer closes it), or if another version of this library wrote it (its
  heartbeat keeps it younger than two heartbeats); otherwise only a save
  that died there leaves one, and a restarted job should not wait the whole
  timeout for it.

A live lease makes the second save fail with :class:`ConcurrentSaveError`
naming the holder. A stale one is broken under a second exclusive file
(``.<lease>.break``), so two savers never both break it; the breaker inherits
the dead save's ids, and its files are deleted as garbage.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import stat
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hyper_parallel.core.distributed_checkpoint._safe_files import describe_mode, read_regular
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointIOError,
    ConcurrentSaveError,
    UnsafeCheckpointError,
)

__all__ = ["DEFAULT_LEASE_TIMEOUT", "LeaseHolder", "SaveLease", "lease_name", "live_lease_in", "unreadable_grace"]

#: Seconds without a heartbeat after which another host's lease counts as stale.
DEFAULT_LEASE_TIMEOUT = 300.0
_BREAK_TIMEOUT = 30.0
#: Least seconds after which an unreadable lease counts as stale (see :func:`unreadable_grace`).
_UNREADABLE_GRACE = 30.0
_MAX_LEASE_BYTES = 4096
_LOG = logging.getLogger(__name__)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def lease_name(metadata_name: str) -> str:
    """The lease file guarding commits of ``metadata_name``."""
    return f".{metadata_name}.lease"


@functools.lru_cache(maxsize=1)
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> tuple[bool, int]:
    """(exists and is not a zombie, start time in clock ticks or 0 when unknown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        return fields[0] != b"Z", int(fields[19])
    except FileNotFoundError:
        return False, 0
    except (OSError, IndexError, ValueError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, 0
    except PermissionError:
        pass
    return True, 0


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a lease (the JSON content of the lease file).

    Attributes:
        host: Host name of the holding process.
        boot_id: Kernel boot id of that host (tells a rebooted host apart).
        pid: Process id of the holder.
        start_ticks: Start time of that process in clock ticks (tells a reused pid apart).
        save_id: The save holding the lease.
        base_save_id: The committed save it replaces (set just before its commit; ``""`` before).
        acquired: When the lease was taken (seconds since the epoch).
    """

    host: str
    boot_id: str
    pid: int
    start_ticks: int
    save_id: str
    base_save_id: str
    acquired: float

    def to_bytes(self) -> bytes:
        """The lease file content."""
        return json.dumps(asdict(self), sort_keys=True).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> LeaseHolder | None:
        """Parse a lease file; ``None`` when it is not one."""
        try:
            document = json.loads(data)
            holder = cls(**{name: document[name] for name in cls.__dataclass_fields__})
        except (ValueError, TypeError, KeyError, RecursionError):
            return None
        types = (str, str, int, int, str, str, (int, float))
        if not all(isinstance(getattr(holder, f), t) for f, t in zip(cls.__dataclass_fields__, types)):
            return None
        return holder

    def describe(self) -> str:
        """``save id ..., host ..., pid ..., since ...`` for error messages."""
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.acquired))
        return f"save id {self.save_id}, host {self.host}, pid {self.pid}, since {since}"

    def same_host(self) -> bool:
        """True when the holder runs on this host (this boot)."""
        return self.host == socket.gethostname() and self.boot_id == _boot_id()


_HELD: dict[str, "SaveLease"] = {}  # save id -> lease held by this process
_HELD_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4)
def _own_start(pid: int) -> int:
    return _process_start(pid)[1]


def _me(save_id: str) -> LeaseHolder:
    return LeaseHolder(host=socket.gethostname(), boot_id=_boot_id(), pid=os.getpid(),
                       start_ticks=_own_start(os.getpid()), save_id=save_id, base_save_id="", acquired=time.time())


def _observe(path: Path) -> tuple[bytes, LeaseHolder | None, float] | None:
    """(raw content, parsed holder, age in seconds) of the lease at ``path``; ``None`` if absent.

    Raises:
        UnsafeCheckpointError: the name holds something else than a lease file.
    """
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeCheckpointError(
                f"lease {path} is {describe_mode(info.st_mode)}, not a lease file; remove it to save here"
            )
        raw = read_regular(path, limit=_MAX_LEASE_BYTES)
    except FileNotFoundError:
        return None
    except UnsafeCheckpointError:
        raise
    except OSError as exc:
        raise CheckpointIOError(f"cannot read lease {path}: {exc}") from exc
    return raw, LeaseHolder.from_bytes(raw), max(0.0, time.time() - info.st_mtime)


def _heartbeat(timeout: float) -> float:
    return max(0.05, timeout / 8)


def unreadable_grace(timeout: float) -> float:
    """Seconds after its last write or heartbeat that an unreadable lease counts as stale (any process).

    Two heartbeats and at least 30 s, so that a live lease this version cannot parse (written by another
    version, which beats as often) is never judged stale between two beats; at most ``timeout``.
    """
    return min(timeout, max(_UNREADABLE_GRACE, 2 * _heartbeat(timeout)))


def _live(holder: LeaseHolder | None, age: float, timeout: float) -> bool:
    if holder is None:
        return age <= unreadable_grace(timeout)
    if holder.same_host():
        if holder.pid == os.getpid():
            with _HELD_LOCK:
                return holder.save_id in _HELD
        alive, ticks = _process_start(holder.pid)
        return alive and not (ticks and holder.start_ticks and ticks != holder.start_ticks)
    return age <= timeout


def live_lease_in(directory: Path, *, timeout: float = DEFAULT_LEASE_TIMEOUT) -> LeaseHolder | None:
    """The holder of a live lease in ``directory`` (any metadata name), or ``None``. Never raises."""
    try:
        names = [e.name for e in os.scandir(directory) if e.name.startswith(".") and e.name.endswith(".lease")]
        for name in names:
            seen = _observe(directory / name)
            if seen is not None and _live(seen[1], seen[2], timeout):
                return seen[1] or LeaseHolder("?", "", 0, 0, "?", "", 0.0)
    except (OSError, CheckpointError):
        return None
    return None


class SaveLease:
    """A lease held by this process for one save (coordinator only)."""

    def __init__(self, path: Path, holder: LeaseHolder, timeout: float) -> None:
        self.path = path
        self.holder = holder
        self.timeout = timeout
        self._stop = threading.Event()
        self.released = threading.Event()
        self.committed = False
        self._thread = threading.Thread(target=self._beat, name="hp-ckpt-lease", daemon=True)

    @classmethod
    def acquire(cls, directory: Path, metadata_name: str, save_id: str, *,
                timeout: float = DEFAULT_LEASE_TIMEOUT) -> tuple[SaveLease, LeaseHolder | None]:
        """Take the lease of ``metadata_name`` in ``directory`` for ``save_id``.

        Returns:
            The lease, and the holder of the stale lease broken to take it (``None`` if there was none).

        Raises:
            ConcurrentSaveError: another save holds a live lease (names it and the fix).
            UnsafeCheckpointError: the lease name holds a directory, FIFO, symlink...
            CheckpointIOError: the lease cannot be created.
        """
        path = directory / lease_name(metadata_name)
        broken: LeaseHolder | None = None
        for _ in range(4):
            try:
                fd = os.open(path, _CREATE_FLAGS, 0o644)
            except FileExistsError:
                seen = _observe(path)
                if seen is None:
                    continue  # released meanwhile
                raw, holder, age = seen
                if holder is not None and holder.pid == os.getpid() and holder.same_host():
                    with _HELD_LOCK:
                        mine = _HELD.get(holder.save_id)
                    if mine is not None and mine.committed:  # this process's committed save, still cleaning up
                        mine.released.wait(timeout)
                        continue
                if _live(holder, age, timeout):
                    raise ConcurrentSaveError(_clash_message(directory, path, holder, age, timeout)) from None
                _break(path, raw)
                broken = holder or broken
                continue
            except OSError as exc:
                raise CheckpointIOError(f"cannot create the save lease {path}: {exc}") from exc
            lease = cls(path, _me(save_id), timeout)
            data = lease.holder.to_bytes()
            try:
                # One write, all of it or an error: a short write (a file size limit) left a torn lease that its
                # own release() could not recognise and so never removed. (Not through the writer's file
                # operations: a lease is no data file, and one write keeps the window in which it is empty
                # as short as it can be; crash tests count the data files' bytes there.)
                written = 0
                while written < len(data):  # a short write is retried: the next one names the cause (EFBIG...)
                    step = os.write(fd, data[written:])
                    if step <= 0:
                        raise OSError(f"short write ({written} of {len(data)} bytes)")
                    written += step
            except OSError as exc:
                os.remove(path)
                raise CheckpointIOError(f"cannot write the save lease {path}: {exc}") from exc
            finally:
                os.close(fd)
            with _HELD_LOCK:
                _HELD[save_id] = lease
            lease._thread.start()
            return lease, broken
        raise ConcurrentSaveError(
            f"checkpoint {directory}: another save keeps taking the lease {path}; save again later"
        )

    def _beat(self) -> None:
        while not self._stop.wait(_heartbeat(self.timeout)):
            try:
                os.utime(self.path)
            except OSError:
                return

    def holds(self) -> bool:
        """True while the lease file still names this save (nobody broke it)."""
        try:
            seen = _observe(self.path)
        except CheckpointError:
            return False
        return seen is not None and seen[1] is not None and seen[1].save_id == self.holder.save_id

    def record_base(self, base_save_id: str) -> None:
        """Write the committed save id this save replaces into the lease (before the commit).

        If the process dies between its commit and its cleanup, whoever breaks
        the lease then knows the files of ``base_save_id`` are garbage.
        """
        if not base_save_id:
            return
        self.holder = LeaseHolder(**{**asdict(self.holder), "base_save_id": base_save_id})
        temporary = self.path.with_name(f"{self.path.name}.{self.holder.save_id}.partial")
        try:
            temporary.write_bytes(self.holder.to_bytes())
            os.replace(temporary, self.path)
        except OSError as exc:  # only garbage collection after a crash needs it
            _LOG.warning("cannot record the replaced save in lease %s: %s", self.path, exc)
            try:
                os.remove(temporary)
            except OSError:
                pass

    def release(self) -> None:
        """Remove the lease file if it still names this save; stop the heartbeat. Idempotent."""
        if self.released.is_set():
            return
        self._stop.set()
        try:
            if self.holds():
                os.remove(self.path)  # (not os.unlink: fault-injection tests hook that one for retention)
        except OSError as exc:
            _LOG.warning("cannot remove save lease %s: %s", self.path, exc)
        finally:
            with _HELD_LOCK:
                _HELD.pop(self.holder.save_id, None)
            self.released.set()


def _break(path: Path, observed: bytes) -> None:
    """Remove the stale lease at ``path`` if it still holds ``observed``, under an exclusive break file."""
    breaker = path.with_name(path.name + ".break")
    try:
        fd = os.open(breaker, _CREATE_FLAGS, 0o644)
    except FileExistsError:
        try:
            age = time.time() - os.lstat(breaker).st_mtime
        except FileNotFoundError:
            return
        if age > _BREAK_TIMEOUT:  # a breaker died holding it
            try:
                os.remove(breaker)
            except OSError:
                pass
            return
        raise ConcurrentSaveError(
            f"checkpoint {path.parent}: another save is taking over the stale lease {path} right now; "
            "save again later"
        ) from None
    try:
        os.close(fd)
        seen = _observe(path)
        if seen is not None and seen[0] == observed:
            _LOG.warning("breaking stale save lease %s (%s)", path, observed[:200].decode("utf-8", "replace"))
            os.remove(path)
    finally:
        try:
            os.remove(breaker)
        except OSError:
            pass


def _clash_message(directory: Path, path: Path, holder: LeaseHolder | None, age: float, timeout: float) -> str:
    if holder is None:
        return (f"checkpoint {directory} is being saved by another save (lease {path} unreadable, "
                f"{age:.0f} s old): a save that died right after creating it leaves one, which counts as stale "
                f"{unreadable_grace(timeout):.0f} s after it was written; save again then, or delete {path} "
                "now if no save runs")
    text = f"checkpoint {directory} is being saved by another save ({holder.describe()}; lease {path}): "
    if holder.pid == os.getpid() and holder.same_host():
        return text + ("this process has not committed it yet: call result() on its async_save handle (or "
                       "CheckpointManager.wait()) before saving to this id again, or save to another checkpoint_id")
    if holder.same_host():
        return text + "wait for it to finish or save to another checkpoint_id"
    return text + (f"wait for it, or save to another checkpoint_id; its lease counts as stale {timeout:.0f} s "
                   f"after its last heartbeat ({age:.0f} s ago), or delete {path} if that process is gone")
