"""Damaged checkpoints loaded through the standard planner's columns (``_whole_reads``) end exactly as through
ReadItems (a subclass of the planner, which gets a plain plan): the same values, or the same refusal with every
target as it was.

Each damage (a byte flipped in a header or a chunk, a file cut short, metadata whose entries were swapped,
moved or retyped) is loaded with checksums verified and not, by one and by four threads, into Parameters,
Tensors and numpy arrays of several dtypes (0-d included), next to a large tensor, a cast target and a value.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._whole_reads import WholeReadPlan

ms.set_device("CPU")

_DTYPES = (np.float32, np.float16, np.int32, np.bool_, np.int8, np.float64)
_SHAPES = ((3, 4), (5,), (), (2, 3, 4), (1,), (3, 4))


def _state(zero: bool) -> dict[str, Any]:
    rng = np.random.default_rng(11)
    state: dict[str, Any] = {}
    for i in range(24):
        values = (rng.standard_normal(_SHAPES[i % 6]) * 40).astype(_DTYPES[i % 6 if i % 4 else 0])
        values = np.zeros_like(values) if zero else values
        if i % 3 == 0:
            state[f"p{i:02d}"] = ms.Parameter(ms.Tensor(values), name=f"p{i:02d}")
        elif i % 3 == 1 and values.ndim:
            state[f"n{i:02d}"] = values
        else:
            state[f"t{i:02d}"] = ms.Tensor(values)
    big = rng.standard_normal((300, 1000)).astype(np.float32)
    state["big"] = np.zeros_like(big) if zero else big
    cast = rng.standard_normal((3, 3)).astype(np.float32)
    state["cast"] = np.zeros((3, 3), np.float64) if zero else cast
    state["step"] = 0 if zero else 9
    return state


def _bits(state: dict[str, Any]) -> dict[str, Any]:
    return {name: value if isinstance(value, int) else
            (value if isinstance(value, np.ndarray) else value.asnumpy()).astype(np.float64).tobytes()
            for name, value in state.items()}


class _Items(dcp.StandardLoadPlanner):
    """The standard planner as a subclass: its plan lists every ReadItem (no columns)."""


def _outcome(path: Path, planner: dcp.StandardLoadPlanner, *, verify: bool, threads: int) -> tuple[str, Any]:
    state = _state(zero=True)
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path, verify_checksums=verify, thread_count=threads),
                 planner=planner, no_dist=True)
    except dcp.CheckpointError as exc:
        assert _bits(state) == _bits(_state(zero=True)), f"a refused load changed a target: {exc}"
        return type(exc).__name__, str(exc)
    return "loaded", _bits(state)


def _file_of(path: Path, key: str) -> Path:
    record = json.loads((path / "metadata.json").read_text())
    return path / next(entry["file"] for entry in record["storage_data"] if entry["fqn"] == key)


def _flip(offset_of: Callable[[bytes, int], int]) -> Callable[[Path], None]:
    """Flip a bit of the data file holding ``p00`` (one file: the refusal is the same whatever thread finds it)."""
    def damage(path: Path) -> None:
        target = _file_of(path, "p00")
        data = bytearray(target.read_bytes())
        data[offset_of(bytes(data), struct.unpack("<Q", data[:8])[0])] ^= 0x10
        target.write_bytes(bytes(data))
    return damage


def _metadata(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        record = json.loads((path / "metadata.json").read_text())
        change(record)
        (path / "metadata.json").write_text(json.dumps(record))
    return damage


def _entries(record: dict[str, Any], *keys: str) -> list[dict[str, Any]]:
    return [next(entry for entry in record["storage_data"] if entry["fqn"] == key) for key in keys]


def _swap(*fields: str) -> Callable[[dict[str, Any]], None]:
    def change(record: dict[str, Any]) -> None:
        first, second = _entries(record, "p00", "p12")  # both float32 (3, 4)
        for field in fields:
            first[field], second[field] = second[field], first[field]
    return change


def _cut(path: Path) -> None:
    target = _file_of(path, "p00")
    os.truncate(target, target.stat().st_size - 3)


_DAMAGES = {
    "a header digit": _flip(lambda data, header: next(  # of p00's shape or byte range
        at for at in range(data.index(b'"p00"') + 5, 8 + header) if chr(data[at]).isdigit())),
    "a header name": _flip(lambda data, header: data.index(b'"p00"') + 1),  # p00 -> `00
    "a chunk byte": _flip(lambda data, header: 8 + header + 5),
    "the last chunk byte": _flip(lambda data, header: len(data) - 1),
    "a file cut short": _cut,
    "offsets swapped": _metadata(_swap("byte_offset")),
    "offsets and digests swapped": _metadata(_swap("byte_offset", "checksum")),
    "an entry moved one byte": _metadata(lambda record: _entries(record, "p03")[0].update(
        byte_offset=_entries(record, "p03")[0]["byte_offset"] + 1)),
    "a dtype retyped": _metadata(lambda record: record["state_dict_metadata"]["p00"].update(dtype="int32")),
}


@pytest.fixture(name="saved", scope="module")
def _saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("damage") / "ckpt"
    dcp.save(_state(zero=False), storage_writer=dcp.FileSystemWriter(path, thread_count=3), no_dist=True)
    return path


def test_the_columns_path_is_the_one_taken(saved: Path) -> None:
    planner = dcp.StandardLoadPlanner()
    planner.configure_planner(_state(zero=True), dcp.read_metadata(saved))
    assert type(planner.build_local_plan()) is WholeReadPlan and len(planner.whole_reads) == 24  # all but big, cast
    assert _outcome(saved, dcp.StandardLoadPlanner(), verify=True, threads=2) == ("loaded", _bits(_state(False)))


@pytest.mark.parametrize("damage", sorted(_DAMAGES))
def test_a_damaged_checkpoint_ends_as_through_read_items(saved: Path, tmp_path: Path, damage: str) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    _DAMAGES[damage](path)
    saved_bits = _bits(_state(zero=False))
    for verify in (True, False):
        for threads in (1, 4):
            columns = _outcome(path, dcp.StandardLoadPlanner(), verify=verify, threads=threads)
            assert columns == _outcome(path, _Items(), verify=verify, threads=threads), (damage, verify, threads)
            if verify:  # every damage is found: refused, no target changed
                assert columns[0] == "CorruptCheckpointError", (damage, threads, columns)
            elif columns[0] == "loaded" and "chunk" not in damage:  # unverified: only chunk bytes may pass
                assert columns[1] == saved_bits, (damage, threads)
