"""The ``metadata_form="auto"`` size estimate counts every checksum digest a save stores.

A tiled chunk lists its tile digests and, since format 2.2, the digests of its
flat blocks too (``flat_digests``). Both estimates (from the plan, and from the
write results of a custom plan at commit) once counted only the flat blocks, or
only ``digests``: the in-line metadata of a save of wide 2-D tensors could be
about twice the size at which ``"auto"`` promises the indexed form.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.core.distributed_checkpoint import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint import _metadata_form
from hyper_parallel.core.distributed_checkpoint._metadata_form import (
    DIGEST_JSON_BYTES,
    ENTRY_JSON_BYTES,
    chunk_digests,
    extra_digests,
    plan_wants_index,
)
from sim_ranks import plan_ranks, simulate_save

BLOCK = 4096


def _states() -> list[dict]:
    return [{
        "wide": np.arange(64 * 2048, dtype=np.float32).reshape(64, 2048),  # 512 KiB: 128 blocks, 16 x 8 tiles
        "small_wide": np.ones((2, 2048), np.float32),  # 16 KiB: 4 blocks, and 1 x 8 tiles
        "one_block": np.ones((1, 1024), np.float32),  # 4 KiB: one block, 1 x 4 tiles of 256 columns
        "cube": np.ones((4, 8, 1024), np.float32),  # 128 KiB: 32 blocks, 4 x 4 tiles
        "narrow": np.ones((1000, 16), np.float32),  # rows of 64 bytes: no tiles, 16 blocks
        "flat": np.ones(5000, np.float32),  # 1-D: 5 blocks
        "step": 7,
    }]


def _stored_extra(metadata) -> tuple[int, int]:
    """(entries, digests beyond one per entry) of a committed in-line metadata, counted from its checksums."""
    entries = extra = 0
    for info in metadata.storage_data.values():
        entries += 1
        extra += len(info.checksum.digests) + len(info.checksum.flat_digests) - 1
    return entries, extra


def test_chunk_digests_by_hand():
    """Flat blocks, plus tiles for a wide chunk of two or more dims (tile shapes worked out by hand)."""
    assert chunk_digests((64, 2048), 4, block_bytes=BLOCK, tiles=True) == 128 + 16 * 8
    assert chunk_digests((64, 2048), 4, block_bytes=BLOCK, tiles=False) == 128
    assert chunk_digests((2, 2048), 4, block_bytes=BLOCK, tiles=True) == 4 + 8
    assert chunk_digests((1, 1024), 4, block_bytes=BLOCK, tiles=True) == 1 + 4
    assert chunk_digests((4, 8, 1024), 4, block_bytes=BLOCK, tiles=True) == 32 + 4 * 4
    assert chunk_digests((1000, 16), 4, block_bytes=BLOCK, tiles=True) == 16
    assert chunk_digests((5000,), 4, block_bytes=BLOCK, tiles=True) == 5
    assert chunk_digests((0, 16), 4, block_bytes=BLOCK, tiles=True) == 1


@pytest.mark.parametrize("tiles", [True, False])
def test_plan_estimate_counts_the_digests_the_save_stores(tmp_path, tiles):
    """The plan-time estimate is 225 bytes per stored entry plus 19 per digest past each entry's first, with the
    digests counted as the save then stores them (tiles and flat blocks); so is the commit-time count."""
    committed, _ = simulate_save(_states(), tmp_path, writer_options={
        "checksum_block_bytes": BLOCK, "metadata_form": "inline", "tile_checksums": tiles})
    entries, extra = _stored_extra(committed)
    tiled = [key.fqn for key, info in committed.storage_data.items() if info.checksum.block_shape]
    assert sorted(tiled) == (["cube", "one_block", "small_wide", "wide"] if tiles else [])
    assert extra == (127 + 128 + 3 + 8 + 0 + 4 + 31 + 16 + 15 + 4 if tiles else 127 + 3 + 0 + 31 + 15 + 4)
    planners, plans = plan_ranks(_states())
    _, metadata = planners[0].build_global_plan(plans)
    assert _metadata_form._inline_estimate(metadata, block_bytes=BLOCK, tiles=tiles) == (entries, extra)
    assert extra_digests(committed.storage_data) == extra


def test_the_writer_decides_with_its_tile_option(tmp_path, monkeypatch):
    """A save whose in-line metadata would be over the threshold only with the tile digests counted is indexed
    when its writer stores tiles, in-line when it does not (the estimate is remembered per tile option)."""
    planners, plans = plan_ranks(_states())
    _, metadata = planners[0].build_global_plan(plans)
    entries, extra = _metadata_form._inline_estimate(metadata, block_bytes=BLOCK, tiles=False)
    monkeypatch.setattr(_metadata_form, "AUTO_INDEX_BYTES", entries * ENTRY_JSON_BYTES + extra * DIGEST_JSON_BYTES)
    tiled = FileSystemWriter(tmp_path / "t", checksum_block_bytes=BLOCK)
    plain = FileSystemWriter(tmp_path / "p", checksum_block_bytes=BLOCK, tile_checksums=False)
    zstd = FileSystemWriter(tmp_path / "z", checksum_block_bytes=BLOCK, compression="zstd")
    for _ in range(2):
        assert tiled.wants_rank_indexes(metadata)
        assert not plain.wants_rank_indexes(metadata)
        assert not zstd.wants_rank_indexes(metadata)  # compressed items are never tiled
    assert plan_wants_index("auto", metadata, block_bytes=BLOCK)
