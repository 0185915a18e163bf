"""CheckpointCallback.resume_dataset: a run killed after a save inside an epoch resumes exactly (Model.train, CPU)."""

from __future__ import annotations

import logging
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import dataset as ds
from mindspore import nn
from mindspore.dataset import transforms
from mindspore.train import Model, RunContext
from mindspore.train.callback import _InternalCallbackParam  # pylint: disable=protected-access
from train_steps import StepLog

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._resume_position import STEPS_PER_EPOCH_KEY

ms.set_device("CPU")
STEPS_PER_EPOCH, EPOCHS = 4, 3


def _data(kind: str = "sampler", batch: int = 4) -> ds.Dataset:
    """16 rows: sampler-shuffled, or a shuffle buffer plus a random map op (seeded like a real job)."""
    ds.config.set_seed(5)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    data = ds.NumpySlicesDataset({"x": x, "y": x[:, :2].copy()}, shuffle=kind == "sampler")
    if kind == "buffer+random":
        data = data.shuffle(6).map(transforms.RandomApply([transforms.Fill(0.5)], prob=0.5), input_columns="x")
    return data.batch(batch)


def _model(seed: int) -> tuple[Model, nn.Cell, nn.Optimizer]:
    ms.set_seed(seed)
    net = nn.Dense(3, 2)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.05)
    return Model(net, loss_fn=nn.MSELoss(), optimizer=opt), net, opt


def _state(net: nn.Cell, opt: nn.Optimizer) -> list[np.ndarray]:
    return [p.asnumpy().copy() for p in list(net.trainable_params()) + list(opt.moment1) + list(opt.moment2)] + [
        opt.global_step.asnumpy().copy()]


@pytest.mark.parametrize("kind, save_steps, crash_at, sink, async_save, exception_save, resume", [
    ("sampler", 3, 7, False, True, False, True),          # newest step 6: 2 batches into epoch 2
    ("buffer+random", 3, 11, False, False, False, True),  # newest step 9: 1 into epoch 3; shuffle buffer, random op
    ("sampler", 4, 6, True, True, False, True),           # newest step 4: an epoch end of a shuffled dataset; sink
    ("sampler", 3, 10, True, False, False, True),         # newest step 9, inside epoch 3; sink (CPU: not sunk)
    ("sampler", 5, 7, False, True, True, "breakpoint"),   # breakpoint step 7 (exception_save) asked for: 3 into epoch 2
    ("sampler", 5, 7, False, True, True, True),           # a plain resume takes regular step 5, not breakpoint step 7
])
def test_resume_after_a_kill_repeats_the_uninterrupted_run(tmp_path: Path, kind: str, save_steps: int, crash_at: int,
                                                           sink: bool, async_save: bool, exception_save: bool,
                                                           resume: bool | str) -> None:
    model, net, opt = _model(1)
    reference = StepLog()
    model.train(EPOCHS, _data(kind), callbacks=[reference], dataset_sink_mode=sink)
    assert sorted(reference.losses) == list(range(1, 13))
    expected_state = _state(net, opt)

    knobs = dict(save_checkpoint_steps=save_steps, keep_checkpoint_max=10, async_save=async_save,
                 exception_save=exception_save, append_info=["epoch_num", "step_num"], resume=resume)
    model, _, _ = _model(1)
    killed = StepLog(crash_at)
    with pytest.raises(RuntimeError, match="killed"):
        model.train(EPOCHS, _data(kind), callbacks=[hyper_parallel.CheckpointCallback(tmp_path, **knobs), killed],
                    dataset_sink_mode=sink)
    newest = crash_at if resume == "breakpoint" else crash_at // save_steps * save_steps
    saved_steps = list(range(save_steps, crash_at + 1, save_steps))
    assert dcp.CheckpointManager(tmp_path).all_steps() == saved_steps
    assert dcp.CheckpointManager(tmp_path, step_prefix="breakpoint_").all_steps() == ([crash_at] if exception_save
                                                                                      else [])

    model, net, opt = _model(9)  # a new job: other initial values, a dataset built again
    callback = hyper_parallel.CheckpointCallback(tmp_path, **knobs)
    resumed = StepLog()
    data = _data(kind)
    first = callback.resume_dataset(data)
    assert first == newest // STEPS_PER_EPOCH and data.get_init_step() == newest
    model.train(EPOCHS, data, callbacks=[callback, resumed], dataset_sink_mode=sink, initial_epoch=first)
    assert callback.resumed_step == newest
    assert sorted(resumed.losses) == list(range(newest + 1, 13)), "step numbers continue after the saved step"
    assert {s: resumed.inputs[s] for s in resumed.inputs} == {s: reference.inputs[s] for s in resumed.inputs}
    assert resumed.losses == {s: reference.losses[s] for s in range(newest + 1, 13)}, "same losses, bit for bit"
    for mine, theirs in zip(_state(net, opt), expected_state):
        np.testing.assert_array_equal(mine, theirs)
    assert callback.manager.all_steps() == sorted({*saved_steps, *range(save_steps, 13, save_steps), 12})
    assert callback.breakpoint_manager.all_steps() == ([crash_at] if exception_save else [])
    for step in callback.manager.all_steps():  # the saved counters follow the uninterrupted numbering
        saved = hyper_parallel.load_checkpoint(tmp_path / f"step_{step:08d}", specify_prefix=["epoch", "step",
                                                                                              "hyper_parallel"])
        assert {k: v.asnumpy().item() for k, v in saved.items()} == {
            "epoch_num": (step - 1) // STEPS_PER_EPOCH + 1, "step_num": step, STEPS_PER_EPOCH_KEY: STEPS_PER_EPOCH}


def _saved_run(root: Path) -> None:
    """A job saving every 3 steps (4 per epoch) killed after step 7: the newest committed step is 6."""
    model, _, _ = _model(1)
    with pytest.raises(RuntimeError, match="killed"):
        model.train(2, _data(), callbacks=[hyper_parallel.CheckpointCallback(root, save_checkpoint_steps=3),
                                           StepLog(crash_at=7)], dataset_sink_mode=False)


def test_steps_per_epoch_changed_is_refused_before_anything_changes(tmp_path: Path) -> None:
    _saved_run(tmp_path)
    _, net, _ = _model(9)
    before = net.weight.asnumpy().copy()
    callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=3)
    data = _data(batch=2)  # 8 steps per epoch
    with pytest.raises(dcp.CheckpointValueError, match=r"step 6 in .*step_00000006 was saved with 4 steps per epoch, "
                       r"but the dataset's size \(get_dataset_size\(\)\) is 8: .*epoch 2, 2 batches in.*saving run's "
                       r"dataset, batch size and number of shards \(4 steps"):
        callback.resume_dataset(data)
    with pytest.raises(dcp.CheckpointValueError, match="saved with 4 steps per epoch, but steps_per_epoch is 8"):
        callback.initial_epoch(8)
    assert data.get_init_step() == 0 and np.array_equal(net.weight.asnumpy(), before)
    assert callback.initial_epoch(4) == 1 and callback.resume_dataset(_data()) == 1
    ds.config.set_debug_mode(True)  # MindSpore ignores set_init_step in debug mode
    try:
        with pytest.raises(dcp.CheckpointValueError, match=r"after step 6: .*debug mode ignores set_init_step.*"
                                                           r"set_debug_mode\(False\)"):
            callback.resume_dataset(_data())
    finally:
        ds.config.set_debug_mode(False)
    assert not hyper_parallel.CheckpointCallback(tmp_path, resume=False).resume_dataset(data) and (
        data.get_init_step() == 0)


def test_a_step_saved_without_steps_per_epoch_is_positioned_by_the_dataset(tmp_path: Path) -> None:
    dcp.CheckpointManager(tmp_path).save(6, {"w": np.zeros(2, np.float32)})  # e.g. saved by an older version
    data = _data()
    assert hyper_parallel.CheckpointCallback(tmp_path).resume_dataset(data) == 1 and data.get_init_step() == 6
    empty = _data()
    assert hyper_parallel.CheckpointCallback(tmp_path / "new").resume_dataset(empty) == 0
    assert empty.get_init_step() == 0


def test_model_train_not_matching_resume_dataset_is_refused(tmp_path: Path) -> None:
    _saved_run(tmp_path)
    cases = [
        (dict(initial_epoch=0), None, r"Model.train begins at epoch 1, but resume_dataset positioned the dataset "
                                      r"after step 6, in epoch 2: pass initial_epoch=1"),
        (dict(initial_epoch=1), "other", "another dataset object than the one resume_dataset positioned after step 6"),
        (dict(initial_epoch=1, dataset_sink_mode=True, sink_size=2), None,
         "counts 2 steps per epoch .sink_size. but the dataset resume_dataset positioned after step 6 has 4 batches"),
    ]
    for kwargs, other, match in cases:
        model, _, _ = _model(9)
        callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=3)
        data = _data()
        assert callback.resume_dataset(data) == 1
        steps = StepLog()
        with pytest.raises(dcp.CheckpointValueError, match=match):
            model.train(3, _data() if other else data, callbacks=[callback, steps],
                        **{"dataset_sink_mode": False, **kwargs})
        assert not steps.losses, "refused before any step"
    assert dcp.CheckpointManager(tmp_path).all_steps() == [3, 6]


def test_device_sink_mode_refuses_a_step_inside_an_epoch(tmp_path: Path) -> None:
    """On a device, sink mode rounds the dataset back to the epoch's start: refused (CPU never sinks)."""
    _saved_run(tmp_path)
    _, net, opt = _model(9)
    callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=3)
    data = _data()
    callback.resume_dataset(data)
    params = _InternalCallbackParam()  # what Model._train_dataset_sink_process gives its callbacks
    params.train_network, params.optimizer, params.cur_step_num = net, opt, 0
    params.batch_num, params.train_dataset, params.dataset_sink_mode = STEPS_PER_EPOCH, data, True
    with pytest.raises(dcp.CheckpointValueError, match=r"step 6 was saved inside an epoch \(2 of 4 batches\).*"
                                                       "dataset_sink_mode=False"):
        callback.on_train_begin(RunContext(params))


def test_resume_without_resume_dataset_warns_when_inexact(tmp_path: Path, caplog) -> None:
    model, _, _ = _model(1)
    model.train(1, _data(), callbacks=[hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=4)],
                dataset_sink_mode=False)  # step 4: an epoch end
    model, _, _ = _model(9)
    callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=4)
    with caplog.at_level(logging.WARNING):
        model.train(2, _data(), callbacks=[callback], dataset_sink_mode=False, initial_epoch=callback.initial_epoch(4))
    assert callback.resumed_step == 4
    assert "the dataset is shuffled: Model.train restarts it in its first epoch's order" in caplog.text
    assert "initial_epoch=callback.resume_dataset(dataset)" in caplog.text


def test_convert_leaves_the_training_position_out_of_the_model(tmp_path: Path, capsys) -> None:
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel

    from hyper_parallel.cli.main import main  # pylint: disable=import-outside-toplevel

    _saved_run(tmp_path / "run")
    assert STEPS_PER_EPOCH_KEY in dcp.read_metadata(tmp_path / "run" / "step_00000006").state_dict_metadata
    assert main(["convert", str(tmp_path / "run" / "step_00000006"), str(tmp_path / "hf"), "--no-progress"]) == 0
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as handle:
        assert set(handle.keys()) == {"weight", "bias"}
        assert not any("steps_per_epoch" in key for key in handle.metadata() or {})
    assert main(["convert", str(tmp_path / "run" / "step_00000006"), str(tmp_path / "all"), "--all",
                 "--no-progress"]) == 0
    with safe_open(str(tmp_path / "all" / "model.safetensors"), "np") as handle:
        assert handle.metadata()[STEPS_PER_EPOCH_KEY] == "4"
    capsys.readouterr()
