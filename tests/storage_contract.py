"""The contract every storage backend passes: one base class, one subclass per backend (as zarr tests its stores).

A backend's test module subclasses :class:`StorageContract` as ``Test<Name>``
and implements the four hooks (``make_id``, ``make_writer``, ``make_reader``,
``corrupt``) plus ``backend``, the name its writer records. The tests drive
the backend only through ``dcp.save`` / ``dcp.load`` and the
``StorageWriter`` / ``StorageReader`` methods, in the order the engine calls
them: save and load, a resharded load across simulated ranks, the commit
being the last step, rank-local metadata, a missing checkpoint, corruption.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint.metadata import FORMAT_VERSION
from hyper_parallel.core.distributed_checkpoint._rank_records import (
    RankRecord,
    encode_rank_record,
    wait_for_rank_records,
)
from hyper_parallel.core.distributed_checkpoint.strategies import LoadOptions, check_load_compatible
from hyper_parallel.platform import numpy_dtype

__all__ = ["StorageContract"]

FULL = np.arange(6 * 8, dtype=np.float32).reshape(6, 8) / 8


def _state(scale: float = 1.0) -> dict[str, Any]:
    return {
        "w": FULL * scale,
        "ids": np.arange(5, dtype=np.int64) * int(scale * 10),
        "half": (np.array([1.5, -2.0, 0.25]) * scale).astype(numpy_dtype("bfloat16")),
        "step": int(scale * 100),
        "name": f"run-{scale}",
        "opt": {"lr": 0.1 * scale, "betas": [0.9, 0.99]},
    }


def _zeros(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, np.ndarray):
            out[key] = np.zeros_like(value)
        elif isinstance(value, dict):
            out[key] = _zeros(value)
        else:
            out[key] = None
    out["opt"] = {"lr": None, "betas": [None, None]}
    return out


def _assert_state(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        if isinstance(value, np.ndarray):
            assert loaded[key].dtype == value.dtype, key
            assert np.array_equal(loaded[key].astype(np.float64), value.astype(np.float64)), key
        else:
            assert loaded[key] == value, key


class _FailingPlanner(dcp.StandardSavePlanner):
    """Fails while the writer asks for the data of ``fqn``: a save that dies mid-write."""

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn

    def get_data(self, item: dcp.WriteItem) -> Any:
        if item.index.fqn == self.fqn:
            raise OSError(5, "Input/output error (injected while writing)")
        return super().get_data(item)


class StorageContract:
    """Tests every backend must pass. Subclass as ``Test<Backend>`` and implement the hooks."""

    #: The backend name the writer records in the metadata.
    backend: str = ""

    @pytest.fixture(autouse=True)
    def _contract_tmp_path(self, tmp_path):
        self.tmp_path = tmp_path

    # Hooks --------------------------------------------------------------------------------------

    def make_id(self, name: str) -> Any:
        """A fresh checkpoint id for this test (``self.tmp_path`` is this test's scratch directory)."""
        raise NotImplementedError

    def make_writer(self, checkpoint_id: Any) -> dcp.StorageWriter:
        """A new writer for ``checkpoint_id`` (one per simulated rank)."""
        raise NotImplementedError

    def make_reader(self, checkpoint_id: Any) -> dcp.StorageReader:
        """A new reader for ``checkpoint_id``."""
        raise NotImplementedError

    def corrupt(self, checkpoint_id: Any, info: dcp.StorageInfo) -> None:
        """Flip one stored byte of the item stored at ``info`` (as a bad disk or network would)."""
        raise NotImplementedError

    # Helpers ------------------------------------------------------------------------------------

    def save(self, state: dict[str, Any], checkpoint_id: Any, **kwargs: Any) -> dcp.Metadata:
        return dcp.save(state, storage_writer=self.make_writer(checkpoint_id), no_dist=True, **kwargs)

    def load(self, state: dict[str, Any], checkpoint_id: Any, **kwargs: Any) -> None:
        dcp.load(state, storage_reader=self.make_reader(checkpoint_id), no_dist=True, **kwargs)

    def simulated_save(self, states: list[dict[str, Any]], checkpoint_id: Any) -> dcp.Metadata:
        """Save as ``len(states)`` ranks, each with its own writer: the engine's save steps by hand."""
        writers, planners, plans = [], [], []
        for rank, state in enumerate(states):
            writer = self.make_writer(checkpoint_id)
            writer.set_up_storage_writer(rank == 0, rank=rank, world_size=len(states))
            planner = dcp.StandardSavePlanner()
            planner.configure_planner(state, rank=rank, world_size=len(states), is_coordinator=rank == 0)
            writers.append(writer)
            planners.append(planner)
            plans.append(writer.prepare_local_plan(planner.build_local_plan()))
        final, metadata = planners[0].build_global_plan(plans)
        final = writers[0].prepare_global_plan(final)
        results = [
            writer.write_data(planner.finalize_plan(plan), planner).result()
            for writer, planner, plan in zip(writers, planners, final)
        ]
        return writers[0].finish(metadata, results)

    # The contract -------------------------------------------------------------------------------

    def test_save_and_load_round_trip(self):
        checkpoint_id = self.make_id("roundtrip")
        expected = _state(1.0)
        metadata = self.save(expected, checkpoint_id)
        assert (metadata.storage_meta.backend, metadata.version) == (self.backend, FORMAT_VERSION)
        assert set(metadata.state_dict_metadata) == {"w", "ids", "half", "step", "name", "opt.lr",
                                                     "opt.betas.0", "opt.betas.1"}
        target = _zeros(expected)
        arrays = {key: value for key, value in target.items() if isinstance(value, np.ndarray)}
        self.load(target, checkpoint_id)
        _assert_state(target, {k: v for k, v in expected.items() if k != "opt"})
        assert target["opt"] == {"lr": 0.1, "betas": [0.9, 0.99]}
        assert all(target[key] is array for key, array in arrays.items()), "tensors are loaded in place"
        reread = self.make_reader(checkpoint_id).read_metadata()
        assert reread.state_dict_metadata == metadata.state_dict_metadata
        assert reread.storage_meta.save_id == metadata.storage_meta.save_id

    def test_resharded_load_across_simulated_ranks(self):
        checkpoint_id = self.make_id("reshard")
        save_layout = Layout((2,), (0, -1))  # 2 ranks, rows
        states = [{"w": DTensor.from_global(ms.Tensor(FULL), save_layout, rank=r), "ids": np.arange(4)}
                  for r in range(2)]
        metadata = self.simulated_save(states, checkpoint_id)
        assert [c.sizes for c in metadata.state_dict_metadata["w"].chunks] == [(3, 8), (3, 8)]
        load_layout = Layout((4,), (-1, 0))  # 4 ranks, columns
        for rank in range(4):
            param = ms.Parameter(ms.Tensor(np.zeros((6, 2), np.float32)), name="w")
            target = {"w": DTensor(param, load_layout, FULL.shape, rank=rank), "ids": np.zeros(4, np.int64)}
            self.load(target, checkpoint_id)
            assert np.array_equal(param.asnumpy(), FULL[:, 2 * rank:2 * rank + 2]), f"rank {rank}"
            assert target["ids"].tolist() == [0, 1, 2, 3]

    def test_nothing_is_visible_before_the_commit(self):
        checkpoint_id = self.make_id("commit")
        writer = self.make_writer(checkpoint_id)
        writer.set_up_storage_writer(True, rank=0, world_size=1)
        planner = dcp.StandardSavePlanner()
        planner.configure_planner(_state(2.0), rank=0, world_size=1, is_coordinator=True)
        final, metadata = planner.build_global_plan([writer.prepare_local_plan(planner.build_local_plan())])
        plan = writer.prepare_global_plan(final)[0]
        results = writer.write_data(plan, planner).result()
        with pytest.raises(dcp.CheckpointError) as caught:  # written, not committed
            self.make_reader(checkpoint_id).read_metadata()
        assert isinstance(caught.value, (dcp.IncompleteCheckpointError, dcp.CheckpointNotFoundError))
        committed = writer.finish(metadata, [results])
        assert self.make_reader(checkpoint_id).read_metadata().storage_meta.save_id == committed.storage_meta.save_id
        target = _zeros(_state(2.0))
        self.load(target, checkpoint_id)
        assert np.array_equal(target["w"], FULL * 2)

    def test_rank_records_commit_a_save_of_simulated_ranks(self):
        """Backends with rank records: each rank records its results, the coordinator commits from them alone."""
        checkpoint_id = self.make_id("records")
        states = [_state(4.0), _state(4.0)]
        writers, planners, plans = [], [], []
        for rank, state in enumerate(states):
            writer = self.make_writer(checkpoint_id)
            writer.set_up_storage_writer(rank == 0, rank=rank, world_size=2)
            planner = dcp.StandardSavePlanner()
            planner.configure_planner(state, rank=rank, world_size=2, is_coordinator=rank == 0)
            writers.append(writer)
            planners.append(planner)
            plans.append(writer.prepare_local_plan(planner.build_local_plan()))
        if not writers[0].supports_rank_records():
            with pytest.raises(NotImplementedError):
                writers[0].read_rank_record(0)
            pytest.skip("this backend keeps no rank records: its multi-rank async saves commit in result()")
        final, metadata = planners[0].build_global_plan(plans)
        final = writers[0].prepare_global_plan(final)
        save_id = getattr(final[0].storage_data, "save_id", "")
        assert writers[0].read_rank_record(1) is None
        for rank, (writer, planner, plan) in enumerate(zip(writers, planners, final)):
            plan = planner.finalize_plan(plan)
            results = tuple(writer.write_data(plan, planner).result())
            writer.write_rank_record(rank, encode_rank_record(RankRecord(save_id, rank, results)), plan=plan)
        gathered = wait_for_rank_records(writers[0], save_id=save_id, world_size=2, timeout=10)
        writers[0].finish(metadata, gathered)
        writers[0].remove_rank_records(2)
        assert writers[0].read_rank_record(0) is None and writers[0].read_rank_record(1) is None
        target = _zeros(_state(4.0))
        self.load(target, checkpoint_id)
        assert np.array_equal(target["w"], FULL * 4)

    def test_an_uncommitted_save_leaves_the_previous_checkpoint(self):
        checkpoint_id = self.make_id("previous")
        self.save(_state(1.0), checkpoint_id)
        with pytest.raises(OSError, match="injected"):
            self.save(_state(3.0), checkpoint_id, planner=_FailingPlanner("ids"))
        target = _zeros(_state(1.0))
        self.load(target, checkpoint_id)
        _assert_state(target, {k: v for k, v in _state(1.0).items() if k != "opt"})

    def test_rank_local_metadata_per_rank(self):
        checkpoint_id = self.make_id("ranklocal")
        for rank in (0, 1):
            writer = self.make_writer(checkpoint_id)
            writer.set_up_storage_writer(True, rank=rank, world_size=1, rank_local=True)
            planner = dcp.StandardSavePlanner()
            planner.configure_planner({"r": np.full(3, rank, np.int32)}, rank=0, world_size=1, is_coordinator=True)
            final, metadata = planner.build_global_plan([writer.prepare_local_plan(planner.build_local_plan())])
            plan = writer.prepare_global_plan(final)[0]
            writer.finish(metadata, [writer.write_data(plan, planner).result()])
        for rank in (0, 1):
            reader = self.make_reader(checkpoint_id)
            metadata = reader.read_metadata(rank=rank)
            target = {"r": np.zeros(3, np.int32)}
            check_load_compatible(metadata).load(target, storage_reader=reader, planner=dcp.StandardLoadPlanner(),
                                                 metadata=metadata, options=LoadOptions(no_dist=True))
            assert target["r"].tolist() == [rank] * 3, f"rank {rank} reads its own metadata"
        with pytest.raises(dcp.IncompleteCheckpointError):
            self.make_reader(checkpoint_id).read_metadata()  # no shared metadata was committed

    def test_missing_checkpoint(self):
        checkpoint_id = self.make_id("never_saved")
        with pytest.raises(dcp.CheckpointNotFoundError) as caught:
            self.make_reader(checkpoint_id).read_metadata()
        assert isinstance(caught.value, FileNotFoundError)
        with pytest.raises(dcp.CheckpointNotFoundError):
            self.load({"w": np.zeros(2)}, checkpoint_id)

    def test_corruption_is_detected_and_named(self):
        checkpoint_id = self.make_id("corrupt")
        metadata = self.save(_state(1.0), checkpoint_id)
        info = metadata.storage_data[dcp.MetadataIndex("w", (0, 0))]
        self.corrupt(checkpoint_id, info)
        target = _zeros(_state(1.0))
        with pytest.raises(dcp.CorruptCheckpointError, match="'w'"):
            self.load(target, checkpoint_id)
        intact = {"ids": np.zeros(5, np.int64)}
        self.load(intact, checkpoint_id)
        assert intact["ids"].tolist() == [0, 10, 20, 30, 40]

    def test_a_corrupt_item_leaves_its_target_untouched(self):
        checkpoint_id = self.make_id("corrupt_target")
        metadata = self.save({"w": FULL}, checkpoint_id)
        self.corrupt(checkpoint_id, metadata.storage_data[dcp.MetadataIndex("w", (0, 0))])
        target = {"w": np.zeros_like(FULL)}
        with pytest.raises(dcp.CorruptCheckpointError, match="'w'"):
            self.load(target, checkpoint_id)
        assert not target["w"].any(), "a byte reached the target before its checksum matched"
