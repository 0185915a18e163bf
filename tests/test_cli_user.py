"""hp-ckpt for everyday work: convert selection and renames, plain values shown, list of a manager's steps."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn
from safetensors import safe_open

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli import KeySelection, list_steps
from hyper_parallel.cli.main import main
from s3_server import new_filesystem, s3_endpoint, s3_url  # noqa: F401  (fixtures)

ms.set_device("CPU")


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _keys(out: Path) -> dict[str, str]:
    return json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.fixture(name="recipe")
def _recipe(tmp_path: Path) -> Path:
    """The README recipe: {"model": net, "optimizer": opt, "step": 100}."""
    ms.set_seed(0)
    net = nn.SequentialCell([nn.Dense(4, 3), nn.Dense(3, 2)])
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    dcp.save({"model": net, "optimizer": opt, "step": 100}, checkpoint_id=tmp_path / "c")
    return tmp_path / "c"


def test_convert_model_only_by_default_and_all(recipe: Path, tmp_path: Path, capsys) -> None:
    code, out, _ = _run(capsys, "convert", recipe, tmp_path / "hf")
    assert code == 0
    assert sorted(_keys(tmp_path / "hf")) == ["0.bias", "0.weight", "1.bias", "1.weight"]  # 'model.' stripped
    assert "not selected" in out and "'optimizer.moment1.0.weight'" in out
    code, _, _ = _run(capsys, "convert", recipe, tmp_path / "all", "--all")
    keys = set(_keys(tmp_path / "all"))
    assert "model.0.weight" in keys and "optimizer.moment2.1.bias" in keys and "optimizer.0.weight" not in keys
    with safe_open(str(tmp_path / "all" / "model.safetensors"), framework="numpy") as handle:
        assert handle.metadata()["step"] == "100"


def test_convert_include_exclude_strip_rename(recipe: Path, tmp_path: Path, capsys) -> None:
    code, _, _ = _run(capsys, "convert", recipe, tmp_path / "a", "--all", "--include", "model.*",
                      "--exclude", "*.bias", "--strip-prefix", "model.", "--rename", "0.=encoder.")
    assert code == 0 and sorted(_keys(tmp_path / "a")) == ["1.weight", "encoder.weight"]
    with safe_open(str(tmp_path / "a" / "model.safetensors"), framework="numpy") as handle:
        weight = handle.get_tensor("encoder.weight")
    whole = {"model": {"0": {"weight": np.zeros((3, 4), np.float32)}}}
    dcp.load(whole, checkpoint_id=recipe, planner=dcp.StandardLoadPlanner(allow_partial_load=True))
    np.testing.assert_array_equal(weight, whole["model"]["0"]["weight"])
    code, _, err = _run(capsys, "convert", recipe, tmp_path / "b", "--all", "--include", "*0.weight",
                        "--rename", "model.=", "--rename", "optimizer.moment1.=")
    assert code == 2 and "'model.0.weight' and 'optimizer.moment1.0.weight' would both be written as '0.weight'" in err
    assert not (tmp_path / "b").exists()  # refused before anything is written
    code, _, err = _run(capsys, "convert", recipe, tmp_path / "c2", "--rename", "nonsense")
    assert code == 2 and "OLD_PREFIX=NEW_PREFIX" in err


def test_selection_names_still_takes_the_keys_or_the_metadata(tmp_path: Path) -> None:
    """KeySelection.names keeps taking what it took before de64b2f: the keys alone (a list: optimizer state told
    by the patterns) or the metadata's key -> storage entries (shapes read from the entries); on main a list raised
    AttributeError and metadata entries kept ASGD's eta_/mu_ state as model weights."""
    net = nn.Dense(3, 2)
    state = {name: p for name, p in net.parameters_and_names()}
    state.update({"moment1.weight": ms.Tensor(np.ones((2, 3), np.float32)),
                  "linear.weight": ms.Tensor(np.ones((2, 3), np.float32)),  # FTRL's state of 'weight'
                  "eta_weight": ms.Tensor(np.float32(0.5)), "epoch": 3})
    dcp.save(state, checkpoint_id=tmp_path / "c")
    metadata = dcp.read_metadata(tmp_path / "c")
    assert KeySelection().names(["weight", "bias", "moment1.weight", "epoch"]) == {
        "bias": "bias", "epoch": "epoch", "weight": "weight"}
    assert KeySelection().names(metadata.state_dict_metadata) == {
        "bias": "bias", "epoch": "epoch", "weight": "weight"}
    assert set(KeySelection(everything=True).names(metadata.state_dict_metadata)) == set(state)


def test_selection_without_model_group_drops_optimizer_state() -> None:
    keys = {"dense.weight": (2, 3), "moment1.dense.weight": (2, 3), "beta1_power": (), "global_step": (1,),
            "learning_rate": (), "epoch": None}
    assert KeySelection().names(keys) == {"dense.weight": "dense.weight", "epoch": "epoch"}
    assert set(KeySelection(everything=True).names(keys)) == set(keys)


def test_inspect_and_diff_print_plain_values(tmp_path: Path, capsys) -> None:
    dcp.save({"w": np.ones(2, np.float32), "epoch": 10, "tag": "run-a", "lr": np.float32(0.5)},
             checkpoint_id=tmp_path / "a")
    dcp.save({"w": np.ones(2, np.float32), "epoch": 11, "tag": "run-a", "lr": np.float32(0.5)},
             checkpoint_id=tmp_path / "b")
    code, out, _ = _run(capsys, "inspect", tmp_path / "a")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert rows["epoch"].rstrip().endswith("10") and rows["tag"].rstrip().endswith("'run-a'")
    assert rows["lr"].rstrip().endswith("0.5")
    code, out, _ = _run(capsys, "inspect", "--json", tmp_path / "a")
    values = {v["key"]: v["value"] for v in json.loads(out)["values"]}
    assert values == {"epoch": "10", "lr": "0.5", "tag": "'run-a'"}
    code, out, _ = _run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert code == 1 and "10 vs 11" in out and "tag" not in out


def test_list_manager_steps(tmp_path: Path, capsys) -> None:
    manager = dcp.CheckpointManager(tmp_path / "run", max_to_keep=2, keep_every_n_steps=10)
    for step in (10, 11, 12):
        manager.save(step, {"w": np.zeros(256, np.float32)}, metrics={"loss": step / 10})
    crashed = manager.directory(13)
    crashed.mkdir()
    (crashed / "r00000_000.partial").write_bytes(b"x" * 10)
    entries = list_steps(tmp_path / "run")
    assert [(e.step, e.status, e.keep_forever) for e in entries] == [
        (10, "committed", True), (11, "committed", False), (12, "committed", False), (13, "uncommitted", False)]
    assert entries[0].metrics == {"loss": 1.0} and entries[0].size > 1024 and entries[3].size == 10
    code, out, _ = _run(capsys, "list", tmp_path / "run")
    assert code == 0 and "step_00000013" in out and "uncommitted" in out
    assert "3 committed of 4 step(s)" in out and "newest committed: step_00000012" in out
    code, out, _ = _run(capsys, "list", "--json", tmp_path / "run")
    assert [e["status"] for e in json.loads(out)] == ["committed"] * 3 + ["uncommitted"]
    code, _, err = _run(capsys, "list", manager.directory(10))
    assert code == 2 and "hp-ckpt inspect" in err
    code, _, err = _run(capsys, "list", tmp_path / "nothing")
    assert code == 2 and "does not exist" in err


def test_progress_bars_on_a_terminal(recipe: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, _, err = _run(capsys, "convert", recipe, tmp_path / "hf", "--all")
    assert code == 0 and "convert:" in err and "B" in err  # tqdm counts bytes
    code, _, err = _run(capsys, "diff", recipe, recipe)
    assert code == 0 and "diff:" in err and "key" in err
    code, _, err = _run(capsys, "convert", recipe, tmp_path / "quiet", "--no-progress")
    assert code == 0 and err == ""


def test_list_reports_in_progress_and_damaged_steps(tmp_path: Path, capsys) -> None:
    # pylint: disable-next=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint._save_lease import SaveLease

    manager = dcp.CheckpointManager(tmp_path / "run")
    manager.save(1, {"w": np.zeros(4, np.float32)})
    manager.save(2, {"w": np.zeros(4, np.float32)})
    (manager.directory(2) / "metadata.json").write_text("{broken")
    running = manager.directory(3)
    running.mkdir()
    lease, _ = SaveLease.acquire(running, "metadata.json", "abc123")
    try:
        (tmp_path / "run" / "manager.json").write_text("not a record")  # a damaged record hides no step
        entries = list_steps(tmp_path / "run")
    finally:
        lease.release()
    assert [(e.step, e.status) for e in entries] == [(1, "committed"), (2, "damaged"), (3, "in progress")]
    assert "abc123" in entries[2].detail and entries[1].detail
    code, out, _ = _run(capsys, "list", tmp_path / "run")
    assert code == 0 and "damaged" in out and "1 committed of 3 step(s)" in out


def test_callback_keep_knobs_map_to_the_manager(tmp_path: Path) -> None:
    import hyper_parallel  # pylint: disable=import-outside-toplevel

    per_minutes = hyper_parallel.CheckpointCallback(tmp_path, keep_checkpoint_max=0, keep_checkpoint_per_n_minutes=2)
    assert per_minutes.manager.max_to_keep == 1 and per_minutes.manager.keep_time_interval_seconds == 120.0
    both = hyper_parallel.CheckpointCallback(tmp_path, keep_checkpoint_max=3, keep_checkpoint_per_n_minutes=2)
    assert both.manager.max_to_keep == 3 and both.manager.keep_time_interval_seconds is None  # max wins
    seconds = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=0, save_checkpoint_seconds=30)
    assert seconds.manager.save_interval_steps is None and seconds.manager.save_interval_seconds == 30.0
    steps_win = hyper_parallel.CheckpointCallback(tmp_path, save_checkpoint_steps=5, save_checkpoint_seconds=30)
    assert steps_win.manager.save_interval_steps == 5 and steps_win.manager.save_interval_seconds is None


def test_list_object_store_root(s3_url: str, capsys) -> None:
    manager = dcp.CheckpointManager(s3_url, max_to_keep=2)
    for step in (1, 2, 3):
        manager.save(step, {"w": np.full(64, step, np.float32)})
    fs = new_filesystem()
    fs.pipe(f"{s3_url[5:]}/step_00000004/r00000_000.x.safetensors", b"partial")  # a save in flight
    entries = list_steps(s3_url)
    assert [(e.step, e.status) for e in entries] == [(2, "committed"), (3, "committed"), (4, "in progress")]
    assert entries[0].size > 256 and entries[2].size == 7
    code, out, _ = _run(capsys, "list", s3_url)
    assert code == 0 and "2 committed of 3 step(s)" in out and "newest committed: step_00000003" in out
