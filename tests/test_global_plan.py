"""The coordinator's merge, driven for simulated ranks in one process."""

from __future__ import annotations

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint._format.cover import check_exact_cover
from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata as Chunk
from sim_ranks import plan_ranks, simulate_save


def _bytes_per_rank(states, **kwargs):
    planners, plans = plan_ranks(states, **kwargs)
    final, metadata = planners[0].build_global_plan(plans)
    return [sum(item.storage_size() for item in plan.items) for plan in final], final, metadata


def test_replicated_tensors_written_once_and_balanced():
    tensors = {f"t{i}": np.full((256,), i, np.float32) for i in range(40)}  # 1 KiB each, on every rank
    states = [dict(tensors) for _ in range(4)]
    per_rank, final, _ = _bytes_per_rank(states)
    assert sum(per_rank) == 40 * 1024, "each replicated byte is written exactly once"
    ideal = 40 * 1024 / 4
    assert max(per_rank) <= ideal * 1.10
    written = sorted(item.index.fqn for plan in final for item in plan.items)
    assert written == sorted(tensors)


def test_save_to_minimum_rank_and_no_dedup():
    states = [{"a": np.ones(8, np.float32), "b": np.ones(4, np.float32)} for _ in range(3)]
    per_rank, _, _ = _bytes_per_rank(states, save_to_minimum_rank=True)
    assert per_rank == [48, 0, 0]
    per_rank, _, _ = _bytes_per_rank(states, remove_redundancy=False)
    assert per_rank == [48, 48, 48]


def test_balance_gives_big_items_to_least_loaded_holder():
    # rank 0 alone holds a big shard; replicated items should go to the others first.
    states = [{"big": np.ones(1000, np.float32)}] + [{} for _ in range(2)]
    for state in states:
        state.update({"r1": np.ones(100, np.float32), "r2": np.ones(100, np.float32)})
    per_rank, _, _ = _bytes_per_rank(states)
    assert per_rank == [4000, 400, 400]


def test_dtensor_replicas_along_unused_mesh_dim_deduplicated(tmp_path):
    full = np.arange(32, dtype=np.float32).reshape(4, 8)
    layout = Layout((2, 2), (-1, 1))  # dim 1 split over mesh dim 0; mesh dim 1 replicates
    states = [{"w": DTensor.from_global(full, layout, rank=r)} for r in range(4)]
    metadata, written = simulate_save(states, tmp_path / "c")
    assert sum(written) == full.nbytes
    assert len(metadata.state_dict_metadata["w"].chunks) == 2
    target = np.zeros_like(full)
    dcp.load({"w": target}, checkpoint_id=tmp_path / "c", no_dist=True)
    assert np.array_equal(target, full)


def test_validation_reports_every_problem_at_once():
    states = [
        {"d": np.ones(4, np.float32), "s": np.ones(4, np.float32), "v": 1, "kind": np.ones(2)},
        {"d": np.ones(4, np.float64), "s": np.ones(5, np.float32), "v": 2, "kind": "x"},
    ]
    planners, plans = plan_ranks(states)
    with pytest.raises(dcp.PlanValidationError) as caught:
        planners[0].build_global_plan(plans)
    text = str(caught.value)
    assert "'d': dtype differs between ranks (float32 on ranks [0]; float64 on ranks [1])" in text
    assert "'s': global shape differs between ranks" in text
    assert "'v': the value differs between ranks (ranks [0]; ranks [1] each agree)" in text
    assert "ShardedObject" in text
    assert "'kind': saved as a tensor by some ranks and as a non-tensor value by others" in text
    assert "(5 problem(s))" in text
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("layout_form", [False, True])
@pytest.mark.parametrize("values", [(np.float32(1.5), np.array(1.5, np.float32)),
                                    (np.array(1.5, np.float32), np.float32(1.5))])
def test_a_value_on_one_rank_and_a_tensor_on_another_is_named(tmp_path, layout_form, values):
    """A numpy scalar on one rank and a 0-d array on the other (one a value, one a tensor): only each item's first
    holder was compared, so the coordinator met the other kind in its checks and raised AttributeError."""
    with pytest.raises(dcp.PlanValidationError, match="'x': saved as a tensor by some ranks and as a non-tensor value"):
        simulate_save([{"x": value} for value in values], tmp_path / "c", layout_form=layout_form)
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_overlapping_and_missing_shards_refused():
    full = np.arange(16, dtype=np.float32).reshape(4, 4)
    layout = Layout((2,), (0, -1))
    # Both ranks claim to be rank 0's shard: nothing covers rows 2..3.
    gap = [{"w": DTensor.from_global(full, layout, rank=0)}, {"w": DTensor.from_global(full, layout, rank=0)}]
    planners, plans = plan_ranks(gap)
    with pytest.raises(dcp.PlanValidationError, match="cover 8 of 16 elements"):
        planners[0].build_global_plan(plans)
    overlap = [
        {"w": dcp.ShardedTensor("w", full[0:3], "f", (3, 4), (4, 4), (0, 0), None)},
        {"w": dcp.ShardedTensor("w", full[1:4], "f", (3, 4), (4, 4), (1, 0), None)},
    ]
    planners, plans = plan_ranks(overlap)
    with pytest.raises(dcp.PlanValidationError, match=r"shards at offsets \(0, 0\).*\(1, 0\).*overlap"):
        planners[0].build_global_plan(plans)


def test_check_exact_cover_grid_and_irregular():
    assert check_exact_cover("g", (4, 4), [Chunk((0, 0), (2, 4)), Chunk((2, 0), (2, 2)), Chunk((2, 2), (2, 2))]) == []
    assert check_exact_cover("g", (4,), [Chunk((0,), (2,)), Chunk((2,), (2,))]) == []
    problems = check_exact_cover("g", (4,), [Chunk((0,), (3,)), Chunk((2,), (2,))])
    assert problems and "overlap" in problems[0]
    problems = check_exact_cover("g", (4,), [Chunk((0,), (5,))])
    assert "leaves the global shape" in problems[0]
    assert check_exact_cover("s", (), [Chunk((), ())]) == []


def test_planning_scales_linearly_in_items():
    """Plans for many ranks merge; cost is checked by scripts/, here only correctness at size."""
    states = [{f"rep{i}": np.ones(2, np.float32) for i in range(50)} for _ in range(64)]
    per_rank, final, metadata = _bytes_per_rank(states)
    assert sum(per_rank) == 50 * 8
    assert len(metadata.state_dict_metadata) == 50
