"""The small leaves of a copying async save: placed in one pass, their places reused by a steady save.

A save meeting the very host arrays the previous save placed (a steady save
of the same state) takes the previous places and typed arena views
(:class:`._stage_copies.SmallRun`) instead of placing each leaf. These tests
change the small leaves between saves in every way that could make the kept
places stale (new memory, new shape, new dtype, a leaf added, removed or
dropped), write every tensor right after the call returns, and check the
saved bytes; a failing small copy fails the save with nothing committed.
"""

from __future__ import annotations

import gc
import threading
import weakref

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _async_engine, _copy_threads
from hyper_parallel.core.distributed_checkpoint._lazy_pool import lazy_executor
from hyper_parallel.core.distributed_checkpoint._copy_threads import SMALL_COPY_BYTES, Copier
from hyper_parallel.platform.tensor import DEVICE_COPIES_ENV, shared_view, shared_view_reader

ms.set_device("CPU")


def _small_shapes() -> list[tuple[int, ...]]:
    return [(7, 9), (), (3,), (0,), (17,), (64, 33), (4096,), (2, 3, 5)]


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    state = {"big": ms.Parameter(ms.Tensor(rng.standard_normal((512, 1024)).astype(np.float32)), name="big")}
    for i, shape in enumerate(_small_shapes() * 3):
        dtype = (ms.float32, ms.bfloat16, ms.float16)[i % 3]
        state[f"s{i}"] = ms.Parameter(ms.Tensor(rng.standard_normal(shape).astype(np.float32), dtype), name=f"s{i}")
    state["step"] = 5
    return state


def _values(state: dict) -> dict[str, np.ndarray]:
    return {name: p.asnumpy().copy() for name, p in state.items() if isinstance(p, ms.Parameter)}


def _save_then_overwrite(state: dict, path) -> dict[str, np.ndarray]:
    """Save asynchronously; write every tensor right after the call; return the values at the call."""
    expected = _values(state)
    handle = dcp.async_save(state, checkpoint_id=path, no_dist=True)
    for p in state.values():
        if isinstance(p, ms.Parameter):
            p.asnumpy()[...] = 7
    handle.result()
    return expected


def _assert_saved(path, expected: dict[str, np.ndarray]) -> None:
    meta = dcp.read_metadata(path).state_dict_metadata
    assert {k for k in meta if k != "step"} == set(expected)
    target = {name: ms.Parameter(ms.Tensor(np.zeros(v.shape, np.float32), {"bfloat16": ms.bfloat16, "float16": ms.float16}
                                           .get(v.dtype.name, ms.float32)), name=name) for name, v in expected.items()}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    for name, value in expected.items():
        got = target[name].asnumpy()
        assert got.shape == value.shape, name
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), value.reshape(-1).view(np.uint8), err_msg=name)


@pytest.fixture(name="pool")
def _pool():
    pool = _async_engine.staging_pool()
    pool.release()
    yield pool
    pool.release()


def test_a_steady_save_reuses_the_small_places_and_keeps_the_values_at_the_call(tmp_path, pool):
    state = _state(1)
    for step in range(2):
        _assert_saved(tmp_path / f"s{step}", _save_then_overwrite(state, tmp_path / f"s{step}"))
    run = pool._small_run  # pylint: disable=protected-access
    assert run is not None and len(run.names) == len(_small_shapes()) * 3
    for step in range(2, 4):
        _assert_saved(tmp_path / f"s{step}", _save_then_overwrite(state, tmp_path / f"s{step}"))
        assert pool._small_run is run, "the very arrays again: the kept places are reused"  # pylint: disable=W0212


@pytest.mark.parametrize("change", ["new memory", "new shape", "new dtype", "added", "removed", "dropped"])
def test_a_changed_small_leaf_is_placed_anew_and_saved_exactly(tmp_path, pool, change):
    state = _state(2)
    for step in range(2):
        _save_then_overwrite(state, tmp_path / f"warm{step}")
    run = pool._small_run  # pylint: disable=protected-access
    if change == "new memory":
        state["s4"].set_data(ms.Tensor(np.arange(17, dtype=np.float32), ms.float16))
    elif change == "new shape":
        state["s5"].set_data(ms.Tensor(np.ones((33, 64), np.float32), ms.bfloat16))
    elif change == "new dtype":
        state["s0"].set_data(ms.Tensor(np.full((7, 9), 2.5, np.float32), ms.float16))
    elif change == "added":
        state["s_new"] = ms.Parameter(ms.Tensor(np.full((5,), 3.0, np.float32)), name="s_new")
    elif change == "removed":
        del state["s3"]
    else:  # the whole state is dropped and made again: the kept places must not keep it alive
        probe = weakref.ref(state["s6"])
        del state
        gc.collect()
        assert probe() is None, "the staging pool keeps the small leaves weakly"
        state = _state(3)
    expected = _save_then_overwrite(state, tmp_path / "changed")
    assert pool._small_run is not run  # pylint: disable=protected-access
    _assert_saved(tmp_path / "changed", expected)
    again = _save_then_overwrite(state, tmp_path / "again")
    _assert_saved(tmp_path / "again", again)


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_a_numpy_leaf_retyped_or_reshaped_in_place_is_placed_anew_and_saved_exactly(tmp_path, pool, change):
    """The very array object, its memory unchanged, but another dtype or shape (``a.dtype = ...``,
    ``a.shape = ...``): the kept places (typed like the old array) must not be reused (values cast, or a
    copy that cannot broadcast)."""
    rng = np.random.default_rng(5)
    small = (rng.standard_normal(8) * 1000).astype(np.float32)
    state = {"big": rng.standard_normal((512, 1024)).astype(np.float32), "small": small}
    for step in range(2):
        dcp.async_save(state, checkpoint_id=tmp_path / f"warm{step}", no_dist=True).result()
    if change == "dtype":
        small.dtype = np.int32
    else:
        small.shape = (2, 4)
    expected = small.copy()
    dcp.async_save(state, checkpoint_id=tmp_path / "changed", no_dist=True).result()
    target = {"big": np.zeros((512, 1024), np.float32), "small": np.zeros(expected.shape, expected.dtype)}
    dcp.load(target, checkpoint_id=tmp_path / "changed", no_dist=True)
    assert target["small"].dtype == expected.dtype and target["small"].shape == expected.shape
    np.testing.assert_array_equal(target["small"].view(np.uint8), expected.view(np.uint8))


def test_a_failed_small_copy_fails_the_save_and_commits_nothing(tmp_path, pool, monkeypatch):
    state = _state(4)
    for step in range(2):
        _save_then_overwrite(state, tmp_path / f"warm{step}")
    real = _copy_threads._copy_all  # pylint: disable=protected-access

    def failing(pairs):
        if any(source.nbytes < SMALL_COPY_BYTES for _, source in pairs):
            raise MemoryError("injected: a small copy failed")
        real(pairs)

    monkeypatch.setattr(_copy_threads, "_copy_all", failing)
    with pytest.raises(MemoryError, match="injected"):
        dcp.async_save(state, checkpoint_id=tmp_path / "failed", no_dist=True)
    assert not (tmp_path / "failed" / ".metadata").exists()
    with pytest.raises(Exception):
        dcp.read_metadata(tmp_path / "failed")
    monkeypatch.setattr(_copy_threads, "_copy_all", real)
    expected = _save_then_overwrite(state, tmp_path / "after")
    _assert_saved(tmp_path / "after", expected)


def _busy_staging_threads(until: threading.Event) -> None:
    """Occupy every staging thread until ``until`` is set (returns once they are all occupied)."""
    started = threading.Semaphore(0)

    def occupy() -> None:
        started.release()
        until.wait(timeout=10)

    for _ in range(_copy_threads.STAGING_THREADS):
        lazy_executor("stage", _copy_threads.STAGING_THREADS).submit(occupy)
    for _ in range(_copy_threads.STAGING_THREADS):
        assert started.acquire(timeout=60)


def _recording_copies(monkeypatch, first_small_on_caller: threading.Event | None = None) -> dict[bool, set[str]]:
    """Record which threads make the small and the large copies (``{small?: thread names}``); set
    ``first_small_on_caller`` when the caller's thread begins a small copy."""
    real = _copy_threads._copy_all  # pylint: disable=protected-access
    threads: dict[bool, set[str]] = {True: set(), False: set()}

    def recording(pairs):
        for _, source in pairs:
            small = source.nbytes < SMALL_COPY_BYTES
            threads[small].add(threading.current_thread().name)
            if small and first_small_on_caller is not None and threading.current_thread() is threading.main_thread():
                first_small_on_caller.set()
        real(pairs)

    monkeypatch.setattr(_copy_threads, "_copy_all", recording)
    return threads


def test_the_callers_thread_takes_back_the_small_copies_no_thread_has_begun(tmp_path, pool, monkeypatch):
    """Each small copy needs the GIL: handed to the staging threads, they came after every large copy and took
    turns for it. A save whose threads are still busy when the caller's thread waits for the copies: the caller's
    thread makes every small copy (taken back from the threads), the threads the large ones; the values at the
    call are saved."""
    state = _state(9)
    state["huge"] = ms.Parameter(ms.Tensor(np.ones((4096, 1024), np.float32)), name="huge")  # past the caller's lead
    for step in range(2):  # a first save of the state in this arena, then a steady one (the kept small places)
        _save_then_overwrite(state, tmp_path / f"warm{step}")
        free = threading.Event()
        threads = _recording_copies(monkeypatch, first_small_on_caller=free)
        _busy_staging_threads(until=free)
        expected = _save_then_overwrite(state, tmp_path / f"s{step}")
        monkeypatch.undo()
        _assert_saved(tmp_path / f"s{step}", expected)
        assert threads[True] == {threading.main_thread().name}
        assert threads[False] - {threading.main_thread().name}, "the large ones: by the staging threads"


def _held_copies(seed: int, count: int) -> tuple[Copier, list[int], list[np.ndarray], list[np.ndarray]]:
    """A copier holding ``count`` small uint8 copies of random sizes: (copier, sizes, targets, sources)."""
    rng = np.random.default_rng(seed)
    sizes = [int(s) for s in rng.integers(0, 5000, count)]
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    targets = [np.zeros_like(s) for s in sources]
    copier = Copier(caller_share=False)
    copier.add_small(list(zip(targets, sources)), sizes)
    return copier, sizes, targets, sources


def test_small_runs_a_thread_began_are_not_copied_again(monkeypatch):
    """Small runs the threads copied before :meth:`Copier.finish` stay theirs; every byte lands once."""
    copier, _, targets, sources = _held_copies(12, 200)
    threads = _recording_copies(monkeypatch)
    copier.release_small()
    for future, _ in copier._released:  # pylint: disable=protected-access
        future.result(timeout=60)
    copier.finish()
    assert threads[True] and threading.main_thread().name not in threads[True], "nothing copied again"
    assert all(t.tobytes() == s.tobytes() for t, s in zip(targets, sources))


def test_held_small_copies_are_split_in_order_by_bytes():
    copier, sizes, targets, sources = _held_copies(6, 300)
    runs = copier._split_small(3)  # pylint: disable=protected-access
    assert [pair for run in runs for pair in run] == list(zip(targets, sources)), "every copy once, in order"
    assert len(runs) == 3
    share = sum(sizes) / 3
    for run in runs:
        assert abs(sum(source.nbytes for _, source in run) - share) <= max(sizes), "about equal bytes"
    copier.add_small(list(zip(targets, sources)), sizes)
    copier.release_small()
    copier.finish()
    assert all(t.tobytes() == s.tobytes() for t, s in zip(targets, sources))
    assert Copier(caller_share=False)._split_small(2) == []  # pylint: disable=protected-access


def test_the_view_reader_reads_the_environment_once(monkeypatch):
    tensor = ms.Tensor(np.arange(6, dtype=np.float32))
    array = np.arange(3)
    monkeypatch.delenv(DEVICE_COPIES_ENV, raising=False)
    read = shared_view_reader()
    assert read(array) is array
    assert read(tensor) is shared_view(tensor) and read(tensor) is not None
    monkeypatch.setenv(DEVICE_COPIES_ENV, "1")
    assert read(tensor) is not None, "read once, when the reader was made"
    forced = shared_view_reader()
    assert forced(tensor) is None and forced(array) is array
    assert shared_view(tensor) is None


@pytest.mark.parametrize("change", [None, "small replaced", "large replaced"])
def test_the_first_save_after_prepare_takes_the_prepared_small_places_and_saves_exactly(tmp_path, pool, change):
    state = _state(8)
    assert dcp.prepare_async_save(state).result(timeout=60) >= sum(
        p.asnumpy().nbytes for p in state.values() if isinstance(p, ms.Parameter))
    prepared = pool._small_run  # pylint: disable=protected-access
    assert prepared is not None and len(prepared.names) == len(_small_shapes()) * 3
    if change == "small replaced":
        state["s7"] = ms.Parameter(ms.Tensor(np.full((2, 3, 5), 4.0, np.float32)), name="s7")
    elif change == "large replaced":  # the copies ahead end elsewhere: the small places start elsewhere
        state["big"] = ms.Parameter(ms.Tensor(np.ones((600, 1024), np.float32)), name="big")
    expected = _save_then_overwrite(state, tmp_path / "first")
    assert (pool._small_run is prepared) == (change is None)  # pylint: disable=protected-access
    _assert_saved(tmp_path / "first", expected)
    _assert_saved(tmp_path / "next", _save_then_overwrite(state, tmp_path / "next"))
