"""Object-store I/O over fsspec: streamed multipart uploads, ranged reads, conditional puts.

The object backend (:mod:`._fsspec_writer`, :mod:`._fsspec_reader`) writes and
reads the same bytes as the filesystem backend; this module only moves them.

- :class:`ObjectSink` streams one data object. On S3 (``s3fs``) it is a
  multipart upload: parts of ``part_bytes`` are uploaded by up to
  ``connections`` threads at once while the next part fills, so at most
  ``connections + 1`` parts are held in memory whatever the object size. An
  object smaller than one part is sent in a single PUT. On other fsspec
  filesystems it streams through ``fs.open(path, "wb")``.
- :class:`RangedSource` reads byte ranges of one object with ranged GETs,
  several at once (``connections``), and counts the bytes fetched.
- :func:`put_if` writes a small object only if the object is still what the
  caller saw (S3 conditional writes ``If-None-Match: *`` / ``If-Match: etag``);
  :func:`get_with_tag` reads an object together with its tag. Together they
  make the commit of a checkpoint a compare-and-swap.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint._options import check_option
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointIOError, CheckpointValueError

__all__ = [
    "DEFAULT_PART_BYTES",
    "DEFAULT_CONNECTIONS",
    "Tagged",
    "PreconditionFailed",
    "filesystem_for",
    "locate",
    "ObjectLocation",
    "is_s3",
    "ObjectSink",
    "RangedSource",
    "get_with_tag",
    "put_if",
    "remove_objects",
]

#: Part size of multipart uploads and of the ranges a large read is split into.
DEFAULT_PART_BYTES = 8 << 20
#: Requests in flight per data object (uploads) or per read.
DEFAULT_CONNECTIONS = 4
#: S3 refuses parts smaller than this (except the last one).
_S3_MIN_PART_BYTES = 5 << 20


class PreconditionFailed(Exception):
    """A conditional write found the object changed (internal; callers turn it into a CheckpointError)."""


@dataclass(frozen=True)
class Tagged:
    """An object's bytes and the tag a conditional write compares against.

    Attributes:
        data: The object's content.
        tag: Its ETag (S3), or a content fingerprint elsewhere.
    """

    data: bytes
    tag: str


def filesystem_for(
    location: str, filesystem: Any = None, storage_options: dict[str, Any] | None = None
) -> tuple[Any, str]:
    """Return the fsspec filesystem and the protocol-less root path of ``location``.

    Args:
        location: A URL such as ``s3://bucket/prefix``.
        filesystem: An fsspec filesystem to use instead of one built from the URL.
        storage_options: Options for ``fsspec`` (``endpoint_url``, ``key``...).

    Raises:
        CheckpointValueError: fsspec (or the protocol's package) is not installed.
    """
    try:
        from fsspec.core import url_to_fs  # pylint: disable=import-outside-toplevel
    except ImportError as exc:  # pragma: no cover - fsspec is a dependency of the s3 extra
        raise CheckpointValueError("object storage needs fsspec: pip install 'hyper_parallel[s3]'") from exc
    if filesystem is not None:
        return filesystem, filesystem._strip_protocol(location).rstrip("/")  # pylint: disable=protected-access
    # A fresh instance, not fsspec's per-argument cache: a cached filesystem keeps
    # the endpoint and credentials of the environment it was first built in.
    options = {"skip_instance_cache": True, **(storage_options or {})}
    try:
        fs, root = url_to_fs(location, **options)
    except ImportError as exc:
        raise CheckpointValueError(
            f"checkpoint {location}: the package for its protocol is missing: pip install 'hyper_parallel[s3]' ({exc})"
        ) from exc
    except ValueError as exc:  # fsspec: "Protocol not known: ..."
        raise CheckpointValueError(
            f"checkpoint_id {location!r}: {exc}; use a directory path, or an fsspec URL such as s3://bucket/prefix"
        ) from exc
    return fs, root.rstrip("/")


def locate(checkpoint_id: object, filesystem: Any, storage_options: dict[str, Any]) -> tuple[str, Any, str]:
    """The URL of ``checkpoint_id`` (no trailing ``/``), its filesystem and its protocol-less root."""
    url = str(checkpoint_id).rstrip("/")
    fs, root = filesystem_for(url, filesystem, storage_options)
    return url, fs, root


class ObjectLocation:
    """Where an fsspec reader or writer points and how it transfers: set up the same way for both.

    A mixin of :class:`.FsspecReader` and :class:`.FsspecWriter`. After
    :meth:`_set_up_location` and :meth:`_relocate` the object has ``path`` (the
    URL, no trailing ``/``, shown in messages), ``fs`` (its filesystem), ``root``
    (the protocol-less root), ``connections``, ``part_bytes`` and
    ``storage_options``.
    """

    def _set_up_location(
        self, *, filesystem: Any, connections: int, part_bytes: int, storage_options: dict[str, Any]
    ) -> None:
        """Check and keep the transfer options (no location yet). Any rank, from ``__init__``; no store access.

        Raises:
            CheckpointValueError: ``connections`` or ``part_bytes`` is not an int >= 1 (names the option).
        """
        check_option("connections", connections, int, minimum=1)
        check_option("part_bytes", part_bytes, int, minimum=1)
        self.connections = connections
        self.part_bytes = part_bytes
        self.storage_options = dict(storage_options)
        self._given_filesystem = filesystem
        self.path = ""  # set by _relocate: the URL, shown in messages
        self.fs: Any = None
        self.root = ""

    def _relocate(self, checkpoint_id: object) -> None:
        """Point at ``checkpoint_id`` (``None``: stay). Any rank, from ``reset``."""
        if checkpoint_id is not None:
            self.path, self.fs, self.root = locate(checkpoint_id, self._given_filesystem, self.storage_options)


def is_s3(fs: Any) -> bool:
    """True for an ``s3fs`` filesystem (multipart and conditional writes available)."""
    return hasattr(fs, "_call_s3") and hasattr(fs, "split_path")


def _s3(fs: Any, method: str, **kwargs: Any) -> Any:
    """Call one S3 API method through s3fs's own client and event loop (thread-safe)."""
    from fsspec.asyn import sync  # pylint: disable=import-outside-toplevel

    return sync(fs.loop, fs._call_s3, method, **kwargs)  # pylint: disable=protected-access


def _is_precondition_failure(exc: BaseException) -> bool:
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) if hasattr(exc, "response") else ""
    return code in ("PreconditionFailed", "412", "ConditionalRequestConflict") or "PreconditionFailed" in str(exc)


class ObjectSink:
    """Streams one object: ``write`` pieces in order, then ``commit`` (or ``abort``).

    Called by one writer thread per object; the parts upload on a small pool
    of its own.

    Args:
        fs: The fsspec filesystem.
        path: The object's path (without protocol).
        part_bytes: Multipart part size (S3 needs at least 5 MiB).
        connections: Parts uploaded at once.
    """

    def __init__(self, fs: Any, path: str, *, part_bytes: int = DEFAULT_PART_BYTES,
                 connections: int = DEFAULT_CONNECTIONS) -> None:
        self.fs, self.path = fs, path
        self.part_bytes = part_bytes
        self.bytes_written = 0
        self._s3 = is_s3(fs)
        if self._s3 and part_bytes < _S3_MIN_PART_BYTES:
            raise CheckpointValueError(f"part_bytes must be at least {_S3_MIN_PART_BYTES} on S3, got {part_bytes}")
        self._free: list[bytearray] = []  # part buffers back from their upload, reused (no fresh pages per part)
        self._free_lock = threading.Lock()
        self._buffer = bytearray(part_bytes) if self._s3 else None
        self._filled = 0
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self._slots = threading.BoundedSemaphore(connections)
        self._pool: ThreadPoolExecutor | None = None
        self._connections = connections
        self._handle = None if self._s3 else fs.open(path, "wb")

    def write(self, view: memoryview) -> None:
        """Append ``view`` to the object (copied into the current part)."""
        view = memoryview(view).cast("B")
        self.bytes_written += len(view)
        if not self._s3:
            self._handle.write(view)
            return
        while len(view):
            take = min(len(view), self.part_bytes - self._filled)
            self._buffer[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == self.part_bytes:
                self._ship()

    def write_many(self, views: list[memoryview], nbytes: int) -> None:
        """Append ``views`` in order (``nbytes`` in all)."""
        del nbytes
        for view in views:
            self.write(view)

    def _ship(self) -> None:
        """Hand the full part to an upload thread; block while ``connections`` parts are in flight."""
        bucket, key, _ = self.fs.split_path(self.path)
        if self._upload_id is None:
            self._upload_id = _s3(self.fs, "create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
            self._pool = ThreadPoolExecutor(max_workers=self._connections, thread_name_prefix="hp-ckpt-upload")
        full = self._filled == len(self._buffer)
        body = self._buffer if full else self._buffer[: self._filled]
        number = len(self._parts) + 1
        self._slots.acquire()

        def upload() -> dict[str, Any]:
            try:
                reply = _s3(self.fs, "upload_part", Bucket=bucket, Key=key, UploadId=self._upload_id,
                            PartNumber=number, Body=body)
                return {"PartNumber": number, "ETag": reply["ETag"]}
            finally:
                if full:
                    with self._free_lock:
                        self._free.append(body)
                self._slots.release()

        self._parts.append(self._pool.submit(upload))
        with self._free_lock:
            self._buffer = self._free.pop() if self._free else bytearray(self.part_bytes)
        self._filled = 0

    def commit(self) -> None:
        """Make the object whole and visible (completes the multipart upload)."""
        if not self._s3:
            self._handle.close()
            return
        bucket, key, _ = self.fs.split_path(self.path)
        if self._upload_id is None:
            _s3(self.fs, "put_object", Bucket=bucket, Key=key, Body=bytes(self._buffer[: self._filled]))
            self._buffer = None
            return
        if self._filled:
            self._ship()
        parts = [future.result() for future in self._parts]
        _s3(self.fs, "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=self._upload_id,
            MultipartUpload={"Parts": parts})
        self._close_pool()

    def abort(self) -> None:
        """Drop everything uploaded so far (best effort; never raises)."""
        try:
            if not self._s3:
                self._handle.close()
                self.fs.rm(self.path)
            elif self._upload_id is not None:
                for future in self._parts:
                    future.exception()
                bucket, key, _ = self.fs.split_path(self.path)
                _s3(self.fs, "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=self._upload_id)
        except Exception:  # pylint: disable=broad-except
            pass  # a leftover upload holds no visible object; bucket lifecycle rules remove it
        self._close_pool()

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class RangedSource:
    """Reads byte ranges of one object with ranged GETs, ``connections`` at a time.

    Used by the reader's threads, several at once: the bound on GETs in
    flight holds across all of them.

    Args:
        fs: The fsspec filesystem.
        path: The object's path.
        size: The object's size in bytes.
        part_bytes: Ranges larger than this are split into parts fetched at once.
        connections: GETs in flight per call.
    """

    def __init__(self, fs: Any, path: str, size: int, *, part_bytes: int = DEFAULT_PART_BYTES,
                 connections: int = DEFAULT_CONNECTIONS) -> None:
        self.fs, self.path, self.size = fs, path, size
        self.part_bytes, self.connections = part_bytes, connections
        self.bytes_fetched = 0
        self.exact = False  # no kernel readahead to avoid: ranged GETs fetch only what is asked
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(connections)

    def _fetch(self, starts: list[int], ends: list[int]) -> list[bytes]:
        """GET the ranges, never more than ``connections`` at once across every thread using this source."""
        blobs: list[Any] = []
        position = 0
        while position < len(starts):
            self._slots.acquire()
            taken = 1
            while taken < self.connections and position + taken < len(starts) and self._slots.acquire(blocking=False):
                taken += 1
            try:
                lo, hi = position, position + taken
                if taken == 1:
                    blobs.append(self.fs.cat_file(self.path, start=starts[lo], end=ends[lo]))
                else:
                    blobs += self.fs.cat_ranges([self.path] * taken, starts[lo:hi], ends[lo:hi], batch_size=taken,
                                                on_error="return")
            finally:
                for _ in range(taken):
                    self._slots.release()
            position += taken
        for blob in blobs:
            if isinstance(blob, BaseException):
                raise blob
        with self._lock:
            self.bytes_fetched += sum(len(b) for b in blobs)
        return blobs

    def readinto(self, buffer: np.ndarray, offset: int) -> int:
        """Fill ``buffer`` (``uint8``, contiguous) from byte ``offset``; return the bytes got (short at the end)."""
        return self.read_rows([buffer], [offset])

    def readinto_many(self, buffers: list[np.ndarray], offset: int) -> int:
        """Fill ``buffers`` (contiguous arrays of any dtype) one after the other from consecutive bytes at
        ``offset`` (one ranged read)."""
        views = [buffer.reshape(-1).view(np.uint8) for buffer in buffers]
        span = np.empty(sum(view.size for view in views), dtype=np.uint8)
        got = self.readinto(span, offset)
        position = 0
        for view in views:
            view[...] = span[position : position + view.size]
            position += view.size
        return got

    def read_rows(self, rows: list[np.ndarray], offsets: list[int]) -> int:
        """Fill each ``rows[i]`` from byte ``offsets[i]``, all at once; return the bytes got."""
        starts, ends, places = [], [], []
        for position, (row, offset) in enumerate(zip(rows, offsets)):
            end = min(offset + row.size, self.size)
            for lo in range(offset, end, self.part_bytes):
                starts.append(lo)
                ends.append(min(lo + self.part_bytes, end))
                places.append((position, lo - offset))
        if not starts:
            return 0
        got = 0
        for blob, (position, at) in zip(self._fetch(starts, ends), places):
            rows[position][at : at + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
            got += len(blob)
        return got


def get_with_tag(fs: Any, path: str) -> Tagged | None:
    """Return an object's content and tag, or ``None`` if it does not exist."""
    if is_s3(fs):
        bucket, key, _ = fs.split_path(path)
        try:
            reply = _s3(fs, "get_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        from fsspec.asyn import sync  # pylint: disable=import-outside-toplevel

        async def _body() -> bytes:
            async with reply["Body"] as stream:
                return await stream.read()

        return Tagged(data=sync(fs.loop, _body), tag=reply["ETag"])
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return None
    import hashlib  # pylint: disable=import-outside-toplevel

    return Tagged(data=data, tag=hashlib.sha256(data).hexdigest())


def put_if(fs: Any, path: str, data: bytes, *, expected_tag: str | None) -> None:
    """Write ``path`` only if it is still as seen: absent (``expected_tag=None``) or with that tag.

    On S3 this is one conditional PUT, decided by the store (atomic against
    any other writer). Elsewhere it is a check then a write (not atomic
    against another process).

    Raises:
        PreconditionFailed: the object changed since it was seen.
        CheckpointIOError: the write failed.
    """
    if is_s3(fs):
        bucket, key, _ = fs.split_path(path)
        condition = {"IfNoneMatch": "*"} if expected_tag is None else {"IfMatch": expected_tag}
        try:
            _s3(fs, "put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except Exception as exc:  # pylint: disable=broad-except
            if _is_precondition_failure(exc) or _is_precondition_failure(exc.__cause__ or exc):
                raise PreconditionFailed(str(exc)) from exc
            raise CheckpointIOError(f"writing {path} failed: {exc}") from exc
        return
    current = get_with_tag(fs, path)
    if (current.tag if current is not None else None) != expected_tag:
        raise PreconditionFailed(f"{path} changed")
    fs.pipe_file(path, data)


def remove_objects(fs: Any, paths: list[str]) -> None:
    """Delete ``paths`` (missing ones are fine; best effort, never raises)."""
    if not paths:
        return
    try:
        fs.rm(paths)
    except Exception:  # pylint: disable=broad-except
        for path in paths:
            try:
                fs.rm_file(path)
            except Exception:  # pylint: disable=broad-except
                pass
