"""Parameters MindSpore sliced: layouts attached on save/load, refusals, replica divergence.

Ranks are simulated in one process (the layout's rank is passed explicitly);
the real multi-process behaviour is in tests/test_mindspore_parallel.py.
"""

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import (
    LayoutSources,
    apply_mindspore_layouts,
    cells_in,
)
from sim_ranks import plan_ranks, simulate_save
from tests.strategy_files import ParamStrategy, write_strategy_file

ms.set_device("CPU")

FULL = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)


class Net(ms.nn.Cell):
    def __init__(self, rows=8, cols=4, sliced=False, fill=None):
        super().__init__()
        data = np.zeros((rows, cols), np.float32) if fill is None else fill
        self.w = ms.Parameter(ms.Tensor(data.copy()), name="w")
        self.b = ms.Parameter(ms.Tensor(np.ones(cols, np.float32)), name="b")
        self.w.sliced = sliced


def _row_strategy(tmp_path, ranks=2):
    return write_strategy_file(tmp_path / "s.ckpt", (ParamStrategy("w", (ranks,), (0, -1)),
                                                     ParamStrategy("b", (ranks,), (-1,))))


def test_sliced_parameter_without_layout_is_refused():
    net = Net(rows=4, sliced=True)
    with pytest.raises(dcp.SlicedParameterError) as info:
        apply_mindspore_layouts({"model": net}, source=None, rank=1)
    text = str(info.value)
    assert "'model.w' (Parameter 'w')" in text and "strategy_file=" in text and "rank 1" in text
    assert "'model.b'" not in text
    assert isinstance(info.value, ValueError)


def test_sliced_parameter_refused_by_save_no_dist(tmp_path):
    net = Net(rows=4, sliced=True)
    with pytest.raises(dcp.SlicedParameterError, match="'model.w'"):
        dcp.save({"model": net}, checkpoint_id=tmp_path / "c", no_dist=True)
    assert not (tmp_path / "c" / ".metadata").exists()


def test_strategy_file_gives_each_rank_its_box(tmp_path):
    path = _row_strategy(tmp_path)
    for rank in (0, 1):
        net = Net(rows=4, sliced=True, fill=FULL[rank * 4:(rank + 1) * 4])
        state = apply_mindspore_layouts({"model": net, "step": 3}, source=path, rank=rank)
        assert isinstance(state["model"], dict) and state["step"] == 3
        w = state["model"]["w"]
        assert isinstance(w, DTensor) and w.to_local() is net.w
        assert w.shape == (8, 4) and w.global_offset == (rank * 4, 0)
        assert isinstance(state["model"]["b"], DTensor) and state["model"]["b"].global_offset == (0,)


def test_parameter_layout_dict_is_used_by_itself():
    net = Net(rows=4, sliced=True)
    net.parameter_layout_dict = {"w": [[2], [0, -1], [4, 4], 0, True, "", [8, 4], [4, 4]]}
    state = apply_mindspore_layouts({"model": net}, source=None, rank=1)
    assert state["model"]["w"].global_offset == (4, 0)
    assert state["model"]["b"] is net.b  # not in the dict, not sliced: whole, as MindSpore saves it


def test_whole_parameter_under_a_splitting_layout_dict_entry_is_refused(tmp_path):
    """A Parameter holding the whole tensor where MindSpore's entry says a slice: refused, never saved wrong."""
    net = Net(rows=8, fill=FULL)  # the whole [8, 4] tensor, not the [4, 4] slice the entry describes
    net.parameter_layout_dict = {"w": [[2], [0, -1], [4, 4], 0, True, "", [8, 4], [4, 4]]}
    with pytest.raises(dcp.SlicedParameterError) as info:
        apply_mindspore_layouts({"model": net}, source=None, rank=1)
    text = str(info.value)
    assert "key 'model.w'" in text and "(8, 4)" in text and "(4, 4)" in text and "rank 1" in text
    with pytest.raises(dcp.SlicedParameterError, match="slice shape"):
        dcp.save({"model": net}, checkpoint_id=tmp_path / "c", no_dist=True)
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_optimizer_state_follows_its_parameter_and_is_wrapped_once(tmp_path):
    net = Net(rows=4, sliced=True)
    opt = ms.nn.Adam(net.trainable_params())
    state = apply_mindspore_layouts({"model": net, "optim": opt}, source=_row_strategy(tmp_path), rank=1)
    assert state["optim"]["w"] is state["model"]["w"]  # one DTensor per Parameter
    for name in ("moment1.w", "moment2.w"):
        assert state["optim"][name].global_offset == (4, 0), name
    assert state["optim"]["global_step"] is opt.global_step


def test_mapping_of_layouts_and_bare_parameters():
    param = ms.Parameter(ms.Tensor(np.zeros((4, 4), np.float32)), name="enc.w")
    param.sliced = True
    state = apply_mindspore_layouts({"x": [param, (param, 1)]}, source={"enc.w": Layout((2,), (0, -1))}, rank=1)
    assert isinstance(state["x"], list) and isinstance(state["x"][1], tuple)
    assert state["x"][0] is state["x"][1][0] and state["x"][0].global_offset == (4, 0)


def test_layout_not_fitting_the_local_shape_is_refused(tmp_path):
    net = Net(rows=4, sliced=True)
    path = write_strategy_file(tmp_path / "bad.ckpt", (ParamStrategy("b", (2,), (0, -1)),
                                                       ParamStrategy("w", (2,), (0, -1))))
    with pytest.raises(dcp.SlicedParameterError, match=r"key 'model.b' \(Parameter 'b', local shape \(4,\)\)"):
        apply_mindspore_layouts({"model": net}, source=path, rank=0)


def test_nothing_sliced_keeps_the_state_dict():
    state = {"model": Net(), "v": 1}
    assert apply_mindspore_layouts(state, source=None, rank=0) is state
    assert cells_in({"a": [state["model"]], "b": 2}) == (state["model"],)


def test_no_dist_round_trip_with_layout_source_and_plain_values(tmp_path):
    path = write_strategy_file(tmp_path / "one.ckpt", (ParamStrategy("w", (1,), (0, -1)),))
    net = Net(fill=FULL, sliced=True)
    dcp.save({"model": net, "step": 7}, checkpoint_id=tmp_path / "c", no_dist=True, strategy_file=path)
    target_net = Net(sliced=True)
    state = {"model": target_net, "step": 0}
    dcp.load(state, checkpoint_id=tmp_path / "c", no_dist=True, strategy_file=LayoutSources(path))
    np.testing.assert_array_equal(target_net.w.asnumpy(), FULL)
    assert state["step"] == 7 and state["model"] is target_net  # plain values come back into the caller's dict


# ------------------------------------------------------------------ replica divergence


def _global_error(states, **kwargs):
    planners, plans = plan_ranks(states, **kwargs)
    with pytest.raises(dcp.PlanValidationError) as info:
        planners[0].build_global_plan(plans)
    return str(info.value)


def test_diverging_whole_tensors_fail_naming_key_and_ranks():
    states = [{"w": np.ones(4, np.float32), "same": np.zeros(3, np.float32)} for _ in range(3)]
    states[2]["w"] = np.full(4, 2, np.float32)
    text = _global_error(states)
    assert "'w': replicas differ between ranks (ranks [0, 1]; ranks [2] each agree)" in text
    assert "check_replicas=False" in text and "'same'" not in text


def test_diverging_dtensor_replicas_fail_and_switch_turns_it_off():
    layout = Layout((2, 2), (-1, 1))  # mesh dim 1 replicates
    states = [{"w": DTensor.from_global(FULL, layout, rank=r)} for r in range(4)]
    planners, plans = plan_ranks(states)
    planners[0].build_global_plan(plans)  # equal replicas pass
    states[3] = {"w": DTensor(np.asarray(states[3]["w"].to_local()) + 1, layout, FULL.shape, rank=3)}
    assert "'w' (chunk at offset [0, 2]): replicas differ between ranks (ranks [2]; ranks [3]" in _global_error(states)
    planners, plans = plan_ranks(states, check_replicas=False)
    planners[0].build_global_plan(plans)


def test_digests_only_where_replicas_can_exist():
    split = Layout((2,), (0, -1))
    states = [{"s": DTensor.from_global(FULL, split, rank=r), "r": FULL} for r in range(2)]
    _, plans = plan_ranks(states)
    by_key = {item.index.fqn: item.tensor_data.replica_digest for item in plans[0].items}
    assert by_key["s"] is None and by_key["r"] is not None
    _, single = plan_ranks([{"r": FULL}])
    assert single[0].items[0].tensor_data.replica_digest is None


# ------------------------------------------------------------------ whole Parameters under a strategy file


def test_whole_parameter_split_by_a_strategy_file_alone_is_refused(tmp_path):
    """Not marked sliced, whole [8, 4], the file splits its rows: saving it would store a [16, 4] tensor."""
    path = _row_strategy(tmp_path)
    for rank in (0, 1):  # every rank holds the whole tensor: the plan would cover a [16, 4] tensor and pass
        with pytest.raises(dcp.SlicedParameterError, match=rf"rank {rank}: key 'model.w'.*global shape \(16, 4\)"):
            apply_mindspore_layouts({"model": Net(rows=8, fill=FULL)}, source=path, rank=rank)
    net = Net(rows=8, fill=FULL)  # never compiled: MindSpore would have set w.sliced with its slice
    for save in (lambda: dcp.save({"model": net}, checkpoint_id=tmp_path / "c", no_dist=True, strategy_file=path),
                 lambda: hyper_parallel.save_checkpoint(net, tmp_path / "c", strategy_file=path)):
        with pytest.raises(dcp.SlicedParameterError) as info:
            save()
        text = str(info.value)
        assert "rank 0:" in text and "(Parameter 'w', shape (8, 4))" in text and repr(str(path)) in text, text
        assert "global shape (16, 4)" in text and "Parameter.sliced = True" in text, text
        assert "'b'" not in text  # replicated by the file: whole either way
        assert not (tmp_path / "c").exists()
    dcp.save({"model": Net(rows=8, fill=FULL)}, checkpoint_id=tmp_path / "whole", no_dist=True)
    with pytest.raises(dcp.SlicedParameterError, match=r"key 'model.w' \(Parameter 'w', shape \(8, 4\)\)"):
        dcp.load({"model": Net(rows=8)}, checkpoint_id=tmp_path / "whole", no_dist=True, strategy_file=path)
    assert hyper_parallel.load_checkpoint(tmp_path / "whole")["model.w"].shape == (8, 4)


def test_marked_slice_under_a_strategy_file_keeps_its_global_shape(tmp_path):
    path = _row_strategy(tmp_path)
    net = Net(rows=4, sliced=True, fill=FULL[:4])
    state = apply_mindspore_layouts({"model": net}, source=path, rank=0)
    assert state["model"]["w"].shape == (8, 4) and state["model"]["b"].shape == (4,)
    moment = ms.Parameter(ms.Tensor(FULL.copy()), name="moment1.w")  # whole, though its Parameter is a slice
    with pytest.raises(dcp.SlicedParameterError, match=r"rank 0: key 'opt.moment1.w' \(Parameter 'moment1.w', sha"):
        apply_mindspore_layouts({"model": net, "opt": {"moment1.w": moment}}, source=path, rank=0)
    net.w.set_data(ms.Tensor(FULL[4:].copy()))  # MindSpore clears the mark: the refusal says how to keep it
    with pytest.raises(dcp.SlicedParameterError, match=r"set_data\(data\) clears the mark: pass slice_shape=True"):
        apply_mindspore_layouts({"model": net}, source=path, rank=0)
    net.w.set_data(ms.Tensor(FULL[4:].copy()), slice_shape=True)
    assert apply_mindspore_layouts({"model": net}, source=path, rank=1)["model"]["w"].global_offset == (4, 0)
    whole = Net(rows=8, fill=FULL)
    whole.w.sliced = True  # the caller says it is this rank's slice: its layout is taken as given
    assert apply_mindspore_layouts({"model": whole}, source=path, rank=0)["model"]["w"].shape == (16, 4)


def test_the_refusal_names_where_the_splitting_layout_came_from(tmp_path):
    path = _row_strategy(tmp_path)
    sources = {"the mapping given as strategy_file=": {"w": Layout((2,), (0, -1))},
               f"strategy files {[str(path)]!r}": [path],
               "its Cell's parameter_layout_dict": None}
    for origin, source in sources.items():
        net = Net(rows=8, fill=FULL)
        if source is None:  # an entry without its slice shape: nothing to compare the shape with
            net.parameter_layout_dict = {"w": [[2], [0, -1], [], 0, True, ""]}
        with pytest.raises(dcp.SlicedParameterError) as info:
            apply_mindspore_layouts({"model": net}, source=source, rank=1)
        assert f"but the layout of {origin} splits it" in str(info.value), str(info.value)


def _blocks_net(rank):
    """Rank ``rank``'s [4, 4] block of an [8, 8] ``w`` compiled as dev (2, 2), map (1, 0), as MindSpore marks it."""
    full = np.arange(64, dtype=np.float32).reshape(8, 8)
    row, col = divmod(rank, 2)
    net = Net(rows=4, cols=4, sliced=True, fill=full[row * 4:row * 4 + 4, col * 4:col * 4 + 4])
    net.parameter_layout_dict = {"w": [[2, 2], [1, 0], [4, 4], 0, True, "", [8, 8], [4, 4]]}
    return net, full


def test_a_strategy_file_placing_slices_elsewhere_than_the_compile_is_refused(tmp_path):
    """strategy_file= overrides a Cell's parameter_layout_dict; one of another compile with the same slice shapes
    (blocks as (0, 1) instead of (1, 0)) saved ranks 1 and 2's blocks at each other's places, silently. Refused on
    the ranks it misplaces, naming both places; a file that agrees is used, and the save is exact."""
    stale = write_strategy_file(tmp_path / "stale.ckpt", (ParamStrategy("w", (2, 2), (0, 1)),))
    good = write_strategy_file(tmp_path / "good.ckpt", (ParamStrategy("w", (2, 2), (1, 0)),))
    for rank in range(4):
        net, _ = _blocks_net(rank)
        if rank in (1, 2):
            with pytest.raises(dcp.SlicedParameterError) as refused:
                apply_mindspore_layouts({"model": net}, source=stale, rank=rank)
            text = str(refused.value)
            assert "key 'model.w'" in text and "stale.ckpt" in text and f"rank {rank}" in text, text
            assert "offset (4, 0)" in text and "offset (0, 4)" in text and "parameter_layout_dict" in text, text
        else:  # the diagonal blocks sit alike under both
            assert apply_mindspore_layouts({"model": net}, source=stale, rank=rank)["model"]["w"].to_local() is net.w
    states = [apply_mindspore_layouts({"model": _blocks_net(rank)[0]}, source=good, rank=rank) for rank in range(4)]
    simulate_save(states, tmp_path / "c")
    assert np.array_equal(hyper_parallel.load_checkpoint(str(tmp_path / "c"))["model.w"].asnumpy(), _blocks_net(0)[1])
    mapping = {"w": Layout((2, 2), (0, 1))}  # a {name: Layout} mapping is compared alike
    with pytest.raises(dcp.SlicedParameterError, match="the mapping given as strategy_file="):
        apply_mindspore_layouts({"model": _blocks_net(1)[0]}, source=mapping, rank=1)
    for layout in (Layout((2,), (0,)), Layout((2,), (0, -1), rank_list=(2, 3))):  # another rank count, other ranks
        with pytest.raises(dcp.SlicedParameterError, match="at no place"):
            apply_mindspore_layouts({"model": _blocks_net(1)[0]}, source={"w": layout}, rank=1)


def test_sliced_parameters_named_with_another_prefix_than_the_strategy_are_refused_naming_it(tmp_path):
    """A strategy file whose names differ from the sliced Parameters' by one prefix (``network.``) said "no layout
    is known ... pass strategy_file=" to a user who had passed it. The prefix is named now, either way."""
    weight = ms.Parameter(ms.Tensor(np.zeros((4, 4), np.float32)), name="dense.w")
    weight.sliced = True
    prefixed = write_strategy_file(tmp_path / "prefixed.ckpt", (ParamStrategy("network.dense.w", (2,), (0, -1)),))
    with pytest.raises(dcp.SlicedParameterError) as refused:
        hyper_parallel.save_checkpoint({"w": weight}, tmp_path / "c", strategy_file=prefixed)
    assert str(refused.value) == (
        f"rank 0: key(s) 'w' (Parameter 'dense.w') hold a slice (Parameter.sliced is True) but strategy file "
        f"{prefixed!r} has no layout under their names: its names differ from theirs by the prefix 'network.' (the "
        "Parameter 'dense.w', the strategy 'network.dense.w'), so saving them as whole tensors would lose the other "
        "ranks' parts. Pass the strategy file of the compile that sliced this network (MindSpore names a Parameter "
        "the same however a Cell wraps it), or leave strategy_file= out and pass the Cell (its "
        "parameter_layout_dict holds the layouts)")
    assert not (tmp_path / "c").exists()
    bare = write_strategy_file(tmp_path / "bare.ckpt", (ParamStrategy("w", (2,), (0, -1)),))
    wrapped = ms.Parameter(ms.Tensor(np.zeros((4, 4), np.float32)), name="backbone.w")
    wrapped.sliced = True
    with pytest.raises(dcp.SlicedParameterError, match=r"key\(s\) 'p' \(Parameter 'backbone\.w'\) hold a slice .* "
                                                       r"by the prefix 'backbone\.' \(the Parameter 'backbone\.w', "
                                                       r"the strategy 'w'\)"):
        apply_mindspore_layouts({"p": wrapped}, source=bare, rank=0)
    other = write_strategy_file(tmp_path / "other.ckpt", (ParamStrategy("proj.w", (2,), (0, -1)),))
    with pytest.raises(dcp.SlicedParameterError, match="but no layout is known"):  # no one prefix: as before
        apply_mindspore_layouts({"p": wrapped}, source=other, rank=0)
