"""A load of the checkpoint an async save of this process is still writing gets that save, not the older one."""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp

ms.set_device("CPU")
N = 1 << 20


def _state(value: float) -> dict:
    return {"w": np.full(N, value, np.float32), "step": int(value)}


@pytest.mark.parametrize("staging", ["copy", "auto", "fork"])
def test_load_of_the_location_being_saved_waits_for_that_save(tmp_path: Path, staging: str) -> None:
    """The "latest" pattern: a directory overwritten by each async save, loaded (say by an evaluation) without
    result() in between: the load finishes the in-flight save first, so it gets the new values."""
    latest = tmp_path / "latest"
    dcp.save(_state(1), checkpoint_id=latest)
    handle = dcp.async_save(_state(2), checkpoint_id=latest, staging=staging)
    target = {"w": np.zeros(N, np.float32), "step": 0}
    dcp.load(target, checkpoint_id=latest)
    assert target["step"] == 2 and (target["w"] == 2).all()
    assert handle.done()
    assert handle.result().storage_meta.save_id == dcp.read_metadata(latest).storage_meta.save_id
    handle = dcp.async_save(_state(3), checkpoint_id=latest, staging=staging)
    loaded = hyper_parallel.load_checkpoint(latest)  # the one-liner reads the metadata first: the same
    assert loaded["step"].asnumpy().item() == 3 and (loaded["w"].asnumpy() == 3).all()
    handle.result()


def test_load_of_another_location_leaves_the_save_in_flight(tmp_path: Path) -> None:
    dcp.save(_state(1), checkpoint_id=tmp_path / "a")
    dcp.save(_state(5), checkpoint_id=tmp_path / "b")
    handle = dcp.async_save(_state(2), checkpoint_id=tmp_path / "a")
    target = {"w": np.zeros(N, np.float32), "step": 0}
    dcp.load(target, checkpoint_id=tmp_path / "b")
    assert target["step"] == 5
    handle.result()
    dcp.load(target, checkpoint_id=tmp_path / "a")
    assert target["step"] == 2


def test_read_metadata_of_the_location_being_saved_sees_that_save(tmp_path: Path) -> None:
    dcp.save(_state(1), checkpoint_id=tmp_path)
    handle = dcp.async_save(_state(2), checkpoint_id=tmp_path)
    assert dcp.read_metadata(tmp_path).storage_meta.save_id == handle.result().storage_meta.save_id
