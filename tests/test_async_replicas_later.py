"""A multi-rank async save hashes its replicas off the blocking part: in the forked writer, or from the staged copies.

With ``staging="fork"`` and several ranks, the layout pass keeps the possibly
replicated pieces instead of hashing them (xxhash holds the GIL: hashing a
data-parallel state cost the caller about 1.5x a memcpy of it); each forked
writer hashes its copy-on-write snapshot and stores the digests in its
results record, and the coordinator compares them before it commits
(``_background_commit.check_record_replicas``). With ``staging="copy"`` the
background thread hashes the staged copies (the items this rank writes, and
copies of the replicas it holds but another rank writes, taken in the
blocking part). Diverging replicas are still
reported on every rank, naming the key and the ranks, at the next collective
step, and nothing is committed. The msrun worker is
``tests/workers/replicas_later_worker.py``; the record format and the
comparison are also checked here without msrun.
"""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._background_commit import check_record_replicas
from hyper_parallel.core.distributed_checkpoint._rank_records import RankRecord, decode_rank_record, encode_rank_record
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner
from msrun_harness import run_workers, scenario_values

WORKER = Path(__file__).resolve().parent / "workers" / "replicas_later_worker.py"


def test_records_carry_replica_digests_and_the_coordinator_names_a_divergence() -> None:
    record = RankRecord("abc", 1, (), replicas=(("big", (0, 0), "aa11"), ("w", (16, 0), "bb22")))
    assert decode_rank_record(encode_rank_record(record), source="r1") == record
    plain = RankRecord("abc", 2, ())
    assert b"replicas" not in encode_rank_record(plain)  # records without digests keep their old form
    assert decode_rank_record(encode_rank_record(plain), source="r2") == plain
    with pytest.raises(dcp.CorruptCheckpointError, match="r3: malformed replica digest 0"):
        decode_rank_record(encode_rank_record(plain)[:-1] + b',"replicas":[["big",[0],7]]}', source="r3")
    same = {r: RankRecord("abc", r, (), replicas=(("big", (0, 0), "aa11"),)) for r in range(3)}
    check_record_replicas(same)  # equal replicas: nothing raised
    differ = dict(same)
    differ[2] = RankRecord("abc", 2, (), replicas=(("big", (0, 0), "ff00"), ("only_here", (0,), "01")))
    with pytest.raises(dcp.PlanValidationError, match=r"(?s)not committed.*'big': replicas differ between ranks "
                                                      r"\(ranks \[0, 1\]; ranks \[2\] each agree\)"):
        check_record_replicas(differ)


def test_writers_hash_the_replicas_off_the_call_and_a_divergence_fails_every_rank(tmp_path: Path) -> None:
    results = run_workers(WORKER, workers=2, tmp_path=tmp_path, timeout=900)
    for scenario, steps in (("equal", [3]), ("equal_copy", [3, 3])):
        for rank, value in enumerate(scenario_values(results, scenario)):
            assert value["hashed_in_call"] == [], (scenario, rank, value)  # the caller's thread hashed no tensor
            # The DTensor shard is not a replica.
            assert value["kept"] == [("bias", (0,)), ("big", (0, 0))], (scenario, rank, value)
            assert value["w_ok"] and value["bias_ok"] and value["big_ok"], (scenario, rank, value)
            assert value["steps"] == steps, (scenario, rank, value)
    for rank, value in enumerate(scenario_values(results, "diverging") + scenario_values(results, "diverging_copy")):
        assert not value["committed"], (rank, value)
        assert value["result_error"] == "", (rank, value)  # result() does not wait for the commit
        raised = value["next_error"]  # the next collective step (a load) raises the failed commit on every rank
        assert "PlanValidationError: checkpoint step 'background commit' failed on rank(s) 0" in raised, (rank, value)
        assert "'big': replicas differ between ranks (ranks [0]; ranks [1] each agree)" in raised, (rank, value)
        assert value["after_ok"], (rank, value)


def test_replicas_kept_for_the_writer_hash_to_the_digests_planning_makes():
    from hyper_parallel import DTensor, Layout  # pylint: disable=import-outside-toplevel

    full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    state = {"d": DTensor.from_global(ms.Tensor(full), Layout((2, 2), (1, -1)), rank=0),  # 2 shards on 4 ranks
             "p": ms.Parameter(ms.Tensor(np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)), name="p"),
             "step": 1}
    now = StandardSavePlanner()
    now.configure_planner(state, rank=0, world_size=4)
    hashed_now = now.describe_layout().replica_digests
    later = StandardSavePlanner()
    later.digest_replicas_later(True)
    later.configure_planner(state, rank=0, world_size=4)
    assert later.describe_layout().replica_digests == ()  # nothing hashed by the layout pass
    digests = later.replica_digests()  # what the forked writer computes from its snapshot
    assert [(key, offsets) for key, offsets, _ in digests] == [("d", (0, 0)), ("p", (0, 0))]
    assert tuple(found for _, _, found in digests) == hashed_now and len(hashed_now) == 2
    assert all(i.tensor_data is None or i.tensor_data.replica_digest is None for i in later.build_local_plan().items)
    assert sum(1 for i in now.build_local_plan().items if i.tensor_data and i.tensor_data.replica_digest) == 2
    later.digest_replicas_later(False)
    assert later.replica_digests() == ()


def test_a_plan_made_hashing_later_is_never_reused_by_a_save_that_hashes_now():
    from hyper_parallel.core.distributed_checkpoint._plan_cache import PlanCache, clear_plan_cache  # pylint: disable=C0415
    from hyper_parallel.core.distributed_checkpoint._save_layout import LayoutDescription  # pylint: disable=C0415
    from hyper_parallel.core.distributed_checkpoint.planner import SavePlan  # pylint: disable=C0415

    clear_plan_cache()
    key = ("rank 0", 2, "options")
    layout = LayoutDescription(digest="L", replica_digests=(), tensor_bytes=0, pieces=0)
    later = PlanCache(key, digests_now=False)
    exchange = "E"
    later.store(exchange, SavePlan(items=()), None, None)
    now = PlanCache(key, digests_now=True)
    assert now.message(layout).cached_exchange == ""  # a plan without replica digests: a save hashing now re-plans
    assert later.message(layout).cached_exchange == exchange
    now.store(exchange, SavePlan(items=()), None, None)
    # A plan made with digests: both kinds of save may reuse it (one hashing later compares before the commit).
    assert now.message(layout).cached_exchange == exchange and later.message(layout).cached_exchange == exchange
    clear_plan_cache()
