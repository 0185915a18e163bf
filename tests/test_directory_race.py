"""A save whose directory another rank's abort removes between its creation and the save lease.

A save that fails while planning removes the checkpoint directory on every rank that created it, if still
empty (``FileSystemWriter.abort``). In a job of several ranks, the coordinator can already be setting up the
next save of that id: it found (or made) the directory, then the slower rank's ``rmdir`` ran, and taking the
lease failed with "cannot create the save lease ...: No such file or directory" (seen in
test_background_commit under load). The removal is a real ``rmdir`` at exactly that moment here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointIOError


class DirectoryRemovedBeforeLease(dcp.FileSystemWriter):
    """Removes its (empty) directory just before the first ``removals`` lease attempts, as another rank's abort."""

    def __init__(self, path: Path, *, removals: int) -> None:
        super().__init__(path)
        self.removals = removals
        self.removed = 0

    def _take_lease(self) -> None:
        if self.removed < self.removals:
            self.removed += 1
            self.path.rmdir()
        super()._take_lease()


@pytest.mark.parametrize("existed", [False, True], ids=["made_by_this_save", "made_by_another_rank"])
def test_a_save_makes_its_directory_again_when_another_rank_s_abort_removed_it(tmp_path: Path, existed: bool) -> None:
    path = tmp_path / "c"
    if existed:
        path.mkdir()
    writer = DirectoryRemovedBeforeLease(path, removals=1)
    dcp.save({"w": np.arange(6, dtype=np.float32)}, storage_writer=writer, no_dist=True)
    assert writer.removed == 1
    target = {"w": np.zeros(6, dtype=np.float32)}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    np.testing.assert_array_equal(target["w"], np.arange(6, dtype=np.float32))


def test_a_directory_removed_at_every_attempt_fails_naming_the_lease(tmp_path: Path) -> None:
    path = tmp_path / "c"
    writer = DirectoryRemovedBeforeLease(path, removals=10)
    with pytest.raises(CheckpointIOError, match=r"cannot create the save lease .*\.lease"):
        dcp.save({"w": np.ones(2, dtype=np.float32)}, storage_writer=writer, no_dist=True)
    assert writer.removed == 3
    assert not (path / "metadata.json").exists()
