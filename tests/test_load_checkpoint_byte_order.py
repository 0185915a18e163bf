"""``load_checkpoint(path, net)`` into a dict of numpy arrays of another byte order (``>f4``) succeeds fully.

The arrays were filled, then making the returned Parameters of them raised TypeError (MindSpore wraps arrays of
this machine's byte order only): the caller's arrays changed and the call failed. Now each Parameter holds a copy
of its array in this machine's byte order, and the arrays keep their dtype and hold the values.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.platform.tensor import from_numpy

_STORED = {
    "w": np.arange(6, dtype=np.float32).reshape(2, 3) / 4,
    "i": np.arange(-2, 2, dtype=np.int64) * (1 << 40),
    "h": np.arange(4, dtype=np.float16) - 1.5,
    "u": np.arange(3, dtype=np.uint16) + 258,
    "s": np.array(-7.25, dtype=np.float64),
}


def test_arrays_of_the_other_byte_order_are_filled_and_returned_as_parameters(tmp_path):
    dcp.save(dict(_STORED), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    net = {key: np.zeros(value.shape, dtype=value.dtype.newbyteorder(">")) for key, value in _STORED.items()}
    arrays = dict(net)
    loaded = hyper_parallel.load_checkpoint(tmp_path / "ckpt", net, no_dist=True)
    for key, stored in _STORED.items():
        assert net[key] is arrays[key] and net[key].dtype == stored.dtype.newbyteorder(">"), key
        assert np.array_equal(net[key], stored), key
        value = loaded[key]
        assert isinstance(value, ms.Parameter) and value.name == key, key
        assert value.asnumpy().dtype == stored.dtype and value.asnumpy().tobytes() == stored.tobytes(), key
    assert loaded.param_not_load == [] and loaded.ckpt_not_load == []


def test_from_numpy_copies_an_array_of_the_other_byte_order():
    array = np.array([[1.5, -2.0], [3.25, 4.0]], dtype=">f4")
    tensor = from_numpy(array)
    assert tensor.asnumpy().dtype == np.float32 and tensor.asnumpy().tolist() == array.tolist()
    assert from_numpy(np.array(7, dtype=">i2")).asnumpy().tolist() == 7
    native = np.arange(4, dtype=np.float32)
    assert from_numpy(native).asnumpy().tolist() == native.tolist()
