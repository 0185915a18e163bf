"""The flat load path: whole host targets planned in one step and read straight into their memory.

Every load is checked bit for bit; failing loads are checked to leave every
target as it was. The fast metadata decode is checked against the full one.
"""

from __future__ import annotations

import json
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _reader_headers
from hyper_parallel.core.distributed_checkpoint._format import header_check, metadata_json, safetensors_file, storage_entry
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import (
    SAFETENSORS_DTYPES,
    HeaderEntry,
    build_header,
)
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType

_SHAPES = [(7,), (), (0,), (3, 5), (2, 0), (1,), (4, 2, 3)]
_KINDS = ["parameter", "tensor", "numpy"]
_DTYPES = [(ms.float32, np.float32), (ms.bfloat16, None), (ms.int32, np.int32), (ms.float16, np.float16),
           (ms.bool_, np.bool_), (ms.int8, np.int8)]


def _target(i: int, values: np.ndarray, zero: bool):
    """Target ``i``: a Parameter, a plain Tensor or a numpy array (bf16 only as a tensor), of mixed dtypes."""
    ms_dtype, np_dtype = _DTYPES[i % len(_DTYPES)]
    kind = _KINDS[i % len(_KINDS)]
    data = np.zeros_like(values) if zero else values
    if kind == "numpy" and np_dtype is not None:
        return data.astype(np_dtype)
    tensor = ms.Tensor(data, ms_dtype)
    return ms.Parameter(tensor, name=f"p{i}") if kind != "tensor" else tensor


def _state(count: int, zero: bool = False) -> dict[str, object]:
    rng = np.random.default_rng(7)
    return {f"blk{i}.w": _target(i, np.asarray(rng.standard_normal(_SHAPES[i % len(_SHAPES)]) * 9, np.float32), zero)
            for i in range(count)}


def _bits(state: dict[str, object]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    out = {}
    for name, value in state.items():
        array = value if isinstance(value, np.ndarray) else value.asnumpy()
        out[name] = (str(array.dtype), tuple(array.shape), array.tobytes())
    return out


class _Recording(dcp.StandardLoadPlanner):
    """A subclass overriding acquire_tensor: the reader must call it for every tensor item."""

    def __init__(self) -> None:
        super().__init__()
        self.acquired: list[str] = []

    def acquire_tensor(self, read_item, shared=True):
        self.acquired.append(read_item.dest_index.fqn)
        return super().acquire_tensor(read_item, shared)


@pytest.mark.parametrize("threads", [1, 2])
def test_mixed_targets_load_bit_exact_through_the_direct_path(tmp_path: Path, threads: int) -> None:
    saved = _state(63)
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=threads), no_dist=True)
    targets = _state(63, zero=True)
    memory = {name: (v if isinstance(v, np.ndarray) else v.asnumpy()) for name, v in targets.items()}
    for verify in (True, False):
        planner = dcp.StandardLoadPlanner()
        reader = dcp.FileSystemReader(tmp_path, thread_count=threads, verify_checksums=verify)
        dcp.load(targets, storage_reader=reader, planner=planner, no_dist=True)
        assert _bits(targets) == _bits(saved)
        direct = {item.dest_index.fqn for item, _ in planner.direct_targets().values()}
        columns = planner.whole_reads  # the small whole reads, kept as columns (no ReadItem each)
        nonempty = {name for name, v in saved.items() if np.prod(np.shape(v.asnumpy() if not isinstance(v, np.ndarray) else v))}
        assert len(columns) > 40 and not direct & set(columns.fqns)
        assert direct | set(columns.fqns) == nonempty  # every non-empty target read straight into its memory
        for item, target in planner.direct_targets().values():
            assert item.type == LoadItemType.TENSOR and target.flags.c_contiguous and target.flags.writeable
        for target in columns.views:
            assert target.flags.c_contiguous and target.flags.writeable
        for name, value in targets.items():  # in place: the same memory holds the values
            now = value if isinstance(value, np.ndarray) else value.asnumpy()
            assert np.shares_memory(now, memory[name]) or now.size == 0, name


def test_a_planner_overriding_acquire_tensor_gets_every_item(tmp_path: Path) -> None:
    saved = _state(21)
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    targets = _state(21, zero=True)
    planner = _Recording()
    dcp.load(targets, checkpoint_id=tmp_path, planner=planner, no_dist=True)
    assert _bits(targets) == _bits(saved)
    assert planner.direct_targets() == {}
    nonempty = sorted(name for name, v in _bits(saved).items() if v[2])
    assert sorted(planner.acquired) == nonempty


def test_shared_reads_take_the_general_path(tmp_path: Path) -> None:
    saved = _state(14)
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    targets = _state(14, zero=True)
    planner = dcp.StandardLoadPlanner(single_replica_read=True)
    dcp.load(targets, checkpoint_id=tmp_path, planner=planner, no_dist=True)
    assert _bits(targets) == _bits(saved)
    assert planner._exchange is not None and planner.direct_targets() == {}  # pylint: disable=protected-access


@pytest.mark.parametrize("threads", [1, 2])
def test_a_corrupt_byte_mid_run_changes_no_target_and_names_key_and_file(tmp_path: Path, threads: int) -> None:
    saved = {f"n{i:03d}": _target(i, np.arange(24, dtype=np.float32) - i, zero=False) for i in range(90)}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=threads), no_dist=True)
    victim = "n046"
    info = dcp.read_metadata(tmp_path).storage_data[dcp.MetadataIndex(victim, (0,))]
    path = tmp_path / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    path.write_bytes(bytes(data))
    targets = {k: _target(i, np.full(24, 5, np.float32), zero=False) for i, k in enumerate(saved)}
    sentinel = _bits(targets)
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path, thread_count=threads), no_dist=True)
    assert f"key '{victim}'" in str(caught.value) and info.relative_path in str(caught.value)
    assert _bits(targets) == sentinel


def test_a_header_entry_of_another_shape_mid_file_changes_no_target(tmp_path: Path) -> None:
    values = {f"s{i:02d}": np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(30)}
    dcp.save({k: ms.Parameter(ms.Tensor(v), name=k) for k, v in values.items()}, checkpoint_id=tmp_path,
             no_dist=True)
    info = dcp.read_metadata(tmp_path).storage_data[dcp.MetadataIndex("s17", (0, 0))]
    path = tmp_path / info.relative_path
    data = path.read_bytes()
    damaged = data.replace(b'"s17":{"dtype":"F32","shape":[2,3]', b'"s17":{"dtype":"F32","shape":[3,2]', 1)
    assert damaged != data and len(damaged) == len(data)
    path.write_bytes(damaged)
    targets = {k: ms.Parameter(ms.Tensor(np.zeros((2, 3), np.float32)), name=k) for k in values}
    with pytest.raises(dcp.CorruptCheckpointError, match=r"key 's17'.*shape \[2, 3\].*shape \[3, 2\]") as caught:
        dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path, verify_checksums=False), no_dist=True)
    assert info.relative_path in str(caught.value) and "hp-ckpt verify" in str(caught.value)
    assert all(not p.asnumpy().any() for p in targets.values())


def test_header_entries_are_the_header_spans() -> None:
    spans = {"a": ("F32", [2, 3], 0, 24), "b@4,0": ("BF16", [1], 24, 26)}
    raw = _safetensors_bytes(spans)
    entries = header_check.header_entries("f", len(raw), lambda n, o: raw[o:o + n], keys=["a"])
    found = header_check.header_spans("f", len(raw), lambda n, o: raw[o:o + n], keys=["a"])
    assert {k: header_check.HeaderSpan(*v) for k, v in entries.items()} == found
    start = len(raw) - 26
    assert entries == {start: (24, "a", "F32", (2, 3)), start + 24: (2, "b@4,0", "BF16", (1,))}


def _safetensors_bytes(spans: dict[str, tuple[str, list[int], int, int]]) -> bytes:
    """A safetensors file (header and zero data) holding ``spans``."""
    header = {name: {"dtype": d, "shape": s, "data_offsets": [b, e]} for name, (d, s, b, e) in spans.items()}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    end = max(e for _, _, _, e in spans.values())
    return len(text).to_bytes(8, "little") + text + bytes(end)


def _slow_decode(monkeypatch: pytest.MonkeyPatch, raw: bytes) -> dcp.Metadata:
    with monkeypatch.context() as patch:
        patch.setattr(storage_entry, "_flat_checked_entry", lambda raw, shared: None)
        patch.setattr(metadata_json, "_whole_tensor_key", lambda raw: None)
        patch.setattr(metadata_json, "plain_text", lambda data: False)  # no decode by runs either
        return metadata_json.metadata_from_json(raw)


def test_fast_metadata_decode_equals_the_full_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state(40)
    for rank in range(2):  # one key stored as two chunks (the full decode's path)
        state[f"part{rank}"] = dcp.ShardedTensor.from_rank_offsets("half", np.ones((2, 3), np.float32), (0, rank, 2))
    state["value"] = {"step": 3}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, compression="zstd"), no_dist=True)
    dcp.save(_state(12), checkpoint_id=tmp_path / "plain", no_dist=True)
    for root in (tmp_path, tmp_path / "plain"):
        raw = (root / "metadata.json").read_bytes()
        assert metadata_json.metadata_from_json(raw) == _slow_decode(monkeypatch, raw)


@pytest.mark.parametrize("change,error", [
    (lambda d: d["state_dict_metadata"]["blk45.w"].update(size=[3.0, 5]), dcp.CorruptCheckpointError),
    (lambda d: d["state_dict_metadata"]["blk45.w"]["chunks"][0].__setitem__(1, [3, 5.0]), dcp.CorruptCheckpointError),
    (lambda d: d["state_dict_metadata"]["blk45.w"]["chunks"][0].__setitem__(0, [False, 0]), dcp.CorruptCheckpointError),
    (lambda d: d["state_dict_metadata"]["blk45.w"].update(size=[3, -5]), dcp.CorruptCheckpointError),
    (lambda d: d["state_dict_metadata"]["blk45.w"].update(dtype="float99"), dcp.CorruptCheckpointError),
    (lambda d: d["storage_data"][-1].update(offset=[0.0]), dcp.CorruptCheckpointError),
    (lambda d: d["storage_data"][-1].update(length=True), dcp.CorruptCheckpointError),
    (lambda d: d["storage_data"][-1].update(byte_offset=-8), dcp.CorruptCheckpointError),
    (lambda d: d["storage_data"][-1].update(length=1 << 60), dcp.UnsafeCheckpointError),
    (lambda d: d["storage_data"][-1]["checksum"].update(digests=[7]), dcp.CorruptCheckpointError),
    (lambda d: d["storage_data"][-1]["checksum"].update(block_bytes=0), dcp.CorruptCheckpointError),
    (lambda d: d["storage_data"][-1].update(file="../outside.safetensors"), dcp.UnsafeCheckpointError),
])
def test_fast_metadata_decode_refuses_what_the_full_one_refuses(tmp_path: Path, change, error) -> None:
    """Entries after the first of their dtype and shape, or of their file, take the fast path: it refuses the same."""
    dcp.save(_state(60), checkpoint_id=tmp_path, no_dist=True)
    document = json.loads((tmp_path / "metadata.json").read_bytes())
    items = document["state_dict_metadata"]
    assert items["blk45.w"] == items["blk3.w"]  # blk45.w repeats blk3.w's dtype and shape: decoded by the fast path
    last = document["storage_data"][-1]
    assert any(entry["file"] == last["file"] for entry in document["storage_data"][:-1])
    change(document)
    with pytest.raises(error):
        metadata_json.metadata_from_json(json.dumps(document, separators=(",", ":")).encode())


def test_a_target_given_new_data_between_loads_is_read_into_its_new_memory(tmp_path: Path) -> None:
    """Views are cached per tensor: new data (another shape or the same) must not reuse the old view."""
    dcp.save({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, checkpoint_id=tmp_path / "a", no_dist=True)
    dcp.save({"w": np.arange(6, dtype=np.float32) * 2}, checkpoint_id=tmp_path / "b", no_dist=True)
    param = ms.Parameter(ms.Tensor(np.zeros((3, 4), np.float32)), name="w")
    dcp.load({"w": param}, checkpoint_id=tmp_path / "a", no_dist=True)
    assert np.array_equal(param.asnumpy(), np.arange(12, dtype=np.float32).reshape(3, 4))
    param.set_data(ms.Tensor(np.zeros(6, np.float32)))
    dcp.load({"w": param}, checkpoint_id=tmp_path / "b", no_dist=True)
    assert np.array_equal(param.asnumpy(), np.arange(6, dtype=np.float32) * 2)
    param.set_data(ms.Tensor(np.full(6, 9, np.float32)))
    dcp.load({"w": param}, checkpoint_id=tmp_path / "b", no_dist=True)
    assert np.array_equal(param.asnumpy(), np.arange(6, dtype=np.float32) * 2)


def _header_damaged(tmp_path: Path, count: int, damage) -> tuple[dict[str, np.ndarray], str]:
    """``count`` float32 (2, 3) Parameters saved in one file; ``damage`` edits the header bytes (same length)."""
    values = {f"s{i:02d}": np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(count)}
    dcp.save({k: ms.Parameter(ms.Tensor(v), name=k) for k, v in values.items()}, checkpoint_id=tmp_path,
             no_dist=True)
    info = dcp.read_metadata(tmp_path).storage_data[dcp.MetadataIndex("s17", (0, 0))]
    path = tmp_path / info.relative_path
    data = path.read_bytes()
    damaged = damage(data, info.offset - (8 + int.from_bytes(data[:8], "little")))
    assert damaged != data and len(damaged) == len(data)
    path.write_bytes(damaged)
    return values, info.relative_path


def _swap_ranges(data: bytes, begin: int) -> bytes:
    """s17 and s18 trade byte ranges in the header (it still tiles the file)."""
    mine, theirs = f'"data_offsets":[{begin},{begin + 24}]'.encode(), f'"data_offsets":[{begin + 24},{begin + 48}]'.encode()
    end = 8 + int.from_bytes(data[:8], "little")
    header = data[:end].replace(mine, b"<mine>", 1).replace(theirs, mine, 1).replace(b"<mine>", theirs, 1)
    return header + data[end:]


@pytest.mark.parametrize("damage,shown", [
    (lambda data, _: data.replace(b'"s17":{"dtype":"F32"', b'"s17":{"dtype":"I32"', 1), r"F32.*I32"),
    (lambda data, _: data.replace(b'"s17":{"dtype":"F32","shape":[2,3]', b'"s17":{"dtype":"F32","shape":[6,1]', 1),
     r"shape \[2, 3\].*shape \[6, 1\]"),
    (_swap_ranges, r"'s17'.*'s18'"),
])
@pytest.mark.parametrize("verify,threads", [(False, 1), (True, 2)])
def test_a_header_entry_disagreeing_mid_file_is_refused_by_the_whole_file_check(
        tmp_path: Path, damage, shown: str, verify: bool, threads: int) -> None:
    """Another dtype, shape or byte range of one entry mid-file: the whole-file comparison fails, the entry by
    entry check names the key and the file, and no target changes."""
    values, relative = _header_damaged(tmp_path, 40, damage)
    targets = {k: ms.Parameter(ms.Tensor(np.full((2, 3), 5, np.float32)), name=k) for k in values}
    reader = dcp.FileSystemReader(tmp_path, verify_checksums=verify, thread_count=threads)
    with pytest.raises(dcp.CorruptCheckpointError, match=r"key 's17'.*" + shown) as caught:
        dcp.load(targets, storage_reader=reader, no_dist=True)
    assert relative in str(caught.value) and "nothing was loaded" in str(caught.value)
    assert all((p.asnumpy() == 5).all() for p in targets.values())


def test_an_intact_file_is_checked_by_one_comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = {f"s{i:02d}": np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(40)}
    dcp.save({k: ms.Parameter(ms.Tensor(v), name=k) for k, v in values.items()}, checkpoint_id=tmp_path,
             no_dist=True)
    entry_by_entry = []
    monkeypatch.setattr(_reader_headers, "header_entries", lambda *a, **k: entry_by_entry.append(a))
    targets = {k: ms.Parameter(ms.Tensor(np.zeros((2, 3), np.float32)), name=k) for k in values}
    dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
    assert entry_by_entry == [] and all(np.array_equal(targets[k].asnumpy(), v) for k, v in values.items())


def test_header_is_exactly_accepts_only_the_writers_header_of_every_row() -> None:
    entries = [HeaderEntry("a", "float32", (2, 3), 24), HeaderEntry("b\u00e9", "bfloat16", (1,), 2),
               HeaderEntry("c", "int8", (), 1)]
    header, offsets = build_header(entries, {"format": "x", "k": "v\""}, align=64)
    size = offsets[-1] + 1
    text = header[8:]
    rows = [(o, e.nbytes, e.name, SAFETENSORS_DTYPES[e.dtype], e.shape) for o, e in zip(offsets, entries)]
    assert header_check.header_is_exactly(text, size, rows)
    assert not header_check.header_is_exactly(text, size, rows[:2])  # a partial read: rows do not tile the file
    assert not header_check.header_is_exactly(text, size + 1, rows)  # the file holds more than the header says
    assert not header_check.header_is_exactly(text, size, [rows[0], rows[1][:3] + ("F16", (1,)), rows[2]])
    assert not header_check.header_is_exactly(text, size, [rows[0], rows[1][:2] + ("b", "BF16", (1,)), rows[2]])
    assert not header_check.header_is_exactly(text, size, [rows[0], rows[1][:4] + ((2,),), rows[2]])
    assert not header_check.header_is_exactly(text.replace(b'"b', b'"x', 1), size, rows)
    assert not header_check.header_is_exactly(text.replace(b'"v\\""', b'"v"', 1), size, rows)  # not JSON there
    assert not header_check.header_is_exactly(text.replace(b'"k":"v\\""', b'"k":"\\u0076\\""', 1), size, rows)
    assert not header_check.header_is_exactly(b"\xff" + text[1:], size, rows)
    assert not header_check.header_is_exactly(b'{"other":1' + text[10:], size, rows)


def test_the_cheap_records_equal_their_classes_own() -> None:
    """Records built without their frozen ``__init__`` (one per tensor) equal, hash and pickle as the usual ones."""
    import dataclasses
    import pickle

    from hyper_parallel.core.distributed_checkpoint import _read_items, _state_items
    from hyper_parallel.core.distributed_checkpoint._whole_reads import whole_read_item
    from hyper_parallel.core.distributed_checkpoint.planner import ReadItem

    index = dcp.MetadataIndex("w", (4, 0), 0)
    item = whole_read_item("w", (4, 0), (2, 3))
    usual = ReadItem(LoadItemType.TENSOR, index, (0, 0), index, (0, 0), (2, 3))
    assert item == usual and hash(item) == hash(usual) and pickle.loads(pickle.dumps(item)) == usual
    assert item.dest_index is item.storage_index and item.dest_index.index == 0 and repr(item) == repr(usual)
    assert set(vars(item)) == {f.name for f in dataclasses.fields(ReadItem)}
    for value in (ms.Parameter(ms.Tensor(np.ones((2, 3), np.float32)), name="w"), ms.Tensor(np.ones(4), ms.bfloat16),
                  np.ones((2, 1), np.int8)):
        entry = _state_items.make_entry("w", value)
        shape = tuple(value.shape)
        usual = _state_items.TensorEntry("w", entry.dtype, shape, (_state_items.TensorPiece((0,) * len(shape), shape),),
                                         value, shape, True, False, True)
        assert entry == usual and type(entry) is _state_items.TensorEntry and len(entry) == len(usual._fields)
        assert entry._asdict() == usual._asdict()
    assert _state_items.make_entry("w", ms.Tensor(np.ones(2), ms.bfloat16)).dtype == "bfloat16"
    with pytest.raises(dcp.UnsupportedTypeError, match="key 'c'.*complex64"):
        _state_items.make_entry("c", ms.Tensor(np.ones(2, np.complex64)))
    facts = _read_items._new_tuple(_read_items.ItemFacts, (None, None, (2,), 4, 8, True))  # pylint: disable=protected-access
    assert facts == _read_items.ItemFacts(None, None, (2,), 4, 8, True) and facts.small and facts.nbytes == 8


def _whole_entry(document: dict, fqn: str) -> dict:
    return next(entry for entry in document["storage_data"] if entry["fqn"] == fqn)


@pytest.mark.parametrize("change,message", [
    (lambda d: _whole_entry(d, "blk45.w")["checksum"]["digests"].append("0" * 16), r"key 'blk45.w'.*2 checksums listed"),
    (lambda d: _whole_entry(d, "blk45.w")["checksum"].update(algorithm="crc32"), r"key 'blk45.w'.*unknown checksum"),
    (lambda d: _whole_entry(d, "blk45.w")["checksum"].update(block_shape=[1, 1]), r"key 'blk45.w'.*1 checksums listed for the 15 block"),
    (lambda d: _whole_entry(d, "blk45.w").update(length=_whole_entry(d, "blk45.w")["length"] - 4),
     r"key 'blk45.w'.*stores \d+ bytes"),
    (lambda d: _whole_entry(d, "blk45.w").update(fqn="blk45.x"), r"key 'blk45.w'.*no storage entry"),
    (lambda d: _whole_entry(d, "blk45.w").update(byte_offset=_whole_entry(d, "blk42.w")["byte_offset"] + 4),
     r"inside the bytes of key"),
])
def test_the_whole_chunk_consistency_path_refuses_what_the_full_one_refuses(tmp_path: Path, change, message) -> None:
    """Whole one-chunk keys take a short consistency check; any doubt falls to the full one and its message."""
    from hyper_parallel.core.distributed_checkpoint._format import consistency

    dcp.save(_state(60), checkpoint_id=tmp_path, no_dist=True)
    document = json.loads((tmp_path / "metadata.json").read_bytes())
    consistency.check_consistency(metadata_json.metadata_from_json(json.dumps(document).encode()))
    change(document)
    with pytest.raises(dcp.CorruptCheckpointError, match=message):
        consistency.check_consistency(metadata_json.metadata_from_json(json.dumps(document).encode()))


def test_the_one_header_spelling_is_json_dumps_and_opens_in_safetensors(tmp_path: Path) -> None:
    """``header_json`` (the writer's and the whole-header check's one builder) against independent references:
    the json module's compact spelling, and the safetensors library reading a file built with it."""
    from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel

    spans = {"w": ("float32", (2, 3), 0, 24), "b\u00e9\"\\x": ("int8", (), 24, 25), "e": ("float16", (0, 4), 25, 25),
             "\U0001f600": ("int32", (1,), 25, 29)}
    file_metadata = {"format": "pt", "k": "v\"\u00e9"}
    reference = json.dumps({"__metadata__": file_metadata, **{
        name: {"dtype": SAFETENSORS_DTYPES[d], "shape": list(s), "data_offsets": [b, e]}
        for name, (d, s, b, e) in spans.items()}}, separators=(",", ":"))
    assert safetensors_file.header_json(
        file_metadata, [(n, SAFETENSORS_DTYPES[d], s, b, e) for n, (d, s, b, e) in spans.items()]) == reference
    header = safetensors_file.header_bytes(spans, file_metadata, align=64)
    assert header[8:].rstrip(b" ") == reference.encode("ascii") and len(header) % 64 == 0
    values = np.arange(29, dtype=np.uint8)
    (tmp_path / "f.safetensors").write_bytes(header + values.tobytes())
    loaded = load_file(str(tmp_path / "f.safetensors"))
    assert np.array_equal(loaded["w"], values[:24].view(np.float32).reshape(2, 3))
    assert loaded["b\u00e9\"\\x"] == np.int8(24) and loaded["e"].shape == (0, 4)
    assert np.array_equal(loaded["\U0001f600"], values[25:29].view(np.int32))
