"""Parameters sliced as MindSpore's semi-auto parallel slices them, under real msrun launches.

Semi-auto parallel itself does not run on CPU, so each rank fills its
Parameters with its slice (``Parameter.sliced = True``) and the strategy files
a job would write are built with ``node_strategy_pb2`` (tests/strategy_files.py).
Launch 1 (2 ranks) saves with strategy ``a``; launch 2 (4 ranks) loads into
another split and world size, into 2 pipeline stages (one optimizer-parallel),
saves from the stages and loads that into a fourth strategy. The workers
compare every loaded slice with numpy slices of the full tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from msrun_harness import check_scenarios, run_workers, scenario_values
from tests.strategy_files import ParamStrategy as P
from tests.strategy_files import write_strategy_file

pytestmark = pytest.mark.msrun
WORKER = Path(__file__).parent / "workers" / "mslayout_worker.py"

STRATEGIES = {
    "a.ckpt": (0, (P("w", (2,), (0, -1)), P("b", (2,), (-1,)))),
    "b.ckpt": (0, (P("w", (2, 2), (1, 0)), P("b", (2, 2), (1,)))),
    "pp_stage0.ckpt": (0, (P("w", (2,), (-1, -1), opt_weight_shard_step=1, opt_weight_shard_size=2),)),
    "pp_stage1.ckpt": (1, (P("b", (2,), (0,)),)),
    "c.ckpt": (0, (P("w", (4,), (-1, 0)),)),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mslayout")
    (path / "strategies").mkdir()
    for name, (stage, params) in STRATEGIES.items():
        write_strategy_file(path / "strategies" / name, params, stage=stage)
    return path


@pytest.fixture(scope="module")
def two(base, tmp_path_factory):
    return run_workers(WORKER, workers=2, tmp_path=tmp_path_factory.mktemp("l1"), args=["two", str(base)],
                       timeout=500)


@pytest.fixture(scope="module")
def four(base, two, tmp_path_factory):
    check_scenarios(two, ["save_with_strategy"])
    return run_workers(WORKER, workers=4, tmp_path=tmp_path_factory.mktemp("l2"), args=["four", str(base)],
                       timeout=600)


def test_sliced_parameter_without_layout_is_refused_on_every_rank(two):
    for value in scenario_values(two, "silent_loss_refused"):
        assert not value["committed"]
        for how in ("dcp", "one_line"):
            failed = value[how]
            assert failed["type"] is not None, f"{how}: a sliced Parameter was saved as a whole tensor"
            assert failed["is_sliced_error"], failed
            assert "'w'" in failed["message"] and "strategy_file=" in failed["message"]


def test_save_with_strategy_file_stores_the_full_tensors(two):
    for value in scenario_values(two, "save_with_strategy"):
        assert value["w"] and value["b"] and value["m1"] and value["m2"], value
        assert {"w", "b", "moment1.w", "moment2.w", "global_step"} <= set(value["keys"])


def test_parameter_layout_dict_used_by_itself(two):
    for value in scenario_values(two, "layout_dict_by_itself"):
        assert value == {"full": True, "back": True}


def test_async_save_with_strategy_file(two):
    for value in scenario_values(two, "async_with_strategy"):
        assert value["w"]


def test_diverging_replicas_fail_naming_key_and_ranks(two):
    for value in scenario_values(two, "replicas_diverge"):
        failed = value["failed"]
        assert failed["is_validation"], failed
        assert "'r': replicas differ between ranks (ranks [0]; ranks [1] each agree)" in failed["message"]
        assert "'same'" not in failed["message"]
        assert not value["committed"] and value["off_committed"]


def test_reused_plan_still_checks_replicas(two):
    for value in scenario_values(two, "reused_plan_still_checks_replicas"):
        assert value["reused"] == 1, value
        # The coordinator checks the replicas of a reused plan in the digest round, before any rank takes it
        # (a fresh exchange would have failed in step 'plan').
        assert value["reused_on_divergence"] == 0, value
        assert "step 'plan digest'" in value["failed"]["message"], value["failed"]
        assert value["failed"]["is_validation"], value["failed"]
        assert "'r': replicas differ between ranks (ranks [0]; ranks [1] each agree)" in value["failed"]["message"]
        assert value["kept"] == 2.0  # the failed save left the committed one


def test_load_into_another_split_and_world_size(four):
    for value in scenario_values(four, "load_other_split_and_size"):
        assert all(value.values()), value


def test_device_path_with_shared_reads_under_msrun(four):
    for value in scenario_values(four, "device_copies_with_shared_reads"):
        assert value == {"w": True, "b": True}


def test_load_into_pipeline_stages_with_optimizer_parallel(four):
    for value in scenario_values(four, "load_into_pipeline_stages"):
        assert value and all(value.values()), value


def test_save_from_pipeline_stages_and_load_into_another_strategy(four):
    for value in scenario_values(four, "save_from_pipeline_then_load_elsewhere"):
        assert all(value.values()), value
