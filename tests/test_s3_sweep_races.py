"""The object-store sweep deletes nothing a committed checkpoint or a still-committable save needs.

Adversarial orders of two saves to one prefix (moto's S3 server on
127.0.0.1): saves interleaved step by step in one process through the
engine's own phases (``plan_save`` notes the leftovers, ``commit_save``
commits and sweeps), a multipart upload of a live save started by the S3 API
itself, prefixes that nest or share a beginning, an async save whose commit
runs in the background as the next save begins, and saves of the two kinds
of metadata (one per checkpoint / one per rank) running at once.
"""

from __future__ import annotations

import numpy as np
import mindspore
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _object_io, _storage_choice
from hyper_parallel.core.distributed_checkpoint._engine import SaveOptions, commit_save, plan_save, write_local
from hyper_parallel.core.distributed_checkpoint._save_id import commits_per_rank, new_save_id
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointIOError, ConcurrentSaveError
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner
from s3_server import new_filesystem, s3_endpoint, s3_url  # noqa: F401  (fixtures)


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": mindspore.Tensor(rng.standard_normal((64, 48)).astype(np.float32)), "step": seed}


def _load(url: str, seed: int, **options) -> None:
    target = {"w": mindspore.Tensor(np.zeros((64, 48), np.float32)), "step": -1}
    dcp.load(target, checkpoint_id=url, **options)
    assert target["w"].asnumpy().tobytes() == _state(seed)["w"].asnumpy().tobytes() and target["step"] == seed


def _begin(url: str, seed: int, **options):
    """A save that has begun: its coordinator read the metadata and noted the leftovers."""
    options = {"no_dist": True, **options}
    return plan_save(_state(seed), writer=dcp.FsspecWriter(url), planner=StandardSavePlanner(),
                     options=SaveOptions(**options))


def _names(root: str) -> list[str]:
    fs = new_filesystem()
    try:
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    except FileNotFoundError:
        return []


def _start_upload(url: str, name: str) -> tuple[str, str, str]:
    """A multipart upload in progress (one 5 MiB part sent), as a live save's writer leaves it meanwhile."""
    fs = new_filesystem()
    bucket, key = url[len("s3://"):].split("/", 1)
    key = f"{key}/{name}"
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * (5 << 20))
    return bucket, key, upload


def _upload_alive(bucket: str, key: str, upload: str) -> bool:
    fs = new_filesystem()
    return any(u["UploadId"] == upload for u in
               fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads", []))


@pytest.mark.parametrize("first", ["earlier", "later"])
def test_two_interleaved_saves_one_commits_whole(s3_url: str, first: str) -> None:  # noqa: F811
    """Two saves begin, each writes (each notes the other's objects if present); whichever commits first wins.

    The loser is refused, and the winner's sweep never took an object the winner's metadata lists.
    """
    dcp.save(_state(1), checkpoint_id=s3_url, no_dist=True)
    early = _begin(s3_url, 2)
    early_results = write_local(early)  # the early save wrote before the late one began: the late one notes them
    late = _begin(s3_url, 3)
    late_results = write_local(late)
    winner, loser = (early, late) if first == "earlier" else (late, early)
    results = {id(early): early_results, id(late): late_results}
    commit_save(winner, lambda: results[id(winner)])
    with pytest.raises(ConcurrentSaveError):
        commit_save(loser, lambda: results[id(loser)])
    _load(s3_url, 2 if first == "earlier" else 3)
    names = _names(s3_url[len("s3://"):])
    winner_id = winner.writer.save_id
    assert [n for n in names if n.endswith(".safetensors")] == [n for n in names if winner_id in n], names


def test_a_save_to_a_prefix_leaves_uploads_under_nested_prefixes_alone(s3_url: str) -> None:  # noqa: F811
    """``<p>/best`` is a checkpoint of its own: a commit at ``<p>`` must not abort its live upload."""
    inner = f"{s3_url}/best"
    dcp.save(_state(1), checkpoint_id=inner, no_dist=True)
    # A save to <p>/best is uploading its data object (begun before the save to <p>).
    live = _start_upload(inner, f"r00000_000.{'5' * 12}.safetensors")
    dcp.save(_state(2), checkpoint_id=s3_url, no_dist=True)
    dcp.save(_state(3), checkpoint_id=s3_url, no_dist=True)
    assert _upload_alive(*live), "a commit at the outer prefix aborted the inner checkpoint's live upload"
    _load(inner, 1)
    _load(s3_url, 3)


def test_step_1_and_step_10_do_not_sweep_each_other(s3_url: str) -> None:  # noqa: F811
    step1, step10 = f"{s3_url}/step_1", f"{s3_url}/step_10"
    dcp.save(_state(10), checkpoint_id=step10, no_dist=True)
    left = f"r00000_000.{'6' * 12}.safetensors"
    new_filesystem().pipe_file(f"{step10[len('s3://'):]}/{left}", b"a save to step_10 writes it")
    live = _start_upload(step10, f"r00000_001.{'6' * 12}.safetensors")
    dcp.save(_state(1), checkpoint_id=step1, no_dist=True)
    dcp.save(_state(2), checkpoint_id=step1, no_dist=True)
    assert left in _names(step10[len("s3://"):]) and _upload_alive(*live)
    _load(step10, 10)
    _load(step1, 2)


def test_a_save_racing_an_async_save_in_the_background_leaves_the_winner_whole(s3_url: str) -> None:  # noqa: F811
    """An async save of one rank writes and commits in the background; a save begun meanwhile races it.

    Whichever commits first wins (both win when the async one committed
    before the other began); the checkpoint loads whole, the loser's objects
    are gone and the winner's all kept.
    """
    dcp.save(_state(1), checkpoint_id=s3_url, no_dist=True)
    future = dcp.async_save(_state(2), checkpoint_id=s3_url, no_dist=True)
    won = {}
    try:
        dcp.save(_state(3), checkpoint_id=s3_url, no_dist=True)  # begins while the async save may still run
        won[3] = True
    except ConcurrentSaveError:
        won[3] = False
    try:
        future.result()
        won[2] = True
    except ConcurrentSaveError:
        won[2] = False
    assert won[2] or won[3], won
    _load(s3_url, 3 if won[3] else 2)
    names = _names(s3_url[len("s3://"):])
    assert len([n for n in names if n.endswith(".safetensors")]) == 1, names
    dcp.async_save(_state(4), checkpoint_id=s3_url, no_dist=True).result()
    _load(s3_url, 4)


def _rank_local(monkeypatch: pytest.MonkeyPatch) -> None:
    """Act as rank 0 of a job of 2 that saves without collectives (rank-local metadata)."""
    monkeypatch.setattr(_storage_choice.platform, "get_world_size", lambda: 2)
    monkeypatch.setattr(_storage_choice.platform, "get_rank", lambda: 0)


@pytest.mark.parametrize("committed_first", ["rank-local", "global"])
def test_saves_of_both_metadata_kinds_at_once_keep_both_checkpoints(
        s3_url: str, monkeypatch: pytest.MonkeyPatch, committed_first: str) -> None:  # noqa: F811
    """A rank-local and a global save to one prefix commit different objects: neither may sweep the other's data."""
    with monkeypatch.context() as patch:
        _rank_local(patch)
        local = _begin(s3_url, 5, no_dist=False, use_collectives=False)
        local_results = write_local(local)
    assert local.writer.rank_local
    whole = _begin(s3_url, 6)  # notes the rank-local save's data object: no rank-local metadata exists yet
    whole_results = write_local(whole)
    if committed_first == "rank-local":
        with monkeypatch.context() as patch:
            _rank_local(patch)
            commit_save(local, lambda: local_results)
        commit_save(whole, lambda: whole_results)
    else:
        commit_save(whole, lambda: whole_results)
        with monkeypatch.context() as patch:
            _rank_local(patch)
            commit_save(local, lambda: local_results)
    _load(s3_url, 6, no_dist=True)
    with monkeypatch.context() as patch:
        _rank_local(patch)
        _load(s3_url, 5, use_collectives=False)


def test_save_ids_tell_the_kind_and_each_kind_sweeps_its_own(
        s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    ids = {kind: [new_save_id(rank_local=kind) for _ in range(64)] for kind in (False, True)}
    assert all(len(i) == 12 and int(i, 16) >= 0 and commits_per_rank(i) is kind for kind in ids for i in ids[kind])
    assert len(set(ids[False])) == 64 and {i[0] for i in ids[False]} <= set("01234567")
    root = s3_url[len("s3://"):]
    fs = new_filesystem()
    local_left = [f"r00000_000.{'9' * 12}.safetensors", f"r00001_000.{'a' * 12}.safetensors"]  # killed rank-local saves
    whole_left = f"r00000_000.{'2' * 12}.safetensors"  # a killed save of one metadata object
    for name in [*local_left, whole_left]:
        fs.pipe_file(f"{root}/{name}", b"left")
    with monkeypatch.context() as patch:
        _rank_local(patch)
        dcp.save(_state(7), checkpoint_id=s3_url, use_collectives=False)
        names = _names(root)
        assert local_left[0] not in names and {local_left[1], whole_left} <= set(names), names  # rank 0's own kind only
        _load(s3_url, 7, use_collectives=False)


@pytest.mark.parametrize("reply", ["retried", "lost"])
def test_a_commit_whose_reply_is_lost_keeps_its_data(s3_url: str, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                     reply: str) -> None:
    """The store applied the conditional PUT of the metadata, its reply never came back.

    ``retried``: the client's retry is refused (412: the object is no longer
    as seen, since this very PUT changed it); ``lost``: the connection broke.
    Either way the metadata object now lists this save's data objects: the
    save must not delete them (it did: the checkpoint then named missing objects).
    """
    dcp.save(_state(1), checkpoint_id=s3_url, no_dist=True)
    real = _object_io._s3

    def reply_lost(fs, method, **kwargs):
        if method == "put_object" and ("IfMatch" in kwargs or "IfNoneMatch" in kwargs):
            real(fs, method, **kwargs)  # applied by the store
            if reply == "lost":
                raise ConnectionResetError("connection reset by peer before the reply")
        return real(fs, method, **kwargs)

    monkeypatch.setattr(_object_io, "_s3", reply_lost)
    dcp.save(_state(2), checkpoint_id=s3_url, no_dist=True)  # committed: no error
    monkeypatch.undo()
    _load(s3_url, 2)
    names = _names(s3_url[len("s3://"):])
    assert len([n for n in names if n.endswith(".safetensors")]) == 1, names  # the superseded data swept


def test_a_commit_of_unknown_outcome_deletes_nothing(
        s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The PUT's fate is unknown and the store cannot be read back: the save raises and keeps its data objects."""
    dcp.save(_state(1), checkpoint_id=s3_url, no_dist=True)
    real = _object_io._s3
    down = []

    def store_gone(fs, method, **kwargs):
        if down or (method == "put_object" and "IfMatch" in kwargs):
            if not down:
                real(fs, method, **kwargs)  # applied; then the store is unreachable for this save
            down.append(method)
            raise ConnectionResetError("connection reset by peer")
        return real(fs, method, **kwargs)

    monkeypatch.setattr(_object_io, "_s3", store_gone)
    with pytest.raises(CheckpointIOError, match="may have committed"):
        dcp.save(_state(2), checkpoint_id=s3_url, no_dist=True)
    monkeypatch.undo()
    _load(s3_url, 2)  # it had committed: every object it lists is there
