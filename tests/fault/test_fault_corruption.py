"""Damaged checkpoints: exact values or an error naming the file (and key); never wrong values.

A pristine checkpoint is written by two simulated ranks (row- and
column-sharded float32 tensors, a bf16 MindSpore tensor, int64, plain values,
small checksum blocks so chunks span several). Every trial damages a fresh
copy: one byte XOR-ed, or a file cut short, in a data file or in
``metadata.json``, then loads everything into full-size targets.

Rules:
- data region of a data file: the load raises ``CheckpointError`` naming the
  file and a key stored in it, and ``hp-ckpt verify`` reports it;
- safetensors header of a data file: the loader never reads it (the metadata
  holds absolute offsets), so values load exact; ``hp-ckpt verify`` reports
  every flip that changes the header's meaning;
- ``metadata.json``: the load raises an error naming ``metadata.json`` or the
  data file the damaged entry points at (a flipped offset or digest fails the
  data checksum), or an ``UnsupportedFormatError`` for a flipped version or
  type name, or the values are exact (a flip in a field loading does not use).
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.cli.verify_cmd import verify_checkpoint

TRIALS = 240
W = np.random.default_rng(1).standard_normal((16, 24)).astype(np.float32)
EMB = np.random.default_rng(2).standard_normal((40, 16)).astype(np.float32)
H = np.random.default_rng(3).standard_normal((20, 10))
IDS = np.random.default_rng(4).integers(-(2**60), 2**60, 50, dtype=np.int64)
VALUES = {"step": 7, "lr": 0.25, "name": "run-7", "blob": b"\x00\x01binary", "scale": np.int32(5),
          "betas": [0.9, 0.999]}


def _rank_state(rank: int) -> dict[str, Any]:
    return {
        "w": DTensor.from_global(ms.Tensor(W), Layout((2,), (0, -1)), rank=rank),  # rows
        "emb": DTensor.from_global(ms.Tensor(EMB), Layout((2,), (-1, 0)), rank=rank),  # columns
        "h": ms.Tensor(H, ms.bfloat16),
        "ids": IDS,
        **VALUES,
    }


def _save_two_ranks(path: Path) -> None:
    """The save protocol for ranks 0 and 1 in one process, with 256-byte checksum blocks."""
    writers = [dcp.FileSystemWriter(path, checksum_block_bytes=256) for _ in range(2)]
    planners, plans = [], []
    for rank in range(2):
        planner = dcp.StandardSavePlanner()
        planner.configure_planner(_rank_state(rank), rank=rank, world_size=2, is_coordinator=rank == 0)
        writers[rank].set_up_storage_writer(rank == 0, rank=rank, world_size=2)
        planners.append(planner)
        plans.append(writers[rank].prepare_local_plan(planner.build_local_plan()))
    final, metadata = planners[0].build_global_plan(plans)
    final = writers[0].prepare_global_plan(final)
    results = [writers[rank].write_data(final[rank], planners[rank]).result() for rank in range(2)]
    writers[0].finish(metadata, results)


def _targets() -> dict[str, Any]:
    return {
        "w": np.zeros_like(W),
        "emb": np.zeros_like(EMB),
        "h": ms.Parameter(ms.Tensor(np.zeros(H.shape), ms.bfloat16), name="h"),
        "ids": np.zeros_like(IDS),
        "step": None, "lr": None, "name": None, "blob": None, "scale": None, "betas": [None, None],
    }


def _exact(target: dict[str, Any]) -> bool:
    arrays_ok = (
        target["w"].tobytes() == W.tobytes()
        and target["emb"].tobytes() == EMB.tobytes()
        and target["ids"].tobytes() == IDS.tobytes()
        and target["h"].asnumpy().tobytes() == ms.Tensor(H, ms.bfloat16).asnumpy().tobytes()
    )
    values_ok = all(type(target[k]) is type(v) and target[k] == v for k, v in VALUES.items())
    return arrays_ok and values_ok


def _load(path: Path) -> tuple[str, Any]:
    """Return ("exact", None), ("error", exception) or ("WRONG", description)."""
    target = _targets()
    try:
        dcp.load(target, checkpoint_id=path, no_dist=True)
    except dcp.CheckpointError as exc:
        return "error", exc
    return ("exact", None) if _exact(target) else ("WRONG", "load returned different values without an error")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pristine") / "ckpt"
    _save_two_ranks(path)
    assert _load(path)[0] == "exact" and verify_checkpoint(path).ok
    assert len(list(path.glob("*.safetensors"))) == 2
    return path


def _layout(path: Path) -> tuple[dict[str, int], dict[str, set[str]]]:
    """Each data file's header end, and the keys each file stores."""
    header_end = {}
    for data in path.glob("*.safetensors"):
        raw = data.read_bytes()
        header_end[data.name] = 8 + struct.unpack("<Q", raw[:8])[0]
    keys: dict[str, set[str]] = {}
    for index, info in dcp.read_metadata(path).storage_data.items():
        keys.setdefault(info.relative_path, set()).add(index.fqn)
    return header_end, keys


def _damage(path: Path, rng: random.Random) -> tuple[str, str, int]:
    """Flip one byte or cut one file of ``path``; return (file name, kind, position)."""
    names = sorted(p.name for p in path.iterdir())
    name = "metadata.json" if rng.random() < 0.35 else rng.choice([n for n in names if n.endswith(".safetensors")])
    raw = bytearray((path / name).read_bytes())
    if rng.random() < 0.75:
        position = rng.randrange(len(raw))
        raw[position] ^= rng.randrange(1, 256)
        kind = "flip"
    else:
        position = rng.randrange(len(raw))
        del raw[position:]
        kind = "truncate"
    (path / name).write_bytes(bytes(raw))
    return name, kind, position


def _header_meaning(raw: bytes) -> Any:
    """The header's entries as parsed (``__metadata__`` left out), or None when unparsable."""
    try:
        length = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + length].decode("utf-8"))
        header.pop("__metadata__", None)
        return header, length
    except (ValueError, AttributeError, struct.error):
        return None


def test_random_flips_and_truncations(pristine: Path, tmp_path: Path) -> None:
    rng = random.Random(20240611)
    header_end, keys_in = _layout(pristine)
    data_files = sorted(header_end)
    tally = {"tried": 0, "detected": 0, "exact": 0, "verify_caught": 0}
    failures = []
    for trial in range(TRIALS):
        copy = tmp_path / f"t{trial:03d}"
        shutil.copytree(pristine, copy)
        name, kind, position = _damage(copy, rng)
        outcome, detail = _load(copy)
        tally["tried"] += 1
        where = f"trial {trial}: {kind} of {name} at byte {position}"
        if outcome == "WRONG":
            failures.append(f"{where}: {detail}")
            continue
        if name == "metadata.json":
            if outcome == "error":
                tally["detected"] += 1
                text = str(detail)
                named = "metadata.json" in text or any(f in text for f in data_files)
                if not (named or isinstance(detail, dcp.UnsupportedFormatError)):
                    failures.append(f"{where}: error names no file: {type(detail).__name__}: {text}")
            else:
                tally["exact"] += 1
            continue
        in_header = kind == "flip" and position < header_end[name]
        if in_header:
            original = (pristine / name).read_bytes()
            if _header_meaning((copy / name).read_bytes()) == _header_meaning(original):
                if outcome != "exact":  # the free-form __metadata__ changed: nothing the load uses
                    failures.append(f"{where}: a harmless header change failed the load: {detail}")
                    continue
                tally["exact"] += 1
                continue
            if outcome != "error" or name not in str(detail):
                failures.append(f"{where}: a changed header was not refused naming the file: {outcome} {detail}")
                continue
            tally["detected"] += 1
            report = verify_checkpoint(copy)
            if report.ok or not any(p.file == name for p in report.problems):
                failures.append(f"{where}: hp-ckpt verify missed a header change")
            else:
                tally["verify_caught"] += 1
            continue
        if outcome != "error":
            failures.append(f"{where}: damage in the data region loaded without an error")
            continue
        tally["detected"] += 1
        text = str(detail)
        if name not in text or not any(f"'{key}'" in text for key in keys_in[name]):
            failures.append(f"{where}: error does not name the file and a key: {text}")
        report = verify_checkpoint(copy)
        if not any(p.file == name for p in report.problems):
            failures.append(f"{where}: hp-ckpt verify missed it")
    print(f"corruptions: {tally}")
    assert not failures, "\n".join(failures[:20])
    assert tally["tried"] >= 100 and tally["detected"] >= 100


def test_every_metadata_byte_flipped(pristine: Path, tmp_path: Path) -> None:
    """Exhaustive: each byte of metadata.json with its lowest bit flipped (digits stay digits, mostly)."""
    original = (pristine / "metadata.json").read_bytes()
    copy = tmp_path / "c"
    shutil.copytree(pristine, copy)
    data_files = [p.name for p in pristine.glob("*.safetensors")]
    counts = {"exact": 0, "error": 0}
    failures = []
    for position in range(len(original)):
        raw = bytearray(original)
        raw[position] ^= 0x01
        (copy / "metadata.json").write_bytes(bytes(raw))
        outcome, detail = _load(copy)
        if outcome == "WRONG":
            failures.append(f"byte {position} ({original[position - 10:position + 10]!r}): wrong values")
        elif outcome == "error":
            counts["error"] += 1
            text = str(detail)
            named = "metadata.json" in text or any(f in text for f in data_files)
            if not (named or isinstance(detail, dcp.UnsupportedFormatError)):
                failures.append(f"byte {position}: error names no file: {type(detail).__name__}: {text}")
        else:
            counts["exact"] += 1
    print(f"metadata flips: {len(original)} tried, {counts}")
    assert not failures, "\n".join(failures[:20])


def test_every_header_byte_flipped_is_refused_by_load_and_verify(pristine: Path, tmp_path: Path) -> None:
    """A load reads each data file's header and refuses any change of its meaning, as ``hp-ckpt verify`` does.

    Changes the load may ignore are those of the free-form ``__metadata__``
    (the header stays valid JSON with the same entries).
    """
    name = sorted(p.name for p in pristine.glob("*.safetensors"))[0]
    original = (pristine / name).read_bytes()
    end = 8 + struct.unpack("<Q", original[:8])[0]
    copy = tmp_path / "c"
    shutil.copytree(pristine, copy)
    missed, refused, harmless = [], 0, 0
    for position in range(end):
        for mask in (0x01, 0x20):
            raw = bytearray(original)
            raw[position] ^= mask
            (copy / name).write_bytes(bytes(raw))
            if _header_meaning(bytes(raw)) == _header_meaning(original):
                harmless += 1
                if position % 7 == 0:
                    assert _load(copy)[0] == "exact", position
                continue
            if position % 3 == 0:  # the load refuses it before any target changes, naming the file
                outcome, detail = _load(copy)
                assert outcome == "error" and name in str(detail), (position, outcome, detail)
            report = verify_checkpoint(copy)
            if report.ok or not any(p.file == name for p in report.problems):
                missed.append((position, bytes(raw[max(0, position - 12) : position + 6])))
            else:
                refused += 1
    print(f"header flips: {2 * end} tried, {refused} refused, {harmless} harmless")
    assert not missed, missed[:10]
    assert refused > harmless > 0


# ------------------------------------------------------------ targeted metadata damage


def _edit(path: Path, change: Any) -> None:
    document = json.loads((path / "metadata.json").read_text())
    change(document)
    (path / "metadata.json").write_text(json.dumps(document))


def _entry(document: dict, fqn: str) -> dict:
    return next(e for e in document["storage_data"] if e["fqn"] == fqn)


def _move_chunk(document: dict, fqn: str, old: list[int], new: list[int]) -> None:
    for chunk in document["state_dict_metadata"][fqn]["chunks"]:
        if chunk[0] == old:
            chunk[0] = new
    next(e for e in document["storage_data"] if e["fqn"] == fqn and e["offset"] == old)["offset"] = new


TARGETED = {
    # A str value's length 5 -> 0: the empty payload has no bytes to checksum (was: silently "").
    "value_length_zeroed": lambda d: _entry(d, "name").update(length=0),
    # Renamed key in the items: its storage entries belong to no item (was: MissingKeyError).
    "item_renamed": lambda d: d["state_dict_metadata"].update(wx=d["state_dict_metadata"].pop("w")),
    # Renamed storage entry: the chunk has no storage entry.
    "entry_renamed": lambda d: _entry(d, "ids").update(fqn="idz"),
    # A global shape grown: the chunks no longer tile it (was: ShapeMismatchError blaming the target).
    "size_grown": lambda d: d["state_dict_metadata"]["ids"].update(size=[51]),
    # A chunk's sizes changed: its stored length no longer matches.
    "chunk_sizes_changed": lambda d: d["state_dict_metadata"]["w"]["chunks"][0][1].__setitem__(0, 7),
    # The second row block moved onto the first, in the items and in storage: overlap and a gap.
    "chunks_overlap": lambda d: _move_chunk(d, "w", [8, 0], [4, 0]),
    # Two entries for one chunk (a second "step" pointing at "lr"'s bytes).
    "entry_duplicated": lambda d: _entry(d, "lr").update(fqn="step"),
    # A checksum block count that does not match the length.
    "digest_dropped": lambda d: _entry(d, "w")["checksum"]["digests"].pop(),
    # Unknown checksum algorithm.
    "algorithm_renamed": lambda d: _entry(d, "emb")["checksum"].update(algorithm="crc32"),
}


@pytest.mark.parametrize("case", sorted(TARGETED))
def test_targeted_metadata_damage(pristine: Path, tmp_path: Path, case: str) -> None:
    copy = tmp_path / "c"
    shutil.copytree(pristine, copy)
    _edit(copy, TARGETED[case])
    outcome, detail = _load(copy)
    assert outcome == "error", f"{case}: {outcome} {detail}"
    assert isinstance(detail, dcp.CorruptCheckpointError), detail
    if case == "value_length_zeroed":  # caught by the stored checksum, which names the data file
        assert "'name'" in str(detail) and ".safetensors" in str(detail), detail
    else:
        assert str(copy / "metadata.json") in str(detail), detail
