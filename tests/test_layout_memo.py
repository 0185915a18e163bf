"""A save repeating the last save's MindSpore tensors skips its layout pass (``_layout_memo``), and any change to
the state (``set_data``, ``set_dtype``, a new shape, a replaced Parameter, keys added, removed, renamed or moved,
a layout from a strategy file) walks it again: the checkpoint always holds what the state holds at the call."""

from __future__ import annotations

import gc
import weakref

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import Layout
from hyper_parallel.core.distributed_checkpoint import _layout_memo
from hyper_parallel.core.distributed_checkpoint._flatten import flatten_state_dict
from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import apply_mindspore_layouts
from hyper_parallel.core.distributed_checkpoint._save_layout import LayoutDescription
from hyper_parallel.core.distributed_checkpoint._copy_threads import SMALL_COPY_BYTES
from hyper_parallel.core.distributed_checkpoint._stage_copies import EarlyCopies
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner
from hyper_parallel.platform.tensor import DEVICE_COPIES_ENV

ms.set_device("CPU")


def _state(seed: int = 0) -> dict:
    """Small and large (copied ahead) Parameters, float32 and bfloat16."""
    rng = np.random.default_rng(seed)
    shapes = [(300, 1024), (7, 5), (5,), (600, 512), (3, 3)]
    return {f"p{i}": ms.Parameter(ms.Tensor(rng.standard_normal(shape).astype(np.float32),
                                            ms.bfloat16 if i % 2 else ms.float32), name=f"p{i}")
            for i, shape in enumerate(shapes)}


def _values(state: dict) -> dict:
    return {name: p.asnumpy().copy() for name, p in state.items()}


def _assert_saved(path, expected: dict) -> None:
    loaded = hyper_parallel.load_checkpoint(path)
    assert sorted(loaded) == sorted(expected)
    for name, value in expected.items():
        got = loaded[name].asnumpy()
        assert got.dtype == value.dtype and got.shape == value.shape, name
        np.testing.assert_array_equal(got.view(np.uint8), value.view(np.uint8), err_msg=name)


def _async(state: dict, path) -> None:
    dcp.async_save(state, checkpoint_id=path, no_dist=True).result(timeout=120)


def _described(state: dict, world_size: int = 1):
    planner = StandardSavePlanner()
    planner.configure_planner(state, world_size=world_size)
    return planner, planner.describe_layout()


def test_a_repeated_pass_is_recalled_and_saves_the_values_at_the_call(tmp_path):
    state = _state()
    _, first = _described(state)
    planner, again = _described(state)
    assert again is first, "the second pass was recalled"
    assert all(planner.leaf_arrays[name] is p.asnumpy().base or planner.leaf_arrays[name].ctypes.data == p.data_ptr()
               for name, p in state.items())
    _async(state, tmp_path / "a")
    for p in state.values():  # in place: the same memory, so the memo still holds
        view = p.asnumpy()
        view[...] = view[::-1] if view.ndim else view
    assert _layout_memo.recall(flatten_state_dict(state).values) is not None
    expected = _values(state)
    _async(state, tmp_path / "b")
    _assert_saved(tmp_path / "b", expected)


def _set_data(state):
    state["p1"].set_data(ms.Tensor(np.full((7, 5), 3.5, np.float32), ms.bfloat16))


def _set_dtype(state):
    state["p3"].set_dtype(ms.float16)


def _bitcast(state):  # the same memory and shape, another dtype (MindSpore 2.10 keeps data_ptr; asnumpy copies)
    state["p0"].assign_value(state["p0"].view(ms.int32))


def _transposed(state):  # the same memory, shape and dtype, read column-wise (MindSpore 2.10 keeps data_ptr)
    state["p4"].assign_value(state["p4"].T)


def _new_shape(state):
    state["p2"].set_data(ms.Tensor(np.arange(6, dtype=np.float32)))


def _replaced(state):
    state["p0"] = ms.Parameter(ms.Tensor(np.full((300, 1024), 2.0, np.float32)), name="p0")


def _added(state):
    state["q"] = ms.Parameter(ms.Tensor(np.ones((2, 2), np.float32)), name="q")


def _removed(state):
    del state["p2"]


def _moved(state):
    state["p0"] = state.pop("p0")


def _renamed(state):
    state["r"] = state.pop("p4")


@pytest.mark.parametrize("change", [_set_data, _set_dtype, _bitcast, _transposed, _new_shape, _replaced, _added, _removed, _moved, _renamed])
def test_every_change_walks_the_state_again(tmp_path, change):
    state = _state(1)
    _async(state, tmp_path / "a")
    assert _layout_memo.recall(flatten_state_dict(state).values) is not None
    change(state)
    assert _layout_memo.recall(flatten_state_dict(state).values) is None
    expected = _values(state)
    _async(state, tmp_path / "b")
    _assert_saved(tmp_path / "b", expected)
    _async(state, tmp_path / "c")  # and the changed state is recalled from then on
    recalled = _layout_memo.recall(flatten_state_dict(state).values)
    # a bitcast or transposed tensor is copied out (no view of its own memory)
    assert recalled is None if change in (_bitcast, _transposed) else recalled is not None
    _assert_saved(tmp_path / "c", expected)


def test_values_beside_the_tensors_are_checked_each_save(tmp_path):
    state = _state(6)
    state["steps_per_epoch"] = 100  # as CheckpointCallback saves with every step
    state["meta"] = {"lr": 0.5, "tag": "run-a"}
    _, first = _described(state)
    _, again = _described(state)
    assert again is first, "tensors and values alike: recalled"
    _async(state, tmp_path / "a")
    state["meta"]["lr"] = 0.25  # a new value is a new layout: walked again, and saved
    _, changed = _described(state)
    assert changed is not first and changed.digest != first.digest
    expected = _values({k: v for k, v in state.items() if isinstance(v, ms.Parameter)})
    _async(state, tmp_path / "b")
    target = {**_state(7), "steps_per_epoch": 0, "meta": {"lr": 0.0, "tag": ""}}
    dcp.load(target, checkpoint_id=tmp_path / "b", no_dist=True)
    assert target["steps_per_epoch"] == 100 and target["meta"] == {"lr": 0.25, "tag": "run-a"}
    for name, value in expected.items():
        np.testing.assert_array_equal(target[name].asnumpy().view(np.uint8), value.view(np.uint8), err_msg=name)
    state["steps_per_epoch"] = ms.Parameter(ms.Tensor(np.ones(2, np.float32)), name="steps_per_epoch")
    _, as_tensor = _described(state)  # a value turned tensor under the same name
    assert as_tensor is not changed and as_tensor.pieces == changed.pieces + 1


def test_a_layout_from_a_strategy_file_is_not_recalled(tmp_path):
    state = {"w": ms.Parameter(ms.Tensor(np.arange(16, dtype=np.float32).reshape(4, 4)), name="w")}
    _async(state, tmp_path / "a")
    layouts = {"w": Layout((2,), (-1, -1))}  # replicated: the same bytes, but a DTensor leaf
    wrapped = apply_mindspore_layouts(state, source=layouts, rank=0)
    assert wrapped is not state and _layout_memo.recall(flatten_state_dict(wrapped).values) is None
    dcp.async_save(state, checkpoint_id=tmp_path / "b", no_dist=True, strategy_file=layouts).result(timeout=60)
    _assert_saved(tmp_path / "b", _values(state))


def test_a_parameter_marked_sliced_after_a_save_is_still_refused(tmp_path):
    state = _state(5)
    _async(state, tmp_path / "a")
    state["p1"].sliced = True  # a slice of this rank with no layout known: saving it whole would lose the others
    with pytest.raises(dcp.SlicedParameterError, match="p1"):
        dcp.async_save(state, checkpoint_id=tmp_path / "b", no_dist=True)


def test_the_memo_keeps_no_tensor_alive():
    state = _state(2)
    _described(state)
    refs = [weakref.ref(p) for p in state.values()]
    del state
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_states_it_cannot_vouch_for_are_not_remembered(monkeypatch):
    _layout_memo.forget()
    arrays = {"a": np.ones((4, 4), np.float32), "b": np.zeros(3, np.int32)}
    _described(arrays)
    assert not _layout_memo._MEMOS  # pylint: disable=protected-access
    _described({**_state(8), "a": np.ones((4, 4), np.float32)})  # a numpy leaf among Parameters
    assert not _layout_memo._MEMOS  # pylint: disable=protected-access
    whole = {"w": ms.Parameter(ms.Tensor(np.ones((4, 4), np.float32)), name="w"), **_state(9)}
    _described(apply_mindspore_layouts(whole, source={"w": Layout((2,), (-1, -1))}, rank=0))  # a DTensor leaf
    assert not _layout_memo._MEMOS  # pylint: disable=protected-access
    param = ms.Parameter(ms.Tensor(np.ones((2, 2), np.float32)), name="w")
    _described({"x": param, "y": {"again": param}})  # an alias
    assert not _layout_memo._MEMOS  # pylint: disable=protected-access
    state = _state(3)
    _described(state, world_size=2)  # replica digests depend on the values
    assert not _layout_memo._MEMOS  # pylint: disable=protected-access
    _described(state)
    assert _layout_memo.recall(flatten_state_dict(state).values) is not None
    monkeypatch.setenv(DEVICE_COPIES_ENV, "1")  # tensors copied out as from a device: no view to recall
    assert _layout_memo.recall(flatten_state_dict(state).values) is None


def test_prepare_makes_the_pass_the_first_save_recalls(tmp_path):
    _layout_memo.forget()
    state = _state(4)
    dcp.prepare_async_save(state).result(timeout=60)
    planner, layout = _described(state)
    assert _layout_memo.recall(flatten_state_dict(state).values)[0].layout is layout
    expected = _values(state)
    _async(state, tmp_path / "a")
    _assert_saved(tmp_path / "a", expected)


def test_prepare_of_a_state_the_pass_refuses_still_prepares():
    _layout_memo.forget()
    state = {"w": ms.Parameter(ms.Tensor(np.ones((2, 2), np.float32)), name="w"), "bad": object()}
    assert dcp.prepare_async_save(state).result(timeout=60) >= 0
    assert not _layout_memo._MEMOS  # pylint: disable=protected-access


def test_small_leaves_copied_ahead_under_their_name_take_the_per_leaf_path():
    arena = np.zeros(8 << 20, np.uint8)
    big = np.arange(SMALL_COPY_BYTES, dtype=np.uint8)
    small = np.full(64, 7, np.uint8)
    copies = EarlyCopies(arena, None, lambda nbytes: arena, ahead=[("s", big)])
    copies.leaves(["s"], [small], [small.nbytes])  # "s" was copied ahead as a large leaf: that copy is missed
    assert copies.missed == 1
    copies.described(LayoutDescription(digest="", replica_digests=(), tensor_bytes=small.nbytes, pieces=1))
    copies.wait()
    offset, nbytes = copies.placed["s"]
    np.testing.assert_array_equal(arena[offset:offset + nbytes], small)


def test_scalars_beside_the_parameters_flatten_at_once_as_the_walk_does(monkeypatch):
    """A CheckpointCallback state (Parameters plus the steps per epoch) takes the column flattening; the same
    scalar object under two keys (ids alike) takes the walk. Either way the result is the walk's."""
    from hyper_parallel.core.distributed_checkpoint import _flatten  # pylint: disable=import-outside-toplevel

    params = _state(10)
    states = [{**params, "steps_per_epoch": 100, "lr": 0.5, "tag": "a", "flag": True, "none": None},
              {"n": 7, **params, "m": 7}, {"only": 3}]
    fast = [_flatten.flatten_state_dict(state) for state in states]
    assert _flatten._top_level_parameters(states[0], _flatten.FlatStateDict(values={}, paths={}, containers={}))
    monkeypatch.setattr(_flatten, "_top_level_parameters", lambda state_dict, flat: False)
    for state, flat in zip(states, fast):
        walked = _flatten.flatten_state_dict(state)
        assert flat == walked and list(flat.values) == list(walked.values) == list(state)



def test_two_states_saved_in_turn_are_both_recalled_and_each_still_misses_its_changes(tmp_path):
    """A model's and an optimizer's state saved in turn: each save recalls its own pass; a third state pushes
    out the oldest; a change to either state is still seen."""
    _layout_memo.forget()
    model, optimizer = _state(20), {f"m.{name}": p for name, p in _state(21).items()}
    first_model, first_optimizer = _described(model)[1], _described(optimizer)[1]
    for step in range(2):
        assert _layout_memo.recall(flatten_state_dict(model).values)[0].layout is first_model, step
        assert _layout_memo.recall(flatten_state_dict(optimizer).values)[0].layout is first_optimizer, step
        expected = {**_values(model), **_values(optimizer)}
        _async(model, tmp_path / f"model{step}")
        _async(optimizer, tmp_path / f"optimizer{step}")
        _assert_saved(tmp_path / f"model{step}", {k: v for k, v in expected.items() if not k.startswith("m.")})
        _assert_saved(tmp_path / f"optimizer{step}", {k: v for k, v in expected.items() if k.startswith("m.")})
    model["p1"].set_data(ms.Tensor(np.full((7, 5), 3, np.float32), ms.bfloat16))
    assert _layout_memo.recall(flatten_state_dict(model).values) is None, "new memory: missed"
    assert _layout_memo.recall(flatten_state_dict(optimizer).values) is not None
    expected = _values(model)
    _async(model, tmp_path / "changed")
    _assert_saved(tmp_path / "changed", expected)
    third = {f"x.{name}": p for name, p in _state(22).items()}
    _described(third)
    assert _layout_memo.recall(flatten_state_dict(third).values) is not None
    assert _layout_memo.recall(flatten_state_dict(model).values) is not None, "the model's pass was the newer"
    assert _layout_memo.recall(flatten_state_dict(optimizer).values) is None, "the oldest was pushed out"
    _layout_memo.forget()
