"""A save refuses Megatron-style state that no rank would write: a key held only as non-main replicas
(replica_id not 0), or a ShardedObject grid position no rank holds. Before, the save succeeded without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import ShardedObject, ShardedTensor, StandardSavePlanner


def test_a_key_held_only_as_non_main_replicas_is_refused(tmp_path: Path) -> None:
    """replica_id=1 on every holder: the save committed without the key."""
    state = {"w": np.ones(2, np.float32),
             "emb": ShardedTensor.from_rank_offsets("emb", np.arange(4, dtype=np.float32), replica_id=1),
             "rng": ShardedObject("rng", {"seed": 3}, (1,), (0,), replica_id=(0, 1))}
    for save in (lambda: dcp.save(state, checkpoint_id=tmp_path / "a"),
                 lambda: dcp.async_save(state, checkpoint_id=tmp_path / "b").result()):
        with pytest.raises(dcp.PlanValidationError) as refused:
            save()
        message = str(refused.value)
        assert "'emb' on rank(s) [0]" in message and "'rng' on rank(s) [0]" in message and "replica_id 0" in message
    assert not (tmp_path / "a" / "metadata.json").exists() and not (tmp_path / "b" / "metadata.json").exists()
    state["emb"] = ShardedTensor.from_rank_offsets("emb", np.arange(4, dtype=np.float32))
    state["rng"] = ShardedObject("rng", {"seed": 3}, (1,), (0,))
    dcp.save(state, checkpoint_id=tmp_path / "c")
    assert set(dcp.read_metadata(tmp_path / "c").state_dict_metadata) == {"w", "emb", "rng"}


def test_a_sharded_object_grid_with_positions_nobody_writes_is_refused(tmp_path: Path) -> None:
    """A grid of 4 with positions 0 and 2 held: the save committed half the objects (a 4-rank load then failed)."""
    with pytest.raises(dcp.PlanValidationError, match=r"ShardedObject 'rng' of global_shape \[4\] has 2 of 4 grid "
                                                      r"positions, e.g. \[\[1\], \[3\]\] missing"):
        dcp.save({"a": ShardedObject("rng", 1, (4,), (0,)), "b": ShardedObject("rng", 2, (4,), (2,))},
                 checkpoint_id=tmp_path)
    assert not (tmp_path / "metadata.json").exists()


def test_ranks_driven_in_one_process_write_a_complete_grid() -> None:
    """Each of 2 ranks holds its grid position (and a replica of the other's key): nothing is refused."""
    plans = []
    planners = []
    for rank in range(2):
        planner = StandardSavePlanner()
        state = {"rng": ShardedObject("rng", rank, (2,), (rank,)),
                 "emb": ShardedTensor.from_rank_offsets("emb", np.ones(4, np.float32), replica_id=rank)}
        planner.configure_planner(state, rank=rank, world_size=2, is_coordinator=rank == 0)
        planners.append(planner)
        plans.append(planner.build_local_plan())
    _, metadata = planners[0].build_global_plan(plans)
    assert metadata.state_dict_metadata["rng"].shard_offsets == ((0,), (1,))
    assert "emb" in metadata.state_dict_metadata
    plans[0] = planners[0].build_local_plan()
    lonely = StandardSavePlanner()
    lonely.configure_planner({"emb": ShardedTensor.from_rank_offsets("emb", np.ones(4, np.float32), replica_id=1),
                              "rng": ShardedObject("rng", 1, (2,), (1,))}, rank=1, world_size=2, is_coordinator=False)
    with pytest.raises(dcp.PlanValidationError, match=r"'emb' on rank\(s\) \[1\]"):
        planners[0].build_global_plan([plans[0].__class__(items=(), planner_data=None), lonely.build_local_plan()])
