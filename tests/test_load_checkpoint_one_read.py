"""``load_checkpoint(path, net)`` reads the metadata once: the dtype check and the load see the same save."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp


class _SaveLandsFirst(dcp.FileSystemReader):
    """Before its first metadata read, another save of int32 weights commits to the same checkpoint id."""

    def __init__(self, path, replacement) -> None:
        super().__init__(path)
        self.replacement = replacement
        self.save_ids: list[str] = []

    def read_metadata(self, *, rank=None):
        if not self.save_ids:
            dcp.save(self.replacement, checkpoint_id=self.path, no_dist=True)
        metadata = super().read_metadata(rank=rank)
        self.save_ids.append(metadata.storage_meta.save_id)
        return metadata


def _net_weight(values) -> ms.Parameter:
    return ms.Parameter(ms.Tensor(np.asarray(values, np.float32)), name="w")


def test_a_save_landing_before_the_metadata_read_is_checked_for_dtype(tmp_path):
    path = tmp_path / "c"
    dcp.save({"w": _net_weight([1.5, 2.5])}, checkpoint_id=path, no_dist=True)
    reader = _SaveLandsFirst(path, {"w": ms.Tensor(np.array([7, 8], np.int32))})
    net = {"w": _net_weight([0, 0])}
    with pytest.raises(dcp.CheckpointValueError, match="'w'.*int32"):
        hyper_parallel.load_checkpoint(path, net, storage_reader=reader, no_dist=True)
    assert len(reader.save_ids) == 1, reader.save_ids  # one read: the check and the load used the same save
    assert np.array_equal(net["w"].asnumpy(), [0, 0]), "nothing of the unchecked save was loaded"


def test_the_metadata_is_read_once_and_the_save_it_names_is_loaded(tmp_path):
    path = tmp_path / "c"
    dcp.save({"w": _net_weight([1.5, 2.5])}, checkpoint_id=path, no_dist=True)
    reader = _SaveLandsFirst(path, {"w": _net_weight([4.0, 5.0])})
    net = {"w": _net_weight([0, 0])}
    loaded = hyper_parallel.load_checkpoint(path, net, storage_reader=reader, no_dist=True)
    assert np.array_equal(net["w"].asnumpy(), [4.0, 5.0]) and loaded["w"] is net["w"]
    assert reader.save_ids == [dcp.read_metadata(path).storage_meta.save_id]
    whole = _SaveLandsFirst(path, {"w": _net_weight([6.0, 7.0])})
    assert np.array_equal(hyper_parallel.load_checkpoint(path, storage_reader=whole, no_dist=True)["w"].asnumpy(),
                          [6.0, 7.0])
    assert len(whole.save_ids) == 1


def test_an_unknown_keyword_is_refused_before_reading(tmp_path):
    refused = r"load_checkpoint\(\): unexpected keyword argument\(s\) 'reader'; it takes .*storage_reader"
    with pytest.raises(TypeError, match=refused):
        hyper_parallel.load_checkpoint(tmp_path / "missing", reader=None)
