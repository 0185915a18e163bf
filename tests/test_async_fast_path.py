"""The fast path of a repeated async save: cached plan, cached arena offsets, values at call time.

A save whose layout (keys, shapes, dtypes, shardings, values) repeats the
previous save's reuses its plan without building a local plan, and stages
into the arena at the previous offsets. These tests change the tensors right
after ``async_save`` returns and check that the checkpoint holds the values
of the call, and that any change of the layout (one shape, one dtype, one
sharding, a value) re-plans and still saves correctly.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _async_engine
from hyper_parallel.core.distributed_checkpoint._plan_cache import STATS, clear_plan_cache
from hyper_parallel.core.distributed_checkpoint.mapping import ShardedTensor


def _param(name: str, shape: tuple[int, ...], value: float, dtype=ms.float32) -> ms.Parameter:
    return ms.Parameter(ms.Tensor(np.full(shape, value, np.float32), dtype), name=name)


def _state(value: float) -> dict:
    state = {f"p{i}": _param(f"p{i}", (3 + i % 4, 5), value + i, ms.bfloat16 if i % 2 else ms.float32)
             for i in range(12)}
    state["big"] = _param("big", (256, 1024), value)
    return state


def _values(path, like: dict) -> dict[str, np.ndarray]:
    target = {name: ms.Parameter(ms.Tensor(np.zeros(p.shape, np.float32), p.dtype), name=name)
              for name, p in like.items() if isinstance(p, ms.Parameter)}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    return {name: p.asnumpy().astype(np.float32) for name, p in target.items()}


def _mutate(state: dict, value: float) -> None:
    for param in state.values():
        if isinstance(param, ms.Parameter):
            param.asnumpy()[...] = value


@pytest.mark.parametrize("staging", ["copy", "fork"])
def test_repeated_layout_reuses_plan_and_offsets_and_keeps_values_at_call(tmp_path, staging):
    clear_plan_cache()
    _async_engine._POOL.release()  # pylint: disable=protected-access
    state = _state(1.0)
    reused, exchanged = STATS.reused, STATS.exchanged
    layouts = _async_engine._POOL.layouts_reused  # pylint: disable=protected-access
    for step in range(3):
        _mutate(state, float(step + 1))
        handle = dcp.async_save(state, checkpoint_id=tmp_path / f"s{step}", no_dist=True, staging=staging)
        _mutate(state, -99.0)  # the caller may change its tensors at once
        handle.result()
    assert (STATS.reused - reused, STATS.exchanged - exchanged) == (2, 1)
    if staging == "copy":  # the second and third saves stage at the first one's offsets
        assert _async_engine._POOL.layouts_reused - layouts == 2  # pylint: disable=protected-access
    for step in range(3):
        found = _values(tmp_path / f"s{step}", state)
        assert sorted(found) == sorted(state)
        for name, values in found.items():
            assert np.all(values == float(step + 1)), (step, name, values.ravel()[:4])


def test_a_replaced_parameter_of_the_same_layout_is_saved_from_its_new_memory(tmp_path):
    clear_plan_cache()
    state = _state(1.0)
    dcp.async_save(state, checkpoint_id=tmp_path / "a", no_dist=True).result()
    state["big"] = _param("big", (256, 1024), 7.0)  # a new object, same shape and dtype: the plan is reused
    state["p3"].set_data(ms.Tensor(np.full((6, 5), 8.0, np.float32), ms.bfloat16))
    reused = STATS.reused
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "b", no_dist=True)
    state["big"].asnumpy()[...] = 0.0
    handle.result()
    assert STATS.reused == reused + 1
    found = _values(tmp_path / "b", state)
    assert np.all(found["big"] == 7.0) and np.all(found["p3"] == 8.0) and np.all(found["p0"] == 1.0)


@pytest.mark.parametrize("change", ["shape", "dtype", "key", "value"])
def test_a_changed_layout_replans_and_saves_the_new_state(tmp_path, change):
    clear_plan_cache()
    state = _state(1.0)
    state["step"] = 1
    dcp.async_save(state, checkpoint_id=tmp_path / "a", no_dist=True).result()
    if change == "shape":
        state["p5"] = _param("p5", (9, 5), 5.0, ms.bfloat16)
    elif change == "dtype":
        state["p5"] = _param("p5", tuple(state["p5"].shape), 5.0, ms.float32)
    elif change == "key":
        state["p5_renamed"] = state.pop("p5")
    else:
        state["step"] = 2
    exchanged = STATS.exchanged
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "b", no_dist=True)
    _mutate(state, -1.0)
    handle.result()
    assert STATS.exchanged == exchanged + 1, "a changed layout must never reuse the cached plan"
    metadata = dcp.FileSystemReader(tmp_path / "b").read_metadata()
    assert sorted(k for k in metadata.state_dict_metadata if k != "step") == sorted(
        k for k in state if k != "step")
    target = {"p5": _param("p5", (9, 5), 0.0, ms.bfloat16), "p5_renamed": _param("p5_renamed", (8, 5), 0.0),
              "step": 0}
    if change == "shape":
        target = {"p5": target["p5"]}
    elif change == "dtype":
        target = {"p5": _param("p5", tuple(state["p5"].shape), 0.0, ms.float32)}
    elif change == "key":
        target = {"p5_renamed": _param("p5_renamed", tuple(state["p5_renamed"].shape), 0.0, ms.bfloat16)}
    else:
        target = {"step": 0, "p5": _param("p5", tuple(state["p5"].shape), 0.0, ms.bfloat16)}
    dcp.load(target, checkpoint_id=tmp_path / "b", no_dist=True, planner=dcp.StandardLoadPlanner(
        allow_partial_load=True))
    expected = {"shape": ("p5", 5.0), "dtype": ("p5", 5.0), "key": ("p5_renamed", 6.0), "value": ("p5", 6.0)}[change]
    name, value = expected
    assert np.all(target[name].asnumpy().astype(np.float32) == value)
    assert target[name].dtype == (ms.float32 if change == "dtype" else ms.bfloat16)
    if change == "value":
        assert target["step"] == 2


def _halves(first: int, data_a: np.ndarray, data_b: np.ndarray) -> dict:
    """Two ShardedTensor leaves of one (4, 8) key: leaf 'a' at row ``first``, leaf 'b' in the other half."""
    other = 2 - first
    return {
        "a": ShardedTensor(key="x", data=data_a, dtype=None, local_shape=(2, 8), global_shape=(4, 8),
                           global_offset=(first, 0), axis_fragmentations=None),
        "b": ShardedTensor(key="x", data=data_b, dtype=None, local_shape=(2, 8), global_shape=(4, 8),
                           global_offset=(other, 0), axis_fragmentations=None),
    }


def test_a_changed_sharding_of_the_same_shapes_replans(tmp_path):
    clear_plan_cache()
    data_a, data_b = np.full((2, 8), 1.0, np.float32), np.full((2, 8), 2.0, np.float32)
    dcp.async_save(_halves(0, data_a, data_b), checkpoint_id=tmp_path / "a", no_dist=True).result()
    exchanged, reused = STATS.exchanged, STATS.reused
    dcp.async_save(_halves(0, data_a, data_b), checkpoint_id=tmp_path / "b", no_dist=True).result()
    assert (STATS.exchanged, STATS.reused) == (exchanged, reused + 1)
    handle = dcp.async_save(_halves(2, data_a, data_b), checkpoint_id=tmp_path / "c", no_dist=True)  # swapped
    data_a[...] = data_b[...] = 0.0
    handle.result()
    assert STATS.exchanged == exchanged + 1
    for name, rows in (("b", [1.0, 1.0, 2.0, 2.0]), ("c", [2.0, 2.0, 1.0, 1.0])):
        target = {"x": np.zeros((4, 8), np.float32)}
        dcp.load(target, checkpoint_id=tmp_path / name, no_dist=True)
        assert target["x"][:, 0].tolist() == rows, name


def test_sync_save_after_a_reused_plan_serves_every_leaf(tmp_path):
    clear_plan_cache()
    state = _state(1.0)
    state["flat"] = ShardedTensor(key="flat", data=np.arange(10, dtype=np.float32), dtype=None, local_shape=(2, 5),
                                  global_shape=(2, 5), global_offset=(0, 0), axis_fragmentations=None,
                                  flattened_range=slice(0, 10))
    dcp.save(state, checkpoint_id=tmp_path / "a", no_dist=True)
    reused = STATS.reused
    _mutate(state, 4.0)
    dcp.save(state, checkpoint_id=tmp_path / "b", no_dist=True)
    assert STATS.reused == reused + 1
    found = _values(tmp_path / "b", state)
    assert all(np.all(values == 4.0) for values in found.values())
    target = {"flat": np.zeros((2, 5), np.float32)}
    dcp.load(target, checkpoint_id=tmp_path / "b", no_dist=True, planner=dcp.StandardLoadPlanner(
        allow_partial_load=True))
    assert target["flat"].ravel().tolist() == list(range(10))


def test_first_call_maps_one_arena_sized_from_the_layout(tmp_path):
    pool = _async_engine._POOL  # pylint: disable=protected-access
    pool.release()
    clear_plan_cache()
    state = _state(3.0)
    arenas = pool.arenas
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "a", no_dist=True)
    _mutate(state, 0.0)
    handle.result()
    nbytes = sum(p.asnumpy().nbytes for p in state.values())
    assert pool.arenas == arenas + 1, "one arena, mapped once the layout is known (early copies), used by the staging"
    assert nbytes <= pool.capacity < nbytes + (4 << 20)
    assert all(np.all(v == 3.0 + (int(n[1:]) if n != "big" else 0)) for n, v in _values(tmp_path / "a", state).items())


def test_whole_tensors_are_copied_while_planning_and_keep_the_values_of_the_call(tmp_path):
    pool = _async_engine._POOL  # pylint: disable=protected-access
    pool.release()
    clear_plan_cache()
    state = _state(2.0)
    state["flat"] = ShardedTensor(key="flat", data=np.full(10, 9.0, np.float32), dtype=None, local_shape=(2, 5),
                                  global_shape=(2, 5), global_offset=(0, 0), axis_fragmentations=None,
                                  flattened_range=slice(0, 10))
    state["step"] = 3
    for step in range(2):  # the first call (fresh arena, no cached plan) and a reused plan
        copied, used = pool.early_copied, pool.early_items
        handle = dcp.async_save(state, checkpoint_id=tmp_path / f"s{step}", no_dist=True, staging="copy")
        _mutate(state, -5.0)
        state["flat"].data[...] = -5.0
        handle.result()
        assert (pool.early_copied - copied, pool.early_items - used) == (13, 13)  # every Parameter, none in vain
        found = _values(tmp_path / f"s{step}", state)
        assert all(np.all(v == (2.0 if step == 0 else -5.0) + (int(n[1:]) if n[0] == "p" and step == 0 else 0))
                   for n, v in found.items()), {n: v.ravel()[0] for n, v in found.items()}
        target = {"flat": np.zeros((2, 5), np.float32), "step": 0}
        dcp.load(target, checkpoint_id=tmp_path / f"s{step}", no_dist=True,
                 planner=dcp.StandardLoadPlanner(allow_partial_load=True))
        assert target["flat"].ravel().tolist() == [9.0 if step == 0 else -5.0] * 10 and target["step"] == 3


def test_a_state_outgrowing_the_arena_while_copied_early_is_staged_whole(tmp_path):
    pool = _async_engine._POOL  # pylint: disable=protected-access
    pool.release()
    clear_plan_cache()
    small = {"a": _param("a", (64, 64), 1.0)}
    dcp.async_save(small, checkpoint_id=tmp_path / "small", no_dist=True).result()
    capacity = pool.capacity
    grown = {"a": _param("a", (64, 64), 2.0)}  # copied early into the old arena, then the rest does not fit
    grown.update({f"b{i}": _param(f"b{i}", (512, 1024), 3.0 + i) for i in range(4)})
    handle = dcp.async_save(grown, checkpoint_id=tmp_path / "grown", no_dist=True)
    _mutate(grown, 0.0)
    handle.result()
    assert pool.capacity > capacity
    found = _values(tmp_path / "grown", grown)
    assert np.all(found["a"] == 2.0) and all(np.all(found[f"b{i}"] == 3.0 + i) for i in range(4))


def test_a_save_failing_after_early_copies_began_leaves_the_next_save_correct(tmp_path):
    clear_plan_cache()
    state = _state(1.0)
    dcp.async_save(state, checkpoint_id=tmp_path / "a", no_dist=True).result()
    state["zz_bad"] = np.zeros(4, np.complex64)  # met last: every Parameter was already being copied early
    with pytest.raises(dcp.UnsupportedTypeError, match="zz_bad"):
        dcp.async_save(state, checkpoint_id=tmp_path / "b", no_dist=True)
    del state["zz_bad"]
    _mutate(state, 6.0)
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "c", no_dist=True)
    _mutate(state, 0.0)
    handle.result()
    assert all(np.all(v == 6.0) for v in _values(tmp_path / "c", state).values())
