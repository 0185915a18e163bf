"""Tile checksums: resharded loads verify exactly what they read."""

from __future__ import annotations

import dataclasses

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.cli import main as cli_main
from hyper_parallel.core.distributed_checkpoint._format.checksum import (
    bad_blocks,
    chunk_checksum,
    flat_expected,
    tile_shape,
)

FULL = np.random.default_rng(7).standard_normal((512, 4096)).astype(np.float32)  # 16 KiB rows, 8 MiB


def test_tile_layout_policy():
    # 16 KiB rows: 8 column groups (the most) of 2 KiB, 512 rows make 1 MiB
    assert tile_shape((512, 4096), 4, 1 << 20) == (512, 512)
    # 4 KiB rows of float32: 4 groups of 1 KiB (the narrowest allowed)
    assert tile_shape((2048, 1024), 4, 1 << 20) == (1024, 256)
    assert tile_shape((1024,), 4, 1 << 20) == ()
    assert tile_shape((64, 100), 4, 1 << 20) == ()  # rows too narrow to split
    assert tile_shape((8, 3, 2048), 2, 1 << 20) == (8, 3, 512)  # 4 KiB rows: 4 groups of 1 KiB
    assert tile_shape((8, 256), 4, 1 << 20) == ()  # 1 KiB rows: one group
    assert tile_shape((8, 3, 4096), 2, 1 << 20) == (8, 3, 512)


def test_tiles_detect_any_flip_and_ignore_none():
    data = memoryview(FULL.tobytes())
    checksum = chunk_checksum(data, 1 << 20, sizes=FULL.shape, itemsize=4)
    assert checksum.block_shape == (512, 512) and len(checksum.digests) == 8
    assert bad_blocks(data, checksum, FULL.shape, 4) == []
    flipped = bytearray(data)
    flipped[3 * 16384 + 9000] ^= 1  # row 3, column byte 9000: first slab, column group of byte 9000
    assert len(bad_blocks(flipped, checksum, FULL.shape, 4)) == 1


def _save_rows(path):
    layout = Layout((2,), (0, -1))
    states = [{"w": DTensor.from_global(ms.Tensor(FULL), layout, rank=r)} for r in range(2)]
    from sim_ranks import simulate_save  # pylint: disable=import-outside-toplevel

    simulate_save(states, path)


def _load_columns(path, rank, verify=True):
    param = ms.Parameter(ms.Tensor(np.zeros((512, 2048), np.float32)), name="w")
    reader = dcp.FileSystemReader(path, verify_checksums=verify)
    dcp.load({"w": DTensor(param, Layout((2,), (-1, 0)), FULL.shape, rank=rank)}, storage_reader=reader, no_dist=True)
    return param.asnumpy(), reader.bytes_read


def test_column_reshard_with_verification_reads_only_needed_bytes(tmp_path):
    _save_rows(tmp_path / "c")
    for rank in range(2):
        local, read = _load_columns(tmp_path / "c", rank)
        assert np.array_equal(local, FULL[:, rank * 2048:(rank + 1) * 2048])
        assert read == local.nbytes, "tile-aligned: verification costs no extra reads"


def test_flip_in_a_tile_is_caught_only_by_loads_that_read_it(tmp_path):
    _save_rows(tmp_path / "c")
    meta = dcp.read_metadata(tmp_path / "c")
    info = meta.storage_data[dcp.MetadataIndex("w", (0, 0))]
    path = tmp_path / "c" / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + 10 * 16384 + 100] ^= 0x10  # row 10, column 25: the left half
    path.write_bytes(bytes(data))
    with pytest.raises(dcp.CorruptCheckpointError, match=r"'w'.*tile"):
        _load_columns(tmp_path / "c", 0)
    right, _ = _load_columns(tmp_path / "c", 1)  # the right half never touches the damaged tile
    assert np.array_equal(right, FULL[:, 2048:])
    assert cli_main(["verify", str(tmp_path / "c")]) == 1
    whole = np.zeros_like(FULL)
    with pytest.raises(dcp.CorruptCheckpointError):
        dcp.load({"w": whole}, checkpoint_id=tmp_path / "c", no_dist=True)


def test_flat_checksums_still_load_and_option_off(tmp_path):
    dcp.save({"w": FULL}, storage_writer=dcp.FileSystemWriter(tmp_path / "flat", tile_checksums=False))
    info = next(iter(dcp.read_metadata(tmp_path / "flat").storage_data.values()))
    assert info.checksum.block_shape == ()
    target = np.zeros((512, 2048), np.float32)
    st = dcp.ShardedTensor.from_rank_offsets("w", target, (1, 1, 2))
    reader = dcp.FileSystemReader(tmp_path / "flat")
    dcp.load({"w": st}, storage_reader=reader, no_dist=True)
    assert np.array_equal(target, FULL[:, 2048:]) and reader.bytes_read == FULL.nbytes  # whole blocks
    assert cli_main(["verify", str(tmp_path / "flat")]) == 0


def test_format_md_tile_example_matches_the_writer():
    """docs/format.md section 7.2's worked example is what the writer chooses."""
    assert tile_shape((512, 4096), 4, 1 << 20) == (512, 512)
    assert tile_shape((512, 4096), 2, 1 << 20) == (512, 512)  # bf16: 8 groups of 1 KiB
    assert tile_shape((512, 512), 2, 1 << 20) == ()  # rows of 1 KiB: under 2 KiB, flat blocks


def test_flat_blocks_are_checked_against_flat_digests_of_a_tiled_chunk_only():
    """A tiled chunk's flat blocks are checked against its flat_digests, never its tile digests (a format 2.1
    tiled chunk has none: nothing to check flat blocks against); a flat chunk's against its digests."""
    data = np.arange(64 * 512, dtype=np.float32).reshape(64, 512)
    view = memoryview(data.reshape(-1).view(np.uint8))
    tiled = chunk_checksum(view, 8192, sizes=(64, 512), itemsize=4)
    assert tiled.block_shape and flat_expected(tiled) == tiled.flat_digests and len(tiled.flat_digests) == 16
    assert tiled.digests != tiled.flat_digests
    flat = chunk_checksum(view, 8192, sizes=(64, 512), itemsize=4, tiles=False)
    assert flat_expected(flat) == flat.digests == tiled.flat_digests
    old = dataclasses.replace(tiled, flat_digests=())
    assert flat_expected(old) == ()
    assert bad_blocks(view, old, None, 4) == list(range(16))  # no flat digest to match
