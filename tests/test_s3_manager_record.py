"""A CheckpointManager on s3:// keeps its record (metrics, keep-forever promises) across re-creation (moto S3)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli.list_cmd import list_steps
from s3_server import new_filesystem, s3_endpoint, s3_url  # noqa: F401  (fixtures)


def _state(step: int) -> dict:
    return {"w": np.full(4, step, dtype=np.float32), "step": step}


def _steps(url: str) -> list[str]:
    return sorted(p.rsplit("/", 1)[-1] for p in new_filesystem().ls(url[len("s3://"):], refresh=True)
                  if p.rsplit("/", 1)[-1].startswith("step_"))


def test_recreated_s3_manager_keeps_the_best_steps(s3_url: str) -> None:  # noqa: F811
    """A job restarted (a new manager) still knows the metrics of the steps saved before: the best stay."""
    first = dcp.CheckpointManager(s3_url, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    for step, loss in [(1, 0.1), (2, 0.2), (3, 0.9)]:
        first.save(step, _state(step), metrics={"loss": loss})
    assert _steps(s3_url) == ["step_00000001", "step_00000002", "step_00000003"]
    again = dcp.CheckpointManager(s3_url, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    again.save(4, _state(4), metrics={"loss": 0.95})
    assert _steps(s3_url) == ["step_00000001", "step_00000002", "step_00000004"]  # best two and the newest
    loaded = {"w": np.zeros(4, np.float32), "step": -1}
    assert again.load(loaded, step=1) == 1 and loaded["step"] == 1
    record = json.loads(new_filesystem().cat_file(f"{s3_url[5:]}/manager.json"))
    assert record["steps"]["1"]["metrics"] == {"loss": 0.1}
    listed = {e.step: e.metrics for e in list_steps(s3_url)}  # hp-ckpt list shows them too
    assert listed == {1: {"loss": 0.1}, 2: {"loss": 0.2}, 4: {"loss": 0.95}}


def test_recreated_s3_manager_keeps_steps_promised_forever(s3_url: str) -> None:  # noqa: F811
    first = dcp.CheckpointManager(s3_url, max_to_keep=1, keep_time_interval_seconds=3600)
    first.save(1, _state(1))  # the first step: promised forever (one per hour)
    first.save(2, _state(2))
    assert _steps(s3_url) == ["step_00000001", "step_00000002"]
    again = dcp.CheckpointManager(s3_url, max_to_keep=1)  # restarted without the interval: promises stay
    again.save(3, _state(3))
    again.save(4, _state(4))
    assert _steps(s3_url) == ["step_00000001", "step_00000004"]
    assert [(e.step, e.keep_forever) for e in list_steps(s3_url)] == [(1, True), (4, False)]


def test_damaged_s3_record_is_named_and_nothing_is_deleted(s3_url: str) -> None:  # noqa: F811
    manager = dcp.CheckpointManager(s3_url, max_to_keep=1)
    manager.save(1, _state(1))
    new_filesystem().pipe_file(f"{s3_url[5:]}/manager.json", b"\xff not a record")
    with pytest.raises(dcp.CorruptCheckpointError, match=r"manager\.json: not a valid manager record.*delete it"):
        manager.save(2, _state(2))
    assert _steps(s3_url) == ["step_00000001", "step_00000002"]  # retention refused: nothing deleted
