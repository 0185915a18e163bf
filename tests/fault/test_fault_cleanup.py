"""Commit cleanup and the save lease facing a directory that holds anything.

A FIFO, a symlink to ``/dev/zero``, a directory or a 100,000-deep JSON under
each name the commit reads or deletes must not hang the save, fill memory or
raise a raw error, neither on that save nor on later ones. Every save runs on
a thread with a deadline, so a hang fails the test instead of blocking it.
Also: the lease of a dead process is taken over (its files deleted), a live
one of another host is respected until its timeout, and a commit that finds
its lease broken or the metadata replaced fails naming the clash.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._save_lease import unreadable_grace
from hyper_parallel.core.distributed_checkpoint._save_lease import LeaseHolder, SaveLease, lease_name, live_lease_in

from fault_common import assert_only_committed_files, assert_same_state, load_into_blank, make_state

DEADLINE = 60


def _within_deadline(function: Callable[[], Any]) -> Any:
    """Run ``function`` on a thread; fail if it does not return within DEADLINE; re-raise its error."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = function()
        except BaseException as exc:  # pylint: disable=broad-except
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), "the save hangs"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _deep_json(path: Path) -> None:
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)


HOSTILE: dict[str, Callable[[Path], None]] = {
    "fifo": lambda p: os.mkfifo(p),
    "dev_zero_link": lambda p: os.symlink("/dev/zero", p),
    "directory": lambda p: p.mkdir(),
    "deep_json": _deep_json,
}
# Names the commit reads or deletes; {old} is the save id of the committed checkpoint being replaced.
NAMES = ["metadata.rank00001.json", "r00000_000.{old}.safetensors", "r00000_007.{old}.safetensors",
         ".metadata.json.{old}.partial", "metadata.json"]


@pytest.mark.parametrize("kind", sorted(HOSTILE))
@pytest.mark.parametrize("name", NAMES)
def test_hostile_entry_never_hangs_or_raises_raw(tmp_path: Path, name: str, kind: str) -> None:
    path = tmp_path / "ckpt"
    dcp.save(make_state(1), checkpoint_id=path, no_dist=True)
    old = dcp.read_metadata(path).storage_meta.save_id
    target = path / name.format(old=old)
    if target.exists():
        target.unlink()
    HOSTILE[kind](target)
    for seed in (2, 3):  # that save and a later one
        try:
            _within_deadline(lambda seed=seed: dcp.save(make_state(seed), checkpoint_id=path, no_dist=True))
        except dcp.CheckpointError as exc:
            # Only a directory where the metadata must go stops the commit: a clear error, nothing committed.
            assert (name, kind) == ("metadata.json", "directory"), repr(exc)
            assert "committing checkpoint" in str(exc) and str(path) in str(exc)
            with pytest.raises(dcp.IncompleteCheckpointError):
                load_into_blank(path, make_state(1))
            continue
        assert_same_state(load_into_blank(path, make_state(seed)), make_state(seed))


def test_cleanup_reads_only_a_regular_metadata_file_and_logs_the_rest(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "ckpt"
    dcp.save(make_state(1), checkpoint_id=path, no_dist=True)
    old = dcp.read_metadata(path).storage_meta.save_id
    (path / "metadata.json").unlink()
    os.mkfifo(path / "metadata.json")
    with caplog.at_level(logging.WARNING):
        _within_deadline(lambda: dcp.save(make_state(2), checkpoint_id=path, no_dist=True))
    assert "a FIFO, not a regular file" in caplog.text
    assert [n for n in os.listdir(path) if old in n], "files of an unreadable metadata are left alone"


# ------------------------------------------------------------------ the lease


def _write_lease(path: Path, **changes: Any) -> LeaseHolder:
    holder = LeaseHolder(host=socket.gethostname(), boot_id="", pid=os.getpid(), start_ticks=0,
                         save_id="0123456789ab", base_save_id="", acquired=time.time())
    holder = LeaseHolder(**{**holder.__dict__, **changes})
    (path / lease_name("metadata.json")).write_bytes(holder.to_bytes())
    return holder


def test_lease_of_a_dead_process_is_taken_over_and_its_files_deleted(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    dcp.save(make_state(1), checkpoint_id=path, no_dist=True)
    committed = dcp.read_metadata(path).storage_meta.save_id
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    # pylint: disable-next=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint._save_lease import _boot_id

    _write_lease(path, pid=int(dead.stdout), boot_id=_boot_id(), save_id="deadbeef0001", base_save_id=committed)
    (path / "r00000_000.deadbeef0001.safetensors").write_bytes(b"half")  # what the dead save wrote
    (path / ".metadata.json.deadbeef0001.partial").write_bytes(b"{")
    (path / "r00000_000.aaaaaaaaaaaa.safetensors").write_bytes(b"another save's")  # not ours to delete
    dcp.save(make_state(2), checkpoint_id=path, no_dist=True)
    assert_same_state(load_into_blank(path, make_state(2)), make_state(2))
    names = os.listdir(path)
    assert not [n for n in names if "deadbeef0001" in n or committed in n or n.endswith(".lease")], names
    assert "r00000_000.aaaaaaaaaaaa.safetensors" in names


def test_lease_of_another_host_is_live_until_its_timeout(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    dcp.save(make_state(1), checkpoint_id=path, no_dist=True)
    _write_lease(path, host="other-node", pid=1, save_id="0000000000aa")
    with pytest.raises(dcp.ConcurrentSaveError) as caught:
        dcp.save(make_state(2), checkpoint_id=path, no_dist=True)
    message = str(caught.value)
    assert "save id 0000000000aa, host other-node, pid 1" in message and "lease_timeout" not in message
    assert str(path / ".metadata.json.lease") in message and "300 s after its last heartbeat" in message
    assert live_lease_in(path) is not None
    old = time.time() - 400
    os.utime(path / ".metadata.json.lease", (old, old))  # no heartbeat for 400 s
    assert live_lease_in(path) is None
    dcp.save(make_state(2), checkpoint_id=path, no_dist=True)
    assert_same_state(load_into_blank(path, make_state(2)), make_state(2))
    assert_only_committed_files(path)
    _write_lease(path, host="other-node", pid=1, save_id="0000000000bb")
    writer = dcp.FileSystemWriter(path, lease_timeout=0.5)
    time.sleep(0.6)
    dcp.save(make_state(3), storage_writer=writer, no_dist=True)
    assert_same_state(load_into_blank(path, make_state(3)), make_state(3))


def test_unreadable_lease_and_a_lease_name_holding_a_directory(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    dcp.save(make_state(1), checkpoint_id=path, no_dist=True)
    (path / ".metadata.json.lease").write_bytes(b"\x00garbage")
    with pytest.raises(dcp.ConcurrentSaveError, match="unreadable"):
        dcp.save(make_state(2), checkpoint_id=path, no_dist=True)
    dcp.save(make_state(2), storage_writer=dcp.FileSystemWriter(path, lease_timeout=0), no_dist=True)
    (path / ".metadata.json.lease").mkdir()
    with pytest.raises(dcp.UnsafeCheckpointError, match="is a directory, not a lease file; remove it"):
        _within_deadline(lambda: dcp.save(make_state(3), checkpoint_id=path, no_dist=True))
    assert_same_state(load_into_blank(path, make_state(2)), make_state(2))


class _Interfering(dcp.FileSystemWriter):
    """Runs ``interfere`` once the data is written, right before the commit."""

    def __init__(self, path: Path, interfere: Callable[[Path], None]) -> None:
        super().__init__(path)
        self.interfere = interfere

    def finish(self, metadata: Any, results: Any, **kwargs: Any) -> Any:
        self.interfere(self.path)
        return super().finish(metadata, results, **kwargs)


def _steal_lease(path: Path) -> None:
    lease = path / ".metadata.json.lease"
    lease.unlink()
    _write_lease(path, host="other-node", pid=1, save_id="0000000000cc")


def _commit_behind_the_back(path: Path) -> None:
    meta = path / "metadata.json"
    copy = path / "copy.json"
    copy.write_bytes(meta.read_bytes())
    os.replace(copy, meta)  # the same bytes, committed again: another file


@pytest.mark.parametrize("interfere,expect", [(_steal_lease, "was removed or taken by another save"),
                                              (_commit_behind_the_back, "was committed by another save")])
def test_commit_checks_its_lease_and_the_committed_metadata(tmp_path: Path, interfere: Callable, expect: str) -> None:
    path = tmp_path / "ckpt"
    dcp.save(make_state(1), checkpoint_id=path, no_dist=True)
    time.sleep(0.01)
    with pytest.raises(dcp.ConcurrentSaveError, match=expect) as caught:
        dcp.save(make_state(2), storage_writer=_Interfering(path, interfere), no_dist=True)
    assert str(path) in str(caught.value) and "nothing" in str(caught.value)
    assert_same_state(load_into_blank(path, make_state(1)), make_state(1))
    saved = dcp.read_metadata(path).storage_meta.save_id
    assert not [n for n in os.listdir(path) if n.startswith("r") and saved not in n], "the loser's files stay"


def test_manager_retention_keeps_a_step_another_save_holds(tmp_path: Path) -> None:
    manager = dcp.CheckpointManager(tmp_path / "run", max_to_keep=1)
    manager.directory(1).mkdir(parents=True)
    lease, _ = SaveLease.acquire(manager.directory(1), "metadata.json", "0000000000dd")
    try:
        manager.save(2, make_state(2))
        assert manager.directory(1).is_dir(), "retention deleted a step being saved"
    finally:
        lease.release()
    manager.save(3, make_state(3))
    assert not manager.directory(1).exists() and manager.all_steps() == [3]


def test_failed_plan_leaves_no_directory(tmp_path: Path) -> None:
    with pytest.raises(dcp.UnsupportedTypeError):
        dcp.save({"x": object()}, checkpoint_id=tmp_path / "new", no_dist=True)
    assert not (tmp_path / "new").exists()
    dcp.save({"x": 1}, checkpoint_id=tmp_path / "new", no_dist=True)
    assert "metadata.json" in os.listdir(tmp_path / "new")


def test_rank_local_saves_of_two_ranks_share_a_directory(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    writers = []
    for rank in (0, 1):
        writer = dcp.FileSystemWriter(path)
        writers.append(writer)
    results: list[Any] = [None, None]

    def save(rank: int, seed: int) -> None:
        writer = writers[rank]
        writer.set_up_storage_writer(True, rank=rank, rank_local=True)
        planner = dcp.StandardSavePlanner()
        planner.configure_planner(make_state(seed), rank=0, world_size=1, is_coordinator=True)
        plans, metadata = planner.build_global_plan([writer.prepare_local_plan(planner.build_local_plan())])
        plan = planner.finalize_plan(writer.prepare_global_plan(plans)[0])
        results[rank] = writer.finish(metadata, [writer.write_data(plan, planner).result()])

    for seed in (1, 2):
        threads = [threading.Thread(target=save, args=(rank, seed + 10 * rank)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE)
    names = os.listdir(path)
    for rank in (0, 1):
        meta = json.loads((path / f"metadata.rank0000{rank}.json").read_text())
        assert {e["file"] for e in meta["storage_data"]} <= set(names)
        assert meta["save_id"] == results[rank].storage_meta.save_id
    assert not [n for n in names if n.endswith(".lease")]


def test_an_empty_lease_of_a_save_that_died_creating_it_is_stale_after_the_grace(tmp_path: Path) -> None:
    """A save killed between creating its lease and writing it leaves an empty lease: a restarted job waited
    the whole lease timeout (300 s) before it could save to that id. It now waits two heartbeats (75 s): a live
    lease it cannot parse (another version's) is never older than one heartbeat."""
    assert unreadable_grace(300.0) == 75.0 and unreadable_grace(20.0) == 20.0 and unreadable_grace(120.0) == 30.0
    path = tmp_path / "ckpt"
    dcp.save(make_state(1), checkpoint_id=path, no_dist=True)
    lease = path / ".metadata.json.lease"
    lease.write_bytes(b"")
    aged = time.time() - 70  # a live other-version lease between two heartbeats (37.5 s apart) is younger
    os.utime(lease, (aged, aged))
    with pytest.raises(dcp.ConcurrentSaveError, match=r"unreadable, 70 s old\): a save that died .* stale 75 s"):
        dcp.save(make_state(2), checkpoint_id=path, no_dist=True)
    assert_same_state(load_into_blank(path, make_state(1)), make_state(1))
    aged = time.time() - 76
    os.utime(lease, (aged, aged))
    dcp.save(make_state(2), checkpoint_id=path, no_dist=True)
    assert not lease.exists()
    assert_same_state(load_into_blank(path, make_state(2)), make_state(2))
