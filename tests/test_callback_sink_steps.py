"""In dataset sink mode MindSpore calls step end once per sink_size steps: CheckpointCallback saves the first step
end past each multiple of save_checkpoint_steps (MindSpore's ModelCheckpoint also saves off the multiples)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.train.callback import RunContext, _InternalCallbackParam

import hyper_parallel

ms.set_device("CPU")


def _begin(directory: Path, *, save_checkpoint_steps: int, batch_num: int) -> tuple[Any, ...]:
    """A network, its callback parameters and run context as Model.train makes them, and the callback begun."""
    net = nn.Dense(3, 2)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.05)
    callback = hyper_parallel.CheckpointCallback(directory, save_checkpoint_steps=save_checkpoint_steps,
                                                 keep_checkpoint_max=100, async_save=False)
    params = _InternalCallbackParam()
    params.train_network = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    params.optimizer = opt
    params.cur_step_num, params.cur_epoch_num, params.batch_num = 0, 0, batch_num
    context = RunContext(params)
    callback.on_train_begin(context)
    return net, params, context, callback


def test_sink_mode_step_ends_save_the_step_past_each_multiple(tmp_path: Path) -> None:
    """sink_size 7, save_checkpoint_steps 10: only multiples of 10 were saved (every 70 steps), so steps 7 to 63
    saved none and a crash lost them all. Saved: the first step end past 10, 20, ..., 60."""
    net, params, context, callback = _begin(tmp_path, save_checkpoint_steps=10, batch_num=7)
    for step in range(7, 64, 7):
        params.cur_step_num, params.cur_epoch_num = step, step // 7
        net.weight.set_data(ms.Tensor(np.full((2, 3), step, np.float32)))
        callback.on_train_step_end(context)
    steps = sorted(int(n.split("_")[1]) for n in os.listdir(tmp_path) if n.startswith("step_"))
    assert steps == [14, 21, 35, 42, 56, 63]
    hyper_parallel.load_checkpoint(tmp_path / "step_00000035", net)
    assert net.weight.asnumpy()[0, 0] == 35


def test_one_step_per_step_end_saves_the_multiples_only(tmp_path: Path) -> None:
    _, params, context, callback = _begin(tmp_path, save_checkpoint_steps=3, batch_num=4)
    for step in range(1, 11):
        params.cur_step_num = step
        callback.on_train_step_end(context)
    assert sorted(int(n.split("_")[1]) for n in os.listdir(tmp_path) if n.startswith("step_")) == [3, 6, 9]
