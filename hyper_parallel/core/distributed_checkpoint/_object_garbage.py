"""What a commit on object storage may delete besides the superseded save: leftovers of saves that cannot commit.

A save killed before its commit (or whose cleanup failed) leaves, under the
checkpoint's prefix, data objects ``r<rank>_<counter>.<save id>.safetensors``,
results records ``.<save id>.rank<r>.results`` and, killed mid-upload,
multipart uploads in progress (invisible in listings, still stored). On disk
the lease tells a dead save apart; an object store has none. The conditional
commit does it instead:

- as a save begins, its coordinator notes the leftovers *present then*:
  objects and uploads of other save ids (of its own rank, for rank-local
  metadata);
- once its conditional write of the metadata succeeds, every save that had
  begun before it can no longer commit (its condition named the metadata
  object as it was before this commit), so what it noted is garbage and is
  deleted with the superseded data. Objects that appeared after this save
  began, maybe a save that began after it, are never touched, nor anything
  under a nested prefix (``<prefix>/best/``: a checkpoint of its own).

The guarantee holds for saves committing the same metadata object; a save
committing another one (``metadata.json`` vs ``metadata.rank<r>.json``) is
not stopped by this commit and may commit after it. So the save id tells
which kind a save commits (:func:`._save_id.new_save_id`: first hex digit 0-7, one
metadata per checkpoint; 8-f, one per rank) and only leftovers of saves of
this save's kind (and rank) are noted. A location that also holds a
committed checkpoint of the other kind is not swept at all (its save ids
may predate the kind digit). Elsewhere than S3 the commit is not
atomic (see :func:`._object_io.put_if`), and the sweep no more than it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.distributed_checkpoint._commit_cleanup import DATA_FILE_PATTERN
from hyper_parallel.core.distributed_checkpoint._object_io import is_s3, remove_objects
from hyper_parallel.core.distributed_checkpoint._save_id import commits_per_rank

__all__ = ["Leftovers", "abort_stale_uploads", "leftovers_at_start", "owner_of", "sweep"]

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Leftovers:
    """Objects and uploads of other saves, present under a checkpoint's prefix as a save began.

    Attributes:
        objects: Paths of data objects and results records.
        uploads: ``(key, upload id)`` of multipart uploads in progress (S3 only).
    """

    objects: tuple[str, ...] = ()
    uploads: tuple[tuple[str, str], ...] = ()


def owner_of(name: str) -> tuple[str, int] | None:
    """``(save id, rank)`` of a data object or results record name, else None."""
    match = DATA_FILE_PATTERN.match(name)
    if match:
        return match.group(3), int(match.group(1))
    parts = name.split(".")
    if name.startswith(".") and len(parts) == 4 and parts[3] == "results" and parts[2].startswith("rank"):
        try:
            return parts[1], int(parts[2][len("rank"):])
        except ValueError:
            return None
    return None


def _other_kind(name: str, rank: int | None) -> bool:
    """A metadata object of the other kind than this save's (one per checkpoint / one per rank)."""
    if rank is None:
        return name.startswith("metadata.rank") and name.endswith(".json")
    return name == "metadata.json"


def _uploads(fs: Any, root: str) -> list[tuple[str, str, float]]:
    """``(path, upload id, start time)`` of the multipart uploads in progress under ``root`` (S3; else none).

    Also those under nested prefixes (``<root>/best/...``): the listing has no delimiter.
    """
    if not is_s3(fs):
        return []
    bucket, key, _ = fs.split_path(root)
    found: list[tuple[str, str, float]] = []
    markers: dict[str, str] = {}
    while True:
        reply = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{key}/", **markers)
        found.extend((f"{bucket}/{u['Key']}", u["UploadId"], u["Initiated"].timestamp())
                     for u in reply.get("Uploads", []))
        if not reply.get("IsTruncated"):
            return found
        markers = {"KeyMarker": reply["NextKeyMarker"], "UploadIdMarker": reply["NextUploadIdMarker"]}


def _abort_uploads(fs: Any, uploads: list[tuple[str, str]]) -> None:
    for path, upload in uploads:
        bucket, key, _ = fs.split_path(path)
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
        except Exception as exc:  # pylint: disable=broad-except
            _LOG.warning("cannot abort the multipart upload of %s left by an earlier save: %s", path, exc)


def leftovers_at_start(fs: Any, root: str, *, save_id: str, metadata_name: str, rank: int | None) -> Leftovers:
    """Note what the save beginning now may delete after it commits. Coordinator (committing rank) only.

    Never raises: a location that cannot be listed has no leftovers to note.

    Args:
        fs: The fsspec filesystem.
        root: The checkpoint's prefix (without protocol).
        save_id: This save's id (its own objects are never leftovers).
        metadata_name: The metadata object this save commits.
        rank: For rank-local metadata, the only rank whose objects are noted;
            ``None``: one metadata object. Only save ids of the same kind
            (:func:`._save_id.commits_per_rank`) are noted.
    """
    try:
        try:
            names = [path.rstrip("/").rsplit("/", 1)[-1] for path in fs.ls(root, detail=False)]
        except FileNotFoundError:
            names = []
        finally:
            fs.invalidate_cache(root)  # the listing goes stale as this save writes: no later lookup may use it
        uploads = _uploads(fs, root)
    except Exception as exc:  # pylint: disable=broad-except
        _LOG.warning("checkpoint %s: cannot list it for leftovers of earlier saves (%s); none are removed", root, exc)
        return Leftovers()
    others = sorted(n for n in names if _other_kind(n, rank))
    if others:  # committed saves of the other kind share the prefix: their objects may look like leftovers
        _LOG.info("checkpoint %s also holds %s (%s): leftovers of earlier saves are not swept", root, others[0],
                  metadata_name)
        return Leftovers()

    def doomed(name: str) -> bool:
        owner = owner_of(name)
        return (owner is not None and owner[0] != save_id and commits_per_rank(owner[0]) == (rank is not None)
                and (rank is None or owner[1] == rank))

    return Leftovers(objects=tuple(f"{root}/{n}" for n in sorted(names) if doomed(n)),
                     uploads=tuple((path, upload) for path, upload, _ in uploads
                                   if path.rsplit("/", 1)[0] == root and doomed(path.rsplit("/", 1)[-1])))


def sweep(fs: Any, leftovers: Leftovers, superseded: list[str]) -> None:
    """Delete the superseded data objects and the leftovers, abort the uploads. Coordinator, after the commit.

    Best effort, never raises (the commit already happened).
    """
    remove_objects(fs, sorted(set(superseded) | set(leftovers.objects)))
    _abort_uploads(fs, list(leftovers.uploads))


def abort_stale_uploads(fs: Any, prefix: str, *, started_before: float) -> None:
    """Abort the multipart uploads under ``prefix`` started before ``started_before`` (epoch seconds).

    For a step prefix retention deletes (:mod:`._object_steps`): an upload
    younger than that may be a save still running. Best effort, never raises.
    """
    try:
        uploads = _uploads(fs, prefix)
    except Exception as exc:  # pylint: disable=broad-except
        _LOG.warning("cannot list the multipart uploads under %s: %s", prefix, exc)
        return
    _abort_uploads(fs, [(path, upload) for path, upload, started in uploads if started < started_before])
