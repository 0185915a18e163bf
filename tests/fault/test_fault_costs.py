"""Hostile metadata cannot make loading slow or hungry: every decode and check is (near) linear or capped.

Measured here, each against a bound with headroom for a loaded machine:
an ``int`` value of 300k digits decodes in well under a second (it took 4 s,
quadratic) and one past :data:`MAX_INT_DIGITS` is refused at once; the
overlap check of 8,000 chunks that form no grid takes well under a second
(it took 22 s, quadratic), with the same answers as a brute-force check;
metadata decoding keeps memory within a small multiple of the file size
(tracemalloc); ``load`` refuses two items that share bytes of a data file,
naming both keys and the file, and metadata whose dtype, shape or byte range
of an item differs from the data file's own safetensors header (checksums made
to match), with or without checksum verification, changing no target.
"""

from __future__ import annotations

import decimal
import itertools
import json
import random
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli.verify_cmd import verify_checkpoint
from hyper_parallel.core.distributed_checkpoint._builtin_handlers import MAX_INT_DIGITS, IntHandler
from hyper_parallel.core.distributed_checkpoint._format.checksum import chunk_checksum
from hyper_parallel.core.distributed_checkpoint._format.cover import MAX_PAIR_CHECKS, check_exact_cover
from hyper_parallel.core.distributed_checkpoint._format.metadata_json import (
    check_consistency,
    metadata_from_json,
    metadata_to_json,
)
from hyper_parallel.core.distributed_checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
)


# ------------------------------------------------------------------ int values
# Costs are bounded in CPU time of this process (time.process_time), not wall time: other processes on
# the machine do not make them fail; the quadratic versions took 4 s to 30 s.


def test_huge_int_decodes_fast_and_round_trips() -> None:
    handler = IntHandler()
    digits = b"7" * 300_000
    start = time.process_time()
    value = handler.deserialize(digits)
    elapsed = time.process_time() - start
    assert value % 10**12 == 777_777_777_777 and value.bit_length() == 996_579
    assert elapsed < 1.5, f"300k digits took {elapsed:.2f} s to decode"
    assert handler.deserialize(b"-" + digits) == -value
    rng = random.Random(7)
    for bits in (0, 1, 63, 64, 9_000, 9_001, 40_000, 200_000):
        number = rng.getrandbits(bits) if bits else 0
        for signed in (number, -number):
            text = handler.serialize(signed)
            assert text == str(decimal.Decimal(signed)).encode()  # an independent conversion
            assert handler.deserialize(text) == signed
    assert handler.deserialize(b"000123") == 123


def test_int_past_the_cap_is_refused_both_ways() -> None:
    handler = IntHandler()
    start = time.process_time()
    with pytest.raises(dcp.UnsafeCheckpointError, match=f"{MAX_INT_DIGITS} digits"):
        handler.deserialize(b"9" * (MAX_INT_DIGITS + 2))
    assert time.process_time() - start < 0.5
    with pytest.raises(dcp.CheckpointValueError, match="store it as bytes"):
        handler.serialize(1 << (4 * MAX_INT_DIGITS))


def test_huge_int_in_a_checkpoint_loads(tmp_path: Path) -> None:
    value = 3 ** 120_000  # 57,253 digits: beyond Python's own 4,300-digit str limit
    dcp.save({"big": value, "w": np.arange(4.0)}, checkpoint_id=tmp_path / "c", no_dist=True)
    target = {"big": None, "w": np.zeros(4)}
    dcp.load(target, checkpoint_id=tmp_path / "c", no_dist=True)
    assert target["big"] == value and target["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


# ------------------------------------------------------------------ overlap check


def _brute_overlaps(chunks: list[ChunkStorageMetadata]) -> bool:
    return any(
        all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))
        and all(s > 0 for s in a.sizes + b.sizes)
        for a, b in itertools.combinations(chunks, 2)
    )


def test_overlap_check_agrees_with_brute_force() -> None:
    rng = random.Random(11)
    seen = {True: 0, False: 0}
    for _ in range(2000):
        dims = rng.choice([1, 2, 3])
        size = tuple(rng.randint(1, 6) for _ in range(dims))
        chunks = []
        for _ in range(rng.randint(1, 7)):
            offsets = tuple(rng.randint(0, s - 1) for s in size)
            chunks.append(ChunkStorageMetadata(offsets, tuple(rng.randint(0, s - o) for s, o in zip(size, offsets))))
        overlapping = _brute_overlaps(chunks)
        problems = check_exact_cover("t", size, chunks)
        assert any("overlap" in p for p in problems) == overlapping, (size, chunks, problems)
        seen[overlapping] += 1
    assert seen[True] > 300 and seen[False] > 300


def _irregular_rows(rows: int, per_row: int, width: int, rng: random.Random) -> list[ChunkStorageMetadata]:
    chunks = []
    for row in range(rows):
        cuts = [0] + sorted(rng.sample(range(1, width), per_row - 1)) + [width]
        chunks.extend(ChunkStorageMetadata((row, lo), (1, hi - lo)) for lo, hi in zip(cuts, cuts[1:]))
    return chunks


def test_overlap_check_of_8000_irregular_chunks_is_fast() -> None:
    rng = random.Random(3)
    chunks = _irregular_rows(4, 2000, 1_000_000, rng)  # every row cut differently: no grid
    start = time.process_time()
    assert check_exact_cover("t", (4, 1_000_000), chunks) == []
    exact = time.process_time() - start
    overlapping = [ChunkStorageMetadata((0, i), (1, 2)) for i in range(8000)]  # each meets the next
    start = time.process_time()
    problems = check_exact_cover("t", (1, 8001), overlapping)
    chained = time.process_time() - start
    assert len(problems) == 50 and "overlap" in problems[0]
    assert exact < 2.0 and chained < 2.0, (exact, chained)
    gap = chunks[:-1]
    assert "held by no rank" in check_exact_cover("t", (4, 1_000_000), gap)[0]


def test_overlap_check_of_irregular_3d_layout_is_capped() -> None:
    side = 24  # 13,824 unit cubes, one replaced by a 2-long box: irregular in 3 dims
    chunks = [ChunkStorageMetadata((i % side, (i // side) % side, i // side**2), (1, 1, 1)) for i in range(side**3)]
    chunks[5] = ChunkStorageMetadata((5, 0, 0), (1, 1, 2))
    start = time.process_time()
    problems = check_exact_cover("t", (side, side, side), chunks)
    assert time.process_time() - start < 10.0
    assert len(problems) == 1 and "too irregular" in problems[0] and str(MAX_PAIR_CHECKS) in problems[0]


# ------------------------------------------------------------------ metadata memory


def _metadata(entries: int) -> bytes:
    checksum = chunk_checksum(memoryview(np.zeros(64, np.uint8)), 16)
    items, storage = {}, {}
    for i in range(entries):
        fqn = f"model.layers.{i // 10}.mlp.weight_{i % 10}"
        items[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype="float32"), size=(4, 4),
            chunks=(ChunkStorageMetadata(offsets=(0, 0), sizes=(4, 4)),),
        )
        storage[MetadataIndex(fqn, (0, 0))] = StorageInfo(
            relative_path=f"r00000_{i % 3:03d}.0123456789ab.safetensors", offset=i * 64, length=64, checksum=checksum
        )
    return metadata_to_json(Metadata(state_dict_metadata=items, storage_data=storage))


def test_metadata_memory_is_a_small_multiple_of_its_size() -> None:
    data = _metadata(2_000)
    tracemalloc.start()
    try:
        start = time.perf_counter()
        metadata = metadata_from_json(data)
        check_consistency(metadata)
        elapsed = time.perf_counter() - start
        retained, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    ratio, kept = peak / len(data), retained / len(data)
    print(f"metadata {len(data) / 1e6:.1f} MB: peak {ratio:.1f}x, retained {kept:.1f}x, {elapsed:.2f} s")
    assert ratio < 4.0 and kept < 3.0, (ratio, kept)  # streaming decode; the whole JSON tree peaked at 6.3x
    assert len(metadata.storage_data) == 2_000


def test_a_handed_over_buffer_is_freed_before_the_records_are_built(tmp_path: Path) -> None:
    """A bytearray is emptied (and read_metadata's anonymous map unmapped) once decoded: the peak drops by 1x."""
    data = _metadata(2_000)
    reference = metadata_from_json(data)
    peaks = {}
    for kind in (bytes, bytearray):
        tracemalloc.start()
        try:
            buffer = kind(memoryview(data))  # a fresh copy, counted: the bytes as read
            assert metadata_from_json(buffer) == reference
            peaks[kind] = tracemalloc.get_traced_memory()[1] / len(data)
        finally:
            tracemalloc.stop()
        assert len(buffer) == (len(data) if kind is bytes else 0)  # bytes untouched; a bytearray handed over
    assert peaks[bytearray] < peaks[bytes] - 0.7, peaks
    with pytest.raises(dcp.CorruptCheckpointError):
        metadata_from_json(bytearray(b"\xff{"))
    # read_metadata reads into an anonymous map the decoder unmaps: the same metadata, every time.
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "metadata.json").write_bytes(data)
    assert dcp.read_metadata(tmp_path / "ckpt") == reference
    (tmp_path / "ckpt" / "metadata.json").write_bytes(b"")
    with pytest.raises(dcp.CorruptCheckpointError):
        dcp.read_metadata(tmp_path / "ckpt")


def test_streaming_decode_reads_any_member_order_and_spacing() -> None:
    """The member-by-member decoder accepts what any JSON writer may produce, and refuses what JSON refuses."""
    data = _metadata(20)
    reference = metadata_from_json(data)
    document = json.loads(data)
    reordered = dict(reversed(list(document.items())))  # storage before items, "format" last
    for text in (json.dumps(reordered), json.dumps(document, indent=2), " \n" + json.dumps(document) + "\n\t"):
        assert metadata_from_json(text.encode()) == reference
    for broken in (data[:-1], data + b"x", data.replace(b'"storage_data":[', b'"storage_data":[,', 1),
                   data.replace(b'},{', b'}{', 1), b"", b"[]", b'{"format": 1'):
        with pytest.raises(dcp.CorruptCheckpointError):
            metadata_from_json(broken)


# ------------------------------------------------------------------ shared bytes


def test_load_refuses_two_items_sharing_bytes(tmp_path: Path) -> None:
    state = {"a": np.arange(64, dtype=np.float32), "b": np.arange(64, dtype=np.float32) * 2}
    dcp.save(state, checkpoint_id=tmp_path / "c", no_dist=True)
    meta_path = tmp_path / "c" / "metadata.json"
    document = json.loads(meta_path.read_bytes())
    entries = {entry["fqn"]: entry for entry in document["storage_data"]}
    entries["b"]["byte_offset"] = entries["a"]["byte_offset"] + 4  # same length: only the overlap is wrong
    entries["b"]["checksum"] = entries["a"]["checksum"]
    meta_path.write_text(json.dumps(document))
    target = {"a": np.zeros(64, np.float32), "b": np.zeros(64, np.float32)}
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(target, checkpoint_id=tmp_path / "c", no_dist=True)
    message = str(caught.value)
    assert "'a'" in message and "'b'" in message and entries["a"]["file"] in message and "share bytes" in message
    assert not target["a"].any() and not target["b"].any()


# ------------------------------------------------------------------ metadata that lies about the bytes


def _lie(path: Path, change: Any) -> None:
    meta_path = path / "metadata.json"
    document = json.loads(meta_path.read_bytes())
    change(document)
    meta_path.write_text(json.dumps(document))


def _shape_lie(document: dict) -> None:
    item = document["state_dict_metadata"]["w"]
    item["size"] = [2, 8]
    item["chunks"] = [[[0, 0], [2, 8]]]


def _swap_lie(document: dict) -> None:
    entries = {entry["fqn"]: entry for entry in document["storage_data"]}
    for field in ("byte_offset", "checksum"):  # two float32 [4, 4] items trade places: no overlap, digests match
        entries["w"][field], entries["v"][field] = entries["v"][field], entries["w"][field]


LIES = {
    # float32 claimed for int32 bytes: same size, same bytes, same checksum (was: loaded as wrong floats).
    "dtype": (lambda d: d["state_dict_metadata"]["a"].update(dtype="float32"), "a", "I32", (4, 4)),
    # [2, 8] claimed for a [4, 4] tensor: same byte count.
    "shape": (_shape_lie, "w", "shape [4, 4]", (2, 8)),
    # two same-sized items' byte ranges (and digests) swapped.
    "swap": (_swap_lie, "vw", "an entry '", (4, 4)),
}


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("lie", sorted(LIES))
def test_load_refuses_metadata_that_disagrees_with_the_file_header(tmp_path: Path, lie: str, verify: bool) -> None:
    change, key, shown, shape = LIES[lie]
    path = tmp_path / "c"
    dcp.save({"a": np.arange(16, dtype=np.int32).reshape(4, 4), "w": np.arange(16, dtype=np.float32).reshape(4, 4),
              "v": -np.arange(16, dtype=np.float32).reshape(4, 4), "z": np.ones(3, np.float32)},
             checkpoint_id=path, no_dist=True)
    _lie(path, change)
    target = {"a": np.full((4, 4), 7, dtype=np.float32 if lie == "dtype" else np.int32),
              "w": np.full(shape, 7, np.float32), "v": np.full((4, 4), 7, np.float32), "z": np.full(3, 7, np.float32)}
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(target, checkpoint_id=path, no_dist=True, storage_reader=dcp.FileSystemReader(
            path, verify_checksums=verify))
    message = str(caught.value)
    (data_file,) = [p.name for p in path.glob("*.safetensors")]
    assert any(f"key '{k}'" in message for k in key)
    assert data_file in message and shown in message and "hp-ckpt verify" in message
    assert all((value == 7).all() for value in target.values()), "a target changed"
    assert not verify_checkpoint(path).ok


def test_header_is_read_once_per_file_and_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c"
    state = {f"p{i}": np.full(8, i, np.float32) for i in range(50)}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    reader = dcp.FileSystemReader(path)
    read_for: list[str] = []
    real = dcp.FileSystemReader._header_entries  # pylint: disable=protected-access

    def counted(self, source, file_path, size, relative_path, *args):
        read_for.append(relative_path)
        return real(self, source, file_path, size, relative_path, *args)

    monkeypatch.setattr(dcp.FileSystemReader, "_header_entries", counted)
    target = {key: np.zeros(8, np.float32) for key in state}
    dcp.load(target, checkpoint_id=path, no_dist=True, storage_reader=reader)
    assert all((target[key] == state[key]).all() for key in state)
    files = {info.relative_path for info in reader.metadata.storage_data.values()}
    assert sorted(read_for) == sorted(files)  # verify pass and read pass: one header read per file
    assert not reader._headers and reader._items is None  # pylint: disable=protected-access  # dropped at the end
