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

__all__ = ["PendingStorage", "DecodedMetadata", "has_storage", "StorageOf"]

_LOCK = threading.Lock()  # (a first access from two threads makes the records once)
_FIELDS = tuple(field.name for field in dataclasses.fields(Metadata))


class PendingStorage:
    """``storage_data``'s decoded entries in order: ``(MetadataIndex, StorageInfo)`` pairs and
    :class:`.regular_runs.StorageRows` (every key checked unique by the decoder). Their ``StorageInfo`` records
    are made once, whichever of :meth:`by_key` and :meth:`records` asks first: both hold the same records."""

    __slots__ = ("parts", "_infos")

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts
        self._infos: list[list[StorageInfo] | None] | None = None

    def _rows_infos(self) -> list[list[StorageInfo] | None]:
        """For each part, its rows' records (``None`` for a pair)."""
        if self._infos is None:
            # pylint: disable-next=unidiomatic-typecheck
            self._infos = [part.infos() if type(part) is StorageRows else None for part in self.parts]
        return self._infos

    def by_key(self) -> dict[tuple[str, tuple[int, ...]], StorageInfo]:
        """The entries keyed by plain ``(key, offset)`` tuples (what ``consistency.storage_by_key`` returns), in the
        file's order, without a ``MetadataIndex`` each."""
        keyed: dict[tuple[str, tuple[int, ...]], StorageInfo] = {}
        for part, infos in zip(self.parts, self._rows_infos()):
            if infos is None:
                keyed[(part[0].fqn, tuple(part[0].offset))] = part[1]
            else:
                keyed.update(zip(part.keys(), infos))
        return keyed

    def records(self) -> dict[MetadataIndex, StorageInfo]:
        """The ``storage_data`` dict, in the file's order."""
        storage: dict[MetadataIndex, StorageInfo] = {}
        for part, infos in zip(self.parts, self._rows_infos()):
            if infos is None:
                storage[part[0]] = part[1]
            else:
                storage.update(zip(part.indexes(), infos))
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
                            doc="Where each item is stored (made on first access).")

    def pending_by_key(self) -> dict[tuple[str, tuple[int, ...]], StorageInfo] | None:
        """While ``storage_data`` was not asked for: its entries keyed by plain ``(key, offset)`` tuples, each key
        once (made once; the records ``storage_data`` will hold); else ``None`` (use ``storage_data``). A load's
        reader looks entries up by key: it never needs a ``MetadataIndex`` of each. Any rank, any thread."""
        keyed = self.__dict__.get("_by_key")
        if keyed is None and type(self.__dict__["_storage"]) is PendingStorage:  # pylint: disable=unidiomatic-typecheck
            with _LOCK:
                keyed = self.__dict__.get("_by_key")
                pending = self.__dict__["_storage"]
                if keyed is None and type(pending) is PendingStorage:  # pylint: disable=unidiomatic-typecheck
                    keyed = self.__dict__["_by_key"] = pending.by_key()
        return keyed

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


def has_storage(metadata: Metadata) -> bool:
    """``metadata.storage_data is not None``, without making a decoded metadata's records. Pure."""
    if isinstance(metadata, DecodedMetadata) and metadata.pending_by_key() is not None:
        return True
    return metadata.storage_data is not None


class StorageOf:
    """``metadata.storage_data``'s ``get``, the records made only when an entry is looked up (a load passes it
    where an entry is needed in rare cases only). Any rank."""

    __slots__ = ("_metadata",)

    def __init__(self, metadata: Metadata) -> None:
        self._metadata = metadata

    def get(self, index: MetadataIndex, default: Any = None) -> Any:
        """``metadata.storage_data.get(index, default)`` (``default`` without storage data)."""
        storage = self._metadata.storage_data
        return default if storage is None else storage.get(index, default)
