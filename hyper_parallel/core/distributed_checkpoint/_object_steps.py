"""The step checkpoints of a :class:`.CheckpointManager` whose root is an object-store URL.

Each step is a prefix ``<root>/<step name>/`` holding one checkpoint. Listing
reads, per step prefix, whether its metadata object exists (and its tag, so
an unchanged step is not re-read); deleting removes the metadata object
first (the step is then uncommitted for every reader), then the data
objects, and aborts the multipart uploads a killed save left under it. An
uncommitted step is deleted only once all its objects are older than
:data:`UNCOMMITTED_GRACE_SECONDS`, because on object storage no lease
tells whether another process is still writing it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hyper_parallel.core.distributed_checkpoint._object_garbage import abort_stale_uploads
from hyper_parallel.core.distributed_checkpoint._object_io import filesystem_for, remove_objects

__all__ = ["UNCOMMITTED_GRACE_SECONDS", "StepEntry", "ObjectStepRoot"]

#: An uncommitted step prefix younger than this may be a save in progress: left alone.
UNCOMMITTED_GRACE_SECONDS = 3600.0


@dataclass(frozen=True)
class StepEntry:
    """One child prefix of the root.

    Attributes:
        name: The child's name (``step_00000120``).
        tag: The tag of its metadata object; ``None`` when uncommitted.
        newest: Newest modification time of its objects (seconds since the epoch).
    """

    name: str
    tag: str | None
    newest: float


class ObjectStepRoot:
    """Lists and deletes step prefixes under an object-store root. Coordinator only.

    Args:
        url: The root, ``s3://bucket/prefix``.
        metadata_name: Name of a step's metadata object.
    """

    def __init__(self, url: str, metadata_name: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem_for(self.url)
        self.metadata_name = metadata_name

    def entries(self) -> list[StepEntry]:
        """Every child prefix with its commit state (an absent root has none)."""
        self.fs.invalidate_cache(self.root)
        try:
            children = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        found = []
        for child in children:
            if child.get("type") != "directory":
                continue
            name = child["name"].rstrip("/").rsplit("/", 1)[-1]
            objects = self.fs.ls(child["name"], detail=True)
            tag = None
            newest = 0.0
            for item in objects:
                modified = item.get("LastModified")
                if modified is not None and hasattr(modified, "timestamp"):
                    newest = max(newest, modified.timestamp())
                if item["name"].rsplit("/", 1)[-1] == self.metadata_name:
                    tag = str(item.get("ETag", item.get("size")))
            found.append(StepEntry(name=name, tag=tag, newest=newest))
        return found

    def is_abandoned(self, entry: StepEntry) -> bool:
        """True for an uncommitted step nobody has written to for :data:`UNCOMMITTED_GRACE_SECONDS`."""
        return entry.tag is None and time.time() - entry.newest > UNCOMMITTED_GRACE_SECONDS

    def location(self, name: str) -> str:
        """The checkpoint id of child ``name``."""
        return f"{self.url}/{name}"

    def delete(self, name: str) -> None:
        """Uncommit step ``name`` (metadata object first), then delete its data objects. Never raises.

        Multipart uploads under it older than :data:`UNCOMMITTED_GRACE_SECONDS`
        (a killed save's) are aborted; a younger one may be a save in progress.
        """
        prefix = f"{self.root}/{name}"
        remove_objects(self.fs, [f"{prefix}/{self.metadata_name}"])
        try:
            rest = self.fs.ls(prefix, detail=False, refresh=True)
        except Exception:  # pylint: disable=broad-except
            rest = []  # gone already (FileNotFoundError), or unreadable: nothing listed to delete
        remove_objects(self.fs, list(rest))
        abort_stale_uploads(self.fs, prefix, started_before=time.time() - UNCOMMITTED_GRACE_SECONDS)

