"""Best-k retention: steps without a usable metric rank last, filling the places the scored steps leave free.

They were dropped outright: a root whose record is gone (an older version kept none on S3; the error of a
damaged record advises deleting it) lost every step but the newest at its first best-k save.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import mindspore
import numpy as np

from hyper_parallel.core.distributed_checkpoint import load
from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager

mindspore.set_device("CPU")


def _steps_on_disk(root: Path) -> list[int]:
    return sorted(int(n.split("_")[1]) for n in os.listdir(root) if n.startswith("step_"))


def _state(step: int) -> dict:
    return {"w": mindspore.Parameter(mindspore.Tensor(np.full(4, step, dtype=np.float32)), name="w")}


def _loaded(manager: CheckpointManager, step: int) -> np.ndarray:
    target = {"w": np.zeros(4, dtype=np.float32)}
    assert manager.load(target, step=step) == step
    return target["w"]


def test_a_root_without_its_record_keeps_max_to_keep_steps(tmp_path: Path) -> None:
    plain = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        plain.save(step, _state(step))
    (tmp_path / "manager.json").unlink()  # a record lost (or deleted, as the error of a damaged one advises)
    best = CheckpointManager(tmp_path, max_to_keep=3, best_fn=lambda m: m["loss"], best_mode="min")
    best.save(4, _state(4), metrics={"loss": 0.5})
    assert _steps_on_disk(tmp_path) == [2, 3, 4]  # the scored step, then the newest unscored ones
    np.testing.assert_array_equal(_loaded(best, 2), np.full(4, 2, dtype=np.float32))
    best.save(5, _state(5), metrics={"loss": 0.4})
    best.save(6, _state(6), metrics={"loss": 0.6})
    assert _steps_on_disk(tmp_path) == [4, 5, 6]  # three scored steps: the unscored ones go


def test_nan_steps_fill_free_places(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, max_to_keep=3, best_fn=lambda m: m["loss"], best_mode="min")
    for step, loss in ((1, 0.5), (2, math.nan), (3, math.nan), (4, math.nan)):
        manager.save(step, _state(step), metrics={"loss": loss})
    assert _steps_on_disk(tmp_path) == [1, 3, 4]  # the scored step 1, then the newest NaN ones
    np.testing.assert_array_equal(_loaded(manager, 3), np.full(4, 3, dtype=np.float32))
    manager.save(5, _state(5), metrics={"loss": 0.7})
    assert _steps_on_disk(tmp_path) == [1, 4, 5]  # scored 1 and 5, the newest NaN one (4) fills the third place
