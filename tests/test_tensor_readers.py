"""MindSpore's C readers of shape, dtype, data_ptr and contiguity: used only where they give what the public
accessors give, and a memo hit still misses every change they must see."""

from __future__ import annotations

import mindspore as ms
import numpy as np

from hyper_parallel.core.distributed_checkpoint import _layout_memo
from hyper_parallel.platform.tensor import shared_view
from hyper_parallel.platform.tensor_readers import PUBLIC_READERS, column_readers

_NAMES = ("shape", "dtype", "data_ptr", "is_contiguous")


class _Strided(ms.Tensor):  # pylint: disable=abstract-method
    """A tensor class with its own is_contiguous (what it answers is set on the class)."""

    contiguous = True

    def is_contiguous(self) -> bool:
        return type(self).contiguous


def _state(kind=ms.Parameter):
    rng = np.random.default_rng(3)
    return {f"p{i}": kind(ms.Tensor(rng.random((4, 4), dtype=np.float32), ms.bfloat16 if i % 2 else ms.float32),
                          name=f"p{i}") for i in range(6)}


def _remember(state):
    views = {name: shared_view(value) for name, value in state.items()}
    _layout_memo.remember(state, views, "layout")
    return views


def test_plain_tensors_get_the_c_readers_and_they_agree_with_the_public_accessors():
    state = _state()
    tensors = list(state.values()) + [ms.Tensor(np.ones((3, 5), np.float16)), state["p0"].T]
    read = column_readers({ms.Tensor, type(state["p0"])})
    assert read is not PUBLIC_READERS, "MindSpore 2.10's own classes read through the C type"
    for name in _NAMES:
        assert [getattr(read, name)(t) for t in tensors] == [getattr(PUBLIC_READERS, name)(t) for t in tensors], name
    assert read.is_contiguous(state["p0"].T) is False
    assert column_readers(set()) is PUBLIC_READERS


def test_a_class_overriding_an_accessor_is_read_through_it_and_its_memo_misses():
    """A tensor class with its own ``is_contiguous`` gets the public readers: once it answers False, the memo
    hands out no cached view (the C type's own answer would still be True)."""
    assert column_readers({_Strided}) is PUBLIC_READERS
    assert column_readers({type(_state()["p0"]), _Strided}) is PUBLIC_READERS
    assert column_readers({ms.Parameter}) is PUBLIC_READERS, "MindSpore's Parameter base is no Tensor class"
    rng = np.random.default_rng(4)
    state = {f"t{i}": _Strided(rng.random((4, 4), dtype=np.float32)) for i in range(4)}
    try:
        views = _remember(state)
        assert all(view is not None for view in views.values())
        assert _layout_memo.recall(state) is not None, "contiguous: the memo hits"
        _Strided.contiguous = False
        assert _layout_memo.recall(state) is None, "the class's own is_contiguous is asked, and says no"
    finally:
        _Strided.contiguous = True
        _layout_memo.forget()


def test_a_memo_hit_read_through_the_c_readers_misses_every_change():
    """set_data (new memory), a bitcast (new dtype, same memory), a transpose in place (non-contiguous) and a
    reshape each make the memo miss."""
    changes = {
        "set_data": lambda p: p.set_data(ms.Tensor(np.zeros((4, 4), np.float32), p.dtype)),
        "bitcast": lambda p: p.assign_value(p.view(ms.int32) if p.dtype == ms.float32 else p.view(ms.int16)),
        "transpose": lambda p: p.assign_value(p.T),
        "reshape": lambda p: p.set_data(ms.Tensor(np.zeros((2, 8), np.float32), p.dtype)),
    }
    for label, change in changes.items():
        for key in ("p0", "p1"):
            state = _state()
            _remember(state)
            hit = _layout_memo.recall(state)
            assert hit is not None, label
            change(state[key])
            again = _layout_memo.recall(state)
            assert again is None, (label, key)
    _layout_memo.forget()
