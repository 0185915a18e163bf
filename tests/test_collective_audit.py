"""Multi-rank (msrun) audit: one rank failing a save, mismatched states, async saves and loads, reshards.

One 4-rank launch (tests/workers/collective_audit_worker.py, phase ``four``)
runs every failure and async scenario and saves the checkpoints that a 3-rank
launch and this process (``no_dist``) then load resharded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.msrun_harness import check_scenarios, run_workers, scenario_values
from tests.strategy_files import ParamStrategy, write_strategy_file

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WORKER = Path(__file__).parent / "workers" / "collective_audit_worker.py"
TIMEOUT = 60  # HP_CKPT_COLLECTIVE_TIMEOUT of the launches, seconds
FULL_W = np.arange(12 * 6, dtype=np.float32).reshape(12, 6)
FULL_B = np.linspace(-3, 3, 12, dtype=np.float32)


def _launch(phase: str, workers: int, base: Path, tmp_path: Path) -> list:
    return run_workers(WORKER, workers=workers, tmp_path=tmp_path / phase, args=[phase, str(base)],
                       env={"HP_CKPT_COLLECTIVE_TIMEOUT": str(TIMEOUT)}, timeout=600)


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp_path = tmp_path_factory.mktemp("collective_audit")
    base = tmp_path / "base"
    strategies = base / "strategies"
    strategies.mkdir(parents=True)
    write_strategy_file(strategies / "s4.ckpt", (ParamStrategy("w", (2, 2), (1, 0)), ParamStrategy("b", (2, 2), (1,))))
    write_strategy_file(strategies / "s3.ckpt", (ParamStrategy("w", (3,), (0, -1)), ParamStrategy("b", (3,), (0,))))
    four = _launch("four", 4, base, tmp_path)
    three = _launch("three", 3, base, tmp_path)
    return {"four": four, "three": three, "base": base}


@pytest.mark.parametrize("name, failing_rank", [
    ("sync_plan", 2), ("sync_write", 2), ("sync_commit", 0),
    ("async_plan", 2), ("async_write", 2), ("async_commit", 0),
])
def test_one_rank_failing_a_save_fails_every_rank_and_keeps_the_previous_checkpoint(launches, name, failing_rank):
    for rank, info in enumerate(scenario_values(launches["four"], name)):
        assert info["type"] is not None and info["type"].startswith("Collective"), (rank, info)
        assert info["failed_ranks"] == [failing_rank], (rank, info)
        assert f"rank {failing_rank}" in info["message"], (rank, info)
        assert info["seconds"] < TIMEOUT, (rank, info)
        assert info["after_failure"]["w"] == [1.0] and info["after_failure"]["step"] == 1, (rank, info)
        assert info["next_save"]["w"] == [3.0] and info["next_save"]["step"] == 3, (rank, info)


@pytest.mark.parametrize("name", ["manager_sync", "manager_async"])
def test_a_manager_step_failing_on_one_rank_fails_every_rank_and_the_next_step_saves(launches, name):
    for rank, info in enumerate(scenario_values(launches["four"], name)):
        assert info["failed_ranks"] == [2] and "'bad'" in info["message"], (rank, info)
        assert info["steps_after_failure"] == [1], (rank, info)
        assert info["steps"] == [1, 3] and info["loaded_step"] == 3 and info["loaded_value"] == 3, (rank, info)


def test_states_that_differ_between_ranks(launches):
    for info in scenario_values(launches["four"], "key_on_one_rank"):
        assert info["type"] is None and info["keys"] == ["a", "extra"] and info["extra"] == [5.0] * 3
    for name, key, rank in (("shape_on_one_rank", "'a'", 3), ("dtype_on_one_rank", "'a'", 3),
                            ("dtensor_shape_on_one_rank", "'w'", 1)):
        for info in scenario_values(launches["four"], name):
            assert info["type"] == "CollectivePlanValidationError", info
            assert key in info["message"] and f"ranks [{rank}]" in info["message"], info


def test_a_load_right_after_async_save_reads_that_save(launches):
    for info in scenario_values(launches["four"], "async_then_load"):
        assert info["loaded"] == {"w": [4.0], "b": info["loaded"]["b"], "step": 4}, info
        assert info["fresh"] == {"w": [5.0], "b": info["fresh"]["b"], "step": 5}, info
        assert info["after"]["step"] == 4 and info["fresh_after"]["step"] == 5, info


def test_a_save_right_after_async_save_to_its_id_finishes_it_first(launches):
    for rank, info in enumerate(scenario_values(launches["four"], "async_then_save")):
        # With collectives every rank finishes the async save (its result() step), then saves: no clash.
        assert info["sync"]["type"] is None and info["first_step"] is None, (rank, info)
        assert info["after_sync"] == {"w": [9.0], "b": [9.0], "step": 9}, (rank, info)
        assert info["after_async"] == {"w": [11.0], "b": [11.0], "step": 11}, (rank, info)
        # Alone (no_dist) in a job: not finished there (another rank may not reach its step); the coordinator's
        # save meets its lease and is refused naming result(); the async save then commits whole.
        if rank == 0:
            assert info["alone"]["type"] == "ConcurrentSaveError" and "result()" in info["alone"]["message"], info
        assert info["after_alone"] == {"w": [12.0], "b": [12.0], "step": 12}, (rank, info)


def test_two_async_saves_finished_in_the_other_order(launches):
    for info in scenario_values(launches["four"], "two_async_other_order"):
        assert info["a"]["w"] == [6.0] and info["a"]["step"] == 6, info
        assert info["b"]["w"] == [7.0] and info["b"]["step"] == 7, info


def test_rank_local_saves_loaded_collectively(launches):
    for rank, info in enumerate(scenario_values(launches["four"], "local_then_collective")):
        assert info["local_mine"] == [rank] * 4, info
        # Refused on every rank, targets untouched, naming the rank-local saves and the fix.
        assert info["collective"]["type"] == "CollectiveIncompleteCheckpointError", info
        assert "metadata.rank00000.json" in info["collective"]["message"], info
        assert "use_collectives=False" in info["collective"]["message"], info
        assert info["collective_mine"] == [-1] * 4, info
        # A rank-local save of DTensor shards is refused naming the option asked for, not uninitialised communication.
        assert info["sharded"]["type"] == "PlanValidationError", info
        assert "use_collectives=False" in info["sharded"]["message"], info
        assert "not initialised" not in info["sharded"]["message"], info


def test_a_four_rank_save_resharded_to_three_ranks_and_one(launches):
    check_scenarios(launches["three"])
    for info in scenario_values(launches["three"], "load_reshard"):
        assert info == {"w": True, "r": True, "b": True}
    for info in scenario_values(launches["three"], "load_strategy"):
        assert info == {"w": True, "b": True}
    import mindspore as ms  # pylint: disable=import-outside-toplevel

    import hyper_parallel  # pylint: disable=import-outside-toplevel
    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel

    target = {"w": np.zeros((12, 6), np.float32), "r": ms.Parameter(ms.Tensor(np.zeros((12, 6), np.float32)), name="r"),
              "b": np.zeros(12, np.float32)}
    dcp.load(target, checkpoint_id=launches["base"] / "reshard", no_dist=True)
    assert np.array_equal(target["w"], FULL_W) and np.array_equal(target["r"].asnumpy(), FULL_W * 2)
    assert np.array_equal(target["b"], FULL_B)
    full = hyper_parallel.load_checkpoint(str(launches["base"] / "strategy"))
    assert np.array_equal(full["w"].asnumpy(), FULL_W) and np.array_equal(full["b"].asnumpy(), FULL_B)


def test_a_callback_save_failing_on_one_rank_stops_every_rank_and_resume_continues(tmp_path):
    results = run_workers(Path(__file__).parent / "workers" / "callback_fail_worker.py", workers=2,
                          tmp_path=tmp_path, args=[str(tmp_path / "base")],
                          env={"HP_CKPT_COLLECTIVE_TIMEOUT": str(TIMEOUT)}, timeout=400)
    for name in ("callback_sync", "callback_async"):
        for info in scenario_values(results, name):
            first, second = info["first"], info["second"]
            assert first["error"].startswith("CollectiveStepError") and first["failed_ranks"] == [1], info
            assert "No space left on device" in first["error"], info
            assert first["steps"] == [2] and "weight" in first["step2_keys"] and "moment1.weight" in first["step2_keys"]
            assert second["error"] is None and second["resumed_step"] == 2 and second["steps"] == [2, 4, 6, 8], info
