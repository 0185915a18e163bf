"""What the commit of a save hands each rank: a receipt whose bytes do not grow with the world size.

Simulated ranks (tests/sim_ranks.py) save real checkpoints; the answers of the
commit step (what :func:`commit_answers` returns, pickled as
``DistWrapper.reduce_scatter`` sends them) are measured per world size. The
view a non-coordinator returns is checked against ``dcp.read_metadata``.
The view of an async save waits for a background commit: here a thread plays
the coordinator's commit (it moves a real checkpoint into place, then removes
the rank's real results record); the msrun side is in tests/test_background_commit.py.
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
import time

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint import _commit_receipt as commit_receipt
from hyper_parallel.core.distributed_checkpoint._commit_receipt import (
    CommitReceipt,
    CommittedMetadataView,
    CommitWait,
    commit_answers,
    metadata_of_answer,
    metadata_reader_of,
    record_probe_of,
)
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import FsspecWriter
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointNotFoundError, CollectiveTimeoutError
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemPlanData
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan
from sim_ranks import simulate_save

TENSORS = 6


def _states(ranks: int) -> list[dict]:
    """Every tensor sharded over every rank (rows): the metadata lists TENSORS x ranks chunks."""
    full = [np.arange(ranks * 4 * 3, dtype=np.float32).reshape(ranks * 4, 3) + t for t in range(TENSORS)]
    layout = Layout((ranks,), (0, -1))
    return [{f"t{t}": DTensor.from_global(ms.Tensor(full[t]), layout, rank=r) for t in range(TENSORS)}
            for r in range(ranks)]


def _received(answers: list, rank: int) -> int:
    """Bytes ``rank`` receives from the commit step: the length broadcast plus its pickled ``(part, failures)``."""
    return 8 + len(pickle.dumps((answers[rank], []), protocol=pickle.HIGHEST_PROTOCOL))


@pytest.mark.parametrize("form", ["inline", "indexed"])
def test_bytes_a_rank_receives_from_the_commit_do_not_grow_with_the_world(tmp_path, form):
    before, after = {}, {}
    for ranks in (2, 8, 32):
        path = tmp_path / f"w{ranks:03d}"  # same length: the receipt names the checkpoint
        committed, _ = simulate_save(_states(ranks), path, writer_options={"metadata_form": form})
        writer = dcp.FileSystemWriter(path)
        old = [committed] * ranks  # what every rank received before: the committed metadata
        new = commit_answers(committed, world_size=ranks, location=path, read_back=metadata_reader_of(writer))
        assert all(part is new[0] for part in new)  # one object: a broadcast, no row per rank
        assert isinstance(new[1], CommitReceipt) and new[1].save_id == committed.storage_meta.save_id
        before[ranks], after[ranks] = _received(old, 1), _received(new, 1)
    print(form, "bytes a non-coordinator receives from the commit, before:", before, "after:", after)
    assert after[2] == after[8] == after[32] < 300, after
    assert before[2] < before[8] < before[32] and before[32] > 10 * after[32], before  # the metadata grows


def test_non_coordinator_view_reads_the_committed_metadata_once(tmp_path):
    path = tmp_path / "ck"
    committed, _ = simulate_save(_states(4), path, writer_options={"metadata_form": "indexed"})
    read = metadata_reader_of(dcp.FileSystemWriter(path))
    calls = []

    def counted() -> Metadata:
        calls.append(1)
        return read()

    receipt = commit_answers(committed, world_size=4, location=path, read_back=read)[1]
    view = CommittedMetadataView(receipt, counted)
    assert not calls  # nothing read until a field is used
    assert isinstance(view, Metadata)
    assert view == dcp.read_metadata(path) and dcp.read_metadata(path) == view and view == committed
    assert view.storage_meta.world_size == 4 and len(view.state_dict_metadata["t0"].chunks) == 4
    assert view.storage_meta.save_id == committed.storage_meta.save_id
    copied = pickle.loads(pickle.dumps(view))
    assert type(copied) is Metadata and copied == committed
    assert view.replace(planner_data="x").planner_data == "x" and type(view.replace()) is Metadata
    assert "state_dict_metadata" in repr(view)
    assert len(calls) == 1
    target = {f"t{t}": np.zeros((16, 3), np.float32) for t in range(TENSORS)}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    assert all(np.array_equal(target[f"t{t}"], np.arange(48, dtype=np.float32).reshape(16, 3) + t)
               for t in range(TENSORS))


def test_view_of_a_replaced_or_deleted_checkpoint_refuses(tmp_path):
    path = tmp_path / "ck"
    committed, _ = simulate_save(_states(2), path)
    read = metadata_reader_of(dcp.FileSystemWriter(path))
    receipt = commit_answers(committed, world_size=2, location=path, read_back=read)[1]
    early = CommittedMetadataView(receipt, read)
    assert early.storage_meta.save_id == committed.storage_meta.save_id  # read now: kept
    replaced, _ = simulate_save(_states(2), path)
    assert replaced.storage_meta.save_id != committed.storage_meta.save_id
    assert early == committed  # what it read stays
    late = CommittedMetadataView(receipt, read)
    with pytest.raises(CheckpointNotFoundError, match=f"{committed.storage_meta.save_id}.*later save"):
        _ = late.state_dict_metadata
    for name in list(path.iterdir()):
        name.unlink()
    gone = CommittedMetadataView(CommitReceipt(replaced.storage_meta.save_id, str(path)), read)
    with pytest.raises(CheckpointNotFoundError, match="is gone"):
        _ = gone.storage_meta


def test_fsspec_writer_reads_back_and_other_writers_send_the_metadata(tmp_path):
    url = "memory://receipt-test/ck"
    committed, _ = simulate_save(_states(2), url, writer_class=FsspecWriter)
    read = metadata_reader_of(FsspecWriter(url))
    view = CommittedMetadataView(commit_answers(committed, world_size=2, location=url, read_back=read)[1], read)
    assert view == committed
    rank_local = dcp.FileSystemWriter(tmp_path / "local")
    rank_local.set_up_storage_writer(True, rank=1, world_size=2, rank_local=True)
    assert metadata_reader_of(rank_local) is None
    assert commit_answers(committed, world_size=3, location=url, read_back=None) == [committed] * 3


def _store_record(writer, save_id: str, rank: int = 1) -> None:
    """``rank``'s results record of ``save_id``, as its background thread stores it before ``result()``."""
    plan = SavePlan(items=(), storage_data=FileSystemPlanData(save_id))
    writer.write_rank_record(rank, b'{"stand-in": 1}', plan=plan)


def _commit_later(staged, path, *, delay: float, commit: bool, remove: bool = True) -> threading.Thread:
    """Rank 0's background commit, after ``delay`` s: move the checkpoint saved at ``staged`` into ``path``
    (data files, then metadata.json by rename; ``commit=False``: it failed, nothing moves), then remove the records
    (``remove=False``: their removal failed)."""

    def run() -> None:
        time.sleep(delay)
        if commit:
            for name in os.listdir(staged):
                if name != "metadata.json":
                    shutil.copy(staged / name, path / name)
            shutil.copy(staged / "metadata.json", path / ".metadata.json.partial")
            os.replace(path / ".metadata.json.partial", path / "metadata.json")
        for record in path.glob(".*.results") if remove else ():
            record.unlink()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _async_view(path, committed, *, timeout: float | None = 30.0, rank: int = 1):
    """What ``result()`` returns on ``rank`` for the async save ``committed`` (record stored), and the reads made."""
    writer = dcp.FileSystemWriter(path)
    save_id = committed.storage_meta.save_id
    _store_record(writer, save_id, rank)
    read = metadata_reader_of(writer)
    reads = []

    def counted() -> Metadata:
        reads.append(1)
        return read()

    receipt = commit_answers(committed, world_size=2, location=path, read_back=read)[1]
    wait = CommitWait(pending=record_probe_of(writer, rank=rank, save_id=save_id), rank=rank, timeout=timeout)
    return metadata_of_answer(receipt, read_back=counted, wait=wait), reads


def test_async_view_waits_for_the_background_commit_never_giving_the_previous_save(tmp_path):
    path, staged = tmp_path / "ck", tmp_path / "staged"
    previous, _ = simulate_save(_states(2), path)
    committed, _ = simulate_save([{k: v for k, v in s.items() if k != "t5"} for s in _states(2)], staged)
    view, reads = _async_view(path, committed)
    assert isinstance(view, CommittedMetadataView) and not reads  # nothing read until used
    thread = _commit_later(staged, path, delay=0.5, commit=True)
    start = time.monotonic()
    assert view.storage_meta.save_id == committed.storage_meta.save_id != previous.storage_meta.save_id
    waited = time.monotonic() - start
    thread.join()
    assert waited >= 0.4, waited  # it read the previous save's metadata while waiting, and did not return it
    assert len(reads) == 2  # the previous save's metadata once, then once the record was gone (not at every look)
    assert view == committed and view == dcp.read_metadata(path)
    again, _ = _async_view(path, committed)
    assert again == view and view == again  # views compare as the metadata they read
    assert sorted(view.state_dict_metadata) == [f"t{t}" for t in range(TENSORS - 1)]
    count = len(reads)
    assert view.version == committed.version and view.planner_data == committed.planner_data
    assert len(reads) == count  # read once: later uses keep what it read
    target = {f"t{t}": np.zeros((8, 3), np.float32) for t in range(TENSORS - 1)}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    assert all(np.array_equal(target[f"t{t}"], np.arange(24, dtype=np.float32).reshape(8, 3) + t)
               for t in range(TENSORS - 1))


def test_async_view_of_a_failed_background_commit_refuses(tmp_path):
    path, staged = tmp_path / "ck", tmp_path / "staged"
    previous, _ = simulate_save(_states(2), path)
    failed, _ = simulate_save(_states(2), staged)
    view, _ = _async_view(path, failed)
    thread = _commit_later(staged, path, delay=0.3, commit=False)
    message = (f"rank 1: the metadata async_save returned for save {failed.storage_meta.save_id} of checkpoint "
               f"{path} is not there: its background commit on rank 0 is over and the checkpoint holds save "
               f"{previous.storage_meta.save_id}. Either that commit failed")
    with pytest.raises(CheckpointNotFoundError) as raised:
        _ = view.state_dict_metadata  # waits while the commit runs, then refuses: never the previous save
    thread.join()
    assert str(raised.value).startswith(message), str(raised.value)
    assert "dcp.read_metadata" in str(raised.value) and isinstance(raised.value, FileNotFoundError)
    empty = tmp_path / "empty"  # a first save of its directory: nothing committed there
    empty.mkdir()
    view, _ = _async_view(empty, failed, rank=3)
    _commit_later(staged, empty, delay=0.1, commit=False).join()
    with pytest.raises(CheckpointNotFoundError, match=f"rank 3: .* save {failed.storage_meta.save_id} .*holds no "
                                                      "committed save"):
        _ = view.storage_meta


def test_async_view_replaced_by_a_later_save_refuses(tmp_path):
    path, staged = tmp_path / "ck", tmp_path / "staged"
    committed, _ = simulate_save(_states(2), staged)
    path.mkdir()
    view, _ = _async_view(path, committed)
    early, _ = _async_view(path, committed)
    _commit_later(staged, path, delay=0.0, commit=True).join()
    assert early == committed  # used before the next save: kept
    later, _ = simulate_save(_states(2), path)
    replaced = f"holds save {later.storage_meta.save_id}.*a later save replaced"
    with pytest.raises(CheckpointNotFoundError, match=replaced):
        _ = view.storage_meta
    assert early.storage_meta.save_id == committed.storage_meta.save_id


def test_async_view_gives_up_after_the_commit_timeout(tmp_path):
    path = tmp_path / "ck"
    previous, _ = simulate_save(_states(2), path)
    running, _ = simulate_save(_states(2), tmp_path / "staged")
    view, reads = _async_view(path, running, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=f"rank 1: .* save {running.storage_meta.save_id} of checkpoint "
                                                     f"{path} .* still not over after 0.3 s"):
        _ = view.state_dict_metadata
    assert 0.3 <= time.monotonic() - start < 5 and len(reads) == 1  # the metadata is not read at every look
    assert previous.storage_meta.save_id != running.storage_meta.save_id


def test_record_probe_follows_the_location_of_the_save(tmp_path):
    writer = dcp.FileSystemWriter(tmp_path / "a")
    (tmp_path / "a").mkdir()
    _store_record(writer, "0123456789ab")
    probe = record_probe_of(writer, rank=1, save_id="0123456789ab")
    assert probe() and not record_probe_of(writer, rank=2, save_id="0123456789ab")()
    assert not record_probe_of(writer, rank=1, save_id="ba9876543210")()
    writer.reset(tmp_path / "b")  # the writer saves elsewhere next: the probe keeps looking where the save was
    assert probe()
    assert writer.read_rank_record(1) is None  # its own save id now: another record
    url = "memory://receipt-probe/ck"
    remote = FsspecWriter(url)
    _store_record(remote, "fedcba987654", rank=2)
    remote_probe = record_probe_of(remote, rank=2, save_id="fedcba987654")
    assert remote_probe() and not record_probe_of(remote, rank=1, save_id="fedcba987654")()
    remote.fs.rm(remote.root.rstrip("/") + "/.fedcba987654.rank00002.results")
    assert not remote_probe()
    rank_local = dcp.FileSystemWriter(tmp_path / "local")
    rank_local.set_up_storage_writer(True, rank=1, world_size=2, rank_local=True)
    assert record_probe_of(rank_local, rank=1, save_id="0123456789ab") is None
    assert metadata_of_answer(Metadata(state_dict_metadata={}), read_back=None) == Metadata(state_dict_metadata={})


def test_async_view_sees_a_commit_whose_records_were_left(tmp_path, monkeypatch):
    """The commit wrote the metadata but could not remove the records: found by reading the metadata again."""
    monkeypatch.setattr(commit_receipt, "_REREAD_SECONDS", 0.3)
    path, staged = tmp_path / "ck", tmp_path / "staged"
    simulate_save(_states(2), path)
    committed, _ = simulate_save(_states(2), staged)
    view, reads = _async_view(path, committed)
    thread = _commit_later(staged, path, delay=0.1, commit=True, remove=False)
    start = time.monotonic()
    assert view.storage_meta.save_id == committed.storage_meta.save_id
    thread.join()
    assert 0.3 <= time.monotonic() - start < 5 and len(reads) == 2 and view == committed


def test_a_view_changes_through_dataclasses_replace_as_the_metadata_does(tmp_path):
    """``dataclasses.replace`` (how a frozen Metadata is changed) works on the view a non-coordinator rank gets
    (sync saves, and async saves since their ranks get receipts): it gives the committed metadata with the change."""
    import dataclasses

    path = tmp_path / "ck"
    committed, _ = simulate_save(_states(4), path)
    read = metadata_reader_of(dcp.FileSystemWriter(path))
    view = CommittedMetadataView(commit_answers(committed, world_size=4, location=path, read_back=read)[1], read)
    changed = dataclasses.replace(view, planner_data={"note": 1})
    assert isinstance(changed, Metadata) and changed.planner_data == {"note": 1}
    assert changed.state_dict_metadata == committed.state_dict_metadata
    assert changed.storage_meta.save_id == committed.storage_meta.save_id
    assert changed == committed.replace(planner_data={"note": 1})
    assert pickle.loads(pickle.dumps(changed)) == changed
    assert dataclasses.replace(view) == committed
