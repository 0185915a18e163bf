"""Tests of ``CheckpointManager``: steps, retention, commit visibility, async, errors."""

from __future__ import annotations

import os
from pathlib import Path

import mindspore
import numpy as np
import pytest

from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointValueError,
    UnsupportedTypeError,
)
from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager

mindspore.set_device("CPU")

WORKER = Path(__file__).resolve().parent / "workers" / "manager_worker.py"


def _state(step: int) -> dict:
    """A state whose every value is derived from ``step``."""
    return {
        "w": mindspore.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3) + step),
        "b": mindspore.Parameter(mindspore.Tensor(np.full((4,), step, dtype=np.int64)), name="b"),
        "opt": {"m": np.linspace(0, 1, 5, dtype=np.float64) * step, "count": step, "tag": f"s{step}"},
    }


def _zeros() -> dict:
    return {
        "w": mindspore.Tensor(np.zeros((2, 3), dtype=np.float32)),
        "b": mindspore.Parameter(mindspore.Tensor(np.zeros((4,), dtype=np.int64)), name="b"),
        "opt": {"m": np.zeros(5, dtype=np.float64), "count": -1, "tag": ""},
    }


def _assert_state(loaded: dict, step: int) -> None:
    expected = _state(step)
    np.testing.assert_array_equal(loaded["w"].asnumpy(), expected["w"].asnumpy())
    np.testing.assert_array_equal(loaded["b"].asnumpy(), expected["b"].asnumpy())
    np.testing.assert_array_equal(loaded["opt"]["m"], expected["opt"]["m"])
    assert loaded["opt"]["count"] == step
    assert loaded["opt"]["tag"] == f"s{step}"


def _names(root: Path) -> list[str]:
    """Entries of ``root`` except the manager's record and its lock."""
    return sorted(n for n in os.listdir(root) if n not in ("manager.json", ".manager.lock"))


def _uncommitted_dir(manager: CheckpointManager, step: int, data_from: int) -> Path:
    """A step directory with a real data file and no metadata.json (a crashed save)."""
    path = manager.directory(step)
    path.mkdir(parents=True)
    source = next(manager.directory(data_from).glob("*.safetensors"))
    (path / source.name).write_bytes(source.read_bytes())
    return path


def test_step_directory_names(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ckpt")
    assert manager.directory(0) == tmp_path / "ckpt" / "step_00000000"
    assert manager.directory(120).name == "step_00000120"
    assert manager.directory(123456789).name == "step_123456789"
    assert CheckpointManager(tmp_path, step_prefix="iter-").directory(7).name == "iter-00000007"


def test_retention_keeps_newest_and_every_n(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, max_to_keep=2, keep_every_n_steps=3)
    remaining = []
    for step in range(1, 11):
        assert manager.save(step, _state(step)) is True
        remaining.append(manager.all_steps())
    assert remaining == [
        [1], [1, 2], [2, 3], [3, 4], [3, 4, 5], [3, 5, 6], [3, 6, 7], [3, 6, 7, 8], [3, 6, 8, 9], [3, 6, 9, 10],
    ]
    assert _names(tmp_path) == ["step_00000003", "step_00000006", "step_00000009", "step_00000010"]
    assert manager.latest_step() == 10


def test_retention_max_to_keep_only_and_keep_all(tmp_path: Path) -> None:
    bounded = CheckpointManager(tmp_path / "a", max_to_keep=3)
    unbounded = CheckpointManager(tmp_path / "b", max_to_keep=None)
    for step in range(6):
        bounded.save(step, _state(step))
        unbounded.save(step, _state(step))
    assert bounded.all_steps() == [3, 4, 5]
    assert _names(tmp_path / "a") == ["step_00000003", "step_00000004", "step_00000005"]
    assert unbounded.all_steps() == [0, 1, 2, 3, 4, 5]


def test_save_interval_steps_and_force(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, save_interval_steps=3)
    saved = [manager.save(step, _state(step)) for step in range(8)]
    assert saved == [True, False, False, True, False, False, True, False]
    assert manager.all_steps() == [0, 3, 6]
    assert _names(tmp_path) == ["step_00000000", "step_00000003", "step_00000006"]
    assert manager.save(7, _state(7), force=True) is True
    assert manager.all_steps() == [0, 3, 6, 7]


def test_latest_step_ignores_handmade_uncommitted_dir_then_cleans_it(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, _state(1))
    crashed = _uncommitted_dir(manager, 2, data_from=1)
    newer = _uncommitted_dir(manager, 9, data_from=1)
    assert manager.latest_step() == 1
    assert manager.all_steps() == [1]
    loaded = _zeros()
    assert manager.load(loaded) == 1
    _assert_state(loaded, 1)

    manager.save(3, _state(3))
    assert not crashed.exists()  # older than the newest committed step: cleaned up
    assert newer.exists()  # newer than it: may still be written by someone, kept
    assert manager.all_steps() == [1, 3]
    assert _names(tmp_path) == ["step_00000001", "step_00000003", "step_00000009"]


def test_crashed_save_stays_uncommitted_and_is_cleaned(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, _state(1))
    with pytest.raises(UnsupportedTypeError, match="x"):
        manager.save(2, {"w": _state(2)["w"], "x": object()})
    assert not manager.directory(2).exists()  # the failed save removed the directory it created
    manager.directory(2).mkdir()  # as a crashed save leaves it
    assert manager.latest_step() == 1
    loaded = _zeros()
    assert manager.load(loaded) == 1
    _assert_state(loaded, 1)

    manager.save(3, _state(3))
    assert _names(tmp_path) == ["step_00000001", "step_00000003"]


def test_invalid_metadata_and_foreign_names_are_not_steps(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(4, _state(4))
    corrupt = manager.directory(5)
    corrupt.mkdir()
    (corrupt / "metadata.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "step_6").mkdir()  # not zero-padded: not a step of this manager
    (tmp_path / "step_00000007").write_text("a file, not a directory", encoding="utf-8")
    (tmp_path / "other").mkdir()
    assert manager.all_steps() == [4]
    manager.save(8, _state(8))
    assert manager.all_steps() == [4, 8]
    assert corrupt.exists()  # has a metadata.json: left for a human to inspect


def test_load_latest_and_explicit_step_exact_values(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    for step in (10, 20, 30):
        manager.save(step, _state(step))
    loaded = _zeros()
    targets = (loaded["w"], loaded["b"], loaded["opt"]["m"])
    assert manager.load(loaded) == 30
    _assert_state(loaded, 30)
    assert (loaded["w"], loaded["b"], loaded["opt"]["m"]) == targets  # in place: same objects
    older = _zeros()
    assert manager.load(older, step=20) == 20
    _assert_state(older, 20)


def test_force_overwrites_committed_step(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(5, _state(5))
    old_files = sorted(p.name for p in manager.directory(5).glob("*.safetensors"))
    with pytest.raises(CheckpointValueError, match=r"step 5 already has a committed checkpoint .*force=True"):
        manager.save(5, _state(6))
    assert manager.save(5, _state(6), force=True) is True
    new_files = sorted(p.name for p in manager.directory(5).glob("*.safetensors"))
    assert new_files and not set(new_files) & set(old_files)  # old data files dropped after the commit
    loaded = _zeros()
    manager.load(loaded)
    _assert_state(loaded, 6)


def test_async_save_stages_values_and_commits_on_wait(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, async_save=True, max_to_keep=2)
    state = _state(1)
    assert manager.save(1, state) is True
    state["w"].asnumpy()[...] = 99.0  # in place: CPU tensors share memory with asnumpy()
    state["opt"]["m"][...] = -5.0
    assert state["w"].asnumpy()[0, 0] == 99.0
    # in flight or already committed by the background thread (one process commits there)
    assert manager.all_steps() in ([], [1])
    manager.wait()
    assert manager.all_steps() == [1]
    loaded = _zeros()
    assert manager.load(loaded) == 1
    _assert_state(loaded, 1)


def test_async_next_save_commits_previous_and_retention_follows(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=True, max_to_keep=2) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
        assert manager.all_steps() == [1]  # step 1 committed by the second save; step 2 in flight
        manager.save(3, _state(3))
        assert manager.all_steps() == [1, 2]
        assert manager.save(4, _state(4)) is True
        assert manager.all_steps() == [2, 3]  # retention ran after step 3 committed, not before
        loaded = _zeros()
        assert manager.load(loaded, step=4) == 4  # loading the in-flight step finishes it first
        _assert_state(loaded, 4)
        assert manager.all_steps() == [3, 4]
        manager.save(5, _state(5))
    assert _names(tmp_path) == ["step_00000004", "step_00000005"]  # close() committed step 5


def test_async_duplicate_of_in_flight_step_is_refused(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, async_save=True)
    manager.save(1, _state(1))
    with pytest.raises(CheckpointValueError, match="step 1 already has a committed checkpoint"):
        manager.save(1, _state(2))
    manager.close()
    loaded = _zeros()
    manager.load(loaded)
    _assert_state(loaded, 1)


def test_load_without_checkpoint_names_root(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    manager = CheckpointManager(root)
    with pytest.raises(CheckpointNotFoundError, match=f"no committed checkpoint in {root}") as info:
        manager.load(_zeros())
    assert isinstance(info.value, FileNotFoundError)
    assert manager.latest_step() is None and manager.all_steps() == []
    manager.directory(3).mkdir(parents=True)
    with pytest.raises(CheckpointNotFoundError):
        manager.load(_zeros())
    with pytest.raises(CheckpointError):
        manager.load(_zeros(), step=3)  # explicit but uncommitted
    with pytest.raises(CheckpointNotFoundError):
        manager.load(_zeros(), step=4)  # no such directory


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_to_keep": 0},
        {"save_interval_steps": 0},
        {"keep_every_n_steps": -2},
        {"max_to_keep": 1.5},
        {"step_prefix": ""},
        {"step_prefix": ".hidden_"},
        {"step_prefix": "a/b"},
    ],
)
def test_bad_settings_are_refused(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(CheckpointValueError):
        CheckpointManager(tmp_path, **kwargs)


@pytest.mark.parametrize("step", [-1, 1.0, True, "3"])
def test_bad_step_is_refused(tmp_path: Path, step: object) -> None:
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointValueError, match="non-negative int"):
        manager.save(step, _state(0))  # type: ignore[arg-type]
    assert not tmp_path.joinpath("step_00000001").exists()


def test_interrupted_deletions_are_swept(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, max_to_keep=1)
    leftover = tmp_path / ".deleting-step_00000000-deadbeef"
    leftover.mkdir()
    (leftover / "r00000_000.0123456789ab.safetensors").write_bytes(b"half deleted")
    foreign = tmp_path / ".deleting-other_00000000-cafe"
    foreign.mkdir()
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    assert _names(tmp_path) == [foreign.name, "step_00000002"]


@pytest.mark.msrun
def test_async_manager_two_ranks_dtensor(tmp_path: Path) -> None:
    from msrun_harness import run_workers, scenario_values  # pylint: disable=import-outside-toplevel

    results = run_workers(WORKER, workers=2, tmp_path=tmp_path, timeout=300)
    root = tmp_path / "shared" / "manager"
    assert _names(root) == ["step_00000003", "step_00000004"]
    for name in _names(root):
        files = sorted(os.listdir(root / name))
        assert "metadata.json" in files
        assert {f.split("_")[0] for f in files if f.endswith(".safetensors")} == {"r00000", "r00001"}

    steps_seen = scenario_values(results, "save_steps")
    assert steps_seen == [[[], [1], [1, 2], [2, 3], [3, 4]]] * 2
    loaded = scenario_values(results, "load_latest")
    full = np.arange(24, dtype=np.float32).reshape(4, 6) * 10 + 4
    for rank, value in enumerate(loaded):
        assert value["step"] == 4
        np.testing.assert_array_equal(value["local"], full[2 * rank : 2 * rank + 2])
        np.testing.assert_array_equal(value["bias"], np.full(3, 4, dtype=np.float32))
        assert value["count"] == 4
    full_3 = np.arange(24, dtype=np.float32).reshape(4, 6) * 10 + 3
    for rank, value in enumerate(scenario_values(results, "load_step_3")):
        np.testing.assert_array_equal(value, full_3[2 * rank : 2 * rank + 2])
    for rank, value in enumerate(scenario_values(results, "rank_local_saves_refused")):
        # A manager step is committed by metadata.json: rank-local saves (each rank's own metadata, or every
        # process as rank 0 of its own world) would never be listed, resumed or pruned. Refused on every rank.
        for option in ("use_collectives", "no_dist"):
            assert f"rank {rank}" in value["refused"][option] and option in value["refused"][option]
            assert "2 ranks" in value["refused"][option]
        assert value["written_before"] == [] and value["steps"] == [1]
    full_2 = np.arange(24, dtype=np.float32).reshape(4, 6) * 10 + 2
    for rank, value in enumerate(scenario_values(results, "load_while_saving")):
        # dcp.load of the directory an async save is still writing finishes that save first (collectively).
        np.testing.assert_array_equal(value["local"], full_2[2 * rank : 2 * rank + 2])
        assert value["count"] == 2 and value["committed"]
