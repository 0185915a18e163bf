"""A load of many small tensors: per-item facts looked up once, targets found in one pass, runs read at once.

Every load here is checked bit for bit against the values saved; the failing
loads are checked to leave every target as it was.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._format import json_stream, metadata_json
from hyper_parallel.core.distributed_checkpoint._read_items import SMALL_ITEM_BYTES, ItemIndex
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, ReadItem
from hyper_parallel.platform.tensor import DEVICE_COPIES_ENV, writable_views

_SHAPES = [(5, 3), (), (0,), (7,), (2, 0, 3), (1, 1), (33,), (4, 4, 2)]
_DTYPES = [ms.float32, ms.bfloat16, ms.float16, ms.int32, ms.bool_, ms.int8, ms.float64]


def _values(count: int, seed: int) -> dict[str, np.ndarray]:
    """Mixed shapes (0-d and empty included) and dtypes; float values as float32 before the cast."""
    rng = np.random.default_rng(seed)
    return {f"layer{i}.w": rng.standard_normal(_SHAPES[i % len(_SHAPES)]).astype(np.float32) * 10 for i in range(count)}


def _state(values: dict[str, np.ndarray], zero: bool = False) -> dict[str, ms.Parameter]:
    state = {}
    for i, (name, array) in enumerate(values.items()):
        dtype = _DTYPES[i % len(_DTYPES)]
        tensor = ms.Tensor(np.zeros_like(array) if zero else array, dtype)
        state[name] = ms.Parameter(tensor, name=name)
    return state


def _bits(state: dict[str, ms.Parameter]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {name: (str(p.dtype), tuple(p.shape), p.asnumpy().tobytes()) for name, p in state.items()}


@pytest.mark.parametrize("threads", [1, 2])
def test_many_mixed_small_tensors_load_bit_exact_in_place(tmp_path: Path, threads: int) -> None:
    saved = _state(_values(240, seed=1))
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=threads), no_dist=True)
    targets = _state(_values(240, seed=1), zero=True)
    before = {name: p.asnumpy() for name, p in targets.items()}  # CPU views: the load writes into them
    for verify in (True, False):
        for p in targets.values():
            p.asnumpy()[...] = 0
        reader = dcp.FileSystemReader(tmp_path, thread_count=threads, verify_checksums=verify)
        dcp.load(targets, storage_reader=reader, no_dist=True)
        assert _bits(targets) == _bits(saved)
    for name, p in targets.items():  # in place: the same memory holds the values
        assert np.shares_memory(before[name], p.asnumpy()) or p.asnumpy().size == 0


def test_numpy_cast_and_readonly_free_targets_mix_with_batched_ones(tmp_path: Path) -> None:
    values = {f"v{i}": np.arange(12, dtype=np.float32).reshape(3, 4) + i for i in range(30)}
    dcp.save({k: ms.Tensor(v) for k, v in values.items()}, checkpoint_id=tmp_path, no_dist=True)
    targets: dict[str, object] = {}
    for i, name in enumerate(values):
        if i % 3 == 0:
            targets[name] = np.zeros((3, 4), np.float32)  # a numpy target: read in place
        elif i % 3 == 1:
            targets[name] = ms.Parameter(ms.Tensor(np.zeros((3, 4), np.float16)), name=name)  # a cast
        else:
            targets[name] = ms.Parameter(ms.Tensor(np.zeros((3, 4), np.float32)), name=name)
    dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
    for name, target in targets.items():
        got = target if isinstance(target, np.ndarray) else target.asnumpy()
        assert np.array_equal(got, values[name].astype(got.dtype)), name


def test_partial_load_fills_matched_keys_only(tmp_path: Path) -> None:
    values = _values(60, seed=2)
    saved = _state(values)
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    wanted = {name: p for i, (name, p) in enumerate(_state(values, zero=True).items()) if i % 4 == 1}
    wanted["not.saved"] = ms.Parameter(ms.Tensor(np.full((3,), 7, np.float32)), name="not.saved")
    planner = dcp.StandardLoadPlanner(allow_partial_load=True)
    dcp.load(wanted, checkpoint_id=tmp_path, planner=planner, no_dist=True)
    got = _bits(wanted)
    assert got.pop("not.saved")[2] == np.full((3,), 7, np.float32).tobytes()
    expected = _bits(saved)
    assert got == {name: expected[name] for name in got}


def test_resharded_small_targets_read_their_region(tmp_path: Path) -> None:
    """Targets asking a part of a stored chunk take the general path, with the same values."""
    full = {f"t{i}": np.arange(40, dtype=np.float32).reshape(8, 5) * (i + 1) for i in range(12)}
    dcp.save({k: ms.Tensor(v) for k, v in full.items()}, checkpoint_id=tmp_path, no_dist=True)
    shards = {k: dcp.ShardedTensor.from_rank_offsets(k, np.zeros((4, 5), np.float32), (0, 1, 2)) for k in full}
    dcp.load(shards, checkpoint_id=tmp_path, no_dist=True)
    for k, shard in shards.items():
        assert np.array_equal(shard.data, full[k][4:]), k


def _flip(tmp_path: Path, key: str, offset: tuple[int, ...], at: int = 1) -> str:
    info = dcp.read_metadata(tmp_path).storage_data[dcp.MetadataIndex(key, offset)]
    path = tmp_path / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + at] ^= 0x10
    path.write_bytes(bytes(data))
    return info.relative_path


@pytest.mark.parametrize("threads", [1, 2])
def test_corruption_inside_a_run_of_small_items_changes_no_target(tmp_path: Path, threads: int) -> None:
    values = {f"k{i:03d}": np.arange(16, dtype=np.float32) + i for i in range(200)}
    dcp.save({k: ms.Tensor(v) for k, v in values.items()}, checkpoint_id=tmp_path, no_dist=True)
    middle = "k101"  # adjacent to others in its file: inside one preadv run
    file_name = _flip(tmp_path, middle, (0,))
    targets = {k: ms.Parameter(ms.Tensor(np.full(16, -1, np.float32)), name=k) for k in values}
    sentinel = _bits(targets)
    with pytest.raises(dcp.CorruptCheckpointError) as caught:
        dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path, thread_count=threads), no_dist=True)
    assert f"key '{middle}'" in str(caught.value) and file_name in str(caught.value)
    assert _bits(targets) == sentinel  # all or nothing per load
    # Without verification the damaged bytes load, every other key exactly.
    dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path, verify_checksums=False), no_dist=True)
    for k, v in values.items():
        assert (targets[k].asnumpy().tobytes() == v.tobytes()) == (k != middle), k


def test_header_disagreeing_in_the_middle_of_a_file_changes_no_target(tmp_path: Path) -> None:
    values = {f"h{i:02d}": np.arange(6, dtype=np.float32) + i for i in range(40)}
    dcp.save({k: ms.Tensor(v) for k, v in values.items()}, checkpoint_id=tmp_path, no_dist=True)
    info = dcp.read_metadata(tmp_path).storage_data[dcp.MetadataIndex("h20", (0,))]
    path = tmp_path / info.relative_path
    data = path.read_bytes()
    damaged = data.replace(b'"h20":{"dtype":"F32"', b'"h20":{"dtype":"I32"', 1)  # same size, another dtype
    assert damaged != data
    path.write_bytes(damaged)
    targets = {k: ms.Parameter(ms.Tensor(np.zeros(6, np.float32)), name=k) for k in values}
    for verify in (True, False):
        with pytest.raises(dcp.CorruptCheckpointError, match=r"key 'h20'.*I32") as caught:
            dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path, verify_checksums=verify), no_dist=True)
        assert info.relative_path in str(caught.value)
        assert all(not p.asnumpy().any() for p in targets.values())


def test_device_copy_targets_load_the_same_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = _values(40, seed=5)
    saved = _state(values)
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    monkeypatch.setenv(DEVICE_COPIES_ENV, "1")  # every tensor through host buffers and region copies
    targets = _state(values, zero=True)
    dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
    assert _bits(targets) == _bits(saved)


def test_writable_views_alias_host_memory_or_say_none(monkeypatch: pytest.MonkeyPatch) -> None:
    param = ms.Parameter(ms.Tensor(np.arange(6, dtype=np.float32)), name="p")
    bf16 = ms.Parameter(ms.Tensor(np.arange(4, dtype=np.float32), ms.bfloat16), name="q")
    frozen = np.zeros(3, np.float32)
    frozen.flags.writeable = False
    free = np.zeros(3, np.float32)
    views = writable_views([param, bf16, frozen, free, "text"])
    views[0][2] = 40.0
    assert param.asnumpy()[2] == 40.0
    assert views[1].dtype.itemsize == 2 and views[1].size == 4
    assert views[2] is None and views[3] is free and views[4] is None
    monkeypatch.setenv(DEVICE_COPIES_ENV, "1")
    assert writable_views([param, free]) == [None, free]


def test_item_facts_tell_small_whole_chunks_from_the_rest(tmp_path: Path) -> None:
    big = np.zeros(SMALL_ITEM_BYTES // 4 + 1, np.float32)
    state = {"small": ms.Tensor(np.ones((4, 3), np.float32)), "big": ms.Tensor(big),
             "top": dcp.ShardedTensor.from_rank_offsets("half", np.ones((2, 3), np.float32), (0, 0, 2)),
             "bottom": dcp.ShardedTensor.from_rank_offsets("half", np.ones((2, 3), np.float32), (0, 1, 2)),
             "scalar": ms.Tensor(np.float32(2.5)), "note": "a value"}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    metadata = dcp.read_metadata(tmp_path)
    index = ItemIndex(metadata)

    def item(fqn: str, offset: tuple[int, ...], storage_offsets: tuple[int, ...], lengths: tuple[int, ...],
             kind: LoadItemType = LoadItemType.TENSOR) -> ReadItem:
        key = dcp.MetadataIndex(fqn, offset)
        return ReadItem(kind, key, (0,) * len(lengths), key, storage_offsets, lengths)

    small = index.facts(item("small", (0, 0), (0, 0), (4, 3)))
    assert small.small and small.sizes == (4, 3) and small.itemsize == 4 and small.nbytes == 48
    assert index.facts(item("small", (0, 0), (0, 0), (4, 3))).small  # another item object: looked up again
    part = index.facts(item("small", (0, 0), (1, 0), (2, 3)))
    assert not part.small and part.nbytes == 24
    assert not index.facts(item("big", (0,), (0,), big.shape)).small
    half = index.facts(item("half", (2, 0), (0, 0), (2, 3)))
    assert half.small and half.sizes == (2, 3)
    scalar = index.facts(item("scalar", (), (), ()))
    assert scalar.small and scalar.nbytes == 4
    note = index.facts(item("note", (), (), (), LoadItemType.BYTE_IO))
    assert not note.small and note.sizes is None and note.nbytes == note.info.length > 0
    with pytest.raises(dcp.CorruptCheckpointError, match=r"key 'half': chunk at offset \[1, 0\] has no storage"):
        index.facts(item("half", (1, 0), (0, 0), (2, 3)))


def test_zstd_compressed_small_items_take_the_general_path(tmp_path: Path) -> None:
    pytest.importorskip("zstandard")
    values = {f"z{i}": np.arange(50, dtype=np.float32) % 3 + i for i in range(20)}
    writer = dcp.FileSystemWriter(tmp_path, compression="zstd")
    dcp.save({k: ms.Tensor(v) for k, v in values.items()}, storage_writer=writer, no_dist=True)
    targets = {k: ms.Parameter(ms.Tensor(np.zeros(50, np.float32)), name=k) for k in values}
    dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
    assert all(np.array_equal(targets[k].asnumpy(), v) for k, v in values.items())


def _document(entries: int) -> bytes:
    """Metadata of ``entries`` one-chunk tensors and a value, in the writer's compact form."""
    state = {f"m.{i}": np.full((2, 3), i, np.float32) for i in range(entries)}
    state["step"] = 7
    with tempfile.TemporaryDirectory() as directory:
        dcp.save(state, checkpoint_id=directory, no_dist=True)
        return (Path(directory) / "metadata.json").read_bytes()


def _decoded(data: bytes, batch: int, monkeypatch: pytest.MonkeyPatch) -> object:
    """The decoded metadata, or the message of the error it raises, with members decoded ``batch`` per JSON call."""
    monkeypatch.setattr(json_stream, "_BATCH", batch)
    try:
        return metadata_json.metadata_from_json(data)
    except dcp.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("batch", [1, 2, 3, 7])
def test_batched_metadata_decode_equals_member_by_member(monkeypatch: pytest.MonkeyPatch, batch: int) -> None:
    data = _document(40)
    reference = _decoded(data, 10**9, monkeypatch)  # no batch: member by member
    assert isinstance(reference, dcp.Metadata) and len(reference.storage_data) == 41
    assert _decoded(data, batch, monkeypatch) == reference
    document = json.loads(data)
    first = next(iter(document["state_dict_metadata"]))
    hostile = [
        # A key and a type name holding the boundaries; a nested object starting with "fqn" in an entry.
        data.replace(b'"m.5"', b'"m.5},\\"x\\":{\\"fqn\\":"', 2),
        data.replace(b'"kind":"tensor"', b'"kind":"tensor","x":{"fqn":1},"y":[{"a":1},{"fqn":2}]', 3),
        # A duplicate key whose first member is bad: member by member names it; so must a batch.
        data.replace(b'{"' + first.encode() + b'":', b'{"' + first.encode() + b'":{"kind":"nope"},"'
                     + first.encode() + b'":', 1),
        data.replace(b'"length":24', b'"length":-1', 1),
        data.replace(b'},{"fqn":', b'}, {"fqn":', 5),  # other spacing
        data.replace(b'},{"fqn":', b'},{"fqn":[', 1),  # bad JSON inside a batch
    ]
    for text in hostile:
        assert text != data
        assert _decoded(text, batch, monkeypatch) == _decoded(text, 10**9, monkeypatch)
