"""Layouts of MindSpore-sliced parameters, read from MindSpore's strategy files.

A semi-auto / auto parallel MindSpore job writes its parameter layouts with
``set_auto_parallel_context(strategy_ckpt_config={"save_file": ...})``: a
protobuf ``ParallelStrategyMap`` (``mindspore.train.node_strategy_pb2``), or
JSON when the name ends with ``.json``. With pipeline parallel each stage
writes its own file (its stage number is in ``parallel_strategy_item``); a file
merged by ``mindspore.parallel.merge_pipeline_strategys`` prefixes every
parameter name with ``<stage>-``. Both forms are read here.

:func:`layouts_from_strategy` returns the :class:`Layout` of every parameter
that lives on a given rank; :func:`read_strategy_records` returns MindSpore's
records of every parameter on every stage (for tools that see all ranks).
:func:`layout_for_state_key` finds the layout of an optimizer state named after
its parameter (``moment1.<param>``, ``adam_m.<param>``, ...).

MindSpore is imported only when a protobuf file is read.
"""

from __future__ import annotations

import glob
import json
import math
import os
from typing import Any, Mapping, Sequence, Union

from hyper_parallel.core._errors import LayoutError, StrategyFileError
from hyper_parallel.core._mindspore_layout import MindSporeLayoutRecord
from hyper_parallel.core.layout import Layout

__all__ = [
    "OPTIMIZER_STATE_PREFIXES",
    "StrategySource",
    "layout_for_state_key",
    "layouts_from_strategy",
    "name_prefix_difference",
    "read_strategy_records",
    "strategy_paths",
]

#: A strategy file, a directory of per-stage files, or a list of per-stage files.
StrategySource = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]

#: Prefixes MindSpore's optimizers put before a parameter's name for its state.
OPTIMIZER_STATE_PREFIXES: tuple[str, ...] = (
    "moment1.", "moment2.", "moments.", "adam_m.", "adam_v.", "accum.", "mean_grad.", "mean_square.",
    "linear.", "exp_avg.", "exp_avg_sq.", "max_exp_avg_sq.", "vhat.",
    "lamb_m.", "lamb_v.", "moment.", "stat.", "exp_inf.", "accum_update.", "ax.", "prev.", "step_size.",
)


def strategy_paths(strategy_file: StrategySource) -> list[str]:
    """Return the strategy files ``strategy_file`` names, in a stable order.

    A directory stands for its ``*.ckpt`` files, or its ``*.json`` files (as
    ``merge_pipeline_strategys`` reads it).

    Raises:
        StrategyFileError: A path that does not exist or is not a regular file, an empty directory, or
            a directory mixing both formats.
    """
    if isinstance(strategy_file, (str, os.PathLike)):
        sources = [os.fspath(strategy_file)]
    else:
        sources = [os.fspath(p) for p in strategy_file]
    if not sources:
        raise StrategyFileError("strategy_file is an empty list: pass a strategy file or one per pipeline stage")
    paths: list[str] = []
    for source in sources:
        if os.path.isdir(source):
            protobuf = sorted(glob.glob(os.path.join(source, "*.ckpt")))
            as_json = sorted(glob.glob(os.path.join(source, "*.json")))
            if protobuf and as_json:
                raise StrategyFileError(f"strategy directory {source!r} mixes .ckpt and .json files: keep one format")
            if not protobuf and not as_json:
                raise StrategyFileError(f"strategy directory {source!r} holds no .ckpt or .json strategy file")
            paths.extend(protobuf or as_json)
        elif os.path.isfile(source):
            paths.append(source)
        else:
            what = "is not a regular file (a FIFO or device)" if os.path.exists(source) else "does not exist"
            raise StrategyFileError(f"strategy file {source!r} {what}: pass the file MindSpore wrote "
                                    f"through strategy_ckpt_config={{'save_file': ...}}")
    return paths


def _split_stage(name: str, stage: int) -> tuple[str, int]:
    """Strip a merged file's ``<stage>-`` prefix (MindSpore's rule: split at the first '-')."""
    head, sep, rest = name.partition("-")
    if sep and head.isdigit():
        return rest, int(head)
    return name, stage


def _dims(message: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in message.dim)


def _protobuf_items(path: str) -> tuple[int, list[tuple[str, dict[str, Any]]]]:
    from mindspore.train import node_strategy_pb2  # pylint: disable=import-outside-toplevel

    with open(path, "rb") as handle:
        content = handle.read()
    if not content:
        raise StrategyFileError(f"strategy file {path!r} is empty")
    strategy_map = node_strategy_pb2.ParallelStrategyMap()
    try:
        strategy_map.ParseFromString(content)
    except Exception as exc:  # protobuf raises its own DecodeError
        raise StrategyFileError(
            f"strategy file {path!r} is not a ParallelStrategyMap protobuf ({str(exc).rstrip('.')})"
            + (_what_else(path) or f"; {_WRITTEN_BY}")) from exc
    stage = int(strategy_map.parallel_strategy_item[0].parallel_strategys.stage) \
        if strategy_map.parallel_strategy_item else 0
    items = []
    for item in strategy_map.parallel_layout_item:
        layouts = item.parallel_layouts
        maps = [_dims(m) for m in layouts.tensor_map]
        # One TensorMap: one int per dim. Several: one (possibly multi-dim) entry per tensor dim.
        tensor_map = maps[0] if len(maps) == 1 else tuple(m if len(m) > 1 else m[0] for m in maps if m)
        items.append((item.param_name, {
            "dev_matrix": _dims(layouts.dev_matrix[0]) if layouts.dev_matrix else (),
            "tensor_map": tensor_map if maps else (),
            "param_split_shape": _dims(layouts.param_split_shape[0]) if layouts.param_split_shape else (),
            "indices_offset": _dims(layouts.indices_offset[0]) if layouts.indices_offset else (),
            "field": int(layouts.field),
            "opt_weight_shard_step": int(layouts.opt_weight_shard_step),
            "opt_weight_shard_size": int(layouts.opt_weight_shard_size),
        }))
    return stage, items


def _json_items(path: str) -> tuple[int, list[tuple[str, dict[str, Any]]]]:
    try:
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
    except (OSError, ValueError) as exc:
        raise StrategyFileError(f"strategy file {path!r} is not readable JSON: {exc}") from exc
    strategies = content.get("parallel_strategy_item") or {}
    stage = int(next(iter(strategies.values())).get("stage", 0)) if strategies else 0
    items = []
    for name, layout in (content.get("parallel_layout_item") or {}).items():
        items.append((name, {
            "dev_matrix": tuple(layout.get("dev_matrix", ())),
            "tensor_map": tuple(tuple(e) if isinstance(e, list) else e for e in layout.get("tensor_map", ())),
            "param_split_shape": tuple(layout.get("param_split_shape") or ()),
            "indices_offset": tuple(layout.get("indices_offset") or ()),
            "field": int(layout.get("field") or 0),
            "opt_weight_shard_step": int(layout.get("opt_weight_shard_step") or 0),
            "opt_weight_shard_size": int(layout.get("opt_weight_shard_size") or 0),
        }))
    return stage, items


_WRITTEN_BY = "pass the file MindSpore wrote through set_auto_parallel_context(strategy_ckpt_config={'save_file': ...})"


def _what_else(path: str) -> str:
    """``"; it is <what> ..."`` with the fix when the file is a checkpoint given as a strategy file (both are
    ``.ckpt`` files in MindSpore), else ``""``. Error paths only."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(9)
            size = os.fstat(handle.fileno()).st_size
            content = handle.read() if size < (64 << 20) else b""
    except OSError:
        return ""
    what = ""
    if len(head) == 9 and head[8:] == b"{" and int.from_bytes(head[:8], "little") < size:
        what = "a safetensors file (a checkpoint's tensors)"
    elif path.endswith(".json") and b'"state_dict_metadata"' in head + content:
        what = "a hyper_parallel checkpoint's metadata"
    elif content:
        from mindspore.train import checkpoint_pb2  # pylint: disable=import-outside-toplevel

        checkpoint = checkpoint_pb2.Checkpoint()
        try:
            checkpoint.ParseFromString(head + content)
        except Exception:  # pylint: disable=broad-except  # protobuf's DecodeError: not a checkpoint either
            return ""
        tags = [value.tag for value in checkpoint.value if value.tag]
        if tags:
            what = f"a MindSpore checkpoint file ({len(tags)} parameter(s), e.g. {tags[0]!r})"
    if not what:
        return ""
    return f"; {path!r} is {what}, not a strategy file: {_WRITTEN_BY}"


def read_strategy_records(strategy_file: StrategySource) -> dict[str, tuple[MindSporeLayoutRecord, ...]]:
    """Read every parameter's layout record on every pipeline stage.

    Called by any rank; reads files, no communication.

    Args:
        strategy_file: A strategy file, a directory of per-stage files, or a
            list of per-stage files (duplicates of a stage are read once).

    Returns:
        Parameter name -> its records, one per stage holding it, by stage.

    Raises:
        StrategyFileError: A missing, empty or unparsable file, or two files
            giving one parameter of one stage different layouts.
    """
    found: dict[str, dict[int, MindSporeLayoutRecord]] = {}
    for path in strategy_paths(strategy_file):
        file_stage, items = _json_items(path) if path.endswith(".json") else _protobuf_items(path)
        for raw_name, fields in items:
            name, stage = _split_stage(raw_name, file_stage)
            record = MindSporeLayoutRecord(name=name, stage=stage, source=path, **fields)
            known = found.setdefault(name, {}).get(stage)
            if known is not None and known != record:
                raise StrategyFileError(
                    f"parameter {name!r} of pipeline stage {stage} has two different layouts in the strategy "
                    f"files ({path!r} and an earlier one): pass one file per stage")
            found[name][stage] = record
    if not found:
        paths = strategy_paths(strategy_file)
        raise StrategyFileError(f"strategy file(s) {paths} hold no parameter layout"
                                + "".join(_what_else(path) for path in paths))
    return {name: tuple(by_stage[s] for s in sorted(by_stage)) for name, by_stage in found.items()}


def layouts_from_strategy(strategy_file: StrategySource, rank: int | None = None) -> dict[str, Layout]:
    """Return the :class:`Layout` of every parameter that lives on ``rank``.

    Called by any rank; reads files, no communication. With pipeline stages a
    parameter appears only if ``rank``'s stage holds it (stage ``rank // N``,
    ``N`` the ranks of one stage); its layout's ``rank_list`` is that stage's ranks.

    Args:
        strategy_file: A strategy file MindSpore wrote, a directory of them, or
            a list of per-stage files (as ``merge_pipeline_strategys`` takes),
            or one merged file.
        rank: Global rank; defaults to the current rank (0 without communication).

    Returns:
        Parameter name (as in ``net.parameters_dict()``) -> its Layout.

    Raises:
        StrategyFileError: See :func:`read_strategy_records`.
        LayoutError: A layout that cannot be mapped exactly (uneven split,
            ``field`` > 1, ...), naming the parameter and the field.
    """
    if rank is None:
        from hyper_parallel.platform.comm import get_rank  # pylint: disable=import-outside-toplevel

        rank = get_rank()
    records_by_name = read_strategy_records(strategy_file)
    _check_stage_sizes(records_by_name)
    layouts: dict[str, Layout] = {}
    for name, records in records_by_name.items():
        for record in records:
            if record.stage == rank // max(1, math.prod(record.dev_matrix)):
                layouts[name] = record.to_layout()
                break
    return layouts


def layout_for_state_key(layouts: Mapping[str, Any], key: str) -> Any:
    """Return the layout of ``key``, or of the parameter an optimizer state ``key`` belongs to.

    ``moment1.dense.weight`` (and ``adam_m.``, ``adam_v.``, ``accum.``, ...
    see :data:`OPTIMIZER_STATE_PREFIXES`) follows ``dense.weight``'s layout,
    the optimizer-parallel one included. Returns ``None`` when neither is known.
    """
    if key in layouts:
        return layouts[key]
    for prefix in OPTIMIZER_STATE_PREFIXES:
        if key.startswith(prefix) and key[len(prefix):] in layouts:
            return layouts[key[len(prefix):]]
    return None


def _check_stage_sizes(records: Mapping[str, Sequence[MindSporeLayoutRecord]]) -> None:
    sizes = {r.stage_device_num for rs in records.values() for r in rs}
    if len(sizes) > 1:
        raise LayoutError(f"the strategy's parameters have meshes of different sizes {sorted(sizes)}: the ranks "
                          f"of a pipeline stage cannot be told; pass the strategy files of one job")


def name_prefix_difference(names: Sequence[str], others: set[str]) -> tuple[str, bool] | None:
    """The one prefix (ending in a dot: ``network.``, as a wrapping Cell names its Parameters) by which every
    name of ``names`` differs from a name of ``others``, and whether ``names`` carry it (``True``) or
    ``others`` do; ``None`` without one. ``names`` is not empty. Any rank; no collectives.
    """
    first = names[0]
    for cut in (i + 1 for i, char in enumerate(first) if char == "."):
        if all(name.startswith(first[:cut]) and name[cut:] in others for name in names):
            return first[:cut], True
    for other in others:
        prefix = other[:-len(first)]
        if other.endswith("." + first) and all(prefix + name in others for name in names):
            return prefix, False
    return None
