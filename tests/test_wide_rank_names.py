"""Files of ranks 100000 and up (``r100000_000.<save id>.safetensors``) and a rank's 1000th file and up are
swept like the others: the name pattern of the cleanup, S3's leftover sweep and the CLI's rank column once
required exactly 5 rank and 3 counter digits, so these files stayed forever after their save was replaced."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli._common import rank_of_file
from hyper_parallel.core.distributed_checkpoint._object_garbage import owner_of
from s3_server import new_filesystem, s3_endpoint, s3_url  # noqa: F401  (fixtures)


def _wide_names(save_id: str) -> list[str]:
    """Names the writer gives rank 100000's first file, rank 123456's index and rank 0's 1000th file."""
    return [f"r{100000:05d}_{0:03d}.{save_id}.safetensors", f"r{123456:05d}_index.{save_id}.json",
            f"r{0:05d}_{1000:03d}.{save_id}.safetensors"]


def test_names_of_wide_ranks_and_counters_are_data_files() -> None:
    names = _wide_names("0123456789ab")
    assert [owner_of(name) for name in names] == [("0123456789ab", 100000), ("0123456789ab", 123456),
                                                  ("0123456789ab", 0)]
    assert [rank_of_file(name) for name in names] == [100000, 123456, 0]
    assert owner_of("r1000_000.0123456789ab.safetensors") is None  # fewer than 5 rank digits: no writer's name


def test_a_resave_removes_the_replaced_saves_files_of_wide_ranks(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    dcp.save({"w": np.arange(6, dtype=np.float32)}, checkpoint_id=path, no_dist=True)
    replaced = dcp.read_metadata(path).storage_meta.save_id
    other = "7" * 12  # a save that is not replaced (another writer's): never touched
    planted = _wide_names(replaced) + _wide_names(other)
    for name in planted:
        (path / name).write_bytes(b"x" * 16)
    dcp.save({"w": np.full(6, 2, np.float32)}, checkpoint_id=path, no_dist=True)
    left = {p.name for p in path.iterdir()}
    assert not left & set(_wide_names(replaced)), sorted(left)
    assert set(_wide_names(other)) <= left
    loaded = {"w": np.zeros(6, np.float32)}
    dcp.load(loaded, checkpoint_id=path, no_dist=True)
    assert np.array_equal(loaded["w"], np.full(6, 2, np.float32))


def test_an_s3_save_sweeps_leftover_objects_of_wide_ranks(s3_url: str) -> None:  # noqa: F811
    fs = new_filesystem()
    root = s3_url[len("s3://"):]
    dead = "0abcdef01234"  # a save that crashed before committing: its objects are leftovers
    for name in _wide_names(dead):
        fs.pipe_file(f"{root}/{name}", b"x" * 16)
    dcp.save({"w": np.arange(6, dtype=np.float32)}, storage_writer=dcp.FsspecWriter(s3_url), no_dist=True)
    fs.invalidate_cache()
    left = {p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    assert not left & set(_wide_names(dead)), sorted(left)
    assert "metadata.json" in left
