"""Custom readers and planners that define neither new optional load hook (``StorageReader.finish_load``,
``LoadPlanner.direct_targets``) still load bit-exact with the read pass's overlap, verify before any target
changes, and the reader's ``finish_load`` runs after a failed load too."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp

ms.set_device("CPU")


def _state(zero: bool = False) -> dict[str, ms.Parameter]:
    """Two large Parameters (read on I/O threads, float32 and bf16) and 12 small ones (read by the caller)."""
    rng = np.random.default_rng(11)
    state = {}
    for i, (shape, dtype) in enumerate((((400, 1024), ms.float32), ((700, 1024), ms.bfloat16))):
        values = rng.standard_normal(shape).astype(np.float32)
        state[f"big{i}"] = ms.Parameter(ms.Tensor(np.zeros_like(values) if zero else values, dtype), name=f"big{i}")
    for i in range(12):
        values = rng.standard_normal((i + 1, 8)).astype(np.float32)
        state[f"small{i}"] = ms.Parameter(ms.Tensor(np.zeros_like(values) if zero else values), name=f"small{i}")
    return state


def _bits(state: dict[str, ms.Parameter]) -> dict[str, bytes]:
    return {name: value.asnumpy().tobytes() for name, value in state.items()}


class _Reader(dcp.StorageReader):
    """A reader of its own (not a FileSystemReader): every required method handed to one; no finish_load."""

    def __init__(self, path: Path) -> None:
        self.inner = dcp.FileSystemReader(path, thread_count=2)

    def reset(self, checkpoint_id: Any = None) -> None:
        self.inner.reset(checkpoint_id)

    def read_metadata(self, *, rank: int | None = None) -> dcp.Metadata:
        return self.inner.read_metadata(rank=rank)

    def set_up_storage_reader(self, metadata: dcp.Metadata, is_coordinator: bool) -> None:
        self.inner.set_up_storage_reader(metadata, is_coordinator)

    def prepare_local_plan(self, plan: dcp.LoadPlan) -> dcp.LoadPlan:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[dcp.LoadPlan]) -> list[dcp.LoadPlan]:
        return self.inner.prepare_global_plan(plans)

    def verify_data(self, plan: dcp.LoadPlan):
        return self.inner.verify_data(plan)

    def read_data(self, plan: dcp.LoadPlan, planner: dcp.LoadPlanner):
        return self.inner.read_data(plan, planner)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return dcp.FileSystemReader.validate_checkpoint_id(checkpoint_id)


class _Planner(dcp.LoadPlanner):
    """A planner of its own (not a StandardLoadPlanner): no direct_targets; records the threads asking."""

    def __init__(self) -> None:
        self.inner = dcp.StandardLoadPlanner()
        self.lock = threading.Lock()
        self.threads: set[str] = set()
        self.asked: list[str] = []  # the key of each item a target was acquired for
        self.finished = 0

    def configure_planner(self, state_dict, metadata, *, rank, world_size, is_coordinator) -> None:
        self.inner.configure_planner(state_dict, metadata, rank=rank, world_size=world_size,
                                     is_coordinator=is_coordinator)

    def build_local_plan(self) -> dcp.LoadPlan:
        return self.inner.build_local_plan()

    def build_global_plan(self, all_plans):
        return self.inner.build_global_plan(all_plans)

    def finalize_plan(self, plan):
        return self.inner.finalize_plan(plan)

    def acquire_tensor(self, read_item):
        with self.lock:  # called from several threads at once (see LoadPlanner.acquire_tensor)
            self.threads.add(threading.current_thread().name)
            self.asked.append(read_item.dest_index.fqn)
        return self.inner.acquire_tensor(read_item)

    def apply_tensor(self, read_item, tensor) -> None:
        self.inner.apply_tensor(read_item, tensor)

    def apply_bytes(self, read_item, value) -> None:
        self.inner.apply_bytes(read_item, value)

    def finish_load(self) -> None:
        self.finished += 1
        self.inner.finish_load()


@pytest.fixture(name="saved")
def _saved(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    state = _state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt", thread_count=2), no_dist=True)
    return tmp_path / "ckpt", _bits(state)


def test_a_custom_reader_and_planner_without_the_new_hooks_load_bit_exact(saved) -> None:
    path, expected = saved
    targets = _state(zero=True)
    planner = _Planner()
    dcp.load(targets, storage_reader=_Reader(path), planner=planner, no_dist=True)
    assert _bits(targets) == expected and planner.finished == 1
    caller = threading.current_thread().name
    assert caller in planner.threads and any(name.startswith("hp-ckpt-read") for name in planner.threads)


def test_a_custom_pair_refuses_a_corrupt_chunk_with_no_target_changed(saved) -> None:
    path, _ = saved
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    info = next(s for i, s in metadata.storage_data.items() if i.fqn == "big1")
    data_file = path / info.relative_path
    raw = bytearray(data_file.read_bytes())
    raw[info.offset + info.length - 1] ^= 0x01  # the last byte of the large bf16 Parameter
    data_file.write_bytes(bytes(raw))
    targets = _state(zero=True)
    before = _bits(targets)
    with pytest.raises(dcp.CorruptCheckpointError, match="big1"):
        dcp.load(targets, storage_reader=_Reader(path), planner=_Planner(), no_dist=True)
    assert _bits(targets) == before
    assert not [t for t in threading.enumerate() if t.name.startswith(("hp-ckpt-read", "hp-ckpt-verify"))]


def test_the_readers_finish_load_runs_after_a_failed_load(saved) -> None:
    path, expected = saved

    class Counting(_Reader):
        finished = 0

        def finish_load(self) -> None:
            Counting.finished += 1
            self.inner.finish_load()

    class Refusing(_Planner):
        def acquire_tensor(self, read_item):
            if read_item.dest_index.fqn == "small5":
                raise dcp.CheckpointValueError("refusing small5")
            return super().acquire_tensor(read_item)

    reader = Counting(path)
    with pytest.raises(dcp.CheckpointValueError, match="refusing small5"):
        dcp.load(_state(zero=True), storage_reader=reader, planner=Refusing(), no_dist=True)
    assert Counting.finished == 1 and reader.inner._items is None  # pylint: disable=protected-access
    assert not [t for t in threading.enumerate() if t.name.startswith("hp-ckpt-read")]
    targets = _state(zero=True)
    dcp.load(targets, storage_reader=reader, planner=_Planner(), no_dist=True)  # the same reader again
    assert _bits(targets) == expected and Counting.finished == 2


@pytest.mark.parametrize("verify", [True, False])
def test_a_planner_wrapping_the_standard_one_is_asked_for_every_target(saved, verify: bool) -> None:
    """The wrapped standard planner keeps its small whole reads as columns (``_whole_reads``): the reader, reading
    for the wrapper, asks it for each of their targets all the same, once each."""
    path, expected = saved
    targets = _state(zero=True)
    planner = _Planner()
    dcp.load(targets, storage_reader=dcp.FileSystemReader(path, verify_checksums=verify), planner=planner,
             no_dist=True)
    assert _bits(targets) == expected and planner.finished == 1
    assert len(planner.inner.whole_reads) == 12  # the small ones were columns of the inner plan
    assert sorted(planner.asked) == sorted(targets)
