"""A multi-rank async save with a forked writer hashes its replicas in the writer, off the blocking part.

With ``staging="fork"`` and several ranks, the layout pass keeps the possibly
replicated pieces instead of hashing them (xxhash holds the GIL: hashing a
data-parallel state cost the caller about 1.5x a memcpy of it); each forked
writer hashes its copy-on-write snapshot and stores the digests in its
results record, and the coordinator compares them before it commits
(``_background_commit.check_record_replicas``). Diverging replicas are still
reported on every rank, naming the key and the ranks, at the next collective
step, and nothing is committed. The msrun worker is
``tests/workers/replicas_later_worker.py``; the record format and the
comparison are also checked here without msrun.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._background_commit import check_record_replicas
from hyper_parallel.core.distributed_checkpoint._rank_records import RankRecord, decode_rank_record, encode_rank_record
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


def test_forked_writers_hash_the_replicas_and_a_divergence_fails_every_rank(tmp_path: Path) -> None:
    results = run_workers(WORKER, workers=2, tmp_path=tmp_path, timeout=600)
    for rank, value in enumerate(scenario_values(results, "equal")):
        assert value["hashed_in_call"] == [], (rank, value)  # the caller's process hashed no tensor
        assert value["kept"] == [("bias", (0,)), ("big", (0, 0))], (rank, value)  # the DTensor shard is not a replica
        assert value["w_ok"] and value["bias_ok"] and value["big_ok"] and value["step"] == 3, (rank, value)
    for rank, value in enumerate(scenario_values(results, "diverging")):
        assert not value["committed"], (rank, value)
        assert value["result_error"] == "", (rank, value)  # result() does not wait for the commit
        raised = value["next_error"]  # the next collective step (a load) raises the failed commit on every rank
        assert "PlanValidationError: checkpoint step 'background commit' failed on rank(s) 0" in raised, (rank, value)
        assert "'big': replicas differ between ranks (ranks [0]; ranks [1] each agree)" in raised, (rank, value)
        assert value["after_ok"], (rank, value)
