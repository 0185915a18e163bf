"""The per-tensor shortcuts of a load: each must give what the general path gives, bit for bit.

A plain tensor leaf is classified in one call (``plain_tensor_entry``), a read
item of a key stored whole finds its facts by its key (``check_consistency``'s
``whole`` table), a target's cached numpy view is reused only for the same
tensor, memory and shape, and never when the device path is forced.
"""

from __future__ import annotations

from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _state_items
from hyper_parallel.core.distributed_checkpoint._format.consistency import check_consistency, storage_by_key
from hyper_parallel.core.distributed_checkpoint._read_items import ItemIndex
from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, ReadItem
from hyper_parallel.platform.tensor import DEVICE_COPIES_ENV, writable_views

_DTYPES = [ms.float32, ms.bfloat16, ms.float16, ms.int32, ms.int8, ms.bool_, ms.int64, ms.uint8]


def _values(count: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = [(5,), (2, 3), (), (4, 1, 2), (0,), (7,)]
    return {f"p{i}": np.asarray(rng.standard_normal(shapes[i % len(shapes)]) * 50, np.float32) for i in range(count)}


def _params(values: dict[str, np.ndarray], zero: bool = False) -> dict[str, object]:
    out = {}
    for name, value in values.items():
        i = int(name[1:])  # dtype and kind by the key's number
        tensor = ms.Tensor(np.zeros_like(value) if zero else value, _DTYPES[i % len(_DTYPES)])
        out[name] = ms.Parameter(tensor, name=name) if i % 3 else tensor
    return out


def _bits(state: dict[str, object]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {k: (str(v.asnumpy().dtype), tuple(v.shape), v.asnumpy().tobytes()) for k, v in state.items()}


def test_plain_leaf_entries_equal_make_entry_and_leave_the_rest_to_it() -> None:
    for i, dtype in enumerate(_DTYPES):
        for value in (ms.Tensor(np.ones((2, 3)), dtype), ms.Parameter(ms.Tensor(np.ones(4), dtype), name=f"x{i}")):
            entry = _state_items.plain_tensor_entry("k", value)
            assert entry == _state_items.make_entry("k", value) and entry.local is value
            assert type(entry.global_shape) is tuple and entry.global_shape == tuple(value.shape)
    for array in (np.ones((2, 3), np.float32), np.zeros(4, np.int8), np.array(2.5), np.ones(0, np.bool_)):
        for _ in range(2):  # (the second time from the table of dtypes seen)
            entry = _state_items.plain_tensor_entry("k", array)
            assert entry == _state_items.make_entry("k", array) and entry.local is array
            assert _state_items.plain_dtype_name(array) == entry.dtype == str(array.dtype)
    # Not a plain tensor or writable array of a stored dtype: None, and make_entry classifies it (or refuses,
    # naming the key; a read-only array is the load planner's to refuse, see test_read_only_array_target_...).
    frozen = np.ones(3, np.float32)
    frozen.flags.writeable = False
    objects = np.array([{"a": 1}, None], dtype=object)
    for other in (frozen, objects, np.ones(2, np.complex64), np.ma.masked_array(np.ones(2)), 5, "text", None, {"a": 1}):
        assert _state_items.plain_tensor_entry("k", other) is None
    assert _state_items.plain_dtype_name(frozen) == "float32"  # (a dtype name says nothing about writing)
    assert _state_items.plain_dtype_name(objects) is None and _state_items.plain_dtype_name(5) is None
    for _ in range(2):  # (the second time from the table of dtypes seen)
        assert _state_items.plain_tensor_entry("c", ms.Tensor(np.ones(2, np.complex64))) is None
    with pytest.raises(dcp.UnsupportedTypeError, match="'c'.*complex64"):
        _state_items.make_entry("c", ms.Tensor(np.ones(2, np.complex64)))


def test_loads_of_mixed_dtypes_are_bit_exact_and_refusals_unchanged(tmp_path: Path) -> None:
    values = _values(40, 1)
    saved = _params(values)
    saved["step"] = 7
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    for verify in (False, True):
        targets = _params(values, zero=True)
        targets["step"] = 0
        dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path, verify_checksums=verify), no_dist=True)
        assert targets.pop("step") == 7
        assert _bits(targets) == _bits({k: v for k, v in saved.items() if k != "step"})
    wrong = _params(values, zero=True)
    wrong["p1"] = ms.Parameter(ms.Tensor(np.zeros((3, 2), np.float32)), name="p1")  # stored (2, 3)
    with pytest.raises(dcp.ShapeMismatchError, match="key 'p1'"):
        dcp.load(wrong, checkpoint_id=tmp_path, no_dist=True)
    complex_target = _params(values, zero=True)
    complex_target["p0"] = ms.Tensor(np.zeros(5, np.complex64))
    with pytest.raises(dcp.UnsupportedTypeError, match="p0.*complex64"):
        dcp.load(complex_target, checkpoint_id=tmp_path, no_dist=True)


def _index_items(tmp_path: Path):
    values = _values(12, 2)
    state = _params(values)
    state["note"] = "hello"
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    metadata = dcp.FileSystemReader(tmp_path).read_metadata()
    planner = dcp.StandardLoadPlanner()
    planner.configure_planner(_params(values, zero=True) | {"note": ""}, metadata)
    items = list(planner.build_local_plan().items)
    index = MetadataIndex("p1", (0, 0))  # (2, 3): regions of it, and the whole with offsets spelled as lists
    items += [
        ReadItem(LoadItemType.TENSOR, index, (1, 0), index, (1, 0), (1, 3)),
        ReadItem(LoadItemType.TENSOR, index, (0, 0), index, (0, 0), (2, 2)),
        ReadItem(LoadItemType.TENSOR, MetadataIndex("p1", [0, 0]), [0, 0], MetadataIndex("p1", [0, 0]), [0, 0], [2, 3]),
        ReadItem(LoadItemType.TENSOR, index, (0, 0), index, (0, 0), [2, 3]),
    ]
    return metadata, items


def test_facts_found_by_key_equal_the_full_lookup(tmp_path: Path) -> None:
    metadata, items = _index_items(tmp_path)
    whole: dict = {}
    check_consistency(metadata, whole=whole)
    assert set(whole) == {k for k in metadata.state_dict_metadata if k != "note"}
    full = ItemIndex(metadata)
    by_key = ItemIndex(metadata, whole=whole)
    assert [by_key.facts(item) for item in items] == [full.facts(item) for item in items]
    assert any(facts.small for facts in map(full.facts, items))
    # The plan's whole items need no (key, offset) lookup: with none left, they are found by key alone.
    keyless = ItemIndex(metadata, by_key={}, whole=whole)
    whole_items = [item for item in items[:-4] if item.type is LoadItemType.TENSOR]  # the plan's tensor items
    assert len(whole_items) == 10  # 12 tensors, two of them empty (nothing to read)
    assert [keyless.facts(item) for item in whole_items] == [full.facts(item) for item in whole_items]
    for item in items:
        if item not in whole_items:
            with pytest.raises(dcp.CorruptCheckpointError):
                ItemIndex(metadata, by_key={}, whole=whole).facts(item)
    assert storage_by_key(metadata)  # the full lookup's table is not empty


def _renew(tensor) -> None:
    """Give ``tensor`` new memory of zeros (same object, shape and dtype)."""
    zeros = ms.Tensor(np.zeros(tensor.shape), tensor.dtype)
    if isinstance(tensor, ms.Parameter):
        tensor.set_data(zeros)
    else:
        tensor.assign_value(zeros)


def test_a_target_with_new_memory_or_replaced_is_never_read_through_an_old_view(tmp_path: Path) -> None:
    """Loads reuse a target's cached numpy view; new memory of the same shape (set_data, assign_value), a new
    tensor object at the same key (the old one kept or dropped) must each get the bytes into the tensor the caller
    holds, and no other tensor changes."""
    values = _values(18, 3)
    saved = _params(values)
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    expected = _bits(saved)
    targets = _params(values, zero=True)
    dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
    assert _bits(targets) == expected
    pointers = {name: value.data_ptr() for name, value in targets.items() if value.size}
    for value in targets.values():
        _renew(value)
    assert all(targets[name].data_ptr() != pointer for name, pointer in pointers.items())
    dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
    assert _bits(targets) == expected
    replaced = list(targets)[::2]
    old = {name: targets[name] for name in replaced}
    for name in replaced:  # new objects, same shapes and dtypes; the old ones kept and zeroed
        targets[name] = _params({name: values[name]}, zero=True)[name]
        _renew(old[name])
    dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
    assert _bits(targets) == expected
    assert all(not old[name].asnumpy().any() for name in replaced)
    del old
    for name in list(targets)[1::2]:  # the old objects dropped (their ids may come back)
        targets[name] = None
        targets[name] = _params({name: values[name]}, zero=True)[name]
    dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
    assert _bits(targets) == expected


def test_the_device_path_forced_between_loads_gets_no_cached_view(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = [ms.Parameter(ms.Tensor(np.ones((2, 3), np.float32)), name="a"), ms.Tensor(np.ones(4), ms.bfloat16)]
    shapes = [tuple(t.shape) for t in tensors]
    first = writable_views(tensors, shapes)
    assert all(view is not None and view.__array_interface__["data"][0] == t.data_ptr()
               for view, t in zip(first, tensors))
    assert all(again is view for again, view in zip(writable_views(tensors, shapes), first))  # the cached views
    monkeypatch.setenv(DEVICE_COPIES_ENV, "1")  # every tensor as if in device memory
    assert writable_views(tensors, shapes) == [None, None]
    monkeypatch.delenv(DEVICE_COPIES_ENV)
    _renew(tensors[0])
    renewed = writable_views(tensors, shapes)
    assert renewed[0] is not first[0] and renewed[0].__array_interface__["data"][0] == tensors[0].data_ptr()
    assert renewed[1] is first[1]


class _FlakyPointer(ms.Tensor):
    """A host tensor whose ``data_ptr`` fails once ``fail`` is set."""

    fail = False

    def data_ptr(self) -> int:
        if self.fail:
            raise RuntimeError("no pointer")
        return super().data_ptr()


class _OnDevice(ms.Tensor):
    """A tensor that says it lives in device memory."""

    @property
    def device(self) -> str:
        return "Ascend:0"


def _aliases(view: np.ndarray | None, tensor: object) -> bool:
    return view is not None and view.__array_interface__["data"][0] == tensor.data_ptr()


def test_cached_views_are_taken_column_by_column_only_when_every_check_holds() -> None:
    """A pass whose every target has its cached view (same tensor, memory, shape) takes them at once; any other
    value in the pass (an array, a device tensor, a new memory, another shape, a failing pointer) sends the whole
    pass through the per-tensor checks, which give each value what it alone would get."""
    param = ms.Parameter(ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), name="a")
    bf16 = ms.Tensor(np.ones(4), ms.bfloat16)
    tensors = [param, bf16]
    shapes = [(2, 3), (4,)]
    first = writable_views(tensors, shapes)
    assert all(_aliases(view, t) for view, t in zip(first, tensors))
    again = writable_views(tensors, shapes)
    assert again[0] is first[0] and again[1] is first[1]
    array = np.zeros(3, np.float32)
    frozen = np.zeros(3, np.float32)
    frozen.flags.writeable = False
    mixed = writable_views([param, array, bf16, frozen], [(2, 3), (3,), (4,), (3,)])
    assert mixed[0] is first[0] and mixed[1] is array and mixed[2] is first[1] and mixed[3] is None
    device = _OnDevice(np.ones(3, np.float32))
    assert writable_views([param, device], [(2, 3), (3,)]) == [first[0], None]
    assert writable_views([param, bf16], [(2, 3), None])[1] is first[1]  # a shape not given: the loop's own view
    other_shape = writable_views([param, bf16], [(3, 2), (4,)])  # not the cached view's shape: a fresh look
    assert other_shape[0] is not first[0] and _aliases(other_shape[0], param) and other_shape[1] is first[1]
    _renew(param)  # new memory, same object and shape: a new view of it
    renewed = writable_views(tensors, shapes)
    assert renewed[0] is not first[0] and _aliases(renewed[0], param) and renewed[1] is first[1]
    assert writable_views(tensors, shapes)[0] is renewed[0]
    flaky = _FlakyPointer(np.ones(5, np.float32))
    cached = writable_views([flaky, bf16], [(5,), (4,)])[0]
    assert _aliases(cached, flaky)
    _FlakyPointer.fail = True
    try:
        views = writable_views([flaky, bf16], [(5,), (4,)])  # no pointer: never the cached view unchecked
    finally:
        _FlakyPointer.fail = False
    assert views[1] is first[1] and (views[0] is None or np.shares_memory(views[0], cached))


def test_a_dict_of_parameters_is_flattened_and_walked_at_once_as_leaf_by_leaf() -> None:
    """A dict of distinct Parameters under str keys (the usual state) is flattened column by column, with what
    the walk gives each such leaf; anything else in it (a Parameter twice, another leaf, a key that is no str)
    takes the walk. The layout pass finds no Cell and every Parameter in it at once."""
    from hyper_parallel.core.distributed_checkpoint._flatten import flatten_state_dict
    from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import _parameters, cells_in

    p, q, r = (ms.Parameter(ms.Tensor(np.ones(2, np.float32)), name=n) for n in "pqr")
    state = {"b.c": q, "a": p, "f": r}
    flat = flatten_state_dict(state)
    assert list(flat.values.items()) == [("b.c", q), ("a", p), ("f", r)] and flat.values is not state
    assert flat.paths == {"b.c": ("b.c",), "a": ("a",), "f": ("f",)}
    assert flat.storage_keys == {"b.c": "b.c", "a": "a", "f": "f"}
    assert flat.key_users == {"b.c": ["b.c"], "a": ["a"], "f": ["f"]}
    assert flat.key_users["a"] is not flat.key_users["f"]  # a list of its own each
    assert flat.aliases == {} and flat.sizes == {} and flat.containers == {(): "dict"}
    assert cells_in(state) == () and _parameters(state) == [q, p, r]
    twice = flatten_state_dict({"a": p, "e": p, "f": r})
    assert list(twice.values) == ["a", "f"] and twice.aliases == {"e": "a"}
    tensor = ms.Tensor(np.ones(2, np.float32))
    mixed = flatten_state_dict({"a": p, "t": tensor})
    assert mixed.values == {"a": p, "t": tensor} and mixed.storage_keys == {"a": "a", "t": "t"}
    assert set(_parameters({"a": p, "t": tensor})) == {p}
    with pytest.raises(dcp.CheckpointValueError, match="only str keys"):
        flatten_state_dict({"a": p, 3: q})
    empty = flatten_state_dict({})
    assert empty.values == {} and empty.sizes == {} and cells_in({}) == () and _parameters({}) == []
    net = ms.nn.Dense(2, 2)
    assert cells_in({"net": net}) == (net,) and len(_parameters({"net": net})) == 2


def test_top_level_parameters_flatten_as_every_leaf_does() -> None:
    from hyper_parallel.core.distributed_checkpoint._flatten import flatten_state_dict

    p, q, r = (ms.Parameter(ms.Tensor(np.ones(2, np.float32)), name=n) for n in "pqr")
    flat = flatten_state_dict({"a": p, "b": {"c": q, "d": p}, "e": q, "f": r, "g": [r]})
    assert flat.values == {"a": p, "b.c": q, "f": r}
    assert flat.paths == {"a": ("a",), "b.c": ("b", "c"), "f": ("f",)}
    assert flat.storage_keys == {"a": "a", "b.c": "b.c", "f": "f"}
    assert flat.key_users == {"a": ["a"], "b.c": ["b.c"], "f": ["f"]}
    assert flat.aliases == {"b.d": "a", "e": "b.c", "g.0": "f"}
    sharded = dcp.ShardedTensor.from_rank_offsets("k", np.ones(2, np.float32))
    for state in ({"a": sharded, "k": p}, {"k": p, "a": sharded}):
        with pytest.raises(dcp.CheckpointValueError, match="both map to checkpoint key 'k'"):
            flatten_state_dict(state)
    with pytest.raises(dcp.CheckpointValueError, match="same dotted name 'x.y'"):
        flatten_state_dict({"x.y": p, "x": {"y": q}})
    with pytest.raises(dcp.CheckpointValueError, match="same dotted name 'x.y'"):
        flatten_state_dict({"x": {"y": q}, "x.y": p})


def test_a_dict_of_arrays_and_parameters_flattens_at_once_as_the_walk_does(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain numpy arrays at the top (alone or with Parameters) are flattened column by column, exactly as the walk
    flattens them; the layout pass finds no Cell and only the Parameters. The same array under two keys still
    takes the walk, and its load is still refused (one memory, two stored values)."""
    from hyper_parallel.core.distributed_checkpoint import _flatten
    from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import _parameters, cells_in

    p = ms.Parameter(ms.Tensor(np.ones(2, np.float32)), name="p")
    a, b = np.zeros(3, np.float32), np.array(2.5)
    states = [{"x": a, "y": b}, {"y": b, "p": p, "x": a}, {"x": a, "m": np.ma.masked_array(np.ones(2))}]
    fast = [_flatten.flatten_state_dict(state) for state in states]
    monkeypatch.setattr(_flatten, "_top_level_parameters", lambda state_dict, flat: False)
    for state, flat in zip(states, fast):
        assert flat == _flatten.flatten_state_dict(state)
    monkeypatch.undo()
    assert cells_in(states[1]) == () and _parameters(states[1]) == [p] and _parameters(states[0]) == []
    dcp.save({"x": np.arange(3, dtype=np.float32), "y": np.arange(3, dtype=np.float32) + 1}, checkpoint_id=tmp_path,
             no_dist=True)
    with pytest.raises(dcp.CheckpointValueError, match="'x' and 'y' are the same tensor object"):
        dcp.load({"x": a, "y": a}, checkpoint_id=tmp_path, no_dist=True)
    assert not a.any()
    overlapping = np.zeros(6, np.float32)
    with pytest.raises(dcp.CheckpointValueError, match="overlap"):
        dcp.load({"x": overlapping[:3], "y": overlapping[2:5]}, checkpoint_id=tmp_path, no_dist=True)
    targets = {"x": np.zeros(3, np.float32), "y": np.zeros(3, np.float32)}
    dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
    assert targets["x"].tolist() == [0, 1, 2] and targets["y"].tolist() == [1, 2, 3]


def test_a_parameter_reached_twice_loads_once_bit_exact(tmp_path: Path) -> None:
    shared = ms.Parameter(ms.Tensor(np.arange(6, dtype=np.float32)), name="shared")
    other = ms.Parameter(ms.Tensor(np.arange(4, dtype=np.float32) * 3, ms.bfloat16), name="other")
    dcp.save({"shared": shared, "opt": {"m": shared, "o": other}, "o2": other}, checkpoint_id=tmp_path, no_dist=True)
    assert set(dcp.read_metadata(tmp_path).state_dict_metadata) == {"shared", "opt.o"}
    t_shared = ms.Parameter(ms.Tensor(np.zeros(6, np.float32)), name="shared")
    t_other = ms.Parameter(ms.Tensor(np.zeros(4, np.float32), ms.bfloat16), name="other")
    dcp.load({"shared": t_shared, "opt": {"m": t_shared, "o": t_other}, "o2": t_other}, checkpoint_id=tmp_path,
             no_dist=True)
    assert t_shared.asnumpy().tobytes() == shared.asnumpy().tobytes()
    assert t_other.asnumpy().tobytes() == other.asnumpy().tobytes()


@pytest.mark.parametrize("verify", [False, True])
def test_each_items_facts_are_looked_up_once_per_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      verify: bool) -> None:
    """Several data files: the header check of the second file takes the facts the grouping found (it once
    looked every item of every later file up again)."""
    values = {k: v for k, v in _values(30, 4).items() if v.size}  # (an empty tensor has no read item)
    saved = _params(values)
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=3), no_dist=True)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    calls: list[str] = []
    new_facts = ItemIndex._new_facts

    def counted(self, item):
        calls.append(item.storage_index.fqn)
        return new_facts(self, item)

    lookups: list[str] = []
    facts = ItemIndex.facts

    def looked_up(self, item):
        lookups.append(item.storage_index.fqn)
        return facts(self, item)

    monkeypatch.setattr(ItemIndex, "_new_facts", counted)
    monkeypatch.setattr(ItemIndex, "facts", looked_up)
    # (Priming a file the page cache lacks, a readahead hint, looks its items up one by one: not counted.)
    monkeypatch.setattr(dcp.FileSystemReader, "_prime", lambda *args: None)
    targets = _params(values, zero=True)
    planner = dcp.StandardLoadPlanner()
    dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path, verify_checksums=verify), planner=planner,
             no_dist=True)
    assert _bits(targets) == _bits(saved)
    columns = planner.whole_reads.fqns  # the small whole reads, kept as columns: no item, no facts to look up
    assert len(columns) > len(values) // 2
    assert sorted(calls + columns) == sorted(values)  # once each
    if not verify:  # the header check and the reads take the grouping's lists of facts: no lookup item by item
        assert lookups == []


@pytest.mark.parametrize("heap", [True, False])
def test_metadata_read_into_heap_or_map_decodes_alike_and_refuses_growth(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heap: bool) -> None:
    """Metadata under ``_HEAP_READ_BYTES`` is read into a bytearray, larger into an anonymous map: the same
    records either way; a file longer than its fstat said (it grew while read) and an empty one are refused."""
    from hyper_parallel.core.distributed_checkpoint import _metadata_file

    values = _values(20, 5)
    dcp.save(_params(values), checkpoint_id=tmp_path, no_dist=True)
    expected = dcp.FileSystemReader(tmp_path).read_metadata()
    if not heap:
        monkeypatch.setattr(_metadata_file, "_HEAP_READ_BYTES", 0)
    assert dcp.FileSystemReader(tmp_path).read_metadata() == expected
    real_fstat = _metadata_file.os.fstat

    class _Shorter:
        def __init__(self, fd):
            self.st_size = real_fstat(fd).st_size - 7

    monkeypatch.setattr(_metadata_file.os, "fstat", _Shorter)
    with pytest.raises(dcp.UnsafeCheckpointError, match="grew past the size"):
        dcp.FileSystemReader(tmp_path).read_metadata()
    monkeypatch.setattr(_metadata_file.os, "fstat", real_fstat)
    (tmp_path / "metadata.json").write_bytes(b"")
    with pytest.raises(dcp.CorruptCheckpointError):
        dcp.FileSystemReader(tmp_path).read_metadata()


def test_a_sliced_parameter_is_found_among_thousands(tmp_path: Path) -> None:
    from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import _any_sliced

    params = [ms.Parameter(ms.Tensor(np.ones(2, np.float32)), name=f"w{i}") for i in range(50)]
    assert not _any_sliced(params) and not _any_sliced([])
    params[37].sliced = True
    assert _any_sliced(params) and _any_sliced([object(), params[37]]) and not _any_sliced([object()])
    with pytest.raises(dcp.SlicedParameterError, match="w37"):
        dcp.save({p.name: p for p in params}, checkpoint_id=tmp_path, no_dist=True)
    # Among plain arrays too (a dict of Parameters and arrays is walked column by column): refused on save and
    # on load, nothing written into the targets.
    mixed = {f"a{i}": np.zeros(2, np.float32) for i in range(20)} | {"w37": params[37]}
    with pytest.raises(dcp.SlicedParameterError, match="w37"):
        dcp.save(mixed, checkpoint_id=tmp_path / "mixed", no_dist=True)
    plain = {f"a{i}": np.full(2, i, np.float32) for i in range(20)} | {"w37": ms.Parameter(
        ms.Tensor(np.full(2, 7, np.float32)), name="w37")}
    dcp.save(plain, checkpoint_id=tmp_path / "plain", no_dist=True)
    with pytest.raises(dcp.SlicedParameterError, match="w37"):
        dcp.load(mixed, checkpoint_id=tmp_path / "plain", no_dist=True)
    assert not any(mixed[f"a{i}"].any() for i in range(20)) and params[37].asnumpy().tolist() == [1, 1]


def test_read_only_array_target_and_dtype_refusals_hold_for_plain_arrays(tmp_path: Path) -> None:
    """Plain numpy targets take the one-call entry: a read-only one is still refused before any target changes,
    arrays of another dtype still load as the general path loads them (bit exact against it), and
    ``load_checkpoint`` still refuses a float checkpoint into an int array."""
    values = {f"a{i}": np.arange(6, dtype=np.float32).reshape(2, 3) * (i + 1) for i in range(30)}
    dcp.save(values, checkpoint_id=tmp_path, no_dist=True)
    targets = {name: np.zeros((2, 3), np.float32) for name in values}
    targets["a7"].flags.writeable = False
    with pytest.raises(dcp.CheckpointValueError, match="'a7'.*read-only"):
        dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
    assert not any(target.any() for target in targets.values())
    targets["a7"] = np.zeros((2, 3), np.float32)
    targets["a3"] = np.zeros((2, 3), np.float16)  # another float dtype: converted
    dcp.load(targets, checkpoint_id=tmp_path, no_dist=True)
    for name, value in values.items():
        np.testing.assert_array_equal(targets[name], value.astype(targets[name].dtype))
    counters = {"a1": np.zeros((2, 3), np.int32), "a2": np.zeros((2, 3), np.float32)}
    with pytest.raises(dcp.CheckpointValueError, match="key 'a1': stored as float32, the target 'a1' is int32"):
        hyper_parallel.load_checkpoint(tmp_path, counters)
    assert not counters["a1"].any() and not counters["a2"].any()
    dcp.save({"step": 3}, checkpoint_id=tmp_path / "values", no_dist=True)
    with pytest.raises(dcp.CheckpointValueError, match="'step': the target is a tensor but the checkpoint stores a"):
        hyper_parallel.load_checkpoint(tmp_path / "values", {"step": np.zeros(1, np.int64)})
    loaded = hyper_parallel.load_checkpoint(tmp_path, {"a2": counters["a2"], "a4": ms.Parameter(
        ms.Tensor(np.zeros((2, 3), np.float32)), name="a4")})
    np.testing.assert_array_equal(counters["a2"], values["a2"])
    np.testing.assert_array_equal(loaded["a4"].asnumpy(), values["a4"])


def test_a_tensor_whose_dtype_changed_in_its_own_memory_is_not_read_through_its_old_view(tmp_path: Path) -> None:
    """``assign_value`` of a bitcast (``p.view(ms.int32)``) keeps a Parameter's memory and shape and changes its
    dtype: the cached float32 view was reused, so a save stored the int32 Parameter as float32 values and a load
    wrote float32 bits of the stored ints into it, silently. The view is renewed on a change of dtype (the save's
    layout pass, a load's column check and its per-tensor loop)."""
    params = [ms.Parameter(ms.Tensor(np.arange(4, dtype=np.float32) + i), name=f"p{i}") for i in range(3)]
    state = {f"p{i}": p for i, p in enumerate(params)}
    dcp.save(state, checkpoint_id=tmp_path / "float", no_dist=True)  # caches the float32 views
    dcp.load(state, checkpoint_id=tmp_path / "float", no_dist=True)
    for p in params:
        pointer = p.data_ptr()
        p.assign_value(p.view(ms.int32))
        assert p.dtype == ms.int32 and p.data_ptr() == pointer and tuple(p.shape) == (4,)
    bits = {name: p.asnumpy().copy() for name, p in state.items()}
    dcp.save(state, checkpoint_id=tmp_path / "int", no_dist=True)
    assert {e.properties.dtype for e in dcp.read_metadata(tmp_path / "int").state_dict_metadata.values()} == {"int32"}
    loaded = {name: np.zeros(4, np.int32) for name in state}
    dcp.load(loaded, checkpoint_id=tmp_path / "int", no_dist=True)
    assert all(np.array_equal(loaded[name], bits[name]) for name in state)
    ints = {name: np.arange(4, dtype=np.int32) * (i + 2) for i, name in enumerate(state)}
    dcp.save(ints, checkpoint_id=tmp_path / "ints", no_dist=True)
    dcp.load(state, checkpoint_id=tmp_path / "ints", no_dist=True)  # column check: every target has a cached view
    assert all(p.dtype == ms.int32 and np.array_equal(p.asnumpy(), ints[name]) for name, p in state.items())
    views = writable_views(params, [(4,)] * 3)
    for p in params:  # back to float32 in the same memory, then the per-tensor loop (an array in the pass)
        p.assign_value(p.view(ms.float32))
    mixed = writable_views([*params, np.zeros(2, np.float32)], [(4,)] * 3 + [(2,)])
    assert all(view is None or (view.dtype == np.float32 and view is not old) for view, old in zip(mixed, views))
    dcp.load(state, checkpoint_id=tmp_path / "float", no_dist=True)
    assert all(np.array_equal(p.asnumpy(), np.arange(4, dtype=np.float32) + i) for i, p in enumerate(params))


def test_fresh_dtype_objects_keep_their_names_and_the_name_table_bounded(tmp_path: Path) -> None:
    """A big-endian or structured numpy dtype is a new object per array: each used to stay in the dtype name
    table for good (1,000 arrays: 1,000 entries). The table now stops at its bound, every array still gets its
    own dtype's name (never a name looked up for another dtype object, whatever ids are reused), and a state of
    such arrays saves and loads bit-exact."""
    for _ in range(2 * _state_items._MAX_DTYPE_NAMES):
        big = np.arange(3, dtype=np.float32).astype(np.dtype(np.float32).newbyteorder(">"))
        wide = np.arange(3, dtype=np.int64).astype(np.dtype(np.int64).newbyteorder(">"))
        record = np.zeros(3, dtype=[("a", "<f4"), ("b", "<i4")])
        assert _state_items.plain_dtype_name(big) == "float32" and _state_items.plain_dtype_name(wide) == "int64"
        assert _state_items.plain_dtype_name(record) is None
        assert _state_items.plain_tensor_entry("k", wide).dtype == "int64"
    assert len(_state_items._DTYPE_NAMES) <= _state_items._MAX_DTYPE_NAMES
    assert _state_items.plain_dtype_name(np.zeros(2, np.float16)) == "float16"
    state = {f"w{i}": np.arange(4, dtype=np.dtype(kind).newbyteorder(">")) * (i + 1)
             for i, kind in enumerate(("f4", "i8", "f8", "i4") * 80)}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    target = {key: np.zeros(4, dtype=value.dtype.newbyteorder("=")) for key, value in state.items()}
    dcp.load(target, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    for key, value in state.items():
        assert target[key].dtype == value.dtype and np.array_equal(target[key], value), key
    assert len(_state_items._DTYPE_NAMES) <= _state_items._MAX_DTYPE_NAMES
