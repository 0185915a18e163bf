"""The verify pass on batches of small chunks: hashed many per window, refused by key and file, all or nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._format.checksum import ALGORITHM, chunk_checksum, digest
from hyper_parallel.core.distributed_checkpoint import _verify_reads
from hyper_parallel.core.distributed_checkpoint._run_reads import FileSource
from hyper_parallel.core.distributed_checkpoint._verify_reads import RegionCheck, verify_regions
from hyper_parallel.core.distributed_checkpoint._verify_windows import BlockList, flat_windows
from hyper_parallel.core.distributed_checkpoint.metadata import ChunkChecksum, StorageInfo

ms.set_device("CPU")

MIB = 1 << 20


def _state(seed: int) -> dict[str, ms.Parameter]:
    """300 small Parameters of mixed dtypes (bf16, fp16, fp32, int32, 0-d, empty), a tiled matrix and a
    vector of two flat blocks, in one file."""
    rng = np.random.default_rng(seed)
    shapes = np.random.default_rng(0)  # the same shapes for every seed
    state = {}
    dtypes = (ms.float32, ms.bfloat16, ms.float16, ms.int32)
    for i in range(300):
        dtype = dtypes[i % 4]
        if i % 50 == 7:
            shape: tuple[int, ...] = ()  # 0-d
        elif i % 50 == 13:
            shape = (0,) if i % 100 == 13 else (0, 4)  # empty
        else:
            shape = (int(shapes.integers(1, 700)),) if i % 3 else (int(shapes.integers(1, 9)), 33)
        values = rng.standard_normal(shape).astype(np.float32) * 100
        state[f"p{i:03d}"] = ms.Parameter(ms.Tensor(values, dtype), name=f"p{i:03d}")
        if i == 150:  # in the middle of the file: a tiled matrix and a vector of two 1 MiB blocks
            state["tiled"] = ms.Parameter(ms.Tensor(rng.random((64, 2048), dtype=np.float32)), name="tiled")
            state["vec"] = ms.Parameter(ms.Tensor(rng.random((300_000,), dtype=np.float32)), name="vec")
    return state


def _bytes(state: dict[str, ms.Parameter]) -> dict[str, np.ndarray]:
    return {name: p.asnumpy().reshape(-1).view(np.uint8).copy() for name, p in state.items()}


def _entries(path: Path) -> dict[str, dict]:
    return {e["fqn"]: e for e in json.loads((path / "metadata.json").read_text())["storage_data"]}


@pytest.fixture(name="saved")
def _saved(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    state = _state(0)
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=1), no_dist=True)
    return path, _bytes(state)


def test_batch_of_mixed_small_chunks_is_bit_exact_and_hashed_once(saved: tuple[Path, dict]) -> None:
    path, expected = saved
    entries = _entries(path)
    assert entries["tiled"]["checksum"].get("block_shape") and len(entries["vec"]["checksum"]["digests"]) == 2
    target = _state(1)
    reader = dcp.FileSystemReader(path, thread_count=2)
    dcp.load(target, storage_reader=reader, no_dist=True)
    for name, values in _bytes(target).items():
        assert np.array_equal(values, expected[name]), name
    assert target["p001"].dtype == ms.bfloat16 and target["p007"].shape == () and target["p013"].shape == (0,)
    assert reader.bytes_verified == sum(v.nbytes for v in expected.values())


@pytest.mark.parametrize("key, where", [
    ("p149", 0.5),  # float32 vector in the middle of the batch
    ("p145", 0.6),  # bf16 vector
    ("p107", 0.0),  # 0-d
    ("tiled", 0.7),  # a tile of the matrix between the small chunks
    ("vec", 0.9),  # the second flat block of the vector
    ("p299", 0.99),  # the last byte region of the file
])
def test_corrupt_byte_in_a_batch_refused_by_key_and_file_every_target_unchanged(
        saved: tuple[Path, dict], key: str, where: float) -> None:
    path, _ = saved
    entry = _entries(path)[key]
    data_file = path / entry["file"]
    raw = bytearray(data_file.read_bytes())
    raw[entry["byte_offset"] + int(entry["length"] * where)] ^= 0x04
    data_file.write_bytes(bytes(raw))
    target = _state(2)
    before = _bytes(target)
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path, thread_count=2), no_dist=True)
    text = str(caught.value)
    assert f"key '{key}'" in text and entry["file"] in text and "no target was changed" in text, text
    for name, values in _bytes(target).items():
        assert np.array_equal(values, before[name]), name


# ----------------------------------------------------------------- verify_regions on a file of known bytes

def _file(tmp_path: Path, *, block: int = 4096) -> tuple[Path, bytearray, list[StorageInfo]]:
    """A file of three flat chunks (3.5, 1 and 2 blocks) and a tiled (64, 512) float32 chunk."""
    rng = np.random.default_rng(5)
    raw = bytearray(rng.integers(0, 256, size=4096 + 7 * block + 64 * 512 * 4, dtype=np.uint8).tobytes())
    infos = []
    offset = 4096
    for length in (3 * block + block // 2, block, 2 * block):
        view = memoryview(raw)[offset:offset + length]
        infos.append(StorageInfo("f", offset, length, chunk_checksum(view, block, tiles=False)))
        offset += length
    tiled = memoryview(raw)[offset:offset + 64 * 512 * 4]
    infos.append(StorageInfo("f", offset, len(tiled), chunk_checksum(tiled, 32 * 1024, sizes=(64, 512), itemsize=4)))
    assert infos[-1].checksum.block_shape == (32, 256)  # two slabs of two tiles
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(raw))
    return path, raw, infos


def _verify(path: Path, checks: list[RegionCheck], whole=(), window: int = 8 * MIB) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return verify_regions(FileSource(fd), path, checks, window, whole=whole)
    finally:
        os.close(fd)


def test_whole_and_partial_regions_hash_each_touched_block_once_in_any_order(tmp_path: Path) -> None:
    block = 4096
    path, raw, infos = _file(tmp_path, block=block)
    a, b, c, tiled = infos
    rows_of_a = RegionCheck("a", a, (a.length // 2,), 2, offsets=(block,), lengths=(block // 2,))  # inside block 2
    part_of_c = RegionCheck("c", c, (c.length,), 1, offsets=(block + 10,), lengths=(5,))  # block 1 of c only
    upper_tiles = RegionCheck("t", tiled, (64, 512), 4, offsets=(0, 0), lengths=(32, 512))  # one slab of tiles
    # a whole, also named by a partial region (hashed once); c partly; b not at all; regions out of file order
    hashed = _verify(path, [part_of_c, rows_of_a, upper_tiles, part_of_c], whole=[("a", a), ("a", a)])
    assert hashed == a.length + block + 32 * 512 * 4
    # bytes outside what is hashed may be anything: b, the first block of c, the lower tiles
    for position in (b.offset + 5, c.offset + 1, tiled.offset + tiled.length - 1):
        raw[position] ^= 1
    path.write_bytes(bytes(raw))
    assert _verify(path, [part_of_c, upper_tiles], whole=[("a", a)]) == a.length + block + 32 * 512 * 4
    # a damaged byte in a hashed block is named by key, file and the block's bytes
    raw[c.offset + block + 4000] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(dcp.CorruptCheckpointError, match=rf"data.bin, key 'c' \(bytes {c.offset + block}\.\."):
        _verify(path, [part_of_c], whole=[("a", a)])
    raw[a.offset + 3 * block + 1] ^= 1  # the last, short block of a, in the same window as c
    path.write_bytes(bytes(raw))
    with pytest.raises(dcp.CorruptCheckpointError, match=rf"key 'a' \(bytes {a.offset + 3 * block}\.\.{b.offset}\)"):
        _verify(path, [part_of_c], whole=[("a", a)])


def test_small_windows_split_a_batch_and_a_tile_slab_splitsflat_windows(tmp_path: Path) -> None:
    path, raw, infos = _file(tmp_path)
    a, b, c, tiled = infos
    checks = [RegionCheck("t", tiled, (64, 512), 4, offsets=(32, 0), lengths=(32, 512))]
    # windows of 2 blocks: the batch is hashed in several windows, every byte still once
    assert _verify(path, checks, whole=[("c", c), ("b", b), ("a", a)], window=2 * 4096) == (
        a.length + b.length + c.length + 32 * 512 * 4)
    raw[b.offset] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(dcp.CorruptCheckpointError, match="key 'b'"):
        _verify(path, checks, whole=[("c", c), ("b", b), ("a", a)], window=2 * 4096)


def test_block_list_sorts_and_windows_group_by_arrays() -> None:
    flat = BlockList()
    digests = tuple(str(i) for i in range(3))
    late = StorageInfo("f", 3 * MIB, 3 * MIB + 5, ChunkChecksum(ALGORITHM, MIB, digests + ("3",)))
    early = StorageInfo("f", 0, 100, ChunkChecksum(ALGORITHM, MIB, ("x",)))
    flat.add_whole("late", late)
    flat.add_blocks("late", late, [3, 0])  # already listed whole: not again
    flat.add_whole("early", early)
    blocks = flat.done()
    assert blocks.starts.tolist() == [0, 3 * MIB, 4 * MIB, 5 * MIB, 6 * MIB]
    assert blocks.ends.tolist() == [100, 4 * MIB, 5 * MIB, 6 * MIB, 6 * MIB + 5]
    assert blocks.keys == ["early", "late", "late", "late", "late"] and blocks.digests == ["x", "0", "1", "2", "3"]
    windows = flat_windows(blocks, 8 * MIB)
    # the gap of 3 MiB - 100 bytes is over the gap bound: two windows; the second read whole
    assert [(w.start, w.end, w.first, w.stop) for w in windows] == [(0, 100, 0, 1), (3 * MIB, 6 * MIB + 5, 1, 5)]
    assert windows[1].whole and windows[1].hashed == 3 * MIB + 5
    assert [(w.first, w.stop) for w in flat_windows(blocks, 2 * MIB)] == [(0, 1), (1, 3), (3, 5)]


def test_chunk_of_no_bytes_must_have_the_checksum_of_no_bytes(tmp_path: Path) -> None:
    # (a load never reads an empty piece of a tensor; a chunk claiming 0 bytes is checked all the same)
    path, _, _ = _file(tmp_path)
    empty = StorageInfo("f", 4096, 0, ChunkChecksum(ALGORITHM, MIB, (digest(b""),)))
    lying = StorageInfo("f", 4096, 0, ChunkChecksum(ALGORITHM, MIB, (digest(b"x"),)))
    assert _verify(path, [RegionCheck("e", empty, (0,), 4, offsets=(0,), lengths=(0,))], whole=[("e", empty)]) == 0
    for checks, whole in (([], [("w", lying)]), ([RegionCheck("w", lying, None, 1)], [])):
        with pytest.raises(dcp.CorruptCheckpointError, match="key 'w': the metadata says it stores 0 bytes"):
            _verify(path, checks, whole=whole)


def test_flat_window_is_read_and_hashed_a_piece_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    block = 4096
    path, raw, infos = _file(tmp_path, block=block)
    a, b, c, _ = infos  # 3.5 + 1 + 2 blocks, one after the other: one window hashed whole
    monkeypatch.setattr(_verify_reads, "_PIECE_BYTES", 2 * block)
    reads: list[tuple[int, int]] = []
    real_preadv = os.preadv

    def recording_preadv(fd: int, buffers: list, offset: int) -> int:
        reads.append((offset, sum(memoryview(buffer).nbytes for buffer in buffers)))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording_preadv)
    whole = [("a", a), ("b", b), ("c", c)]
    assert _verify(path, [], whole=whole) == a.length + b.length + c.length
    # the blocks starting in each 2-block step, in file order, each byte once: 2, 2.5 and 2 blocks
    assert reads == [(a.offset, 2 * block), (a.offset + 2 * block, 2 * block + block // 2),
                     (b.offset + block, 2 * block)]
    # a damaged byte in any piece is named by key, file and the block's bytes
    for key, info, index in (("a", a, 0), ("b", b, 0), ("c", c, 1)):
        damaged = bytearray(raw)
        damaged[info.offset + index * block + 7] ^= 1
        path.write_bytes(bytes(damaged))
        end = min(info.offset + (index + 1) * block, info.offset + info.length)
        with pytest.raises(dcp.CorruptCheckpointError,
                           match=rf"data.bin, key '{key}' \(bytes {info.offset + index * block}\.\.{end}\)"):
            _verify(path, [], whole=whole)
    # a file cut short inside the last piece (as by another process during a load) is refused, not mapped past its end
    path.write_bytes(bytes(raw[:c.offset + block + 10]))
    with pytest.raises(dcp.CorruptCheckpointError, match="data.bin is truncated"):
        _verify(path, [], whole=whole)
