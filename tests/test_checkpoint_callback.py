"""CheckpointCallback with Model.train: saves, retention, resume into network and optimizer, kill + resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import dataset as ds
from mindspore import nn
from mindspore.train import Callback, Model

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp

ms.set_device("CPU")
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "scripts" / "train_model_example.py"


def _data(steps: int = 3) -> ds.Dataset:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * steps, 3)).astype(np.float32)
    return ds.NumpySlicesDataset({"x": x, "y": x[:, :2].copy()}, shuffle=False).batch(4)


def _model(seed: int = 1) -> tuple[Model, nn.Cell, nn.Optimizer]:
    ms.set_seed(seed)
    net = nn.Dense(3, 2)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.05)
    return Model(net, loss_fn=nn.MSELoss(), optimizer=opt), net, opt


class _Steps(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    def on_train_step_end(self, run_context):
        self.steps.append(int(run_context.original_args().cur_step_num))


def _steps_on_disk(root: Path) -> list[int]:
    return sorted(int(n.split("_")[1]) for n in os.listdir(root) if n.startswith("step_"))


def test_saves_train_network_like_model_checkpoint_and_resumes(tmp_path: Path) -> None:
    model, net, opt = _model()
    callback = hyper_parallel.CheckpointCallback(tmp_path / "run", save_checkpoint_steps=2, keep_checkpoint_max=2,
                                                 append_info=["epoch_num", "step_num", {"tag": "v1"}])
    model.train(2, _data(), callbacks=[callback], dataset_sink_mode=False)  # 6 steps: saves 2, 4, 6
    assert _steps_on_disk(tmp_path / "run") == [4, 6]
    stored = set(dcp.read_metadata(tmp_path / "run" / "step_00000006").state_dict_metadata)
    train_net = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    ms.save_checkpoint(train_net, str(tmp_path / "ms.ckpt"))
    assert stored == set(ms.load_checkpoint(str(tmp_path / "ms.ckpt"))) | {
        "epoch_num", "step_num", "tag", "hyper_parallel.steps_per_epoch"}
    values = hyper_parallel.load_checkpoint(tmp_path / "run" / "step_00000006", specify_prefix=["epoch", "step", "tag"])
    assert {k: v if isinstance(v, str) else v.asnumpy().item() for k, v in values.items()} == {
        "epoch_num": 2, "step_num": 6, "tag": "v1"}
    # A new job: fresh (other) initial values, resumed into network AND optimizer, numbering continues.
    model2, net2, opt2 = _model(seed=2)
    resumed = hyper_parallel.CheckpointCallback(tmp_path / "run", save_checkpoint_steps=2, keep_checkpoint_max=2,
                                                append_info=["step_num", {"note": "resumed"}])  # other extras: fine
    steps = _Steps()
    assert resumed.initial_epoch(3) == 2
    model2.train(3, _data(), callbacks=[resumed, steps], dataset_sink_mode=False, initial_epoch=2)
    assert resumed.resumed_step == 6 and steps.steps == [7, 8, 9]
    assert _steps_on_disk(tmp_path / "run") == [8, 9]  # 9: the last step is always saved at the end
    # The same 3 steps continued in the first job give the same weights and moments.
    model.train(3, _data(), callbacks=[], dataset_sink_mode=False, initial_epoch=2)
    for mine, theirs in zip(list(net2.trainable_params()) + list(opt2.moment1), list(net.trainable_params())
                            + list(opt.moment1)):
        np.testing.assert_array_equal(mine.asnumpy(), theirs.asnumpy())


def test_resume_false_and_no_checkpoint_start_fresh(tmp_path: Path) -> None:
    model, net, _ = _model()
    before = net.weight.asnumpy().copy()
    callback = hyper_parallel.CheckpointCallback(tmp_path, resume=True, async_save=False, save_checkpoint_steps=3)
    assert callback.initial_epoch(3) == 0
    model.train(1, _data(), callbacks=[callback], dataset_sink_mode=False)
    assert callback.resumed_step is None and _steps_on_disk(tmp_path) == [3]
    model2, net2, _ = _model()
    fresh = hyper_parallel.CheckpointCallback(tmp_path, resume=False, save_checkpoint_steps=3)
    assert fresh.initial_epoch(3) == 0
    with pytest.raises(dcp.CheckpointValueError, match=r"already holds committed steps up to 3 and resume=False"):
        model2.train(1, _data(), callbacks=[fresh], dataset_sink_mode=False)  # refused before any step
    assert np.array_equal(net2.weight.asnumpy(), before) and _steps_on_disk(tmp_path) == [3]


def test_save_by_seconds_only_saves_the_end(tmp_path: Path) -> None:
    model, _, _ = _model()
    callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=0, save_checkpoint_seconds=3600)
    model.train(2, _data(), callbacks=[callback], dataset_sink_mode=False)
    assert _steps_on_disk(tmp_path) == [6]


def test_exception_save_keeps_the_last_completed_step(tmp_path: Path) -> None:
    class _Boom(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == 2:
                raise RuntimeError("boom")

    model, net, _ = _model()
    callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=5, exception_save=True,
                                                 append_info=["step_num"])
    with pytest.raises(RuntimeError, match="boom"):
        model.train(1, _data(), callbacks=[callback, _Boom()], dataset_sink_mode=False)
    assert _steps_on_disk(tmp_path) == [] and callback.breakpoint_manager.all_steps() == [2]
    loaded = hyper_parallel.load_checkpoint(tmp_path / "breakpoint_00000002")
    np.testing.assert_array_equal(loaded["weight"].asnumpy(), net.weight.asnumpy())
    assert loaded["step_num"].asnumpy().item() == 2
    model2, _, _ = _model()
    plain = hyper_parallel.CheckpointCallback(tmp_path / "b", save_checkpoint_steps=5)
    with pytest.raises(RuntimeError, match="boom"):
        model2.train(1, _data(), callbacks=[plain, _Boom()], dataset_sink_mode=False)
    assert not (tmp_path / "b").exists() or _steps_on_disk(tmp_path / "b") == []


def test_resume_from_a_modelcheckpoint_directory_warns_that_it_starts_fresh(tmp_path: Path, caplog) -> None:
    """CheckpointCallback(resume=True) on the directory MindSpore's ModelCheckpoint filled: training started from
    the network's current values without a word, as if it had resumed. Now a warning names the files and how to
    load them; the training itself is unchanged (it saves its own steps beside them)."""
    model, net, _ = _model()
    ms.save_checkpoint(net, str(tmp_path / "net-1_4.ckpt"))
    callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=3, async_save=False)
    with caplog.at_level("WARNING", logger="hyper_parallel.core.distributed_checkpoint.callback"):
        model.train(1, _data(), callbacks=[callback], dataset_sink_mode=False)
    warned = [r.getMessage() for r in caplog.records if "MindSpore checkpoint files" in r.getMessage()]
    assert warned == [f"resume=True: {tmp_path} holds no committed step of hyper_parallel, only MindSpore "
                      "checkpoint files (net-1_4.ckpt): training starts from the network's current values. To "
                      "continue from them, load one first (mindspore.load_checkpoint and load_param_into_net) or "
                      "convert it with hp-ckpt import"]
    assert callback.resumed_step is None and _steps_on_disk(tmp_path) == [3]
    caplog.clear()
    model, _, _ = _model()
    with caplog.at_level("WARNING", logger="hyper_parallel.core.distributed_checkpoint.callback"):
        model.train(1, _data(), callbacks=[hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=3)],
                    dataset_sink_mode=False)
    assert not [r for r in caplog.records if "MindSpore checkpoint files" in r.getMessage()]  # resumed from step 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(save_checkpoint_steps=0, keep_checkpoint_max=0), "all 0"),
    (dict(save_checkpoint_steps=-1), "save_checkpoint_steps"),
    (dict(append_info=["loss"]), "append_info"),
    (dict(append_info="epoch_num"), "append_info"),
])
def test_bad_knobs_are_refused(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(dcp.CheckpointValueError, match=match):
        hyper_parallel.CheckpointCallback(tmp_path, **kwargs)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(EXAMPLE), *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def _losses(path: Path) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in map(json.loads, path.read_text().splitlines())]


def test_example_killed_and_resumed_repeats_the_uninterrupted_losses(tmp_path: Path) -> None:
    """README's three commands: shuffled data, saves every 3 steps (inside epochs of 4), killed at step 10."""
    reference = _run(["--ckpt", str(tmp_path / "ref"), "--epochs", "5", "--log", str(tmp_path / "ref.jsonl")])
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = dict(_losses(tmp_path / "ref.jsonl"))
    assert sorted(expected) == list(range(1, 21))
    killed = _run(["--ckpt", str(tmp_path / "run"), "--epochs", "5", "--crash-at", "10",
                   "--log", str(tmp_path / "killed.jsonl")])
    assert killed.returncode == 17, killed.stderr[-3000:]
    assert _losses(tmp_path / "killed.jsonl") == [(s, expected[s]) for s in range(1, 11)]
    resumed = _run(["--ckpt", str(tmp_path / "run"), "--epochs", "5", "--log", str(tmp_path / "resumed.jsonl")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    logged = _losses(tmp_path / "resumed.jsonl")
    first = logged[0][0]
    assert first in (7, 10), "resumed after the newest committed step (6, or 9 if its background commit ended)"
    assert logged == [(s, expected[s]) for s in range(first, 21)], "same batches, same losses, bit for bit"
    assert f"resumed from step {first - 1}; newest step 20" in resumed.stdout
    assert "exact replay" not in resumed.stderr  # no warning: the dataset was positioned
    assert _steps_on_disk(tmp_path / "run") == [15, 18, 20]
    again = _run(["--ckpt", str(tmp_path / "run"), "--epochs", "5"])
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_msrun_two_ranks_sliced_parameters_resume(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from msrun_harness import run_workers  # pylint: disable=import-outside-toplevel
    from strategy_files import ParamStrategy, write_strategy_file  # pylint: disable=import-outside-toplevel

    base = tmp_path / "shared"
    (base / "strategies").mkdir(parents=True)
    write_strategy_file(base / "strategies" / "rows.ckpt",
                        (ParamStrategy("w", (2,), (0, -1)), ParamStrategy("b", (2,), (0,))))
    results = run_workers(ROOT / "tests" / "workers" / "callback_worker.py", workers=2, tmp_path=tmp_path,
                          args=[str(base)], timeout=600)
    for rank, result in enumerate(results):
        assert sorted(result["reference"]) == list(range(1, 17)) and sorted(result["first"]) == list(range(1, 8))
        assert "saved with 4 steps per epoch, but the dataset's size (get_dataset_size()) is 8" in result["refused"]
        assert "resume_dataset" in result["refused"] and "rank 1" in result["refused"], result["refused"]
        # newest committed step 6: 2 batches into epoch 2 of this rank's shuffled shard
        assert result["resumed_step"] == 6 and sorted(result["resumed"]) == list(range(7, 17))
        assert result["inputs"] == {s: result["ref_inputs"][s] for s in range(7, 17)}, f"rank {rank}: same batches"
        assert result["resumed"] == {s: result["reference"][s] for s in range(7, 17)}, f"rank {rank}: same losses"
        np.testing.assert_array_equal(result["w"], result["ref_w"])
        np.testing.assert_array_equal(result["m1"], result["ref_m1"])
        assert result["steps"] == [15, 16]
    assert results[0]["inputs"] != results[1]["inputs"], "each rank trained its own shard"
    # The checkpoint holds the global tensors: each rank's rows, in rank order.
    np.testing.assert_array_equal(results[0]["full_w"], np.concatenate([r["w"] for r in results]))
    np.testing.assert_array_equal(results[0]["full_m1"], np.concatenate([r["m1"] for r in results]))
    assert results[0]["full_w"].shape == (8, 4)
    assert {"w", "b", "moment1.w", "moment2.b", "global_step"} <= set(results[0]["keys"])


def test_resume_inside_an_epoch_warns(tmp_path: Path, caplog) -> None:
    model, _, _ = _model()
    model.train(1, _data(), callbacks=[hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=2)],
                dataset_sink_mode=False)  # 3 steps: saves 2 and 3
    model2, _, _ = _model(seed=5)
    callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=2, resume=True)
    (tmp_path / "step_00000003").rename(tmp_path / ".gone")  # newest committed step is now 2, inside epoch 1
    with caplog.at_level("WARNING"):
        model2.train(2, _data(), callbacks=[callback], dataset_sink_mode=False, initial_epoch=1)
    assert callback.resumed_step == 2 and "inside epoch 1 of 3 steps" in caplog.text
