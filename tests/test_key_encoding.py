"""Keys a safetensors file can name: any valid Unicode; a lone surrogate is refused before a byte is written."""

from __future__ import annotations

import os

import mindspore as ms
import numpy as np
import pytest
from safetensors import safe_open

import hyper_parallel.core.distributed_checkpoint as dcp


def _data_keys(directory) -> dict[str, np.ndarray]:
    seen = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(str(directory / name), framework="numpy") as handle:
                seen.update({key: handle.get_tensor(key) for key in handle.keys()})
    return seen


def test_unicode_keys_are_saved_and_open_with_safetensors(tmp_path):
    state = {"größe": ms.Tensor(np.arange(3, dtype=np.float32)), "层.权重": ms.Tensor(np.ones((2, 2), np.float32)),
             "emoji😀": ms.Parameter(ms.Tensor(np.full(2, 7, np.int32)), name="emoji😀")}
    dcp.save(state, checkpoint_id=tmp_path / "c", no_dist=True)
    seen = _data_keys(tmp_path / "c")
    assert set(seen) == set(state)
    for key, value in state.items():
        assert np.array_equal(seen[key], value.asnumpy()), key
    loaded = dcp.load_checkpoint(tmp_path / "c")
    assert np.array_equal(loaded["emoji😀"].asnumpy(), [7, 7])


@pytest.mark.parametrize("state, named", [
    ({"w\udc80": ms.Tensor(np.ones(3, np.float32)), "ok": ms.Tensor(np.ones(2, np.float32))}, "'w\\udc80'"),
    ({"ok": ms.Tensor(np.ones(2, np.float32)), "opt": {"\ud800x": [1, 2]}}, "'opt.\\ud800x.0'"),
], ids=["tensor", "nested-value"])
def test_a_key_with_a_lone_surrogate_is_refused_before_writing(tmp_path, state, named):
    with pytest.raises(dcp.CheckpointValueError) as caught:
        dcp.save(state, checkpoint_id=tmp_path / "c", no_dist=True)
    message = str(caught.value)
    assert f"checkpoint key {named} holds a lone surrogate" in message and "rename the key" in message, message
    assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")
