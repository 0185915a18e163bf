"""Plan data is typed and merged from every rank: no rank's part of it is lost."""

from __future__ import annotations

import json

import mindspore as ms
import numpy as np

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemPlanData
from hyper_parallel.core.distributed_checkpoint.standard_planner import AliasData
from sim_ranks import plan_ranks, simulate_save


def _param(name):
    return ms.Parameter(ms.Tensor(np.arange(4, dtype=np.float32)), name=name)


def test_aliases_of_every_rank_reach_the_metadata_and_are_read_back(tmp_path):
    shared = _param("w")
    states = [{"a": _param("w")}, {"a": shared, "b": {"again": shared}}]
    _, plans = plan_ranks(states)
    assert plans[0].planner_data is None
    assert plans[1].planner_data == AliasData(aliases=(("b.again", "a"),))
    metadata, _ = simulate_save(states, tmp_path / "c")
    assert metadata.planner_data == {"aliases": {"b.again": "a"}}
    document = json.loads((tmp_path / "c" / "metadata.json").read_text())
    assert document["planner_data"] == {"aliases": {"b.again": "a"}}, "only the aliases; no nesting record"
    target = {"b": {"again": np.zeros(4, np.float32)}}
    dcp.load(target, checkpoint_id=tmp_path / "c", no_dist=True)
    assert target["b"]["again"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_plain_save_records_no_planner_data_and_typed_storage_data(tmp_path):
    writer = dcp.FileSystemWriter(tmp_path / "c")
    writer.set_up_storage_writer(True, rank=0, world_size=1)
    planner = dcp.StandardSavePlanner()
    planner.configure_planner({"x": np.ones(2), "n": {"k": 1}}, rank=0, world_size=1, is_coordinator=True)
    local = writer.prepare_local_plan(planner.build_local_plan())
    assert local.planner_data is None and local.storage_data is None
    final, metadata = planner.build_global_plan([local])
    assert metadata.planner_data is None
    (plan,) = writer.prepare_global_plan(final)
    assert plan.storage_data == FileSystemPlanData(save_id=writer.save_id)
    writer.abort()
