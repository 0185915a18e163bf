"""hp-ckpt export-mindspore of a whole training state: MindSpore's load_param_into_net loads the network's weights,
never an optimizer state that ends with the same name."""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli import export_mindspore, main
from strategy_files import ParamStrategy, write_json_strategy_file

ms.set_device("CPU")


@pytest.mark.parametrize("fmt", ["ckpt"])  # MindSpore lists a safetensors file's keys sorted: see the guide
@pytest.mark.parametrize("groups", [("net", "adam"), ("model", "optimizer"), ("z_model", "a_opt")])
def test_exported_training_state_loads_the_weights_into_the_bare_network(tmp_path: Path, fmt: str,
                                                                         groups: tuple[str, str]) -> None:
    """{"net": net, "adam": opt} exported: MindSpore's non-strict load, looking for 'weight', takes the prefix of
    the first file key ending with it; sorted by name, that was 'adam.moment1.weight': the first moments were
    loaded as the weights, and load_param_into_net reported everything loaded."""
    ms.set_seed(1)
    net = nn.Dense(3, 2)
    opt = nn.Adam(net.trainable_params())
    opt.moment1[0].set_data(ms.Tensor(np.full((2, 3), 7, np.float32)))
    opt.moment1[1].set_data(ms.Tensor(np.full(2, 8, np.float32)))
    model_group, optimizer_group = groups
    dcp.save({model_group: net, optimizer_group: opt}, checkpoint_id=tmp_path / "ckpt")
    export_mindspore(tmp_path / "ckpt", tmp_path / "out", fmt=fmt)
    params = ms.load_checkpoint(str(tmp_path / "out" / f"checkpoint.{fmt}"), format=fmt)
    ms.set_seed(5)
    bare = nn.Dense(3, 2)
    not_loaded, _ = ms.load_param_into_net(bare, params)
    assert not_loaded == []
    np.testing.assert_array_equal(bare.weight.asnumpy(), net.weight.asnumpy())
    np.testing.assert_array_equal(bare.bias.asnumpy(), net.bias.asnumpy())


@pytest.mark.parametrize("order", ["optimizer first", "network first"])
def test_load_checkpoint_dict_gives_load_param_into_net_the_weights(tmp_path: Path, order: str) -> None:
    """hyper_parallel.load_checkpoint(path) then mindspore.load_param_into_net(net, params): the returned dict
    lists the shallowest names first, so MindSpore's prefix search finds 'net.weight' before 'adam.moment1.weight'
    (in the checkpoint's order, a state saved optimizer first gave the network its moments)."""
    import hyper_parallel  # pylint: disable=import-outside-toplevel

    ms.set_seed(1)
    net = nn.Dense(3, 2)
    opt = nn.Adam(net.trainable_params())
    opt.moment1[0].set_data(ms.Tensor(np.full((2, 3), 7, np.float32)))
    state = {"adam": opt, "net": net} if order == "optimizer first" else {"net": net, "adam": opt}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt")
    params = hyper_parallel.load_checkpoint(tmp_path / "ckpt")
    ms.set_seed(5)
    bare = nn.Dense(3, 2)
    not_loaded, _ = ms.load_param_into_net(bare, params)
    assert not_loaded == []
    np.testing.assert_array_equal(bare.weight.asnumpy(), net.weight.asnumpy())


def test_export_names_strategy_parameters_the_checkpoint_lacks(tmp_path, capsys):
    """A destination strategy listing a parameter the checkpoint does not hold exported without a word (the job's
    Parameter silently kept its initial value); listing none of its keys (a checkpoint under 'model.') wrote every
    tensor whole to every rank."""
    dcp.save({"w": np.arange(8, dtype=np.float32).reshape(4, 2), "b": np.ones(2, np.float32)},
             checkpoint_id=tmp_path / "ckpt")
    strategy = write_json_strategy_file(tmp_path / "s.json", (ParamStrategy("w", (2,), (0, -1)),
                                                               ParamStrategy("head", (2,), (0, -1))))
    assert main(["export-mindspore", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--strategy", strategy]) == 0
    out = capsys.readouterr().out
    assert "note: 'head': listed in the destination strategy but not in the checkpoint" in out
    dcp.save({"model": {"w": np.arange(8, dtype=np.float32).reshape(4, 2)}}, checkpoint_id=tmp_path / "prefixed")
    code = main(["export-mindspore", str(tmp_path / "prefixed"), str(tmp_path / "out2"), "--strategy", strategy])
    err = capsys.readouterr().err
    assert code == 2 and "none of the 2 parameter(s)" in err and "'model.w'" in err
    assert not (tmp_path / "out2").exists()
