"""``async_save(staging="auto")``: a first call of one rank snapshots by fork, later calls copy (the default is "copy").

The first async save of a process has no staging arena: copying into fresh
memory costs its page faults. ``"auto"`` takes the fork's copy-on-write
snapshot instead (when safe: the filesystem writer, the standard planner),
and the background work maps and faults in the arena the next save copies
into. These tests count the forks, change the caller's tensors right after
each call returns and check the checkpoints bit-exact; a refused fork falls
back to copying; a writer subclass is never forked for.
"""

from __future__ import annotations

import errno
import os

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _async_engine
from hyper_parallel.core.distributed_checkpoint._plan_cache import STATS, clear_plan_cache

ms.set_device("CPU")


def _state(base: float) -> dict:
    rng = np.random.default_rng(3)
    state = {f"w{i}": ms.Parameter(ms.Tensor(rng.standard_normal((9 + i, 33)).astype(np.float32) + base,
                                             ms.bfloat16 if i % 2 else ms.float32), name=f"w{i}")
             for i in range(6)}
    state["big"] = ms.Parameter(ms.Tensor(np.full((256, 1024), base, np.float32)), name="big")
    state["step"] = 7  # a changed value would change the layout (no cached plan)
    return state


def _expected(state: dict) -> dict:
    return {k: (v.asnumpy().copy() if isinstance(v, ms.Parameter) else v) for k, v in state.items()}


def _scramble(state: dict) -> None:
    """What training does right after ``async_save`` returns: values change, a Parameter is reshaped."""
    for value in state.values():
        if isinstance(value, ms.Parameter):
            value.asnumpy()[...] = -9
    state["w0"].set_data(ms.Tensor(np.ones((2, 2), np.float32)))


def _assert_saved(path, expected: dict) -> None:
    target = {k: (ms.Parameter(ms.Tensor(np.zeros(v.shape, np.float32), ms.bfloat16 if v.dtype.name == "bfloat16"
                                         else ms.float32), name=k) if isinstance(v, np.ndarray) else None)
              for k, v in expected.items()}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    for key, value in expected.items():
        if isinstance(value, np.ndarray):
            got = target[key].asnumpy()
            assert got.shape == value.shape and got.tobytes() == value.tobytes(), key  # bit-exact
        else:
            assert target[key] == value, key


@pytest.fixture(name="forks")
def _forks(monkeypatch) -> list[int]:
    """Count the forks this process makes (the real ``os.fork`` runs)."""
    made: list[int] = []
    real = os.fork

    def counted() -> int:
        made.append(1)
        return real()

    monkeypatch.setattr(os, "fork", counted)
    return made


@pytest.mark.parametrize("cached", [False, True])
def test_a_first_call_forks_and_the_next_ones_copy_into_the_arena_it_faulted_in(tmp_path, forks, cached):
    clear_plan_cache()
    pool = _async_engine._POOL  # pylint: disable=protected-access
    if cached:  # a plan of this layout is cached: the fork follows the planning (the planned path)
        dcp.async_save(_state(0.0), checkpoint_id=tmp_path / "warm", no_dist=True, staging="fork").result()
        forks.clear()
    pool.release()
    arenas, reused = pool.arenas, STATS.reused
    state = _state(1.0)
    expected = _expected(state)
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "first", no_dist=True, staging="auto")
    _scramble(state)
    handle.result()
    assert len(forks) == 1, "a first call without an arena takes the fork's snapshot"
    assert STATS.reused - reused == (1 if cached else 0)
    nbytes = sum(v.nbytes for v in expected.values() if isinstance(v, np.ndarray))
    assert pool.arenas == arenas + 1 and nbytes <= pool.capacity < nbytes + (4 << 20), "faulted in for the next save"
    _assert_saved(tmp_path / "first", expected)
    allocated = pool.allocated
    for step in range(2):  # the next calls copy into that arena (no fork, no new arena, the cached plan)
        state = _state(2.0 + step)
        expected = _expected(state)
        handle = dcp.async_save(state, checkpoint_id=tmp_path / f"next{step}", no_dist=True, staging="auto")
        _scramble(state)
        handle.result()
        _assert_saved(tmp_path / f"next{step}", expected)
    assert len(forks) == 1 and pool.arenas == arenas + 1 and pool.allocated == allocated
    assert STATS.reused - reused == (3 if cached else 2)


@pytest.mark.parametrize("cached", [False, True])
def test_a_refused_fork_falls_back_to_copying(tmp_path, monkeypatch, cached):
    clear_plan_cache()
    pool = _async_engine._POOL  # pylint: disable=protected-access
    if cached:
        dcp.async_save(_state(0.0), checkpoint_id=tmp_path / "warm", no_dist=True, staging="fork").result()
    pool.release()

    def no_fork() -> int:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(os, "fork", no_fork)
    state = _state(5.0)
    expected = _expected(state)
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "c", no_dist=True, staging="auto")
    _scramble(state)
    handle.result()
    _assert_saved(tmp_path / "c", expected)
    assert pool.capacity > 0  # staged by copying
    with pytest.raises(dcp.CheckpointIOError, match="cannot fork"):  # an explicit fork still says so
        pool.release()
        dcp.async_save(_state(6.0), checkpoint_id=tmp_path / "f", no_dist=True, staging="fork")


def test_a_writer_subclass_is_copied_not_forked_and_an_unknown_staging_is_refused(tmp_path, forks):
    class OwnWriter(dcp.FileSystemWriter):
        """A writer of the user's: its ``write_data`` might not survive a fork."""

    clear_plan_cache()
    _async_engine._POOL.release()  # pylint: disable=protected-access
    state = _state(7.0)
    expected = _expected(state)
    handle = dcp.async_save(state, storage_writer=OwnWriter(tmp_path / "own"), no_dist=True, staging="auto")
    _scramble(state)
    handle.result()
    assert forks == []
    _assert_saved(tmp_path / "own", expected)
    with pytest.raises(dcp.CheckpointValueError, match="'auto', 'copy' or 'fork'"):
        dcp.async_save(state, checkpoint_id=tmp_path / "x", no_dist=True, staging="pinned")


def test_a_failed_prefault_only_leaves_the_next_save_to_map_its_arena(tmp_path, monkeypatch):
    clear_plan_cache()
    pool = _async_engine._POOL  # pylint: disable=protected-access
    pool.release()

    def no_memory(_nbytes: int) -> None:
        raise MemoryError("no memory for the staging arena")

    monkeypatch.setattr(pool, "prefault", no_memory)
    state = _state(8.0)
    expected = _expected(state)
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "a", no_dist=True, staging="auto")
    _scramble(state)
    handle.result()  # the save itself succeeded
    _assert_saved(tmp_path / "a", expected)
    assert pool.capacity == 0
    monkeypatch.undo()
    state = _state(9.0)
    expected = _expected(state)
    dcp.async_save(state, checkpoint_id=tmp_path / "b", no_dist=True, staging="copy").result()
    _assert_saved(tmp_path / "b", expected)
    assert pool.capacity > 0


def test_the_default_staging_copies_even_a_first_call(tmp_path, forks):
    """A fork's page faults would land in the next training step: the default never forks."""
    clear_plan_cache()
    pool = _async_engine._POOL  # pylint: disable=protected-access
    pool.release()
    state = _state(10.0)
    expected = _expected(state)
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "d", no_dist=True)
    _scramble(state)
    handle.result()
    assert forks == [] and pool.capacity > 0
    _assert_saved(tmp_path / "d", expected)
