"""Decoded metadata whose usual storage entries become records when ``storage_data`` is first asked for.

``read_metadata`` decodes and checks every entry of ``metadata.json`` at once (a
hostile or damaged file is refused there), but making the three records of each
usual storage entry (:class:`.MetadataIndex`, :class:`.StorageInfo`,
:class:`.ChunkChecksum`) is about a third of the decode, and a caller that
looks at the keys, dtypes and shapes never needs them. :class:`DecodedMetadata`
is a :class:`.Metadata` whose ``storage_data`` is made from the checked columns
(:class:`.regular_runs.StorageRows`) on first access, once, and is then the same
dict every time. It compares, hashes, prints, copies, pickles and
``dataclasses.replace``-s as the :class:`.Metadata` of the same fields (a
pickle or a copy is a plain :class:`.Metadata`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from hyper_parallel.core.distributed_checkpoint._format.regular_runs import StorageRows
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, MetadataIndex, StorageInfo

__all__ = ["PendingStorage", "DecodedMetadata"]

_LOCK = threading.Lock()  # (a first access from two threads makes the records once)
_FIELDS = tuple(field.name for field in dataclasses.fields(Metadata))


class PendingStorage:
    """``storage_data``'s decoded entries in order: ``(MetadataIndex, StorageInfo)`` pairs and
    :class:`.regular_runs.StorageRows` (every key checked unique by the decoder)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def records(self) -> dict[MetadataIndex, StorageInfo]:
        """The ``storage_data`` dict, in the file's order."""
        storage: dict[MetadataIndex, StorageInfo] = {}
        pairs: list[tuple[MetadataIndex, StorageInfo]] = []
        for part in self.parts:
            if type(part) is StorageRows:  # pylint: disable=unidiomatic-typecheck
                storage.update(pairs)
                pairs = []
                storage.update(part.pairs())
            else:
                pairs.append(part)
        storage.update(pairs)
        return storage


def _storage_data(metadata: "DecodedMetadata") -> Any:
    found = metadata.__dict__["_storage"]
    if type(found) is PendingStorage:  # pylint: disable=unidiomatic-typecheck
        with _LOCK:
            found = metadata.__dict__["_storage"]
            if type(found) is PendingStorage:  # pylint: disable=unidiomatic-typecheck
                found = metadata.__dict__["_storage"] = found.records()
    return found


def _set_storage_data(metadata: "DecodedMetadata", value: Any) -> None:
    metadata.__dict__["_storage"] = value  # (the frozen __init__ of Metadata sets it through this)


class DecodedMetadata(Metadata):
    """A :class:`.Metadata` decoded by ``metadata_from_json`` whose ``storage_data`` may be a
    :class:`PendingStorage` until first read (see the module docstring). Any rank."""

    storage_data = property(_storage_data, _set_storage_data,  # type: ignore[assignment]
                            doc=Metadata.__doc__ and "Where each item is stored (made on first access).")

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Metadata):
            return NotImplemented
        return self._fields() == tuple(getattr(other, name) for name in _FIELDS)

    __hash__ = Metadata.__hash__

    def __repr__(self) -> str:
        return repr(Metadata(*self._fields()))

    def __reduce__(self) -> tuple[Any, ...]:
        return Metadata, self._fields()
