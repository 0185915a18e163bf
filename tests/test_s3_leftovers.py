"""What a killed save leaves on object storage is deleted by the next commit there, and nothing else is.

A save killed before its commit leaves data objects named with a save id no
metadata lists; one killed mid-upload leaves a multipart upload in progress
(invisible in listings, still stored). The next save's coordinator notes them
as it begins and deletes them once its conditional commit succeeded (moto's
S3 server on 127.0.0.1, real SIGKILLed child processes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import mindspore
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _object_steps
from hyper_parallel.core.distributed_checkpoint._engine import SaveOptions, commit_save, plan_save, write_local
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner
from s3_server import new_filesystem, s3_endpoint, s3_url  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parent.parent
CHILD = REPO / "tests" / "workers" / "s3_save_child.py"


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": mindspore.Tensor(rng.standard_normal((128, 96)).astype(np.float32)), "step": seed}


def _loads_as(writer_url: str, seed: int, reader=None) -> None:
    target = {"w": mindspore.Tensor(np.zeros((128, 96), np.float32)), "step": -1}
    dcp.load(target, checkpoint_id=None if reader else writer_url, storage_reader=reader, no_dist=True)
    expected = _state(seed)
    assert target["w"].asnumpy().tobytes() == expected["w"].asnumpy().tobytes() and target["step"] == seed


def _names(fs, root: str) -> list[str]:
    fs.invalidate_cache(root)
    try:
        return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    except FileNotFoundError:
        return []


def _uploads(fs, url: str) -> list[str]:
    bucket, key = url[len("s3://"):].split("/", 1)
    return [u["Key"] for u in fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{key}/").get("Uploads", [])]


def _saved_then_ended(url: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), url, *args],
                            env={**os.environ, **env, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_what_killed_saves_leave_is_swept_by_the_next_commit(s3_url: str, s3_endpoint) -> None:  # noqa: F811
    fs, root = new_filesystem(), s3_url[len("s3://"):]
    dcp.save(_state(1), checkpoint_id=s3_url, no_dist=True)
    first = dcp.read_metadata(s3_url).storage_meta.save_id

    # Killed just before its commit: its data objects are complete, no metadata names them.
    child = _saved_then_ended(s3_url, s3_endpoint.env, "--die-before-commit")
    output = child.communicate(timeout=300)[0].decode(errors="replace")
    assert child.returncode == -signal.SIGKILL, output[-2000:]
    dead = [n for n in _names(fs, root) if n.endswith(".safetensors") and first not in n]
    assert len(dead) == 2, _names(fs, root)

    # Killed mid-upload: a multipart upload stays in progress.
    child = _saved_then_ended(s3_url, s3_endpoint.env)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and child.poll() is None and not _uploads(fs, s3_url):
            time.sleep(0.02)
    finally:
        child.kill()
        output = child.communicate()[0].decode(errors="replace")
    assert _uploads(fs, s3_url), f"the child never started an upload: {output[-2000:]}"
    _loads_as(s3_url, 1)  # neither touched the committed checkpoint

    committed = dcp.save(_state(2), checkpoint_id=s3_url, no_dist=True)
    new = committed.storage_meta.save_id
    names = _names(fs, root)
    assert names == sorted(["metadata.json", *(n for n in names if n.endswith(f".{new}.safetensors"))]), names
    assert len(names) > 1 and _uploads(fs, s3_url) == []
    _loads_as(s3_url, 2)


def _prepared(url: str, seed: int, **writer_options):
    writer = dcp.FsspecWriter(url, **writer_options)
    return plan_save(_state(seed), writer=writer, planner=StandardSavePlanner(), options=SaveOptions(no_dist=True))


def test_objects_that_appear_after_a_save_began_are_kept(s3_url: str) -> None:
    fs, root = new_filesystem(), s3_url[len("s3://"):]
    dcp.save(_state(3), checkpoint_id=s3_url, no_dist=True)
    # Left by killed saves (names as they write them): a data object and a results record.
    earlier = [f"r00000_000.{'1' * 12}.safetensors", f".{'1' * 12}.rank00001.results"]
    for name in earlier:
        fs.pipe_file(f"{root}/{name}", b"left")
    session = _prepared(s3_url, 4)  # began: notes them
    later = f"r00000_000.{'3' * 12}.safetensors"  # a save that began after this one
    fs.pipe_file(f"{root}/{later}", b"live")
    commit_save(session, lambda: write_local(session))
    names = _names(fs, root)
    assert later in names and not set(earlier) & set(names), names
    _loads_as(s3_url, 4)


def test_a_location_holding_both_kinds_of_metadata_is_not_swept(s3_url: str) -> None:
    fs, root = new_filesystem(), s3_url[len("s3://"):]
    other = f"r00000_000.{'c' * 12}.safetensors"
    fs.pipe_file(f"{root}/{other}", b"maybe referenced")
    fs.pipe_file(f"{root}/metadata.rank00000.json", b"{}")  # a rank-local checkpoint shares the prefix
    dcp.save(_state(5), checkpoint_id=s3_url, no_dist=True)
    assert other in _names(fs, root)
    _loads_as(s3_url, 5)


def test_other_fsspec_filesystems_sweep_the_same_way() -> None:
    fs = fsspec.filesystem("memory")
    url = f"memory://hp-ckpt-left-{os.getpid()}/ckpt"
    root = url[len("memory://"):]
    try:
        dcp.save(_state(6), storage_writer=dcp.FsspecWriter(url, filesystem=fs), no_dist=True)
        left = f"r00000_000.{'4' * 12}.safetensors"
        fs.pipe_file(f"{url}/{left}", b"left")
        dcp.save(_state(7), storage_writer=dcp.FsspecWriter(url, filesystem=fs), no_dist=True)
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(url, detail=False)]
        assert left not in names and len([n for n in names if n.endswith(".safetensors")]) == 1, names
        _loads_as(url, 7, reader=dcp.FsspecReader(url, filesystem=fs))
    finally:
        fs.rm(f"/{root.split('/')[0]}", recursive=True)


def test_manager_retention_deletes_an_abandoned_step_with_its_uploads(s3_url: str, s3_endpoint,  # noqa: F811
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    fs = new_filesystem()
    manager = dcp.CheckpointManager(s3_url, max_to_keep=2)
    manager.save(1, _state(1))
    step2 = str(manager.directory(2))
    child = _saved_then_ended(step2, s3_endpoint.env, "--two-objects")  # killed mid-upload, one object complete
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and child.poll() is None and not (
                _uploads(fs, step2) and _names(fs, step2[len("s3://"):])):
            time.sleep(0.02)
    finally:
        child.kill()
        output = child.communicate()[0].decode(errors="replace")
    assert _uploads(fs, step2) and _names(fs, step2[len("s3://"):]), output[-2000:]
    monkeypatch.setattr(_object_steps, "UNCOMMITTED_GRACE_SECONDS", -1.0)  # abandoned at once
    manager.save(3, _state(3))
    assert manager.all_steps() == [1, 3]
    assert _uploads(fs, s3_url) == [] and "step_00000002" not in _names(fs, s3_url[len("s3://"):])
    _loads_as(manager.directory(3), 3)


def test_the_listing_leaves_no_stale_cache_behind(s3_url: str) -> None:
    """s3fs answers ``exists`` from a cached listing: the one taken as the save began must not outlive it."""
    fs = new_filesystem()  # one instance given to the writer and the reader
    fs.pipe_file(f"{s3_url[len('s3://'):]}/README", b"not a checkpoint object")
    # nothing to sweep: no delete refreshes the cache
    dcp.save(_state(8), storage_writer=dcp.FsspecWriter(s3_url, filesystem=fs), no_dist=True)
    reader = dcp.FsspecReader(s3_url, filesystem=fs)
    assert reader.has_object("metadata.json")
    _loads_as(s3_url, 8, reader=reader)


def test_a_failed_save_removes_its_own_data_objects_and_results_records(s3_url: str) -> None:
    from hyper_parallel.core.distributed_checkpoint.planner import SavePlan  # pylint: disable=import-outside-toplevel

    fs, root = new_filesystem(), s3_url[len("s3://"):]
    writer = dcp.FsspecWriter(s3_url, filesystem=fs)
    writer.set_up_storage_writer(True)
    writer.write_rank_record(1, b"{}", plan=SavePlan(items=()))  # a rank's record of a multi-rank async save
    fs.pipe_file(f"{root}/r00001_000.{writer.save_id}.safetensors", b"written")
    other = f"r00000_000.{'e' * 12}.safetensors"
    fs.pipe_file(f"{root}/{other}", b"another save's")
    probe = new_filesystem()  # lists for the test, apart from the writer's filesystem (and its cache)
    assert len(_names(probe, root)) == 3
    writer.abort()
    assert _names(probe, root) == [other]
    bucket, key = root.split("/", 1)
    fs.call_s3("put_object", Bucket=bucket, Key=f"{key}/metadata.json", Body=b"{}")  # as another save's commit
    assert dcp.FsspecReader(s3_url, filesystem=fs).has_object("metadata.json")  # no stale listing left by abort
