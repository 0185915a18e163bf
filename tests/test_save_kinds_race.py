"""Rank-local and collective saves of one directory, and a save alone beside a pending collective async save.

One 2-rank msrun launch (tests/workers/save_kinds_worker.py), and the refusal's parts in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncRequest
from msrun_harness import run_workers

WORKER = Path(__file__).resolve().parent / "workers" / "save_kinds_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list:
    """Every rank's scenario results."""
    return run_workers(WORKER, workers=2, tmp_path=tmp_path_factory.mktemp("save_kinds"), timeout=400)


def test_rank_local_and_collective_saves_of_one_directory_keep_each_other_whole(results: list) -> None:
    """Rank-local saves (metadata.rank<r>.json, thread) and collective async saves (metadata.json) commit to one
    directory at once on both ranks: they take different leases, but data files carry their save's id and
    every sweep removes files by save id, so each committed checkpoint of either kind loads its own values
    whole (checksums checked), never the other kind's nor a mix."""
    for rank in (0, 1):
        entry = results[rank]["kinds_race"]
        assert entry["ok"], entry
        local, whole = entry["value"]["local"], entry["value"]["whole"]
        assert local == [(value, [float(value)]) for value in range(100 + 10 * rank, 118 + 10 * rank)], local
        for i, values in whole:
            # result() does not wait for the coordinator's background commit, and a no_dist load in a job of
            # several ranks does not finish it: the previous collective save may still be the committed one, or
            # be replaced by save i while the load reads it (then the load fails whole, saying so).
            replaced = isinstance(values, str) and values.startswith("CheckpointNotFoundError: ") and (
                "was deleted or replaced by another save while loading" in values and values.endswith("load it again"))
            assert values in ([float(i)], [float(i - 1)]) or replaced, (i, values)


def test_an_async_save_alone_beside_a_pending_collective_async_save_fails_fast(results: list) -> None:
    """Rank 0 alone starts an async save (use_collectives=False or no_dist) while a collective async save is
    pending and rank 1 is not in its result(): it used to finish that save first, whose result() step waits
    for every rank, and hung until rank 1 got there (here after 20 s). Now it raises at once naming the
    pending save and the fix; once result() ran on every rank the same save commits. A sync save alone does
    not finish the pending save and commits at once, unless it was given the pending save's own writer object
    (storage_writer=): it must finish that save first, and used to hang there as well; now it fails fast too."""
    outcomes = results[0]["alone_after_collective"]
    assert outcomes["ok"], outcomes
    for name, outcome in outcomes["value"].items():
        assert outcome["collective"] == [3.0], (name, outcome)
        assert outcome["alone"] == [7.0], (name, outcome)
        assert outcome["seconds"] < 10.0, (name, outcome)
        if name.startswith("async") or name.endswith("shared_writer"):
            assert outcome["error"] == "ConcurrentSaveError", (name, outcome)
            assert f"collective_{name}" in outcome["message"] and "Call result() on" in outcome["message"], outcome
            assert "every rank" in outcome["message"], outcome
        else:
            assert outcome["error"] is None, (name, outcome)
    other = results[1]["alone_after_collective"]
    assert other["ok"], other
    for name, outcome in other["value"].items():
        # A shared-writer case's alone save, repeated after result(), writes the collective's own directory: rank 1
        # may load it after that save committed.
        assert outcome["collective"] in ([3.0], [7.0] if name.endswith("shared_writer") else [3.0]), (name, outcome)


def test_a_collective_save_whose_ranks_name_different_checkpoints_is_refused(results: list) -> None:
    """Each rank passed its own checkpoint_id (split_<kind>_<rank>) to one collective save. The sync save used to
    return on every rank, committing split_sync_0/metadata.json that lists rank 1's file, which sat in
    split_sync_1 (the load then failed: file missing); the async one committed nothing but said nothing until
    the next save, after the collective timeout. Both are now refused at the first step, on every rank, naming
    the ranks and their paths; nothing is committed, and a save of both ranks to one id commits next. A collective
    load of a different checkpoint on each rank is refused naming the paths (it was refused as a save replacing
    the checkpoint), its targets untouched."""
    for rank in (0, 1):
        entry = results[rank]["split_ids"]
        assert entry["ok"], entry
        for kind in ("sync", "async"):
            outcome = entry["value"][kind]
            assert outcome["error"] is not None and outcome["value_error"], (rank, kind, outcome)
            message = outcome["message"]
            assert "name 2 different checkpoints" in message, message
            for r in (0, 1):
                assert f"ranks [{r}] to " in message and f"split_{kind}_{r}" in message, message
            assert "the same checkpoint_id" in message, message
            assert all(not held or "metadata.json" not in held for held in outcome["held"].values()), outcome
            assert outcome["joined"] == [9.0], outcome
        load = entry["value"]["load"]  # each rank its own checkpoint in one collective load
        assert load["value_error"] and load["untouched"], load
        assert "CheckpointValueError: the ranks of one collective load name 2 different checkpoints" in (
            load["message"]), load
        assert "split_load_0" in load["message"] and "split_load_1" in load["message"], load


def test_the_queue_refuses_to_finish_alone_a_call_whose_finishing_needs_every_rank(tmp_path: Path) -> None:
    """Only a call scheduled with all_ranks and not finalized yet is pending for every rank. Finishing it without
    collectives (an async save's start, or dcp.save's finishing of the writer it shares) is refused naming its
    checkpoint and save id, and leaves it pending; a call on another writer is not finished, so not refused; with
    collectives, or once it is finalized, nothing is refused."""
    queue = dcp.AsyncCallsQueue()
    writer = dcp.FileSystemWriter(tmp_path / "ckpt")
    queue.schedule_async_request(AsyncRequest(async_fn=lambda: 1), uses=object())
    assert queue.pending_all_ranks() is None
    queue.maybe_finalize_async_calls(blocking=True, collective=False)  # nothing needs every rank
    call = queue.schedule_async_request(AsyncRequest(async_fn=lambda: 2), uses=writer, all_ranks=True)
    assert queue.pending_all_ranks() is call
    for finish, because, not_because in (
            (lambda: queue.maybe_finalize_async_calls(blocking=True, collective=False),
             "an async save starts once this process's earlier ones are finished", "writer"),
            (lambda: queue.finish_calls_using(writer, collective=False),
             "a pending async save still uses this save's storage writer", "earlier ones")):
        with pytest.raises(dcp.ConcurrentSaveError) as caught:
            finish()
        assert str(tmp_path / "ckpt") in str(caught.value) and writer.save_id in str(caught.value)
        assert "Call result() on that save's handle on every rank" in str(caught.value)
        assert because in str(caught.value) and not_because not in str(caught.value), "the reason of its path"
        assert not call.finalized()
    assert not queue.finish_calls_using(dcp.FileSystemWriter(tmp_path / "other"), collective=False)
    assert queue.finish_calls_using(writer)
    assert queue.pending_all_ranks() is None and call.finalize() == 2
    queue.maybe_finalize_async_calls(blocking=True, collective=False)  # nothing pending: no error
