"""One data file of a save: layout in one pass, checksums as the general path computes them, early writeback."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import mindspore
import numpy as np
import pytest
from safetensors.numpy import load_file

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._data_file import (
    WRITEBACK_BYTES,
    CoalescingWriter,
    LocalDataFile,
    StoredShape,
    byte_view,
    lay_out,
    write_hashed,
)
from hyper_parallel.core.distributed_checkpoint._file_ops import FileOps
from hyper_parallel.core.distributed_checkpoint._format.checksum import RUN_BYTES, chunk_checksum
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import read_header
from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from hyper_parallel.core.distributed_checkpoint.planner import BytesWriteData, TensorWriteData, WriteItem, WriteItemType
from hyper_parallel.platform.dtypes import DTYPE_NAMES


class CountingFileOps(FileOps):
    """The operating system's file operations, noting early-writeback requests and page drops (each really made)."""

    def __init__(self) -> None:
        self.writebacks: list[tuple[int, int]] = []
        self.drops: list[tuple[int, str]] = []

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        super().start_writeback(fd, offset, length)
        self.writebacks.append((offset, length))

    def drop_cache(self, fd: int) -> None:
        super().drop_cache(fd)
        self.drops.append((os.fstat(fd).st_size, threading.current_thread().name))


def _tensor_item(name: str, array: np.ndarray, dtype: str, offset: tuple[int, ...] = ()) -> WriteItem:
    sizes = tuple(array.shape)
    return WriteItem(
        index=MetadataIndex(name, offset or (0,) * len(sizes)),
        type=WriteItemType.SHARD if offset else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offset or (0,) * len(sizes), sizes=sizes),
                                    properties=TensorProperties(dtype=dtype), size=sizes),
    )


def _write_file(path: Path, layout_header: bytes, views: list[memoryview], shapes: list, *, block: int,
                tiles: bool) -> list:
    """Write a data file as the writer does (header, then every item hashed and written run by run)."""
    sink = LocalDataFile(path, FileOps(), sync=False, drop_page_cache=False)
    out = CoalescingWriter(sink)
    out.write(memoryview(layout_header))
    checksums = [write_hashed(out, view, shape, block_bytes=block, tiles=tiles) for view, shape in zip(views, shapes)]
    out.flush()
    sink.commit()
    return checksums


def test_layout_and_checksums_match_the_general_path_for_every_kind_of_item(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "vector": rng.random(1000, dtype=np.float32),  # 1-D, one flat block
        "narrow": rng.random((8, 16), dtype=np.float32),  # 2-D too narrow for column tiles: one flat block
        "wide": rng.random((4, 2048), dtype=np.float32),  # 2-D small but wide: tiles
        "big": rng.random(300_000, dtype=np.float32),  # several flat blocks at block_bytes=64 KiB, 2 runs
        "slabs": rng.random((600, 1024), dtype=np.float32),  # tiles in 10 row slabs
        "empty": np.zeros(0, np.float32),
        "__metadata__": rng.random(3, dtype=np.float32),  # the reserved safetensors key
    }
    items = [_tensor_item(name, array, "float32") for name, array in arrays.items()]
    items.append(_tensor_item("vector", arrays["vector"], "float32", offset=(1000,)))  # a shard of the same key
    payload = b"pickled value"
    items.append(WriteItem(index=MetadataIndex("value"), type=WriteItemType.BYTE_IO,
                           bytes_io_data=BytesWriteData(type_name="str", nbytes=len(payload), digest="",
                                                        global_shape=())))
    views = [byte_view(a) for a in arrays.values()] + [byte_view(arrays["vector"]), byte_view(payload)]
    block = 64 << 10
    layout = lay_out(tuple(items), [len(view) for view in views], file_metadata={"save_id": "x"}, align=4096,
                     stored_as_bytes=False)
    path = tmp_path / "f.safetensors"
    checksums = _write_file(path, layout.header, views, layout.shapes, block=block, tiles=True)
    for item, view, checksum in zip(items, views, checksums):
        data = item.tensor_data
        expected = chunk_checksum(view, block, sizes=data.chunk.sizes if data else None,
                                  itemsize=DTYPE_NAMES[data.properties.dtype] if data else 1, tiles=True)
        assert checksum == expected, item.index.fqn
    assert checksums[2].block_shape and len(checksums[3].digests) == 19
    assert checksums[4].block_shape == (64, 256) and len(checksums[4].flat_digests) == 38
    # The header and offsets make a file any safetensors reader opens, names kept unique; the bytes as written.
    assert path.read_bytes() == layout.header + b"".join(bytes(v) for v in views)
    header, data_start = read_header(path)
    assert data_start == len(layout.header) and data_start % 4096 == 0
    assert layout.offsets == sorted(layout.offsets) and layout.offsets[0] == data_start
    loaded = load_file(str(path))
    assert set(loaded) == {"vector", "narrow", "wide", "big", "slabs", "empty", "__metadata__#", "vector@1000",
                           "value"}
    for name in ("narrow", "wide", "big", "slabs"):
        np.testing.assert_array_equal(loaded[name], arrays[name])
    np.testing.assert_array_equal(loaded["__metadata__#"], arrays["__metadata__"])
    assert loaded["value"].tobytes() == payload
    # Stored as bytes (compressed): every item a flat uint8 entry.
    flat = lay_out(tuple(items), [len(view) for view in views], file_metadata={}, align=8, stored_as_bytes=True)
    assert flat.shapes == [None] * len(items)
    flat_sums = _write_file(tmp_path / "g", flat.header, views, flat.shapes, block=block, tiles=True)
    assert not any(c.block_shape for c in flat_sums)
    assert flat_sums[3] == chunk_checksum(views[3], block) and flat_sums[4] == chunk_checksum(views[4], block)


class ChangingSource(LocalDataFile):
    """A real data file whose source array changes after each write: every byte not yet written is incremented."""

    def __init__(self, path: Path, source: np.ndarray) -> None:
        super().__init__(path, FileOps(), sync=False, drop_page_cache=False)
        self.source = source
        self.writes: list[int] = []

    def write(self, view: memoryview) -> None:
        super().write(view)
        self.writes.append(len(view))
        written = sum(self.writes)
        self.source[written:] += 1


@pytest.mark.parametrize("shape", [(5 << 20,), (256, 8192)], ids=["flat", "tiles"])
def test_each_run_is_hashed_just_before_it_is_written(tmp_path: Path, shape: tuple[int, ...]) -> None:
    """The checksums describe the bytes as each run was written: a run is hashed when its turn comes, not all
    first (an import's memory-mapped source larger than the page cache is then read once, not twice)."""
    source = np.zeros(shape, np.uint8)
    sink = ChangingSource(tmp_path / "f", source.reshape(-1))
    shape_info = StoredShape(sizes=shape, itemsize=1) if len(shape) > 1 else None
    checksum = write_hashed(CoalescingWriter(sink), byte_view(source), shape_info, block_bytes=64 << 10, tiles=True)
    sink.commit()
    written = np.fromfile(tmp_path / "f", np.uint8)
    # Runs of RUN_BYTES (flat) or of one row slab of tiles (256 rows x 8192 bytes at 64 KiB blocks: 64 rows).
    assert sink.writes == ([RUN_BYTES] * 5 if len(shape) == 1 else [64 * 8192] * 4)
    assert written.max() == len(sink.writes) - 1  # the source did change between runs
    assert checksum == chunk_checksum(memoryview(written), 64 << 10, sizes=shape, itemsize=1, tiles=True)


@pytest.mark.parametrize("sync", [True, False])
def test_a_synced_file_asks_for_writeback_as_it_grows(tmp_path: Path, sync: bool) -> None:
    ops = CountingFileOps()
    sink = LocalDataFile(tmp_path / "f", ops, sync=sync, drop_page_cache=True)
    out = CoalescingWriter(sink)
    pieces = [np.full(WRITEBACK_BYTES // 3, i, np.uint8) for i in range(7)] + [np.full(100, 9, np.uint8)] * 50
    pieces.append(np.full(WRITEBACK_BYTES * 5 // 2, 7, np.uint8))  # one large item: sent on in steps as it is written
    for piece in pieces:
        out.write(memoryview(piece))
    out.flush()
    sink.commit()
    data = np.fromfile(tmp_path / "f", np.uint8)
    np.testing.assert_array_equal(data, np.concatenate(pieces))
    if not sync:
        assert ops.writebacks == []
        return
    # Consecutive ranges from 0, each at least WRITEBACK_BYTES, never past what was written, and at most
    # WRITEBACK_BYTES left for the fsync (the large item too was sent on as it was written).
    assert len(ops.writebacks) == 4
    position = 0
    for offset, length in ops.writebacks:
        assert offset == position and WRITEBACK_BYTES <= length < 2 * WRITEBACK_BYTES
        position += length
    assert data.size - WRITEBACK_BYTES < position <= data.size


def test_writeback_request_on_a_pipe_is_harmless() -> None:
    read_end, write_end = os.pipe()
    try:
        FileOps().start_writeback(write_end, 0, 1 << 20)  # the kernel refuses (ESPIPE): no early writeback, no error
    finally:
        os.close(read_end)
        os.close(write_end)


def test_save_of_many_parameters_reads_back_bit_exact_with_writeback(tmp_path: Path) -> None:
    """A save larger than the writeback step, on 2 files, with small and large Parameters of both dtypes."""
    rng = np.random.default_rng(1)
    state = {}
    for i in range(300):
        values = rng.random(4096 if i % 50 else (WRITEBACK_BYTES // 4 + 1000), dtype=np.float32)
        tensor = mindspore.Tensor(values, mindspore.bfloat16) if i % 2 else mindspore.Tensor(values)
        state[f"p{i}"] = mindspore.Parameter(tensor, name=f"p{i}")
    ops = CountingFileOps()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "c", thread_count=2, file_ops=ops), no_dist=True)
    assert ops.writebacks
    target = {name: mindspore.Parameter(mindspore.Tensor(np.zeros(p.shape, np.float32), p.dtype), name=name)
              for name, p in state.items()}
    dcp.load(target, checkpoint_id=tmp_path / "c", no_dist=True)
    for name, param in state.items():
        assert np.array_equal(target[name].float().asnumpy(), param.float().asnumpy()), name


@pytest.mark.parametrize("drop", [True, False])
def test_pages_of_a_durable_save_are_dropped_off_the_critical_path(tmp_path: Path, drop: bool) -> None:
    state = {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(4)}
    ops = CountingFileOps()
    writer = dcp.FileSystemWriter(tmp_path / "c", thread_count=2, file_ops=ops, drop_page_cache=drop)
    dcp.save(state, storage_writer=writer, no_dist=True)
    writer.wait_page_drop()
    sizes = sorted(path.stat().st_size for path in (tmp_path / "c").glob("*.safetensors"))
    if not drop:
        assert ops.drops == []
        return
    # Once per data file, whole, on the background thread (never on the saving thread).
    assert sorted(size for size, _ in ops.drops) == sizes and len(sizes) == 2
    assert {name for _, name in ops.drops} == {"hp-ckpt-drop-pages"}
    dcp.save(state, storage_writer=writer, no_dist=True)  # a second save waits for the first advice first
    writer.wait_page_drop()
    assert len(ops.drops) == 4


def test_an_empty_chunk_hashed_in_runs_is_one_run() -> None:
    ends: list[int] = []
    checksum = chunk_checksum(memoryview(b""), 1 << 20, after=ends.append)
    assert ends == [0] and checksum.digests == ("2d06800538d394c2",)


class _ShortPlanner(dcp.StandardSavePlanner):
    """Hands one item an element short of its plan (a planner bug)."""

    def get_data(self, item: WriteItem):
        data = super().get_data(item)
        return data[:-1] if item.index.fqn == "b" else data


def test_an_item_of_other_bytes_than_planned_fails_the_save_and_leaves_no_data_file(tmp_path: Path) -> None:
    state = {"a": np.arange(4096, dtype=np.float32), "b": np.arange(10, dtype=np.float32)}
    with pytest.raises(dcp.CheckpointError, match=r"key 'b': planner returned 36 bytes, plan says 40"):
        dcp.save(state, checkpoint_id=tmp_path / "c", planner=_ShortPlanner(), no_dist=True)
    assert not list((tmp_path / "c").glob("*.safetensors"))
