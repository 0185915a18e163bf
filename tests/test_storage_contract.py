"""The storage contract (tests/storage_contract.py) run against every backend in this repository."""

from __future__ import annotations

from pathlib import Path

import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import strategies
from memory_storage import BACKEND, MemoryReader, MemoryStore, MemoryWriter, register_memory_backend
from storage_contract import StorageContract


class TestFileSystemStorage(StorageContract):
    backend = "filesystem"

    def make_id(self, name):
        return self.tmp_path / name

    def make_writer(self, checkpoint_id):
        return dcp.FileSystemWriter(checkpoint_id)

    def make_reader(self, checkpoint_id):
        return dcp.FileSystemReader(checkpoint_id)

    def corrupt(self, checkpoint_id, info):
        with open(Path(checkpoint_id) / info.relative_path, "r+b") as handle:
            handle.seek(info.offset)
            byte = handle.read(1)
            handle.seek(info.offset)
            handle.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="class")
def memory_backend():
    before = set(strategies.registered_strategies())
    register_memory_backend()
    yield
    for key in set(strategies.registered_strategies()) - before:
        strategies._REGISTRY.pop(key)  # pylint: disable=protected-access


@pytest.mark.usefixtures("memory_backend")
class TestMemoryStorage(StorageContract):
    backend = BACKEND

    @pytest.fixture(autouse=True)
    def _store(self):
        self.store = MemoryStore()

    def make_id(self, name):
        return f"memory://{name}"

    def make_writer(self, checkpoint_id):
        return MemoryWriter(checkpoint_id, store=self.store)

    def make_reader(self, checkpoint_id):
        return MemoryReader(checkpoint_id, store=self.store)

    def corrupt(self, checkpoint_id, info):
        data = bytearray(self.store.objects[info.relative_path])
        data[info.offset] ^= 0xFF
        self.store.objects[info.relative_path] = bytes(data)


def test_memory_backend_is_unknown_until_registered(tmp_path):
    store = MemoryStore()
    dcp.save({"a": [1, 2]}, storage_writer=MemoryWriter("memory://x", store=store), no_dist=True)
    with pytest.raises(dcp.UnsupportedFormatError, match="backend 'memory'"):
        dcp.load({"a": [0, 0]}, storage_reader=MemoryReader("memory://x", store=store), no_dist=True)


def test_storage_is_picked_from_the_checkpoint_id_or_reset_to_it(tmp_path):
    with pytest.raises(dcp.CheckpointValueError, match="needs a checkpoint_id"):
        dcp.save({"a": 1}, no_dist=True)
    with pytest.raises(dcp.CheckpointValueError, match="storage_reader"):
        dcp.load({"a": 0}, checkpoint_id=12345, no_dist=True)
    store = MemoryStore()
    dcp.save({"a": 7}, storage_writer=MemoryWriter("memory://first", store=store), checkpoint_id="memory://second",
             no_dist=True)
    assert not store.has_prefix("first/") and store.has_prefix("second/")
    assert MemoryReader("memory://second", store=store).read_metadata().storage_meta.backend == BACKEND
