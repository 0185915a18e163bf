"""Tests of hyper_parallel.core.dtensor.DTensor with real MindSpore tensors."""

import mindspore
import numpy as np
import pytest
from mindspore.parallel import Layout as MsLayout

from hyper_parallel.core.distributed_checkpoint.errors import LayoutError
from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.core.layout import Layout

mindspore.set_device("CPU")


def _full(shape, dtype=np.float32):
    return np.arange(int(np.prod(shape))).astype(dtype).reshape(shape)


LAYOUTS = {
    "rows": (Layout((4,), (0, -1)), (8, 6)),
    "columns": (Layout((4,), (-1, 0)), (4, 8)),
    "inner_replica": (Layout((2, 4), (1, -1)), (4, 6)),
    "outer_replica": (Layout((2, 4), (0, -1)), (8, 2)),
    "tuple_outer_first": (Layout((2, 2, 2), (2, (1, 0))), (4, 8)),
    "tuple_inner_first": (Layout((2, 2, 2), (2, (0, 1))), (4, 8)),
    "custom_rank_list": (Layout((2, 2), (1, 0), rank_list=(3, 1, 2, 0)), (4, 4)),
    "3d": (Layout((2, 3), (1, -1, 0)), (4, 5, 6)),
    "replicated": (Layout((4,), (-1, -1)), (3, 5)),
    "mindspore": (MsLayout((2, 2, 2), ("dp", "tp", "pp"))("dp", ("tp", "pp")), (4, 8)),
    "scalar": (Layout((2,), ()), ()),
}


def test_wraps_local_tensor():
    local = mindspore.Tensor(_full((2, 8)))
    dt = DTensor(local, Layout((4,), (0, -1)), rank=2)
    assert dt.to_local() is local
    assert dt.shape == (8, 8)
    assert dt.local_shape == (2, 8)
    assert dt.dtype == mindspore.float32
    assert dt.rank == 2
    assert dt.global_offset == (4, 0)
    assert isinstance(dt.layout, Layout)
    assert "DTensor" in repr(dt) and "(8, 8)" in repr(dt)


def test_accepts_parameter_numpy_and_mindspore_layout():
    param = mindspore.Parameter(mindspore.Tensor(_full((2, 2))), name="w")
    ms_layout = MsLayout((2, 2, 2), ("dp", "tp", "pp"))("dp", ("tp", "pp"))
    dt = DTensor(param, ms_layout)
    assert dt.to_local() is param
    assert dt.shape == (4, 8)
    assert dt.layout == Layout((2, 2, 2), (2, (1, 0)), ("dp", "tp", "pp"))
    array = _full((3, 2), np.float16)
    dt = DTensor(array, {"device_matrix": (2,), "tensor_map": (-1, 0)}, global_shape=[3, 4])
    assert dt.to_local() is array and dt.dtype == np.float16 and dt.shape == (3, 4)


def test_default_rank_is_current_rank():
    dt = DTensor(mindspore.Tensor(_full((2, 6))), Layout((4,), (0, -1)))
    assert dt.rank == 0
    assert dt.global_offset == (0, 0)


def test_local_shape_mismatch():
    with pytest.raises(LayoutError) as info:
        DTensor(mindspore.Tensor(_full((3, 8))), Layout((4,), (0, -1)), global_shape=(8, 8))
    assert "(3, 8)" in str(info.value) and "(2, 8)" in str(info.value)
    with pytest.raises(LayoutError, match="dims"):
        DTensor(mindspore.Tensor(_full((2, 8))), Layout((4,), (0,)))
    with pytest.raises(LayoutError, match="dim 0"):
        DTensor(mindspore.Tensor(_full((2, 8))), Layout((4,), (0, -1)), global_shape=(7, 8))


def test_rank_not_in_layout():
    with pytest.raises(LayoutError, match="rank 0"):
        DTensor(mindspore.Tensor(_full((2,))), Layout((2,), (0,), rank_list=(4, 5)), rank=0)
    dt = DTensor(mindspore.Tensor(_full((2,))), Layout((2,), (0,), rank_list=(4, 5)))  # current rank 0
    with pytest.raises(LayoutError, match=r"rank 0 .*\[4, 5\]"):
        _ = dt.global_offset


def test_rejects_non_tensor():
    with pytest.raises(TypeError):
        DTensor([1.0, 2.0], Layout((1,), (-1,)))


def test_from_global_matches_hand_cut():
    full_np = _full((4, 8))
    full = mindspore.Tensor(full_np)
    layout = Layout((2, 2, 2), (2, (0, 1)))
    expected = {
        0: full_np[0:2, 0:2], 1: full_np[0:2, 4:6], 2: full_np[0:2, 2:4], 3: full_np[0:2, 6:8],
        4: full_np[2:4, 0:2], 5: full_np[2:4, 4:6], 6: full_np[2:4, 2:4], 7: full_np[2:4, 6:8],
    }
    for rank, want in expected.items():
        dt = DTensor.from_global(full, layout, rank=rank)
        assert dt.rank == rank and dt.shape == (4, 8)
        np.testing.assert_array_equal(dt.to_local().asnumpy(), want)
    custom = Layout((2, 2), (1, 0), rank_list=(3, 1, 2, 0))
    np.testing.assert_array_equal(DTensor.from_global(full_np[:, 0:4], custom, rank=0).to_local(), full_np[2:4, 2:4])
    three_d = _full((4, 5, 6))
    dt = DTensor.from_global(mindspore.Tensor(three_d), Layout((2, 3), (1, -1, 0)), rank=4)
    np.testing.assert_array_equal(dt.to_local().asnumpy(), three_d[2:4, :, 2:4])
    assert dt.global_offset == (2, 0, 2)


def test_from_global_returns_new_objects():
    full = mindspore.Parameter(mindspore.Tensor(_full((4, 4))), name="p")
    dt = DTensor.from_global(full, Layout((2,), (0, -1)), rank=1)
    local = dt.to_local()
    assert isinstance(local, mindspore.Tensor) and not isinstance(local, mindspore.Parameter)
    local.asnumpy()[...] = -1  # writing the shard must not touch the full tensor
    assert full.asnumpy().min() == 0
    full_np = _full((4, 4))
    dt = DTensor.from_global(full_np, Layout((2,), (0, -1)), rank=1)
    assert isinstance(dt.to_local(), np.ndarray)
    dt.to_local()[...] = -1
    assert full_np.min() == 0
    assert DTensor.from_global(full_np, Layout((2,), (0, -1))).rank == 0


def test_from_global_bfloat16_and_scalar():
    full = mindspore.Tensor(_full((4, 2)), mindspore.bfloat16)
    dt = DTensor.from_global(full, Layout((2,), (0, -1)), rank=1)
    assert dt.dtype == mindspore.bfloat16
    np.testing.assert_array_equal(dt.to_local().float().asnumpy(), _full((4, 2))[2:4, :])
    scalar = DTensor.from_global(mindspore.Tensor(np.float32(3.5)), Layout((2,), ()), rank=1)
    assert scalar.shape == () and scalar.local_shape == () and scalar.global_offset == ()
    assert float(scalar.to_local().asnumpy()) == 3.5


def test_from_global_uneven_raises():
    with pytest.raises(LayoutError, match="dim 1"):
        DTensor.from_global(mindspore.Tensor(_full((4, 6))), Layout((4,), (-1, 0)), rank=0)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_from_global_reassembles_and_replicas_agree(name):
    layout_obj, shape = LAYOUTS[name]
    layout = Layout.from_any(layout_obj)
    full_np = _full(shape)
    full = mindspore.Tensor(full_np)
    rebuilt = np.full(shape, np.nan, dtype=np.float32)
    shards = {}
    for rank in layout.rank_list:
        dt = DTensor.from_global(full, layout_obj, rank=rank)
        local = dt.to_local().asnumpy()
        window = tuple(slice(o, o + n) for o, n in zip(dt.global_offset, dt.local_shape))
        rebuilt[window] = local
        shards.setdefault(layout.shard_index(rank), []).append(local)
    np.testing.assert_array_equal(rebuilt, full_np)
    assert len(shards) == layout.num_shards()
    for index, copies in shards.items():
        assert len(copies) == len(layout.ranks_holding(index))
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])
