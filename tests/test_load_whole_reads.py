"""The standard planner's small whole reads kept as columns (``_whole_reads``): the plan still lists every
ReadItem for whoever asks, custom planners and readers get the items they always got, and the filesystem
reader checks, verifies and reads the columns as it does items (header, checksums, truncation, priming).

Every load is checked bit for bit against the values saved; failing loads leave every target as it was.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _reader_verify
from hyper_parallel.core.distributed_checkpoint._whole_reads import SMALL_WHOLE_BYTES, WholeReadPlan
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan

ms.set_device("CPU")


def _state(zero: bool = False) -> dict[str, object]:
    """Small Parameters (float32, bf16, int8), a large one, a numpy target of another dtype, a 0-d and an empty
    tensor, and a value: the plan mixes column rows with items of every other kind."""
    rng = np.random.default_rng(5)
    state: dict[str, object] = {}
    for i in range(30):
        values = rng.standard_normal((i % 4 + 1, 6)).astype(np.float32) * 9
        dtype = (ms.float32, ms.bfloat16, ms.int8)[i % 3]
        state[f"p{i:02d}"] = ms.Parameter(ms.Tensor(np.zeros_like(values) if zero else values, dtype), name=f"p{i:02d}")
        if i == 10:
            big = rng.standard_normal((SMALL_WHOLE_BYTES // 4 // 64 + 1, 64)).astype(np.float32)
            state["big"] = ms.Parameter(ms.Tensor(np.zeros_like(big) if zero else big), name="big")
            cast = rng.standard_normal((3, 2)).astype(np.float32)
            state["cast"] = np.zeros((3, 2), np.float64) if zero else cast  # a float64 target of float32 bytes
            state["scalar"] = ms.Parameter(ms.Tensor(0.0 if zero else 2.5, ms.float32), name="scalar")
            state["empty"] = ms.Parameter(ms.Tensor(np.zeros((0, 3), np.float32)), name="empty")
            state["step"] = 0 if zero else 7
    return state


def _bits(state: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, value in state.items():
        if isinstance(value, int):
            out[name] = value
            continue
        array = value if isinstance(value, np.ndarray) else value.asnumpy()
        out[name] = (tuple(array.shape), array.astype(np.float64).tobytes())
    return out


@pytest.fixture(name="saved")
def _saved(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    state = _state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "ckpt", thread_count=2), no_dist=True)
    return tmp_path / "ckpt", _bits(state)


def _plans(path: Path, state: dict[str, object]) -> tuple[dcp.StandardLoadPlanner, LoadPlan, LoadPlan]:
    """A standard planner, its plan (columns) and a subclass's plan (no columns) of the same load."""

    class Subclass(dcp.StandardLoadPlanner):
        pass

    metadata = dcp.read_metadata(path)
    planners = (dcp.StandardLoadPlanner(), Subclass())
    for planner in planners:
        planner.configure_planner(state, metadata)
    return planners[0], planners[0].build_local_plan(), planners[1].build_local_plan()


def test_the_plan_lists_every_item_a_subclass_would_in_the_same_order(saved) -> None:
    path, _ = saved
    state = _state(zero=True)
    planner, plan, items_plan = _plans(path, state)
    assert type(plan) is WholeReadPlan and type(items_plan) is LoadPlan
    smalls = {name for name, value in state.items() if name.startswith("p") or name == "scalar"}
    assert set(planner.whole_reads.fqns) == smalls  # neither the large, the cast, the empty tensor nor the value
    assert len(plan.rest) == len(items_plan.items) - len(smalls)
    assert plan.items == items_plan.items  # made on first access: the same ReadItems, in the same order
    assert [item.dest_index.fqn for item in plan.items] == [item.dest_index.fqn for item in items_plan.items]
    assert plan.items is plan.items  # made once
    assert plan == items_plan and items_plan == plan and hash(plan) == hash(items_plan)
    assert plan != items_plan.items and plan != dataclasses.replace(items_plan, planner_data=1)
    assert repr(plan).startswith("WholeReadPlan(items=(ReadItem(")
    # Each item made from a row is a direct target of the planner, with the row's view.
    direct = planner.direct_targets()
    for item in plan.items:
        if item.dest_index.fqn in smalls:
            found, view = direct[id(item)]
            assert found is item and item.type == LoadItemType.TENSOR and view.flags.c_contiguous
            assert np.shares_memory(view, state[item.dest_index.fqn].asnumpy())


def test_the_plan_pickles_and_replaces_as_a_plain_load_plan(saved) -> None:
    path, _ = saved
    _, plan, items_plan = _plans(path, _state(zero=True))
    copy = pickle.loads(pickle.dumps(plan))
    assert type(copy) is LoadPlan and copy == items_plan
    changed = dataclasses.replace(plan, planner_data="x")
    assert changed.items == items_plan.items and changed.planner_data == "x" and changed.rest == items_plan.items
    assert plan.planner_data is None and plan.storage_data is None


def test_a_plan_without_its_values_keeps_its_columns_and_order(saved) -> None:
    """``load`` reads the values first, then the plan without them (``_load_engine._without``)."""
    path, _ = saved
    planner, plan, items_plan = _plans(path, _state(zero=True))
    values = planner.value_reads(plan)
    assert [item.dest_index.fqn for item in values.items] == ["step"]
    left = plan.without({id(item) for item in values.items} | {id(plan.rest[0])})
    assert type(left) is WholeReadPlan and left.whole is plan.whole
    dropped = {"step", plan.rest[0].dest_index.fqn}
    assert left.items == tuple(item for item in items_plan.items if item.dest_index.fqn not in dropped)


@pytest.mark.parametrize("verify", [True, False])
def test_columns_load_bit_exact_in_place(saved, verify: bool) -> None:
    path, expected = saved
    state = _state(zero=True)
    memory = {name: value.asnumpy() for name, value in state.items() if isinstance(value, ms.Tensor)}
    planner = dcp.StandardLoadPlanner()
    reader = dcp.FileSystemReader(path, verify_checksums=verify, thread_count=2)
    dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    assert _bits(state) == expected
    assert len(planner.whole_reads) == 31
    for name, before in memory.items():
        assert np.shares_memory(before, state[name].asnumpy()) or before.size == 0, name
    assert reader.bytes_read == sum((path / f).stat().st_size for f in os.listdir(path)
                                    if f.endswith(".safetensors")) - _headers(path)


def _headers(path: Path) -> int:
    """Bytes of the data files that are not chunks (the safetensors headers)."""
    metadata = dcp.read_metadata(path)
    files = {info.relative_path for info in metadata.storage_data.values()}
    return sum((path / f).stat().st_size for f in files) - sum(i.length for i in metadata.storage_data.values())


def test_a_reader_of_objects_reads_the_items(saved, monkeypatch: pytest.MonkeyPatch) -> None:
    """A FileSystemReader subclass overriding a per-file method (as the object storage reader does) gets items."""
    path, expected = saved
    seen: list[int] = []

    class Reader(dcp.FileSystemReader):
        def _read_groups(self, work, planner):  # pylint: disable=arguments-renamed
            seen.append(sum(len(items) for group in work for _, items in group))
            return super()._read_groups(work, planner)

    state = _state(zero=True)
    dcp.load(state, storage_reader=Reader(path), no_dist=True)
    assert _bits(state) == expected and seen == [1, 33]  # the value first, then every tensor region as an item


@pytest.mark.parametrize("verify", [True, False])
def test_a_header_disagreeing_on_a_column_row_changes_no_target(saved, verify: bool) -> None:
    path, _ = saved
    info = dcp.read_metadata(path).storage_data[dcp.MetadataIndex("p07", (0, 0))]
    data_file = path / info.relative_path
    data = data_file.read_bytes()
    damaged = data.replace(b'"p07":{"dtype":"BF16","shape":[4,6]', b'"p07":{"dtype":"BF16","shape":[6,4]', 1)
    assert damaged != data
    data_file.write_bytes(damaged)
    state = _state(zero=True)
    before = _bits(state)
    with pytest.raises(dcp.CorruptCheckpointError, match=r"key 'p07'.*\[6, 4\]") as caught:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path, verify_checksums=verify), no_dist=True)
    assert info.relative_path in str(caught.value)
    assert _bits(state) == before


def test_a_damaged_column_chunk_is_named_and_changes_no_target(saved) -> None:
    path, expected = saved
    info = dcp.read_metadata(path).storage_data[dcp.MetadataIndex("p13", (0, 0))]
    data_file = path / info.relative_path
    with open(data_file, "r+b") as handle:
        handle.seek(info.offset + 3)
        byte = handle.read(1)
        handle.seek(info.offset + 3)
        handle.write(bytes([byte[0] ^ 0x40]))
    state = _state(zero=True)
    before = _bits(state)
    with pytest.raises(dcp.CorruptCheckpointError, match=r"key 'p13'") as caught:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    assert info.relative_path in str(caught.value)
    assert _bits(state) == before
    dcp.load(state, storage_reader=dcp.FileSystemReader(path, verify_checksums=False), no_dist=True)
    loaded = _bits(state)
    assert loaded["p13"] != expected["p13"] and {k: v for k, v in loaded.items() if k != "p13"} == {
        k: v for k, v in expected.items() if k != "p13"}


def test_a_truncated_file_of_column_rows_is_refused(saved) -> None:
    path, _ = saved
    metadata = dcp.read_metadata(path)
    last = max(metadata.storage_data.items(), key=lambda pair: (pair[1].relative_path, pair[1].offset))
    data_file = path / last[1].relative_path
    os.truncate(data_file, last[1].offset + 1)
    for verify in (True, False):
        state = _state(zero=True)
        before = _bits(state)
        with pytest.raises(dcp.CorruptCheckpointError, match=last[1].relative_path):
            dcp.load(state, storage_reader=dcp.FileSystemReader(path, verify_checksums=verify), no_dist=True)
        assert _bits(state) == before


def test_a_cold_file_of_column_rows_only_is_primed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file holding only small whole chunks (every one a column row, no item) is primed over their bytes."""
    rng = np.random.default_rng(3)
    rows = SMALL_WHOLE_BYTES // 4 // 256
    state = {f"m{i:02d}": ms.Parameter(ms.Tensor(rng.standard_normal((rows, 256)).astype(np.float32)), name=f"m{i:02d}")
             for i in range(20)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=1), no_dist=True)
    expected = {name: value.asnumpy().tobytes() for name, value in state.items()}
    metadata = dcp.read_metadata(tmp_path)
    infos = list(metadata.storage_data.values())
    (data_file,) = {info.relative_path for info in infos}
    primed: list[tuple[int, int]] = []
    real_prime = _reader_verify.prime

    def recording(source, start, end):
        primed.append((start, end))
        return real_prime(source, start, end)

    monkeypatch.setattr(_reader_verify, "prime", recording)
    targets = {name: ms.Parameter(ms.Tensor(np.zeros((rows, 256), np.float32)), name=name) for name in state}
    assert (tmp_path / data_file).read_bytes()  # warm: in the page cache
    dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    assert primed == []
    cached = _reader_verify.page_cached
    monkeypatch.setattr(_reader_verify, "page_cached", lambda source, offset: False)  # as if cold
    planner = dcp.StandardLoadPlanner()
    dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path), planner=planner, no_dist=True)
    assert {name: value.asnumpy().tobytes() for name, value in targets.items()} == expected
    assert len(planner.whole_reads) == 20 and data_file and cached is not None
    assert primed == [(min(i.offset for i in infos), max(i.offset + i.length for i in infos))]


def test_a_file_cut_short_after_its_check_fails_the_read_naming_a_key(saved) -> None:
    """The read pass reads what the verify pass checked; a file truncated while it reads ends a run early.
    (Truncated between the passes, the load fails before the read pass: test_kept_files.)"""
    path, _ = saved
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))

    class Cutting(dcp.FileSystemReader):
        def _read_groups(self, work, planner):  # the read pass, after its check that no file changed
            for name in files:
                os.truncate(path / name, 4096 + 8)
            return super()._read_groups(work, planner)

    # (without the value and the large tensor: the first read after the check is of column rows)
    state = {name: value for name, value in _state(zero=True).items() if name not in ("step", "big")}
    with pytest.raises(dcp.CorruptCheckpointError, match=r"is truncated while reading key '(p\d\d|scalar)'"):
        dcp.load(state, storage_reader=Cutting(path, verify_checksums=False), no_dist=True)


@pytest.mark.parametrize("damage", ["brace", "length"])
def test_a_header_that_does_not_parse_names_the_column_keys(saved, damage: str) -> None:
    path, _ = saved
    data_file = path / dcp.read_metadata(path).storage_data[dcp.MetadataIndex("p05", (0, 0))].relative_path
    data = bytearray(data_file.read_bytes())
    if damage == "brace":
        data[8:9] = b"["  # the JSON object's opening brace
    else:
        data[0:8] = (len(data) * 2).to_bytes(8, "little")  # a header longer than the file
    data_file.write_bytes(bytes(data))
    state = _state(zero=True)
    before = _bits(state)
    with pytest.raises(dcp.CorruptCheckpointError, match=r"the file holds key\(s\) 'cast', 'p00', 'p01'"):  # items and column rows
        dcp.load(state, storage_reader=dcp.FileSystemReader(path, verify_checksums=False), no_dist=True)
    assert _bits(state) == before


def test_metadata_placing_a_column_row_past_the_file_end_is_refused(saved) -> None:
    """A forged offset the header check meets entry by entry (the whole-file comparison fails first)."""
    path, _ = saved
    metadata = dcp.read_metadata(path)
    info = metadata.storage_data[dcp.MetadataIndex("p05", (0, 0))]
    size = (path / info.relative_path).stat().st_size
    text = (path / "metadata.json").read_text()
    entry = f'"fqn":"p05","offset":[0,0],"file":"{info.relative_path}","byte_offset":{info.offset},'
    assert text.count(entry) == 1
    (path / "metadata.json").write_text(text.replace(entry, entry.replace(str(info.offset), str(size + 64))))
    state = _state(zero=True)
    before = _bits(state)
    with pytest.raises(dcp.CorruptCheckpointError, match=r"p05"):
        dcp.load(state, storage_reader=dcp.FileSystemReader(path, verify_checksums=False), no_dist=True)
    assert _bits(state) == before


def test_reader_classes_made_on_the_fly_are_freed(tmp_path) -> None:
    """The reader-class cache of the column path does not keep a class alive after its last load."""
    import gc
    import weakref

    dcp.save({"w": np.arange(4, dtype=np.float32)}, checkpoint_id=tmp_path)
    made = type("OnTheFly", (dcp.FileSystemReader,), {})
    target = {"w": np.zeros(4, np.float32)}
    dcp.load(target, storage_reader=made(tmp_path))
    np.testing.assert_array_equal(target["w"], np.arange(4, dtype=np.float32))
    alive = weakref.ref(made)
    del made
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("verify", [True, False])
def test_a_load_leaves_nothing_for_the_garbage_collector(saved, verify: bool) -> None:
    """Every record of a load (its entries, plan, columns, metadata) is freed by reference counting as the load
    returns: none waits in a reference cycle for the cyclic collector, which would walk and free them all at its
    next run (the planner and its columns formed one: 19,280 objects per load of 1,750 Parameters, about 1.5 us
    per tensor). Also a load into a Cell, whose Parameters are reached through the network."""
    import gc
    from collections import Counter

    from mindspore import nn

    path, expected = saved
    net = nn.SequentialCell([nn.Dense(3, 3) for _ in range(3)])
    dcp.save({"model": net}, checkpoint_id=path.parent / "net", no_dist=True)
    saved_net = {name: param.asnumpy().copy() for name, param in net.parameters_and_names()}
    for param in net.get_parameters():
        param.set_data(ms.Tensor(np.zeros(param.shape, np.float32)))
    loads = {
        "state": (_state(zero=True), path),
        "net": ({"model": net}, path.parent / "net"),
    }
    for label, (state, where) in loads.items():
        enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(where, verify_checksums=verify), no_dist=True)
            gc.set_debug(gc.DEBUG_SAVEALL)  # keep what a collection finds unreachable, to name it
            found = gc.collect()
            kinds = Counter(type(obj).__name__ for obj in gc.garbage).most_common(5)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            if enabled:
                gc.enable()
        assert found == 0, f"{label}: {found} objects left in cycles: {kinds}"
    assert _bits(loads["state"][0]) == expected
    for name, param in net.parameters_and_names():
        np.testing.assert_array_equal(param.asnumpy(), saved_net[name])
