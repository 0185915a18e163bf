"""A save refuses Megatron-style state that no rank would write: a key held only as non-main replicas
(replica_id not 0), or a ShardedObject grid position no rank holds. Before, the save succeeded without it."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import ShardedObject, ShardedTensor, StandardSavePlanner
from hyper_parallel.core.distributed_checkpoint._collectives import _error_class
from hyper_parallel.core.distributed_checkpoint._unwritten_keys import key_hash, name_refusal
from msrun_harness import run_workers


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


WORKER = Path(__file__).resolve().parent / "workers" / "unwritten_worker.py"


def test_under_msrun_a_key_only_another_rank_holds_is_named_on_every_rank(tmp_path: Path) -> None:
    """Ranks send hashes of the keys they hold only as non-main replicas; rank 0 never saw 'decoder.only_on_1'
    (rank 1's): the refusal names it and its rank on both ranks, and the job saves the fixed state after."""
    results = run_workers(WORKER, workers=2, tmp_path=tmp_path)
    for rank in (0, 1):
        for name in ("refused", "refused_async"):
            assert results[rank][name]["ok"], results[rank][name]
            kind, message, committed = results[rank][name]["value"]
            assert "PlanValidationError" in kind and not committed
            assert "'decoder.only_on_1' on rank(s) [1]" in message and "key #" not in message, message
        assert results[rank]["after"]["value"] == [0.0, 1.0, 2.0, 3.0]
    assert results[1]["sent"]["value"][1] is False and results[0]["sent"]["value"][1] is False  # a hash, not the name
    # Both ranks offered box [0] of 'decoder.tied' as its main replica: the save kept rank 0's copy (or rank 1's)
    # without a word. Refused on both ranks, different data or equal, as Megatron's sharding check refuses it.
    for rank in (0, 1):
        for name in ("two_main", "two_main_async", "two_main_equal"):
            assert results[rank][name]["ok"], results[rank][name]
            kind, message, committed = results[rank][name]["value"]
            assert "PlanValidationError" in kind and not committed, (name, kind, message)
            assert ("'decoder.tied': the box at global offset [0] of sizes [3] is offered as the main replica "
                    "(replica_id 0) of a ShardedTensor by ranks [0, 1]") in message, message
            assert "give the copies on all ranks but one a replica_id other than 0" in message
        tied, rows = results[rank]["marked"]["value"]
        assert tied == (np.arange(6, dtype=np.float32).reshape(2, 3) / 7).tobytes()
        assert rows == np.concatenate([np.arange(8, dtype=np.float32).reshape(2, 4) * 1.5 + r
                                       for r in (0, 1)]).tobytes()


def test_a_thousand_non_main_keys_cost_about_eight_bytes_each_in_the_local_plan() -> None:
    """A rank holding 1,000 ShardedTensors only as non-main replicas sent their names (43,497 B); now 8-byte
    hashes. The coordinator still refuses them, naming a key it holds itself and the others by hash, which the
    failure path resolves from the ranks' own keys."""
    names = [f"decoder.layers.{i}.mlp.linear_fc1.weight" for i in range(1000)]
    planners, plans = [], []
    for rank in range(2):
        state = {"w": np.ones(2, np.float32)}
        if rank == 1:
            state.update({n: ShardedTensor.from_rank_offsets(n, np.ones(4, np.float32), replica_id=1) for n in names})
        else:
            state["mine"] = ShardedTensor.from_rank_offsets("mine", np.ones(4, np.float32), replica_id=1)
        planner = StandardSavePlanner()
        planner.configure_planner(state, rank=rank, world_size=2, is_coordinator=rank == 0)
        planners.append(planner)
        plans.append(planner.build_local_plan())
    blob = pickle.dumps(plans[1], protocol=pickle.HIGHEST_PROTOCOL)
    assert len(blob) < 1000 * 8 + 1000 and names[7].encode() not in blob
    with pytest.raises(dcp.PlanValidationError) as refused:
        planners[0].build_global_plan(plans)
    message = str(refused.value)
    assert message.startswith("1001 key(s) are held only as non-main replicas") and "'mine' on rank(s) [0]" in message
    assert message.count("key #") == 19 and names[7] not in message
    named = name_refusal(refused.value, gather=lambda fn: [fn(), planners[1].unwritten_names(
        {key_hash(n) for n in names})], names_of=planners[0].unwritten_names)
    text = str(named)
    assert "key #" not in text and "'mine' on rank(s) [0]" in text and text.count("on rank(s) [1]") == 19
    collective = _error_class({"PlanValidationError"})("plan", {0: f"PlanValidationError: {message}"})
    named = name_refusal(collective, gather=lambda fn: [fn()], names_of=planners[1].unwritten_names)
    assert type(named) is type(collective) and isinstance(named, dcp.PlanValidationError) and named.failed_ranks == (0,)
    assert str(named).count("key #") == 0 and str(named).count("on rank(s) [1]") == 19
    unnamed = name_refusal(collective, gather=lambda fn: [{}], names_of=None)
    assert str(unnamed) == str(collective)  # a hash no rank names stays as it was
    assert name_refusal(ValueError("key #0123456789abcdef"), gather=None, names_of=None) is None
    assert name_refusal(dcp.PlanValidationError("overlap"), gather=None, names_of=None) is None
