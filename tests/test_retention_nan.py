"""Best-k retention with a metric that is NaN (a diverged evaluation): the best steps are never deleted."""

from __future__ import annotations

import math
import os
from pathlib import Path

import mindspore
import numpy as np
import pytest

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
