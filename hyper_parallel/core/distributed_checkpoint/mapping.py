"""Megatron-style sharded state: tensors and objects named by a global key.

A :class:`ShardedTensor` says where its local data sits in a global tensor
(``global_offset`` within ``global_shape``) and whether this rank holds the
main replica; it is stored under its ``key`` wherever it sits in the state
dict, so the same global tensor saved as a ``ShardedTensor`` loads into a
``DTensor`` of the same name and the other way round. ``flattened_range``
describes a flat slice of the local shard, as a distributed optimizer holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Union

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError

__all__ = [
    "ReplicaId",
    "is_main_replica",
    "ShardedTensor",
    "ShardedObject",
    "LocalNonpersistentObject",
    "ShardedTensorFactory",
    "apply_factories",
    "apply_factory_merges",
]

#: A replica id: 0 (or all zeros) is the main replica, the one written.
ReplicaId = Union[int, tuple[int, ...]]


def is_main_replica(replica_id: Any) -> bool:
    """Tell whether ``replica_id`` names the main replica (0, or all zeros)."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


@dataclass
class ShardedTensor:
    """A local tensor that is a box (or a flat part of a box) of a global tensor.

    Attributes:
        key: Global name; the tensor is stored under it.
        data: The local tensor (MindSpore Tensor/Parameter or numpy array).
        dtype: dtype of the data (informational; the data's own dtype is used).
        local_shape: Shape of the local box (with prepended axes).
        global_shape: Shape of the global tensor.
        global_offset: Offset of the local box in the global tensor.
        axis_fragmentations: Number of fragments along each global axis.
        replica_id: 0 (or all zeros) for the main replica, which is written.
        prepend_axis_num: Leading global axes of local size 1 that ``data``
            does not have.
        allow_shape_mismatch: On load, accept a stored global shape that
            differs (the overlap is loaded).
        flattened_range: A ``slice`` of the flattened local box that ``data``
            (1-D) holds.
    """

    key: str
    data: Any
    dtype: Any
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: Any = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.local_shape = tuple(int(s) for s in self.local_shape)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        if not (len(self.local_shape) == len(self.global_shape) == len(self.global_offset)):
            raise CheckpointValueError(
                f"ShardedTensor '{self.key}': local_shape {self.local_shape}, global_shape {self.global_shape} "
                f"and global_offset {self.global_offset} must have the same length"
            )
        for dim, (off, loc, glob) in enumerate(zip(self.global_offset, self.local_shape, self.global_shape)):
            if off < 0 or loc < 0 or off + loc > glob:
                raise CheckpointValueError(
                    f"ShardedTensor '{self.key}': dim {dim} box [{off}, {off + loc}) lies outside global size {glob}"
                )
        if self.flattened_range is not None:
            rng = self.flattened_range
            if (rng.step not in (None, 1) or rng.start < 0 or rng.stop > math.prod(self.local_shape)
                    or rng.start > rng.stop):
                raise CheckpointValueError(
                    f"ShardedTensor '{self.key}': flattened_range {rng} is not a contiguous range inside the "
                    f"local shape {self.local_shape}"
                )

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: Any,
        *rank_offsets: tuple[int, int, int],
        replica_id: Any = 0,
        prepend_axis_num: int = 0,
        flattened_range: slice | None = None,
        allow_shape_mismatch: bool = False,
    ) -> "ShardedTensor":
        """Build from ``(axis, axis_rank_offset, axis_fragments)`` triples.

        Each triple says the global ``axis`` is cut into ``axis_fragments``
        equal parts and the data is part ``axis_rank_offset``. Axes below
        ``prepend_axis_num`` are global axes the data does not have.
        """
        if flattened_range is not None:
            raise CheckpointValueError(
                f"ShardedTensor '{key}': from_rank_offsets takes the local shape from the data; for a flat "
                "slice use ShardedTensor.from_rank_offsets_flat(key, data, non_flat_local_shape, *rank_offsets, "
                "flattened_range=...)"
            )
        return cls._from_shape(key, data, tuple(int(s) for s in data.shape), rank_offsets, replica_id,
                               prepend_axis_num, None, allow_shape_mismatch)

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: Any,
        non_flat_local_shape: tuple[int, ...],
        *rank_offsets: tuple[int, int, int],
        flattened_range: slice,
        replica_id: Any = 0,
        prepend_axis_num: int = 0,
        allow_shape_mismatch: bool = False,
    ) -> "ShardedTensor":
        """Like :meth:`from_rank_offsets` for ``data`` holding a flat slice of the local box.

        Args:
            non_flat_local_shape: Shape of the whole local box (without prepended axes).
            flattened_range: The slice of the flattened box that ``data`` (1-D) holds.
        """
        expected = flattened_range.stop - flattened_range.start
        if tuple(int(s) for s in data.shape) != (expected,):
            raise CheckpointValueError(
                f"ShardedTensor '{key}': flat data of shape {tuple(data.shape)} does not hold flattened_range "
                f"{flattened_range} ({expected} elements)"
            )
        return cls._from_shape(key, data, tuple(int(s) for s in non_flat_local_shape), rank_offsets, replica_id,
                               prepend_axis_num, flattened_range, allow_shape_mismatch)

    @classmethod
    def _from_shape(
        cls,
        key: str,
        data: Any,
        data_shape: tuple[int, ...],
        rank_offsets: tuple[tuple[int, int, int], ...],
        replica_id: Any,
        prepend_axis_num: int,
        flattened_range: slice | None,
        allow_shape_mismatch: bool,
    ) -> "ShardedTensor":
        local_shape = (1,) * prepend_axis_num + data_shape
        fragments = [1] * len(local_shape)
        offsets = [0] * len(local_shape)
        seen: set[int] = set()
        for axis, axis_rank_offset, axis_fragments in rank_offsets:
            if axis in seen or not 0 <= axis < len(local_shape):
                raise CheckpointValueError(
                    f"ShardedTensor '{key}': rank offset axis {axis} is repeated or outside 0..{len(local_shape) - 1}"
                )
            if not 0 <= axis_rank_offset < axis_fragments:
                raise CheckpointValueError(
                    f"ShardedTensor '{key}': axis {axis} rank offset {axis_rank_offset} not in [0, {axis_fragments})"
                )
            seen.add(axis)
            fragments[axis] = axis_fragments
            offsets[axis] = axis_rank_offset * local_shape[axis]
        global_shape = tuple(loc * frag for loc, frag in zip(local_shape, fragments))
        return cls(
            key=key,
            data=data,
            dtype=getattr(data, "dtype", None),
            local_shape=local_shape,
            global_shape=global_shape,
            global_offset=tuple(offsets),
            axis_fragmentations=tuple(fragments),
            replica_id=replica_id,
            prepend_axis_num=prepend_axis_num,
            allow_shape_mismatch=allow_shape_mismatch,
            flattened_range=flattened_range,
        )


@dataclass
class ShardedObject:
    """A per-rank Python object, one cell of a grid named by ``key``.

    Attributes:
        key: Global name.
        data: The object (stored through a type handler).
        global_shape: Shape of the grid of objects.
        global_offset: Position of this object in the grid.
        replica_id: Only the main replica is written.
    """

    key: str
    data: Any
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: Any = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        if len(self.global_shape) != len(self.global_offset) or any(
            not 0 <= o < s for o, s in zip(self.global_offset, self.global_shape)
        ):
            raise CheckpointValueError(
                f"ShardedObject '{self.key}': global_offset {self.global_offset} is not a position in grid "
                f"{self.global_shape}"
            )


@dataclass
class LocalNonpersistentObject:
    """A value never saved; on load it keeps (gets back) its local value."""

    obj: Any

    def unwrap(self) -> Any:
        """Return the wrapped local value."""
        return self.obj


@dataclass
class ShardedTensorFactory:
    """Builds sharded state for saving and merges it back after loading.

    Attributes:
        key: Name of the factory.
        data: The original local tensor.
        build_fn: ``build_fn(key, data, replica_id)`` returns a (nested)
            sharded state dict of ShardedTensors.
        merge_fn: ``merge_fn(loaded)`` turns the loaded sub-state back into
            the original tensor.
        replica_id: Passed to ``build_fn``.
    """

    key: str
    data: Any
    build_fn: Callable[..., Any]
    merge_fn: Callable[[Any], Any]
    replica_id: Any = 0

    def build(self) -> Any:
        """Run ``build_fn`` and return its sharded state."""
        return self.build_fn(self.key, self.data, self.replica_id)


def _walk(node: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(node, dict):
        for key in list(node):
            node[key] = _walk(node[key], fn)
        return node
    if isinstance(node, list):
        for position, item in enumerate(node):
            node[position] = _walk(item, fn)
        return node
    return fn(node)


def apply_factories(sharded_state_dict: dict[str, Any]) -> None:
    """Replace every :class:`ShardedTensorFactory` by what its ``build_fn`` returns (in place)."""

    def build(value: Any) -> Any:
        return value.build() if isinstance(value, ShardedTensorFactory) else value

    _walk(sharded_state_dict, build)


def apply_factory_merges(loaded: Any, factories: Any) -> Any:
    """Merge loaded sub-states back through the factories' ``merge_fn``.

    Args:
        loaded: The loaded state dict, where each factory's place holds what
            its ``build_fn`` produced, now filled with loaded values.
        factories: The same structure before :func:`apply_factories`, holding
            the factories.

    Returns:
        ``loaded`` with each factory's place replaced by ``merge_fn``'s result.
    """
    if isinstance(factories, ShardedTensorFactory):
        return factories.merge_fn(loaded)
    if isinstance(factories, dict):
        for key, sub in factories.items():
            if key not in loaded:
                raise CheckpointValueError(f"apply_factory_merges: key '{key}' of the factories is missing in loaded")
            loaded[key] = apply_factory_merges(loaded[key], sub)
        return loaded
    if isinstance(factories, list):
        for position, sub in enumerate(factories):
            loaded[position] = apply_factory_merges(loaded[position], sub)
        return loaded
    return loaded
