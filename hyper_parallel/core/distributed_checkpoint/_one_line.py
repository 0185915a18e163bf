"""``save_checkpoint`` / ``load_checkpoint``: the one-line forms, with MindSpore's conventions.

Names are MindSpore's: a Cell stands for its Parameters under their own
names (``param.name``, as ``mindspore.save_checkpoint(net)`` stores them),
also when it is a top-level value of a dict (``{"model": net, "optimizer":
opt}``), and a Parameter reached twice (a network's weight is also in its
optimizer) is stored once. ``load_checkpoint`` returns what
``mindspore.load_checkpoint`` returns, ``{name: mindspore.Parameter}`` plus
the other values (numbers as 0-d Parameters, strings as ``str``, as MindSpore
returns them), with ``strict_load`` / ``filter_prefix`` /
``specify_prefix`` / ``choice_func`` as MindSpore defines them; with a
``net`` it loads in place (resharding like :func:`load`) and reports what was
not loaded as ``mindspore.load_param_into_net`` does.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np

from hyper_parallel.core.distributed_checkpoint import api
from hyper_parallel.core.distributed_checkpoint._load_engine import LoadOptions
from hyper_parallel.core.distributed_checkpoint._flatten import cell_parameters, flatten_state_dict, set_by_path
from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import LayoutSources, cells_in
from hyper_parallel.core.distributed_checkpoint._ms_name_match import (
    check_dtypes,
    every,
    match_names,
    selector,
    shown,
    stored_names,
)
from hyper_parallel.core.distributed_checkpoint._ms_keywords import (
    LOAD_INSTEAD,
    LOAD_POSITIONS,
    SAVE_INSTEAD,
    SAVE_POSITIONS,
    check_checkpoint_id,
    check_keywords,
    check_positional,
    warn_file_name,
)
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointValueError,
    MissingKeyError,
    UnsafeCheckpointError,
)
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, TensorStorageMetadata
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlanner
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardLoadPlanner, StandardSavePlanner
from hyper_parallel.platform.tensor import from_numpy, is_cell, is_parameter, is_tensor, parameter_and_cell_types
from hyper_parallel.platform.dtypes import ms_dtype

__all__ = ["save_checkpoint", "load_checkpoint", "LoadedParameters", "mindspore_state_dict"]

_LOG = logging.getLogger(__name__)


class LoadedParameters(dict):
    """What :func:`load_checkpoint` returns: ``{name: mindspore.Parameter}`` plus non-tensor values.

    A plain ``dict`` (``mindspore.load_param_into_net`` accepts it) that also
    says what was not loaded, as ``load_param_into_net`` returns it.

    Attributes:
        param_not_load: Names of ``net`` entries that received nothing (not in
            the checkpoint, or left out by ``filter_prefix`` / ``specify_prefix``
            / ``choice_func``). Empty without a ``net``.
        ckpt_not_load: Checkpoint keys that were not loaded (not in ``net``, or
            left out by the selection).
    """

    def __init__(self, values: dict[str, Any], param_not_load: list[str], ckpt_not_load: list[str]) -> None:
        super().__init__(values)
        self.param_not_load = param_not_load
        self.ckpt_not_load = ckpt_not_load


def mindspore_state_dict(obj: Any, what: str = "save_obj") -> dict[str, Any]:
    """Return ``obj`` as a state dict under MindSpore's names. Any rank; no communication.

    A Cell gives ``{param.name: Parameter}``; in a dict, every top-level Cell
    is replaced by its Parameters the same way and other entries keep their
    key. A Parameter reached twice (same object) appears once.

    Raises:
        CheckpointValueError: ``obj`` is neither a Cell nor a dict, or two
            different objects end up under one name.
    """
    if is_cell(obj):
        return cell_parameters(obj, what)  # one Cell: its Parameters by name (each name once, refused otherwise)
    if not isinstance(obj, dict):
        listed = isinstance(obj, list) and obj and all(isinstance(item, dict) and "name" in item for item in obj)
        model = is_cell(getattr(obj, "train_network", None))  # a mindspore.train.Model
        raise CheckpointValueError(
            f"{what} must be a mindspore.nn.Cell or a state dict, got {type(obj).__name__}"
            + ("; for mindspore.save_checkpoint's list of {'name': ..., 'data': ...} dicts pass "
               f"{{item['name']: item['data'] for item in {what}}} (a dict of the same entries)" if listed else "")
            + ("; for a mindspore.train.Model pass model.train_network (its network and optimizer, each "
               "Parameter once), or the network alone" if model else "")
        )
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in obj.items():
        entries = (cell_parameters(value, what if key == "" else f"{what}[{key!r}]").items() if is_cell(value)
                   else [(key, value)])
        for name, item in entries:
            if name in out:
                if out[name] is item:
                    continue
                raise CheckpointValueError(
                    f"{what}: '{name}' is both a Parameter of {origin[name]!r} and of {key!r} (different objects); "
                    "rename one Parameter or save them separately"
                )
            out[name] = item
            origin[name] = key
    return out


def save_checkpoint(save_obj: Any, checkpoint_id: Any, *mindspore_positional: Any,
                    append_dict: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """Save a Cell's parameters or a state dict under MindSpore's names. All ranks call it.

    ``save_checkpoint(net, path)`` stores the keys ``mindspore.save_checkpoint(net)``
    stores; ``save_checkpoint({"model": net, "optimizer": opt}, path)`` stores
    each Parameter once, the keys ``mindspore.save_checkpoint`` gives the
    ``TrainOneStepCell`` holding both.

    Args:
        save_obj: A ``mindspore.nn.Cell`` or a state dict (top-level Cells stand
            for their Parameters under their own names).
        checkpoint_id: The checkpoint directory.
        *mindspore_positional: None taken: the arguments of
            ``mindspore.save_checkpoint`` after its first two are refused, each
            named, saying what to do instead (``append_dict`` by keyword).
        append_dict: Extra plain values to store beside the Parameters (as
            MindSpore's ``append_dict``).
        **kwargs: ``allow_pickle`` and any argument of ``dcp.save``
            (``strategy_file=`` gives the layouts of Parameters MindSpore
            sliced; the Cells' own ``parameter_layout_dict`` is used too).

    Returns:
        The committed metadata.

    Raises:
        CheckpointValueError: ``save_obj`` is not a Cell or dict, an
            ``append_dict`` key clashes with a Parameter name, or
            ``checkpoint_id`` is None (without ``storage_writer``) or a Cell.
        TypeError: A keyword it does not take or a third positional argument
            (one of ``mindspore.save_checkpoint``'s says what to do instead).
    """
    check_positional("save_checkpoint", ("save_obj", "checkpoint_id"), mindspore_positional, SAVE_POSITIONS,
                     _SAVE_KEYWORDS, SAVE_INSTEAD)
    if kwargs:
        check_keywords("save_checkpoint", kwargs, _SAVE_KEYWORDS, SAVE_INSTEAD)
    check_checkpoint_id("save_checkpoint", checkpoint_id, kwargs.get("storage_writer"), "storage_writer")
    warn_file_name(checkpoint_id)
    state = mindspore_state_dict(save_obj)
    for key, value in (append_dict or {}).items():
        if key in state:
            raise CheckpointValueError(f"append_dict key '{key}' is also a Parameter name; rename it")
        state[key] = value
    allow_pickle = kwargs.pop("allow_pickle", False)
    if "planner" not in kwargs:
        kwargs["planner"] = StandardSavePlanner(allow_pickle=allow_pickle,
                                                check_replicas=kwargs.get("check_replicas", True))
    # The Cells are flattened away here: hand their parameter_layout_dict on.
    kwargs["strategy_file"] = LayoutSources(kwargs.get("strategy_file"), cells=cells_in(save_obj))
    return api.save(state, checkpoint_id=checkpoint_id, **kwargs)


#: Every keyword save_checkpoint / load_checkpoint takes: their own and those they hand to dcp.save / dcp.load.
_SAVE_KEYWORDS = ("append_dict", "allow_pickle", "check_replicas", "no_dist", "planner", "remove_redundancy",
                  "save_to_minimum_rank", "storage_writer", "strategy_file", "use_collectives")
_LOAD_KEYWORDS = ("net", "strict_load", "filter_prefix", "specify_prefix", "choice_func", "allow_partial_load",
                  "allow_pickle", "no_dist", "planner", "storage_reader", "strategy_file", "use_collectives")


def _as_parameter(name: str, value: Any) -> Any:
    import mindspore as ms  # pylint: disable=import-outside-toplevel

    if is_parameter(value):
        return value
    if hasattr(value, "to_local") and hasattr(value, "layout"):  # a DTensor: this rank's shard
        value = value.to_local()
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < 1 << 64:
        return value  # no MindSpore integer dtype holds it (a 128-bit seed): the int itself
    if isinstance(value, (bool, int, float, np.generic)):
        value = np.asarray(value)  # a number comes back as a 0-d Parameter, as mindspore.load_checkpoint returns it
    if isinstance(value, np.ndarray):
        value = from_numpy(value)
    if is_tensor(value):
        return ms.Parameter(value, name=name)  # requires_grad True, as mindspore.load_checkpoint gives it
    return value


def _whole_targets(metadata: Metadata, keys: list[str]) -> dict[str, Any]:
    """The targets of ``load_checkpoint(path)``: a zeroed Parameter per stored tensor (the load fills its memory in
    place, so no copy of the loaded values is made after), ``None`` for a whole stored value."""
    target: dict[str, Any] = {}
    for fqn in keys:
        item = metadata.state_dict_metadata[fqn]
        if isinstance(item, TensorStorageMetadata):
            try:
                target[fqn] = _zeroed_parameter(fqn, tuple(item.size), item.properties.dtype)
            except (MemoryError, ValueError) as exc:  # sizes come from the checkpoint
                raise UnsafeCheckpointError(
                    f"key '{fqn}': the checkpoint declares shape {list(item.size)}, too large to allocate; "
                    "load into an existing state dict instead"
                ) from exc
        elif not item.global_shape:  # per-rank ShardedObjects have no single value
            target[fqn] = None
    return target


def _zeroed_parameter(fqn: str, shape: tuple[int, ...], dtype: str) -> Any:
    """A ``mindspore.Parameter`` named ``fqn`` of zeros in memory of its own: numpy's lazily zeroed pages, which
    MindSpore wraps without a copy when it makes the Parameter of an ``init=Zero()`` tensor. (A Parameter made of
    a filled array copies it: a second copy of the state.) In an auto-parallel mode MindSpore defers the memory;
    the load then fills a copy and assigns it."""
    import mindspore as ms  # pylint: disable=import-outside-toplevel
    from mindspore.common.initializer import Zero  # pylint: disable=import-outside-toplevel

    return ms.Parameter(ms.Tensor(shape=shape, dtype=ms_dtype(dtype), init=Zero()), name=fqn)


def load_checkpoint(
    checkpoint_id: Any,
    net: Any = None,
    *mindspore_positional: Any,
    strict_load: bool = False,
    filter_prefix: str | Sequence[str] | None = None,
    specify_prefix: str | Sequence[str] | None = None,
    choice_func: Callable[[str], bool] | None = None,
    allow_partial_load: bool = False,
    allow_pickle: bool = False,
    **kwargs: Any,
) -> LoadedParameters:
    """Load a checkpoint the way ``mindspore.load_checkpoint`` does. All ranks call it.

    Args:
        checkpoint_id: The checkpoint directory.
        net: A Cell or state dict to load into in place (resharded to its
            layout); ``None`` to get the whole checkpoint back.
        *mindspore_positional: None taken: the arguments of
            ``mindspore.load_checkpoint`` after its first two are refused, each
            named, saying what to do instead (``strict_load``... by keyword).
        strict_load: Match names exactly and refuse dtype casts. Otherwise a
            ``net`` name missing from the checkpoint is also looked up with the
            one prefix the checkpoint adds (``model.`` of a ``{"model": net}``
            save; never a key another entry has by its own name), and stored
            values are cast to the target's dtype among float dtypes or among
            signed int dtypes (other casts are refused, as MindSpore's
            ``load_param_into_net`` refuses them).
        filter_prefix: Checkpoint keys starting with it (a str or list) are not loaded.
        specify_prefix: Only checkpoint keys starting with it are loaded.
        choice_func: ``name -> bool``: load the keys it accepts. Ignored when
            ``filter_prefix`` or ``specify_prefix`` is given (as in MindSpore).
        allow_partial_load: With ``net``: load what matches and only warn
            about ``net`` entries the checkpoint lacks (listed in
            ``param_not_load``), instead of raising.
        allow_pickle: Unpickle stored pickled values (trusted checkpoints only).
        **kwargs: Any argument of ``dcp.load`` (``storage_reader``, ``planner``,
            ``strategy_file`` for Parameters MindSpore sliced, ...).

    Returns:
        ``{name: mindspore.Parameter}`` plus the other values, as
        ``mindspore.load_checkpoint`` returns them (an int / float / bool as a
        0-d Parameter, a str as ``str``, other values as they are): with
        ``net`` its own loaded Parameters (each rank its shards; plain values
        of a dict ``net`` are also put back into it), otherwise full values
        under the checkpoint's keys. ``.param_not_load`` / ``.ckpt_not_load``
        list what was not loaded (both are also logged).

    Raises:
        CheckpointValueError: Nothing left to load after the selection, no
            ``net`` entry matches any checkpoint key (both lists shown), or
            ``checkpoint_id`` is None (without ``storage_reader``) or a Cell.
        TypeError: A keyword it does not take or a third positional argument
            (one of ``mindspore.load_checkpoint``'s says what to do instead).
        MissingKeyError: Some ``net`` entries are not in the checkpoint (unless
            ``allow_partial_load``).
        CheckpointError: As :func:`load`.
    """
    check_positional("load_checkpoint", ("checkpoint_id", "net"), mindspore_positional, LOAD_POSITIONS,
                     _LOAD_KEYWORDS, LOAD_INSTEAD)
    if kwargs:
        check_keywords("load_checkpoint", kwargs, _LOAD_KEYWORDS, LOAD_INSTEAD)
    check_checkpoint_id("load_checkpoint", checkpoint_id, kwargs.get("storage_reader"), "storage_reader")
    select = selector(filter_prefix, specify_prefix, choice_func)
    planner = kwargs.pop("planner", None) or StandardLoadPlanner(allow_pickle=allow_pickle)
    reader = kwargs.pop("storage_reader", None)
    options = LoadOptions(no_dist=kwargs.pop("no_dist", False), use_collectives=kwargs.pop("use_collectives", True),
                          strategy_file=kwargs.pop("strategy_file", None))
    # All ranks read the metadata once (an async save of this process committed first); the checks below and the
    # load use that one save, so a save landing meanwhile is neither checked nor loaded.
    opened = api.open_checkpoint(checkpoint_id, reader, options)
    metadata = opened.metadata
    if net is None:
        keys = [key for key in metadata.state_dict_metadata if select(key)]
        if not keys:
            raise CheckpointValueError(
                f"checkpoint {checkpoint_id}: no key is left after filter_prefix / specify_prefix / choice_func "
                f"(keys: {shown(sorted(metadata.state_dict_metadata))}); check the prefixes"
            )
        target = _whole_targets(metadata, keys)
        api.load_opened(target, opened, planner=planner)
        skipped = sorted(set(metadata.state_dict_metadata) - set(target))
        return LoadedParameters({k: _as_parameter(k, v) for k, v in target.items()}, [], skipped)
    return _load_into(checkpoint_id, net, opened, select, strict_load, allow_partial_load, planner)


def _load_into(
    checkpoint_id: Any,
    net: Any,
    opened: api.OpenedCheckpoint,
    select: Callable[[str], bool],
    strict_load: bool,
    allow_partial_load: bool,
    planner: LoadPlanner,
) -> LoadedParameters:
    metadata = opened.metadata
    state = mindspore_state_dict(net, "net")
    flat = flatten_state_dict(state)
    stored = stored_names(metadata)
    wanted = list(map(flat.storage_keys.__getitem__, flat.values))
    by_key = dict(zip(wanted, flat.values))
    matched = match_names(wanted, stored, strict_load, select)
    if not matched:
        raise CheckpointValueError(
            f"checkpoint {checkpoint_id}: no entry of net matches a checkpoint key, nothing would load. "
            f"net has {shown(sorted(wanted))}; the checkpoint has {shown(sorted(metadata.state_dict_metadata))}. "
            "Load the checkpoint of this network, or map the names (strict_load=False strips one common prefix)"
        )
    chosen = dict(matched) if select is every else {key: ck for key, ck in matched.items() if select(ck)}
    if not chosen:
        raise CheckpointValueError(
            f"checkpoint {checkpoint_id}: filter_prefix / specify_prefix / choice_func left out every matching key "
            f"({shown(sorted(matched.values()))}); check the prefixes"
        )
    absent = [key for key in wanted if key not in matched]
    if absent and not allow_partial_load:
        raise MissingKeyError(
            f"checkpoint {checkpoint_id}: net entries {shown(absent)} are not in the checkpoint "
            f"({len(matched)} of {len(wanted)} matched, e.g. {shown(sorted(matched)[:3])}); pass "
            "allow_partial_load=True to load the matching ones, or filter_prefix to leave some out"
        )
    check_dtypes({by_key[k]: ck for k, ck in chosen.items()}, flat.values, metadata, stored, strict_load=strict_load)
    targets = {ck: flat.values[by_key[key]] for key, ck in chosen.items()}
    layouts = LayoutSources(opened.options.strategy_file, cells=cells_in(net))
    api.load_opened(targets, replace(opened, options=replace(opened.options, strategy_file=layouts)), planner=planner)
    loaded: dict[str, Any] = {}
    parameter_type = parameter_and_cell_types()[0]
    for key, ck in chosen.items():
        name = by_key[key]
        value = targets[ck]
        if isinstance(value, parameter_type):
            loaded[key] = value  # (most entries: a Parameter, loaded in place; _as_parameter returns it)
            continue
        if not (is_tensor(value) or isinstance(value, np.ndarray) or hasattr(value, "to_local")):
            set_by_path(state, flat.paths[name], value)  # a plain value: replaced, not filled in
            if isinstance(net, dict) and flat.paths[name][0] in net:
                net[flat.paths[name][0]] = state[flat.paths[name][0]]
        loaded[key] = _as_parameter(key, value)
    param_not_load = [key for key in wanted if key not in chosen]
    aliases = metadata.planner_data.get("aliases", {}) if isinstance(metadata.planner_data, dict) else {}
    used = {aliases.get(ck, ck) for ck in chosen.values()}
    ckpt_not_load = sorted(k for k in metadata.state_dict_metadata if k not in used)
    if param_not_load:
        _LOG.warning("load_checkpoint: %d entries of net are not loaded: %s", len(param_not_load),
                     shown(param_not_load))
    if ckpt_not_load:
        _LOG.info("load_checkpoint: %d checkpoint keys are not loaded: %s", len(ckpt_not_load), shown(ckpt_not_load))
    return LoadedParameters(loaded, param_not_load, ckpt_not_load)
