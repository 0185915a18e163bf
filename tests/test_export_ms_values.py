"""``hp-ckpt export-mindspore`` writes int / float / bool values as MindSpore's own checkpoints hold them: 0-d
tensors that ``mindspore.load_checkpoint`` returns (``epoch_num``, ``step_num``, ``learning_rate``...)."""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli import export_mindspore, main
from strategy_files import ParamStrategy, write_json_strategy_file

__all__: list[str] = []

ms.set_device("CPU")

#: What a MindSpore training job passes as ``append_dict`` (step_num above 2**53: exact as Int64).
APPEND = {"epoch_num": 3, "step_num": 2**53 + 1, "learning_rate": 0.1, "loss_scale_on": True}


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_exported_numbers_load_through_mindspore_as_its_own_save_stores_them(tmp_path: Path, capsys, fmt: str):
    """The numbers were left out with a note: a resume through MindSpore from the exported file had no epoch_num,
    step_num or learning_rate. Now load_checkpoint returns them with the dtype and shape MindSpore's own
    save_checkpoint(append_dict=...) gives them; what MindSpore cannot hold is still noted."""
    ms.set_seed(1)
    net = nn.Dense(3, 2)
    state = {"net": net, **APPEND, "global_step": np.int32(7), "huge": 2**70, "too_big": 1e300, "nothing": None,
             "tag": "run-1"}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt")
    ms.save_checkpoint(net, str(tmp_path / f"native.{fmt}"), append_dict=dict(APPEND), format=fmt)
    native = ms.load_checkpoint(str(tmp_path / f"native.{fmt}"), format=fmt)

    code = main(["export-mindspore", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--format", fmt])
    out = capsys.readouterr().out
    assert code == 0
    loaded = ms.load_checkpoint(str(tmp_path / "out" / f"checkpoint.{fmt}"), format=fmt)
    for key, value in APPEND.items():
        assert isinstance(loaded[key], ms.Parameter), key
        assert (loaded[key].dtype, loaded[key].shape) == (native[key].dtype, native[key].shape) == (
            ms.Tensor(value).dtype, ()), key
        assert loaded[key].asnumpy().item() == native[key].asnumpy().item(), key
    assert loaded["step_num"].asnumpy().item() == 2**53 + 1
    assert loaded["learning_rate"].asnumpy().item() == np.float32(0.1)
    assert loaded["global_step"].dtype == ms.int32 and loaded["global_step"].asnumpy().item() == 7
    np.testing.assert_array_equal(loaded["net.weight"].asnumpy(), net.weight.asnumpy())

    notes = {line.split("'")[1]: line for line in out.splitlines() if line.startswith("note: ")}
    assert sorted(notes) == sorted(["huge", "too_big", "nothing"] + (["tag"] if fmt == "safetensors" else []))
    assert "does not fit MindSpore's Int64" in notes["huge"] and "overflows MindSpore's Float32" in notes["too_big"]
    assert not {"huge", "too_big", "nothing"} & set(loaded)
    assert (loaded["tag"] == "run-1") if fmt == "ckpt" else "safetensors files hold no strings" in notes["tag"]


def test_exported_numbers_reach_every_rank_file(tmp_path: Path):
    """With a destination strategy every rank file holds the numbers (as transform_checkpoints copies
    global_step into each rank's file)."""
    dcp.save({"w": np.arange(8, dtype=np.float32).reshape(4, 2), "epoch_num": 5, "learning_rate": 0.25,
              "global_step": np.int64(2**60 + 3)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    strategy = tmp_path / "strategy.json"
    write_json_strategy_file(strategy, (ParamStrategy("w", (2,), (0, -1)),))
    result = export_mindspore(tmp_path / "ckpt", tmp_path / "out", strategy_files=[strategy])
    assert result.skipped == ()
    for rank, path in enumerate(result.files):
        loaded = ms.load_checkpoint(path)
        np.testing.assert_array_equal(loaded["w"].asnumpy(), np.arange(8, dtype=np.float32).reshape(4, 2)[
            2 * rank:2 * rank + 2])
        assert loaded["epoch_num"].asnumpy().item() == 5 and loaded["epoch_num"].dtype == ms.int64
        assert loaded["learning_rate"].asnumpy().item() == 0.25 and loaded["learning_rate"].dtype == ms.float32
        assert loaded["global_step"].asnumpy().item() == 2**60 + 3


def test_every_stored_dtype_is_a_mindspore_dtype():
    """export writes a stored numpy scalar with its own dtype: MindSpore must know every dtype this library stores."""
    from hyper_parallel.cli._ms_files import MS_DTYPE_NAMES  # pylint: disable=import-outside-toplevel
    from hyper_parallel.platform.dtypes import DTYPE_NAMES  # pylint: disable=import-outside-toplevel

    assert set(DTYPE_NAMES) <= set(MS_DTYPE_NAMES.values())
