"""Checkpoints written by earlier format versions still load, and their digests are what the spec says.

The directories under tests/data/ were written once by
tests/data/make_reference_checkpoints.py with the code of their version and
are never rewritten. The digests are recomputed here from the raw JSON and
file bytes with ``xxhash`` directly, following docs/format.md section 7, not
with the library's checksum code.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from safetensors import safe_open

import hyper_parallel.core.distributed_checkpoint as dcp

DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(DATA))

from make_reference_checkpoints import reference_full_state  # noqa: E402  pylint: disable=wrong-import-position

#: (directory, format version recorded in it).
REFERENCES = (("ckpt_v1_0", "1.0"), ("ckpt_v2_0", "2.0"), ("ckpt_v2_0_zstd", "2.0"), ("ckpt_v2_1", "2.1"),
              ("ckpt_v2_1_zstd", "2.1"))


def _zeros_like(value):
    if isinstance(value, np.ndarray):
        return np.zeros_like(value)
    if isinstance(value, dict):
        return {key: _zeros_like(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_zeros_like(item) for item in value]
    return None


@pytest.mark.parametrize("name,version", REFERENCES)
def test_reference_checkpoint_loads_with_its_version(name, version):
    expected = reference_full_state(version)
    target = _zeros_like(expected)
    target_arrays = {key: value for key, value in target.items() if isinstance(value, np.ndarray)}
    dcp.load(target, checkpoint_id=DATA / name, no_dist=True)
    assert dcp.read_metadata(DATA / name).version == version
    for key, value in expected.items():
        if isinstance(value, np.ndarray):
            assert target[key] is target_arrays[key], f"{key}: loaded in place"
            assert target[key].dtype == value.dtype and np.array_equal(target[key], value), key
        else:
            assert target[key] == value, key


def _flat_digests(stored: bytes, block_bytes: int) -> list[str]:
    blocks = [stored[start:start + block_bytes] for start in range(0, len(stored), block_bytes)] or [b""]
    return [xxhash.xxh3_64(block, seed=0).hexdigest() for block in blocks]


def _tile_digests(stored: bytes, sizes: list[int], itemsize: int, block_shape: list[int]) -> list[str]:
    rows, width = block_shape[0], block_shape[-1]
    cube = np.frombuffer(stored, np.uint8).reshape(sizes[0], math.prod(sizes[1:-1]), sizes[-1] * itemsize)
    digests = []
    for row in range(0, sizes[0], rows):
        for column in range(0, sizes[-1], width):
            tile = cube[row:row + rows, :, column * itemsize:(column + width) * itemsize]
            digests.append(xxhash.xxh3_64(np.ascontiguousarray(tile).tobytes(), seed=0).hexdigest())
    return digests


@pytest.mark.parametrize("name,version", REFERENCES)
def test_reference_digests_match_an_independent_xxh3(name, version):
    root = DATA / name
    document = json.loads((root / "metadata.json").read_text())
    assert document["version"] == version and document["backend"] == "filesystem"
    kinds = {"tiles": 0, "flat": 0, "zstd": 0}
    for entry in document["storage_data"]:
        item = document["state_dict_metadata"][entry["fqn"]]
        with open(root / entry["file"], "rb") as handle:
            handle.seek(entry["byte_offset"])
            stored = handle.read(entry["length"])
        assert len(stored) == entry["length"]
        checksum = entry["checksum"]
        assert checksum["algorithm"] == "xxh3_64"
        if checksum.get("block_shape"):
            sizes = next(sizes for offsets, sizes in item["chunks"] if offsets == entry["offset"])
            itemsize = np.dtype(item["dtype"]).itemsize
            assert _tile_digests(stored, sizes, itemsize, checksum["block_shape"]) == checksum["digests"], entry["fqn"]
            kinds["tiles"] += 1
        else:
            assert _flat_digests(stored, checksum["block_bytes"]) == checksum["digests"], entry["fqn"]
            kinds["flat"] += 1
        kinds["zstd"] += entry.get("compression") == "zstd"
    assert kinds["flat"] > 0
    if name in ("ckpt_v2_0", "ckpt_v2_1"):
        assert kinds["tiles"] == 2 and kinds["zstd"] == 0, "the 2.0 and 2.1 references carry tile checksums"
        assert not any("flat_digests" in entry["checksum"] for entry in document["storage_data"])
    if name.endswith("zstd"):
        assert kinds["zstd"] == len(document["storage_data"]) and kinds["tiles"] == 0
    if version == "1.0":
        assert kinds["tiles"] == 0 and kinds["zstd"] == 0


@pytest.mark.parametrize("name,version", REFERENCES)
def test_reference_data_files_open_with_safetensors(name, version):
    files = sorted((DATA / name).glob("*.safetensors"))
    assert len(files) == 2, "one data file per rank"
    for path in files:
        with safe_open(str(path), framework="numpy") as handle:
            assert list(handle.keys())


def test_a_reference_older_than_every_registered_version_is_refused(tmp_path):
    """Versions outside what is registered fail naming both versions."""
    document = json.loads((DATA / "ckpt_v1_0" / "metadata.json").read_text())
    document["version"] = "0.9"
    (tmp_path / "metadata.json").write_text(json.dumps(document))
    with pytest.raises(dcp.UnsupportedFormatError) as caught:
        dcp.load({"step": 0}, checkpoint_id=tmp_path, no_dist=True)
    message = str(caught.value)
    assert "version '0.9'" in message and "filesystem 1.0" in message and "filesystem 2.0" in message


@pytest.mark.parametrize("name,version", REFERENCES)
def test_the_save_id_is_read_from_the_head_of_the_metadata(name, version):
    # pylint: disable-next=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint._format.metadata_json import (
        save_id_from_head,
        save_id_of,
    )

    data = (DATA / name / "metadata.json").read_bytes()
    expected = json.loads(data)["save_id"]
    assert save_id_from_head(data[:4096]) == expected == save_id_of(data)
    reordered = json.dumps({"save_id": expected, **json.loads(data)}).encode()
    assert save_id_from_head(reordered[:4096]) is None and save_id_of(reordered) == expected
    assert save_id_of(b'{"save_id": "not-an-id"}') is None
