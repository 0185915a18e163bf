"""Indexed metadata of an S3 checkpoint pickles bound to its index objects, as a directory's does.

The metadata a save returns reaches every rank but the coordinator pickled; on S3 its copy could not read
a single index (CheckpointValueError), and neither could a pickled ``read_metadata`` result.
"""

from __future__ import annotations

import pickle

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointNotFoundError
from s3_server import new_filesystem, s3_endpoint, s3_url  # noqa: F401  (fixtures)
from sim_ranks import simulate_save

FULL = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)


def _save(url: str, ranks: int) -> dcp.Metadata:
    states = [{"w": DTensor.from_global(ms.Tensor(FULL), Layout((ranks,), (0, -1)), rank=r), "step": 9}
              for r in range(ranks)]
    committed, _ = simulate_save(states, url, writer_options={"metadata_form": "indexed"},
                                 writer_class=dcp.FsspecWriter)
    return committed


def _entries(metadata: dcp.Metadata) -> dict:
    return {(index.fqn, index.offset): (info.relative_path, info.offset, info.length)
            for index, info in metadata.storage_data.items()}


def test_s3_indexed_metadata_pickles_bound_to_its_index_objects(s3_url):  # noqa: F811
    committed = _save(s3_url, 4)
    expected = _entries(dcp.read_metadata(s3_url))
    assert sorted(expected)[:4] == [("step", ()), ("w", (0, 0)), ("w", (2, 0)), ("w", (4, 0))]
    received = pickle.loads(pickle.dumps(committed))  # what every other rank of the save receives
    assert _entries(received) == expected
    read = pickle.loads(pickle.dumps(dcp.read_metadata(s3_url)))
    info = read.storage_data[dcp.MetadataIndex("w", (6, 0))]
    assert (info.relative_path, info.offset, info.length) == expected[("w", (6, 0))]
    stale = pickle.loads(pickle.dumps(dcp.read_metadata(s3_url)))
    _save(s3_url, 2)  # another save replaces the checkpoint: its commit removes the old index objects
    with pytest.raises(CheckpointNotFoundError, match="deleted or replaced by another save while loading"):
        stale.storage_data[dcp.MetadataIndex("w", (0, 0))]
    whole = {"w": np.zeros_like(FULL), "step": 0}
    dcp.load(whole, checkpoint_id=s3_url, no_dist=True)
    assert np.array_equal(whole["w"], FULL) and whole["step"] == 9
