"""What the commit of a save hands each rank: a receipt whose bytes do not grow with the world size.

Simulated ranks (tests/sim_ranks.py) save real checkpoints; the answers of the
commit step (what :func:`commit_answers` returns, pickled as
``DistWrapper.reduce_scatter`` sends them) are measured per world size. The
view a non-coordinator returns is checked against ``dcp.read_metadata``.
"""

from __future__ import annotations

import pickle

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint._commit_receipt import (
    CommitReceipt,
    CommittedMetadataView,
    commit_answers,
    metadata_reader_of,
)
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import FsspecWriter
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointNotFoundError
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata
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
