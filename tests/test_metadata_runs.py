"""The metadata's regular entries decoded by runs (``_format.regular_runs``) equal the full decode, and every
file the full decode refuses is refused by the same error, however it is damaged inside a run."""

from __future__ import annotations

import importlib.util
import json
import tracemalloc
from pathlib import Path
from typing import Callable

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._format import metadata_json, regular_runs
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError


def _state() -> dict[str, object]:
    """Parameters of every usual form: fp32 and bf16, scalars, empty, 2-D wide (tile checksums), values."""
    rng = np.random.default_rng(3)
    state: dict[str, object] = {}
    shapes = [(6, 4), (5,), (), (0, 3), (3, 2, 2), (1,)]
    for i in range(60):
        shape = shapes[i % len(shapes)]
        values = np.asarray(rng.standard_normal(shape), np.float32)
        tensor = ms.Tensor(values, ms.bfloat16) if i % 2 else ms.Tensor(values)
        state[f"layer{i // 6}.p{i % 6}"] = ms.Parameter(tensor, name=f"layer{i // 6}.p{i % 6}")
    state["wide"] = ms.Parameter(ms.Tensor(np.ones((64, 4096), np.float32)), name="wide")  # tile checksums
    state["long"] = np.arange(3000, dtype=np.float32)  # several flat blocks with checksum_block_bytes=4096
    for rank in range(3):  # one key stored as three chunks
        state[f"part{rank}"] = dcp.ShardedTensor.from_rank_offsets("half", np.full((2, 3), rank, np.float32),
                                                                   (0, rank, 3))
    state["step"] = 7
    state["name"] = "run"
    state["more"] = {"lr": 0.5, "betas": [0.9, 0.99]}
    for i in range(60, 80):  # a second run after the values
        state[f"tail.p{i}"] = ms.Parameter(ms.Tensor(np.full((4,), i, np.float32), ms.bfloat16), name=f"tail.p{i}")
    return state


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("runs")
    state = _state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(root / "plain", checksum_block_bytes=4096), no_dist=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(root / "zstd", compression="zstd"), no_dist=True)
    tensors = {key: value for key, value in state.items() if isinstance(value, ms.Parameter) and key != "wide"}
    dcp.save(tensors, checkpoint_id=root / "tensors", no_dist=True)  # every entry of the usual form
    return {name: (root / name / "metadata.json").read_bytes() for name in ("plain", "zstd", "tensors")}


def _full(raw: bytes) -> dcp.Metadata:
    """The member-by-member decode, without runs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metadata_json, "plain_text", lambda data: False)
        return metadata_json.metadata_from_json(raw)


def _by_runs(raw: bytes) -> tuple[dcp.Metadata, list[str]]:
    """Decode ``raw`` and say which members runs decoded (``items``, ``storage``)."""
    used: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        for name, label in (("items_run", "items"), ("storage_run", "storage")):
            real = getattr(regular_runs, name)
            patch.setattr(regular_runs, name, lambda *args, _real=real, _label=label: (
                lambda out: (used.append(_label) if out is not None else None, out)[1])(_real(*args)))
        return metadata_json.metadata_from_json(raw), used


@pytest.mark.parametrize("kind", ["plain", "zstd", "tensors"])
def test_runs_decode_equals_the_full_decode(saved: dict[str, bytes], kind: str) -> None:
    raw = saved[kind]
    fast, used = _by_runs(raw)
    full = _full(raw)
    assert used == ["items", "storage"]  # both members decoded by runs (the odd entries in their place)
    assert fast == full
    assert list(fast.state_dict_metadata) == list(full.state_dict_metadata)  # the same order
    assert list(fast.storage_data) == list(full.storage_data)
    assert [(i.index, i.offset) for i in fast.storage_data] == [(i.index, i.offset) for i in full.storage_data]
    for key, item in fast.state_dict_metadata.items():
        assert type(item) is type(full.state_dict_metadata[key])
        assert repr(item) == repr(full.state_dict_metadata[key])
    for index, info in fast.storage_data.items():
        assert repr(info) == repr(full.storage_data[index])
        assert type(info.checksum.digests) is tuple and type(index.offset) is tuple
    stored = fast.state_dict_metadata
    if kind == "tensors":
        assert len(stored) == 80 and stored["tail.p79"].properties.dtype == "bfloat16"
        return
    assert stored["layer0.p1"].properties.dtype == "bfloat16" and stored["layer0.p2"].size == ()
    assert stored["layer0.p3"].size == (0, 3) and len(stored["half"].chunks) == 3
    assert isinstance(stored["step"], dcp.BytesStorageMetadata)
    infos = {index.fqn: info for index, info in fast.storage_data.items()}
    if kind == "plain":
        assert infos["wide"].checksum.block_shape and len(infos["long"].checksum.digests) == 3
    else:
        assert all(info.compression == "zstd" for info in infos.values())


def test_a_runs_decoded_checkpoint_loads_bit_exact(tmp_path: Path) -> None:
    state = _state()
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    assert _by_runs((tmp_path / "metadata.json").read_bytes())[1] == ["items", "storage"]
    target = {key: (ms.Parameter(ms.Tensor(np.zeros(value.shape, np.float32), value.dtype), name=key)
                    if isinstance(value, ms.Parameter) else value) for key, value in _state().items()}
    target["long"] = np.zeros(3000, np.float32)
    dcp.load(target, checkpoint_id=tmp_path, no_dist=True)
    for key, value in state.items():
        if isinstance(value, ms.Parameter):
            assert np.array_equal(target[key].asnumpy().astype(np.float32), value.asnumpy().astype(np.float32)), key
    assert np.array_equal(target["long"], state["long"])


def _sub(old: str, new: str, count: int = 1) -> Callable[[str], str]:
    def change(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, count)
    return change


def _nth(old: str, new: str, n: int) -> Callable[[str], str]:
    """Replace the ``n``-th occurrence of ``old`` (deep inside a run)."""
    def change(text: str) -> str:
        at = -1
        for _ in range(n):
            at = text.index(old, at + 1)
        return text[:at] + new + text[at + len(old):]
    return change


_DAMAGE: list[tuple[str, Callable[[str], str]]] = [
    ("leading_zero_length", _nth('"length":', '"length":0', 30)),
    ("leading_zero_offset", _nth('"offset":[0', '"offset":[00', 20)),
    ("trailing_comma_in_offset", _nth('"offset":[0', '"offset":[0,', 20)),
    ("negative_byte_offset", _nth('"byte_offset":', '"byte_offset":-', 25)),
    ("float_length", _nth('"length":', '"length":1.5e1', 25)),
    ("huge_integer", _nth('"length":', '"length":' + "9" * 5000, 25)),
    ("absurd_length", _nth('"length":', '"length":' + str(1 << 60) + ",\"x\":", 25)),
    ("absurd_length_alone", lambda text: _edited(text, lambda d: d["storage_data"][25].update(length=1 << 60))),
    ("zero_block_bytes", lambda text: _edited(text, lambda d: d["storage_data"][25]["checksum"].update(block_bytes=0))),
    ("block_bytes_with_extra_key", _nth('"block_bytes":', '"block_bytes":0,"_":', 25)),
    ("control_character_in_a_name", _sub('"layer5.p1"', '"layer5.\x01p1"', 2)),
    ("tab_in_a_key", _sub('"layer5.p1":', '"layer5.\tp1":')),
    ("escaped_name", _sub('"layer5.p1"', '"layer5.\\u0070\\"1"', 2)),
    ("path_leaving", _nth('"file":"', '"file":"../', 30)),
    ("absolute_path", _nth('"file":"', '"file":"/', 30)),
    ("missing_comma_between_entries", _nth('},{"fqn":', '}{"fqn":', 20)),
    ("missing_comma_between_items", _nth('},"layer', '}"layer', 10)),
    ("braces_in_a_name", _sub('"layer5.p1"', '"layer5.},{p1]:,"', 2)),
    ("braces_in_a_value_name", _sub('"step"', '"st}{,ep"', 2)),
    ("unknown_dtype_mid_run", _nth('"dtype":"float32"', '"dtype":"float99"', 12)),
    ("chunk_outside_mid_run",
     _nth('"size":[6,4],"chunks":[[[0,0],[6,4]]]', '"size":[6,4],"chunks":[[[0,1],[6,4]]]', 5)),
    ("bool_in_size", _nth('"size":[5]', '"size":[true]', 4)),
    ("two_digests_not_strings", _nth('"digests":["', '"digests":[7,"', 25)),
    ("duplicate_entry", lambda text: _edited(text, lambda d: d["storage_data"].insert(30, d["storage_data"][10]))),
    ("truncated", lambda text: text[: len(text) * 2 // 3]),
    ("first_item_unknown_dtype", _nth('"dtype":"float32"', '"dtype":"float99"', 1)),
    ("first_entry_negative_offset", _nth('"byte_offset":', '"byte_offset":-', 1)),
    ("empty_items", lambda text: _edited(text, lambda d: d.update(state_dict_metadata={}))),
    ("other_algorithm", _nth('"algorithm":"xxh3_64"', '"algorithm":"md5"', 25)),
]


def _edited(text: str, change: Callable[[dict], None]) -> str:
    document = json.loads(text)
    change(document)
    return json.dumps(document, separators=(",", ":"))


@pytest.mark.parametrize("name,damage", _DAMAGE, ids=[name for name, _ in _DAMAGE])
def test_damage_inside_a_run_is_refused_as_the_full_decode_refuses_it(saved: dict[str, bytes], name: str,
                                                                       damage: Callable[[str], str]) -> None:
    raw = damage(saved["plain"].decode()).encode()
    outcomes = []
    for decode in (lambda: _by_runs(raw)[0], lambda: _full(raw)):
        try:
            outcomes.append(("decoded", decode()))
        except CheckpointError as exc:
            outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0] == outcomes[1], name
    if name not in _VALID:
        assert outcomes[0][0] != "decoded", name


#: Changes that leave valid metadata (a name spelled with escapes or holding braces; an unknown checksum
#: algorithm, refused later by check_consistency): both decodes give the same records.
_VALID = {"empty_items", "escaped_name", "braces_in_a_name", "braces_in_a_value_name", "other_algorithm"}


def test_plain_text_tells_escapes_and_control_characters() -> None:
    assert regular_runs.plain_text(b'{"a":[1,2]}')
    assert not regular_runs.plain_text(b'{"a\\n":1}')
    assert not regular_runs.plain_text(b'{"a":\n1}')
    assert not regular_runs.plain_text(b"")
    assert regular_runs.plain_text(bytearray(b'{"\xc3\xa9":1}'))  # UTF-8 text: every byte >= 0x20


def test_an_entry_longer_than_a_window_is_decoded_by_the_streaming_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor of more chunks than the longest window holds: its member takes the streaming path (the storage
    entries still decode by runs); the result equals the full decode."""
    monkeypatch.setattr(regular_runs, "_WINDOW", 1 << 10)
    monkeypatch.setattr(regular_runs, "_WINDOW_MAX", 1 << 12)
    raw = metadata_json.metadata_to_json(_bench_metadata().make_metadata(600, 2))  # items of ~10 KB each
    fast, used = _by_runs(raw)
    assert used == ["storage"]
    assert fast == _full(raw) and len(fast.storage_data) == 1_200


def test_hostile_text_without_boundaries_is_given_up_within_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commas by the hundred thousand inside storage_data: refused as the full decode refuses it, the runs
    never holding more than one bounded window of columns."""
    monkeypatch.setattr(regular_runs, "_WINDOW_MAX", 1 << 14)
    good = metadata_json.metadata_to_json(_bench_metadata().make_metadata(4, 3))
    at = good.index(b'},{"fqn":') + 1
    raw = good[:at] + b"," * (1 << 18) + good[at:]
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as caught:
            _by_runs(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    with pytest.raises(CheckpointError) as full:
        _full(raw)
    assert str(caught.value) == str(full.value)
    assert peak < 6 * len(raw), peak  # the text and one window's columns, not a tuple per character


def _bench_metadata():
    """scripts/bench_metadata.py, whose make_metadata builds a chunk-per-rank metadata."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_metadata.py"
    spec = importlib.util.spec_from_file_location("bench_metadata", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
