"""exception_save labels the saved state with the step the parameters are at, whatever the callback order."""

from __future__ import annotations

import shutil
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import dataset as ds
from mindspore import nn
from mindspore.train import Model
from train_steps import StepLog

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp

ms.set_device("CPU")


def _data() -> ds.Dataset:
    x = np.random.default_rng(0).standard_normal((16, 3)).astype(np.float32)
    return ds.NumpySlicesDataset({"x": x, "y": x[:, :2].copy()}, shuffle=False).batch(4)


def _model() -> tuple[Model, nn.Cell, nn.Optimizer]:
    ms.set_seed(1)
    net = nn.Dense(3, 2)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.05)
    return Model(net, loss_fn=nn.MSELoss(), optimizer=opt), net, opt


def _weights_after(steps: int) -> np.ndarray:
    """The weight of an uninterrupted run after ``steps`` steps."""
    model, net, _ = _model()
    model.train(1, _data().take(steps), callbacks=[], dataset_sink_mode=False)
    return net.weight.asnumpy().copy()


@pytest.mark.parametrize("async_save", [False, True])
def test_exception_in_an_earlier_callbacks_step_end_saves_the_step_the_weights_are_at(
        tmp_path: Path, async_save: bool) -> None:
    """A callback listed BEFORE the CheckpointCallback raises at the end of step 3 (as LossMonitor does on a NaN
    loss): the network already trained step 3, the CheckpointCallback never saw its end. The saved step must
    hold the weights of the step it is named after."""
    model, net, _ = _model()
    crash = StepLog(crash_at=3)
    callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=10, exception_save=True,
                                                 async_save=async_save, append_info=["step_num"])
    with pytest.raises(RuntimeError, match="killed after step 3"):
        model.train(1, _data(), callbacks=[crash, callback], dataset_sink_mode=False)
    assert not dcp.CheckpointManager(tmp_path).all_steps()
    steps = dcp.CheckpointManager(tmp_path, step_prefix="breakpoint_").all_steps()
    assert len(steps) == 1
    step = steps[0]
    loaded = hyper_parallel.load_checkpoint(tmp_path / f"breakpoint_{step:08d}")
    assert loaded["step_num"].asnumpy().item() == step
    np.testing.assert_array_equal(net.weight.asnumpy(), _weights_after(3))  # the weights at the exception
    np.testing.assert_array_equal(loaded["weight"].asnumpy(), _weights_after(step))
    assert step == 3


class _RaiseAtBegin(StepLog):
    """Raises when step ``crash_at`` begins: the network never runs it."""

    def on_train_step_begin(self, run_context):
        if int(run_context.original_args().cur_step_num) == self.crash_at:
            raise RuntimeError(f"killed before step {self.crash_at}")

    def on_train_step_end(self, run_context):
        pass


@pytest.mark.parametrize("crash_first", [True, False])
def test_exception_before_the_network_ran_saves_the_previous_step(tmp_path: Path, crash_first: bool) -> None:
    """Raised as step 3 begins (before or after this callback saw the begin): the weights are step 2's."""
    model, net, _ = _model()
    crash = _RaiseAtBegin(crash_at=3)
    callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=10, exception_save=True,
                                                 async_save=False, append_info=["step_num"])
    with pytest.raises(RuntimeError, match="killed before step 3"):
        model.train(1, _data(), callbacks=[crash, callback] if crash_first else [callback, crash],
                    dataset_sink_mode=False)
    assert callback.breakpoint_manager.all_steps() == [2] and not callback.manager.all_steps()
    loaded = hyper_parallel.load_checkpoint(tmp_path / "breakpoint_00000002")
    np.testing.assert_array_equal(net.weight.asnumpy(), _weights_after(2))
    np.testing.assert_array_equal(loaded["weight"].asnumpy(), _weights_after(2))
    assert loaded["step_num"].asnumpy().item() == 2


@pytest.mark.parametrize("async_save, resume", [(False, True), (True, True), (False, False)])
def test_a_second_model_train_keeps_the_changes_made_between_the_calls(tmp_path: Path, async_save: bool,
                                                                       resume: bool) -> None:
    """Model.train called again with the same CheckpointCallback (one epoch per call, a learning rate set and
    weights changed by hand in between): the callback does not load back the step it saved itself, which
    would silently undo those changes; step numbers continue."""
    def train_twice(callbacks: list) -> tuple[nn.Cell, nn.Optimizer]:
        model, net, opt = _model()
        model.train(1, _data(), callbacks=callbacks, dataset_sink_mode=False)
        ms.ops.assign(opt.learning_rate, ms.Tensor(np.float32(0.001)))
        net.bias.set_data(ms.Tensor(np.zeros(2, np.float32)))
        model.train(1, _data(), callbacks=callbacks, dataset_sink_mode=False)
        return net, opt

    reference_net, reference_opt = train_twice([])
    callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=2, keep_checkpoint_max=10,
                                                 async_save=async_save, resume=resume, append_info=["step_num"])
    steps = StepLog()
    net, opt = train_twice([callback, steps])
    assert float(opt.learning_rate.asnumpy()) == pytest.approx(0.001)
    np.testing.assert_array_equal(net.weight.asnumpy(), reference_net.weight.asnumpy())
    np.testing.assert_array_equal(net.bias.asnumpy(), reference_net.bias.asnumpy())
    np.testing.assert_array_equal(opt.moment1[0].asnumpy(), reference_opt.moment1[0].asnumpy())
    assert sorted(steps.losses) == list(range(1, 9)), "the second call's steps continue the numbering"
    assert callback.manager.all_steps() == [2, 4, 6, 8]
    loaded = hyper_parallel.load_checkpoint(tmp_path / "step_00000008")
    np.testing.assert_array_equal(loaded["weight"].asnumpy(), reference_net.weight.asnumpy())
    assert loaded["step_num"].asnumpy().item() == 8


def test_append_info_clashing_with_a_parameter_name_is_refused_before_any_step(tmp_path: Path) -> None:
    """append_info {'weight': ...} would replace the network's weight in every saved step: refused."""
    model, net, _ = _model()
    before = net.weight.asnumpy().copy()
    for info, name in [([{"weight": "v1"}], "'weight'"), ([{"note": 1, "learning_rate": 0.5}], "'learning_rate'")]:
        callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=2, async_save=False,
                                                     append_info=info)
        with pytest.raises(dcp.CheckpointValueError, match=f"append_info key\\(s\\) {name} are also names"):
            model.train(1, _data(), callbacks=[callback], dataset_sink_mode=False)
        np.testing.assert_array_equal(net.weight.asnumpy(), before)  # refused when training begins
    assert dcp.CheckpointManager(tmp_path).all_steps() == []


class _NanThenRaise(StepLog):
    """Turns the weights into NaN at the end of step ``crash_at`` and raises (a diverged step, as LossMonitor
    stops it), listed after the CheckpointCallback."""

    def on_train_step_end(self, run_context):
        params = run_context.original_args()
        if int(params.cur_step_num) == self.crash_at:
            weight = params.network.trainable_params()[0]
            weight.set_data(ms.Tensor(np.full(weight.shape, np.nan, np.float32)))
            raise ValueError(f"loss is NaN at step {self.crash_at}")


@pytest.mark.parametrize("async_save", [False, True])
def test_exception_save_deletes_no_earlier_step(tmp_path: Path, async_save: bool) -> None:
    """keep_checkpoint_max=1 and exception_save: the step saved at the exception (its state may be a diverged
    one) is kept apart as breakpoint_<n>, the last good step stays; the next run's saves prune as usual."""
    model, net, _ = _model()
    callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=2, keep_checkpoint_max=1,
                                                 exception_save=True, async_save=async_save)
    with pytest.raises(ValueError, match="NaN"):
        model.train(1, _data(), callbacks=[callback, _NanThenRaise(crash_at=3)], dataset_sink_mode=False)
    assert dcp.CheckpointManager(tmp_path).all_steps() == [2]
    assert dcp.CheckpointManager(tmp_path, step_prefix="breakpoint_").all_steps() == [3]
    good = hyper_parallel.load_checkpoint(tmp_path / "step_00000002")
    np.testing.assert_array_equal(good["weight"].asnumpy(), _weights_after(2))
    assert np.isnan(hyper_parallel.load_checkpoint(tmp_path / "breakpoint_00000003")["weight"].asnumpy()).all()
    manager = dcp.CheckpointManager(tmp_path, max_to_keep=1)
    manager.save(4, {"weight": np.zeros(2, np.float32)})
    assert manager.all_steps() == [4]  # a later save's retention prunes as the policy says
    assert callback.breakpoint_manager.all_steps() == [3]  # and leaves the breakpoint step alone


class _FirstStep(StepLog):
    """Records the number and the weight at the begin of the first step it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.first: tuple[int, np.ndarray] | None = None

    def on_train_step_begin(self, run_context):
        params = run_context.original_args()
        if self.first is None:
            self.first = (int(params.cur_step_num), params.network.trainable_params()[0].asnumpy().copy())


def test_a_retry_after_a_failed_model_train_resumes_from_the_last_saved_step(tmp_path: Path) -> None:
    """The first call raised after step 3 (saved: step 2): the Parameters are past the last saved step, so the
    retry with the same callback loads step 2 back and numbers on from it (as a new process would)."""
    model, net, _ = _model()
    callback = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=2, async_save=False)
    with pytest.raises(RuntimeError, match="killed after step 3"):
        model.train(1, _data(), callbacks=[callback, StepLog(crash_at=3)], dataset_sink_mode=False)
    np.testing.assert_array_equal(net.weight.asnumpy(), _weights_after(3))
    probe = _FirstStep()
    model.train(1, _data(), callbacks=[callback, probe], dataset_sink_mode=False)
    assert probe.first is not None and probe.first[0] == 3
    np.testing.assert_array_equal(probe.first[1], _weights_after(2))
    assert callback.manager.all_steps()[-1] == 6


def test_a_resume_takes_the_last_regular_step_unless_the_breakpoint_is_asked_for(tmp_path: Path) -> None:
    """NaN weights at step 3 with exception_save: the step is saved as breakpoint_00000003. A new job with the
    default resume=True trains on from the last regular step 2 (not from NaN); resume="breakpoint" loads step 3
    when asked; later exception saves keep the newest keep_checkpoint_max breakpoints."""
    knobs = dict(save_checkpoint_steps=2, keep_checkpoint_max=1, exception_save=True, async_save=True)
    root = tmp_path / "run"
    model, _, _ = _model()
    with pytest.raises(ValueError, match="NaN"):
        model.train(1, _data(), callbacks=[hyper_parallel.CheckpointCallback(root, **knobs),
                                           _NanThenRaise(crash_at=3)], dataset_sink_mode=False)
    shutil.copytree(root, tmp_path / "copy")

    model, net, _ = _model()
    net.weight.set_data(ms.Tensor(np.zeros((2, 3), np.float32)))
    plain, probe = hyper_parallel.CheckpointCallback(root, **knobs), _FirstStep()
    assert plain.initial_epoch(4) == 0 and plain.breakpoint_manager.all_steps() == [3]
    with pytest.raises(ValueError, match="NaN at step 7"):
        model.train(2, _data(), callbacks=[plain, probe, _NanThenRaise(crash_at=7)], dataset_sink_mode=False)
    assert plain.resumed_step == 2 and probe.first is not None and probe.first[0] == 3
    np.testing.assert_array_equal(probe.first[1], _weights_after(2))  # the good weights, not the NaN ones
    assert plain.manager.all_steps() == [6] and plain.breakpoint_manager.all_steps() == [7]  # 3 pruned (keep 1)
    assert np.isnan(hyper_parallel.load_checkpoint(plain.breakpoint_manager.directory(7))["weight"].asnumpy()).all()

    model, net, _ = _model()
    asked, probe = hyper_parallel.CheckpointCallback(tmp_path / "copy", resume="breakpoint", **knobs), _FirstStep()
    model.train(1, _data(), callbacks=[asked, probe], dataset_sink_mode=False)
    assert asked.resumed_step == 3 and probe.first is not None and probe.first[0] == 4
    assert np.isnan(probe.first[1]).all()  # what was asked for: the state at the exception
    assert asked.manager.all_steps() == [7] and asked.breakpoint_manager.all_steps() == [3]  # 4 batches: steps 4-7
    weights = {"weight": ms.Parameter(ms.Tensor(np.zeros((2, 3), np.float32)), name="weight")}
    assert asked.breakpoint_manager.load(weights, step=3) == 3 and np.isnan(weights["weight"].asnumpy()).all()


def test_a_breakpoint_of_an_abandoned_run_is_not_what_resume_breakpoint_loads(tmp_path: Path) -> None:
    """Run A: NaN at step 7 (breakpoint 7; regular step 4). Run B resumes from step 4 and raises, healthy, at
    step 5 (breakpoint 5). resume="breakpoint" loaded step 7, run A's NaN state (the highest number), not the
    exception run B just saved; and retention by number kept that stale step 7 over newer breakpoints."""
    knobs = dict(save_checkpoint_steps=4, keep_checkpoint_max=1, exception_save=True, async_save=False)
    model, _, _ = _model()
    with pytest.raises(ValueError, match="NaN at step 7"):
        model.train(2, _data(), callbacks=[hyper_parallel.CheckpointCallback(tmp_path, **knobs),
                                           _NanThenRaise(crash_at=7)], dataset_sink_mode=False)
    assert dcp.CheckpointManager(tmp_path, step_prefix="breakpoint_").all_steps() == [7]

    model, net, _ = _model()
    resumed = hyper_parallel.CheckpointCallback(tmp_path, **knobs)
    with pytest.raises(RuntimeError, match="killed after step 5"):
        model.train(2, _data(), callbacks=[resumed, StepLog(crash_at=5)], dataset_sink_mode=False)
    assert resumed.resumed_step == 4
    at_exception = net.weight.asnumpy().copy()
    assert not np.isnan(at_exception).any()
    assert resumed.breakpoint_manager.all_steps() == [5]  # step 7 belonged to the run step 5 was resumed past

    model, net, _ = _model()
    asked, probe = hyper_parallel.CheckpointCallback(tmp_path, resume="breakpoint", **knobs), _FirstStep()
    model.train(1, _data().take(1), callbacks=[asked, probe], dataset_sink_mode=False)
    assert asked.resumed_step == 5 and probe.first is not None and probe.first[0] == 6
    np.testing.assert_array_equal(probe.first[1], at_exception)


def test_resume_takes_only_true_false_or_breakpoint(tmp_path: Path) -> None:
    for bad in ("yes", 1, None):
        with pytest.raises(dcp.CheckpointValueError, match=r"resume must be True, False or 'breakpoint', got"):
            hyper_parallel.CheckpointCallback(tmp_path, resume=bad)
