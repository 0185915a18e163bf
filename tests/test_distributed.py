"""Distributed save and load under real msrun launches (2 and 4 CPU workers).

Three launches in order: 2 ranks save checkpoint Y (and run the async and
rank-local scenarios), 4 ranks load Y in another layout and save X (and run
dedup and failure scenarios), 2 ranks load X in a third layout; finally this
process (no communication) loads X whole.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from msrun_harness import check_scenarios, run_workers, scenario_values

pytestmark = pytest.mark.msrun
WORKER = Path(__file__).parent / "workers" / "dist_worker.py"
FULL_X = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def two_first(base, tmp_path_factory):
    results = run_workers(WORKER, workers=2, tmp_path=tmp_path_factory.mktemp("l1"), args=["two_first", str(base)],
                          timeout=400)
    return results


@pytest.fixture(scope="module")
def four(base, two_first, tmp_path_factory):
    return run_workers(WORKER, workers=4, tmp_path=tmp_path_factory.mktemp("l2"), args=["four", str(base)],
                       timeout=500)


@pytest.fixture(scope="module")
def two_last(base, four, tmp_path_factory):
    return run_workers(WORKER, workers=2, tmp_path=tmp_path_factory.mktemp("l3"), args=["two_last", str(base)],
                       timeout=400)


def test_two_rank_save_commits_before_return(two_first):
    check_scenarios(two_first, ["save_y"])
    for rank, value in enumerate(scenario_values(two_first, "save_y")):
        assert value["committed"]
        assert sum(value["bytes_per_rank"]) == 8 * 12 * 4 + 8 * 4 * 2 + 8 * 4 + 1
        # The ranks sent layout-form plans and the coordinator merged them per layout (no fallback).
        assert value["layout_merges"] == ([1, 0] if rank == 0 else [0, 0]), value


def test_repeated_layout_reuses_the_plan_on_every_rank(two_first):
    check_scenarios(two_first, ["plan_cache"])
    for rank, value in enumerate(scenario_values(two_first, "plan_cache")):
        # saves 2 and 3 reuse; rank 1's change re-plans on both ranks; the async save then reuses that plan
        assert value["counts"] == [[0, 0], [1, 0], [2, 0], [2, 1], [3, 1]]
        assert [list(pair) for pair in value["loaded"]] == [[[float(step * 10 + rank)], True] for step in (0, 1, 2)] + [
            [[float(20 + rank)], True]] * 2


def test_async_saves_in_a_loop_keep_their_own_step(two_first):
    check_scenarios(two_first, ["async_loop", "async_deleted_tensors"])
    for rank, value in enumerate(scenario_values(two_first, "async_loop")):
        assert value["loaded"] == [{"step": step, "values": [float(step * 100 + rank)]} for step in range(5)]
    for value in scenario_values(two_first, "async_deleted_tensors"):
        assert value == {"a": 3.0, "b": [5] * 10}


def test_async_early_copies_only_what_the_rank_writes(two_first):
    check_scenarios(two_first, ["async_early_copies"])
    values = scenario_values(two_first, "async_early_copies")
    for rank_value in values:
        assert rank_value["loaded"] == [[0.0], [10.0], [20.0], [30.0]]  # the values of each call, on every rank
        assert rank_value["counts"][0] == [0, 0]  # a first save of a rank in a job of several copies nothing early
        for copied, used in rank_value["counts"][1:]:
            assert copied == used  # nothing copied in vain: exactly the replicas this rank writes
    for step in (1, 2):  # each of the 6 replicated Parameters is written (and copied early) by one rank
        assert sum(value["counts"][step][0] for value in values) == 6


def test_async_background_failure_surfaces_on_every_rank(two_first):
    check_scenarios(two_first, ["async_write_failure"])
    for value in scenario_values(two_first, "async_write_failure"):
        assert value["type"] in ("CollectiveStepError", "CollectiveCheckpointIOError")
        assert value["failed_ranks"] == [1]
        assert "No space left on device" in value["message"]
        assert value["old_values"] == [1.0] * 16, "the earlier committed checkpoint must stay intact"


def test_use_collectives_false_round_trip(two_first, base):
    check_scenarios(two_first, ["no_collectives"])
    for rank, value in enumerate(scenario_values(two_first, "no_collectives")):
        assert value["mine"] == [rank] * 4 and value["step"] == rank
        assert "metadata.rank00000.json" in value["files"] and "metadata.rank00001.json" in value["files"]


def test_four_ranks_load_a_two_rank_checkpoint_in_another_layout(four):
    check_scenarios(four, ["load_y_on_four"])
    assert scenario_values(four, "load_y_on_four") == [{"ok": True, "bf_ok": True, "step": 7}] * 4


def test_replicated_state_written_once_and_balanced(four):
    check_scenarios(four, ["replicated_bytes"])
    value = scenario_values(four, "replicated_bytes")[0]
    per_rank = value["bytes_per_rank"]
    assert sum(per_rank) == 40 * 1024 * 4, "total written equals the unique bytes"
    ideal = sum(per_rank) / 4
    assert max(per_rank) <= ideal * 1.10
    assert sorted(value["file_bytes"]) == ["r00000", "r00001", "r00002", "r00003"]


def test_single_replica_read_reads_each_byte_once(four):
    check_scenarios(four, ["single_replica_read"])
    values = scenario_values(four, "single_replica_read")
    assert all(v["ok"] and v["x_ok"] for v in values)
    assert sum(v["bytes_read"] for v in values) == 40 * 1024 * 4, "unique bytes, read once in total"
    assert max(v["bytes_read"] for v in values) <= 40 * 1024 * 4 / 4 * 1.1, "reads balanced across ranks"
    assert sum(v["x_bytes_read"] for v in values) == 16 * 8 * 4


def test_three_dedup_modes(four):
    check_scenarios(four, ["dedup_modes"])
    value = scenario_values(four, "dedup_modes")[0]
    assert value["min"] == {"bytes": [8 * 1024, 0, 0, 0], "ok": True}
    assert value["all"] == {"bytes": [8 * 1024] * 4, "ok": True}
    assert value["balanced"] == {"bytes": [2048] * 4, "ok": True}


def test_failures_raise_the_same_error_on_every_rank(four):
    names = ["save_failure_planning", "save_failure_write", "save_failure_commit", "load_failure_missing_key",
             "load_failure_read", "differing_value"]
    check_scenarios(four, names)
    for value in scenario_values(four, "save_failure_planning"):
        assert value["failed_ranks"] == [2] and "'weird'" in value["message"] and "allow_pickle" in value["message"]
        assert value["seconds"] < 60
    for value in scenario_values(four, "save_failure_write"):
        assert value["failed_ranks"] == [1] and "No space left" in value["message"] and not value["committed"]
    for value in scenario_values(four, "save_failure_commit"):
        assert value["failed_ranks"] == [0] and "commit" in value["message"] and not value["committed"]
    for value in scenario_values(four, "load_failure_missing_key"):
        assert value["failed_ranks"] == [3] and value["is_missing_key"] and "'nope'" in value["message"]
    for value in scenario_values(four, "load_failure_read"):
        assert value["failed_ranks"] == [1] and "I/O error while reading" in value["message"]
    for value in scenario_values(four, "differing_value"):
        assert value["failed_ranks"] == [0] and value["is_validation"]
        assert "'step'" in value["message"] and "ranks [0, 2]" in value["message"]


def test_corrupt_chunk_of_one_rank_changes_no_rank_targets(four):
    """Verify before a byte lands, across ranks: the verify step fails on every rank before any read."""
    check_scenarios(four, ["load_corrupt_on_one_rank"])
    for value in scenario_values(four, "load_corrupt_on_one_rank"):
        assert value["failed_ranks"] == [3] and "checksum mismatch" in value["message"], value
        assert "no target was changed" in value["message"] and value["untouched"], value


def test_one_line_forms_under_msrun(two_first):
    check_scenarios(two_first, ["one_liners"])
    for value in scenario_values(two_first, "one_liners"):
        assert value["same"] and value["keys"] == ["bias", "weight"]
        assert value["weight_sum"] == value["expected_sum"]


def test_sharded_tensor_from_four_loads_into_dtensors_and_flat_ranges_on_two(four, two_last):
    check_scenarios(four, ["save_mapping"])
    check_scenarios(two_last, ["load_mapping_on_two"])
    for rank, value in enumerate(scenario_values(two_last, "load_mapping_on_two")):
        assert value["dtensor_ok"] and value["flat_ok"]
        assert value["objs"] == [rank * 2 * 11, (rank * 2 + 1) * 11]


def test_two_ranks_load_a_four_rank_checkpoint_reading_only_needed_bytes(two_last):
    check_scenarios(two_last, ["load_x_on_two"])
    for value in scenario_values(two_last, "load_x_on_two"):
        assert value["ok"] and value["step"] == 42
        assert value["bias"] == np.linspace(-1, 1, 8, dtype=np.float32).tolist()
        assert value["bytes_read"] == value["needed"] + len(b"42")  # + the stored step value


def test_one_process_loads_the_four_rank_checkpoint(base, four):
    check_scenarios(four, ["save_x"])
    values = scenario_values(four, "save_x")
    assert all(v["visible_after_return"] and v["chunks"] == 4 and v["same_as_committed"] for v in values)
    # Only the coordinator holds the metadata it committed; the others received a receipt (_commit_receipt).
    assert [v["kind"] for v in values] == ["Metadata"] + ["CommittedMetadataView"] * 3
    target = {"model": {"x": np.zeros((16, 8), np.float32), "bias": np.zeros(8, np.float32)}, "step": 0}
    dcp.load(target, checkpoint_id=base / "X")
    assert np.array_equal(target["model"]["x"], FULL_X) and target["step"] == 42


def test_indexed_metadata_saved_by_four_loads_on_four_and_two(four, two_last):
    check_scenarios(four, ["save_x_indexed"])
    for value in scenario_values(four, "save_x_indexed"):
        assert value["indexes"] == ["r00000_index", "r00001_index", "r00002_index", "r00003_index"]
        assert value["grid"] and value["chunks"] == 4 and value["ok"] and value["step"] == 42
        assert value["bias"] == np.linspace(-1, 1, 8, dtype=np.float32).tolist()
        assert value["same_as_committed"]
    assert [v["kind"] for v in scenario_values(four, "save_x_indexed")] == ["Metadata"] + ["CommittedMetadataView"] * 3
    # Each rank wrote its own index; the commit received a summary per rank and committed the same files as the
    # coordinator building them from every rank's write results.
    coordinator = scenario_values(four, "save_x_indexed")[0]
    assert [kind for kind, _ in coordinator["received"]] == ["RankIndexSummary"] * 4
    assert [kind for kind, _ in coordinator["received_built"]] == ["list"] * 4
    assert coordinator["same_files"] is True
    assert [kind for kind, _ in coordinator["received_kept"]] == ["RankIndexSummary"] * 4  # remove_redundancy=False
    assert coordinator["same_kept"] is True
    check_scenarios(two_last, ["load_x_indexed_on_two"])
    for value in scenario_values(two_last, "load_x_indexed_on_two"):
        assert value["ok"] and value["step"] == 42
        assert value["bias"] == np.linspace(-1, 1, 8, dtype=np.float32).tolist()


def test_async_indexed_saves_and_a_damaged_index_on_one_rank(four):
    """4-rank async saves in the indexed form (copy, fork) load resharded; a damaged index on rank 3 fails every
    rank's load and changes no target on any rank."""
    check_scenarios(four, ["async_indexed_and_corrupt_index"])
    for value in scenario_values(four, "async_indexed_and_corrupt_index"):
        for loaded in value["loaded"]:
            assert loaded["ok"] and loaded["step"] == 6
            assert loaded["indexes"] == ["r00000_index", "r00001_index", "r00002_index", "r00003_index"]
    for loaded in scenario_values(four, "async_indexed_and_corrupt_index")[0]["loaded"]:
        # Each rank wrote its own index (the forked writer's in its parent); the background commit got a summary
        # per rank through its version-2 results record, as did result()'s "async write" step; same files as the
        # coordinator building the indexes from the results.
        assert [kind for kind, _ in loaded["received"]] == ["RankIndexSummary"] * 4, loaded
        assert [kind for kind, _ in loaded["received_built"]] == ["list"] * 4, loaded
        assert loaded["gathered"] == [["RankIndexSummary"] * 4] * 2 and loaded["same_files"] is True, loaded
        assert value["type"].endswith("CorruptCheckpointError") and value["untouched"] and value["failed_ranks"] == [3]
        assert "r00003_index." in value["message"] and "does not match its length and digest" in value["message"]
