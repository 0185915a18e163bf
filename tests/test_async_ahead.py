"""Copies ahead: the large tensors a save is expected to hold are copied as ``async_save`` begins.

``prepare_async_save`` (and every copying async save) tells the staging pool
which large whole tensors the next save copies; that save copies them into
the arena at once, before its layout pass, which adopts a copy only for the
leaf of the same name whose host array is the very array copied. These
tests change the state between the expectation and the save in every way
that could make a copy ahead stale, and check the saved bytes.
"""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _async_engine
from msrun_harness import run_workers, scenario_values

ms.set_device("CPU")

_LARGE = (512, 1024)  # 2 MiB in float32, 1 MiB in bfloat16: copied ahead (at least SMALL_COPY_BYTES)


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    state = {f"big{i}": ms.Parameter(ms.Tensor(rng.standard_normal(_LARGE).astype(np.float32),
                                               ms.bfloat16 if i % 2 else ms.float32), name=f"big{i}") for i in range(3)}
    state.update({f"small{i}": ms.Parameter(ms.Tensor(rng.standard_normal((7, 9)).astype(np.float32)), name=f"small{i}")
                  for i in range(4)})
    state["step"] = 3
    return state


def _expected(state: dict) -> dict[str, np.ndarray]:
    return {name: p.asnumpy().copy() for name, p in state.items() if isinstance(p, ms.Parameter)}


def _zero(state: dict) -> None:
    """The next training step writes every Parameter right after the call."""
    for p in state.values():
        if isinstance(p, ms.Parameter):
            p.asnumpy()[...] = 0


def _assert_saved(path, expected: dict[str, np.ndarray]) -> None:
    meta = dcp.read_metadata(path).state_dict_metadata
    assert {k for k in meta if k != "step"} == set(expected)
    target = {name: ms.Parameter(ms.Tensor(np.zeros(v.shape, np.float32), ms.bfloat16 if v.dtype.itemsize == 2
                                           else ms.float32), name=name) for name, v in expected.items()}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    for name, value in expected.items():
        np.testing.assert_array_equal(target[name].asnumpy().view(np.uint8), value.view(np.uint8), err_msg=name)


@pytest.fixture(name="pool")
def _pool():
    pool = _async_engine.staging_pool()
    pool.release()
    return pool


def _counts(pool) -> tuple[int, int]:
    return pool.ahead_adopted, pool.ahead_missed


def test_the_first_save_after_prepare_copies_the_large_tensors_ahead(tmp_path, pool):
    state = _state(1)
    dcp.prepare_async_save(state).result(timeout=60)
    assert [name for name, _ in pool.expected()] == ["big0", "big1", "big2"]
    for step in range(3):  # the first save after prepare, then steady saves expecting what the last one copied
        before = _counts(pool)
        expected = _expected(state)
        handle = dcp.async_save(state, checkpoint_id=tmp_path / str(step), no_dist=True)
        _zero(state)
        handle.result()
        assert _counts(pool) == (before[0] + 3, before[1]), "every large tensor copied ahead was adopted"
        _assert_saved(tmp_path / str(step), expected)
        for p in state.values():
            if isinstance(p, ms.Parameter):
                p.asnumpy()[...] = step + 1.5


def test_new_memory_of_the_same_parameter_is_copied_ahead_from_its_new_memory(tmp_path, pool):
    """set_data after the expectation (same shape; another shape and dtype): copied ahead as it is at the call."""
    state = _state(2)
    dcp.prepare_async_save(state).result(timeout=60)
    state["big0"].set_data(ms.Tensor(np.full(_LARGE, 4.25, np.float32)))  # the same Parameter, new memory
    state["big1"].set_data(ms.Tensor(np.full((1024, 768), 1.5, np.float32)))  # reshaped, bfloat16 -> float32
    expected = _expected(state)
    before = _counts(pool)
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "a", no_dist=True)
    _zero(state)
    handle.result()
    assert _counts(pool) == (before[0] + 3, before[1])
    assert dcp.read_metadata(tmp_path / "a").state_dict_metadata["big1"].size == (1024, 768)
    _assert_saved(tmp_path / "a", expected)


@pytest.mark.parametrize("change", ["replaced", "replaced_same_size", "removed"])
def test_a_stale_copy_ahead_is_dropped_and_the_save_is_exact(tmp_path, pool, change):
    """A large tensor replaced by another Parameter or removed after the expectation, the old one still alive."""
    state = _state(3)
    dcp.prepare_async_save(state).result(timeout=60)
    arenas = pool.arenas
    old = state["big1"]  # kept alive: its copy ahead runs, and no leaf adopts it
    if change == "replaced":  # float32 instead of bfloat16: twice the bytes, a new place
        state["big1"] = ms.Parameter(ms.Tensor(np.full(_LARGE, -2.0, np.float32)), name="big1")
    elif change == "replaced_same_size":  # copied again into the stale copy's place, once that copy is over
        state["big1"] = ms.Parameter(ms.Tensor(np.full(_LARGE, -2.0, np.float32), ms.bfloat16), name="big1")
    else:
        del state["big1"]
    expected = _expected(state)
    before = _counts(pool)
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "a", no_dist=True)
    _zero(state)
    handle.result()
    _assert_saved(tmp_path / "a", expected)
    adopted, missed = _counts(pool)
    assert (adopted, missed) == (before[0] + 2, before[1] + 1), "big1's copy ahead was missed, the others adopted"
    assert old.asnumpy().shape == _LARGE
    if change != "replaced":
        assert pool.arenas == arenas, "the prepared arena was large enough"
    # A wrong guess turns copying ahead off (each one costs a copy for nothing) until the next preparation.
    assert pool.expected() == []
    expected = _expected(state)
    dcp.async_save(state, checkpoint_id=tmp_path / "b", no_dist=True).result()
    assert _counts(pool) == (adopted, missed)
    _assert_saved(tmp_path / "b", expected)
    dcp.prepare_async_save(state).result(timeout=60)
    dcp.async_save(state, checkpoint_id=tmp_path / "c", no_dist=True).result()
    assert pool.ahead_adopted > adopted and pool.ahead_missed == missed
    _assert_saved(tmp_path / "c", expected)


def test_a_save_of_another_state_copies_nothing_ahead_for_it(tmp_path, pool):
    """Two states saved in turn: the second one's save misses once, then no copy ahead is wasted."""
    first, second = _state(4), _state(5)
    dcp.prepare_async_save(first).result(timeout=60)
    expected = _expected(second)
    before = pool.ahead_missed
    dcp.async_save(second, checkpoint_id=tmp_path / "a", no_dist=True).result()
    _assert_saved(tmp_path / "a", expected)
    missed = pool.ahead_missed
    assert missed == before + 3
    for name in ("b", "c"):
        state = first if name == "b" else second
        expected = _expected(state)
        dcp.async_save(state, checkpoint_id=tmp_path / name, no_dist=True).result()
        _assert_saved(tmp_path / name, expected)
    assert pool.ahead_missed == missed


WORKER = Path(__file__).resolve().parent / "workers" / "async_ahead_worker.py"


def test_ranks_of_a_job_copy_ahead_what_they_wrote_and_save_exactly(tmp_path):
    """Two msrun ranks: from the third save on (the leaves a rank writes are known after its first), a rank copies
    ahead the large tensors it writes, adopts every one, and every step loads back bit-exact; a replaced
    Parameter's stale copy ahead is dropped on the rank that wrote it."""
    results = run_workers(WORKER, workers=2, tmp_path=tmp_path, timeout=600)
    steady = scenario_values(results, "steady")
    for per_rank in steady:
        assert all(exact for _, _, exact in per_rank), per_rank
        assert all(missed == 0 for _, missed, _ in per_rank), per_rank
        assert per_rank[2][0] == per_rank[3][0] > 0, per_rank  # steady: the same large leaves adopted each time
    assert sum(per_rank[3][0] for per_rank in steady) == 4, "each replicated large Parameter is written by one rank"
    changed = scenario_values(results, "changed")
    assert all(exact for _, _, exact in changed), changed
    assert sum(missed for _, missed, _ in changed) == 1, changed
