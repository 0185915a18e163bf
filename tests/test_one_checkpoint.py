"""Every rank of a collective save or load names one checkpoint: how locations are compared.

The coordinator's check runs here on messages built by ``sent_with_location`` as each simulated rank would
build them (its own working directory, its own storage object); the real collective runs are in
test_save_kinds_race.
"""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._fsspec_writer import FsspecWriter
from hyper_parallel.core.distributed_checkpoint._one_checkpoint import (
    one_save_read,
    same_save_location,
    sent_with_location,
)


def _message(storage, part):
    return sent_with_location(storage, lambda: part)()


def test_an_object_store_path_is_compared_as_written_not_against_the_cwd(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    memory = fsspec.filesystem("memory")
    messages = []
    for rank in (0, 1):
        (tmp_path / str(rank)).mkdir()
        monkeypatch.chdir(tmp_path / str(rank))  # each rank's own working directory
        messages.append(_message(FsspecWriter("bucket/ckpt", filesystem=memory), rank))
    assert [location for location, _ in messages] == ["bucket/ckpt", "bucket/ckpt"]
    assert same_save_location(lambda parts: parts)(messages) == [0, 1]


def test_a_symlinked_directory_is_not_resolved(tmp_path: Path) -> None:
    """One path may resolve differently on two hosts (a symlink on one, a mount on the other): compare it as
    written, made absolute."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    location, _ = _message(dcp.FileSystemWriter(tmp_path / "link"), None)
    assert location == str(tmp_path / "link")


def test_a_save_to_two_places_is_refused_naming_them(tmp_path: Path) -> None:
    messages = [_message(dcp.FileSystemWriter(tmp_path / f"r{rank}"), rank) for rank in (0, 1)]
    with pytest.raises(dcp.CheckpointValueError, match=r"name 2 different checkpoints \(ranks \[0\] to .*r0; "
                                                       r"ranks \[1\] to .*r1\).*the same checkpoint_id"):
        same_save_location(lambda parts: parts)(messages)


def test_copies_of_one_save_at_two_places_load_but_two_saves_are_refused(tmp_path: Path) -> None:
    """Ranks may read their own copy of one save (staged to node-local disks): one checkpoint. Two saves are
    refused naming each rank's path."""
    readers = [dcp.FileSystemReader(tmp_path / f"node{rank}") for rank in (0, 1)]
    assert one_save_read([_message(reader, "abc") for reader in readers]) == [None, None]
    with pytest.raises(dcp.CheckpointValueError, match=r"ranks \[0\] to .*node0; ranks \[1\] to .*node1"):
        one_save_read([_message(reader, save_id) for reader, save_id in zip(readers, ("abc", "def"))])
    with pytest.raises(dcp.CheckpointNotFoundError) as replaced:  # one place holding two saves in turn
        one_save_read([_message(readers[0], save_id) for save_id in ("abc", "def", "abc")])
    assert "replaced by another save while the ranks read its metadata (save abc on ranks [0, 2]; save def on " \
           "ranks [1])" in str(replaced.value)


def test_a_refusal_names_eight_locations_and_counts_the_others(tmp_path: Path) -> None:
    messages = [_message(dcp.FileSystemWriter(tmp_path / f"r{rank}"), rank) for rank in range(11)]
    with pytest.raises(dcp.CheckpointValueError) as refused:
        same_save_location(lambda parts: parts)(messages)
    text = str(refused.value)
    assert "name 11 different checkpoints" in text and "ranks [7] to " in text and "ranks [8] to " not in text
    assert "; and 3 more): " in text, text
