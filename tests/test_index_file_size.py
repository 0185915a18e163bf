"""A rank index file larger than its record says is refused without reading it whole (filesystem and S3)."""

from __future__ import annotations

import json
import tracemalloc

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from s3_server import new_filesystem, s3_endpoint, s3_url  # noqa: F401  (fixtures)
from sim_ranks import simulate_save

FULL = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)


def _states(ranks: int) -> list[dict]:
    return [{"w": DTensor.from_global(ms.Tensor(FULL), Layout((ranks,), (0, -1)), rank=r), "step": 4}
            for r in range(ranks)]


def _refused_lean(checkpoint_id, index_name: str, *, max_peak: int | None) -> None:
    """The load refuses the index naming it and the fix, changes no target, and allocates at most ``max_peak``
    (unless ``None``)."""
    target = {"w": np.zeros_like(FULL), "step": 0}
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=f"{index_name}: the index file of rank 1 does not match "
                                                         "its length and digest recorded in"):
            dcp.load(target, checkpoint_id=checkpoint_id, no_dist=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not target["w"].any() and target["step"] == 0
    assert max_peak is None or peak < max_peak, f"refusing a grown index file allocated {peak:,} bytes"


def _loads_whole(checkpoint) -> None:
    """The checkpoint (its index restored) loads the whole state again."""
    whole = {"w": np.zeros_like(FULL), "step": 0}
    dcp.load(whole, checkpoint_id=checkpoint, no_dist=True)
    assert np.array_equal(whole["w"], FULL) and whole["step"] == 4


def test_a_grown_index_file_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "c"
    simulate_save(_states(4), path, writer_options={"metadata_form": "indexed"})
    record = json.loads((path / "metadata.json").read_bytes())["rank_indexes"][1]
    name = record["file"]
    with open(path / name, "r+b") as handle:  # its recorded bytes, then 512 MiB more (sparse: no disk used)
        handle.truncate(512 << 20)
    _refused_lean(path, name, max_peak=8 << 20)  # the file is 512 MiB
    with open(path / name, "r+b") as handle:  # back to its recorded bytes: the checkpoint loads again
        handle.truncate(record["length"])
    _loads_whole(path)


def test_a_grown_index_object_is_refused_without_reading_it(s3_url):  # noqa: F811
    simulate_save(_states(2), s3_url, writer_options={"metadata_form": "indexed"}, writer_class=dcp.FsspecWriter)
    fs = new_filesystem()
    root = s3_url[len("s3://"):]
    record = json.loads(fs.cat_file(f"{root}/metadata.json"))["rank_indexes"][1]
    name = record["file"]
    original = fs.cat_file(f"{root}/{name}")
    grown = 64 << 20
    fs.pipe_file(f"{root}/{name}", original + b" " * grown)
    # The S3 server of the tests runs in this process: its own copy of the object is counted (once); a reader
    # fetching the whole object would add a second.
    _refused_lean(s3_url, name, max_peak=grown * 7 // 5)
    fs.pipe_file(f"{root}/{name}", original)
    _loads_whole(s3_url)


def test_an_emptied_index_object_is_named_damaged_not_unreachable(s3_url):  # noqa: F811
    """A ranged GET of an empty object is refused by S3 (range not satisfiable): still a damaged index."""
    simulate_save(_states(2), s3_url, writer_options={"metadata_form": "indexed"}, writer_class=dcp.FsspecWriter)
    fs = new_filesystem()
    root = s3_url[len("s3://"):]
    name = json.loads(fs.cat_file(f"{root}/metadata.json"))["rank_indexes"][1]["file"]
    fs.pipe_file(f"{root}/{name}", b"")
    _refused_lean(s3_url, name, max_peak=None)  # CorruptCheckpointError, not CheckpointIOError (store unreachable)
