"""Flat block digests of tiled chunks (format 2.2): whole reads verify them, partial reads the tiles.

The digests are recomputed here with ``xxhash`` directly over the raw file
bytes (docs/format.md sections 7.1 and 7.2), not with the library's checksum
code; damage is made by editing the files and the metadata by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
import xxhash
from safetensors import safe_open

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.cli import main as cli_main
from hyper_parallel.cli.verify_cmd import verify_checkpoint
from hyper_parallel.core.distributed_checkpoint import _verify_reads
from tile_only import strip_flat_digests

ms.set_device("CPU")

#: 16 KiB rows, 3 MiB: with 1 MiB blocks, tiles of (192, 512) (8 columns, 1 slab) and 3 flat blocks.
FULL = np.random.default_rng(11).standard_normal((192, 4096)).astype(np.float32)
MIB = 1 << 20


def _save_rows(path: Path) -> None:
    """Two ranks' row shards of ``FULL`` (simulated in one process): two chunks of (96, 4096)."""
    from sim_ranks import simulate_save  # pylint: disable=import-outside-toplevel

    layout = Layout((2,), (0, -1))
    simulate_save([{"w": DTensor.from_global(ms.Tensor(FULL), layout, rank=r), "b": np.arange(7.0)}
                   for r in range(2)], path)


def _document(path: Path) -> dict:
    return json.loads((path / "metadata.json").read_text())


def _entry(document: dict, offset: list[int]) -> dict:
    return next(e for e in document["storage_data"] if e["fqn"] == "w" and e["offset"] == offset)


def _rewrite(path: Path, document: dict) -> None:
    (path / "metadata.json").write_text(json.dumps(document, separators=(",", ":")))


def _load_whole(path: Path, **reader) -> np.ndarray:
    target = {"w": np.full(FULL.shape, -1.0, np.float32), "b": np.zeros(7)}
    dcp.load(target, storage_reader=dcp.FileSystemReader(path, **reader), no_dist=True)
    return target["w"]


def _load_columns(path: Path, rank: int) -> np.ndarray:
    """Rank ``rank``'s column half (a reshard: part of each stored chunk)."""
    param = ms.Parameter(ms.Tensor(np.zeros((192, 2048), np.float32)), name="w")
    dcp.load({"w": DTensor(param, Layout((2,), (-1, 0)), FULL.shape, rank=rank)},
             storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return param.asnumpy()


def _flip(path: Path, entry: dict, at: int) -> None:
    data_file = path / entry["file"]
    raw = bytearray(data_file.read_bytes())
    raw[entry["byte_offset"] + at] ^= 0x20
    data_file.write_bytes(bytes(raw))


@pytest.fixture(name="saved")
def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    _save_rows(path)
    return path


def test_a_tiled_chunk_carries_the_flat_digests_of_its_stored_bytes(saved):
    document = _document(saved)
    assert document["version"] == "2.2"
    for offset in ([0, 0], [96, 0]):
        entry = _entry(document, offset)
        checksum = entry["checksum"]
        with open(saved / entry["file"], "rb") as handle:
            handle.seek(entry["byte_offset"])
            stored = handle.read(entry["length"])
        blocks = [stored[s : s + MIB] for s in range(0, len(stored), MIB)]
        assert checksum["block_shape"] == [96, 512] and len(checksum["digests"]) == 8
        assert checksum["flat_digests"] == [xxhash.xxh3_64(b, seed=0).hexdigest() for b in blocks]
        assert len(blocks) == 2 and len(blocks[-1]) == 96 * 16384 - MIB
    plain = next(e for e in document["storage_data"] if e["fqn"] == "b")
    assert "flat_digests" not in plain["checksum"] and "block_shape" not in plain["checksum"]
    for data_file in sorted(saved.glob("*.safetensors")):
        with safe_open(str(data_file), framework="numpy") as handle:
            assert list(handle.keys())


def test_whole_reads_verify_flat_blocks_and_partial_reads_the_tiles(saved, monkeypatch):
    """A whole load hashes no tile slab; a column reshard hashes only tiles (and names a bad one)."""
    slabs = []
    tile_windows = _verify_reads.tile_windows
    monkeypatch.setattr(_verify_reads, "tile_windows", lambda check, done: slabs.append(check.fqn) or tile_windows(check, done))
    assert np.array_equal(_load_whole(saved), FULL)
    assert slabs == []
    assert np.array_equal(_load_columns(saved, 1), FULL[:, 2048:])
    assert slabs == ["w", "w"]
    # A flat digest made wrong (valid hex): the whole load fails on it, the reshard (tiles) does not see it.
    original = _document(saved)
    document = _document(saved)
    entry = _entry(document, [96, 0])
    entry["checksum"]["flat_digests"][1] = "0123456789abcdef"
    _rewrite(saved, document)
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        _load_whole(saved)
    message = str(caught.value)
    second = entry["byte_offset"] + MIB
    assert f"{entry['file']}, key 'w' (bytes {second}..{entry['byte_offset'] + entry['length']})" in message
    assert np.array_equal(_load_columns(saved, 0), FULL[:, :2048])
    # A tile digest made wrong: the reshard reading that tile fails naming it, the other half still loads.
    _entry(original, [96, 0])["checksum"]["digests"][6] = "fedcba9876543210"
    _rewrite(saved, original)
    with pytest.raises(dcp.CorruptCheckpointError, match=r"key 'w' \(tile 0,6 of the chunk"):
        _load_columns(saved, 1)
    assert np.array_equal(_load_columns(saved, 0), FULL[:, :2048])
    assert np.array_equal(_load_whole(saved), FULL)  # a whole load checks the flat blocks, which are right


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("at,block", [(5, 0), (MIB + 40_000, 1)])
def test_a_damaged_byte_fails_a_whole_load_by_file_key_and_block_no_target_changed(saved, at, block, threads):
    entry = _entry(_document(saved), [0, 0])
    _flip(saved, entry, at)
    target = {"w": np.full(FULL.shape, -1.0, np.float32), "b": np.zeros(7)}
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(target, storage_reader=dcp.FileSystemReader(saved, thread_count=threads), no_dist=True)
    start = entry["byte_offset"] + block * MIB
    end = min(start + MIB, entry["byte_offset"] + entry["length"])
    assert f"checksum mismatch in data file {saved / entry['file']}, key 'w' (bytes {start}..{end})" in str(caught.value)
    assert "no target was changed" in str(caught.value)
    assert (target["w"] == -1.0).all() and (target["b"] == 0).all()
    # hp-ckpt verify finds it both ways: the tile holding the byte, and the flat block.
    report = verify_checkpoint(saved, progress=False)
    column = (at % 16384) // 2048
    assert [problem.message for problem in report.problems] == [
        f"checksum mismatch in chunk at offset [0, 0] (tile(s) {column})",
        f"checksum mismatch in chunk at offset [0, 0] (flat block(s) {block})",
    ]


def test_hp_ckpt_verify_checks_the_flat_digests_apart_from_the_tiles(saved, capsys):
    assert cli_main(["verify", str(saved)]) == 0
    document = _document(saved)
    _entry(document, [96, 0])["checksum"]["flat_digests"][0] = "0" * 16
    _rewrite(saved, document)
    assert cli_main(["verify", str(saved)]) == 1
    assert "checksum mismatch in chunk at offset [96, 0] (flat block(s) 0)" in capsys.readouterr().out


def test_a_checkpoint_without_flat_digests_loads_by_its_tiles(saved, monkeypatch):
    """A 2.1-style tiled chunk (no ``flat_digests``) read whole: verified by its tiles, a bad one named."""
    assert strip_flat_digests(saved) == 2
    slabs = []
    tile_windows = _verify_reads.tile_windows
    monkeypatch.setattr(_verify_reads, "tile_windows", lambda check, done: slabs.append(check.fqn) or tile_windows(check, done))
    assert np.array_equal(_load_whole(saved), FULL)
    assert slabs == ["w", "w"]
    _flip(saved, _entry(_document(saved), [96, 0]), 3 * 2048 + 1)
    with pytest.raises(dcp.CorruptCheckpointError, match=r"key 'w' \(tile 0,3 of the chunk"):
        _load_whole(saved)


def _set(path: str, value):
    def change(checksum: dict) -> None:
        if value is _DROP:
            checksum.pop(path)
        else:
            checksum[path] = value
    return change


_DROP = object()
_HEX = "0123456789abcdef"


@pytest.mark.parametrize("change,problem", [
    (_set("flat_digests", "0123456789abcdef"), "flat_digests must be a non-empty list"),
    (_set("flat_digests", []), "flat_digests must be a non-empty list"),
    (_set("flat_digests", [_HEX, 7]), r"flat_digests\[1\] is 7, not 16 lowercase hex digits"),
    (_set("flat_digests", [_HEX, _HEX.upper()]), r"flat_digests\[1\] is '0123456789ABCDEF'"),
    (_set("flat_digests", [_HEX, _HEX[:15]]), r"flat_digests\[1\] is '0123456789abcde',"),
    (_set("flat_digests", [_HEX]), r"1 flat_digests listed for the 2 flat block\(s\) of the chunk at offset \[96, 0\]"),
    (_set("flat_digests", [_HEX] * 3), r"3 flat_digests listed for the 2 flat block\(s\)"),
    (_set("block_shape", _DROP), "flat_digests given with flat blocks"),
    (_set("digests", [_HEX] * 7 + ["xyz"]), r"digests\[7\] is 'xyz', not 16 lowercase hex digits"),
])
def test_malformed_digests_in_the_metadata_are_refused_naming_file_and_key(saved, change, problem):
    document = _document(saved)
    change(_entry(document, [96, 0])["checksum"])
    _rewrite(saved, document)
    target = {"w": np.full(FULL.shape, -1.0, np.float32), "b": np.zeros(7)}
    for verify in (True, False):  # checked when the metadata is decoded, whether or not checksums are verified
        with pytest.raises(dcp.CorruptCheckpointError, match=problem) as caught:
            dcp.load(target, storage_reader=dcp.FileSystemReader(saved, verify_checksums=verify), no_dist=True)
        assert "metadata.json" in str(caught.value) and "'w'" in str(caught.value)
    assert (target["w"] == -1.0).all()


def test_a_malformed_digest_of_a_usual_entry_is_refused(saved):
    """The one-block entry of the writer's usual form: its digest is checked too (the columnar decode gives way)."""
    document = _document(saved)
    plain = next(e for e in document["storage_data"] if e["fqn"] == "b")
    plain["checksum"]["digests"] = ["g" * 16]
    _rewrite(saved, document)
    with pytest.raises(dcp.CorruptCheckpointError, match=r"key 'b'.*digests\[0\] is 'gggggggggggggggg'"):
        dcp.read_metadata(saved)


@pytest.mark.parametrize("shape,dtype,block", [
    ((512, 4096), np.float32, MIB),  # one slab of 8 tiles, 8 whole blocks
    ((1000, 4096), np.float32, MIB),  # 16 slabs of 64 rows (1 MiB each): slab and block edges meet
    ((300, 3, 1024), np.float32, 15 * 1024),  # slabs of 5 rows (60 KiB): blocks straddle slab edges
    ((48, 2048), np.float16, 15 * 1024),  # last slab shorter (3 of 15 rows)
    ((5, 3, 4096), np.float32, 100),  # blocks far smaller than a slab
])
def test_the_writer_hashes_tiles_and_flat_blocks_as_the_format_says(shape, dtype, block):
    """The one-pass computation (flat blocks hashed slab by slab) against xxhash over the whole bytes."""
    from hyper_parallel.core.distributed_checkpoint._format.checksum import chunk_checksum  # pylint: disable=import-outside-toplevel

    values = np.random.default_rng(3).standard_normal(shape).astype(dtype)
    raw = values.tobytes()
    checksum = chunk_checksum(memoryview(raw), block, sizes=shape, itemsize=values.itemsize)
    assert checksum.block_shape
    assert checksum.flat_digests == tuple(xxhash.xxh3_64(raw[s : s + block], seed=0).hexdigest()
                                          for s in range(0, len(raw), block))
    rows, width = checksum.block_shape[0], checksum.block_shape[-1]
    cube = np.frombuffer(raw, np.uint8).reshape(shape[0], -1, shape[-1] * values.itemsize)
    tiles = [xxhash.xxh3_64(np.ascontiguousarray(
        cube[r : r + rows, :, c * values.itemsize : (c + width) * values.itemsize]).tobytes(), seed=0).hexdigest()
        for r in range(0, shape[0], rows) for c in range(0, shape[-1], width)]
    assert checksum.digests == tuple(tiles)
