"""Async save in one process, and the strategy registry with format versions."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _async_engine
from hyper_parallel.core.distributed_checkpoint.metadata import FORMAT_VERSION
from hyper_parallel.core.distributed_checkpoint.strategies import (
    StandardLoadStrategy,
    StandardSaveStrategy,
    LoadOptions,
    LoadStrategyBase,
    SaveOptions,
    SaveStrategyBase,
    StrategyAction,
    check_load_compatible,
    get_default_strategy,
    register_default_strategy,
)


def test_async_save_keeps_values_at_call_time_and_reuses_staging(tmp_path):
    param = ms.Parameter(ms.Tensor(np.full((32, 32), 1.0, np.float32)), name="p")
    array = np.arange(10, dtype=np.int64)
    handle = dcp.async_save({"p": param, "a": array, "step": 1}, checkpoint_id=tmp_path / "s1")
    param.asnumpy()[...] = 5.0
    array[...] = -1
    metadata = handle.result()
    assert handle.done() and metadata.storage_meta.world_size == 1
    reused_before = _async_engine._POOL.reused  # pylint: disable=protected-access
    handle2 = dcp.async_save({"p": param, "a": array, "step": 2}, checkpoint_id=tmp_path / "s2")
    param.asnumpy()[...] = 9.0
    handle2.result()
    assert _async_engine._POOL.reused - reused_before == 2, "same shapes: both staging buffers reused"
    for path, p_value, a_value, step in ((tmp_path / "s1", 1.0, list(range(10)), 1),
                                         (tmp_path / "s2", 5.0, [-1] * 10, 2)):
        target = {"p": np.zeros((32, 32), np.float32), "a": np.zeros(10, np.int64), "step": 0}
        dcp.load(target, checkpoint_id=path)
        assert np.all(target["p"] == p_value) and target["a"].tolist() == a_value and target["step"] == step


def test_async_result_timeout_and_failure_keep_old_checkpoint(tmp_path):
    dcp.save({"v": np.ones(4)}, checkpoint_id=tmp_path / "c")

    class Failing(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(28, "No space left on device")

    handle = dcp.async_save({"v": np.zeros(4)}, storage_writer=Failing(tmp_path / "c"))
    with pytest.raises(OSError, match="No space left"):
        handle.result(timeout=30)
    with pytest.raises(OSError):
        handle.result()  # the same failure again, never a silent success
    target = np.zeros(4)
    dcp.load({"v": target}, checkpoint_id=tmp_path / "c")
    assert target.tolist() == [1.0] * 4


def test_an_unseen_async_failure_is_raised_by_the_next_async_save(tmp_path):
    class Failing(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(5, "Input/output error")

    dcp.async_save({"v": np.zeros(4)}, storage_writer=Failing(tmp_path / "bad"))
    with pytest.raises(OSError, match="Input/output error"):
        dcp.async_save({"v": np.zeros(4)}, checkpoint_id=tmp_path / "next")
    dcp.async_save({"v": np.zeros(4)}, checkpoint_id=tmp_path / "next").result()


def test_process_exit_with_async_save_in_flight_commits_it_whole(tmp_path):
    script = textwrap.dedent(f"""
        import numpy as np
        import hyper_parallel.core.distributed_checkpoint as dcp
        dcp.save({{"v": np.ones(8)}}, checkpoint_id={str(tmp_path / 'old')!r})
        dcp.async_save({{"v": np.ones((2048, 2048))}}, checkpoint_id={str(tmp_path / 'new')!r})
        # exit without result(): one process commits in the background, and the exit waits for it
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    whole = np.zeros((2048, 2048))
    dcp.load({"v": whole}, checkpoint_id=tmp_path / "new")
    assert whole.min() == whole.max() == 1.0
    target = np.zeros(8)
    dcp.load({"v": target}, checkpoint_id=tmp_path / "old")
    assert target.tolist() == [1.0] * 8


def test_filesystem_backend_is_registered_and_recorded(tmp_path):
    metadata = dcp.save({"a": np.ones(2)}, checkpoint_id=tmp_path / "c")
    assert (metadata.storage_meta.backend, metadata.version) == ("filesystem", "2.2") == ("filesystem", FORMAT_VERSION)
    strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, "filesystem", "2.2")
    assert isinstance(strategy, StandardLoadStrategy)
    assert check_load_compatible(metadata) is strategy
    older = get_default_strategy(StrategyAction.LOAD_SHARDED, "filesystem", "1.0")
    assert isinstance(older, StandardLoadStrategy) and older.version == "1.0" and older is not strategy
    assert get_default_strategy(StrategyAction.LOAD_SHARDED, "filesystem", "2.0").version == "2.0"
    save_strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, "filesystem", "2.2")
    committed = save_strategy.save({"a": np.full(2, 3.0)}, storage_writer=dcp.FileSystemWriter(tmp_path / "via"),
                                   planner=dcp.StandardSavePlanner(), options=SaveOptions(no_dist=True))
    target = {"a": np.zeros(2)}
    reader = dcp.FileSystemReader(tmp_path / "via")
    strategy.load(target, storage_reader=reader, planner=dcp.StandardLoadPlanner(), metadata=reader.read_metadata(),
                  options=LoadOptions(no_dist=True))
    assert target["a"].tolist() == [3.0, 3.0] and committed.storage_meta.backend == "filesystem"
    request = save_strategy.async_save({"a": np.full(2, 4.0)}, storage_writer=dcp.FileSystemWriter(tmp_path / "via_async"),
                                       planner=dcp.StandardSavePlanner(), options=SaveOptions(), staging="copy")
    assert isinstance(request, dcp.AsyncRequest)
    queue = dcp.AsyncCallsQueue()
    call = queue.schedule_async_request(request)
    # one process: written and committed in the background, before finalize
    assert call.wait(60) and (tmp_path / "via_async" / "metadata.json").exists()
    assert call.finalize().storage_meta.backend == "filesystem"
    dcp.load(target, checkpoint_id=tmp_path / "via_async")
    assert target["a"].tolist() == [4.0, 4.0]
    queue.close()


def _rewrite(path, **fields):
    document = json.loads((path / "metadata.json").read_text())
    document.update(fields)
    (path / "metadata.json").write_text(json.dumps(document))


@pytest.mark.parametrize("fields,expected", [
    ({"backend": "zarr"}, "backend 'zarr' version '2.2'"),
    ({"version": "3.0"}, "backend 'filesystem' version '3.0'"),
    ({"version": "2.7"}, "backend 'filesystem' version '2.7'"),
    ({"version": "1.7"}, "backend 'filesystem' version '1.7'"),
])
def test_unknown_backend_or_future_version_is_refused(tmp_path, fields, expected):
    dcp.save({"a": np.ones(2)}, checkpoint_id=tmp_path / "c")
    _rewrite(tmp_path / "c", **fields)
    with pytest.raises(dcp.UnsupportedFormatError) as caught:
        dcp.load({"a": np.zeros(2)}, checkpoint_id=tmp_path / "c")
    assert expected in str(caught.value) and "supported: filesystem 1.0, filesystem 2.0, filesystem 2.1, filesystem 2.2" in str(caught.value)


def test_registering_a_strategy_for_a_new_version(tmp_path):
    dcp.save({"a": np.ones(2)}, checkpoint_id=tmp_path / "c")
    _rewrite(tmp_path / "c", version="2.5")

    class Reader25(StandardLoadStrategy):
        pass

    register_default_strategy(StrategyAction.LOAD_SHARDED, "filesystem", "2.5", Reader25("filesystem", "2.5"))
    try:
        target = {"a": np.zeros(2)}
        dcp.load(target, checkpoint_id=tmp_path / "c")
        assert target["a"].tolist() == [1.0, 1.0]
    finally:
        from hyper_parallel.core.distributed_checkpoint import strategies  # pylint: disable=import-outside-toplevel

        strategies._REGISTRY.pop((StrategyAction.LOAD_SHARDED, "filesystem", "2.5"))  # pylint: disable=protected-access
    with pytest.raises(dcp.CheckpointValueError):
        register_default_strategy("load", "filesystem", "2.2", Reader25("filesystem", "2.2"))
    with pytest.raises(dcp.CheckpointValueError, match="must be a SaveStrategyBase"):
        register_default_strategy(StrategyAction.SAVE_SHARDED, "filesystem", "2.2", Reader25("filesystem", "2.2"))


@contextlib.contextmanager
def _registered(action, strategy):
    previous = get_default_strategy(action, "filesystem", FORMAT_VERSION)
    register_default_strategy(action, "filesystem", FORMAT_VERSION, strategy)
    try:
        yield
    finally:
        register_default_strategy(action, "filesystem", FORMAT_VERSION, previous)


def test_save_async_save_and_load_call_the_registered_strategies(tmp_path):
    calls = []

    class RecordingSave(StandardSaveStrategy):
        def save(self, state_dict, *, storage_writer, planner, options):
            calls.append(("save", type(storage_writer).__name__, options.remove_redundancy))
            return super().save(state_dict, storage_writer=storage_writer, planner=planner, options=options)

        def async_save(self, state_dict, *, storage_writer, planner, options, staging):
            calls.append(("async_save", staging))
            return super().async_save(state_dict, storage_writer=storage_writer, planner=planner, options=options,
                                      staging=staging)

    class RecordingLoad(StandardLoadStrategy):
        def load(self, state_dict, *, storage_reader, planner, metadata, options):
            calls.append(("load", metadata.version, sorted(metadata.state_dict_metadata), options.use_collectives))
            super().load(state_dict, storage_reader=storage_reader, planner=planner, metadata=metadata,
                         options=options)

    with _registered(StrategyAction.SAVE_SHARDED, RecordingSave("filesystem", FORMAT_VERSION)), \
            _registered(StrategyAction.LOAD_SHARDED, RecordingLoad("filesystem", FORMAT_VERSION)):
        dcp.save({"a": np.ones(2)}, checkpoint_id=tmp_path / "s", remove_redundancy=False)
        dcp.async_save({"a": np.full(2, 2.0)}, checkpoint_id=tmp_path / "t").result()
        target = {"a": np.zeros(2)}
        dcp.load(target, checkpoint_id=tmp_path / "t", use_collectives=False)
    assert calls == [("save", "FileSystemWriter", False), ("async_save", "copy"), ("load", "2.2", ["a"], False)]
    assert target["a"].tolist() == [2.0, 2.0]
    dcp.load(target, checkpoint_id=tmp_path / "s")
    assert target["a"].tolist() == [1.0, 1.0] and len(calls) == 3, "the default strategies are back"


def test_the_registered_strategy_is_what_runs(tmp_path):
    class Constant(LoadStrategyBase):
        def load(self, state_dict, *, storage_reader, planner, metadata, options):
            state_dict["a"][...] = metadata.storage_meta.world_size * 42

    class SyncOnly(SaveStrategyBase):
        def save(self, state_dict, *, storage_writer, planner, options):
            raise dcp.CheckpointValueError("saving is switched off here")

    dcp.save({"a": np.ones(2)}, checkpoint_id=tmp_path / "c")
    target = {"a": np.zeros(2)}
    with _registered(StrategyAction.LOAD_SHARDED, Constant("filesystem", FORMAT_VERSION)):
        dcp.load(target, checkpoint_id=tmp_path / "c")
    assert target["a"].tolist() == [42.0, 42.0]
    with _registered(StrategyAction.SAVE_SHARDED, SyncOnly("filesystem", FORMAT_VERSION)):
        with pytest.raises(dcp.CheckpointValueError, match="switched off"):
            dcp.save({"a": np.ones(2)}, checkpoint_id=tmp_path / "d")
        with pytest.raises(dcp.UnsupportedFormatError, match="cannot save asynchronously"):
            dcp.async_save({"a": np.ones(2)}, checkpoint_id=tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_fork_staging_snapshots_at_call_time_and_reports_child_errors(tmp_path):
    param = ms.Parameter(ms.Tensor(np.full((64, 64), 2.0, np.float32)), name="p")
    handle = dcp.async_save({"p": param, "step": 5}, checkpoint_id=tmp_path / "f", staging="fork")
    param.asnumpy()[...] = -7.0  # after the fork: the child's snapshot keeps 2.0
    metadata = handle.result()
    assert metadata.state_dict_metadata["p"].size == (64, 64)
    target = {"p": np.zeros((64, 64), np.float32), "step": 0}
    dcp.load(target, checkpoint_id=tmp_path / "f")
    assert np.all(target["p"] == 2.0) and target["step"] == 5

    class Failing(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(28, "No space left on device")

    handle = dcp.async_save({"p": param}, storage_writer=Failing(tmp_path / "g"), staging="fork")
    with pytest.raises(dcp.CheckpointIOError, match="No space left on device") as caught:
        handle.result()
    assert "writer process failed" in str(caught.value)
    assert not (tmp_path / "g" / "metadata.json").exists()
    with pytest.raises(dcp.CheckpointValueError, match="staging"):
        dcp.async_save({"p": param}, checkpoint_id=tmp_path / "h", staging="mmap")


@pytest.mark.parametrize("version,accepted", [("2", True), ("2.0", True), ("2.1", True), ("2.2", True), ("1", True), ("2.3", False), ("2.x", False), ("", False)])
def test_a_version_is_accepted_by_a_registered_strategy_of_the_same_major(tmp_path, version, accepted):
    dcp.save({"a": np.ones(2)}, checkpoint_id=tmp_path / "c")
    _rewrite(tmp_path / "c", version=version)
    target = {"a": np.zeros(2)}
    if accepted:
        dcp.load(target, checkpoint_id=tmp_path / "c")
        assert target["a"].tolist() == [1.0, 1.0]
    else:
        with pytest.raises(dcp.UnsupportedFormatError, match=f"version '{version}'"):
            dcp.load(target, checkpoint_id=tmp_path / "c")
