"""The layout-form merge decides exactly what the per-rank merge decides (simulated ranks)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from hyper_parallel.core.distributed_checkpoint import PlanValidationError
from hyper_parallel.core.distributed_checkpoint._grid_chunks import GridChunks
from hyper_parallel.core.distributed_checkpoint._layout_merge import _Irregular, _Merge, keep_masks
from hyper_parallel.core.distributed_checkpoint._layout_plan import LayoutSavePlan, expand_save_plan
from hyper_parallel.core.distributed_checkpoint.mapping import ShardedObject, ShardedTensor
from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.core.layout import Layout
from tests.sim_ranks import plan_ranks

WORLD = 8
RNG = np.random.default_rng(7)


def _full(shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


# (name, layout, global shape, dtype): replicas, tuple tensor maps, permuted rank lists, uneven sizes.
LAYOUTS = [
    ("tp_dp", Layout((2, 4), (1, 0)), (6, 8), np.float32),
    ("rows_replicated", Layout((2, 4), (0, -1)), (16, 3), np.float32),
    ("rows_replicated_big", Layout((2, 4), (0, -1)), (40, 5), np.float16),
    ("tuple_map", Layout((2, 2, 2), ((2, 0), -1)), (12, 7), np.float32),
    ("all_replicated", Layout((8,), (-1, -1)), (3, 3), np.int32),
    ("permuted", Layout((2, 4), (1, -1), rank_list=(7, 6, 5, 4, 3, 2, 1, 0)), (10, 2), np.float64),
    ("cols", Layout((4, 2), (-1, 1)), (5, 8), np.float32),
    ("scalar_dt", Layout((8,), ()), (), np.float32),
]
FULLS = {name: _full(shape, dtype) for name, _, shape, dtype in LAYOUTS}
PLAIN = {f"plain.{i}": _full((i + 1, 3)) for i in range(5)}
STAGE = {f"stage{s}.w": _full((8, 4)) for s in range(2)}


def _state(rank: int, *, differ: str | None = None, skip: str | None = None, sharded_tensor: bool = True,
           stages: bool = True):
    state = {}
    for name, layout, _, _ in LAYOUTS:
        if name != skip:
            state[name] = DTensor.from_global(FULLS[name], layout, rank=rank)
    for name, value in PLAIN.items():
        state[name] = value + 1 if (differ == name and rank == 3) else value
    stage = rank // 4 if stages else 0  # two pipeline stages: each its own weights (tables differ by stage)
    ranks = tuple(range(stage * 4, stage * 4 + 4)) if stages else tuple(range(WORLD))
    layout = Layout((len(ranks),), (0, -1), rank_list=ranks)
    state[f"stage{stage}.w"] = DTensor.from_global(STAGE[f"stage{stage}.w"], layout, rank=rank)
    state["step"] = 12
    state["cell"] = ShardedObject("cell", {"rank": rank}, (WORLD,), (rank,))
    if sharded_tensor:
        full = STAGE["stage0.w"]
        state["st"] = ShardedTensor.from_rank_offsets("st", full[rank:rank + 1], (0, rank, WORLD))
    return state


def _both(states, **options):
    """The old merge and the layout merge of the same local plans: (masks, metadata) each."""
    planners, plans = plan_ranks(states, **options)
    final, metadata = planners[0].build_global_plan(plans)
    compact = [planner.compact_local_plan(plan) for planner, plan in zip(planners, plans)]
    for rank, (plan, sent) in enumerate(zip(plans, compact)):
        assert expand_save_plan(sent, rank=rank) == plan  # lossless
    masks, merged = planners[0].build_global_masks([pickle.loads(pickle.dumps(p)) for p in compact])
    return (keep_masks(plans, final), metadata), (masks, merged), compact


OPTIONS = [
    {},
    {"remove_redundancy": False},
    {"save_to_minimum_rank": True},
    {"check_replicas": False},
]


@pytest.mark.parametrize("options", OPTIONS, ids=["balanced", "keep_all", "min_rank", "no_replica_check"])
def test_layout_merge_equals_per_rank_merge(options):
    states = [_state(rank) for rank in range(WORLD)]
    (old_masks, old_meta), (new_masks, new_meta), compact = _both(states, **options)
    assert new_masks == old_masks
    assert new_meta == old_meta
    assert list(new_meta.state_dict_metadata) == list(old_meta.state_dict_metadata)  # same order
    assert new_meta.storage_meta.bytes_per_rank == old_meta.storage_meta.bytes_per_rank
    assert all(isinstance(p, LayoutSavePlan) for p in compact)
    # Ranks of one pipeline stage send the same table bytes: the coordinator decodes 2 tables, not 8.
    assert len({p.table for p in compact}) == 2
    _Merge(compact, options.get("remove_redundancy", True), options.get("save_to_minimum_rank", False)).run(None)
    grid = new_meta.state_dict_metadata["rows_replicated"]
    assert isinstance(grid.chunks, GridChunks) and grid.chunks == old_meta.state_dict_metadata["rows_replicated"].chunks
    if options == {}:
        # The balance really is exercised: replicated chunks do not all land on rank 0.
        written = [sum(bin(b).count("1") for b in mask) for mask in new_masks]
        assert len(set(written)) > 1 and min(new_meta.storage_meta.bytes_per_rank) > 0


def test_layout_merge_without_general_items_stays_regular():
    states = [_state(rank, sharded_tensor=False) for rank in range(WORLD)]
    (old_masks, old_meta), (new_masks, new_meta), compact = _both(states)
    assert (new_masks, new_meta) == (old_masks, old_meta)
    _Merge(compact, True, False).run(None)


@pytest.mark.parametrize("differ", [None, "plain.1", "rows_replicated"])
def test_one_table_for_every_rank(differ):
    """Every rank with the same structure: one table, replica digests compared a table at a time."""
    states = [_state(rank, stages=False) for rank in range(WORLD)]
    if differ == "rows_replicated":
        bad = FULLS[differ].copy()
        bad[LAYOUTS[1][1].shard_offsets(bad.shape, 6)] += 1
        states[6][differ] = DTensor.from_global(bad, LAYOUTS[1][1], rank=6)
    elif differ:
        states[6][differ] = PLAIN[differ] * 2
    planners, plans = plan_ranks(states)
    compact = [planner.compact_local_plan(plan) for planner, plan in zip(planners, plans)]
    assert len({p.table for p in compact}) == 1
    if differ is None:
        (old_masks, old_meta), (new_masks, new_meta), _ = _both(states)
        assert (new_masks, new_meta) == (old_masks, old_meta)
        _Merge(compact, True, False).run(None)
        return
    with pytest.raises(PlanValidationError) as old:
        planners[0].build_global_plan(plans)
    with pytest.raises(PlanValidationError) as new:
        planners[0].build_global_masks(compact)
    assert str(new.value) == str(old.value) and "rank" in str(new.value)


@pytest.mark.parametrize("case", ["plain_differs", "dtensor_replica_differs", "layout_rank_missing"])
def test_layout_merge_reports_the_same_errors(case):
    states = [_state(rank) for rank in range(WORLD)]
    if case == "plain_differs":
        states = [_state(rank, differ="plain.2") for rank in range(WORLD)]
    elif case == "dtensor_replica_differs":
        bad = FULLS["rows_replicated"].copy()
        bad[LAYOUTS[1][1].shard_offsets(bad.shape, 5)] += 1  # rank 5's shard; rank 1 holds its replica
        states[5]["rows_replicated"] = DTensor.from_global(bad, LAYOUTS[1][1], rank=5)
    else:
        del states[6]["tp_dp"]  # a rank of the layout does not offer its shard: part of the tensor is missing
    planners, plans = plan_ranks(states)
    with pytest.raises(PlanValidationError) as old:
        planners[0].build_global_plan(plans)
    compact = [planner.compact_local_plan(plan) for planner, plan in zip(planners, plans)]
    with pytest.raises(_Irregular):
        _Merge(compact, True, False).run(None)
    with pytest.raises(PlanValidationError) as new:
        planners[0].build_global_masks(compact)
    assert str(new.value) == str(old.value)


def test_mixed_declarations_fall_back_to_the_general_merge():
    """A tensor held whole by one rank and by layout on the others merges as before."""
    states = [_state(rank) for rank in range(WORLD)]
    states[0]["all_replicated"] = FULLS["all_replicated"]
    (old_masks, old_meta), (new_masks, new_meta), _ = _both(states)
    assert (new_masks, new_meta) == (old_masks, old_meta)


def test_grid_chunks_is_the_tuple_of_its_chunks():
    grid = GridChunks((4, 6), (2, 3))
    chunks = tuple(ChunkStorageMetadata((r, c), (2, 3)) for r in (0, 2) for c in (0, 3))
    assert len(grid) == 4 and grid[1] == chunks[1] and grid[-1] == chunks[-1] and grid[1:3] == chunks[1:3]
    assert grid == chunks and chunks == grid and hash(grid) == hash(chunks) and list(grid) == list(chunks)
    assert pickle.loads(pickle.dumps(grid)) == grid and grid != GridChunks((4, 6), (4, 3))
    assert grid != "abcd" and repr(grid) == "GridChunks(size=(4, 6), chunk_sizes=(2, 3))"
    stored = TensorStorageMetadata(properties=None, size=(4, 6), chunks=grid)
    assert stored == TensorStorageMetadata(properties=None, size=(4, 6), chunks=chunks)
    with pytest.raises(IndexError):
        _ = GridChunks((4,), (2,))[2]
    with pytest.raises(ValueError):
        GridChunks((5,), (2,))


def _merged_both_ways(plans, layouts):
    """(masks, metadata or error text) of the per-item merge and of the layout merge of hand-made plans."""
    from hyper_parallel.core.distributed_checkpoint._global_plan import build_global_save_plan
    from hyper_parallel.core.distributed_checkpoint._layout_merge import merge_layout_plans
    from hyper_parallel.core.distributed_checkpoint._layout_plan import compact_save_plan

    world = len(plans)
    compact = [compact_save_plan(plan, layouts[rank], rank=rank, world_size=world) for rank, plan in enumerate(plans)]
    results = []
    for merge in (lambda: _old(build_global_save_plan, plans), lambda: merge_layout_plans(compact)):
        try:
            results.append(merge())
        except PlanValidationError as exc:
            results.append(str(exc))
    return results, compact


def _old(build, plans):
    final, metadata = build(plans)
    return keep_masks(plans, final), metadata


def _tensor_item(fqn, offsets, sizes, size, digest=None):
    from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex, TensorProperties
    from hyper_parallel.core.distributed_checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    return WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.TENSOR if sizes == size else
                     WriteItemType.SHARD, tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes),
                                                                      TensorProperties("float32"), size, digest))


def _rows(fqn, rank, ranks, layout, digest=None):
    return _tensor_item(fqn, (2 * ranks.index(rank), 0), (2, 3), (2 * len(ranks), 3), digest)


def test_hand_made_plans_merge_as_the_per_item_merge():
    """Ranks sending plain plans, a non-hex digest, a rank outside a layout, zero-size and repeated items."""
    from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex
    from hyper_parallel.core.distributed_checkpoint.planner import SavePlan

    ranks = (0, 1, 2)
    rows = Layout((3,), (0, -1), rank_list=ranks)
    plans, layouts = [], []
    for rank in range(4):
        items, known = [], {}
        if rank in ranks:
            item = _rows("w", rank, ranks, rows)
            items.append(item)
            known[MetadataIndex("w", item.index.offset)] = rows
            whole = _tensor_item("b", (0,), (5,), (5,), digest="0123456789abcdef")
            items.append(whole)
            known[MetadataIndex("b", (0,))] = None
        odd = _tensor_item("odd", (0,), (2,), (2,), digest="not a hex digest")  # stays general
        items.append(odd)
        known[MetadataIndex("odd", (0,))] = None
        plans.append(SavePlan(items=tuple(items)))
        layouts.append(known if rank in ranks else {})
    (old, new), compact = _merged_both_ways(plans, layouts)
    assert not isinstance(compact[3], LayoutSavePlan) and isinstance(compact[0], LayoutSavePlan)
    assert new == old and not isinstance(new, str)
    _Merge(compact, True, False).run(None)


@pytest.mark.parametrize("case", ["beyond_world", "twice", "zero_size", "not_in_layout"])
def test_irregular_hand_made_plans_fall_back(case):
    from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex
    from hyper_parallel.core.distributed_checkpoint.planner import SavePlan

    ranks = (0, 1, 2, 3) if case == "beyond_world" else (0, 1)
    layout = Layout((len(ranks),), (0, -1), rank_list=ranks)
    plans, layouts = [], []
    for rank in range(2):
        item = _rows("w", rank, ranks, layout)
        items, known = [item], {MetadataIndex("w", item.index.offset): layout}
        if case == "twice":
            items.append(item)
        elif case == "zero_size":
            empty = _tensor_item("e", (0, 0), (0, 3), (0, 3))
            items.append(empty)
            known[MetadataIndex("e", (0, 0))] = Layout((2,), (0, -1))
        elif case == "not_in_layout":
            other = _tensor_item("x", (0,), (4,), (4,))
            items.append(other)
            known[MetadataIndex("x", (0,))] = Layout((1,), (-1,), rank_list=(1 - rank + 5,))
        plans.append(SavePlan(items=tuple(items)))
        layouts.append(known)
    (old, new), compact = _merged_both_ways(plans, layouts)
    assert new == old
    if case == "twice":
        with pytest.raises(_Irregular):
            _Merge(compact, True, False).run(None)


def test_layout_form_save_writes_the_same_checkpoint(tmp_path):
    """Saved through the layout form: the same metadata.json (grid chunks written as the list), same data."""
    import json

    import hyper_parallel.core.distributed_checkpoint as dcp
    from tests.sim_ranks import simulate_save

    states = [_state(rank, sharded_tensor=False) for rank in range(WORLD)]
    for rank in range(WORLD):
        states[rank].pop("cell")  # loaded below into one process: a ShardedObject cell per rank is not
    old, old_bytes = simulate_save(states, tmp_path / "old")
    new, new_bytes = simulate_save(states, tmp_path / "new", layout_form=True)
    assert new_bytes == old_bytes and new.state_dict_metadata == old.state_dict_metadata

    def stored(name, metadata):
        text = (tmp_path / name / "metadata.json").read_text().replace(metadata.storage_meta.save_id, "SAVE")
        document = json.loads(text)
        document.pop("created", None)
        return document

    assert stored("new", new) == stored("old", old)  # key order, chunks, files, offsets, checksums
    target = {name: np.zeros_like(FULLS[name]) for name, *_ in LAYOUTS}
    dcp.load(target, checkpoint_id=tmp_path / "new", no_dist=True)
    for name, value in target.items():
        np.testing.assert_array_equal(value, FULLS[name])


@pytest.mark.parametrize("changed", [None, "rank 5 plain.3", "rank 2 as items"])
def test_reused_layout_form_plan_checks_this_saves_replica_digests(changed):
    """A reuse after a layout-form exchange re-checks replicas with the new digests (per layout, numpy)."""
    from hyper_parallel.core.distributed_checkpoint._plan_cache import CachedPlan, PlanMessage, check_cached_replicas

    states = [_state(rank) for rank in range(WORLD)]
    planners, plans = plan_ranks(states)
    compact = [planner.compact_local_plan(plan) for planner, plan in zip(planners, plans)]
    if changed == "rank 2 as items":
        compact[2] = plans[2]  # a rank that sent its plan item by item
    cached = CachedPlan(exchange="x", final=plans[0], all_final=None, metadata=None, local_plans=tuple(compact))
    messages = []
    for rank, plan in enumerate(plans):
        digests = [(item.index.fqn, item.tensor_data.replica_digest) for item in plan.items
                   if item.tensor_data is not None and item.tensor_data.replica_digest]
        if changed == "rank 5 plain.3" and rank == 5:
            digests = [(fqn, "ffffffffffffffff" if fqn == "plain.3" else d) for fqn, d in digests]
        if changed == "rank 2 as items" and rank == 2:
            digests = [(fqn, d.upper() if fqn == "plain.0" else d) for fqn, d in digests]
        messages.append(PlanMessage(local_digest="d", cached_exchange="x",
                                    replica_digests=tuple(d for _, d in digests)))
    if changed is None:
        check_cached_replicas(cached, messages)
        return
    with pytest.raises(PlanValidationError) as failure:
        check_cached_replicas(cached, messages)
    key, rank = ("plain.3", "5") if changed.startswith("rank 5") else ("plain.0", "2")
    assert f"'{key}'" in str(failure.value) and rank in str(failure.value)
