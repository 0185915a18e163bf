"""A Parameter that becomes a transpose of its own memory is never read or written through its old numpy view.

``Parameter.assign_value(p.T)`` of a square Parameter (MindSpore 2.10) keeps its
memory (``data_ptr``), shape and dtype, and makes it a non-contiguous view: the
numpy view cached by an earlier save or load (which checked object, memory,
shape and dtype) still reads the memory row-major. A save then stored the
values untransposed and a load wrote the stored rows into the columns, both
silently. The cached view is reused only while the tensor is contiguous.
"""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _layout_memo
from hyper_parallel.core.distributed_checkpoint._flatten import flatten_state_dict
from hyper_parallel.platform.tensor import _cached_views, _contiguous, shared_view, writable_views

ms.set_device("CPU")


def _transposed_state(tmp_path: Path) -> dict:
    """Three square Parameters whose views are cached (a save and a load), then each transposed in its memory."""
    state = {f"p{i}": ms.Parameter(ms.Tensor(np.arange(16, dtype=np.float32).reshape(4, 4) + 100 * i), name=f"p{i}")
             for i in range(3)}
    dcp.save(state, checkpoint_id=tmp_path / "cache", no_dist=True)
    dcp.load(state, checkpoint_id=tmp_path / "cache", no_dist=True)
    for p in state.values():
        pointer = p.data_ptr()
        p.assign_value(p.T)
        assert p.data_ptr() == pointer and tuple(p.shape) == (4, 4) and not p.is_contiguous()
    return state


@pytest.mark.parametrize("save", ["sync", "async"])
def test_a_save_stores_the_values_of_a_parameter_transposed_in_its_own_memory(tmp_path: Path, save: str) -> None:
    state = _transposed_state(tmp_path)
    if save == "async":  # the layout memo (remembered by a save of the untransposed state) must not hold either
        dcp.async_save(state, checkpoint_id=tmp_path / "before", no_dist=True).result(timeout=60)
    expected = {name: p.asnumpy().copy() for name, p in state.items()}
    assert np.array_equal(expected["p1"][0], [100, 104, 108, 112])
    if save == "async":
        dcp.async_save(state, checkpoint_id=tmp_path / "out", no_dist=True).result(timeout=60)
        assert _layout_memo.recall(flatten_state_dict(state).values) is None
    else:
        dcp.save(state, checkpoint_id=tmp_path / "out", no_dist=True)
    loaded = hyper_parallel.load_checkpoint(tmp_path / "out")
    for name, values in expected.items():
        np.testing.assert_array_equal(loaded[name].asnumpy(), values, err_msg=name)


@pytest.mark.parametrize("with_array", [False, True])  # the column check of cached views, and the per-tensor loop
def test_a_load_never_writes_rows_into_a_parameter_transposed_in_its_own_memory(tmp_path: Path,
                                                                                with_array: bool) -> None:
    state = _transposed_state(tmp_path)
    stored = {name: np.arange(16, dtype=np.float32).reshape(4, 4) * (i + 2) for i, name in enumerate(state)}
    dcp.save({**stored, "a": np.ones(2, np.float32)}, checkpoint_id=tmp_path / "new", no_dist=True)
    views = writable_views(list(state.values()), [(4, 4)] * 3)
    assert all(view is None for view in views)
    assert all(shared_view(p) is None for p in state.values())
    targets = {**state, "a": np.zeros(2, np.float32)} if with_array else state
    dcp.load(targets, checkpoint_id=tmp_path / "new", no_dist=True)
    for name, p in state.items():
        np.testing.assert_array_equal(p.asnumpy(), stored[name], err_msg=name)


def test_a_parameter_transposed_before_any_view_is_never_aliased(tmp_path: Path) -> None:
    """No cached view to check: ``asnumpy()`` of a tensor that is not contiguous is a copy at another address, so
    no view of it is made or cached; a save stores its values and a load writes them in its layout."""
    p = ms.Parameter(ms.Tensor(np.arange(16, dtype=np.float32).reshape(4, 4)), name="fresh")
    pointer = p.data_ptr()
    p.assign_value(p.T)
    assert p.data_ptr() == pointer and not p.is_contiguous()
    assert p.asnumpy().__array_interface__["data"][0] != pointer
    assert shared_view(p) is None and writable_views([p], [(4, 4)]) == [None] and shared_view(p) is None
    expected = np.arange(16, dtype=np.float32).reshape(4, 4).T
    dcp.save({"p": p}, checkpoint_id=tmp_path / "out", no_dist=True)
    np.testing.assert_array_equal(hyper_parallel.load_checkpoint(tmp_path / "out")["p"].asnumpy(), expected)
    dcp.save({"p": np.full((4, 4), 3.0, np.float32)}, checkpoint_id=tmp_path / "threes", no_dist=True)
    dcp.load({"p": p}, checkpoint_id=tmp_path / "threes", no_dist=True)
    np.testing.assert_array_equal(p.asnumpy(), np.full((4, 4), 3.0, np.float32))


def test_a_tensor_that_cannot_tell_its_layout_gets_no_cached_view() -> None:
    """``is_contiguous`` failing counts as not contiguous; a tensor class without it (no views) as contiguous."""

    class Failing:
        def is_contiguous(self) -> bool:
            raise RuntimeError("no layout")

    assert _contiguous(Failing()) is False
    assert _contiguous(object()) is True
    assert _contiguous(ms.Tensor(np.zeros((2, 3), np.float32)).T) is False


def test_a_plain_tensor_transposed_in_its_own_memory_saves_its_values_and_a_load_into_it_is_refused(
        tmp_path: Path) -> None:
    """Not a Parameter: a load cannot give it memory of its own, so it is refused as a view (4ae16d6), unchanged."""
    tensor = ms.Tensor(np.arange(16, dtype=np.float32).reshape(4, 4))
    dcp.save({"t": tensor}, checkpoint_id=tmp_path / "cache", no_dist=True)  # caches its row-major view
    tensor.assign_value(tensor.T)
    expected = tensor.asnumpy().copy()
    dcp.save({"t": tensor}, checkpoint_id=tmp_path / "out", no_dist=True)
    np.testing.assert_array_equal(hyper_parallel.load_checkpoint(tmp_path / "out")["t"].asnumpy(), expected)
    dcp.save({"t": np.full((4, 4), 7.0, np.float32)}, checkpoint_id=tmp_path / "new", no_dist=True)
    with pytest.raises(dcp.CheckpointError, match="key 't'.*not contiguous"):
        dcp.load({"t": tensor}, checkpoint_id=tmp_path / "new", no_dist=True)
    np.testing.assert_array_equal(tensor.asnumpy(), expected)


@pytest.mark.parametrize("method", ["is_contiguous", "data_ptr"])
def test_a_tensor_class_overriding_how_it_tells_its_layout_or_memory_is_asked_by_the_cached_view_check(method) -> None:
    """The column check calls MindSpore's own methods unbound only for classes that keep them: a subclass's own
    ``is_contiguous`` (now a transpose) or ``data_ptr`` (memory moved) makes the cached view stale."""

    class Told(ms.Tensor):
        changed = False

        def is_contiguous(self) -> bool:
            return not (self.changed and method == "is_contiguous")

        def data_ptr(self) -> int:
            return ms.Tensor.data_ptr(self) + (64 if self.changed and method == "data_ptr" else 0)

    tensor = Told(np.arange(16, dtype=np.float32).reshape(4, 4))
    (view,) = writable_views([tensor], [(4, 4)])
    cached = _cached_views([tensor], [(4, 4)], ms.Tensor)
    assert view is not None and cached is not None and cached[0] is view
    Told.changed = True
    assert _cached_views([tensor], [(4, 4)], ms.Tensor) is None
