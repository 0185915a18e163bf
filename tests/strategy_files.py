"""Build MindSpore strategy files (``ParallelStrategyMap`` protobuf) for tests.

Semi-auto parallel does not run on CPU, so tests write the strategy files a
real job would write with ``mindspore.train.node_strategy_pb2``. Each case of
:data:`CASES` is a list of per-stage files for one job, and the global shapes
of its parameters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Union

__all__ = [
    "CASES", "ParamStrategy", "StrategyCase", "strategy_for_mindspore", "write_case", "write_json_strategy_file",
    "write_strategy_file",
]

Entry = Union[int, tuple[int, ...]]


@dataclass(frozen=True)
class ParamStrategy:
    """One ``parallel_layout_item`` of a strategy file (fields as in node_strategy.proto)."""

    name: str
    dev_matrix: tuple[int, ...]
    tensor_map: tuple[Entry, ...]
    param_split_shape: tuple[int, ...] = ()
    indices_offset: tuple[int, ...] = ()
    field: int = 0
    opt_weight_shard_step: int = 0
    opt_weight_shard_size: int = 0


@dataclass(frozen=True)
class StrategyCase:
    """One job: its stages' parameters and the parameters' global shapes."""

    stages: tuple[tuple[ParamStrategy, ...], ...]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """Ranks of the whole job (stages x ranks per stage)."""
        dev = self.stages[0][0].dev_matrix
        size = 1
        for d in dev:
            size *= d
        return size * len(self.stages)


def write_strategy_file(path: str | os.PathLike, params: tuple[ParamStrategy, ...], *, stage: int = 0) -> str:
    """Write ``params`` as the strategy file of pipeline ``stage``; return the path."""
    from mindspore.train import node_strategy_pb2  # pylint: disable=import-outside-toplevel

    strategy_map = node_strategy_pb2.ParallelStrategyMap()
    strategy_map.current_stage = stage
    node = strategy_map.parallel_strategy_item.add()
    node.node_name = f"Default/network-Net/MatMul-op{stage}"
    node.parallel_strategys.stage = stage
    node.parallel_strategys.parallel_strategy.add().dim.extend([1, 1])
    for param in params:
        item = strategy_map.parallel_layout_item.add()
        item.param_name = param.name
        layouts = item.parallel_layouts
        layouts.dev_matrix.add().dim.extend(param.dev_matrix)
        if any(isinstance(e, tuple) for e in param.tensor_map):
            for entry in param.tensor_map:  # one TensorMap per tensor dim
                layouts.tensor_map.add().dim.extend(entry if isinstance(entry, tuple) else (entry,))
        else:
            layouts.tensor_map.add().dim.extend(param.tensor_map)
        layouts.param_split_shape.add().dim.extend(param.param_split_shape)
        layouts.indices_offset.add().dim.extend(param.indices_offset)
        layouts.field = param.field
        layouts.opt_weight_shard_step = param.opt_weight_shard_step
        layouts.opt_weight_shard_size = param.opt_weight_shard_size
    path = os.fspath(path)
    with open(path, "wb") as handle:
        handle.write(strategy_map.SerializeToString())
    return path


def write_json_strategy_file(path: str | os.PathLike, params: tuple[ParamStrategy, ...], *, stage: int = 0) -> str:
    """Write ``params`` as the JSON strategy file of pipeline ``stage`` (a tensor dim over several mesh
    dims as a nested list); return the path."""
    import json  # pylint: disable=import-outside-toplevel

    layouts = {
        p.name: {"dev_matrix": list(p.dev_matrix),
                 "tensor_map": [list(e) if isinstance(e, tuple) else e for e in p.tensor_map],
                 "param_split_shape": list(p.param_split_shape), "indices_offset": list(p.indices_offset),
                 "field": p.field, "opt_weight_shard_step": p.opt_weight_shard_step,
                 "opt_weight_shard_size": p.opt_weight_shard_size}
        for p in params
    }
    content = {"current_stage": stage,
               "parallel_strategy_item": {f"Default/network-Net/MatMul-op{stage}": {"stage": stage}},
               "parallel_layout_item": layouts}
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(content, handle)
    return path


def write_case(directory: str | os.PathLike, case: StrategyCase, *, prefix: str = "strategy",
               fmt: str = "ckpt") -> list[str]:
    """Write one file per stage of ``case`` into ``directory`` (protobuf ``ckpt`` or ``json``); return
    their paths by stage."""
    os.makedirs(directory, exist_ok=True)
    writer = write_json_strategy_file if fmt == "json" else write_strategy_file
    return [
        writer(os.path.join(directory, f"{prefix}_stage{stage}.{fmt}"), params, stage=stage)
        for stage, params in enumerate(case.stages)
    ]


def strategy_for_mindspore(directory: str | os.PathLike, paths: list[str]) -> str:
    """The one file MindSpore's tools take: the stage file, or the stages merged by
    ``merge_pipeline_strategys`` into ``directory/merged.ckpt``."""
    import mindspore  # pylint: disable=import-outside-toplevel

    if len(paths) == 1:
        return paths[0]
    merged = os.path.join(directory, "merged.ckpt")
    mindspore.parallel.merge_pipeline_strategys(os.path.dirname(paths[0]), merged)
    return merged


_P = ParamStrategy

#: (a) 2-D tensor parallel on 8 ranks, (b) data parallel with replicas,
#: (c) optimizer parallel, (d) 2 pipeline stages, (e) the 8 -> 4 reshard target.
CASES: dict[str, StrategyCase] = {
    "tp2d_8": StrategyCase(
        stages=((
            _P("dense.weight", (2, 4), (1, 0)),
            _P("dense.bias", (2, 4), (0,)),
            _P("proj.weight", (2, 2, 2), ((2, 1), 0)),
        ),),
        shapes={"dense.weight": (8, 16), "dense.bias": (16,), "proj.weight": (8, 6)},
    ),
    "dp_replicas_4": StrategyCase(
        stages=((
            _P("dense.weight", (2, 2), (0, -1)),
            _P("dense.bias", (2, 2), (-1,)),
        ),),
        shapes={"dense.weight": (8, 6), "dense.bias": (6,)},
    ),
    "opt_parallel_8": StrategyCase(
        stages=((
            _P("dense.weight", (4, 2), (0, -1), opt_weight_shard_step=2, opt_weight_shard_size=4),
            _P("dense.bias", (4, 2), (-1,), opt_weight_shard_step=1, opt_weight_shard_size=-1),
            _P("head.weight", (4, 2), (-1, 0), opt_weight_shard_step=2, opt_weight_shard_size=2),
            _P("norm.gamma", (4, 2), (-1, -1)),
        ),),
        shapes={"dense.weight": (16, 4), "dense.bias": (16,), "head.weight": (8, 6), "norm.gamma": (4, 4)},
    ),
    "pipeline_2x2": StrategyCase(
        stages=(
            (
                _P("embed.weight", (2,), (-1, 0)),
                _P("layer0.weight", (2,), (0, -1)),
            ),
            (
                _P("embed.weight", (2,), (-1, 0)),
                _P("layer1.weight", (2,), (-1, 0)),
            ),
        ),
        shapes={"embed.weight": (6, 8), "layer0.weight": (8, 4), "layer1.weight": (4, 8)},
    ),
    "reshard_dst_4": StrategyCase(
        stages=((
            _P("dense.weight", (4,), (-1, 0)),
            _P("dense.bias", (2, 2), (1,)),
            _P("proj.weight", (4,), (0, -1)),
        ),),
        shapes={"dense.weight": (8, 16), "dense.bias": (16,), "proj.weight": (8, 6)},
    ),
}
