"""``hp-ckpt import`` of rank files that hold whole tensors (MindSpore's ``integrated_save=True``) with a strategy.

``save_checkpoint(..., integrated_save=True)`` (MindSpore's default, and ``ModelCheckpoint``'s) gathers every sliced
Parameter under auto parallel, so each rank's file holds the whole tensors while the strategy still describes
slices. Semi-auto parallel does not run on CPU: the files are written by ``mindspore.save_checkpoint`` of the whole
tensors on every rank, which is what such a job writes.
"""

from __future__ import annotations

import os
from pathlib import Path

import mindspore
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli import import_checkpoint, main
from hyper_parallel.core.distributed_checkpoint.errors import LayoutError
from tests.device_io import read_bytes
from tests.strategy_files import ParamStrategy, write_strategy_file

mindspore.set_device("CPU")


def _ranks(root: Path, per_rank: dict[int, dict[str, np.ndarray]]) -> Path:
    for rank, tensors in per_rank.items():
        (root / "ranks" / f"rank_{rank}").mkdir(parents=True)
        mindspore.save_checkpoint([{"name": k, "data": mindspore.Tensor(v)} for k, v in tensors.items()],
                                  str(root / "ranks" / f"rank_{rank}" / "net.ckpt"))
    return root / "ranks"


def _load(path: Path) -> dict[str, np.ndarray]:
    targets = {name: None for name in dcp.read_metadata(path).state_dict_metadata}
    dcp.load(targets, checkpoint_id=path, no_dist=True)
    return targets


def test_whole_tensors_on_every_rank_are_refused_where_transform_checkpoints_doubles_them(tmp_path):
    rng = np.random.default_rng(0)
    full = {"dense.weight": rng.standard_normal((512, 256)).astype(np.float32),
            "dense.bias": np.zeros(512, np.float32),  # a constant: equal as slices too
            "global_step": np.array([5], np.int32)}
    strategy = write_strategy_file(tmp_path / "strategy.ckpt", (ParamStrategy("dense.weight", (2,), (0, -1)),
                                                                 ParamStrategy("dense.bias", (2,), (0,))))
    src = _ranks(tmp_path, {0: full, 1: full})
    with pytest.raises(LayoutError) as refused:
        import_checkpoint(src, tmp_path / "out", strategy_files=[strategy])
    assert str(refused.value) == (
        f"parameter 'dense.weight': the strategy ({strategy}) splits it into 2 slices of [512, 256], but "
        f"{src}/rank_0/net.ckpt and {src}/rank_1/net.ckpt hold the same values, as do the boxes of every parameter "
        "it splits: the rank files hold whole tensors, not slices (MindSpore's save_checkpoint(..., "
        "integrated_save=True), ModelCheckpoint's default, gathers them), and importing them with the strategy would "
        f"make tensors of global shape [1024, 256]. Import one rank's file, without --strategy: hp-ckpt import "
        f"{src}/rank_0/net.ckpt OUT (slices equal by design are imported with --no-check-replicas)")
    assert not (tmp_path / "out").exists()
    # MindSpore's own merge of these files: tensors of twice the rows, silently.
    mindspore.parallel.transform_checkpoints(str(src), str(tmp_path / "ms"), "m_", strategy, None)
    merged = mindspore.load_checkpoint(str(tmp_path / "ms" / "rank_0" / "m_0.ckpt"))
    assert merged["dense.weight"].shape == (1024, 256)
    # The advised import gives the tensors.
    assert main(["import", str(src / "rank_0" / "net.ckpt"), str(tmp_path / "one")]) == 0
    loaded = _load(tmp_path / "one")
    assert all(np.array_equal(loaded[name], value) for name, value in full.items())
    # The caller's choice: slices equal by design.
    assert main(["import", str(src), str(tmp_path / "unchecked"), "--strategy", strategy, "--no-check-replicas"]) == 0
    assert _load(tmp_path / "unchecked")["dense.weight"].shape == (1024, 256)


def test_slices_are_told_from_whole_tensors_by_a_page_each(tmp_path):
    # Real slices: the first parameter split (a constant, moment1 at step 0) has equal boxes, the next differ.
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((1024, 512)).astype(np.float32)
    strategy = write_strategy_file(tmp_path / "strategy.ckpt", (ParamStrategy("dense.weight", (2,), (0, -1)),
                                                                 ParamStrategy("a.ones", (2,), (0,))))
    src = _ranks(tmp_path, {rank: {"a.ones": np.ones(4096, np.float32),
                                   "dense.weight": weight[rank * 512:(rank + 1) * 512]} for rank in range(2)})
    before = read_bytes()
    import_checkpoint(src, tmp_path / "out", strategy_files=[strategy])
    loaded = _load(tmp_path / "out")
    assert np.array_equal(loaded["dense.weight"], weight) and np.array_equal(loaded["a.ones"], np.ones(8192))
    assert read_bytes() - before <= sum(p.stat().st_size for p in src.glob("rank_*/*.ckpt")) + (256 << 10)
    # Constants only (a model at initialisation): equal as slices, imported as the strategy says.
    only = tmp_path / "constants"
    only.mkdir()
    src = _ranks(only, {rank: {"a.ones": np.ones(4096, np.float32)} for rank in range(2)})
    import_checkpoint(src, only / "out", strategy_files=[strategy])
    assert np.array_equal(_load(only / "out")["a.ones"], np.ones(8192))
    assert os.listdir(only / "out")
