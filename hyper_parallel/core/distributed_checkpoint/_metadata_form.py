"""Which metadata form a save commits: the writers' ``metadata_form`` option and its ``"auto"`` estimate.

Small saves keep one ``metadata.json`` listing every storage entry (the
in-line form). A save whose in-line metadata would be large (estimated at
:data:`ENTRY_JSON_BYTES` per entry and :data:`DIGEST_JSON_BYTES` per further
checksum digest, over :data:`AUTO_INDEX_BYTES`), or whose writer was told
``metadata_form="indexed"``, is committed in the indexed form (docs/format.md
section 12.1; :mod:`._index_form`, :mod:`._index_plan`). The estimate is
made at plan time from the merged plan's chunks (:func:`plan_wants_index`,
so every rank can write its own index), or at commit from the storage
entries the ranks returned (:func:`wants_index_form`); both compare the same
sum against the same threshold.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

from hyper_parallel.core.distributed_checkpoint._format.checksum import flat_count, grid_shape, tile_shape
from hyper_parallel.core.distributed_checkpoint._grid_chunks import GridChunks
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, TensorStorageMetadata
from hyper_parallel.platform.dtypes import DTYPE_NAMES

__all__ = [
    "METADATA_FORMS",
    "AUTO_INDEX_BYTES",
    "ENTRY_JSON_BYTES",
    "DIGEST_JSON_BYTES",
    "check_metadata_form",
    "wants_index_form",
    "extra_digests",
    "plan_wants_index",
    "chunk_digests",
]

#: Values of the writers' ``metadata_form`` option.
METADATA_FORMS = ("auto", "inline", "indexed")
#: With ``metadata_form="auto"``, a save whose in-line metadata is estimated above this is indexed.
AUTO_INDEX_BYTES = 64 << 20
#: Estimated JSON bytes per storage entry and chunk box of the in-line form, its first digest included
#: (``scripts/bench_metadata.py``).
ENTRY_JSON_BYTES = 225
#: JSON bytes of each further checksum digest of an entry (16 hex digits, quotes, comma).
DIGEST_JSON_BYTES = 19


def check_metadata_form(form: object) -> str:
    """``form`` if it is one of :data:`METADATA_FORMS`. Any rank.

    Raises:
        CheckpointValueError: anything else (names the choices).
    """
    if form not in METADATA_FORMS:
        raise CheckpointValueError(f"metadata_form must be one of {', '.join(METADATA_FORMS)}; got {form!r}")
    return form  # type: ignore[return-value]


def wants_index_form(form: str, entries: int, extra_digests: int = 0) -> bool:
    """Whether a save of ``entries`` storage entries commits the indexed form. Coordinator; pure.

    ``extra_digests``: the checksum digests of those entries beyond one per entry (a chunk of many checksum
    blocks, e.g. a large tensor at one digest per MiB, weighs more in-line than the entry estimate).
    """
    if form == "auto":
        return entries * ENTRY_JSON_BYTES + extra_digests * DIGEST_JSON_BYTES > AUTO_INDEX_BYTES
    return form == "indexed"


def extra_digests(storage: Any) -> int:
    """The checksum digests of ``storage``'s entries beyond one per entry. Coordinator; pure.

    A tiled chunk's ``flat_digests`` are counted too.
    """
    return sum(len(info.checksum.digests) + len(info.checksum.flat_digests) - 1 for info in storage.values()
               if info.checksum is not None)


#: The in-line estimates of the last few plans: ``(metadata, block_bytes, tiles, (entries, extra digests))``, newest
#: first. A reused cached plan brings back its metadata object at every save, so its estimate is made once, not per
#: save.
_ESTIMATES: list[tuple["weakref.ref[Metadata]", int, bool, tuple[int, int]]] = []
_KEPT_ESTIMATES = 4


def plan_wants_index(form: str, metadata: Metadata, *, block_bytes: int, tiles: bool = True) -> bool:
    """Whether the save of ``metadata`` commits the indexed form, decided from the plan. Coordinator; pure.

    ``"auto"`` estimates the in-line size as :func:`wants_index_form` does at commit, each
    chunk's checksum digests counted from its shape as the save will store them (:func:`chunk_digests`;
    ``tiles``: the writer's ``tile_checksums``). The estimate of a plan's metadata (not changed once the plan
    is built) is remembered for the next saves of that plan.
    """
    if form != "auto":
        return wants_index_form(form, 0)
    for known, block, tiled, estimate in tuple(_ESTIMATES):
        if known() is metadata and block == block_bytes and tiled == tiles:
            return wants_index_form(form, *estimate)
    estimate = _inline_estimate(metadata, block_bytes=block_bytes, tiles=tiles)
    _ESTIMATES.insert(0, (weakref.ref(metadata), block_bytes, tiles, estimate))
    del _ESTIMATES[_KEPT_ESTIMATES:]
    return wants_index_form(form, *estimate)


def chunk_digests(sizes: tuple[int, ...], itemsize: int, *, block_bytes: int, tiles: bool) -> int:
    """How many checksum digests a save stores for an uncompressed tensor chunk of ``sizes``. Any rank; pure.

    Its flat blocks (at least one), and, when the chunk gets tiles (``tiles`` and a wide enough chunk of two or
    more dims, :func:`._format.checksum.tile_shape`), its tiles as well: a tiled chunk lists both
    (``digests`` and ``flat_digests``, format 2.2).
    """
    flat = flat_count(math.prod(sizes) * itemsize, block_bytes)
    shape = tile_shape(sizes, itemsize, block_bytes) if tiles else ()
    if not shape:
        return flat
    rows, columns = grid_shape(sizes, shape)
    return flat + rows * columns


def _inline_estimate(metadata: Metadata, *, block_bytes: int, tiles: bool) -> tuple[int, int]:
    """The storage entries ``metadata``'s chunks make, and their checksum digests beyond one per entry."""
    entries = extra = 0
    counted: dict[tuple[tuple[int, ...], int], int] = {}  # digests of a chunk shape and item size
    for item in metadata.state_dict_metadata.values():  # runs at a new plan's step: no call a chunk can skip
        if not isinstance(item, TensorStorageMetadata):
            entries += 1
            continue
        chunks = item.chunks
        count = len(chunks)
        entries += count
        itemsize = DTYPE_NAMES.get(item.properties.dtype, 1)
        if isinstance(chunks, GridChunks):
            extra += count * (chunk_digests(tuple(chunks.chunk_sizes), itemsize, block_bytes=block_bytes,
                                            tiles=tiles) - 1)
            continue
        for chunk in chunks:
            key = (tuple(chunk.sizes), itemsize)
            digests = counted.get(key)
            if digests is None:
                digests = counted[key] = chunk_digests(key[0], itemsize, block_bytes=block_bytes, tiles=tiles)
            extra += digests - 1
    return entries, extra
