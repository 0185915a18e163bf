"""A first async save of one rank plans after it returns, from its snapshot (``_deferred_save``).

The blocking part takes the snapshot only (the early copies, or the fork);
the local plan, the merge and the metadata are made on the background
thread (``staging="copy"``) or in the forked writer (``staging="fork"``).
These tests change, replace and reshape the caller's tensors right after
``async_save`` returns and check that the checkpoint holds the values and
shapes of the call, bit-exact; that the plan is made off the caller's thread
and kept for the next save; that a planning failure is raised by
``result()`` and leaves the directory free; and that a state the snapshot
cannot stand for is planned in the blocking part as before.
"""

from __future__ import annotations

import errno
import os
import threading

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _async_engine
from hyper_parallel.core.distributed_checkpoint._plan_cache import STATS, clear_plan_cache
from hyper_parallel.core.distributed_checkpoint.mapping import ShardedTensor
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner


def _state() -> dict:
    rng = np.random.default_rng(7)
    state = {
        f"w{i}": ms.Parameter(ms.Tensor(rng.standard_normal((5 + i, 7)).astype(np.float32),
                                        ms.bfloat16 if i % 2 else ms.float32), name=f"w{i}")
        for i in range(9)
    }
    state["big"] = ms.Parameter(ms.Tensor(rng.standard_normal((512, 1024)).astype(np.float32)), name="big")
    state["scalar"] = ms.Parameter(ms.Tensor(np.float32(0.125)), name="scalar")  # 0-d
    state["ints"] = np.arange(10, dtype=np.int64)
    state["step"] = 41
    return state


def _snapshot(state: dict) -> dict:
    return {k: (v.asnumpy().copy() if isinstance(v, ms.Parameter) else v.copy() if isinstance(v, np.ndarray) else v)
            for k, v in state.items()}


def _load(path, like: dict) -> dict:
    """Load ``path`` into fresh targets shaped like ``like`` (numpy arrays: Parameters' values; other values)."""
    target = {}
    for key, value in like.items():
        if isinstance(value, np.ndarray):
            dtype = ms.bfloat16 if value.dtype.name == "bfloat16" else None
            target[key] = ms.Parameter(ms.Tensor(np.zeros(value.shape, np.float32), dtype or ms.float32), name=key) \
                if dtype is not None or key not in ("ints", "sharded") else np.zeros(value.shape, value.dtype)
        else:
            target[key] = None
    dcp.load(target, checkpoint_id=path, no_dist=True)
    return {k: (v.asnumpy() if isinstance(v, ms.Tensor) else v) for k, v in target.items()}


def _assert_saved(path, expected: dict) -> None:
    found = _load(path, expected)
    for key, value in expected.items():
        got = found[key]
        if isinstance(value, np.ndarray):
            assert got.shape == value.shape and got.dtype == value.dtype, (key, got.shape, got.dtype)
            assert got.tobytes() == value.tobytes(), key  # bit-exact
        else:
            assert got == value, key


def _where_plans(monkeypatch) -> list[tuple[int, str]]:
    """Record (process id, thread name) of every local plan this process builds."""
    seen: list[tuple[int, str]] = []
    original = StandardSavePlanner.build_local_plan

    def recorded(self):
        seen.append((os.getpid(), threading.current_thread().name))
        return original(self)

    monkeypatch.setattr(StandardSavePlanner, "build_local_plan", recorded)
    return seen


@pytest.mark.parametrize("staging", ["copy", "fork"])
def test_a_first_save_plans_off_the_caller_and_keeps_the_values_and_shapes_of_the_call(tmp_path, monkeypatch,
                                                                                       staging):
    clear_plan_cache()
    _async_engine._POOL.release()  # pylint: disable=protected-access
    seen = _where_plans(monkeypatch)
    state = _state()
    expected = _snapshot(state)
    exchanged, reused = STATS.exchanged, STATS.reused
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "first", no_dist=True, staging=staging)
    assert seen == [] or all(name != threading.current_thread().name for _, name in seen)
    # The caller changes everything at once: values in place, a Parameter reshaped, one replaced, a value.
    for value in state.values():
        if isinstance(value, ms.Parameter):
            value.asnumpy()[...] = -7
    state["w3"].set_data(ms.Tensor(np.ones((2, 2), np.float32), ms.bfloat16))
    state["big"] = ms.Parameter(ms.Tensor(np.zeros((3, 3), np.float32)), name="big")
    state["ints"][...] = 0
    handle.result()
    if staging == "fork":
        assert seen == []  # the forked writer planned; this process built no local plan
    else:
        assert len(seen) == 1 and seen[0][0] == os.getpid() and seen[0][1] != threading.current_thread().name
    assert STATS.exchanged - exchanged == 1
    _assert_saved(tmp_path / "first", expected)
    # The plan made after the call is cached: a save of the call's layout reuses it.
    again = _state()
    dcp.async_save(again, checkpoint_id=tmp_path / "second", no_dist=True, staging=staging).result()
    assert STATS.reused - reused == 1
    assert len(seen) == (0 if staging == "fork" else 1)
    _assert_saved(tmp_path / "second", _snapshot(again))


@pytest.mark.parametrize("staging", ["copy", "fork"])
def test_a_planning_failure_after_the_call_is_raised_by_result_and_frees_the_directory(tmp_path, monkeypatch,
                                                                                        staging):
    clear_plan_cache()
    state = _state()
    original = StandardSavePlanner.build_global_plan

    def failing(self, all_plans):
        raise dcp.PlanValidationError("injected: key 'w1' overlaps itself")

    monkeypatch.setattr(StandardSavePlanner, "build_global_plan", failing)
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "c", no_dist=True, staging=staging)
    with pytest.raises(dcp.CheckpointError, match="injected: key 'w1' overlaps itself"):
        handle.result()
    assert not (tmp_path / "c" / "metadata.json").exists()
    assert [p.name for p in (tmp_path / "c").glob(".*lease*")] == []  # the lease was released
    monkeypatch.setattr(StandardSavePlanner, "build_global_plan", original)
    dcp.async_save(state, checkpoint_id=tmp_path / "c", no_dist=True, staging=staging).result()
    _assert_saved(tmp_path / "c", _snapshot(state))


@pytest.mark.parametrize("staging", ["copy", "fork"])
def test_a_state_with_sharded_pieces_is_planned_before_the_call_returns(tmp_path, monkeypatch, staging):
    clear_plan_cache()
    seen = _where_plans(monkeypatch)
    full = np.arange(48, dtype=np.float32).reshape(8, 6)
    state = _state()
    state["sh_a"] = ShardedTensor.from_rank_offsets("sharded", full[:4].copy(), (0, 0, 2))
    state["sh_b"] = ShardedTensor.from_rank_offsets("sharded", full[4:].copy(), (0, 1, 2))
    expected = _snapshot({k: v for k, v in state.items() if not isinstance(v, ShardedTensor)})
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "s", no_dist=True, staging=staging)
    assert seen == [(os.getpid(), threading.current_thread().name)]  # planned in the blocking part
    state["sh_a"].data[...] = -1
    handle.result()
    expected["sharded"] = full
    _assert_saved(tmp_path / "s", expected)


@pytest.mark.parametrize("cached", [False, True])
def test_a_fork_that_fails_raises_at_the_call_names_the_fix_and_frees_the_directory(tmp_path, monkeypatch, cached):
    clear_plan_cache()
    state = _state()
    if cached:  # the plan is cached: the fork happens after planning (the steady path)
        dcp.async_save(state, checkpoint_id=tmp_path / "warm", no_dist=True, staging="fork").result()

    def no_fork():
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(os, "fork", no_fork)
    with pytest.raises(dcp.CheckpointIOError, match=r"rank 0: cannot fork .*Cannot allocate memory.*staging='copy'"):
        dcp.async_save(state, checkpoint_id=tmp_path / "f", no_dist=True, staging="fork")
    assert not (tmp_path / "f" / "metadata.json").exists()
    assert not (tmp_path / "f").exists() or list((tmp_path / "f").glob(".*lease*")) == []  # the lease is released
    dcp.async_save(state, checkpoint_id=tmp_path / "f", no_dist=True, staging="copy").result()
    _assert_saved(tmp_path / "f", _snapshot(state))


def test_a_fork_with_a_writer_subclass_is_planned_before_the_call_returns(tmp_path, monkeypatch):
    class StampingWriter(dcp.FileSystemWriter):
        """A writer whose global plan step is its own (it might keep state a forked process would not share)."""

        def prepare_global_plan(self, plans):
            return super().prepare_global_plan(plans)

    clear_plan_cache()
    seen = _where_plans(monkeypatch)
    state = _state()
    expected = _snapshot(state)
    handle = dcp.async_save(state, storage_writer=StampingWriter(tmp_path / "w"), no_dist=True, staging="fork")
    assert seen == [(os.getpid(), threading.current_thread().name)]  # planned in the blocking part
    state["big"].asnumpy()[...] = -3
    handle.result()
    _assert_saved(tmp_path / "w", expected)

