"""Reading the rank index objects of an indexed checkpoint in object storage (``s3://...``).

:class:`IndexObjects` is the opener an object-store checkpoint's
:class:`.IndexedStorage` reads its rank index objects with (docs/format.md
section 12.1). It holds the store's filesystem, the prefix and the save id,
and pickles with them: the committed metadata a save hands every rank, or a
pickled ``read_metadata`` result, still reads its index objects, as a
directory's (``_metadata_file.IndexFiles``) does.

An fsspec filesystem pickles as its storage options, credentials included
(``key``, ``secret``, ``token``, ``client_kwargs={"aws_secret_access_key":
...}``). The opener pickles its filesystem's class and options without any
option whose name says it is a credential (:func:`without_credentials`), so
no copy of the metadata carries them to another rank or into a file; the
copy's filesystem takes credentials from its own process's configuration
(environment, profile), as a new reader does. A filesystem that is not an
fsspec one (no ``storage_options``) is not pickled: the copy is unbound.
"""

from __future__ import annotations

import re
from typing import Any

from hyper_parallel.core.distributed_checkpoint._format.metadata_json import save_id_from_head, save_id_of
from hyper_parallel.core.distributed_checkpoint._format.rank_index import MAX_INDEX_BYTES
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)

__all__ = ["IndexObjects", "without_credentials"]

#: Option names that hold a credential, in any fsspec implementation (s3fs ``key`` / ``secret`` / ``token``,
#: botocore's ``aws_*_key*`` / ``aws_session_token``, gcsfs ``token``, adlfs ``account_key`` / ``sas_token`` /
#: ``connection_string`` / ``client_secret``, ``password``, SSE-C ``SSECustomerKey``, a ``session`` object).
_CREDENTIAL = re.compile(r"key|secret|token|passw|credential|session|sas|auth|connection_string", re.IGNORECASE)


def without_credentials(options: Any) -> Any:
    """``options`` (nested dicts, lists, tuples) without the entries whose name says they hold a credential."""
    if isinstance(options, dict):
        return {name: without_credentials(value) for name, value in options.items()
                if not (isinstance(name, str) and _CREDENTIAL.search(name))}
    if isinstance(options, (list, tuple)):
        return type(options)(without_credentials(value) for value in options)
    return options


class IndexObjects:
    """Reads the rank index objects under one checkpoint prefix; pickles with its filesystem's options, never
    its credentials.

    Args:
        fs: The fsspec filesystem of the store.
        root: The checkpoint's prefix in ``fs`` (``bucket/prefix``).
        url: The checkpoint's URL (named in errors).
        metadata_file: The metadata object that lists the indexes.
        save_id: The save whose metadata lists them (tells a checkpoint replaced meanwhile).
    """

    def __init__(self, fs: Any, *, root: str, url: str, metadata_file: str, save_id: str) -> None:
        self.fs = fs
        self.root = root
        self.url = url
        self.metadata_file = metadata_file
        self.save_id = save_id

    @property
    def picklable(self) -> bool:
        """Whether a copy can rebuild the filesystem (an fsspec filesystem: its class and options)."""
        return isinstance(getattr(self.fs, "storage_options", None), dict)

    def __reduce__(self) -> tuple:
        """Pickles as the filesystem's class, positional arguments and options without credentials, and the
        names (see the module docstring)."""
        fs_class, args = type(self.fs), tuple(getattr(self.fs, "storage_args", ()))
        options = without_credentials(dict(self.fs.storage_options))
        return (_rebuilt, (fs_class, args, options, self.root, self.url, self.metadata_file, self.save_id))

    def __call__(self, name: str, limit: int = MAX_INDEX_BYTES) -> bytes:
        """The first ``limit`` bytes of index object ``name`` (one ranged GET: an object longer than its record is
        not fetched whole). Any rank.

        Raises:
            UnsafeCheckpointError: ``name`` is not a plain name, or the object is larger than allowed.
            CheckpointNotFoundError: it is gone because the checkpoint was deleted or replaced meanwhile.
            CorruptCheckpointError: the object is missing from the checkpoint.
            CheckpointIOError: the store cannot be read.
        """
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise UnsafeCheckpointError(f"index object {name!r} is not a plain name inside checkpoint {self.url}; "
                                        "refused")
        location = f"{self.root}/{name}"
        try:
            data = self.fs.cat_file(location, start=0, end=min(limit, MAX_INDEX_BYTES + 1))
        except FileNotFoundError:
            data = None
        except CheckpointError:
            raise
        except Exception as exc:  # pylint: disable=broad-except
            if not self._empty(location):  # S3 refuses a range of an empty object: a damaged index, not the store
                raise CheckpointIOError(f"reading index object {self.url}/{name} failed: {exc}") from exc
            data = b""
        if data is None:
            if self._replaced():
                raise CheckpointNotFoundError(
                    f"checkpoint {self.url} was deleted or replaced by another save while loading (its rank index "
                    f"{name} is gone); load it again")
            raise CorruptCheckpointError(
                f"{self.url}/{name}: the rank index listed in the metadata is missing (deleted or not copied with "
                "the checkpoint): copy the whole checkpoint, or load an earlier one")
        if len(data) > MAX_INDEX_BYTES:
            raise UnsafeCheckpointError(f"{self.url}/{name}: index of over {MAX_INDEX_BYTES} bytes is larger than "
                                        "allowed; refused")
        return data

    def _empty(self, location: str) -> bool:
        """True when object ``location`` exists and holds no byte."""
        try:
            return self.fs.info(location).get("size") == 0
        except Exception:  # pylint: disable=broad-except
            return False

    def _replaced(self) -> bool:
        """True when the committed metadata is gone or names another save than :attr:`save_id`."""
        try:
            data = self.fs.cat_file(f"{self.root}/{self.metadata_file}")
        except FileNotFoundError:
            return True
        except Exception:  # pylint: disable=broad-except  # unreadable: not known to be replaced
            return False
        try:
            committed = save_id_from_head(data[:4096]) or save_id_of(data)
        except (ValueError, RecursionError):
            return False
        return committed is not None and committed != self.save_id


def _rebuilt(fs_class: Any, args: tuple, options: dict[str, Any], root: str, url: str, metadata_file: str,
             save_id: str) -> IndexObjects:
    """An :class:`IndexObjects` from its pickled parts (the filesystem made anew: credentials from this process)."""
    return IndexObjects(fs_class(*args, **options), root=root, url=url, metadata_file=metadata_file,
                        save_id=save_id)
