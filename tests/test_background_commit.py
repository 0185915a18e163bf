"""A multi-rank ``async_save`` commits in the background: durable without ``result()`` (2 msrun ranks).

The worker is ``tests/workers/bgcommit_worker.py``. Before this, the commit of
a multi-rank async save ran inside ``result()``, so a job killed after the
save had finished writing, but before the next ``result()``, lost the step.
Also unit checks of the per-rank results records (``_rank_records``).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._rank_records import (
    RankRecord,
    collect_rank_records,
    decode_rank_record,
    encode_rank_record,
    wait_for_rank_records,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemPlanData
from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex, StorageInfo
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan
from hyper_parallel.core.distributed_checkpoint.storage import WriteResult
from msrun_harness import run_workers

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from bgcommit_worker import full_value  # noqa: E402  pylint: disable=wrong-import-position

WORKER = Path(__file__).resolve().parent / "workers" / "bgcommit_worker.py"


def test_two_ranks_commit_in_the_background(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="msrun launch failed"):  # the job ends SIGKILLed, as planned
        run_workers(WORKER, workers=2, tmp_path=tmp_path, timeout=600)
    results = [pickle.loads((tmp_path / "results" / f"rank_{rank}.pkl").read_bytes()) for rank in range(2)]
    for rank, outcome in enumerate(results):
        first = outcome["commit_without_result"]
        assert first["ok"], first["traceback"]
        value = first["value"]
        assert value["committed_before_result"], f"rank {rank}: not committed when done() was true"
        assert value["records"] == [], value  # removed by the coordinator after the commit
        assert value["result_is_metadata"] and value["values_ok"], value
        second = outcome["failure_reaches_all"]
        assert second["ok"], second["traceback"]
        assert "disk full (injected on rank 1)" in second["value"]["raised"], (rank, second["value"])
        assert not second["value"]["committed"]
        assert not [n for n in second["value"]["left"] if n.endswith((".results", ".safetensors", ".lease"))]
    for rank, outcome in enumerate(results):
        waited = outcome["result_does_not_wait_for_commit"]
        assert waited["ok"], waited["traceback"]
        value = waited["value"]
        assert not value["committed_at_return"], f"rank {rank}: result() waited for the held-back commit"
        assert value["world"] == 2 and value["same_as_committed"] and value["values_ok"], value
        assert value["records"] == [], value
        if rank == 0:
            assert value["saw_flag"] == [True], "the commit ran before every rank's result() returned"
        failed = outcome["commit_failure_reaches_all_at_next_step"]
        assert failed["ok"], failed["traceback"]
        value = failed["value"]
        assert value["raised"]["failed_ranks"] == [0], value
        assert "I/O error during commit (injected)" in value["raised"]["message"], value
        assert value["old_ok"] and value["left"] == [], value
        assert value["raised_by_save"]["failed_ranks"] == [0], value
        assert "I/O error during commit (injected)" in value["raised_by_save"]["message"], value
        assert not value["raised_by_save"]["committed"], value
        coordinator = outcome["coordinator_failure_reaches_all"]
        assert coordinator["ok"], coordinator["traceback"]
        value = coordinator["value"]
        assert value["raised"]["failed_ranks"] == [0], value
        assert "disk full (injected on rank 0)" in value["raised"]["message"], value
        assert value["left"] == [] and value["resave_ok"], value
        reads = outcome["reads_after_result_see_the_commit"]
        assert reads["ok"], reads["traceback"]
        value = reads["value"]
        assert value["first_ok"] and value["second_ok"], value
        if rank == 0:
            assert value["read"] == {"world": 2}, value
            # dcp.load(no_dist=True) right after result() waited for rank 0's own commit (3 s): save 12, not 11
            assert value["lone_step"] == 12 and value["lone_bias"] == [12.0] * 5, value
            assert value["lone_waited"] > 1.0, value
        else:
            assert "still be committing it in the background" in value["read"]["error"], value
            assert "CheckpointManager.wait()" in value["read"]["error"], value
        managed = outcome["manager_reports_lost_lease"]
        assert managed["ok"], managed["traceback"]
        value = managed["value"]
        assert value["raised"]["type"] == "CollectiveConcurrentSaveError", value
        assert value["raised"]["failed_ranks"] == [0] and "lease" in value["raised"]["message"], value
        assert value["steps"] == [1], value
        _check_explained_commit_failure(rank, outcome["commit_failure_is_explained"], tmp_path)
    _check_result_receipt([outcome["async_result_receipt"] for outcome in results], tmp_path)
    shared = tmp_path / "shared" / "bgcommit"
    assert (shared / "rank0.done").exists() and (shared / "rank1.done").exists()
    # The job exited without result(): the step is committed and loads bit-exact.
    target = {"w": np.zeros((64, 6), np.float32), "bias": np.zeros(5, np.float32), "step": 0}
    dcp.load(target, checkpoint_id=shared / "c3", no_dist=True)
    np.testing.assert_array_equal(target["w"], full_value(3))
    assert (target["bias"] == 3).all() and target["step"] == 3
    assert not list((shared / "c3").glob(".*"))  # no record, lease or partial left


def _names_checkpoint_cause_and_fix(message: str, checkpoint: Path) -> None:
    assert f"checkpoint {checkpoint} (save id " in message, message
    assert "did not commit: every rank wrote its data, then its background commit on rank 0 failed" in message, message
    assert "Is a directory" in message, message  # the cause: the kernel's EISDIR for the metadata's rename
    assert "Fix the cause, then save this step again" in message, message


def _check_explained_commit_failure(rank: int, outcome: dict, tmp_path: Path) -> None:
    """A background commit failed by a real file-system condition (the metadata's rename meets a directory)."""
    assert outcome["ok"], outcome["traceback"]
    value = outcome["value"]
    shared = tmp_path / "shared" / "bgcommit"
    assert value["result_ok"] and value["uncommitted"], value
    if rank == 0:  # the coordinator knows: read_metadata names the failure, a save alone raises it once
        assert value["read"]["type"] == "IncompleteCheckpointError", value
        _names_checkpoint_cause_and_fix(value["read"]["message"], shared / "c11")
        assert value["alone_first"]["type"] == "CheckpointIOError" and not value["alone_first"]["saved"], value
        _names_checkpoint_cause_and_fix(value["alone_first"]["message"], shared / "c11")
        assert len(value["logged"]) == 1, value["logged"]  # logged at once (the only report at process exit)
        _names_checkpoint_cause_and_fix(value["logged"][0], shared / "c11")
        assert value["recorded_steps"] == [1], value  # the manager's record never counted the failed step
    else:  # no collective step yet: rank 1 cannot know, and says so
        assert "still be committing it in the background" in value["read"]["message"], value
        assert value["alone_first"] == {} and value["logged"] == [], value
    assert value["alone_second_saved"], value
    collective = value["collective"]  # the next collective step: every rank, the same error
    assert collective["type"] == "CollectiveCheckpointIOError" and collective["io"], collective
    assert collective["failed_ranks"] == [0] and not collective["committed"], collective
    _names_checkpoint_cause_and_fix(collective["message"], shared / "c11")
    manager = value["manager"]
    assert manager["failed_ranks"] == [0] and manager["io"], manager
    _names_checkpoint_cause_and_fix(manager["message"], shared / "managed_blocked" / "step_00000002")
    assert value["steps_after_failure"] == [1], value  # not counted: retention (max_to_keep=1) kept step 1
    assert value["latest_loaded"] == 1 and value["latest_values_ok"], value
    assert value["steps_after_resave"] == [2], value


def _check_result_receipt(outcomes: list[dict], tmp_path: Path) -> None:
    """result() of an async save hands rank 1 a receipt: its bytes do not grow with the chunks; used, the
    metadata is the coordinator's once committed, a failed commit or a later save refuses."""
    for rank, outcome in enumerate(outcomes):
        assert outcome["ok"], (rank, outcome["traceback"])
    coordinator, other = (outcome["value"] for outcome in outcomes)
    # (a) The "async write" step hands rank 1 one receipt, the same bytes for 8 and 800 chunks; before it
    # received the committed metadata (what the coordinator's metadata pickles to), which grows with them.
    assert [coordinator["chunks_4"], coordinator["chunks_400"]] == [8, 800] == [other["chunks_4"], other["chunks_400"]]
    print("bytes rank 1 receives in result()'s step, 8 / 800 chunks:", other["received_4"], other["received_400"],
          "; the committed metadata it received before:", coordinator["inline_4"], coordinator["inline_400"])
    assert other["received_4"] == other["received_400"] and len(other["received_4"]) == 1, other
    assert other["received_4"][0] < 300 < 20 * 800 < coordinator["inline_400"], (other, coordinator["inline_400"])
    assert coordinator["received_4"] == coordinator["received_400"]  # the coordinator receives its own part too
    assert [coordinator["kind_4"], other["kind_4"]] == ["Metadata", "CommittedMetadataView"]
    # (b) Used while the commit is held back and the previous save still in place: waits, then the committed one.
    held, held_other = coordinator["held"], other["held"]
    assert held_other["kind"] == "CommittedMetadataView" and held_other["unread_at_return"], held_other
    assert held_other["save_id"] == held["save_id"] != held["previous"] == held_other["previous"]
    assert held_other["metadata"] == held["metadata"] and type(held_other["metadata"]) is dcp.Metadata
    assert held_other["metadata"] == dcp.read_metadata(tmp_path / "shared" / "bgcommit" / "receipt_held")
    assert held_other["values"] == ["p000", "p001", "p002"] and held["loaded_ok"] and held_other["loaded_ok"]
    assert held_other["waited"] > 0.5, held_other["waited"]  # it waited for the commit (held back 1.5 s)
    # (c) A failed background commit: rank 1's use refuses, naming rank, save and checkpoint; never the old metadata.
    failed, failed_other = coordinator["failed"], other["failed"]
    assert failed["kind"] == "Metadata" and "save_id" in failed["used"]  # the coordinator keeps its own
    failed_id, used = failed["used"]["save_id"], failed_other["used"]
    assert used.get("type") == "CheckpointNotFoundError", used
    assert used["message"].startswith(
        f"rank 1: the metadata async_save returned for save {failed_id} of checkpoint "
        f"{tmp_path / 'shared' / 'bgcommit' / 'receipt_failed'} is not there: its background commit on rank 0 is "
        f"over and the checkpoint holds save {failed['previous']}. Either that commit failed"), used["message"]
    assert failed["settled"] and failed["settled"] == failed_other["settled"], (failed, failed_other)
    # (d) A later save replaced the checkpoint before rank 1 used it: refused, as for a sync save.
    replaced, replaced_other = coordinator["replaced"], other["replaced"]
    assert "save_id" in replaced["used"] and replaced_other["used"].get("type") == "CheckpointNotFoundError"
    assert f"holds save {replaced['later']}" in replaced_other["used"]["message"], replaced_other
    assert "a later save replaced the checkpoint" in replaced_other["used"]["message"]


def _result(fqn: str, offset: int) -> WriteResult:
    info = StorageInfo(relative_path="r00000_000.0123456789ab.safetensors", offset=offset, length=16)
    return WriteResult(index=MetadataIndex(fqn, (0,)), size_in_bytes=16, storage_data=info)


def test_records_round_trip_and_refuse_damage() -> None:
    record = RankRecord("0123456789ab", 1, (_result("a", 4096), _result("b", 4112)))
    assert decode_rank_record(encode_rank_record(record), source="r") == record
    failed = RankRecord("0123456789ab", 2, None, "OSError: disk full")
    assert decode_rank_record(encode_rank_record(failed), source="r") == failed
    raw = json.loads(encode_rank_record(record))
    for damage in ({"format": "x"}, {"rank": "1"}, {"results": None}, {"results": [{"size": -1}]},
                   {"results": [{"size": 1, "entry": {"fqn": "a"}}]}):
        with pytest.raises(dcp.CorruptCheckpointError, match="record"):
            decode_rank_record(json.dumps({**raw, **damage}).encode(), source="record of rank 1")
    with pytest.raises(dcp.CorruptCheckpointError):
        decode_rank_record(b"\xff", source="r")


def test_waiting_names_missing_and_failed_ranks(tmp_path: Path) -> None:
    writer = dcp.FileSystemWriter(tmp_path / "c")
    writer.set_up_storage_writer(True, rank=0, world_size=3)
    plan = SavePlan(items=[], storage_data=FileSystemPlanData(save_id=writer.save_id))
    writer.write_rank_record(0, encode_rank_record(RankRecord(writer.save_id, 0, (_result("a", 4096),))), plan=plan)
    writer.write_rank_record(2, encode_rank_record(RankRecord("another-save", 2, ())), plan=plan)  # not this save's
    ticks = iter(range(100))
    with pytest.raises(dcp.CollectiveTimeoutError, match=r"rank\(s\) \[1, 2\]"):
        wait_for_rank_records(writer, save_id=writer.save_id, world_size=3, timeout=3, clock=lambda: next(ticks))
    failed = RankRecord(writer.save_id, 1, None, "OSError: disk full")
    writer.write_rank_record(1, encode_rank_record(failed), plan=plan)
    cancel = threading.Event()
    cancel.set()  # cancelled: one more look, then what was found (rank 2's record is another save's)
    found = collect_rank_records(writer, save_id=writer.save_id, ranks=range(3), timeout=None, cancel=cancel)
    assert sorted(found) == [0, 1] and found[1].error == "OSError: disk full"
    writer.write_rank_record(2, encode_rank_record(RankRecord(writer.save_id, 2, (_result("b", 4112),))), plan=plan)
    with pytest.raises(dcp.CheckpointError, match=r"rank\(s\) \[1\] failed.*rank 1: OSError: disk full"):
        wait_for_rank_records(writer, save_id=writer.save_id, world_size=3, timeout=None)
    writer.write_rank_record(1, encode_rank_record(RankRecord(writer.save_id, 1, ())), plan=plan)
    found = wait_for_rank_records(writer, save_id=writer.save_id, world_size=3, timeout=None)
    assert [len(r) for r in found] == [1, 0, 1] and found[2][0].index.fqn == "b"
    writer.remove_rank_records(3)
    assert not list((tmp_path / "c").glob(".*.results"))
    writer.abort()


def test_a_ready_request_finalizes_while_its_background_goes_on() -> None:
    from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncCallsQueue, AsyncRequest

    ready, release, seen = threading.Event(), threading.Event(), []

    def work() -> str:
        ready.set()  # what result() waits for is over; the rest (a commit) goes on
        release.wait(30)
        return "late"

    def finalize(value, error):
        seen.append((value, error))
        return "confirmed"

    queue = AsyncCallsQueue()
    call = queue.schedule_async_request(AsyncRequest(async_fn=work, finalize_fns=(finalize,), ready=ready))
    assert call.wait(10)
    assert call.finalize() == "confirmed" and seen == [(None, None)]
    assert not call.background_done()
    release.set()
    call.join(10)
    assert call.background_done() and call.finalize() == "confirmed" and len(seen) == 1
    queue.close()


def test_reading_one_checkpoint_waits_only_for_commits_to_it(tmp_path: Path) -> None:
    """The coordinator's read_metadata waits for its own pending commit to that checkpoint, not to others."""
    from hyper_parallel.core.distributed_checkpoint import _background_commit as bg
    from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper

    commits = []
    for name in ("a", "b"):
        commit = bg.BackgroundCommit(dist=DistWrapper(use_dist=False), writer=dcp.FileSystemWriter(tmp_path / name),
                                     plan=SavePlan(items=[]), metadata=None, write=lambda: [])
        commits.append(commit)
    with bg._PENDING_LOCK:
        bg._PENDING.extend(commits)
    try:
        assert bg.await_own_commits(tmp_path / "c") is False  # nothing pending there: no wait
        waiter = threading.Thread(target=bg.await_own_commits, args=(str(tmp_path / "b") + "/",))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # b's commit has not ended
        commits[0].finished.set()
        waiter.join(0.5)
        assert waiter.is_alive()  # a's end does not release a reader of b
        commits[1].finished.set()
        waiter.join(10)
        assert not waiter.is_alive()
        assert bg.same_location("s3://bucket/x/", "s3://bucket/x") and not bg.same_location("s3://b/x", "s3://b/y")
        assert bg.same_location(None, tmp_path)  # a writer without a path: waited for, to be safe
    finally:
        assert bg.take_pending_commits() == commits


def test_a_failed_commit_is_explained_and_raised_once_by_a_save_alone(tmp_path: Path) -> None:
    """In one process: the explained error's class, read_metadata naming it, a save alone raising it once.

    (The msrun test above makes a real background commit fail; this covers the rank-0 side in-process.)
    """
    from hyper_parallel.core.distributed_checkpoint import _background_commit as bg
    from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper

    target = tmp_path / "c"
    target.mkdir()
    (target / "metadata.json").mkdir()  # the commit's rename meets a directory: the kernel says EISDIR
    (tmp_path / "partial").write_bytes(b"{}")
    with pytest.raises(OSError) as refused:
        os.replace(tmp_path / "partial", target / "metadata.json")
    explained = bg.explain_commit_failure(refused.value, location=target, save_id="0123456789ab")
    assert type(explained) is dcp.CheckpointIOError and explained.__cause__ is refused.value
    message = str(explained)
    assert message.startswith(f"the async save to checkpoint {target} (save id 0123456789ab) did not commit")
    assert "Is a directory" in message and message.endswith("Fix the cause, then save this step again")
    lost = bg.explain_commit_failure(dcp.ConcurrentSaveError("lease taken"), location=target, save_id="x")
    assert type(lost) is dcp.ConcurrentSaveError and "lease taken" in str(lost)
    assert type(bg.explain_commit_failure(RuntimeError("bug"), location=target, save_id="x")) is dcp.CheckpointError
    stepped = dcp.CollectiveStepError("write", {1: "boom"})  # a class with another constructor
    assert type(bg.explain_commit_failure(stepped, location=target, save_id="x")) is dcp.CheckpointError

    (target / "metadata.json").rmdir()
    commit = bg.BackgroundCommit(dist=DistWrapper(use_dist=False), writer=dcp.FileSystemWriter(target),
                                 plan=SavePlan(items=[]), metadata=None, write=lambda: [])
    commit.commit_error = explained
    commit.finished.set()
    with bg._PENDING_LOCK:
        bg._PENDING.append(commit)
    try:
        assert bg.failed_commit_to(tmp_path / "elsewhere") is None
        with pytest.raises(dcp.IncompleteCheckpointError) as read:
            dcp.read_metadata(target)
        assert "has no metadata.json" in str(read.value) and str(explained) in str(read.value)
        assert read.value.__cause__ is explained
        state = {"w": np.arange(4, dtype=np.float32)}
        with pytest.raises(dcp.CheckpointIOError) as raised:  # the next save alone: raised once, not run
            dcp.save(state, checkpoint_id=tmp_path / "next", no_dist=True)
        assert raised.value is explained and not (tmp_path / "next" / "metadata.json").exists()
        dcp.save(state, checkpoint_id=tmp_path / "next", no_dist=True)  # once reported, saves go on
        loaded = {"w": np.zeros(4, np.float32)}
        dcp.load(loaded, checkpoint_id=tmp_path / "next", no_dist=True)
        np.testing.assert_array_equal(loaded["w"], state["w"])
    finally:
        assert bg.take_pending_commits() == [commit]  # still pending: the next collective step shares it


@pytest.mark.parametrize("no_dist", [False, True])
def test_a_load_in_one_process_right_after_async_save_reads_that_save(tmp_path: Path, no_dist: bool) -> None:
    """A process alone (no msrun) loading the checkpoint its async save is still writing gets the new state:
    its result() needs no other rank, so the load finishes it first, as a load with collectives does. It read
    the checkpoint the save was replacing (1.0 instead of 2.0), silently."""
    old = {f"w{i}": np.full(1 << 18, 1.0, np.float32) for i in range(16)}  # 16 MiB: the save is still writing
    dcp.save(old, checkpoint_id=tmp_path / "c", no_dist=no_dist)
    dcp.save({"w0": np.full(4, 5.0, np.float32)}, checkpoint_id=tmp_path / "other", no_dist=no_dist)
    for value, load in ((2.0, lambda t: dcp.load(t, checkpoint_id=tmp_path / "c", no_dist=no_dist)),
                        (3.0, lambda t: hyper_parallel.load_checkpoint(tmp_path / "c", t, no_dist=no_dist))):
        handle = dcp.async_save({k: np.full_like(v, value) for k, v in old.items()}, checkpoint_id=tmp_path / "c",
                                no_dist=no_dist)
        other = {"w0": np.zeros(4, np.float32)}
        dcp.load(other, checkpoint_id=tmp_path / "other", no_dist=no_dist)  # another checkpoint: read as it is
        assert other["w0"].tolist() == [5.0] * 4
        target = {k: np.zeros_like(v) for k, v in old.items()}
        load(target)
        assert {float(v[0]) for v in target.values()} == {value} and all((v == value).all() for v in target.values())
        handle.result()
