"""Parameters that MindSpore sliced itself: give them their layout, never save a slice as whole.

Under semi-auto / auto parallel each rank's ``mindspore.Parameter`` holds only
its slice (``Parameter.sliced`` is set) and the layout lives in the strategy
file or in ``Cell.parameter_layout_dict``. :func:`apply_mindspore_layouts`
runs on every rank inside the first collective step of a save or load: it
turns every Parameter with a known layout (by its MindSpore name; optimizer
states such as ``moment1.<param>`` follow ``<param>``) into a
:class:`~hyper_parallel.core.dtensor.DTensor` over that very Parameter, and
refuses a sliced Parameter whose layout is unknown, and an unmarked one its layout
splits (whole or a slice, nothing tells), naming the key and the fix.
The state dict is not changed; a new one is returned (Cells holding wrapped
Parameters become dicts of the same names).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Mapping, Union

from hyper_parallel.core.distributed_checkpoint._flatten import cell_parameters, flatten_state_dict, set_by_path
from hyper_parallel.core.distributed_checkpoint.errors import LayoutError, SlicedParameterError
from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.core.layout import Layout
from hyper_parallel.core.strategy_file import (
    OPTIMIZER_STATE_PREFIXES,
    StrategySource,
    layout_for_state_key,
    layouts_from_strategy,
    name_prefix_difference,
)
from hyper_parallel.platform.tensor import (
    all_parameters,
    all_plain_leaves,
    is_cell,
    is_parameter,
    parameter_and_cell_types,
)

__all__ = [
    "LayoutSources",
    "LayoutArgument",
    "apply_mindspore_layouts",
    "cells_in",
    "copy_back_values",
]

_SHOWN = 10
_SLICED = attrgetter("sliced")


@dataclass(frozen=True)
class LayoutSources:
    """Where the layouts of MindSpore-sliced Parameters come from, resolved on every rank.

    Attributes:
        strategy_file: A strategy file, a list of per-stage files, a directory,
            or a ready ``{parameter name: Layout}`` mapping; ``None`` for none.
        cells: Cells whose ``parameter_layout_dict`` is consulted (for callers
            that flattened the Cells away before saving, as the one-liners do).
    """

    strategy_file: Any = None
    cells: tuple[Any, ...] = ()


#: What ``strategy_file=`` of ``save`` / ``load`` accepts.
LayoutArgument = Union[StrategySource, Mapping[str, Any], LayoutSources, None]


def cells_in(obj: Any) -> tuple[Any, ...]:
    """Return every ``mindspore.nn.Cell`` in ``obj`` (nested dicts, lists, tuples), outermost first."""
    if isinstance(obj, dict) and all_plain_leaves(list(obj.values())):
        return ()  # a dict of Parameters or arrays (the usual state): told at once
    found: list[Any] = []
    stack = [obj]
    parameter_type, cell_type = parameter_and_cell_types()
    while stack:
        value = stack.pop()
        if isinstance(value, parameter_type):  # most values: a leaf (a Parameter is no Cell)
            continue
        if isinstance(value, cell_type):
            found.append(value)
        elif isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
    return tuple(found)


def _cell_layouts(cell: Any, rank: int) -> dict[str, Layout]:
    entries = getattr(cell, "parameter_layout_dict", None) or {}
    return {name: Layout.from_mindspore_layout(entry, name=name, rank=rank) for name, entry in entries.items()}


def _layouts_by_source(source: LayoutArgument, state_dict: Any, *, rank: int
                       ) -> tuple[dict[str, Layout], dict[str, Layout]]:
    """``{MindSpore parameter name: Layout}`` for ``rank`` from the Cells' ``parameter_layout_dict`` (those in
    ``state_dict`` and in ``source.cells``) and from ``strategy_file=`` (which overrides them), apart. Any rank;
    reads files, no communication."""
    sources = source if isinstance(source, LayoutSources) else LayoutSources(strategy_file=source)
    cell_layouts: dict[str, Layout] = {}
    for cell in sources.cells + cells_in(state_dict):
        cell_layouts.update(_cell_layouts(cell, rank))
    given = sources.strategy_file
    if isinstance(given, Mapping):
        return cell_layouts, {name: Layout.from_any(layout) for name, layout in given.items()}
    return cell_layouts, ({} if given is None else layouts_from_strategy(given, rank=rank))


def _placement(layout: Layout, shape: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], ...] | None:
    """Where ``layout`` puts this rank's slice of local ``shape``: (global shape, offset); ``None`` if nowhere."""
    splits = layout.splits_per_dim()
    if len(splits) != len(shape):
        return None
    global_shape = tuple(n * s for n, s in zip(shape, splits))
    try:
        return global_shape, layout.shard_offsets(global_shape, rank)
    except LayoutError:
        return None


def _cell_slice_shapes(cells: tuple[Any, ...]) -> dict[str, tuple[int, ...]]:
    """``{parameter name: slice shape}`` from the Cells' ``parameter_layout_dict`` (its third field)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for cell in cells:
        for name, entry in (getattr(cell, "parameter_layout_dict", None) or {}).items():
            items = list(entry)
            if len(items) > 2 and isinstance(items[2], (list, tuple)) and items[2]:
                shapes[name] = tuple(int(s) for s in items[2])
    return shapes


class _Wrapper:
    """Wraps Parameters once each (a Parameter reached twice gets the same DTensor)."""

    def __init__(self, layouts: Mapping[str, Layout], rank: int,
                 slice_shapes: Mapping[str, tuple[int, ...]] | None = None, origin: str = "",
                 cell_layouts: Mapping[str, Layout] | None = None) -> None:
        self.layouts = layouts
        #: The Cells' own layouts, when ``strategy_file=`` overrides some: each is compared with the one used.
        self.cell_layouts = cell_layouts or {}
        self.rank = rank
        self.slice_shapes = slice_shapes or {}
        self.origin = origin  # where the layouts came from, as refusals name it
        self.sliced_shapes: dict[str, tuple[int, ...]] = {}  # name -> shape of every Parameter marked sliced
        #: Unmarked Parameters a layout splits: (path, Parameter, global shape); see :meth:`unmarked_problems`.
        self.unmarked: list[tuple[str, Any, tuple[int, ...]]] = []
        self.done: dict[int, Any] = {}
        self.unknown: list[str] = []
        self.unknown_names: list[str] = []  # the Parameter names of ``unknown``
        self.bad: list[str] = []

    def leaf(self, path: str, value: Any) -> Any:
        if not is_parameter(value):
            return value
        if id(value) in self.done:
            return self.done[id(value)]
        layout = layout_for_state_key(self.layouts, value.name)
        if layout is None and path != value.name:
            layout = layout_for_state_key(self.layouts, path)
        wrapped = value
        expected = self.slice_shapes.get(value.name)
        if layout is not None and expected is not None and tuple(value.shape) != expected:
            self.bad.append(
                f"key '{path}' (Parameter '{value.name}') holds shape {tuple(value.shape)} but MindSpore's "
                f"parameter_layout_dict gives this rank the slice shape {expected}: it is not the slice its layout "
                "describes (saving it would place the wrong bytes in the global tensor); save the Parameters of "
                "the compiled parallel network, or drop its parameter_layout_dict entry if it is whole"
            )
        elif layout is not None:
            if not self._disagrees(path, value, layout):  # a disagreement is noted in self.bad
                try:
                    wrapped = DTensor(value, layout, rank=self.rank)
                except LayoutError as exc:
                    self.bad.append(f"key '{path}' (Parameter '{value.name}', local shape {tuple(value.shape)}): "
                                    f"{exc}")
                else:
                    if value.sliced:
                        self.sliced_shapes[value.name] = tuple(value.shape)
                    elif expected is None and wrapped.shape != tuple(value.shape):
                        self.unmarked.append((path, value, wrapped.shape))
        elif getattr(value, "sliced", False):
            self.unknown.append(f"'{path}' (Parameter '{value.name}')")
            self.unknown_names.append(value.name)
        self.done[id(value)] = wrapped
        return wrapped

    def _disagrees(self, path: str, value: Any, layout: Layout) -> bool:
        """Whether ``strategy_file=`` places this rank's slice elsewhere than the Cell's ``parameter_layout_dict``
        (a file of another job or compile: the slices would be saved or loaded at the wrong offsets); noted."""
        if not self.cell_layouts:
            return False
        own = layout_for_state_key(self.cell_layouts, value.name)
        if own is None or own == layout:
            return False
        shape = tuple(value.shape)
        given, compiled = _placement(layout, shape, self.rank), _placement(own, shape, self.rank)
        if given == compiled:
            return False
        self.bad.append(
            f"key '{path}' (Parameter '{value.name}', shape {shape}): {self.origin} places this rank's slice at "
            f"{_where(given)}, its Cell's parameter_layout_dict at {_where(compiled)}: the strategy file is not "
            "the one of the compile that sliced this network (saving or loading under it would put the slices at "
            "the wrong places); pass the strategy file this job wrote, or leave strategy_file= out to use the "
            "Cell's own layouts"
        )
        return True

    def unmarked_problems(self) -> list[str]:
        """The unmarked Parameters a layout splits that are not told to be slices, after the walk.

        One is a slice when it is an optimizer state (``moment1.w``) of a Parameter marked sliced whose shape it
        has: it was made from that slice. Any other may hold the whole tensor (MindSpore's parallel compile marks
        every Parameter it slices), so saving it under the layout would store a wrong global shape.
        """
        return [self._whole_under_split(path, value, global_shape) for path, value, global_shape in self.unmarked
                if self.sliced_shapes.get(_owner_name(value.name), ()) != tuple(value.shape)]

    def _whole_under_split(self, path: str, value: Any, global_shape: tuple[int, ...]) -> str:
        """A Parameter not marked sliced that its layout splits: whole or a slice, nothing tells (refused)."""
        return (
            f"key '{path}' (Parameter '{value.name}', shape {tuple(value.shape)}) is not marked sliced "
            f"(Parameter.sliced is False) but the layout of {self.origin} splits it, which would make it a slice of "
            f"global shape {global_shape}: MindSpore's parallel compile marks every Parameter it slices, so this "
            "one may hold the whole tensor, and saving it under that layout would store a wrong global shape. If "
            "it holds this rank's slice, set Parameter.sliced = True (Parameter.set_data(data) clears the mark: "
            "pass slice_shape=True to keep it); if it is whole, compile the parallel network first (MindSpore "
            "slices it) or save it without strategy_file="
        )

    def walk(self, path: str, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self.walk(f"{path}.{k}" if path else str(k), v) for k, v in value.items()}
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            items = [self.walk(f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        if is_cell(value):
            params = cell_parameters(value, f"the Cell at '{path}'" if path else "the Cell")
            wrapped = {name: self.leaf(f"{path}.{name}" if path else name, p) for name, p in params.items()}
            if all(wrapped[name] is params[name] for name in params):
                return value  # nothing sliced: the Cell stays a Cell
            return wrapped
        return self.leaf(path, value)


def apply_mindspore_layouts(state_dict: dict[str, Any], *, source: LayoutArgument, rank: int) -> dict[str, Any]:
    """Return ``state_dict`` with every Parameter of known layout wrapped in a DTensor. All ranks.

    Called inside the first collective step of ``save`` / ``load`` (so a
    failure is raised on every rank).

    Args:
        state_dict: The caller's state dict (not modified).
        source: ``strategy_file=`` as given to ``save`` / ``load``.
        rank: This process's global rank (picks the pipeline stage).

    Raises:
        SlicedParameterError: Parameters marked ``sliced`` with no known layout
            (all listed), or whose local shape does not fit their layout or
            differs from the slice shape of their ``parameter_layout_dict``
            entry (a whole tensor under a splitting layout); Parameters not
            marked ``sliced`` that a layout splits, unless they are optimizer
            states of a marked Parameter of their shape (nothing tells them
            from whole tensors, which would be saved with a wrong global shape).
        StrategyFileError / LayoutError: As :func:`hyper_parallel.layouts_from_strategy`.
    """
    cell_layouts, given = _layouts_by_source(source, state_dict, rank=rank)
    layouts = {**cell_layouts, **given}
    if not layouts and not _any_sliced(_parameters(state_dict)):
        return state_dict
    cells = (source.cells if isinstance(source, LayoutSources) else ()) + cells_in(state_dict)
    wrapper = _Wrapper(layouts, rank, _cell_slice_shapes(cells), _origin(source),
                       cell_layouts=cell_layouts if given else None)
    result = wrapper.walk("", state_dict)
    if wrapper.unknown:
        shown = ", ".join(wrapper.unknown[:_SHOWN])
        more = f" and {len(wrapper.unknown) - _SHOWN} more" if len(wrapper.unknown) > _SHOWN else ""
        prefixed = _prefix_refusal(sorted(set(wrapper.unknown_names)), given, _origin(source))
        if prefixed:
            raise SlicedParameterError(f"rank {rank}: key(s) {shown}{more} {prefixed}")
        raise SlicedParameterError(
            f"rank {rank}: key(s) {shown}{more} hold a slice (Parameter.sliced is True) but no layout is known, "
            "so saving them as whole tensors would lose the other ranks' parts; pass strategy_file= (the file "
            "MindSpore wrote through strategy_ckpt_config={'save_file': ...}), or save the Cell whose "
            "parameter_layout_dict holds them, or wrap them in hyper_parallel.DTensor"
        )
    bad = wrapper.bad + wrapper.unmarked_problems()
    if bad:
        raise SlicedParameterError(f"rank {rank}: " + "; ".join(bad[:_SHOWN]))
    return result


def copy_back_values(loaded: dict[str, Any], state_dict: dict[str, Any]) -> None:
    """Put the non-tensor values a load replaced in ``loaded`` (a wrapped copy) into ``state_dict``.

    The copy has the same paths as ``state_dict`` (Cells became dicts of the
    same names), so every replaced plain value goes back to its place.
    """
    before = flatten_state_dict(state_dict).values
    after = flatten_state_dict(loaded)
    for name, value in after.values.items():
        if name in before and before[name] is not value and not isinstance(value, DTensor):
            set_by_path(state_dict, after.paths[name], value)


def _where(placement: tuple[tuple[int, ...], ...] | None) -> str:
    if placement is None:
        return "no place (it does not fit that layout, or this rank holds no slice of it)"
    return f"offset {placement[1]} of global shape {placement[0]}"


def _owner_name(name: str) -> str:
    """The Parameter an optimizer state ``name`` belongs to (``moment1.w`` -> ``w``); else ``name``."""
    for prefix in OPTIMIZER_STATE_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _prefix_refusal(names: list[str], given: Mapping[str, Layout], origin: str) -> str:
    """Why the sliced Parameters ``names`` found no layout in the strategy's ``given`` ones when all their names
    differ from the strategy's by one prefix (``network.``); empty otherwise."""
    found = name_prefix_difference(names, set(given))
    if found is None:
        return ""
    prefix, ours = found
    theirs = names[0][len(prefix):] if ours else prefix + names[0]
    return (
        f"hold a slice (Parameter.sliced is True) but {origin} has no layout under their names: its names differ "
        f"from theirs by the prefix '{prefix}' (the Parameter '{names[0]}', the strategy '{theirs}'), so saving "
        "them as whole tensors would lose the other ranks' parts. Pass the strategy file of the compile that "
        "sliced this network (MindSpore names a Parameter the same however a Cell wraps it), or leave "
        "strategy_file= out and pass the Cell (its parameter_layout_dict holds the layouts)"
    )


def _origin(source: LayoutArgument) -> str:
    """Where ``strategy_file=`` took the layouts from, as a refusal names it."""
    given = source.strategy_file if isinstance(source, LayoutSources) else source
    if given is None:
        return "its Cell's parameter_layout_dict"
    if isinstance(given, Mapping):
        return "the mapping given as strategy_file="
    if isinstance(given, (list, tuple)):
        return f"strategy files {[os.fspath(p) for p in given]!r}"
    return f"strategy file {os.fspath(given)!r}"


def _any_sliced(params: list[Any]) -> bool:
    """Whether any of ``params`` is marked ``sliced`` (read by a C getter: one per Parameter of a state of
    thousands; an object without the attribute counts as not sliced)."""
    try:
        return any(map(_SLICED, params))
    except AttributeError:
        return any(getattr(p, "sliced", False) for p in params)


def _parameters(obj: Any) -> list[Any]:
    """Every Parameter in ``obj`` (nested dicts, lists, tuples, Cells)."""
    if isinstance(obj, dict):
        values = list(obj.values())
        if all_parameters(values):
            return values  # a dict of Parameters (the usual state): told at once
        if all_plain_leaves(values):  # of Parameters and arrays (or arrays alone): no walk
            return [value for value in values if is_parameter(value)]
    found: list[Any] = []
    stack = [obj]
    parameter_type, cell_type = parameter_and_cell_types()
    while stack:
        value = stack.pop()
        if isinstance(value, parameter_type):  # most leaves (a Parameter is no Cell)
            found.append(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, cell_type):
            found.extend(value.get_parameters())
    return found
