"""A save's layout in a few bytes, so that a repeated layout skips planning.

A save plan depends on the state dict's layout (keys, tensor shapes, dtypes,
shardings, which rank offers what, the non-tensor values) and not on the
tensors' values. :func:`describe_layout` walks the flattened state once and
digests one small row of plain tuples per leaf: a MindSpore Tensor, Parameter
or numpy array costs a type check, its shape and dtype; every other leaf is
classified as the planner would (DTensor, ShardedTensor, values). Ranks agree
on these digests (:mod:`._plan_cache`); when every rank's layout repeats the
previous save's, the cached plan is reused and no :class:`.WriteItem` is built.

The digest covers every input of the local plan: a changed shape, dtype,
sharding (a DTensor's layout, global offset or local shape), key, leaf
path, alias or non-tensor value changes it, so a changed layout is never
served a stale plan.

:class:`LeafSource` tells, for each item of a cached plan, which leaf of this
save holds its data: the planner serves the data of a reused plan through it
(:meth:`.StandardSavePlanner.bind_sources`).
"""

from __future__ import annotations

import math
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import xxhash

from hyper_parallel.core.distributed_checkpoint._format.checksum import digest
from hyper_parallel.core.distributed_checkpoint._layout_memo import recall, remember
from hyper_parallel.core.distributed_checkpoint._state_items import (
    SkipEntry,
    TensorEntry,
    TensorPiece,
    ValueEntry,
    piece_view,
)
from hyper_parallel.core.distributed_checkpoint.mapping import ShardedTensor
from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.platform.tensor import is_tensor, shared_view, shared_view_reader, to_numpy
from hyper_parallel.platform.dtypes import DTYPE_NAMES

__all__ = [
    "LayoutDescription",
    "LayoutListener",
    "LeafSource",
    "describe_layout",
    "plain_tensor",
    "leaf_array",
    "host_array",
    "piece_array",
]


@dataclass(frozen=True)
class LayoutDescription:
    """What a rank sends to agree on a cached plan.

    Attributes:
        digest: xxh3-128 of every leaf's layout row, in traversal order.
        replica_digests: Digests of the possibly replicated tensor pieces,
            in local plan order (empty unless ``check_replicas`` and several ranks).
        tensor_bytes: Bytes of the tensor pieces this rank offers (sizes the staging arena).
        pieces: Number of those pieces.
    """

    digest: str
    replica_digests: tuple[str, ...]
    tensor_bytes: int
    pieces: int = 0


class LayoutListener(Protocol):
    """Told about a save's layout as the layout pass meets it (the staging of an async save)."""

    def leaf(self, name: str, array: np.ndarray) -> None:
        """A whole tensor in host memory: its C-contiguous data, valid while the save blocks."""

    def leaves(self, names: list[str], arrays: list[np.ndarray], nbytes: list[int]) -> None:
        """:meth:`leaf` of each whole tensor, in order (``nbytes``: each one's bytes), when a pass repeats the
        last one's (:mod:`._layout_memo`)."""

    def described(self, layout: LayoutDescription) -> None:
        """The pass is over."""


@dataclass(frozen=True)
class LeafSource:
    """Where a plan item's data is in the flattened state.

    Attributes:
        name: The leaf's dotted name (a key of ``FlatStateDict.values``).
        piece: Position of the item's piece among the leaf's pieces.
        plain: The leaf is a whole MindSpore Tensor/Parameter or numpy array (one piece, no entry needed).
    """

    name: str
    piece: int
    plain: bool


def plain_tensor(value: Any) -> bool:
    """Tell whether ``value`` is a whole tensor: a MindSpore Tensor/Parameter or a numeric numpy array."""
    if isinstance(value, np.ndarray):
        return value.dtype != object
    return is_tensor(value) and not isinstance(value, (DTensor, ShardedTensor))


def host_array(value: Any) -> np.ndarray | None:
    """:func:`leaf_array` of a whole tensor whose memory numpy shares (no copy), else ``None``."""
    array = value if isinstance(value, np.ndarray) else shared_view(value)
    if array is None:
        return None
    if not array.dtype.isnative:  # stored little-endian, as safetensors requires
        array = array.astype(array.dtype.newbyteorder("="))
    # Not np.ascontiguousarray, which makes a 0-d array 1-d: the array keeps the tensor's own shape.
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _plain_class(cls: type) -> bool:
    """Whether values of class ``cls`` may be whole tensors (for :func:`plain_tensor`).

    Asked before a numpy array's dtype test.
    """
    if issubclass(cls, np.ndarray):
        return True
    if issubclass(cls, (DTensor, ShardedTensor)):
        return False
    ms = sys.modules.get("mindspore")
    return ms is not None and issubclass(cls, ms.Tensor)


def _tensor_classes(plain_types: dict[type, bool]) -> bool:
    """Whether the whole-tensor classes met are all MindSpore tensor classes (no numpy array)."""
    return not any(plain and issubclass(cls, np.ndarray) for cls, plain in plain_types.items())


def _value_row(planner: Any, name: str, fqn: str, entry: Any) -> tuple[Any, ...] | None:
    """The layout row of a leaf skipped or stored as a value (its payload serialised, kept by the planner for
    writing); ``None`` for any other entry."""
    if isinstance(entry, SkipEntry):
        return (name, fqn, "skip")
    if not isinstance(entry, ValueEntry):
        return None
    row: tuple[Any, ...] = (name, fqn, "value", entry.offset, entry.grid_shape, entry.write)
    if entry.write:
        type_name, payload = planner.serialize(entry)
        row += (type_name, len(payload), digest(payload))
    return row


def _values_repeat(planner: Any, others: tuple[tuple[str, tuple[Any, ...]], ...]) -> bool:
    """Whether each leaf of ``others`` (a remembered pass's ``(name, row)`` of its values) has that row now."""
    values, storage_keys = planner.flat.values, planner.flat.storage_keys
    for name, row in others:
        fqn = storage_keys[name]
        if _value_row(planner, name, fqn, planner.classify(fqn, values[name])) != row:
            return False
    return True


def _dtype_name(dtype: np.dtype) -> str | None:
    """The stored dtype name of a numpy dtype (``None``: not storable)."""
    name = _NUMPY_NAMES.get(dtype)
    if name is None and dtype not in _NUMPY_NAMES:
        name = dtype.name if dtype.name in DTYPE_NAMES and dtype.isnative else None
        _NUMPY_NAMES[dtype] = name
    return name


_NUMPY_NAMES: dict[np.dtype, str | None] = {}


def leaf_array(value: Any) -> np.ndarray:
    """A whole tensor's data as a C-contiguous array in native byte order (a view when possible)."""
    array = to_numpy(value)
    if not array.dtype.isnative:  # stored little-endian, as safetensors requires
        array = array.astype(array.dtype.newbyteorder("="))
    return np.ascontiguousarray(array)


def describe_layout(planner: Any, listener: LayoutListener | None = None) -> LayoutDescription:
    """Digest the layout of the planner's flattened state (after ``configure_planner``). All ranks.

    Serialises non-tensor values (their payloads are kept by the planner for
    writing), keeps the numpy view of every whole tensor in host memory
    (``planner.leaf_arrays``, so the staging of a reused plan looks nothing
    up again) and, with ``check_replicas`` on several ranks, hashes every
    possibly replicated piece (kept by the planner for its local plan), or,
    when the planner hashes them later (``planner.later_replicas``, a forked
    writer hashing its snapshot), keeps the pieces for it.

    Args:
        planner: A configured :class:`.StandardSavePlanner`.
        listener: Told each whole tensor in host memory as it is met, then the result.

    Raises:
        UnsupportedTypeError: A value or dtype no checkpoint stores (names the key).
    """
    flat = planner.flat
    check = planner.check_replicas and planner.world_size > 1
    recalled = None if check or flat.aliases else recall(flat.values)
    if recalled is not None and _values_repeat(planner, recalled[0].others):  # the last pass's state again
        memo, views = recalled  # (:mod:`._layout_memo`): no tensor walked
        planner.leaf_arrays.update(zip(memo.tensor_names, views))
        if listener is not None:
            listener.leaves(memo.tensor_names, views, memo.nbytes)
            listener.described(memo.layout)
        return memo.layout
    pieces = 0
    rows: list[tuple[Any, ...]] = []
    replicas: list[str] = []
    converted = False  # a host array that is not its tensor's own view (a copy in native byte order)
    others: list[tuple[str, tuple[Any, ...]]] = []  # (name, row) of every leaf skipped or stored as a value
    sharded = False  # a leaf stored as pieces (DTensor, ShardedTensor)
    later = planner.later_replicas if check else None  # kept for the writer to hash (a forked writer's snapshot)
    total = 0
    storage_keys = flat.storage_keys
    arrays = planner.leaf_arrays
    view_of = shared_view_reader()
    plain_types: dict[type, bool] = {}  # a leaf's class -> whether it is a whole tensor (numpy: see plain_tensor)
    for name, value in flat.values.items():
        fqn = storage_keys[name]
        plain = plain_types.get(type(value))
        if plain is None:
            plain = plain_types[type(value)] = _plain_class(type(value))
        if plain and (not isinstance(value, np.ndarray) or value.dtype != object):
            array = view_of(value)
            if array is not None and not (array.flags.c_contiguous and array.dtype.isnative):
                array, converted = host_array(value), True
            dtype = _dtype_name(array.dtype) if array is not None else None
            if dtype is None:  # device memory (not copied out here), or a dtype to report against its key
                shape, dtype = tuple(value.shape), planner.classify_dtype(fqn, value)
                total += math.prod(shape) * DTYPE_NAMES[dtype]
            else:
                shape = array.shape
                arrays[name] = array
                total += array.nbytes
                if listener is not None:
                    listener.leaf(name, array)
            rows.append((name, fqn, dtype, shape))
            pieces += 1
            if later is not None:
                later.append((fqn, (0,) * len(shape), array if array is not None else leaf_array(value)))
            elif check:
                whole = array if array is not None else leaf_array(value)
                found = digest(memoryview(whole.reshape(-1).view(np.uint8)))
                planner.keep_replica_digest(fqn, (0,) * len(shape), found)
                replicas.append(found)
            continue
        entry = planner.classify(fqn, value)
        row = _value_row(planner, name, fqn, entry)
        if row is not None:
            rows.append(row)
            others.append((name, row))
        elif isinstance(entry, TensorEntry):
            sharded = True
            boxes = tuple((p.offsets, p.sizes, p.flat_start) for p in entry.pieces)
            rows.append((name, fqn, "tensor", entry.dtype, entry.global_shape, entry.local_shape, boxes,
                         entry.write, entry.may_be_replicated, entry.layout))
            if not entry.write:
                continue
            total += sum(math.prod(p.sizes) for p in entry.pieces) * DTYPE_NAMES[entry.dtype]
            pieces += len(entry.pieces)
            if later is not None and entry.may_be_replicated:
                later.extend((fqn, piece.offsets, piece_array(entry, piece)) for piece in entry.pieces)
            elif check and entry.may_be_replicated:
                for piece in entry.pieces:
                    found = digest(memoryview(piece_array(entry, piece).reshape(-1).view(np.uint8)))
                    planner.keep_replica_digest(fqn, piece.offsets, found)
                    replicas.append(found)
    rows.append(("aliases", tuple(sorted(flat.aliases.items()))))
    layout = xxhash.xxh3_128_hexdigest(pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL))
    found = LayoutDescription(digest=layout, replica_digests=tuple(replicas), tensor_bytes=total, pieces=pieces)
    if (not (check or converted or sharded or flat.aliases) and len(arrays) + len(others) == len(flat.values)
            and _tensor_classes(plain_types)):
        remember(flat.values, arrays, found, others=tuple(others))
    if listener is not None:
        listener.described(found)
    return found


def piece_array(entry: TensorEntry, piece: TensorPiece) -> np.ndarray:
    """One piece of a tensor entry as a C-contiguous array in native byte order (a view when possible)."""
    local = to_numpy(entry.local)
    if not local.dtype.isnative:  # stored little-endian, as safetensors requires
        local = local.astype(local.dtype.newbyteorder("="))
    if piece.flat_start is None and tuple(local.shape) != entry.local_shape:
        local = local.reshape(entry.local_shape)
    return np.ascontiguousarray(piece_view(local, entry, piece))
