"""What one flattened state-dict leaf is, in the terms the planners use.

Every tensor-like leaf (DTensor, MindSpore Tensor/Parameter, numpy array,
``ShardedTensor``) becomes a :class:`TensorEntry`: the global shape and one or
more *pieces*, boxes of the global tensor that this rank holds. A DTensor or a
whole tensor is one piece; a ``ShardedTensor`` with ``flattened_range`` is the
few boxes its flat slice decomposes into, so a flat slice is stored as ordinary
chunks and reshards like any other box. Every other leaf becomes a
:class:`ValueEntry`, stored as bytes by a type handler.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hyper_parallel.core.distributed_checkpoint.errors import UnsupportedTypeError
from hyper_parallel.core.distributed_checkpoint.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)
from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.platform.tensor import is_tensor
from hyper_parallel.platform.dtypes import dtype_name, tensor_dtype_name

__all__ = [
    "TensorPiece",
    "TensorEntry",
    "ValueEntry",
    "SkipEntry",
    "make_entry",
    "plain_tensor_entry",
    "plain_dtype_name",
    "flat_range_boxes",
    "piece_view",
]


@dataclass(frozen=True)
class TensorPiece:
    """A box of the global tensor held locally.

    Attributes:
        offsets: Global offset of the box.
        sizes: Extent of the box.
        flat_start: ``None`` when the box is the whole local tensor; else the
            position in the (1-D) local data where the box's elements start,
            in row-major order.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int | None = None


class TensorEntry(NamedTuple):
    """A tensor-like leaf (immutable; a typed tuple: one is made per tensor leaf of every save and load, at a
    fifth of a frozen dataclass's cost).

    Attributes:
        fqn: Storage key.
        dtype: Stored (or target) dtype name.
        global_shape: Shape of the global tensor.
        pieces: The boxes held locally.
        local: The local tensor object (loaded into in place).
        local_shape: Shape of the local box (before any flattening).
        write: Whether this rank offers the pieces for writing (main replica).
        allow_shape_mismatch: On load, accept a different stored global shape.
        may_be_replicated: Another rank may hold the same box (a whole
            tensor, or a DTensor whose layout has replica positions).
        layout: The DTensor's :class:`.Layout` (``None`` otherwise): lets the
            save plan describe the piece by its layout (see ``_layout_plan``).
    """

    fqn: str
    dtype: str
    global_shape: tuple[int, ...]
    pieces: tuple[TensorPiece, ...]
    local: Any
    local_shape: tuple[int, ...]
    write: bool = True
    allow_shape_mismatch: bool = False
    may_be_replicated: bool = False
    layout: Any = None


@dataclass(frozen=True)
class ValueEntry:
    """A non-tensor leaf (a plain value or a ``ShardedObject``).

    Attributes:
        fqn: Storage key.
        value: The value.
        offset: Grid position of a ``ShardedObject`` (empty otherwise).
        grid_shape: Grid shape of a ``ShardedObject`` (empty otherwise).
        write: Whether this rank writes it (main replica).
    """

    fqn: str
    value: Any
    offset: tuple[int, ...] = ()
    grid_shape: tuple[int, ...] = ()
    write: bool = True


@dataclass(frozen=True)
class SkipEntry:
    """A leaf never saved (``LocalNonpersistentObject``); on load it keeps its value."""

    fqn: str
    value: Any


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cut the row-major flat range ``[start, stop)`` of ``shape`` into boxes.

    The boxes come in flat order and each is contiguous in row-major order, so
    box ``i`` holds the next ``prod(sizes)`` elements of the range.

    Returns:
        ``(offsets, sizes)`` of each box, offsets relative to ``shape``.
    """
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    row, col = divmod(start, inner)
    if col:
        end = min(stop, (row + 1) * inner)
        for offs, sizes in flat_range_boxes(shape[1:], col, end - row * inner):
            boxes.append(((row,) + offs, (1,) + sizes))
        row, start = row + 1, end
    full_rows = (stop - start) // inner
    if start < stop and full_rows:
        boxes.append(((row,) + (0,) * (len(shape) - 1), (full_rows,) + tuple(shape[1:])))
        row, start = row + full_rows, start + full_rows * inner
    if start < stop:
        for offs, sizes in flat_range_boxes(shape[1:], 0, stop - start):
            boxes.append(((row,) + offs, (1,) + sizes))
    return boxes


def _sharded_tensor_entry(fqn: str, st: ShardedTensor) -> TensorEntry:
    if st.flattened_range is None:
        pieces = (TensorPiece(offsets=st.global_offset, sizes=st.local_shape),)
    else:
        rng = st.flattened_range
        boxes = flat_range_boxes(st.local_shape, rng.start, rng.stop)
        pieces_list = []
        position = 0
        for offs, sizes in boxes:
            glob = tuple(o + g for o, g in zip(offs, st.global_offset))
            pieces_list.append(TensorPiece(offsets=glob, sizes=sizes, flat_start=position))
            position += math.prod(sizes)
        pieces = tuple(pieces_list)
    return TensorEntry(
        fqn=fqn,
        dtype=dtype_name(st.data),
        global_shape=st.global_shape,
        pieces=pieces,
        local=st.data,
        local_shape=st.local_shape,
        write=is_main_replica(st.replica_id),
        allow_shape_mismatch=st.allow_shape_mismatch,
    )


def make_entry(fqn: str, value: Any) -> TensorEntry | ValueEntry | SkipEntry:
    """Classify one flattened leaf.

    Raises:
        UnsupportedTypeError: an unapplied ``ShardedTensorFactory`` (call
            ``apply_factories`` first), or a tensor dtype that cannot be stored.
    """
    try:
        return _make_entry(fqn, value)
    except TypeError as exc:
        if isinstance(exc, UnsupportedTypeError):
            raise
        raise UnsupportedTypeError(f"key '{fqn}': {exc}; convert it to a supported dtype before saving") from exc


@functools.lru_cache(maxsize=1024)
def _whole_pieces(shape: tuple[int, ...]) -> tuple[TensorPiece, ...]:
    """The pieces of a whole tensor of ``shape``: one box from the origin (records are immutable: shared)."""
    return (TensorPiece((0,) * len(shape), shape),)


_new_tuple = tuple.__new__


def _plain_tensor_entry(fqn: str, dtype: str, shape: tuple[int, ...], value: Any) -> TensorEntry:
    """The :class:`TensorEntry` of a whole plain tensor: equal to ``TensorEntry(fqn, dtype, shape,
    ((0,...), shape) piece, value, shape, write=True, allow_shape_mismatch=False, may_be_replicated=True)``,
    built without the class's Python-level ``__new__`` (one per leaf of a state of thousands)."""
    # The fields in order: fqn, dtype, global_shape, pieces, local, local_shape, write, allow_shape_mismatch,
    # may_be_replicated, layout.
    return _new_tuple(TensorEntry, (fqn, dtype, shape, _whole_pieces(shape), value, shape, True, False, True, None))


#: Exact type of a leaf -> whether it is a plain MindSpore tensor (a Parameter, a Tensor; no DTensor or
#: ShardedTensor): most leaves of a state, classified without the chain of type tests below.
_PLAIN_TENSOR_TYPES: dict[type, bool] = {}


def _is_plain(kind: type, value: Any) -> bool:
    plain = _PLAIN_TENSOR_TYPES[kind] = is_tensor(value) and not issubclass(kind, (DTensor, ShardedTensor))
    return plain


#: id() of a MindSpore or numpy dtype -> (the dtype, its stored name or None: not stored); the dtype is held, so
#: the identity check makes a reused id harmless. At most :data:`_MAX_DTYPE_NAMES` entries, emptied when full:
#: MindSpore's and numpy's native dtypes are singletons, but a big-endian, structured or metadata-carrying numpy
#: dtype can be a new object per array, and each would stay here for good (and keep the dtypes met later out).
_DTYPE_NAMES: dict[int, tuple[Any, str | None]] = {}
_MAX_DTYPE_NAMES = 256


def _stored_name(dtype: Any, value: Any) -> str | None:
    """The stored name of ``value``'s dtype ``dtype``, looked up once per dtype object; ``None``: not stored."""
    known = _DTYPE_NAMES.get(id(dtype))
    if known is None or known[0] is not dtype:
        try:
            name = dtype_name(value)
        except TypeError:
            name = None  # a dtype no checkpoint stores (an object array too): make_entry classifies or refuses it
        if len(_DTYPE_NAMES) >= _MAX_DTYPE_NAMES:
            _DTYPE_NAMES.clear()  # the dtypes in use come back at their next leaf
        known = _DTYPE_NAMES[id(dtype)] = (dtype, name)
    return known[1]


def plain_dtype_name(value: Any) -> str | None:
    """The stored dtype name of a plain MindSpore tensor (a Parameter, a Tensor) or a plain numpy array, as
    :func:`.dtype_name` gives it, looked up once per dtype object; ``None`` for any other leaf (a DTensor, a
    ``ShardedTensor``, an array subclass, a value) and for a dtype no checkpoint stores. Pure; never raises."""
    kind = type(value)
    if kind is np.ndarray:
        return _stored_name(value.dtype, value)
    plain = _PLAIN_TENSOR_TYPES.get(kind)
    if not (plain or plain is None and _is_plain(kind, value)):
        return None
    return _stored_name(value.dtype, value)


def plain_tensor_entry(fqn: str, value: Any) -> TensorEntry | None:
    """:func:`make_entry` of a plain MindSpore tensor (a Parameter, a Tensor) or a plain writable numpy array of a
    dtype the checkpoint stores, in one call (the usual leaf of a state of thousands); ``None`` for any other leaf,
    which :func:`make_entry` classifies (and refuses with its message, e.g. a dtype no checkpoint stores; a
    read-only array is refused by the load planner's own check). Pure; never raises."""
    kind = type(value)
    if kind is np.ndarray:
        name = _stored_name(value.dtype, value) if value.flags.writeable else None
    else:  # (plain_dtype_name, its cache hit inlined: one call per leaf)
        plain = _PLAIN_TENSOR_TYPES.get(kind)
        if not (plain or plain is None and _is_plain(kind, value)):
            return None
        dtype = value.dtype
        known = _DTYPE_NAMES.get(id(dtype))
        name = known[1] if known is not None and known[0] is dtype else _stored_name(dtype, value)
    if name is None:
        return None
    shape = value.shape
    if type(shape) is not tuple:  # pylint: disable=unidiomatic-typecheck
        shape = tuple(map(int, shape))
    # _plain_tensor_entry, inlined: the fields in order.
    return _new_tuple(TensorEntry, (fqn, name, shape, _whole_pieces(shape), value, shape, True, False, True, None))


def _make_entry(fqn: str, value: Any) -> TensorEntry | ValueEntry | SkipEntry:
    kind = type(value)
    plain = _PLAIN_TENSOR_TYPES.get(kind)
    if plain is None:
        plain = _is_plain(kind, value)
    if plain:
        shape = tuple(map(int, value.shape))
        return _plain_tensor_entry(fqn, tensor_dtype_name(value), shape, value)
    if isinstance(value, DTensor):
        local = value.to_local()
        return TensorEntry(
            fqn=fqn,
            dtype=dtype_name(local),
            global_shape=tuple(value.shape),
            pieces=(TensorPiece(offsets=tuple(value.global_offset), sizes=tuple(value.local_shape)),),
            local=local,
            local_shape=tuple(value.local_shape),
            may_be_replicated=value.layout.num_shards() < len(value.layout.rank_list),
            layout=value.layout,
        )
    if isinstance(value, ShardedTensor):
        return _sharded_tensor_entry(fqn, value)
    if is_tensor(value) or isinstance(value, np.ndarray):
        shape = tuple(map(int, value.shape))
        if isinstance(value, np.ndarray) and value.dtype == object:
            return ValueEntry(fqn=fqn, value=value)
        return _plain_tensor_entry(fqn, dtype_name(value), shape, value)
    if isinstance(value, ShardedObject):
        return ValueEntry(
            fqn=fqn,
            value=value.data,
            offset=value.global_offset,
            grid_shape=value.global_shape,
            write=is_main_replica(value.replica_id),
        )
    if isinstance(value, LocalNonpersistentObject):
        return SkipEntry(fqn=fqn, value=value.unwrap())
    if isinstance(value, ShardedTensorFactory):
        raise UnsupportedTypeError(
            f"state_dict key '{fqn}' holds a ShardedTensorFactory; call "
            "hyper_parallel.core.distributed_checkpoint.mapping.apply_factories(state_dict) first"
        )
    return ValueEntry(fqn=fqn, value=value)


def piece_view(local_array: np.ndarray, entry: TensorEntry, piece: TensorPiece) -> np.ndarray:
    """Return the part of the local array holding ``piece``, shaped like the box.

    A view whenever the layout allows (always for whole and flat pieces).
    """
    if piece.flat_start is None:
        return local_array.reshape(piece.sizes)
    count = math.prod(piece.sizes)
    flat = local_array.reshape(-1)
    return flat[piece.flat_start : piece.flat_start + count].reshape(piece.sizes)
