"""``prepare_async_save``: the first async save copies into buffers mapped and faulted in beforehand."""

from __future__ import annotations

import logging

import mindspore as ms
import numpy as np
from mindspore import dataset as ds
from mindspore import nn
from mindspore.train import Callback, Model

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _async_engine

ms.set_device("CPU")


def _state(base: float) -> dict:
    rng = np.random.default_rng(5)
    state = {f"w{i}": ms.Parameter(ms.Tensor(rng.standard_normal((17 + i, 65)).astype(np.float32) + base,
                                             ms.bfloat16 if i % 2 else ms.float32), name=f"w{i}") for i in range(6)}
    state["opt"] = {"m": ms.Tensor(np.full((3, 7), base, np.float32)), "step": 4}
    return state


def _bytes(state: dict) -> int:
    return sum(p.asnumpy().nbytes for p in state.values() if isinstance(p, ms.Parameter)) + state["opt"]["m"].nbytes


def _assert_saved(path, expected: dict) -> None:
    target = _state(0.0)
    dcp.load(target, checkpoint_id=path, no_dist=True)
    for name, value in expected.items():
        got = target[name].asnumpy() if name != "m" else target["opt"]["m"].asnumpy()
        np.testing.assert_array_equal(got.view(np.uint8), value.view(np.uint8))


def _expected(state: dict) -> dict:
    out = {name: p.asnumpy().copy() for name, p in state.items() if isinstance(p, ms.Parameter)}
    out["m"] = state["opt"]["m"].asnumpy().copy()
    return out


def test_the_first_save_after_prepare_maps_no_arena_and_is_bit_exact(tmp_path):
    pool = _async_engine.staging_pool()
    pool.release()
    state = _state(1.0)
    arenas = pool.arenas
    capacity = dcp.prepare_async_save(state).result(timeout=60)
    assert capacity == pool.capacity >= _bytes(state) and pool.arenas == arenas + 1
    expected = _expected(state)
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "a", no_dist=True)
    for p in state.values():
        if isinstance(p, ms.Parameter):
            p.asnumpy()[...] = 0  # changed right after the call: the checkpoint keeps the values at call time
    handle.result()
    assert pool.arenas == arenas + 1, "the first save copied into the prepared arena"
    _assert_saved(tmp_path / "a", expected)
    assert dcp.prepare_async_save(state).result(timeout=60) == capacity  # large enough already: kept as it is
    assert pool.arenas == arenas + 1


def test_a_save_started_while_preparing_waits_for_the_buffers(tmp_path):
    pool = _async_engine.staging_pool()
    pool.release()
    state = _state(2.0)
    expected = _expected(state)
    future = dcp.prepare_async_save(state)
    dcp.async_save(state, checkpoint_id=tmp_path / "b", no_dist=True).result()  # no race on the one arena
    assert future.done() and pool.capacity >= _bytes(state)
    _assert_saved(tmp_path / "b", expected)


def test_buffers_that_cannot_be_had_leave_the_first_save_to_map_its_own(tmp_path, monkeypatch, caplog):
    pool = _async_engine.staging_pool()
    pool.release()

    def no_memory(_nbytes: int) -> None:
        raise MemoryError("no memory for the staging arena")

    monkeypatch.setattr(pool, "prefault", no_memory)
    state = _state(3.0)
    expected = _expected(state)
    with caplog.at_level(logging.WARNING):
        assert dcp.prepare_async_save(state).result(timeout=60) == 0
    assert "no staging buffers" in caplog.text and "the first async save maps its own" in caplog.text
    monkeypatch.undo()
    dcp.async_save(state, checkpoint_id=tmp_path / "c", no_dist=True).result()
    _assert_saved(tmp_path / "c", expected)


def test_the_callback_prepares_the_buffers_at_train_begin(tmp_path):
    pool = _async_engine.staging_pool()
    pool.release()
    ms.set_seed(1)
    net = nn.Dense(64, 32)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=opt)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    data = ds.NumpySlicesDataset({"x": x, "y": x[:, :32].copy()}, shuffle=False).batch(4)
    callback = hyper_parallel.CheckpointCallback(tmp_path / "run", save_checkpoint_steps=2, keep_checkpoint_max=1)
    arenas = pool.arenas
    before_first_step: list[int] = []

    class Probe(Callback):
        def on_train_step_begin(self, run_context):
            if not before_first_step:  # step 1, before any save
                callback._staging.result(timeout=60)  # pylint: disable=protected-access
                before_first_step.append(pool.capacity)

    model.train(1, data, callbacks=[callback, Probe()], dataset_sink_mode=False)
    callback.manager.wait()
    # weights, bias, two Adam moments of each: in the arena mapped at train begin, before the first step
    assert before_first_step[0] >= 3 * (64 * 32 + 32) * 4
    assert pool.arenas == arenas + 1, "the saves copied into the arena prepared at train begin"
    saved = dcp.read_metadata(tmp_path / "run" / "step_00000002").state_dict_metadata
    assert any(key.endswith("weight") for key in saved)


def test_the_prepared_arena_is_as_large_as_the_first_save_needs(tmp_path):
    """Sized as staging packs a first save (every tensor at a 64-byte boundary), at a 2 MiB rounding edge."""
    pool = _async_engine.staging_pool()
    pool.release()
    # 4,000 tensors of 2,052 bytes and one of 2,030,000: 64 bytes per tensor decide between 10 and 12 MiB.
    state = {f"w{i}": ms.Parameter(ms.Tensor(np.full(513, i, np.float32)), name=f"w{i}") for i in range(4000)}
    state["pad"] = ms.Parameter(ms.Tensor(np.ones(507_500, np.float32)), name="pad")
    dcp.prepare_async_save(state).result(timeout=60)
    arenas = pool.arenas
    dcp.async_save(state, checkpoint_id=tmp_path / "edge", no_dist=True).result()
    assert pool.arenas == arenas, "the first save mapped a new arena: the prepared one was too small"


def _count_asnumpy(monkeypatch) -> list[int]:
    """Count ``Tensor.asnumpy`` calls (the call itself still runs): a tensor's host memory being looked up."""
    calls = [0]
    real = ms.Tensor.asnumpy

    def counted(self):
        calls[0] += 1
        return real(self)

    monkeypatch.setattr(ms.Tensor, "asnumpy", counted)
    return calls


def test_the_first_save_after_prepare_looks_up_no_tensor_again(tmp_path, monkeypatch):
    """prepare_async_save looks every tensor up once: the first save's layout pass finds them (as a steady save)."""
    _async_engine.staging_pool().release()
    state = _state(4.0)  # new Parameters: nothing looked up yet
    expected = _expected(state)
    dcp.prepare_async_save(state).result(timeout=60)
    calls = _count_asnumpy(monkeypatch)
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "d", no_dist=True)
    assert calls[0] == 0, "the first save looked a tensor up again"
    monkeypatch.undo()
    for p in state.values():
        if isinstance(p, ms.Parameter):
            p.asnumpy()[...] = 0
    handle.result()
    _assert_saved(tmp_path / "d", expected)
    # Without the preparation the same save looks every tensor up inside the call.
    fresh = _state(5.0)
    calls = _count_asnumpy(monkeypatch)
    dcp.async_save(fresh, checkpoint_id=tmp_path / "e", no_dist=True).result()
    assert calls[0] >= 7


def test_a_state_changed_between_prepare_and_save_is_saved_exactly(tmp_path):
    """Replaced, reshaped, retyped, new and changed-in-place tensors after the preparation: the save has them all."""
    _async_engine.staging_pool().release()
    state = _state(6.0)
    dcp.prepare_async_save(state).result(timeout=60)
    rng = np.random.default_rng(9)
    state["w0"].set_data(ms.Tensor(rng.standard_normal((17, 65)).astype(np.float32)))  # new memory, same layout
    state["w1"].set_data(ms.Tensor(rng.standard_normal((13, 70)).astype(np.float32), ms.bfloat16))  # reshaped
    state["w2"] = ms.Parameter(ms.Tensor(rng.standard_normal((19, 65)).astype(np.float16)), name="w2")  # new dtype
    state["w6"] = ms.Parameter(ms.Tensor(rng.standard_normal((5, 3)).astype(np.float32)), name="w6")  # a new key
    state["w3"].asnumpy()[...] = 2.5  # changed in place
    del state["w5"]
    expected = _expected(state)
    dcp.async_save(state, checkpoint_id=tmp_path / "f", no_dist=True).result()
    saved = dcp.read_metadata(tmp_path / "f").state_dict_metadata
    assert "w5" not in saved and tuple(saved["w1"].size) == (13, 70) and tuple(saved["w6"].size) == (5, 3)
    target = {name: ms.Parameter(ms.Tensor(np.zeros(p.shape, np.float32), p.dtype), name=name)
              for name, p in state.items() if isinstance(p, ms.Parameter)}
    dcp.load(target, checkpoint_id=tmp_path / "f", no_dist=True)
    assert target["w2"].dtype == ms.float16
    for name, value in expected.items():
        if name != "m":
            np.testing.assert_array_equal(target[name].asnumpy().view(np.uint8), value.view(np.uint8))


def test_the_background_work_starts_after_the_call_returns(tmp_path):
    """The writer runs only once async_save let go of the caller's thread (its lock released): no GIL tug of war."""
    from hyper_parallel.core.distributed_checkpoint import async_checkpoint  # pylint: disable=import-outside-toplevel

    seen: list[bool] = []

    class Probe(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            free = async_checkpoint._ASYNC_LOCK.acquire(blocking=False)  # pylint: disable=protected-access
            if free:
                async_checkpoint._ASYNC_LOCK.release()  # pylint: disable=protected-access
            seen.append(free)
            return super().write_data(plan, planner)

    state = _state(7.0)
    expected = _expected(state)
    for name in ("g", "h"):  # the first save (planned in the background) and a steady one
        dcp.async_save(state, storage_writer=Probe(tmp_path / name), no_dist=True).result()
        _assert_saved(tmp_path / name, expected)
    assert seen == [True, True]
