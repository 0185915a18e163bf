"""Tests of hyper_parallel.core.layout.Layout against shards cut by hand."""

import json

import mindspore
import numpy as np
import pytest
from mindspore.parallel import Layout as MsLayout

from hyper_parallel.core.distributed_checkpoint.errors import LayoutError
from hyper_parallel.core.layout import Layout

mindspore.set_device("CPU")


def _full(shape):
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)


def _cut(layout, full, rank):
    """The shard the layout says ``rank`` holds, via local_shape/shard_offsets."""
    offsets = layout.shard_offsets(full.shape, rank)
    local = layout.local_shape(full.shape)
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, local))]


# (id, layout, global shape, {rank: expected shard cut by hand})
CASES = [
    (
        "1d_mesh_rows",
        Layout((4,), (0, -1)),
        (8, 6),
        {0: lambda f: f[0:2, :], 1: lambda f: f[2:4, :], 2: lambda f: f[4:6, :], 3: lambda f: f[6:8, :]},
    ),
    (
        "1d_mesh_columns",
        Layout((4,), (-1, 0)),
        (4, 8),
        {0: lambda f: f[:, 0:2], 1: lambda f: f[:, 2:4], 2: lambda f: f[:, 4:6], 3: lambda f: f[:, 6:8]},
    ),
    (
        "2d_mesh_inner_replica",
        Layout((2, 4), (1, -1)),
        (4, 6),
        {
            0: lambda f: f[0:2, :], 1: lambda f: f[0:2, :], 2: lambda f: f[0:2, :], 3: lambda f: f[0:2, :],
            4: lambda f: f[2:4, :], 5: lambda f: f[2:4, :], 6: lambda f: f[2:4, :], 7: lambda f: f[2:4, :],
        },
    ),
    (
        "2d_mesh_outer_replica",
        Layout((2, 4), (0, -1)),
        (8, 2),
        {
            0: lambda f: f[0:2, :], 1: lambda f: f[2:4, :], 2: lambda f: f[4:6, :], 3: lambda f: f[6:8, :],
            4: lambda f: f[0:2, :], 5: lambda f: f[2:4, :], 6: lambda f: f[4:6, :], 7: lambda f: f[6:8, :],
        },
    ),
    (
        "tuple_entry_outer_first",
        Layout((2, 2, 2), (2, (1, 0))),
        (4, 8),
        {
            0: lambda f: f[0:2, 0:2], 1: lambda f: f[0:2, 2:4], 2: lambda f: f[0:2, 4:6], 3: lambda f: f[0:2, 6:8],
            4: lambda f: f[2:4, 0:2], 5: lambda f: f[2:4, 2:4], 6: lambda f: f[2:4, 4:6], 7: lambda f: f[2:4, 6:8],
        },
    ),
    (
        "tuple_entry_inner_first",
        Layout((2, 2, 2), (2, (0, 1))),
        (4, 8),
        {
            0: lambda f: f[0:2, 0:2], 1: lambda f: f[0:2, 4:6], 2: lambda f: f[0:2, 2:4], 3: lambda f: f[0:2, 6:8],
            4: lambda f: f[2:4, 0:2], 5: lambda f: f[2:4, 4:6], 6: lambda f: f[2:4, 2:4], 7: lambda f: f[2:4, 6:8],
        },
    ),
    (
        "custom_rank_list",
        Layout((2, 2), (1, 0), rank_list=(3, 1, 2, 0)),
        (4, 4),
        {3: lambda f: f[0:2, 0:2], 1: lambda f: f[0:2, 2:4], 2: lambda f: f[2:4, 0:2], 0: lambda f: f[2:4, 2:4]},
    ),
    (
        "offset_rank_list",
        Layout((2,), (0,), rank_list=(8, 9)),
        (6,),
        {8: lambda f: f[0:3], 9: lambda f: f[3:6]},
    ),
    (
        "3d_two_split_dims",
        Layout((2, 3), (1, -1, 0)),
        (4, 5, 6),
        {
            0: lambda f: f[0:2, :, 0:2], 1: lambda f: f[0:2, :, 2:4], 2: lambda f: f[0:2, :, 4:6],
            3: lambda f: f[2:4, :, 0:2], 4: lambda f: f[2:4, :, 2:4], 5: lambda f: f[2:4, :, 4:6],
        },
    ),
    (
        "fully_replicated",
        Layout((4,), (-1, -1)),
        (3, 5),
        {0: lambda f: f[:, :], 1: lambda f: f[:, :], 2: lambda f: f[:, :], 3: lambda f: f[:, :]},
    ),
    (
        "mindspore_layout_tuple",
        Layout.from_any(MsLayout((2, 2, 2), ("dp", "tp", "pp"))("dp", ("tp", "pp"))),
        (4, 8),
        {
            0: lambda f: f[0:2, 0:2], 1: lambda f: f[0:2, 2:4], 2: lambda f: f[0:2, 4:6], 3: lambda f: f[0:2, 6:8],
            4: lambda f: f[2:4, 0:2], 5: lambda f: f[2:4, 2:4], 6: lambda f: f[2:4, 4:6], 7: lambda f: f[2:4, 6:8],
        },
    ),
    (
        "mindspore_layout_swapped",
        Layout.from_any(MsLayout((2, 4), ("dp", "mp"))("mp", "dp")),
        (8, 4),
        {
            0: lambda f: f[0:2, 0:2], 1: lambda f: f[2:4, 0:2], 2: lambda f: f[4:6, 0:2], 3: lambda f: f[6:8, 0:2],
            4: lambda f: f[0:2, 2:4], 5: lambda f: f[2:4, 2:4], 6: lambda f: f[4:6, 2:4], 7: lambda f: f[6:8, 2:4],
        },
    ),
    ("scalar_0d", Layout((2,), ()), (), {0: lambda f: f[()], 1: lambda f: f[()]}),
    ("unsplit_1d", Layout((2,), (-1,)), (5,), {0: lambda f: f[0:5], 1: lambda f: f[0:5]}),
]


@pytest.mark.parametrize("layout, shape, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_shards_match_hand_cut(layout, shape, expected):
    full = _full(shape)
    assert sorted(expected) == sorted(layout.rank_list)
    for rank, cut in expected.items():
        want = cut(full)
        got = _cut(layout, full, rank)
        assert got.shape == want.shape == layout.local_shape(shape)
        np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}")


def test_mesh_coordinate_and_shard_index():
    layout = Layout((2, 2, 2), (2, (1, 0)))
    assert layout.mesh_coordinate(0) == (0, 0, 0)
    assert layout.mesh_coordinate(6) == (1, 1, 0)
    assert layout.shard_index(6) == (1, 2)
    assert Layout((2, 2, 2), (2, (0, 1))).shard_index(6) == (1, 1)
    assert Layout((2, 2), (1, 0), rank_list=(3, 1, 2, 0)).mesh_coordinate(0) == (1, 1)


def test_splits_and_num_shards():
    assert Layout((2, 2, 2), (2, (1, 0))).splits_per_dim() == (2, 4)
    assert Layout((2, 2, 2), (2, (1, 0))).num_shards() == 8
    assert Layout((2, 4), (1, -1)).splits_per_dim() == (2, 1)
    assert Layout((2, 4), (1, -1)).num_shards() == 2
    assert Layout((4,), (-1, -1)).num_shards() == 1
    assert Layout((2,), ()).splits_per_dim() == ()
    assert Layout((2,), ()).num_shards() == 1


def test_replicas():
    inner = Layout((2, 4), (1, -1))
    assert inner.replica_dims() == (1,)
    assert [inner.replica_index(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert inner.ranks_holding((1, 0)) == (4, 5, 6, 7)
    outer = Layout((2, 4), (0, -1))
    assert outer.replica_dims() == (0,)
    assert [outer.replica_index(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert outer.ranks_holding((2, 0)) == (2, 6)
    full = Layout((2, 2), (-1,))
    assert full.replica_dims() == (0, 1)
    assert [full.replica_index(r) for r in range(4)] == [0, 1, 2, 3]
    assert full.ranks_holding((0,)) == (0, 1, 2, 3)
    custom = Layout((2, 2), (-1, 1), rank_list=(3, 1, 2, 0))
    assert custom.ranks_holding((0, 0)) == (3, 1)
    assert custom.ranks_holding((0, 1)) == (2, 0)
    assert custom.replica_index(1) == 1
    with pytest.raises(LayoutError):
        inner.ranks_holding((2, 0))
    with pytest.raises(LayoutError):
        inner.ranks_holding((0,))


def test_construction_normalises_and_compares():
    a = Layout([2, 2], [1, [0]], rank_list=[0, 1, 2, 3])
    b = Layout(device_matrix=(2, 2), tensor_map=(1, (0,)))
    assert a == b and hash(a) == hash(b)
    assert a.device_matrix == (2, 2) and a.tensor_map == (1, (0,)) and a.rank_list == (0, 1, 2, 3)
    with pytest.raises(AttributeError):
        a.device_matrix = (4,)  # frozen


def test_from_any_and_to_dict():
    ms_layout = MsLayout((2, 2, 2), ("dp", "tp", "pp"))("dp", ("tp", "pp"))
    layout = Layout.from_any(ms_layout)
    assert layout.device_matrix == (2, 2, 2)
    assert layout.tensor_map == (2, (1, 0))
    assert layout.alias_name == ("dp", "tp", "pp")
    assert layout.rank_list == tuple(range(8))
    assert Layout.from_any(layout) is layout
    as_dict = layout.to_dict()
    assert set(as_dict) == set(ms_layout.to_dict())
    assert Layout.from_any(as_dict) == layout
    assert Layout.from_any(json.loads(json.dumps(as_dict))) == layout  # lists after JSON
    assert Layout.from_any({"device_matrix": [4], "tensor_map": [0]}) == Layout((4,), (0,))


def test_from_any_rejects():
    with pytest.raises(LayoutError, match="cannot build a Layout"):
        Layout.from_any(42)
    with pytest.raises(LayoutError, match="tensor_map"):
        Layout.from_any({"device_matrix": (2,)})
    with pytest.raises(LayoutError, match="interleaved"):
        Layout.from_any({"device_matrix": (2,), "tensor_map": (0,), "interleaved_parallel": True})


def test_uneven_split_names_tensor_and_dim():
    layout = Layout((4,), (-1, 0))
    with pytest.raises(LayoutError) as info:
        layout.local_shape((8, 6), name="decoder.weight")
    message = str(info.value)
    assert "decoder.weight" in message and "dim 1" in message and "size 6" in message and "4 shards" in message
    with pytest.raises(LayoutError, match="dim 1"):
        layout.shard_offsets((8, 6), 0)
    assert isinstance(info.value, ValueError)


def test_wrong_number_of_dims():
    with pytest.raises(LayoutError, match="'w'.*3 dims"):
        Layout((2,), (0, -1)).local_shape((2, 2, 2), name="w")


def test_rank_not_in_rank_list():
    layout = Layout((2,), (0,), rank_list=(8, 9))
    with pytest.raises(LayoutError) as info:
        layout.shard_offsets((4,), 0)
    assert "rank 0" in str(info.value) and "[8, 9]" in str(info.value)
    with pytest.raises(LayoutError, match="rank 7"):
        Layout((2, 2), (1, 0)).mesh_coordinate(7)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"device_matrix": (2, 2), "tensor_map": (2, -1)}, "out of range"),
        ({"device_matrix": (2, 2), "tensor_map": (-2,)}, "out of range"),
        ({"device_matrix": (2, 2), "tensor_map": ((0, 2),)}, "out of range"),
        ({"device_matrix": (2, 2), "tensor_map": (0, 0)}, "more than once"),
        ({"device_matrix": (2, 2), "tensor_map": (1, (1, 0))}, "more than once"),
        ({"device_matrix": (2, 2), "tensor_map": ((),)}, "empty"),
        ({"device_matrix": (2,), "tensor_map": ("dp",)}, "integer"),
        ({"device_matrix": (2,), "tensor_map": (True,)}, "integer"),
        ({"device_matrix": (2, 0), "tensor_map": (0,)}, ">= 1"),
        ({"device_matrix": (2, 2), "tensor_map": (0,), "rank_list": (0, 1, 2)}, "3 ranks"),
        ({"device_matrix": (2,), "tensor_map": (0,), "rank_list": (1, 1)}, "distinct"),
        ({"device_matrix": (2,), "tensor_map": (0,), "rank_list": (-1, 1)}, "distinct"),
        ({"device_matrix": (2, 2), "tensor_map": (0,), "alias_name": ("dp",)}, "alias_name"),
        ({"device_matrix": (2, 2), "tensor_map": (0,), "alias_name": ("dp", "dp")}, "alias_name"),
    ],
)
def test_bad_layouts(kwargs, fragment):
    with pytest.raises(LayoutError, match=fragment):
        Layout(**kwargs)
