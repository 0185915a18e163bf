"""The indexed metadata form (format 2.1): grid tensors, per-rank storage index files, lazy lookups."""

from __future__ import annotations

import json
import os

import mindspore as ms
import numpy as np
import pytest
from safetensors.numpy import load_file

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint._format.indexed_storage import IndexedStorage
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointValueError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from sim_ranks import simulate_save

FULL = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
BIAS = np.arange(8, dtype=np.float32) * 0.5


def _states(layout: Layout, ranks: int) -> list[dict]:
    return [{"w": DTensor.from_global(ms.Tensor(FULL), layout, rank=r),
             "b": DTensor.from_global(ms.Tensor(BIAS), Layout((ranks,), (0,)), rank=r),
             "step": 7} for r in range(ranks)]


def _save(path, layout=Layout((2, 2), (1, 0)), ranks=4, form="indexed"):
    return simulate_save(_states(layout, ranks), path, writer_options={"metadata_form": form})


def _load(path, layout, ranks, *, verify=True):
    out = []
    for rank in range(ranks):
        param = ms.Parameter(ms.Tensor(np.zeros(layout.local_shape(FULL.shape), np.float32)), name="w")
        target = DTensor(param, layout, FULL.shape, rank=rank)
        dcp.load({"w": target}, checkpoint_id=path, no_dist=True,
                 storage_reader=dcp.FileSystemReader(path, verify_checksums=verify))
        out.append((target.global_offset, param.asnumpy()))
    return out


def _check(out):
    for offset, local in out:
        rows, cols = local.shape
        assert np.array_equal(local, FULL[offset[0]:offset[0] + rows, offset[1]:offset[1] + cols])


def test_indexed_round_trip_and_reshard(tmp_path):
    path = tmp_path / "c"
    committed, _ = _save(path)
    document = json.loads((path / "metadata.json").read_bytes())
    assert document["version"] == "2.1"
    assert "grid" in document["state_dict_metadata"]["w"] and "chunks" not in document["state_dict_metadata"]["w"]
    assert document["state_dict_metadata"]["w"]["grid"]["splits"] == [2, 2]
    assert {e["fqn"] for e in document["storage_data"]} == {"step"}  # grid tensors' entries are in the indexes
    names = sorted(n for n in os.listdir(path) if "_index." in n)
    assert [r["file"] for r in document["rank_indexes"]] == names and len(names) == 4
    assert isinstance(committed.storage_data, IndexedStorage)
    _check(_load(path, Layout((2, 2), (1, 0)), 4))  # each rank its own shard
    _check(_load(path, Layout((2,), (-1, 0)), 2))  # reshard: column split
    _check(_load(path, Layout((3,), (-1, 0)), 3))  # reshard: chunks cut in parts
    whole = {"w": np.zeros_like(FULL), "b": np.zeros_like(BIAS), "step": 0}
    dcp.load(whole, checkpoint_id=path, no_dist=True)
    assert np.array_equal(whole["w"], FULL) and np.array_equal(whole["b"], BIAS) and whole["step"] == 7
    metadata = dcp.read_metadata(path)
    assert len(metadata.storage_data) == 4 + 4 + 1
    assert sorted((i.fqn, i.offset) for i in metadata.storage_data)[:2] == [("b", (0,)), ("b", (2,))]


def test_data_files_open_with_safetensors(tmp_path):
    path = tmp_path / "c"
    _save(path)
    pieces = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            pieces.update(load_file(str(path / name)))
    assert sum(v.size for k, v in pieces.items() if k.startswith("w")) == FULL.size


def test_small_save_stays_inline(tmp_path):
    path = tmp_path / "c"
    _save(path, form="auto")
    document = json.loads((path / "metadata.json").read_bytes())
    assert "rank_indexes" not in document and "chunks" in document["state_dict_metadata"]["w"]
    assert not [n for n in os.listdir(path) if "_index." in n]
    _check(_load(path, Layout((2,), (0, -1)), 2))


def test_bad_form_refused(tmp_path):
    with pytest.raises(CheckpointValueError, match="metadata_form"):
        dcp.FileSystemWriter(tmp_path, metadata_form="compact")
