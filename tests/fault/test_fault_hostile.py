"""Hostile checkpoints: refused with a clear error, nothing read or written outside, no code run.

Each case damages a fresh copy of a small checkpoint on purpose. Next to it
lies an ``outside`` directory holding an exact copy of the data file and the
metadata: a loader that followed a path out of the checkpoint would load
correct values from there, so only a refusal passes. Every case also checks
that nothing outside the checkpoint directory was created or changed.
Allocation cases run in a child with the address space capped
(``scripts/hostile_child.py``).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli.verify_cmd import verify_checkpoint
from hyper_parallel.core.distributed_checkpoint.filesystem_reader import MAX_METADATA_BYTES
from hyper_parallel.core.distributed_checkpoint._one_line import load_checkpoint
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import read_header

from fault_common import run_script, snapshot_tree

STATE = {"w": np.arange(32, dtype=np.float32).reshape(8, 4), "n": np.arange(5, dtype=np.int64), "step": 3, "name": "x"}


def _blank() -> dict[str, Any]:
    return {"w": np.zeros((8, 4), np.float32), "n": np.zeros(5, np.int64), "step": None, "name": None}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile_base") / "ckpt"
    dcp.save(STATE, checkpoint_id=path, no_dist=True)
    return path


class Case:
    """A copy of the base checkpoint at ``root/ckpt`` with an ``outside`` twin next to it."""

    def __init__(self, base: Path, root: Path) -> None:
        self.root = root
        self.ckpt = root / "ckpt"
        self.outside = root / "outside"
        shutil.copytree(base, self.ckpt)
        shutil.copytree(base, self.outside)
        self.data = next(p.name for p in self.ckpt.glob("*.safetensors"))

    def edit(self, change: Callable[[dict], None]) -> None:
        document = json.loads((self.ckpt / "metadata.json").read_text())
        change(document)
        (self.ckpt / "metadata.json").write_text(json.dumps(document))

    def set_all_files(self, value: Any) -> None:
        def change(document: dict) -> None:
            for entry in document["storage_data"]:
                entry["file"] = value

        self.edit(change)

    def entry(self, document: dict, fqn: str) -> dict:
        return next(e for e in document["storage_data"] if e["fqn"] == fqn)

    def outside_snapshot(self) -> dict:
        snap = snapshot_tree(self.root)
        return {k: v for k, v in snap.items() if not k.startswith("ckpt" + os.sep)}


def _expect_refusal(case: Case, error: type, *needles: str) -> BaseException:
    before = case.outside_snapshot()
    with pytest.raises(error) as caught:
        dcp.load(_blank(), checkpoint_id=case.ckpt, no_dist=True)
    text = str(caught.value)
    for needle in needles:
        assert needle in text, f"{needle!r} not in: {text}"
    assert case.outside_snapshot() == before, "something outside the checkpoint changed"
    return caught.value


# (name, how to make the checkpoint hostile, expected error, words the message must hold)
PATH_CASES: list[tuple[str, Callable[[Case], None], type, tuple[str, ...]]] = [
    ("parent_dir", lambda c: c.set_all_files(f"../outside/{c.data}"), dcp.UnsafeCheckpointError, ("leaves",)),
    ("absolute", lambda c: c.set_all_files(str(c.outside / c.data)), dcp.UnsafeCheckpointError, ("leaves",)),
    ("nested_parent", lambda c: c.set_all_files(f"sub/../../outside/{c.data}"), dcp.UnsafeCheckpointError,
     ("leaves",)),
    ("dot_slash", lambda c: c.set_all_files(f"./{c.data}"), dcp.UnsafeCheckpointError, ("leaves",)),
    ("backslash", lambda c: c.set_all_files(f"..\\outside\\{c.data}"), dcp.UnsafeCheckpointError,
     ("not a plain relative path",)),
    ("nul_byte", lambda c: c.set_all_files(f"{c.data}\x00.txt"), dcp.UnsafeCheckpointError,
     ("not a plain relative path",)),
    ("empty_name", lambda c: c.set_all_files(""), dcp.UnsafeCheckpointError, ("not a plain relative path",)),
    ("name_not_text", lambda c: c.set_all_files(5), dcp.UnsafeCheckpointError, ("not a plain relative path",)),
]


def _symlink_data_file(case: Case) -> None:
    (case.ckpt / case.data).unlink()
    (case.ckpt / case.data).symlink_to(case.outside / case.data)


def _symlink_directory(case: Case) -> None:
    (case.ckpt / "link").symlink_to(case.outside, target_is_directory=True)
    case.set_all_files(f"link/{case.data}")


def _symlink_metadata(case: Case) -> None:
    (case.ckpt / "metadata.json").unlink()
    (case.ckpt / "metadata.json").symlink_to(case.outside / "metadata.json")


PATH_CASES += [
    ("symlinked_data_file", _symlink_data_file, dcp.UnsafeCheckpointError, ("resolves outside", "refused")),
    ("symlinked_directory", _symlink_directory, dcp.UnsafeCheckpointError, ("resolves outside", "refused")),
    ("symlinked_metadata", _symlink_metadata, dcp.UnsafeCheckpointError, ("outside", "refused")),
]

SIZE_CASES: list[tuple[str, Callable[[Case], None], type, tuple[str, ...]]] = [
    ("absurd_length", lambda c: c.edit(lambda d: c.entry(d, "w").update(length=2**60)),
     dcp.UnsafeCheckpointError, ("absurd",)),
    ("absurd_byte_offset", lambda c: c.edit(lambda d: c.entry(d, "n").update(byte_offset=2**60)),
     dcp.UnsafeCheckpointError, ("absurd",)),
    ("absurd_size", lambda c: c.edit(lambda d: d["state_dict_metadata"]["w"].update(size=[2**40, 2**20])),
     dcp.UnsafeCheckpointError, ("absurdly large",)),
    ("negative_offset", lambda c: c.edit(lambda d: c.entry(d, "n").update(byte_offset=-8)),
     dcp.CorruptCheckpointError, ("byte_offset", ">= 0")),
    ("offset_past_the_file", lambda c: c.edit(lambda d: c.entry(d, "n").update(byte_offset=10**9)),
     dcp.CorruptCheckpointError, ("truncated", "'n'")),
    ("value_length_past_the_file", lambda c: c.edit(lambda d: c.entry(d, "step").update(
        length=2**40, checksum=None)), dcp.CorruptCheckpointError, ("'step'", "share bytes")),  # runs into 'name'

    ("length_as_text", lambda c: c.edit(lambda d: c.entry(d, "w").update(length="128")),
     dcp.CorruptCheckpointError, ("length",)),
    ("length_as_bool", lambda c: c.edit(lambda d: c.entry(d, "w").update(length=True)),
     dcp.CorruptCheckpointError, ("length",)),
    ("huge_block_bytes", lambda c: c.edit(lambda d: c.entry(d, "w")["checksum"].update(block_bytes=2**62)),
     None, ()),  # harmless: one block, still verified
    ("deeply_nested", lambda c: (c.ckpt / "metadata.json").write_text("[" * 100_000 + "]" * 100_000),
     dcp.CorruptCheckpointError, ("not valid JSON",)),
    ("huge_integer", lambda c: (c.ckpt / "metadata.json").write_text('{"format": ' + "9" * 5000 + "}"),
     dcp.CorruptCheckpointError, ("not valid JSON",)),
    ("unknown_kind", lambda c: c.edit(lambda d: d["state_dict_metadata"]["w"].update(kind="code")),
     dcp.CorruptCheckpointError, ("unknown kind",)),
    ("foreign_format", lambda c: c.edit(lambda d: d.update(format="torch.distributed")),
     dcp.CorruptCheckpointError, ("not a hyper_parallel checkpoint",)),
    ("future_version", lambda c: c.edit(lambda d: d.update(version="9.0")),
     dcp.UnsupportedFormatError, ("9.0",)),
]


def _too_large_metadata(case: Case) -> None:
    with open(case.ckpt / "metadata.json", "r+b") as handle:
        handle.truncate(MAX_METADATA_BYTES + 1)  # sparse: refused by its size, never read


def _pickled_metadata(case: Case) -> None:
    marker = case.root / "pwned_by_metadata"
    (case.ckpt / "metadata.json").write_bytes(pickle.dumps(_Creates(str(marker))))


SIZE_CASES += [
    ("metadata_too_large", _too_large_metadata, dcp.UnsafeCheckpointError, ("larger than allowed",)),
    ("metadata_is_a_pickle", _pickled_metadata, dcp.CorruptCheckpointError, ("not valid JSON",)),
]


class _Creates:
    """Unpickling this creates the file ``path``: the proof that code from a checkpoint ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


@pytest.mark.parametrize("name,make,error,needles", PATH_CASES + SIZE_CASES,
                         ids=[c[0] for c in PATH_CASES + SIZE_CASES])
def test_hostile_metadata_is_refused(base: Path, tmp_path: Path, name: str, make: Callable, error: Any,
                                     needles: tuple[str, ...]) -> None:
    case = Case(base, tmp_path)
    make(case)
    if error is None:
        target = _blank()
        dcp.load(target, checkpoint_id=case.ckpt, no_dist=True)
        assert np.array_equal(target["w"], STATE["w"]) and target["name"] == "x"
        return
    _expect_refusal(case, error, *needles)
    assert not (case.root / "pwned_by_metadata").exists()


# ------------------------------------------------------------------ pickle


def test_pickled_item_never_runs_without_allow_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "ckpt"
    dcp.save({"w": np.ones(3, np.float32), "evil": _Creates(str(marker))}, checkpoint_id=path, no_dist=True,
             planner=dcp.StandardSavePlanner(allow_pickle=True))
    assert not marker.exists()
    for attempt in (
        lambda: dcp.load({"w": np.zeros(3, np.float32), "evil": None}, checkpoint_id=path, no_dist=True),
        lambda: load_checkpoint(path),
    ):
        with pytest.raises(dcp.UnsafeCheckpointError, match="allow_pickle=True") as caught:
            attempt()
        assert "'evil'" in str(caught.value)
        assert not marker.exists()
    assert verify_checkpoint(path).ok and not marker.exists()  # verify hashes bytes, never decodes
    # The payload is live: with allow_pickle the (trusted) caller gets what it asked for.
    dcp.load({"evil": None}, checkpoint_id=path, no_dist=True, planner=dcp.StandardLoadPlanner(allow_pickle=True))
    assert marker.exists()


def test_type_name_switched_to_pickle_is_refused(base: Path, tmp_path: Path) -> None:
    case = Case(base, tmp_path)
    case.edit(lambda d: d["state_dict_metadata"]["name"].update(type="pickle"))
    _expect_refusal(case, dcp.UnsafeCheckpointError, "allow_pickle", "'name'")
    case.edit(lambda d: d["state_dict_metadata"]["name"].update(type="builtins.eval"))
    _expect_refusal(case, dcp.UnsupportedFormatError, "builtins.eval", "'name'")


# ------------------------------------------------------------------ safetensors headers


def _data_file(raw_header: bytes, data: bytes = b"\x00" * 4, length: int | None = None) -> bytes:
    raw_header += b" " * (-len(raw_header) % 8)
    return struct.pack("<Q", len(raw_header) if length is None else length) + raw_header + data


HEADERS: dict[str, bytes] = {
    "length_2_63": _data_file(b"{}", length=2**63),
    "length_past_the_file": _data_file(b"{}", length=4096),
    "too_short": b"\x01\x02",
    "not_json": _data_file(b"{not json"),
    "not_utf8": _data_file(b'{"a\xff":1}'),
    "deeply_nested": _data_file(b"[" * 50_000 + b"]" * 50_000),
    "huge_integer": _data_file(b'{"a":' + b"7" * 5000 + b"}"),
    "not_an_object": _data_file(b"[1,2]"),
    "entry_not_an_object": _data_file(b'{"a":[1]}'),
    "infinite_offset": _data_file(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,1e400]}}'),
    "negative_shape": _data_file(b'{"a":{"dtype":"F32","shape":[-1,-1],"data_offsets":[0,4]}}'),
    "numbers_as_text": _data_file(b'{"a":{"dtype":"F32","shape":["1"],"data_offsets":["0","4"]}}'),
    "unknown_dtype": _data_file(b'{"a":{"dtype":"C64","shape":[1],"data_offsets":[0,4]}}'),
    "three_offsets": _data_file(b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,2,4]}}'),
    "metadata_not_text": _data_file(b'{"__metadata__":{"k":1},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}'),
    "overlap": _data_file(b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
                          b'"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}'),
    "gap": _data_file(b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}'),
    "shape_mismatch": _data_file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}'),
}


@pytest.mark.parametrize("name", sorted(HEADERS))
def test_malformed_safetensors_header(base: Path, tmp_path: Path, name: str) -> None:
    case = Case(base, tmp_path)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(HEADERS[name])
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        read_header(bad)
    assert str(bad) in str(caught.value)
    # The same header on a checkpoint's data file: verify reports it, and a load refuses the file
    # (its header no longer describes the items the metadata places there), changing no target.
    original = (case.ckpt / case.data).read_bytes()
    header_end = 8 + struct.unpack("<Q", original[:8])[0]
    (case.ckpt / case.data).write_bytes(HEADERS[name][:header_end].ljust(header_end, b" ") + original[header_end:])
    report = verify_checkpoint(case.ckpt)
    assert any(p.file == case.data and "header" in p.message for p in report.problems), report.problems
    target = _blank()
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(target, checkpoint_id=case.ckpt, no_dist=True)
    assert case.data in str(caught.value) and "hp-ckpt verify" in str(caught.value)
    assert not target["w"].any() and not target["n"].any(), "a target changed"
    assert target["step"] is None and target["name"] is None


# ------------------------------------------------------------------ allocation, address space capped


def _declare_huge_tensor(case: Case) -> None:
    """A 1 TiB float32 tensor whose chunk and storage entry agree: only the file size gives it away."""
    def change(document: dict) -> None:
        document["state_dict_metadata"]["w"].update(size=[2**38], chunks=[[[0], [2**38]]])
        entry = case.entry(document, "w")
        entry.update(offset=[0], byte_offset=2**41, length=2**40, checksum=None)  # past every other item

    case.edit(change)


def test_declared_sizes_never_allocate(base: Path, tmp_path: Path) -> None:
    cases = []
    huge = Case(base, tmp_path / "huge")
    _declare_huge_tensor(huge)
    cases.append({"name": "load_none", "path": str(huge.ckpt), "how": "load_none"})
    big_header = tmp_path / "big_header.safetensors"
    with open(big_header, "wb") as handle:  # sparse: a 100 MB header of zeros in a 200 MB file
        handle.write(struct.pack("<Q", 100 * 1024 * 1024 - 8))
        handle.truncate(200 * 1024 * 1024)
    cases.append({"name": "header_at_the_limit", "path": str(big_header), "how": "read_header"})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = run_script("hostile_child.py", str(tmp_path / "cases.json"), str(tmp_path / "results.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["load_none"]["type"] == "UnsafeCheckpointError", results["load_none"]
    assert "'w'" in results["load_none"]["message"] and "too large" in results["load_none"]["message"]
    assert results["header_at_the_limit"]["type"] == "CorruptCheckpointError", results["header_at_the_limit"]


def test_one_line_without_target_refuses_declared_sizes(base: Path, tmp_path: Path) -> None:
    huge = Case(base, tmp_path / "huge")
    _declare_huge_tensor(huge)
    (tmp_path / "cases.json").write_text(json.dumps([{"name": "one_line", "path": str(huge.ckpt), "how": "one_line"}]))
    done = run_script("hostile_child.py", str(tmp_path / "cases.json"), str(tmp_path / "results.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())["one_line"]
    assert "CheckpointError" in result["classes"], result
