"""``load_checkpoint(path)`` loads into Parameters it makes first: the values land in their memory, no copy after.

The returned Parameters hold the stored values bit for bit (every stored dtype, 0-d and empty shapes too), under
the stored keys, and the load's peak memory is one copy of the state (making each Parameter of a filled array
copied every value: two). In an auto-parallel mode MindSpore defers a new Parameter's memory: the load then goes
through numpy arrays, with the same result.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp

_DTYPES = [ms.float32, ms.bfloat16, ms.float16, ms.float64, ms.int8, ms.int16, ms.int32, ms.int64, ms.uint8,
           ms.uint16, ms.uint32, ms.uint64, ms.bool_]


def _state() -> dict[str, ms.Parameter]:
    rng = np.random.default_rng(3)
    shapes = [(5,), (2, 3), (), (0,), (4, 1, 2)]
    state = {}
    for i, dtype in enumerate(_DTYPES):
        values = rng.standard_normal(shapes[i % len(shapes)]) * 40
        state[f"layer{i}.weight"] = ms.Parameter(ms.Tensor(values, dtype), name=f"layer{i}.weight")
    return state


def _check_loaded(loaded: dict, saved: dict[str, ms.Parameter]) -> None:
    assert sorted(loaded) == sorted(saved)
    for key, param in saved.items():
        value = loaded[key]
        assert isinstance(value, ms.Parameter) and value.name == key and value.requires_grad, key  # as mindspore.load_checkpoint gives it
        assert value.dtype == param.dtype and tuple(value.shape) == tuple(param.shape), key
        assert value.asnumpy().tobytes() == param.asnumpy().tobytes(), key


def test_parameters_come_back_with_the_stored_values(tmp_path: Path) -> None:
    saved = _state()
    dcp.save(saved, checkpoint_id=tmp_path / "c", no_dist=True)
    first = hyper_parallel.load_checkpoint(tmp_path / "c")
    _check_loaded(first, saved)
    second = hyper_parallel.load_checkpoint(tmp_path / "c")
    _check_loaded(second, saved)
    second["layer0.weight"].asnumpy()[...] = 0  # each load's Parameters own their memory
    _check_loaded(first, saved)


def _rss_and_peak() -> tuple[int, int]:
    status = Path("/proc/self/status").read_text()
    return tuple(int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) << 10 for field in ("VmRSS", "VmHWM"))


def test_the_load_holds_one_copy_of_the_state(tmp_path: Path) -> None:
    state_bytes = 128 << 20
    saved = {f"w{i}": ms.Parameter(ms.Tensor(np.full(state_bytes // 16, i + 0.5, np.float32)), name=f"w{i}")
             for i in range(4)}
    dcp.save(saved, checkpoint_id=tmp_path / "c", no_dist=True)
    del saved
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current RSS
    except OSError:
        pytest.skip("this kernel does not reset the peak RSS")
    rss, _ = _rss_and_peak()
    loaded = hyper_parallel.load_checkpoint(tmp_path / "c")
    _, peak = _rss_and_peak()
    assert [float(loaded[f"w{i}"].asnumpy()[-1]) for i in range(4)] == [0.5, 1.5, 2.5, 3.5]
    # One copy of the state (the targets the load fills), with room for the reader's buffers; Parameters made of
    # filled arrays afterwards held two.
    assert peak - rss < state_bytes * 1.4, (peak - rss) >> 20


def test_an_auto_parallel_mode_loads_through_numpy_arrays(tmp_path: Path) -> None:
    saved = _state()
    dcp.save(saved, checkpoint_id=tmp_path / "c", no_dist=True)
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    try:
        assert ms.Parameter(ms.Tensor(shape=(2,), dtype=ms.float32, init=ms.common.initializer.Zero())).has_init
        loaded = hyper_parallel.load_checkpoint(tmp_path / "c")
    finally:
        ms.reset_auto_parallel_context()
    _check_loaded(loaded, saved)
