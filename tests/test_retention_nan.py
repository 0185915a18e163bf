"""Best-k retention with a metric that is NaN (a diverged evaluation): the best steps are never deleted."""

from __future__ import annotations

import math
import os
from pathlib import Path

import mindspore
import numpy as np
import pytest

from hyper_parallel.core.distributed_checkpoint import errors as dcp_errors
from hyper_parallel.core.distributed_checkpoint import load
from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager

mindspore.set_device("CPU")


def _steps_on_disk(root: Path) -> list[int]:
    return sorted(int(n.split("_")[1]) for n in os.listdir(root) if n.startswith("step_"))


@pytest.mark.parametrize("mode, sign", [("min", 1.0), ("max", -1.0)])
def test_nan_metric_ranks_last_and_the_best_steps_stay(tmp_path: Path, mode: str, sign: float) -> None:
    nan = math.nan
    losses = {1: nan, 2: 0.76, 3: nan, 4: 0.45, 5: 0.79, 6: nan}
    manager = CheckpointManager(tmp_path, max_to_keep=2, best_fn=lambda m: sign * m["loss"], best_mode=mode)
    for step, loss in losses.items():
        manager.save(step, {"w": np.full(4, step, dtype=np.float32)}, metrics={"loss": loss})
    # The two best (4: 0.45, 2: 0.76) and the newest (6, what a resume loads); NaN steps rank last.
    assert _steps_on_disk(tmp_path) == [2, 4, 6]
    target = {"w": np.zeros(4, dtype=np.float32)}
    load(target, checkpoint_id=manager.directory(2))
    np.testing.assert_array_equal(target["w"], np.full(4, 2, dtype=np.float32))


def test_two_managers_with_other_prefixes_on_one_root_keep_their_own_records(tmp_path: Path) -> None:
    """A best-k manager (prefix best_) beside the regular one (step_) in one root: each keeps its own record of
    metrics and promises; the regular one's retention no longer erases the other's metrics (its best steps were
    deleted)."""
    regular = CheckpointManager(tmp_path, max_to_keep=2)
    best = CheckpointManager(tmp_path, max_to_keep=2, step_prefix="best_", best_fn=lambda m: m["acc"])
    accuracy = {1: 0.9, 2: 0.5, 3: 0.4, 4: 0.3}
    for step, acc in accuracy.items():
        regular.save(step, {"w": np.full(4, step, dtype=np.float32)})
        best.save(step, {"w": np.full(4, -step, dtype=np.float32)}, metrics={"acc": acc})
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith(("step_", "best_")))
    assert names == ["best_00000001", "best_00000002", "best_00000004", "step_00000003", "step_00000004"]
    target = {"w": np.zeros(4, dtype=np.float32)}
    assert best.load(target, step=1) == 1
    np.testing.assert_array_equal(target["w"], np.full(4, -1, dtype=np.float32))
    from hyper_parallel.cli.list_cmd import list_steps  # pylint: disable=import-outside-toplevel
    listed = {e.name: e.metrics for e in list_steps(tmp_path)}
    assert listed["best_00000001"] == {"acc": 0.9} and listed["step_00000004"] is None


def test_a_root_of_one_prefixed_manager_keeps_its_promises_on_upgrade(tmp_path: Path) -> None:
    """A root whose only manager used another prefix has its record in manager.json: still honoured."""
    first = CheckpointManager(tmp_path, max_to_keep=1, step_prefix="ckpt-", best_fn=lambda m: -m["loss"])
    for step, loss in [(1, 0.1), (2, 0.5)]:
        first.save(step, {"w": np.full(2, step, dtype=np.float32)}, metrics={"loss": loss})
    record = tmp_path / "manager.ckpt-.json"
    if record.exists():  # written by this version: make it look like an older one's
        record.replace(tmp_path / "manager.json")
    again = CheckpointManager(tmp_path, max_to_keep=1, step_prefix="ckpt-", best_fn=lambda m: -m["loss"])
    again.save(3, {"w": np.full(2, 3, dtype=np.float32)}, metrics={"loss": 0.7})
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt-")) == ["ckpt-00000001", "ckpt-00000003"]


def test_numpy_and_tensor_metrics_are_recorded_and_others_refused_before_saving(tmp_path: Path) -> None:
    """A loss from asnumpy() (numpy float32) was refused by the JSON record AFTER the step committed: the save
    raised a TypeError and the step stayed without metrics, so a later retention deleted it although it was the
    best. Numbers of numpy / MindSpore are recorded; anything else is refused before a byte is written."""
    import json  # pylint: disable=import-outside-toplevel

    manager = CheckpointManager(tmp_path, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    losses = [np.float32(0.25), np.array(0.5), mindspore.Tensor(np.float32(0.75)), 0.9]
    for step, loss in enumerate(losses, start=1):
        manager.save(step, {"w": np.full(2, step, dtype=np.float32)}, metrics={"loss": loss, "epoch": np.int64(1)})
    assert _steps_on_disk(tmp_path) == [1, 2, 4]  # the best two (0.25, 0.5) and the newest
    record = json.loads((tmp_path / "manager.json").read_text())
    assert record["steps"]["1"]["metrics"] == {"loss": 0.25, "epoch": 1}
    with pytest.raises(dcp_errors.CheckpointValueError, match=r"step 5: metrics 'loss' is a object.*Nothing was saved"):
        manager.save(5, {"w": np.zeros(2, dtype=np.float32)}, metrics={"loss": object()})
    assert _steps_on_disk(tmp_path) == [1, 2, 4]


def test_metrics_best_fn_cannot_rank_are_refused_before_saving(tmp_path: Path) -> None:
    """best_fn raising on the metrics (a missing key) raised in retention after the commit, and left the step
    without its record: refused before anything is written."""
    manager = CheckpointManager(tmp_path, max_to_keep=1, best_fn=lambda m: m["acc"])
    manager.save(1, {"w": np.ones(2, dtype=np.float32)}, metrics={"acc": 0.9})
    with pytest.raises(dcp_errors.CheckpointValueError, match=r"step 2: best_fn\(metrics\) failed.*KeyError"):
        manager.save(2, {"w": np.ones(2, dtype=np.float32)}, metrics={"loss": 0.1})
    assert _steps_on_disk(tmp_path) == [1]
    manager.save(2, {"w": np.ones(2, dtype=np.float32)}, metrics={"acc": 0.5})
    assert _steps_on_disk(tmp_path) == [1, 2]  # 1 is the best, 2 the newest
