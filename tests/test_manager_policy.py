"""CheckpointManager keeps its promises across re-creation; steps move forward; time, best-k, writer options."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import mindspore
import numpy as np
import pytest

from hyper_parallel.core.distributed_checkpoint import read_metadata
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError, CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager

mindspore.set_device("CPU")


def _state(step: int) -> dict:
    return {"w": np.full(3, step, dtype=np.float32), "step": step}


def _steps_on_disk(root: Path) -> list[int]:
    return sorted(int(n.split("_")[1]) for n in os.listdir(root) if n.startswith("step_"))


def test_default_keeps_five_like_mindspore(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    for step in range(1, 9):
        manager.save(step, _state(step))
    assert _steps_on_disk(tmp_path) == [4, 5, 6, 7, 8]


def test_recreated_manager_keeps_earlier_promises_and_its_own_step(tmp_path: Path) -> None:
    first = CheckpointManager(tmp_path, max_to_keep=1, keep_every_n_steps=2)
    for step in range(1, 6):
        first.save(step, _state(step))
    assert _steps_on_disk(tmp_path) == [2, 4, 5]
    record = json.loads((tmp_path / "manager.json").read_text())
    assert {s for s, r in record["steps"].items() if r["keep_forever"]} == {"2", "4"}
    # Another policy: no keep_every_n_steps, max_to_keep=1. Steps 2 and 4 were promised forever.
    second = CheckpointManager(tmp_path, max_to_keep=1)
    second.save(6, _state(6))
    assert _steps_on_disk(tmp_path) == [2, 4, 6]
    # Overwriting an old step on purpose keeps it too (the step just saved is never deleted).
    second.save(3, _state(33), force=True)
    assert _steps_on_disk(tmp_path) == [2, 3, 4, 6]
    loaded = {"w": np.zeros(3, np.float32), "step": 0}
    assert second.load(loaded, step=3) == 3 and loaded["step"] == 33


@pytest.mark.parametrize("metrics", [{"loss": 0.5}, None])
def test_a_reused_step_number_decides_keep_forever_afresh(tmp_path: Path, metrics: dict | None) -> None:
    """A new save of a step number starts a fresh record entry. Before, the entry of a deleted step promised 'keep
    forever' passed its promise on (copied when the save started, or at its retention): the new step was never
    pruned (disk leak)."""
    first = CheckpointManager(tmp_path, max_to_keep=5, keep_every_n_steps=2)
    for step in (1, 2):
        first.save(step, _state(step))
    shutil.rmtree(first.directory(2))  # rolled back: the run resumes from step 1
    second = CheckpointManager(tmp_path, max_to_keep=1)
    second.save(2, _state(20), metrics=metrics)
    record = json.loads((tmp_path / "manager.json").read_text())
    assert record["steps"]["2"]["keep_forever"] is False and record["steps"]["2"]["metrics"] == metrics
    for step in (3, 4):
        second.save(step, _state(10 * step), metrics=metrics)
    assert _steps_on_disk(tmp_path) == [4]
    record = json.loads((tmp_path / "manager.json").read_text())
    assert list(record["steps"]) == ["4"] and record["steps"]["4"]["keep_forever"] is False


def test_a_reused_step_number_saved_async_starts_a_fresh_entry(tmp_path: Path) -> None:
    """An async save's entry is written when it starts (it may commit at exit, with no retention): the stale
    promise of a deleted step of that number is gone from the record before the save commits."""
    first = CheckpointManager(tmp_path, keep_every_n_steps=2)
    for step in (1, 2):
        first.save(step, _state(step))
    shutil.rmtree(first.directory(2))
    second = CheckpointManager(tmp_path, max_to_keep=1, async_save=True)
    second.save(2, _state(20))
    record = json.loads((tmp_path / "manager.json").read_text())
    assert record["steps"]["2"]["keep_forever"] is False and record["steps"]["2"]["metrics"] is None
    second.close()
    assert _steps_on_disk(tmp_path) == [2]


def test_steps_at_or_below_the_latest_are_refused(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(10, _state(10))
    with pytest.raises(CheckpointValueError, match=r"step 7 is below the newest committed step 10 .*force=True"):
        manager.save(7, _state(7))
    with pytest.raises(CheckpointValueError, match="step 10 already has a committed checkpoint"):
        CheckpointManager(tmp_path).save(10, _state(10))  # a re-created manager checks the disk
    assert manager.save(11, _state(11)) is True
    assert _steps_on_disk(tmp_path) == [10, 11]


def test_save_by_time_interval(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, save_interval_seconds=0.3)
    assert manager.save(1, _state(1)) is False  # less than 0.3 s since the manager was made
    time.sleep(0.35)
    assert manager.save(2, _state(2)) is True
    assert manager.save(3, _state(3)) is False
    time.sleep(0.35)
    assert manager.should_save(4) is True and manager.save(4, _state(4)) is True
    assert _steps_on_disk(tmp_path) == [2, 4]
    both = CheckpointManager(tmp_path / "b", save_interval_steps=5, save_interval_seconds=3600)
    assert [both.save(s, _state(s)) for s in range(1, 7)] == [False, False, False, False, True, False]


def test_keep_time_interval_keeps_one_step_per_period(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, max_to_keep=1, keep_time_interval_seconds=0.3)
    manager.save(1, _state(1))  # the first step is kept forever
    manager.save(2, _state(2))
    time.sleep(0.35)
    manager.save(3, _state(3))  # 0.35 s after step 1: kept forever
    manager.save(4, _state(4))
    assert _steps_on_disk(tmp_path) == [1, 3, 4]


def test_best_k_by_metric_persists(tmp_path: Path) -> None:
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.1, 5: 0.8, 6: 0.7}
    manager = CheckpointManager(tmp_path, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    for step in range(1, 5):
        manager.save(step, _state(step), metrics={"loss": losses[step]})
    assert _steps_on_disk(tmp_path) == [2, 4]
    again = CheckpointManager(tmp_path, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    again.save(5, _state(5), metrics={"loss": losses[5]})
    assert _steps_on_disk(tmp_path) == [2, 4, 5]  # 5 is the newest: kept for a resume
    again.save(6, _state(6), metrics={"loss": losses[6]})
    assert _steps_on_disk(tmp_path) == [2, 4, 6]
    highest = CheckpointManager(tmp_path / "max", max_to_keep=1, best_fn=lambda m: m["acc"])
    for step, acc in [(1, 0.5), (2, 0.9), (3, 0.6)]:
        highest.save(step, _state(step), metrics={"acc": acc})
    assert _steps_on_disk(tmp_path / "max") == [2, 3]
    with pytest.raises(CheckpointValueError, match="best_mode"):
        CheckpointManager(tmp_path, best_fn=len, best_mode="lowest")
    with pytest.raises(CheckpointValueError, match="metrics must be a dict"):
        manager.save(7, _state(7), metrics=0.5)


def test_writer_options_are_passed_through(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, writer_options={"compression": "zstd", "thread_count": 1})
    manager.save(1, {"z": np.zeros(4096, np.float32)})
    chunk = read_metadata(manager.directory(1)).state_dict_metadata["z"]
    stored = sum(p.stat().st_size for p in manager.directory(1).glob("*.safetensors"))
    assert stored < 4096 * 4 // 2, "zstd compression reached the writer"
    assert chunk.size == (4096,)
    with pytest.raises(CheckpointValueError, match="compression"):
        CheckpointManager(tmp_path, writer_options={"compression": "lz4"})
    with pytest.raises(TypeError):
        CheckpointManager(tmp_path, writer_options={"no_such_option": 1})


def test_corrupt_record_is_named(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, _state(1))
    (tmp_path / "manager.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match=r"manager\.json.*delete it"):
        manager.save(2, _state(2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(save_interval_seconds=0), "save_interval_seconds"),
    (dict(keep_time_interval_seconds=float("inf")), "keep_time_interval_seconds"),
    (dict(best_fn="loss"), "best_fn must be callable"),
])
def test_bad_new_settings_are_refused(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(CheckpointValueError, match=match):
        CheckpointManager(tmp_path, **kwargs)
