"""Layouts from MindSpore strategy files and parameter_layout_dict entries.

Shards cut with the returned Layouts are compared with shards cut by hand
(numpy slicing) and with MindSpore's own slicing helpers
(``mindspore.parallel._tensor``), which its checkpoint tools use.
"""

import math
import os

import mindspore
import numpy as np
import pytest
from mindspore.parallel import _tensor as ms_tensor

import hyper_parallel
from hyper_parallel import Layout, layouts_from_strategy
from hyper_parallel.core.distributed_checkpoint.errors import LayoutError, StrategyFileError
from hyper_parallel.core.strategy_file import layout_for_state_key, read_strategy_records
from tests.strategy_files import CASES, ParamStrategy, write_case, write_strategy_file

mindspore.set_device("CPU")


def _full(shape):
    return np.arange(math.prod(shape), dtype=np.float32).reshape(shape)


def _cut(layout, full, rank):
    offsets = layout.shard_offsets(full.shape, rank)
    local = layout.local_shape(full.shape)
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, local))]


def _mindspore_slice(full, param, local_rank):
    """The slice MindSpore's own helpers give ``local_rank`` of the stage."""
    dev = list(param.dev_matrix)
    tmap = [list(e) if isinstance(e, tuple) else e for e in param.tensor_map]
    shape = list(full.shape)
    if param.opt_weight_shard_size:
        # -1 ("all replicas") resolved as MindSpore's _extract_layout_item does.
        _, _, step, size = ms_tensor._extract_layout_item(  # pylint: disable=protected-access
            (dev, tmap, [], 0, param.opt_weight_shard_step, param.opt_weight_shard_size))
        dev, tmap, shape = ms_tensor._construct_tensor_layout_for_opt_shard(  # pylint: disable=protected-access
            dev, tmap, step, int(size), shape)
    elif any(isinstance(e, list) for e in tmap):
        dev, tmap, shape = ms_tensor._expand_layout(dev, tmap, shape)  # pylint: disable=protected-access
    # pylint: disable-next=protected-access
    return ms_tensor._load_tensor(mindspore.Tensor(full), dev, tmap, shape, local_rank)


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_every_rank_matches_mindspore_slicing(tmp_path, case_name):
    case = CASES[case_name]
    files = write_case(tmp_path, case)
    per_stage = math.prod(case.stages[0][0].dev_matrix)
    for rank in range(case.world_size):
        stage = rank // per_stage
        layouts = layouts_from_strategy(files, rank=rank)
        assert set(layouts) == {p.name for p in case.stages[stage]}, (case_name, rank)
        for param in case.stages[stage]:
            full = _full(case.shapes[param.name])
            mine = _cut(layouts[param.name], full, rank)
            theirs = _mindspore_slice(full, param, rank - stage * per_stage)
            np.testing.assert_array_equal(mine, theirs.reshape(mine.shape), err_msg=f"{case_name} {param.name} {rank}")
            assert mine.size * layouts[param.name].num_shards() == full.size


# (case, parameter, rank, expected shard cut by hand)
HAND_CUT = [
    ("tp2d_8", "dense.weight", 5, lambda f: f[4:8, 4:8]),
    ("tp2d_8", "dense.weight", 2, lambda f: f[0:4, 8:12]),
    ("tp2d_8", "dense.bias", 6, lambda f: f[8:12]),
    # dev (2,2,2), dim 0 over mesh dims 0 then 1 (outermost first), dim 1 over mesh dim 2.
    ("tp2d_8", "proj.weight", 3, lambda f: f[2:4, 3:6]),
    ("tp2d_8", "proj.weight", 4, lambda f: f[4:6, 0:3]),
    ("dp_replicas_4", "dense.weight", 2, lambda f: f[0:4, :]),
    ("dp_replicas_4", "dense.weight", 3, lambda f: f[4:8, :]),
    ("dp_replicas_4", "dense.bias", 3, lambda f: f),
    # dev (4 dp, 2 mp): rows split by mp (8 rows) then by all 4 dp (2 rows each).
    ("opt_parallel_8", "dense.weight", 5, lambda f: f[12:14, :]),
    ("opt_parallel_8", "dense.weight", 0, lambda f: f[0:2, :]),
    # bias: no mp split, opt over all 8 ranks (-1).
    ("opt_parallel_8", "dense.bias", 6, lambda f: f[12:14]),
    # columns by mp; rows by opt size 2 = the inner half of dp (dp coord % 2).
    ("opt_parallel_8", "head.weight", 5, lambda f: f[0:4, 3:6]),
    ("opt_parallel_8", "head.weight", 3, lambda f: f[4:8, 3:6]),
    ("opt_parallel_8", "norm.gamma", 7, lambda f: f),
    ("pipeline_2x2", "layer1.weight", 3, lambda f: f[:, 4:8]),
    ("pipeline_2x2", "embed.weight", 2, lambda f: f[:, 0:4]),
    ("reshard_dst_4", "dense.bias", 1, lambda f: f[0:8]),
    ("reshard_dst_4", "dense.bias", 2, lambda f: f[8:16]),
]


@pytest.mark.parametrize("case_name,name,rank,expected", HAND_CUT)
def test_shards_cut_by_hand(tmp_path, case_name, name, rank, expected):
    case = CASES[case_name]
    layout = layouts_from_strategy(write_case(tmp_path, case), rank=rank)[name]
    full = _full(case.shapes[name])
    np.testing.assert_array_equal(_cut(layout, full, rank), expected(full))


def test_pipeline_parameter_exists_only_on_its_stage(tmp_path):
    files = write_case(tmp_path, CASES["pipeline_2x2"])
    assert sorted(layouts_from_strategy(files, rank=1)) == ["embed.weight", "layer0.weight"]
    assert sorted(layouts_from_strategy(files, rank=2)) == ["embed.weight", "layer1.weight"]
    assert layouts_from_strategy(files, rank=3)["layer1.weight"].rank_list == (2, 3)
    # A directory stands for its per-stage files; the order of the list does not matter.
    assert layouts_from_strategy(str(tmp_path), rank=3) == layouts_from_strategy(files[::-1], rank=3)
    records = read_strategy_records(files)
    assert [r.stage for r in records["embed.weight"]] == [0, 1]
    assert [r.stage for r in records["layer1.weight"]] == [1]


def test_merged_pipeline_file_reads_like_the_stage_files(tmp_path):
    from mindspore.parallel import merge_pipeline_strategys

    write_case(tmp_path / "stages", CASES["pipeline_2x2"])
    merged = str(tmp_path / "merged.ckpt")
    merge_pipeline_strategys(str(tmp_path / "stages"), merged)
    for rank in range(4):
        assert layouts_from_strategy(merged, rank=rank) == layouts_from_strategy(str(tmp_path / "stages"), rank=rank)


def test_json_strategy_file(tmp_path):
    import json

    path = tmp_path / "strategy.json"
    path.write_text(json.dumps({
        "parallel_strategy_item": {"op": {"stage": 0}},
        "parallel_layout_item": {"w": {"dev_matrix": [2, 2], "tensor_map": [1, -1], "field": 0,
                                       "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}},
    }))
    layout = layouts_from_strategy(str(path), rank=2)["w"]
    np.testing.assert_array_equal(_cut(layout, _full((4, 2)), 2), _full((4, 2))[2:4])


def test_default_rank_is_the_current_rank(tmp_path):
    files = write_case(tmp_path, CASES["pipeline_2x2"])
    assert sorted(layouts_from_strategy(files)) == ["embed.weight", "layer0.weight"]
    assert hyper_parallel.layouts_from_strategy is layouts_from_strategy


def test_optimizer_state_follows_its_parameter(tmp_path):
    layouts = layouts_from_strategy(write_case(tmp_path, CASES["opt_parallel_8"]), rank=0)
    for key in ("moment1.dense.weight", "moment2.dense.weight", "adam_m.dense.weight", "adam_v.dense.weight",
                "accum.dense.weight", "dense.weight"):
        assert layout_for_state_key(layouts, key) == layouts["dense.weight"], key
    assert layout_for_state_key(layouts, "moment1.other") is None
    assert layout_for_state_key(layouts, "global_step") is None


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("param,field", [
    (ParamStrategy("w", (4,), (0, -1), param_split_shape=(3, 3, 1, 1), indices_offset=(0, 3, 6, 7)),
     "param_split_shape"),
    (ParamStrategy("w", (4,), (0, -1), param_split_shape=(2, 2, 2, 2), indices_offset=(0, 2, 5, 6)),
     "indices_offset"),
    (ParamStrategy("w", (2, 2), (1, -1), field=39), "field"),
    (ParamStrategy("w", (2, 2), (1, 0), opt_weight_shard_step=1, opt_weight_shard_size=2),
     "opt_weight_shard_size"),
    (ParamStrategy("w", (4, 2), (0, -1), opt_weight_shard_step=2, opt_weight_shard_size=3),
     "opt_weight_shard_size"),
    (ParamStrategy("w", (2, 2), (0, -1), opt_weight_shard_step=2, opt_weight_shard_size=4),
     "opt_weight_shard_size"),
    (ParamStrategy("w", (4, 2), (0, -1), opt_weight_shard_step=3, opt_weight_shard_size=2),
     "opt_weight_shard_step"),
    (ParamStrategy("w", (2, 2, 2), (0, 1), opt_weight_shard_step=4, opt_weight_shard_size=2), "tensor_map"),
    (ParamStrategy("w", (2, 0), (0, -1)), "dev_matrix"),
    (ParamStrategy("w", (2, 2), (2, -1)), "tensor_map"),
    (ParamStrategy("w", (6, 2), (0, -1), opt_weight_shard_step=2, opt_weight_shard_size=4), "opt_weight_shard_size"),
    (ParamStrategy("w", (2, 3), (-1, -1), opt_weight_shard_step=1, opt_weight_shard_size=4),
     "opt_weight_shard_size"),
    (ParamStrategy("w", (4, 2), (0, -1), opt_weight_shard_step=2, opt_weight_shard_size=-2), "opt_weight_shard_size"),
])
def test_what_cannot_be_mapped_exactly_is_refused(tmp_path, param, field):
    path = write_strategy_file(tmp_path / "s.ckpt", (param,))
    with pytest.raises(LayoutError) as info:
        layouts_from_strategy(path, rank=0)
    text = str(info.value)
    assert "'w'" in text and f"{field}=" in text
    # The refusal names the strategy file and the ranks that hold the parameter.
    assert repr(str(path)) in text and "pipeline stage 0" in text, text


def test_optimizer_parallel_out_of_mesh_order_is_refused_with_mindspores_disagreement(tmp_path):
    """MindSpore's transform_checkpoints and load_distributed_checkpoint place these slices differently.

    Only the outermost mesh dim is a replica dim and the model-parallel dims are used out of mesh order:
    transform_checkpoints renumbers the mesh by tensor dim, load_distributed_checkpoint does not (seen by
    tests/ms_fuzz.py). Which one a training job follows is unknown, so the layout is refused, naming the
    file, the ranks and what to change.
    """
    import mindspore

    param = ParamStrategy("w", (2, 2, 2), (0, -1, 1), opt_weight_shard_step=4, opt_weight_shard_size=2)
    path = write_strategy_file(tmp_path / "s.ckpt", (param,))
    full = _full((8, 2, 4))
    (tmp_path / "full" / "rank_0").mkdir(parents=True)
    mindspore.save_checkpoint([{"name": "w", "data": mindspore.Tensor(full)}],
                              str(tmp_path / "full" / "rank_0" / "full.ckpt"))
    mindspore.parallel.transform_checkpoints(str(tmp_path / "full"), str(tmp_path / "ranks"), "c", None, path)
    files = [str(tmp_path / "ranks" / f"rank_{r}" / f"c{r}.ckpt") for r in range(8)]
    net = mindspore.nn.Cell()
    net.w = mindspore.Parameter(mindspore.Tensor(np.zeros_like(full)), name="w")
    mindspore.load_distributed_checkpoint(net, files, None, train_strategy_filename=path)
    assert not np.array_equal(net.w.asnumpy(), full)  # MindSpore's two tools disagree
    with pytest.raises(LayoutError) as info:
        layouts_from_strategy(path, rank=0)
    text = str(info.value)
    for part in ("'w'", "tensor_map=(0, -1, 1)", repr(str(path)), "ranks 0-7", "parallel_optimizer"):
        assert part in text, (part, text)


@pytest.mark.parametrize("mesh,size", [((3, 2), 3), ((2, 3), 2), ((3, 2, 2), 3)])
def test_replicated_tensor_optimizer_pieces_by_rank_modulo_size_as_mindspore(tmp_path, mesh, size):
    """A replicated tensor whose optimizer-parallel size does not fill the replica dims from the inside
    (size 3 over dims (3, 2)): MindSpore's transform_checkpoints gives rank r the piece r % size."""
    path = write_strategy_file(tmp_path / "s.ckpt", (
        ParamStrategy("w", mesh, (-1, -1), opt_weight_shard_step=1, opt_weight_shard_size=size),))
    full = _full((12, 2))
    (tmp_path / "full" / "rank_0").mkdir(parents=True)
    mindspore.save_checkpoint([{"name": "w", "data": mindspore.Tensor(full)}],
                              str(tmp_path / "full" / "rank_0" / "full.ckpt"))
    mindspore.parallel.transform_checkpoints(str(tmp_path / "full"), str(tmp_path / "ranks"), "c", None, str(path))
    rows = 12 // size
    for rank in range(math.prod(mesh)):
        mindspores = mindspore.load_checkpoint(str(tmp_path / "ranks" / f"rank_{rank}" / f"c{rank}.ckpt"))["w"]
        ours = _cut(layouts_from_strategy(path, rank=rank)["w"], full, rank)
        np.testing.assert_array_equal(ours, mindspores.asnumpy())
        np.testing.assert_array_equal(ours, full[rank % size * rows:(rank % size + 1) * rows])


def test_even_param_split_shape_and_field_one_are_exact(tmp_path):
    path = write_strategy_file(tmp_path / "s.ckpt", (
        ParamStrategy("even", (4,), (0, -1), param_split_shape=(2, 2, 2, 2), indices_offset=(0, 2, 4, 6)),
        ParamStrategy("field1", (2, 2), (1, -1), field=1),
    ))
    full = _full((8, 3))
    for rank in range(4):
        layouts = layouts_from_strategy(path, rank=rank)
        np.testing.assert_array_equal(_cut(layouts["even"], full, rank), full[2 * rank:2 * rank + 2])
        # field 1: rows concatenated in rank order (MindSpore's _reshape_param_data_with_weight).
        np.testing.assert_array_equal(_cut(layouts["field1"], full, rank), full[2 * rank:2 * rank + 2])


def test_scalar_refusals_and_group_of_one():
    from hyper_parallel.core._mindspore_layout import MindSporeLayoutRecord

    with pytest.raises(LayoutError, match="field=1"):
        MindSporeLayoutRecord("s", (2,), (), field=1).to_layout()
    with pytest.raises(LayoutError, match="opt_weight_shard_size=2"):
        MindSporeLayoutRecord("s", (2,), (), opt_weight_shard_step=1, opt_weight_shard_size=2).to_layout()
    assert MindSporeLayoutRecord("s", (2,), (), stage=1).to_layout().rank_list == (2, 3)
    # An optimizer group of one rank (slice shape = model-parallel shape): no optimizer split.
    entry = _entry((2,), (0, -1), (8, 4), (4, 4), opt_group="1-1")
    assert Layout.from_mindspore_layout(entry, rank=1) == Layout((2,), (0, -1))


def test_bad_strategy_files(tmp_path):
    with pytest.raises(StrategyFileError, match="does not exist"):
        layouts_from_strategy(str(tmp_path / "missing.ckpt"), rank=0)
    os.mkfifo(tmp_path / "fifo.ckpt")  # never opened (an open would wait for a writer); was "does not exist"
    with pytest.raises(StrategyFileError) as info:
        layouts_from_strategy(str(tmp_path / "fifo.ckpt"), rank=0)
    assert str(info.value).startswith(f"strategy file {str(tmp_path / 'fifo.ckpt')!r} is not a regular file (a FIFO "
                                      "or device): pass the file MindSpore wrote"), info.value
    (tmp_path / "empty.ckpt").write_bytes(b"")
    with pytest.raises(StrategyFileError, match="is empty"):
        layouts_from_strategy(str(tmp_path / "empty.ckpt"), rank=0)
    (tmp_path / "junk.ckpt").write_bytes(b"\xff\xff\xff\xff")
    with pytest.raises(StrategyFileError, match="not a ParallelStrategyMap"):
        layouts_from_strategy(str(tmp_path / "junk.ckpt"), rank=0)
    with pytest.raises(StrategyFileError, match="empty list"):
        layouts_from_strategy([], rank=0)
    (tmp_path / "d").mkdir()
    with pytest.raises(StrategyFileError, match="holds no"):
        layouts_from_strategy(str(tmp_path / "d"), rank=0)
    (tmp_path / "d" / "a.ckpt").write_bytes(b"x")
    (tmp_path / "d" / "a.json").write_text("{}")
    with pytest.raises(StrategyFileError, match="mixes"):
        layouts_from_strategy(str(tmp_path / "d"), rank=0)
    write_strategy_file(tmp_path / "a.ckpt", (ParamStrategy("w", (2,), (0,)),))
    write_strategy_file(tmp_path / "b.ckpt", (ParamStrategy("w", (2,), (-1,)),))
    with pytest.raises(StrategyFileError, match="two different layouts"):
        layouts_from_strategy([str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")], rank=0)
    write_strategy_file(tmp_path / "c.ckpt", (ParamStrategy("v", (4,), (0,)),))
    with pytest.raises(LayoutError, match="meshes of different sizes"):
        layouts_from_strategy([str(tmp_path / "a.ckpt"), str(tmp_path / "c.ckpt")], rank=0)


# ------------------------------------------------------------------ parameter_layout_dict


def _entry(dev, tmap, full_shape, slice_shape, opt_group="", field=0, uniform=True):
    return [list(dev), list(tmap), list(slice_shape), field, uniform, opt_group, list(full_shape), list(slice_shape)]


def test_from_mindspore_layout_matches_the_strategy_file(tmp_path):
    path = write_case(tmp_path, CASES["opt_parallel_8"])
    entry = _entry((4, 2), (0, -1), (16, 4), (2, 4), opt_group="4-123")
    head = _entry((4, 2), (-1, 0), (8, 6), (4, 3), opt_group="2-456")
    for rank in range(8):
        layouts = layouts_from_strategy(path, rank=rank)
        assert Layout.from_mindspore_layout(entry, rank=rank) == layouts["dense.weight"]
        assert Layout.from_mindspore_layout(head, rank=rank) == layouts["head.weight"]
    plain = Layout.from_mindspore_layout(_entry((2, 4), (1, 0), (8, 16), (4, 4)))
    np.testing.assert_array_equal(_cut(plain, _full((8, 16)), 5), _full((8, 16))[4:8, 4:8])


def test_from_mindspore_layout_pipeline_stage_from_rank():
    entry = _entry((2,), (-1, 0), (4, 8), (4, 4))
    assert Layout.from_mindspore_layout(entry, rank=3).rank_list == (2, 3)
    assert Layout.from_mindspore_layout(entry, rank=0).rank_list == (0, 1)


@pytest.mark.parametrize("entry,field", [
    (_entry((2,), (0, -1), (8, 4), (4, 4), uniform=False), "uniform_split"),
    (_entry((2,), (0, -1), (8, 4), (3, 4), opt_group="g"), "opt_shard_group"),
    ([[2], [0, -1], [4, 4], 0, True, "g"], "opt_shard_group"),
    (_entry((2,), (0, -1), (8, 4), (4, 4), field=3), "field"),
])
def test_from_mindspore_layout_refusals(entry, field):
    with pytest.raises(LayoutError) as info:
        Layout.from_mindspore_layout(entry, name="net.w", rank=0)
    assert "'net.w'" in str(info.value) and f"{field}=" in str(info.value)
    with pytest.raises(LayoutError, match="fewer than 6"):
        Layout.from_mindspore_layout([[2], [0]], name="net.w", rank=0)


def test_replica_groups_match_mindspore_parameter_redundancy(tmp_path):
    """Ranks holding the same shard (replicas, optimizer-parallel groups included) as MindSpore groups them."""
    from mindspore.train._utils import get_parameter_redundancy  # pylint: disable=import-outside-toplevel

    for name in ("tp2d_8", "dp_replicas_4", "opt_parallel_8", "reshard_dst_4"):
        case = CASES[name]
        path = write_case(tmp_path / name, case)[0]
        layouts = layouts_from_strategy(path, rank=0)
        for param, groups in get_parameter_redundancy(path, initial_rank=0).items():
            if any(isinstance(e, tuple) for p in case.stages[0] if p.name == param for e in p.tensor_map):
                # A multi-dim entry: the redundancy tool disagrees with MindSpore's own slicing (checked above).
                continue
            layout = layouts[param]
            mine: dict[tuple[int, ...], list[int]] = {}
            for rank in layout.rank_list:
                mine.setdefault(layout.shard_index(rank), []).append(rank)
            assert sorted(tuple(v) for v in mine.values()) == sorted(tuple(g) for g in groups), (name, param)
