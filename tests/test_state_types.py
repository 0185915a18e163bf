"""Everything a MindSpore training state holds: Cells, optimizers, nesting, mapping, values."""

from __future__ import annotations

import re

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp
from sim_ranks import simulate_save


def _train_setup(seed: int):
    ms.set_seed(seed)
    net = nn.SequentialCell(nn.Dense(6, 16), nn.ReLU(), nn.Dense(16, 16), nn.ReLU(), nn.Dense(16, 3))
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    step.set_train()
    return net, opt, step


def _batches(count: int):
    rng = np.random.default_rng(123)
    return [(ms.Tensor(rng.standard_normal((8, 6)).astype(np.float32)),
             ms.Tensor(rng.standard_normal((8, 3)).astype(np.float32))) for _ in range(count)]


def test_trained_network_and_adam_resume_bit_exact(tmp_path):
    batches = _batches(8)
    net, opt, step = _train_setup(seed=1)
    for x, y in batches[:4]:
        step(x, y)
    dcp.save({"model": net, "optimizer": opt, "step": 4}, checkpoint_id=tmp_path / "c")
    reference = [step(x, y).asnumpy().item() for x, y in batches[4:]]

    net2, opt2, step2 = _train_setup(seed=99)  # different initial weights
    params_before = {name: id(p) for name, p in net2.parameters_dict().items()}
    state = {"model": net2, "optimizer": opt2, "step": 0}
    dcp.load(state, checkpoint_id=tmp_path / "c")
    assert state["step"] == 4 and state["model"] is net2
    assert {name: id(p) for name, p in net2.parameters_dict().items()} == params_before
    resumed = [step2(x, y).asnumpy().item() for x, y in batches[4:]]
    assert resumed == reference, "losses after resume must be bit-identical"


def test_nested_state_round_trips_with_types(tmp_path):
    state = {
        "optim": {"state": [{"exp_avg": np.arange(3.0), "count": 2}, {"exp_avg": np.ones(2), "count": 5}],
                  "param_groups": ({"lr": 0.1, "betas": (0.9, 0.999)},)},
        "rng": np.random.default_rng(0).bit_generator.state["state"]["state"],
        "tag": "v1",
    }
    dcp.save(state, checkpoint_id=tmp_path / "c")
    meta = dcp.read_metadata(tmp_path / "c")
    assert "optim.state.0.exp_avg" in meta.state_dict_metadata
    assert "optim.param_groups.0.betas.1" in meta.state_dict_metadata
    target = {
        "optim": {"state": [{"exp_avg": np.zeros(3), "count": 0}, {"exp_avg": np.zeros(2), "count": 0}],
                  "param_groups": ({"lr": 0.0, "betas": (0.0, 0.0)},)},
        "rng": 0,
        "tag": "",
    }
    dcp.load(target, checkpoint_id=tmp_path / "c")
    assert target["optim"]["state"][1]["count"] == 5 and target["optim"]["state"][0]["exp_avg"].tolist() == [0, 1, 2]
    groups = target["optim"]["param_groups"]
    assert type(groups) is tuple and type(groups[0]["betas"]) is tuple and groups[0]["betas"] == (0.9, 0.999)
    assert target["rng"] == state["rng"] and type(target["rng"]) is int and target["tag"] == "v1"


def test_one_line_save_and_load_checkpoint(tmp_path):
    net, _, _ = _train_setup(seed=3)
    hyper_parallel.save_checkpoint(net, tmp_path / "net")
    other, _, _ = _train_setup(seed=4)
    loaded = hyper_parallel.load_checkpoint(tmp_path / "net", net=other)
    for name, param in net.parameters_dict().items():
        assert np.array_equal(other.parameters_dict()[name].asnumpy(), param.asnumpy())
        assert loaded[name] is other.parameters_dict()[name]
    whole = hyper_parallel.load_checkpoint(tmp_path / "net")
    assert sorted(whole) == sorted(net.parameters_dict())
    assert all(isinstance(v, ms.Tensor) for v in whole.values())
    assert np.array_equal(whole["0.weight"].asnumpy(), net.parameters_dict()["0.weight"].asnumpy())
    hyper_parallel.save_checkpoint({"w": ms.Tensor(np.ones(2, np.float32)), "epoch": 3}, tmp_path / "sd")
    back = hyper_parallel.load_checkpoint(tmp_path / "sd")
    assert back["epoch"] == 3 and back["w"].asnumpy().tolist() == [1.0, 1.0]
    with pytest.raises(dcp.CheckpointValueError, match="Cell or a state dict"):
        hyper_parallel.save_checkpoint(42, tmp_path / "bad")


def test_local_nonpersistent_object_is_never_written(tmp_path):
    state = {"w": np.ones(2), "cache": dcp.LocalNonpersistentObject({"big": "local only"})}
    dcp.save(state, checkpoint_id=tmp_path / "c")
    assert "cache" not in dcp.read_metadata(tmp_path / "c").state_dict_metadata
    local = {"mine": 1}
    target = {"w": np.zeros(2), "cache": dcp.LocalNonpersistentObject(local)}
    dcp.load(target, checkpoint_id=tmp_path / "c")
    assert target["cache"] is local and target["w"].tolist() == [1.0, 1.0]


class _Evil:
    """Unpickling it creates a file: the proof that a pickle ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickled_item_never_runs_without_allow_pickle(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(dcp.UnsupportedTypeError) as refused:
        dcp.save({"obj": _Evil(str(marker))}, checkpoint_id=tmp_path / "c")
    assert "'obj'" in str(refused.value) and "allow_pickle" in str(refused.value)
    assert "register" in str(refused.value)
    dcp.save({"obj": _Evil(str(marker))}, checkpoint_id=tmp_path / "c",
             planner=dcp.StandardSavePlanner(allow_pickle=True))
    assert not marker.exists()
    with pytest.raises(dcp.UnsafeCheckpointError, match="allow_pickle") as caught:
        dcp.load({"obj": None}, checkpoint_id=tmp_path / "c")
    assert "'obj'" in str(caught.value)
    with pytest.raises(dcp.UnsafeCheckpointError):
        hyper_parallel.load_checkpoint(tmp_path / "c")
    assert not marker.exists(), "no code from the checkpoint may run"
    target = {"obj": None}
    dcp.load(target, checkpoint_id=tmp_path / "c", planner=dcp.StandardLoadPlanner(allow_pickle=True))
    assert marker.exists(), "with allow_pickle=True the caller asked for it"


def test_sharded_tensor_and_dtensor_are_the_same_global_tensor(tmp_path):
    full = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    states = [{"layers": {"w": dcp.ShardedTensor.from_rank_offsets("decoder.w", full[r * 2:(r + 1) * 2].copy(),
                                                                    (0, r, 4))}} for r in range(4)]
    simulate_save(states, tmp_path / "st")
    assert "decoder.w" in dcp.read_metadata(tmp_path / "st").state_dict_metadata
    layout = hyper_parallel.Layout((2,), (-1, 0))
    for rank in range(2):
        target = hyper_parallel.DTensor(np.zeros((8, 2), np.float32), layout, (8, 4), rank=rank)
        dcp.load({"decoder.w": target}, checkpoint_id=tmp_path / "st", no_dist=True)
        assert np.array_equal(target.to_local(), full[:, rank * 2:(rank + 1) * 2])
    # and back: a DTensor save loads into ShardedTensors (prepend axis and replica included)
    dcp.save({"decoder.w": ms.Tensor(full)}, checkpoint_id=tmp_path / "dt")
    for rank in range(2):
        data = np.zeros((4, 4), np.float32)
        st = dcp.ShardedTensor.from_rank_offsets("decoder.w", data, (0, rank, 2), replica_id=(0, 1))
        dcp.load({"anything": st}, checkpoint_id=tmp_path / "dt", no_dist=True)
        assert np.array_equal(data, full[rank * 4:(rank + 1) * 4])


def test_sharded_object_and_prepend_axis(tmp_path):
    states = []
    for rank in range(2):
        states.append({
            "rng": dcp.ShardedObject("rng_state", {"seed": rank}, (2,), (rank,)),
            "emb": dcp.ShardedTensor.from_rank_offsets("emb", np.full((3,), rank, np.float32), (0, rank, 2),
                                                       prepend_axis_num=1),
            "dup": dcp.ShardedTensor.from_rank_offsets("dup", np.ones(2, np.float32), replica_id=rank),
        })
    metadata, written = simulate_save(states, tmp_path / "c")
    assert metadata.state_dict_metadata["emb"].size == (2, 3)
    assert metadata.state_dict_metadata["rng_state"].shard_offsets == ((0,), (1,))
    assert metadata.state_dict_metadata["dup"].chunks[0].sizes == (2,)
    for rank in range(2):
        target = {"rng": dcp.ShardedObject("rng_state", None, (2,), (rank,)),
                  "emb": dcp.ShardedTensor.from_rank_offsets("emb", np.zeros(3, np.float32), (0, rank, 2),
                                                             prepend_axis_num=1)}
        dcp.load(target, checkpoint_id=tmp_path / "c", no_dist=True)
        assert target["rng"] == {"seed": rank}
        assert target["emb"].data.tolist() == [float(rank)] * 3
    full = np.zeros((2, 3), np.float32)
    dcp.load({"emb": full}, checkpoint_id=tmp_path / "c", no_dist=True)
    assert full.tolist() == [[0.0] * 3, [1.0] * 3]


def test_sharded_objects_of_another_grid_are_refused(tmp_path):
    """Per-rank objects saved by 2 ranks (grid (2,)), loaded by a job of 1 or 4 ranks: rank 0 of a 1-rank job and
    rank 1 of a 4-rank job silently received the objects of ranks 0 and 1 of the saving job (a data loader's
    position over the other half of the data, another rank's RNG state). Megatron refuses another grid."""
    simulate_save([{"rng": dcp.ShardedObject("rng_state", {"seed": rank}, (2,), (rank,))} for rank in range(2)],
                  tmp_path / "c")
    for grid, position in (((1,), (0,)), ((4,), (1,)), ((4,), (3,)), ((2, 1), (1, 0))):
        target = {"rng": dcp.ShardedObject("rng_state", None, grid, position)}
        with pytest.raises(dcp.ShapeMismatchError,
                           match=re.escape(f"grid of shape [2], the target's grid is {list(grid)}")):
            dcp.load(target, checkpoint_id=tmp_path / "c", no_dist=True)
        assert isinstance(target["rng"], dcp.ShardedObject) and target["rng"].data is None
    target = {"rng": dcp.ShardedObject("rng_state", None, (2,), (1,))}  # the saved grid, asked for on purpose
    dcp.load(target, checkpoint_id=tmp_path / "c", no_dist=True)
    assert target["rng"] == {"seed": 1}


def test_sharded_tensor_factory_builds_and_merges(tmp_path):
    weight = np.arange(12, dtype=np.float32).reshape(4, 3)

    def build(key, data, replica_id):
        return {"up": dcp.ShardedTensor.from_rank_offsets(f"{key}.up", data[:2].copy(), replica_id=replica_id),
                "down": dcp.ShardedTensor.from_rank_offsets(f"{key}.down", data[2:].copy(), replica_id=replica_id)}

    def merge(loaded):
        return np.concatenate([loaded["up"].data, loaded["down"].data])

    state = {"fc": dcp.ShardedTensorFactory("fc", weight, build, merge)}
    with pytest.raises(dcp.UnsupportedTypeError, match="apply_factories"):
        dcp.save(dict(state), checkpoint_id=tmp_path / "x")
    original = dict(state)
    dcp.apply_factories(state)
    dcp.save(state, checkpoint_id=tmp_path / "c")
    target = {"fc": dcp.ShardedTensorFactory("fc", np.zeros((4, 3), np.float32), build, merge)}
    factories = dict(target)
    dcp.apply_factories(target)
    dcp.load(target, checkpoint_id=tmp_path / "c")
    merged = dcp.apply_factory_merges(target, factories)
    assert np.array_equal(merged["fc"], weight) and original["fc"].key == "fc"


def test_same_storage_key_twice_is_refused(tmp_path):
    st = dcp.ShardedTensor.from_rank_offsets("k", np.ones(2, np.float32))
    with pytest.raises(dcp.CheckpointValueError, match="both map to checkpoint key 'k'"):
        dcp.save({"a": st, "k": np.ones(2)}, checkpoint_id=tmp_path / "c")


def test_two_main_replicas_of_one_box_on_a_rank_are_refused(tmp_path):
    """Two ShardedTensors (or ShardedObjects) of one key and box, both main replicas, on one rank: the save kept
    one of them silently (the later tensor, the earlier object). Now refused naming both paths, the key and the
    box, sync and async; a copy marked replica_id=1, other boxes or other flat ranges of one key still save."""
    ones, zeros = np.ones(4, np.float32), np.zeros(4, np.float32)
    twice = {"s1": dcp.ShardedTensor.from_rank_offsets("x", ones),
             "s2": dcp.ShardedTensor.from_rank_offsets("x", zeros)}
    objects = {"o1": dcp.ShardedObject("o", {"v": 1}, (2,), (1,)), "o2": dcp.ShardedObject("o", {"v": 2}, (2,), (1,))}
    for save in (dcp.save, lambda *a, **k: dcp.async_save(*a, **k).result()):
        with pytest.raises(dcp.CheckpointValueError) as refused:
            save(twice, checkpoint_id=tmp_path / "twice", no_dist=True)
        assert str(refused.value).startswith("state_dict paths state_dict['s1'] and state_dict['s2'] are both the "
                                             "main replica of checkpoint key 'x' at global offset [0]")
        with pytest.raises(dcp.CheckpointValueError, match=r"'o1'\] and state_dict\['o2'\] .* key 'o' at global "
                                                           r"offset \[1\]"):
            save(objects, checkpoint_id=tmp_path / "objects", no_dist=True)
    assert not (tmp_path / "twice" / "metadata.json").exists()
    copy = {"s1": dcp.ShardedTensor.from_rank_offsets("x", ones),
            "s2": dcp.ShardedTensor.from_rank_offsets("x", ones.copy(), replica_id=1),
            "f1": dcp.ShardedTensor.from_rank_offsets_flat("f", ones[:2].copy(), (4,), flattened_range=slice(0, 2)),
            "f2": dcp.ShardedTensor.from_rank_offsets_flat("f", zeros[2:].copy(), (4,), flattened_range=slice(2, 4))}
    dcp.save(copy, checkpoint_id=tmp_path / "ok", no_dist=True)
    target = {"x": np.full(4, -1, np.float32), "f": np.full(4, -1, np.float32)}
    dcp.load(target, checkpoint_id=tmp_path / "ok", no_dist=True)
    assert target["x"].tolist() == [1.0] * 4 and target["f"].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_one_sharded_tensor_under_two_paths_is_one_box(tmp_path):
    """Tied weights: the same ShardedTensor object at two state-dict paths is one box, not two main replicas."""
    tied = dcp.ShardedTensor.from_rank_offsets("emb", np.arange(6, dtype=np.float32).reshape(2, 3))
    dcp.save({"embedding": {"weight": tied}, "output": {"weight": tied}}, checkpoint_id=tmp_path / "t", no_dist=True)
    target = {"emb": np.zeros((2, 3), np.float32)}
    dcp.load(target, checkpoint_id=tmp_path / "t", no_dist=True)
    assert target["emb"].ravel().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
