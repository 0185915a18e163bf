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
        f"{src}/rank_0/net.ckpt and {src}/rank_1/net.ckpt hold the same values, and so do the slices of every "
        f"parameter it splits (2 checked: 'dense.bias', 'dense.weight'; in {src}/rank_0/net.ckpt, "
        f"{src}/rank_1/net.ckpt): the rank files look like whole tensors, not slices. If they were saved with "
        "MindSpore's save_checkpoint(..., integrated_save=True) (ModelCheckpoint's default, which gathers them), "
        "importing them with the strategy would make tensors of global shape [1024, 256]: import them as whole "
        f"tensors, without --strategy: hp-ckpt import {src} OUT --whole-tensors. If they are slices that are equal "
        "(experts copied from one layer, saved before training), import them with the strategy and "
        "--slices-may-be-equal (replicas are still compared)")
    assert not (tmp_path / "out").exists()
    # MindSpore's own merge of these files: tensors of twice the rows, silently.
    mindspore.parallel.transform_checkpoints(str(src), str(tmp_path / "ms"), "m_", strategy, None)
    merged = mindspore.load_checkpoint(str(tmp_path / "ms" / "rank_0" / "m_0.ckpt"))
    assert merged["dense.weight"].shape == (1024, 256)
    # The advised import gives the tensors, each stored once.
    assert main(["import", str(src), str(tmp_path / "whole"), "--whole-tensors"]) == 0
    loaded = _load(tmp_path / "whole")
    assert all(np.array_equal(loaded[name], value) for name, value in full.items())
    stored = dcp.read_metadata(tmp_path / "whole").storage_data
    assert sum(info.length for info in stored.values()) == sum(value.nbytes for value in full.values())
    # The caller's choice: slices equal by design.
    assert main(["import", str(src), str(tmp_path / "unchecked"), "--strategy", strategy, "--no-check-replicas"]) == 0
    assert _load(tmp_path / "unchecked")["dense.weight"].shape == (1024, 256)


def test_whole_tensors_held_at_other_offsets_of_their_files_are_refused(tmp_path):
    # Rank 1's file holds global_step first, so dense.weight starts at another offset within a page than in
    # rank 0's: both copies are sampled at the same positions of the tensor's bytes all the same (they were not,
    # and the copies were imported silently as slices of a [1024, 256] tensor).
    rng = np.random.default_rng(3)
    weight, step = rng.standard_normal((512, 256)).astype(np.float32), np.array([5], np.int32)
    strategy = write_strategy_file(tmp_path / "strategy.ckpt", (ParamStrategy("dense.weight", (2,), (0, -1)),))
    src = _ranks(tmp_path, {0: {"dense.weight": weight, "global_step": step},
                            1: {"global_step": step, "dense.weight": weight}})
    with pytest.raises(LayoutError, match="hold the same values, and so do the slices of every parameter it splits"):
        import_checkpoint(src, tmp_path / "out", strategy_files=[strategy])
    assert not (tmp_path / "out").exists()


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


def test_whole_tensors_of_a_pipeline_job_are_imported_from_each_stage_with_copies_compared(tmp_path):
    """integrated_save under pipeline parallel: each stage's ranks hold that stage's tensors whole."""
    rng = np.random.default_rng(2)
    stage0 = {"embed.weight": rng.standard_normal((1024, 512)).astype(np.float32), "global_step": np.array([7])}
    stage1 = {"head.weight": rng.standard_normal((512, 64)).astype(np.float32), "global_step": np.array([7])}
    src = _ranks(tmp_path, {0: stage0, 1: stage0, 2: stage1, 3: stage1})
    import_checkpoint(src, tmp_path / "out", whole_tensors=True)
    loaded = _load(tmp_path / "out")
    assert sorted(loaded) == ["embed.weight", "global_step", "head.weight"]
    assert np.array_equal(loaded["embed.weight"], stage0["embed.weight"])
    assert np.array_equal(loaded["head.weight"], stage1["head.weight"])
    # A copy that differs (rank 3's file of another step) is refused, naming both files, before a byte is written.
    later = dict(stage1, **{"head.weight": stage1["head.weight"] + 1})
    other = tmp_path / "steps"
    other.mkdir()
    src = _ranks(other, {0: stage0, 1: stage0, 2: stage1, 3: later})
    with pytest.raises(LayoutError) as refused:
        import_checkpoint(src, other / "out", whole_tensors=True)
    assert (f"parameter 'head.weight' is not in the strategy file but ranks [3] hold other values than rank 2 "
            f"(float32 [512, 64] on each; files: rank 2 {src}/rank_2/net.ckpt, rank 3 {src}/rank_3/net.ckpt)"
            ) in str(refused.value), refused.value
    assert not (other / "out").exists()
    # Slices (integrated_save=False) given as whole tensors: refused, the advice names --strategy instead.
    sliced = tmp_path / "sliced"
    sliced.mkdir()
    src_sliced = _ranks(sliced, {rank: {"head.weight": stage1["head.weight"][rank * 256:(rank + 1) * 256]}
                                 for rank in range(2)})
    with pytest.raises(LayoutError) as refused:
        import_checkpoint(src_sliced, sliced / "out", whole_tensors=True)
    assert ("either it is sliced (slices of one shape; rank 0's would be stored as the whole tensor): pass the "
            "strategy file(s) that list it with --strategy (one per pipeline stage), not --whole-tensors; or the rank "
            "files are of different steps") in str(refused.value), refused.value
    assert not (sliced / "out").exists()
    # --whole-tensors with a strategy, or without rank files; rank files with neither.
    with pytest.raises(dcp.CheckpointValueError, match="not both"):
        import_checkpoint(src, other / "out", whole_tensors=True, strategy_files=["s.ckpt"])
    with pytest.raises(dcp.CheckpointValueError, match="--whole-tensors applies to a directory of MindSpore per-rank"):
        import_checkpoint(src / "rank_0" / "net.ckpt", other / "out", whole_tensors=True)
    with pytest.raises(dcp.CheckpointValueError, match="integrated_save=True .MindSpore's default. hold whole "
                                                       "tensors: pass --whole-tensors"):
        import_checkpoint(src, other / "out")
    # --slices-may-be-equal only means something with a strategy over per-rank files.
    with pytest.raises(dcp.CheckpointValueError, match="is imported without a strategy: drop --slices-may-be-equal"):
        import_checkpoint(src, other / "out", whole_tensors=True, slices_may_be_equal=True)
    with pytest.raises(dcp.CheckpointValueError,
                       match=r"--slices-may-be-equal applies to MindSpore per-rank .* is not one"):
        import_checkpoint(src / "rank_0" / "net.ckpt", other / "out", slices_may_be_equal=True)
    assert not (other / "out").exists()


def test_equal_slices_of_an_upcycled_mixture_of_experts_import_with_slices_may_be_equal(tmp_path):
    """Sparse upcycling: every expert a copy of one dense layer, saved before training, the experts split 2 ways.

    The slices are equal, so the files look like whole tensors: refused with both ways out named;
    ``--slices-may-be-equal`` imports them as the strategy says, and still compares the router's replicas.
    """
    rng = np.random.default_rng(4)
    dense = rng.standard_normal((256, 512)).astype(np.float32)
    experts = np.stack([dense] * 4)  # [4, 256, 512]
    router = rng.standard_normal((512, 4)).astype(np.float32)
    strategy = write_strategy_file(tmp_path / "strategy.ckpt", (ParamStrategy("moe.experts", (2,), (0, -1, -1)),
                                                                 ParamStrategy("moe.router", (2,), (-1, -1))))
    src = _ranks(tmp_path, {rank: {"moe.experts": experts[rank * 2:(rank + 1) * 2], "moe.router": router}
                            for rank in range(2)})
    with pytest.raises(LayoutError) as refused:
        import_checkpoint(src, tmp_path / "out", strategy_files=[strategy])
    assert str(refused.value) == (
        f"parameter 'moe.experts': the strategy ({strategy}) splits it into 2 slices of [2, 256, 512], but "
        f"{src}/rank_0/net.ckpt and {src}/rank_1/net.ckpt hold the same values, and so do the slices of every "
        f"parameter it splits (1 checked: 'moe.experts'; in {src}/rank_0/net.ckpt, {src}/rank_1/net.ckpt): the rank "
        "files look like whole tensors, not slices. If they were saved with MindSpore's save_checkpoint(..., "
        "integrated_save=True) (ModelCheckpoint's default, which gathers them), importing them with the strategy "
        f"would make tensors of global shape [4, 256, 512]: import them as whole tensors, without --strategy: "
        f"hp-ckpt import {src} OUT --whole-tensors. If they are slices that are equal (experts copied from one "
        "layer, saved before training), import them with the strategy and --slices-may-be-equal (replicas are "
        "still compared)")
    assert not (tmp_path / "out").exists()
    assert main(["import", str(src), str(tmp_path / "moe"), "--strategy", strategy, "--slices-may-be-equal"]) == 0
    loaded = _load(tmp_path / "moe")
    assert np.array_equal(loaded["moe.experts"], experts) and np.array_equal(loaded["moe.router"], router)
    # MindSpore's own merge of the slices agrees.
    mindspore.parallel.transform_checkpoints(str(src), str(tmp_path / "ms"), "m_", strategy, None)
    merged = mindspore.load_checkpoint(str(tmp_path / "ms" / "rank_0" / "m_0.ckpt"))
    assert np.array_equal(merged["moe.experts"].asnumpy(), loaded["moe.experts"])
    assert np.array_equal(merged["moe.router"].asnumpy(), loaded["moe.router"])
    # The option skips only that check: a router replica that differs (another step's file) is still refused.
    other = tmp_path / "steps"
    other.mkdir()
    src = _ranks(other, {0: {"moe.experts": experts[:2], "moe.router": router},
                         1: {"moe.experts": experts[2:], "moe.router": router + 1}})
    with pytest.raises(LayoutError) as refused:
        import_checkpoint(src, other / "out", strategy_files=[strategy], slices_may_be_equal=True)
    assert "ranks [1] hold other values than rank 0 for the box at [0, 0]" in str(refused.value), refused.value
    assert not (other / "out").exists()
