"""Turn MindSpore's record of a sliced parameter into a :class:`~hyper_parallel.core.layout.Layout`.

MindSpore describes a parameter sliced by semi-auto / auto parallel with the
fields of ``node_strategy.proto``'s ``ParallelLayouts`` (the strategy file) or
with a ``Cell.parameter_layout_dict`` entry. :class:`MindSporeLayoutRecord`
holds those facts; :meth:`MindSporeLayoutRecord.to_layout` maps them exactly
onto a :class:`Layout`, or refuses with a :class:`LayoutError` naming the
parameter and the field.

The semantics follow MindSpore's own checkpoint tools
(``mindspore/parallel/_tensor.py``):

* ``dev_matrix`` is the mesh of one pipeline stage; stage ``s`` holds global
  ranks ``s * N .. (s + 1) * N - 1`` with ``N = prod(dev_matrix)``, row-major.
* ``tensor_map`` counts mesh dims from the right (as :class:`Layout` does); an
  entry with several dims splits the tensor dim over all of them, outermost first.
* Optimizer parallel (``opt_weight_shard_size`` > 0, or -1 for "all replicas")
  splits tensor dim 0 further, inside each model-parallel chunk, over the
  replica mesh dims taken from the innermost one outwards; a replica dim larger
  than what is still needed is itself cut into (outer, inner) and only its inner
  part is used. A :class:`Layout` expresses that exactly by refining the mesh
  (cutting a dim into two keeps the row-major rank order). A tensor replicated
  over every mesh dim (all > 1, step 1) whose size does not fill the dims that
  way gets MindSpore's piece ``rank % size``: mesh ``(N / size, size)``.
* ``param_split_shape`` / ``indices_offset`` describe uneven dim-0 slices: equal
  sizes are accepted, anything else is refused.
* ``field`` (a row interleave used by sparse embedding tables) maps exactly only
  for ``field`` 0 or 1; larger values are refused.

No MindSpore import happens here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field as dataclass_field
from typing import Any, Sequence

from hyper_parallel.core._errors import LayoutError
from hyper_parallel.core.layout import Layout, TensorMapEntry

__all__ = ["MindSporeLayoutRecord", "record_from_parameter_layout"]


def _entry_dims(entry: Any, mesh_ndim: int) -> list[int]:
    """Return the mesh dims (from the left, outermost first) a MindSpore tensor_map entry names."""
    parts = list(entry) if isinstance(entry, (list, tuple)) else [entry]
    return [mesh_ndim - 1 - int(k) for k in parts if int(k) != -1]


_RESHARD_FIX = ("check the strategy file, or re-shard the job's checkpoint with MindSpore's own tools "
                "(mindspore.parallel.transform_checkpoints) to a layout that splits evenly")


def _refuse(name: str, field: str, value: Any, why: str, *, where: str = "", fix: str = _RESHARD_FIX) -> LayoutError:
    return LayoutError(f"parameter {name!r}{where}: {field}={value!r} cannot be mapped exactly to a Layout "
                       f"({why}); {fix}")


@dataclass(frozen=True)
class MindSporeLayoutRecord:
    """The facts MindSpore records about one sliced parameter (strategy-file fields).

    Args:
        name: Parameter name (without the ``<stage>-`` prefix of a merged file).
        dev_matrix: Mesh of one pipeline stage.
        tensor_map: MindSpore's tensor_map (mesh dims counted from the right;
            an entry may be a tuple of dims).
        param_split_shape: Dim-0 slice sizes of an uneven split (empty: even).
        indices_offset: Dim-0 offsets of those slices (empty: implied).
        field: MindSpore's ``field`` (row interleave of sparse tables).
        opt_weight_shard_step: Rank stride of the optimizer-parallel group (0: none).
        opt_weight_shard_size: Optimizer-parallel group size (0: none, -1: all replicas).
        stage: Pipeline stage holding the parameter.
        source: The strategy file the record was read from (named by refusals;
            not part of equality).
    """

    name: str
    dev_matrix: tuple[int, ...]
    tensor_map: tuple[TensorMapEntry, ...]
    param_split_shape: tuple[int, ...] = ()
    indices_offset: tuple[int, ...] = ()
    field: int = 0
    opt_weight_shard_step: int = 0
    opt_weight_shard_size: int = 0
    stage: int = 0
    source: str = dataclass_field(default="", compare=False)

    @property
    def stage_device_num(self) -> int:
        """Number of ranks in one pipeline stage (``prod(dev_matrix)``)."""
        return math.prod(self.dev_matrix)

    def stage_ranks(self) -> tuple[int, ...]:
        """Return the global ranks of this record's stage, in row-major mesh order."""
        start = self.stage * self.stage_device_num
        return tuple(range(start, start + self.stage_device_num))

    def to_layout(self) -> Layout:
        """Return the exact :class:`Layout` of this parameter on its stage's ranks.

        Raises:
            LayoutError: An uneven split, an unsupported ``field``, or an
                optimizer-parallel split that MindSpore's rules cannot place;
                the message names the parameter, the field, the strategy file
                and the ranks of the parameter's stage.
        """
        self._check_even_split()
        ndim = len(self.dev_matrix)
        mesh = [int(d) for d in self.dev_matrix]
        if any(d < 1 for d in mesh):
            raise self._refusal("dev_matrix", self.dev_matrix, "entries must be >= 1")
        # Per tensor dim, the mesh dims (from the left, outermost first) splitting it.
        dims = [_entry_dims(e, ndim) for e in self.tensor_map]
        if any(not 0 <= m < ndim for split in dims for m in split):
            raise self._refusal("tensor_map", self.tensor_map, f"entries must be -1 or in [0, {ndim})")
        if self.field not in (0, 1):
            raise self._refusal("field", self.field, "a field split interleaves rows of several ranks")
        if self.field == 1:
            if not dims:
                raise self._refusal("field", self.field, "a scalar has no rows to split")
            dims = [list(range(ndim))] + [[] for _ in dims[1:]]
        if self.opt_weight_shard_step and self.opt_weight_shard_size:
            mesh, dims = self._add_optimizer_split(mesh, dims)
        tensor_map = tuple(
            -1 if not split
            else (len(mesh) - 1 - split[0] if len(split) == 1 else tuple(len(mesh) - 1 - m for m in split))
            for split in dims
        )
        return Layout(tuple(mesh), tensor_map, rank_list=self.stage_ranks())  # a refined mesh has as many ranks

    def _refusal(self, field: str, value: Any, why: str, *, fix: str = _RESHARD_FIX) -> LayoutError:
        ranks = self.stage_ranks()
        held = f"ranks {ranks[0]}-{ranks[-1]}" if ranks else "no rank"
        where = f" (pipeline stage {self.stage}, {held}" + (f", strategy file {self.source!r})" if self.source else ")")
        return _refuse(self.name, field, value, why, where=where, fix=fix)

    def _check_even_split(self) -> None:
        sizes = self.param_split_shape
        if sizes and len(set(sizes)) > 1:
            raise self._refusal("param_split_shape", list(sizes), "the dim-0 slices have different sizes")
        if sizes and self.indices_offset:
            expected = [i * sizes[0] for i in range(len(sizes))]
            if list(self.indices_offset) != expected:
                raise self._refusal("indices_offset", list(self.indices_offset),
                                    f"slices of {sizes[0]} rows should start at {expected}")

    def _add_optimizer_split(self, mesh: list[int], dims: list[list[int]]) -> tuple[list[int], list[list[int]]]:
        """Refine ``mesh`` and add the optimizer-parallel dims to tensor dim 0 (outermost first)."""
        if not dims:
            raise self._refusal("opt_weight_shard_size", self.opt_weight_shard_size, "a scalar has no dim 0")
        used = {m for split in dims for m in split}
        repeated = [m for m in range(len(mesh)) if m not in used and mesh[m] > 1]
        if not repeated:
            raise self._refusal("opt_weight_shard_size", self.opt_weight_shard_size,
                                f"no replica mesh dim is left in dev_matrix {list(mesh)}")
        size = self.opt_weight_shard_size
        wanted = math.prod(mesh[m] for m in repeated) if size == -1 else int(size)
        if wanted < 1:
            raise self._refusal("opt_weight_shard_size", size, "must be -1 or >= 1")
        if len(repeated) == 1 and math.prod(mesh[repeated[0] + 1:]) != self.opt_weight_shard_step:
            raise self._refusal("opt_weight_shard_step", self.opt_weight_shard_step,
                                f"the replica dim's rank stride is {math.prod(mesh[repeated[0] + 1:])}")
        if repeated == [0] and not self._mp_dims_in_mesh_order(dims):
            # MindSpore's transform then renumbers the mesh by tensor order: ambiguous.
            raise self._refusal(
                "tensor_map", self.tensor_map, "optimizer parallel with model-parallel dims out of mesh order: "
                "MindSpore's transform_checkpoints and load_distributed_checkpoint place these slices differently",
                fix="save the job's checkpoint with this parameter's optimizer parallel off "
                    "(Parameter.parallel_optimizer = False) or its tensor_map's mesh dims in mesh order")
        total = math.prod(mesh)
        if not used and all(d > 1 for d in mesh) and self.opt_weight_shard_step == 1 and total % wanted == 0 \
                and not self._replicas_cut_evenly(mesh, repeated, wanted):
            # A replicated tensor: MindSpore gives rank r the dim-0 piece r % size (transform_checkpoints'
            # layout for replicas over every mesh dim), which no cut of the mesh dims expresses.
            return [total // wanted, wanted], [[1]] + [[] for _ in dims[1:]]
        # position -> new index, after cutting dims; collect opt dims inner to outer.
        new_mesh = list(mesh)
        index_of = list(range(len(mesh)))
        opt_dims: list[int] = []
        remaining = wanted
        for m in reversed(repeated):
            if remaining == 1:
                break
            take = mesh[m]
            where = index_of[m]
            if remaining < take:
                if take % remaining:
                    raise self._refusal("opt_weight_shard_size", size,
                                        f"mesh dim of size {take} cannot be divided by the remaining {remaining}")
                new_mesh[where:where + 1] = [take // remaining, remaining]
                for later in range(m + 1, len(mesh)):
                    index_of[later] += 1
                opt_dims = [d + 1 for d in opt_dims]
                opt_dims.insert(0, where + 1)
                remaining = 1
                break
            if remaining % take:
                raise self._refusal("opt_weight_shard_size", size,
                                    f"{remaining} cannot be divided by the replica mesh dim of size {take}")
            opt_dims.insert(0, where)
            remaining //= take
        if remaining != 1:
            replicas = math.prod(mesh[m] for m in repeated)
            raise self._refusal("opt_weight_shard_size", size,
                                f"only {replicas} replicas exist in dev_matrix {list(mesh)}")
        new_dims = [[index_of[m] for m in split] for split in dims]
        new_dims[0] = new_dims[0] + opt_dims
        return new_mesh, new_dims

    @staticmethod
    def _replicas_cut_evenly(mesh: list[int], repeated: list[int], wanted: int) -> bool:
        """Whether ``wanted`` optimizer pieces fill the replica dims from the innermost outwards."""
        for m in reversed(repeated):
            if wanted == 1:
                return True
            if wanted < mesh[m]:
                return mesh[m] % wanted == 0
            if wanted % mesh[m]:
                return False
            wanted //= mesh[m]
        return wanted == 1

    @staticmethod
    def _mp_dims_in_mesh_order(dims: list[list[int]]) -> bool:
        order = [m for split in dims for m in split]
        return order == sorted(order)


def record_from_parameter_layout(entry: Sequence[Any], *, name: str, rank: int) -> MindSporeLayoutRecord:
    """Build a record from one ``Cell.parameter_layout_dict`` value.

    The value is MindSpore's list ``[dev_matrix, tensor_map, slice_shape,
    field_size, uniform_split, opt_shard_group, full_shape, ...]``. The
    optimizer-parallel group size is read from the shapes (``full_shape[0]`` /
    (model-parallel splits x ``slice_shape[0]``)); the pipeline stage from
    ``rank // prod(dev_matrix)``.

    Args:
        entry: The ``parameter_layout_dict`` value.
        name: Parameter name (for messages).
        rank: Global rank of the caller (chooses the pipeline stage).

    Raises:
        LayoutError: A malformed entry, an uneven split, or an optimizer-parallel
            split the shapes do not determine.
    """
    items = list(entry)
    if len(items) < 6:
        raise LayoutError(f"parameter {name!r}: parameter_layout_dict entry {items!r} has fewer than 6 fields")
    dev_matrix = tuple(int(d) for d in items[0])
    tensor_map = tuple(tuple(int(k) for k in e) if isinstance(e, (list, tuple)) else int(e) for e in items[1])
    slice_shape = tuple(int(s) for s in items[2])
    field, uniform_split, opt_group = int(items[3] or 0), items[4], items[5]
    full_shape = tuple(int(s) for s in items[6]) if len(items) > 6 and items[6] else ()
    if not uniform_split:
        raise _refuse(name, "uniform_split", uniform_split, "the slices have different sizes")
    step = size = 0
    if opt_group:
        if not full_shape or not slice_shape:
            raise _refuse(name, "opt_shard_group", opt_group, "the entry lacks the full and slice shapes")
        mp_splits = math.prod(dev_matrix[len(dev_matrix) - 1 - m] for m in _entry_right_dims(tensor_map[0]))
        size, rest = divmod(full_shape[0], mp_splits * slice_shape[0])
        if rest or size < 1:
            raise _refuse(name, "opt_shard_group", opt_group,
                          f"full shape {full_shape} and slice shape {slice_shape} do not give a whole group size")
        if size > 1:
            used = {m for e in tensor_map for m in _entry_dims(e, len(dev_matrix))}
            repeated = [m for m in range(len(dev_matrix)) if m not in used and dev_matrix[m] > 1]
            # The entry names a group, not a stride: use the stride the group implies.
            step = math.prod(dev_matrix[repeated[0] + 1:]) if len(repeated) == 1 else 1
        else:
            size = 0
    stage = rank // max(1, math.prod(dev_matrix))
    return MindSporeLayoutRecord(name, dev_matrix, tensor_map, field=field, opt_weight_shard_step=step,
                                 opt_weight_shard_size=size, stage=stage)


def _entry_right_dims(entry: TensorMapEntry) -> list[int]:
    parts = entry if isinstance(entry, tuple) else (entry,)
    return [int(k) for k in parts if int(k) != -1]
