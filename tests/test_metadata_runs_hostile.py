"""Adversarial review of the metadata decode by runs (``_format.regular_runs``): names holding the pattern's
delimiters, crafted numbers and duplicates decode or are refused exactly as the full decode does, and a hostile
window of text the runs cannot match costs neither a tuple per character nor seconds of CPU."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._format import metadata_json, regular_runs
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError

#: Names holding the delimiters the patterns and windows cut at (no quote or backslash: those take escapes).
_NAMES = ("a", "storage_data", "planner_data", "x},{y", "p]:[q", "ü.λ.名", "fqn", "w},", ",{", "kind:tensor")


def _full(raw: bytes) -> dcp.Metadata:
    """The member-by-member decode, without runs."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metadata_json, "plain_text", lambda data: False)
        return metadata_json.metadata_from_json(raw)


def _same_verdict(raw: bytes) -> dcp.Metadata | None:
    """Decode ``raw`` with and without runs: equal records, or the same error class and text."""
    try:
        full = _full(raw)
    except CheckpointError as exc:
        with pytest.raises(CheckpointError) as caught:
            metadata_json.metadata_from_json(raw)
        assert type(caught.value) is type(exc) and str(caught.value) == str(exc)
        return None
    fast = metadata_json.metadata_from_json(raw)
    assert fast == full
    assert list(fast.state_dict_metadata) == list(full.state_dict_metadata)
    assert list(fast.storage_data) == list(full.storage_data)
    return fast


def test_names_holding_the_patterns_delimiters_load_bit_exact(tmp_path: Path) -> None:
    state = {name: ms.Parameter(ms.Tensor(np.full((3, 2), i, np.float32), ms.bfloat16 if i % 2 else ms.float32),
                                name=f"p{i}") for i, name in enumerate(_NAMES)}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    decoded = _same_verdict((tmp_path / "metadata.json").read_bytes())
    assert decoded is not None and list(decoded.state_dict_metadata) == list(_NAMES)
    target = {name: ms.Parameter(ms.Tensor(np.zeros((3, 2), np.float32), value.dtype), name=f"p{i}")
              for i, (name, value) in enumerate(state.items())}
    dcp.load(target, checkpoint_id=tmp_path, no_dist=True)
    for i, name in enumerate(_NAMES):
        assert np.array_equal(target[name].asnumpy().astype(np.float32), np.full((3, 2), i, np.float32)), name


@pytest.fixture(name="good")
def _good(tmp_path: Path) -> str:
    state = {f"k{i}": ms.Parameter(ms.Tensor(np.full((4,), i, np.float32)), name=f"k{i}") for i in range(6)}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    return (tmp_path / "metadata.json").read_text()


@pytest.mark.parametrize("old,new", [
    ('"byte_offset":4144', '"byte_offset":04144'),  # leading zero: not JSON
    ('"byte_offset":4144', '"byte_offset":-0'),  # negative zero is the integer 0 in JSON
    ('"byte_offset":4144', '"byte_offset":4.144e3'),  # a float
    ('"byte_offset":4144', '"byte_offset":1E400'),
    ('"length":16', '"length":99999999999999999999999999'),  # huge
    ('"length":16', '"length":16.0'),
    ('"offset":[0]', '"offset":[00]'),
    ('"offset":[0]', '"offset":[0,]'),
    ('"offset":[0]', '"offset":[99999999999999999999999999]'),
    ('"size":[4]', '"size":[04]'),
    ('"size":[4]', '"size":[4e0]'),
    ('"chunks":[[[0],[4]]]', '"chunks":[[[0],[04]]]'),
    ('"block_bytes":1048576', '"block_bytes":0'),
    ('"digests":["', '"digests":[1,"'),
    ('"algorithm":"xxh3_64"', '"algorithm":"xxh3_64 "'),
    ('"k3":{', '"k1":{'),  # duplicate member name: the last one counts, in both
    ('{"fqn":"k3"', '{"fqn":"k1"'),  # duplicate chunk: refused by both
    ('{"fqn":"k4","offset":[0],', '{"fqn":"k4","fqn":"k5","offset":[0],'),  # duplicate field inside an entry
    ('"file":"', '"file":"../'),
    ('"kind":"tensor","dtype":"float32"', '"kind":"tensor","dtype":"float32","dtype":"float32"'),
    (']]]}},"storage_data":', ']]]},"zz":{}},"storage_data":'),  # an item of another form last
    ('}],"planner_data":', '}garbage],"planner_data":'),  # a valid run followed by garbage
    ('}],"planner_data":', '},{}],"planner_data":'),
    ('"k5":{', '"k5" :{'),
])
def test_crafted_entries_are_decoded_or_refused_as_the_full_decode_does(good: str, old: str, new: str) -> None:
    at = good.index('"k2":{') if old.startswith(('"size"', '"chunks"', '"kind"')) else good.index('{"fqn":"k2"')
    if old.startswith(('"k', '{"fqn"', ']]]}', '}]')):
        at = 0  # names its own place
    assert old in good[at:], old
    _same_verdict((good[:at] + good[at:].replace(old, new, 1)).encode())  # inside a run, not its first entry


@pytest.mark.parametrize("member", ["items", "storage"])
def test_a_hostile_window_costs_no_tuple_per_character(good: str, member: str) -> None:
    """A member with a megabyte of characters the runs cannot match (commas, no entry boundary) under the default
    window bounds: refused as the full decode refuses it; the runs hold no tuple per character (they held 170x the
    file's size and took about 2 s of CPU per such window)."""
    at = good.index(',"k1":{') if member == "items" else good.index(',{"fqn":"k1"')
    raw = (good[:at] + "," * (regular_runs._WINDOW_MAX - 4096) + good[at:]).encode()
    _same_verdict(raw)
    tracemalloc.start()
    try:
        started = time.process_time()
        with pytest.raises(CheckpointError):
            metadata_json.metadata_from_json(raw)
        spent = time.process_time() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 * len(raw), peak
    assert spent < 0.5, spent


_DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("where,text", [
    ("items", '"z":{"kind":"value","v":' + _DEEP + '},'),  # nested too deep, as the first member
    ("items", '"z":{"kind":"value","v":tru},'),
    ("items", '"z":{"kind":"tensor","dtype":"float32","size":[3],"chunks":[[[0],[4]]]},'),  # chunk past the size
    ("storage", _DEEP + ","),
    ("storage", '{"fqn":1e},'),
    ("storage", '{"fqn":"k0","offset":[0],"file":"../x","byte_offset":0,"length":1},'),  # leaves the directory
])
def test_a_damaged_first_member_is_refused_as_the_full_decode_does(good: str, where: str, text: str) -> None:
    """The first member of a run is decoded on its own before the run: its errors (also a nesting too deep
    for the JSON decoder) are the full decode's."""
    marker = '"state_dict_metadata":{' if where == "items" else '"storage_data":['
    at = good.index(marker) + len(marker)
    assert _same_verdict((good[:at] + text + good[at:]).encode()) is None
