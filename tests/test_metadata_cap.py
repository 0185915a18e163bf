"""A save never commits metadata larger than every reader accepts (``MAX_METADATA_BYTES``).

A metadata file over the cap would commit a checkpoint that no load can read. The cap is lowered in
these tests (the real one is 1 GiB) so that a few hundred keys cross it.
"""

from __future__ import annotations

import os

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import filesystem_reader
from hyper_parallel.core.distributed_checkpoint._format import metadata_json
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError

ms.set_device("CPU")


def _state(keys: int, base: float) -> dict:
    return {f"p{i}": ms.Parameter(ms.Tensor(np.full((4,), base + i, np.float32)), name=f"p{i}") for i in range(keys)}


def _metadata_size(path) -> int:
    return os.path.getsize(path / "metadata.json")


def _assert_values(path, keys: int, base: float) -> None:
    target = _state(keys, -1.0)
    dcp.load(target, checkpoint_id=path, no_dist=True)
    for i in range(keys):
        np.testing.assert_array_equal(target[f"p{i}"].asnumpy(), np.full((4,), base + i, np.float32))


def test_the_reader_and_the_writer_share_one_cap():
    assert filesystem_reader.MAX_METADATA_BYTES is metadata_json.MAX_METADATA_BYTES
    assert metadata_json.MAX_METADATA_BYTES == 1 << 30


@pytest.mark.parametrize("use_async", [False, True])
def test_an_oversized_metadata_is_refused_and_the_committed_checkpoint_kept(tmp_path, monkeypatch, use_async):
    path = tmp_path / "ckpt"
    dcp.save(_state(3, 1.0), checkpoint_id=path, no_dist=True)
    small = _metadata_size(path)
    small_id = dcp.read_metadata(path).storage_meta.save_id
    monkeypatch.setattr(metadata_json, "MAX_METADATA_BYTES", small * 4)

    with pytest.raises(CheckpointValueError) as caught:
        if use_async:
            dcp.async_save(_state(300, 5.0), checkpoint_id=path, no_dist=True).result()
        else:
            dcp.save(_state(300, 5.0), checkpoint_id=path, no_dist=True)
    message = str(caught.value)
    assert str(path / "metadata.json") in message
    assert "MAX_METADATA_BYTES" in message and "300 keys" in message and "not committed" in message

    # The checkpoint committed before is untouched and loads; no data file of the refused save is left.
    assert dcp.read_metadata(path).storage_meta.save_id == small_id
    _assert_values(path, 3, 1.0)
    data_files = sorted(p.name for p in path.glob("*.safetensors"))
    assert data_files and all(small_id in name for name in data_files), data_files

    # Under the cap the next save to the same id commits (the refused save holds nothing).
    monkeypatch.setattr(metadata_json, "MAX_METADATA_BYTES", 1 << 30)
    dcp.save(_state(300, 7.0), checkpoint_id=path, no_dist=True)
    _assert_values(path, 300, 7.0)


def test_an_oversized_object_store_metadata_is_refused(tmp_path, monkeypatch):
    fsspec = pytest.importorskip("fsspec")
    path = "memory://hp-ckpt-cap/ckpt"
    dcp.save(_state(3, 1.0), storage_writer=dcp.FsspecWriter(path), no_dist=True)
    monkeypatch.setattr(metadata_json, "MAX_METADATA_BYTES", 2048)
    fs = fsspec.filesystem("memory")
    before = set(fs.find(path))
    with pytest.raises(CheckpointValueError, match="MAX_METADATA_BYTES"):
        dcp.save(_state(300, 5.0), storage_writer=dcp.FsspecWriter(path), no_dist=True)
    assert set(fs.find(path)) == before  # the refused save's data objects are removed
    target = _state(3, -1.0)
    dcp.load(target, storage_reader=dcp.FsspecReader(path), no_dist=True)
    np.testing.assert_array_equal(target["p2"].asnumpy(), np.full((4,), 3.0, np.float32))
