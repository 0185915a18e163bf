"""Resharding on load, with the saving ranks simulated in one process."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint._state_items import flat_range_boxes
from sim_ranks import simulate_save

FULL = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)


def _save_layout(path, layout, ranks, full=FULL, name="w"):
    states = [{name: DTensor.from_global(ms.Tensor(full), layout, rank=r)} for r in range(ranks)]
    return simulate_save(states, path)


def _load_layout(path, layout, ranks, full=FULL, name="w"):
    out = []
    for rank in range(ranks):
        shape = layout.local_shape(full.shape)
        param = ms.Parameter(ms.Tensor(np.zeros(shape, full.dtype)), name=name)
        target = DTensor(param, layout, full.shape, rank=rank)
        dcp.load({name: target}, checkpoint_id=path, no_dist=True)
        assert target.to_local() is param
        out.append((target.global_offset, param.asnumpy()))
    return out


@pytest.mark.parametrize(
    "save_layout,save_ranks,load_layout,load_ranks",
    [
        (Layout((2, 2), (1, 0)), 4, Layout((2,), (-1, 0)), 2),  # 2x2 grid -> column split
        (Layout((2, 2), (1, 0)), 4, Layout((2,), (0, -1)), 2),  # 2x2 grid -> row split
        (Layout((4,), (0, -1)), 4, Layout((2, 3), (-1, 0)), 6),  # rows -> 3 columns with a replica dim
        (Layout((2,), (0, -1)), 2, Layout((2, 2), (0, 1), rank_list=(3, 1, 2, 0)), 4),  # custom rank order
        (Layout((2, 2), ((1, 0), -1)), 4, Layout((4,), (-1, 0)), 4),  # multi-axis split -> columns
    ],
)
def test_reshard_any_layout(tmp_path, save_layout, save_ranks, load_layout, load_ranks):
    _save_layout(tmp_path / "c", save_layout, save_ranks)
    for offset, local in _load_layout(tmp_path / "c", load_layout, load_ranks):
        rows, cols = local.shape
        assert np.array_equal(local, FULL[offset[0] : offset[0] + rows, offset[1] : offset[1] + cols])


def test_sharded_to_single_full_and_full_to_sharded(tmp_path):
    _save_layout(tmp_path / "sharded", Layout((2, 2), (0, 1)), 4)
    full = ms.Parameter(ms.Tensor(np.zeros_like(FULL)), name="w")
    dcp.load({"w": full}, checkpoint_id=tmp_path / "sharded", no_dist=True)
    assert np.array_equal(full.asnumpy(), FULL)
    dcp.save({"w": ms.Tensor(FULL)}, checkpoint_id=tmp_path / "full", no_dist=True)
    for offset, local in _load_layout(tmp_path / "full", Layout((2, 2), (1, 0)), 4):
        assert np.array_equal(local, FULL[offset[0] : offset[0] + 4, offset[1] : offset[1] + 6])


def test_reader_reads_only_needed_bytes(tmp_path):
    big = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
    _save_layout(tmp_path / "c", Layout((2,), (0, -1)), 2, full=big)
    for verify in (False, True):
        layout = Layout((2,), (-1, 0))
        param = ms.Parameter(ms.Tensor(np.zeros((64, 128), np.float32)), name="w")
        reader = dcp.FileSystemReader(tmp_path / "c", verify_checksums=verify)
        dcp.load({"w": DTensor(param, layout, big.shape, rank=1)}, storage_reader=reader, no_dist=True)
        assert np.array_equal(param.asnumpy(), big[:, 128:])
        needed = param.asnumpy().nbytes
        if not verify:
            assert reader.bytes_read == needed
        else:
            assert needed <= reader.bytes_read <= 2 * needed


@pytest.mark.parametrize("shape,start,stop", [((4, 5), 3, 17), ((2, 3, 4), 5, 23), ((6,), 1, 4), ((3, 4), 0, 12),
                                              ((2, 3, 4), 0, 24), ((2, 3, 4), 4, 8), ((3, 4), 5, 6)])
def test_flat_range_boxes_cover_range_in_order(shape, start, stop):
    flat = np.arange(int(np.prod(shape))).reshape(shape)
    pieces = [flat[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].reshape(-1)
              for offs, sizes in flat_range_boxes(shape, start, stop)]
    assert np.array_equal(np.concatenate(pieces), np.arange(start, stop))


def test_flattened_range_sharded_tensor_reshards(tmp_path):
    """A distributed-optimizer-style flat split of each shard, saved by 4, loaded as 2 other flat splits."""
    full = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
    states = []
    for rank in range(4):
        shard_rows = slice(0, 2) if rank < 2 else slice(2, 4)
        local = full[shard_rows].reshape(-1)
        rng = slice(0, 5) if rank % 2 == 0 else slice(5, 12)
        st = dcp.ShardedTensor("opt.w", local[rng].copy(), "float32", (2, 6), (4, 6), ((rank // 2) * 2, 0),
                               (2, 1), flattened_range=rng)
        states.append({"state": st})
    simulate_save(states, tmp_path / "c")
    # Load as two ranks, each holding rows 0..3 flattened split 0..13 / 13..24.
    for rng in (slice(0, 13), slice(13, 24)):
        data = np.zeros(rng.stop - rng.start, np.float32)
        target = dcp.ShardedTensor("opt.w", data, "float32", (4, 6), (4, 6), (0, 0), (1, 1), flattened_range=rng)
        dcp.load({"x": target}, checkpoint_id=tmp_path / "c", no_dist=True)
        assert np.array_equal(data, full.reshape(-1)[rng])
