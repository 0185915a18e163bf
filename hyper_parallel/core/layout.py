"""How a tensor is split over a mesh of devices (``mindspore.parallel.Layout`` compatible).

A :class:`Layout` holds the same four facts as MindSpore's ``Layout.to_dict()``:

* ``device_matrix``: the mesh shape; mesh positions are numbered row-major.
* ``rank_list``: ``rank_list[i]`` is the global rank at mesh position ``i``
  (default ``range(prod(device_matrix))``).
* ``tensor_map``: one entry per tensor dim. ``-1`` leaves the dim whole; ``k``
  splits it over mesh dim ``len(device_matrix) - 1 - k`` (counted from the
  right); a tuple splits it over several mesh dims, the first the outermost.
* ``alias_name``: optional names of the mesh dims (kept for round trips only).

Mesh dims that no tensor dim uses are replica dims: ranks differing only there
hold the same shard. This module does not import MindSpore.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence, Union

from hyper_parallel.core._errors import LayoutError

__all__ = ["Layout", "TensorMapEntry"]

#: One ``tensor_map`` entry: ``-1``, a mesh-dim index from the right, or a tuple of them.
TensorMapEntry = Union[int, tuple[int, ...]]


def _to_int(value: Any, what: str) -> int:
    """Return ``value`` as a plain int, refusing bools, floats and strings."""
    if isinstance(value, bool):
        raise LayoutError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise LayoutError(f"{what} must be an integer, got {value!r}") from None


def _to_tuple(value: Any, what: str) -> tuple[Any, ...]:
    """Return a list/tuple ``value`` as a tuple, refusing other types."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise LayoutError(f"{what} must be a sequence, got {value!r}")
    return tuple(value)


def _tensor_name(name: str | None) -> str:
    return f"tensor {name!r}" if name is not None else "tensor"


@dataclass(frozen=True)
class Layout:
    """The split of one tensor over a device mesh.

    Lists are normalised to tuples and everything is validated on construction.

    Args:
        device_matrix: Mesh shape, e.g. ``(2, 4)``.
        tensor_map: One entry per tensor dim (see the module docstring).
        alias_name: Optional names of the mesh dims.
        rank_list: Global rank at each row-major mesh position. ``None`` means
            ``range(prod(device_matrix))``; it is stored as that tuple.

    Raises:
        LayoutError: An entry out of range, a mesh dim used twice, a rank_list
            of the wrong length or with duplicates.
    """

    device_matrix: tuple[int, ...]
    tensor_map: tuple[TensorMapEntry, ...]
    alias_name: tuple[str, ...] | None = None
    rank_list: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        matrix = tuple(_to_int(d, "device_matrix entry") for d in _to_tuple(self.device_matrix, "device_matrix"))
        if any(d < 1 for d in matrix):
            raise LayoutError(f"device_matrix entries must be >= 1, got {matrix}")
        tensor_map = tuple(self._normalise_entry(e, len(matrix)) for e in _to_tuple(self.tensor_map, "tensor_map"))
        used = [k for entry in tensor_map for k in (entry if isinstance(entry, tuple) else (entry,)) if k != -1]
        if len(used) != len(set(used)):
            raise LayoutError(f"tensor_map {tensor_map} uses a mesh dim more than once")
        alias = self.alias_name
        if alias is not None:
            alias = tuple(str(a) for a in _to_tuple(alias, "alias_name"))
            if len(alias) != len(matrix) or len(set(alias)) != len(alias):
                raise LayoutError(f"alias_name {alias} must be {len(matrix)} distinct names, one per mesh dim")
        size = math.prod(matrix)
        ranks = tuple(range(size)) if self.rank_list is None else tuple(
            _to_int(r, "rank_list entry") for r in _to_tuple(self.rank_list, "rank_list")
        )
        if len(ranks) != size:
            raise LayoutError(f"rank_list has {len(ranks)} ranks but device_matrix {matrix} has {size} positions")
        if len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks):
            raise LayoutError(f"rank_list {ranks} must hold distinct non-negative ranks")
        object.__setattr__(self, "device_matrix", matrix)
        object.__setattr__(self, "tensor_map", tensor_map)
        object.__setattr__(self, "alias_name", alias)
        object.__setattr__(self, "rank_list", ranks)

    @staticmethod
    def _normalise_entry(entry: Any, mesh_ndim: int) -> TensorMapEntry:
        """Validate one tensor_map entry and return it as an int or a tuple of ints."""
        if isinstance(entry, (list, tuple)):
            if not entry:
                raise LayoutError("a tensor_map tuple entry must not be empty")
            parts = tuple(_to_int(k, "tensor_map entry") for k in entry)
            if any(not 0 <= k < mesh_ndim for k in parts):
                raise LayoutError(f"tensor_map entry {parts} out of range: each must be in [0, {mesh_ndim})")
            return parts
        k = _to_int(entry, "tensor_map entry")
        if not -1 <= k < mesh_ndim:
            raise LayoutError(f"tensor_map entry {k} out of range: must be -1 or in [0, {mesh_ndim})")
        return k

    # ------------------------------------------------------------------ building

    @classmethod
    def from_any(cls, obj: Any) -> Layout:
        """Build a Layout from a Layout, a dict, or an object with ``to_dict()``.

        Args:
            obj: A :class:`Layout` (returned as is), a dict with the keys of
                :meth:`to_dict`, or e.g. a ``mindspore.parallel.Layout``.

        Raises:
            LayoutError: Anything else, an interleaved layout, or bad contents.
        """
        if isinstance(obj, Layout):
            return obj
        if not isinstance(obj, Mapping):
            to_dict = getattr(obj, "to_dict", None)
            if not callable(to_dict):
                raise LayoutError(f"cannot build a Layout from {type(obj).__name__}")
            obj = to_dict()
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Build a Layout from a dict shaped like MindSpore's ``Layout.to_dict()``.

        Raises:
            LayoutError: A missing key or an interleaved layout (not supported).
        """
        missing = [key for key in ("device_matrix", "tensor_map") if key not in data]
        if missing:
            raise LayoutError(f"layout dict lacks key(s) {missing}: {dict(data)}")
        if data.get("interleaved_parallel"):
            raise LayoutError("interleaved_parallel layouts are not supported")
        return cls(data["device_matrix"], data["tensor_map"], data.get("alias_name"), data.get("rank_list"))

    @classmethod
    def from_mindspore_layout(cls, entry: Sequence[Any], *, name: str = "parameter", rank: int | None = None) -> Layout:
        """Build the Layout of one ``Cell.parameter_layout_dict`` value.

        The value is MindSpore's ``[dev_matrix, tensor_map, slice_shape,
        field_size, uniform_split, opt_shard_group, full_shape, ...]``. An
        optimizer-parallel group splits dim 0 further over the replica mesh
        dims (its size read from ``full_shape`` and ``slice_shape``); with
        pipeline stages the layout's ``rank_list`` is ``rank``'s stage.
        Called by any rank, no communication.

        Args:
            entry: The ``parameter_layout_dict`` value.
            name: Parameter name used in error messages.
            rank: Global rank choosing the pipeline stage (default: current rank).

        Raises:
            LayoutError: An uneven split, a ``field`` > 1 or an entry that does
                not determine the split, naming the parameter and the field.
        """
        # pylint: disable=import-outside-toplevel
        from hyper_parallel.core._mindspore_layout import record_from_parameter_layout

        if rank is None:
            from hyper_parallel.platform.comm import get_rank

            rank = get_rank()
        return record_from_parameter_layout(entry, name=name, rank=rank).to_layout()

    def to_dict(self) -> dict[str, Any]:
        """Return the layout with the keys of MindSpore's ``Layout.to_dict()``."""
        return {
            "device_matrix": self.device_matrix,
            "tensor_map": self.tensor_map,
            "interleaved_parallel": False,
            "alias_name": self.alias_name,
            "rank_list": list(self.rank_list),
        }

    # ------------------------------------------------------------------ mesh facts

    def mesh_dims(self, tensor_dim: int) -> tuple[int, ...]:
        """Return the mesh dims (from the left, outermost first) splitting ``tensor_dim``."""
        entry = self.tensor_map[tensor_dim]
        parts = entry if isinstance(entry, tuple) else (entry,)
        return tuple(len(self.device_matrix) - 1 - k for k in parts if k != -1)

    def mesh_coordinate(self, rank: int) -> tuple[int, ...]:
        """Return the row-major mesh coordinate of global ``rank``.

        Raises:
            LayoutError: ``rank`` is not in ``rank_list``.
        """
        try:
            position = self.rank_list.index(rank)
        except ValueError:
            raise LayoutError(f"rank {rank} is not in the layout's rank_list {list(self.rank_list)}") from None
        coordinate = []
        for size in reversed(self.device_matrix):
            position, rest = divmod(position, size)
            coordinate.append(rest)
        return tuple(reversed(coordinate))

    def splits_per_dim(self) -> tuple[int, ...]:
        """Return the number of shards along each tensor dim."""
        return tuple(
            math.prod(self.device_matrix[m] for m in self.mesh_dims(d)) for d in range(len(self.tensor_map))
        )

    def num_shards(self) -> int:
        """Return the number of distinct shards (replicas counted once)."""
        return math.prod(self.splits_per_dim())

    def shard_index(self, rank: int) -> tuple[int, ...]:
        """Return the index of ``rank``'s shard along each tensor dim."""
        coordinate = self.mesh_coordinate(rank)
        index = []
        for d in range(len(self.tensor_map)):
            value = 0
            for m in self.mesh_dims(d):
                value = value * self.device_matrix[m] + coordinate[m]
            index.append(value)
        return tuple(index)

    def replica_dims(self) -> tuple[int, ...]:
        """Return the mesh dims (from the left) that no tensor dim uses."""
        used = {m for d in range(len(self.tensor_map)) for m in self.mesh_dims(d)}
        return tuple(m for m in range(len(self.device_matrix)) if m not in used)

    def replica_index(self, rank: int) -> int:
        """Return ``rank``'s row-major index over the replica dims (0: main replica)."""
        coordinate = self.mesh_coordinate(rank)
        value = 0
        for m in self.replica_dims():
            value = value * self.device_matrix[m] + coordinate[m]
        return value

    def ranks_holding(self, shard_index: Sequence[int]) -> tuple[int, ...]:
        """Return the ranks holding shard ``shard_index``, by increasing replica index.

        Raises:
            LayoutError: ``shard_index`` has the wrong length or is out of range.
        """
        wanted = tuple(shard_index)
        splits = self.splits_per_dim()
        if len(wanted) != len(splits) or any(not 0 <= i < s for i, s in zip(wanted, splits)):
            raise LayoutError(f"shard index {wanted} out of range for {splits} shards per dim")
        return tuple(rank for rank in self.rank_list if self.shard_index(rank) == wanted)

    # ------------------------------------------------------------------ shapes

    def local_shape(self, global_shape: Sequence[int], name: str | None = None) -> tuple[int, ...]:
        """Return the shape of one shard of a tensor of ``global_shape``.

        Args:
            global_shape: The full tensor's shape.
            name: Tensor name used in error messages.

        Raises:
            LayoutError: Wrong number of dims, or a dim not divisible by its splits.
        """
        shape = tuple(int(s) for s in global_shape)
        if len(shape) != len(self.tensor_map):
            raise LayoutError(
                f"{_tensor_name(name)} has {len(shape)} dims (shape {shape}) "
                f"but tensor_map {self.tensor_map} describes {len(self.tensor_map)}"
            )
        local = []
        for d, (size, splits) in enumerate(zip(shape, self.splits_per_dim())):
            if size % splits:
                raise LayoutError(
                    f"{_tensor_name(name)}: dim {d} of size {size} cannot be split evenly "
                    f"into {splits} shards (global shape {shape}, tensor_map {self.tensor_map})"
                )
            local.append(size // splits)
        return tuple(local)

    def shard_offsets(self, global_shape: Sequence[int], rank: int, name: str | None = None) -> tuple[int, ...]:
        """Return the global offset (per dim) of ``rank``'s shard of a ``global_shape`` tensor.

        Raises:
            LayoutError: As :meth:`local_shape`, or ``rank`` not in ``rank_list``.
        """
        local = self.local_shape(global_shape, name)
        return tuple(i * n for i, n in zip(self.shard_index(rank), local))
