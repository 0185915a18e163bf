"""The one-liners behave like MindSpore's: names, filters, load_param_into_net, one copy per Parameter."""

import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp

ms.set_device("CPU")


class _Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(4, 3)
        self.head = nn.Dense(3, 2)

    def construct(self, x):
        return self.head(self.dense(x))


def _net_and_opt(seed: int) -> tuple[nn.Cell, nn.Optimizer]:
    ms.set_seed(seed)
    net = _Net()
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    for param in opt.parameters_dict().values():  # distinct values everywhere, moments included
        param.set_data(ms.Tensor(np.random.default_rng(seed).standard_normal(param.shape).astype(np.float32)))
    return net, opt


def _train_cell(net: nn.Cell, opt: nn.Optimizer) -> nn.Cell:
    return nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)


def test_keys_and_bytes_match_mindspore_save_checkpoint(tmp_path):
    net, opt = _net_and_opt(1)
    ms.save_checkpoint(_train_cell(net, opt), str(tmp_path / "ms.ckpt"))
    ms_keys = set(ms.load_checkpoint(str(tmp_path / "ms.ckpt")))
    meta = hyper_parallel.save_checkpoint({"model": net, "optimizer": opt}, tmp_path / "ours")
    assert set(meta.state_dict_metadata) == ms_keys
    ms.save_checkpoint(net, str(tmp_path / "net.ckpt"))
    meta = hyper_parallel.save_checkpoint(net, tmp_path / "net")
    assert set(meta.state_dict_metadata) == set(ms.load_checkpoint(str(tmp_path / "net.ckpt")))
    # Each Parameter once: the stored bytes are exactly the parameters' bytes.
    stored = sum(np.prod(m.size) * 4 for m in dcp.read_metadata(tmp_path / "ours").state_dict_metadata.values())
    assert stored == sum(p.asnumpy().nbytes for p in _train_cell(net, opt).parameters_dict().values())


def test_dcp_save_of_model_and_optimizer_stores_each_parameter_once(tmp_path):
    net, opt = _net_and_opt(2)
    meta = dcp.save({"model": net, "optimizer": opt, "step": 7}, checkpoint_id=tmp_path / "c")
    keys = set(meta.state_dict_metadata)
    assert "model.dense.weight" in keys and "optimizer.dense.weight" not in keys
    assert "optimizer.moment1.dense.weight" in keys
    net2, opt2 = _net_and_opt(3)
    dcp.load({"optimizer": opt2}, checkpoint_id=tmp_path / "c")  # the alias resolves to the model's copy
    assert np.array_equal(net2.dense.weight.asnumpy(), net.dense.weight.asnumpy())
    assert np.array_equal(opt2.moment1[0].asnumpy(), opt.moment1[0].asnumpy())


def test_load_param_into_net_accepts_what_load_checkpoint_returns(tmp_path):
    net, opt = _net_and_opt(4)
    hyper_parallel.save_checkpoint({"model": net, "optimizer": opt}, tmp_path / "c", append_dict={"epoch": 3})
    params = hyper_parallel.load_checkpoint(tmp_path / "c")
    assert isinstance(params["dense.weight"], ms.Parameter) and params["dense.weight"].name == "dense.weight"
    assert isinstance(params["epoch"], ms.Parameter) and params["epoch"].asnumpy().item() == 3  # as MindSpore
    net2, opt2 = _net_and_opt(5)
    param_not_load, ckpt_not_load = ms.load_param_into_net(_train_cell(net2, opt2), params)
    assert param_not_load == [] and ckpt_not_load == ["epoch"]
    for name, param in _train_cell(net, opt).parameters_dict().items():
        assert np.array_equal(_train_cell(net2, opt2).parameters_dict()[name].asnumpy(), param.asnumpy()), name


def test_load_into_net_and_optimizer_in_place(tmp_path):
    net, opt = _net_and_opt(6)
    hyper_parallel.save_checkpoint({"model": net, "optimizer": opt, "step": 9}, tmp_path / "c")
    net2, opt2 = _net_and_opt(7)
    target = {"model": net2, "optimizer": opt2, "step": 0}
    loaded = hyper_parallel.load_checkpoint(tmp_path / "c", target)
    assert target["step"] == 9 and loaded["step"].asnumpy().item() == 9
    assert loaded["dense.weight"] is net2.dense.weight
    assert np.array_equal(opt2.moment2[1].asnumpy(), opt.moment2[1].asnumpy())
    assert loaded.param_not_load == [] and loaded.ckpt_not_load == []


def test_filter_specify_choice_func_as_mindspore(tmp_path):
    net, opt = _net_and_opt(8)
    ms.save_checkpoint(_train_cell(net, opt), str(tmp_path / "ms.ckpt"))
    hyper_parallel.save_checkpoint({"model": net, "optimizer": opt}, tmp_path / "c")
    cases = [dict(filter_prefix="moment"), dict(specify_prefix=["dense", "head.bias"]),
             dict(choice_func=lambda n: n.startswith("head")),
             dict(specify_prefix="dense", filter_prefix="dense.bias", choice_func=lambda n: False)]
    for case in cases:
        ours = hyper_parallel.load_checkpoint(tmp_path / "c", **case)
        theirs = ms.load_checkpoint(str(tmp_path / "ms.ckpt"), **case)
        assert set(ours) == set(theirs), case
    with pytest.raises(dcp.CheckpointValueError, match="no key is left"):
        hyper_parallel.load_checkpoint(tmp_path / "c", specify_prefix="nothing")
    with pytest.raises(dcp.CheckpointValueError, match="specify_prefix"):
        hyper_parallel.load_checkpoint(tmp_path / "c", specify_prefix=[""])
    # With a net: filtered-out entries are reported, as load_param_into_net's lists.
    net2, _ = _net_and_opt(9)
    before = net2.head.weight.asnumpy().copy()
    loaded = hyper_parallel.load_checkpoint(tmp_path / "c", net2, filter_prefix="head")
    assert np.array_equal(net2.head.weight.asnumpy(), before)
    assert np.array_equal(net2.dense.weight.asnumpy(), net.dense.weight.asnumpy())
    assert loaded.param_not_load == ["head.weight", "head.bias"]
    assert "head.weight" in loaded.ckpt_not_load and "moment1.dense.weight" in loaded.ckpt_not_load


def test_strict_load_and_prefix_matching(tmp_path):
    net, _ = _net_and_opt(10)
    dcp.save({"model": net}, checkpoint_id=tmp_path / "c")  # keys 'model.dense.weight', ...
    net2, _ = _net_and_opt(11)
    hyper_parallel.load_checkpoint(tmp_path / "c", net2)  # not strict: the 'model.' prefix is found
    assert np.array_equal(net2.head.bias.asnumpy(), net.head.bias.asnumpy())
    with pytest.raises(dcp.CheckpointValueError, match="no entry of net matches") as caught:
        hyper_parallel.load_checkpoint(tmp_path / "c", net2, strict_load=True)
    assert "'dense.weight'" in str(caught.value) and "'model.dense.weight'" in str(caught.value)
    hyper_parallel.save_checkpoint({"w": ms.Parameter(ms.Tensor(np.ones(2, np.float32)), name="w")}, tmp_path / "f")
    half = {"w": ms.Parameter(ms.Tensor(np.zeros(2, np.float16)), name="w")}
    with pytest.raises(dcp.CheckpointValueError, match="strict_load"):
        hyper_parallel.load_checkpoint(tmp_path / "f", half, strict_load=True)
    hyper_parallel.load_checkpoint(tmp_path / "f", half)
    assert half["w"].asnumpy().tolist() == [1.0, 1.0] and half["w"].dtype == ms.float16


def test_partial_load_reports_what_matched(tmp_path, caplog):
    net, _ = _net_and_opt(12)
    hyper_parallel.save_checkpoint(net.dense, tmp_path / "c")  # only 'dense.weight', 'dense.bias'
    bigger = {"dense.weight": ms.Parameter(ms.Tensor(np.zeros((3, 4), np.float32)), name="dense.weight"),
              "extra": ms.Parameter(ms.Tensor(np.zeros(2, np.float32)), name="extra")}
    with pytest.raises(dcp.MissingKeyError) as caught:
        hyper_parallel.load_checkpoint(tmp_path / "c", bigger)
    text = str(caught.value)
    assert "'extra'" in text and "1 of 2 matched" in text and "'dense.weight'" in text and "allow_partial_load" in text
    with caplog.at_level(logging.WARNING):
        loaded = hyper_parallel.load_checkpoint(tmp_path / "c", bigger, allow_partial_load=True)
    assert loaded.param_not_load == ["extra"] and loaded.ckpt_not_load == ["dense.bias"]
    assert "'extra'" in caplog.text
    assert np.array_equal(bigger["dense.weight"].asnumpy(), net.dense.weight.asnumpy())
    with pytest.raises(dcp.CheckpointValueError, match="nothing would load"):
        hyper_parallel.load_checkpoint(tmp_path / "c", {"other": np.zeros(2)}, allow_partial_load=True)


def test_name_clash_between_cells_is_refused(tmp_path):
    a, b = nn.Dense(2, 2), nn.Dense(2, 2)  # both name their Parameters 'weight' / 'bias'
    with pytest.raises(dcp.CheckpointValueError, match="'weight' is both a Parameter of 'a' and of 'b'"):
        hyper_parallel.save_checkpoint({"a": a, "b": b}, tmp_path / "c")
    with pytest.raises(dcp.CheckpointValueError, match="append_dict key 'weight'"):
        hyper_parallel.save_checkpoint(a, tmp_path / "c", append_dict={"weight": 1})


def test_plain_values_come_back_as_mindspore_returns_them(tmp_path):
    net = nn.Dense(2, 2)
    values = {"epoch": 3, "tag": "x", "lr": 0.5, "flag": True}
    ms.save_checkpoint(net, str(tmp_path / "ms.ckpt"), append_dict=values)
    theirs = ms.load_checkpoint(str(tmp_path / "ms.ckpt"))
    hyper_parallel.save_checkpoint(net, tmp_path / "c", append_dict=values)
    ours = hyper_parallel.load_checkpoint(tmp_path / "c")
    assert set(ours) == set(theirs)
    for key in values:
        assert type(ours[key]) is type(theirs[key]), key
        if key != "tag":
            assert ours[key].asnumpy().item() == theirs[key].asnumpy().item() and ours[key].shape == ()
    assert ours["tag"] == "x"
    ms.load_param_into_net(nn.Dense(2, 2), ours)  # accepted, as MindSpore's own dict is


def test_loaded_parameters_require_grad_as_mindspore_gives_them(tmp_path):
    """load_checkpoint gave Parameters with requires_grad=False where mindspore.load_checkpoint gives True
    (load_param_into_net does not copy the flag, but a user building a network from the dict, or an
    optimizer from its Parameters, trained nothing)."""
    net, opt = _net_and_opt(4)
    net.head.bias.requires_grad = False  # saved as such: MindSpore gives True back all the same
    cell = _train_cell(net, opt)
    ms.save_checkpoint(cell, str(tmp_path / "ms.ckpt"), append_dict={"epoch_num": 3, "lr": 0.5})
    theirs = ms.load_checkpoint(str(tmp_path / "ms.ckpt"))
    hyper_parallel.save_checkpoint(cell, tmp_path / "c", append_dict={"epoch_num": 3, "lr": 0.5})
    ours = hyper_parallel.load_checkpoint(tmp_path / "c")
    assert set(ours) == set(theirs)
    assert {k: (type(v).__name__, v.requires_grad) for k, v in ours.items()} == {
        k: (type(v).__name__, v.requires_grad) for k, v in theirs.items()}
    assert all(v.requires_grad for v in ours.values())


def test_an_int_no_mindspore_dtype_holds_comes_back_as_the_int(tmp_path):
    """A 128-bit seed made load_checkpoint raise MindSpore's TypeError: the checkpoint did not load at all."""
    hyper_parallel.save_checkpoint({"w": np.ones(2, np.float32), "seed": 2**100 + 7, "low": -(2**63),
                                    "high": 2**64 - 1}, tmp_path / "c")
    ours = hyper_parallel.load_checkpoint(tmp_path / "c")
    assert ours["seed"] == 2**100 + 7 and type(ours["seed"]) is int
    assert ours["low"].asnumpy().item() == -(2**63) and ours["high"].asnumpy().item() == 2**64 - 1
    np.testing.assert_array_equal(ours["w"].asnumpy(), np.ones(2, np.float32))


def test_dcp_checkpoint_of_model_and_optimizer_loads_through_the_one_liner(tmp_path):
    net, opt = _net_and_opt(13)
    dcp.save({"model": net, "optimizer": opt, "step": 4}, checkpoint_id=tmp_path / "c")
    net2, opt2 = _net_and_opt(14)
    loaded = hyper_parallel.load_checkpoint(tmp_path / "c", {"model": net2, "optimizer": opt2})
    assert loaded.param_not_load == [] and loaded.ckpt_not_load == ["step"]
    np.testing.assert_array_equal(net2.head.weight.asnumpy(), net.head.weight.asnumpy())
    np.testing.assert_array_equal(opt2.moment2[0].asnumpy(), opt.moment2[0].asnumpy())
    np.testing.assert_array_equal(opt2.global_step.asnumpy(), opt.global_step.asnumpy())


def test_bad_arguments_are_refused(tmp_path):
    hyper_parallel.save_checkpoint(nn.Dense(2, 2), tmp_path / "c")
    with pytest.raises(dcp.CheckpointValueError, match="choice_func must be callable"):
        hyper_parallel.load_checkpoint(tmp_path / "c", choice_func="weight")
    with pytest.raises(dcp.CheckpointValueError, match="net must be a mindspore.nn.Cell or a state dict"):
        hyper_parallel.load_checkpoint(tmp_path / "c", [1])


def test_load_checkpoint_refuses_the_casts_mindspore_refuses(tmp_path):
    """A float checkpoint into an int Parameter was truncated silently (MindSpore's load_param_into_net refuses
    it); casts among floats or among ints still convert, as MindSpore does."""
    hyper_parallel.save_checkpoint({"steps": np.array([1.7, 2.9], np.float32), "w": np.ones(2, np.float32),
                                    "n": np.array([3, 4], np.int64)}, tmp_path / "c")
    counter = ms.Parameter(ms.Tensor(np.zeros(2, np.int32)), name="steps")
    with pytest.raises(dcp.CheckpointValueError, match=r"key 'steps': stored as float32, the target 'steps' is int32"):
        hyper_parallel.load_checkpoint(tmp_path / "c", {"steps": counter})
    assert not counter.asnumpy().any()
    half = ms.Parameter(ms.Tensor(np.zeros(2, np.float16)), name="w")
    wide = ms.Parameter(ms.Tensor(np.zeros(2, np.int32)), name="n")
    hyper_parallel.load_checkpoint(tmp_path / "c", {"w": half, "n": wide})
    assert half.asnumpy().tolist() == [1.0, 1.0] and wide.asnumpy().tolist() == [3, 4]


def test_load_checkpoint_refuses_those_casts_into_dtensors_and_sharded_tensors(tmp_path):
    """The dtype check looked at Parameters and arrays only: a DTensor of an int Parameter got a float checkpoint
    truncated, and a ShardedTensor of int8 data got 300.2 wrapped to 44, silently."""
    from hyper_parallel import DTensor, Layout  # pylint: disable=import-outside-toplevel
    # pylint: disable-next=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint.mapping import ShardedTensor

    hyper_parallel.save_checkpoint({"w": np.array([[1.7, -2.6], [3.5, 300.2]], np.float32)}, tmp_path / "c")
    shard = ms.Parameter(ms.Tensor(np.zeros((2, 2), np.int32)), name="w")
    with pytest.raises(dcp.CheckpointValueError, match=r"key 'w': stored as float32, the target 'w' is int32"):
        hyper_parallel.load_checkpoint(tmp_path / "c", {"w": DTensor(shard, Layout((1,), (-1, -1)), (2, 2))})
    assert not shard.asnumpy().any()
    data = np.zeros((2, 2), np.int8)
    with pytest.raises(dcp.CheckpointValueError, match=r"key 'w': stored as float32, the target 'x' is int8"):
        hyper_parallel.load_checkpoint(tmp_path / "c", {"x": ShardedTensor.from_rank_offsets("w", data)})
    assert not data.any()
    half = np.zeros((2, 2), np.float16)  # within the float family, converted as before
    hyper_parallel.load_checkpoint(tmp_path / "c", {"x": ShardedTensor.from_rank_offsets("w", half)})
    np.testing.assert_array_equal(half, np.array([[1.7, -2.6], [3.5, 300.2]], np.float16))


def test_a_directory_of_mindspore_files_is_named_as_such(tmp_path):
    """load_checkpoint of a MindSpore job's checkpoint directory said 'the save did not commit (it crashed or is
    still running); load an earlier checkpoint': a user went looking for a crash. Now the files are named, with
    the converter; a save of ours that did not commit keeps its message."""
    net = nn.Dense(4, 3)
    (tmp_path / "ranks" / "rank_0").mkdir(parents=True)
    (tmp_path / "ranks" / "rank_1").mkdir()
    (tmp_path / "one").mkdir()
    ms.save_checkpoint(net, str(tmp_path / "one" / "net.ckpt"))
    for rank in (0, 1):
        ms.save_checkpoint(net, str(tmp_path / "ranks" / f"rank_{rank}" / "net.safetensors"), format="safetensors")
    with pytest.raises(dcp.IncompleteCheckpointError) as one:
        hyper_parallel.load_checkpoint(tmp_path / "one")
    assert str(one.value) == (
        f"{tmp_path / 'one'} holds MindSpore checkpoint files (net.ckpt), not a checkpoint of hyper_parallel (no "
        "metadata.json): read them with mindspore.load_checkpoint, or convert them once with `hp-ckpt import "
        f"{tmp_path / 'one' / 'net.ckpt'} OUT_DIR` and load OUT_DIR")
    with pytest.raises(dcp.IncompleteCheckpointError, match=r"holds MindSpore checkpoint files \(rank_0/net"
                                                            r"\.safetensors, rank_1/net\.safetensors\).*--strategy"):
        dcp.load({"weight": np.zeros((3, 4), np.float32)}, checkpoint_id=tmp_path / "ranks")
    hyper_parallel.save_checkpoint(net, tmp_path / "ours")
    (tmp_path / "ours" / "metadata.json").unlink()  # our data files without the commit: a save that crashed
    with pytest.raises(dcp.IncompleteCheckpointError, match="the save did not commit"):
        hyper_parallel.load_checkpoint(tmp_path / "ours")


def test_a_directory_of_both_kinds_of_mindspore_file_names_a_command_for_each(tmp_path):
    """A directory holding a .safetensors and a .ckpt file advised `hp-ckpt import DIR OUT_DIR`, which refuses
    such a directory and names two other commands: the user ran a refused command to learn the right ones. The
    load's message now gives both, and each of them imports."""
    from hyper_parallel.cli import import_checkpoint

    net = nn.Dense(4, 3)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    ms.save_checkpoint(net, str(mixed / "net.safetensors"), format="safetensors")
    with pytest.raises(dcp.IncompleteCheckpointError, match=rf"once with `hp-ckpt import {mixed} OUT_DIR` and load"):
        hyper_parallel.load_checkpoint(mixed)  # safetensors files alone: the directory, as before
    ms.save_checkpoint(net, str(mixed / "net.ckpt"))
    with pytest.raises(dcp.IncompleteCheckpointError) as both:
        hyper_parallel.load_checkpoint(mixed)
    assert str(both.value) == (
        f"{mixed} holds MindSpore checkpoint files (net.ckpt, net.safetensors), not a checkpoint of hyper_parallel "
        f"(no metadata.json): read them with mindspore.load_checkpoint, or convert them once with `hp-ckpt import "
        f"{mixed / 'net.safetensors'} OUT_DIR` for the .safetensors files, or `hp-ckpt import {mixed / 'net.ckpt'} "
        "OUT_DIR` for the .ckpt file (the directory itself holds both kinds and is not imported whole) and load OUT_DIR")
    for name in ("net.safetensors", "net.ckpt"):
        import_checkpoint(mixed / name, tmp_path / name, show_progress=False)
        loaded = hyper_parallel.load_checkpoint(tmp_path / name)
        np.testing.assert_array_equal(loaded["weight"].asnumpy(), net.weight.asnumpy())
    ms.save_checkpoint(net, str(mixed / "other.safetensors"), format="safetensors")
    with pytest.raises(dcp.IncompleteCheckpointError, match=(
            rf"`hp-ckpt import {mixed} OUT_DIR` after moving its \.ckpt files out for the \.safetensors files, "
            rf"or `hp-ckpt import {mixed / 'net.ckpt'} OUT_DIR` for the \.ckpt file")):
        dcp.load({"weight": np.zeros((3, 4), np.float32)}, checkpoint_id=mixed)
