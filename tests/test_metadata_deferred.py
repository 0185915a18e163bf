"""``read_metadata`` checks every storage entry at once but makes the records of the usual ones
(``MetadataIndex``, ``StorageInfo``, ``ChunkChecksum``) when ``storage_data`` is first asked for
(``_format.deferred_storage``). The metadata it returns behaves in every way as the ``Metadata`` of the same
fields: equal both ways, the same repr, pickles and copies as one, ``replace``-s, refuses hashing and assignment.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import threading
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._format import metadata_json
from hyper_parallel.core.distributed_checkpoint._format.consistency import check_consistency, storage_by_key
from hyper_parallel.core.distributed_checkpoint._format.deferred_storage import (
    DecodedMetadata,
    PendingStorage,
    StorageOf,
    has_storage,
)
from hyper_parallel.core.distributed_checkpoint.errors import CorruptCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex


def _state() -> dict[str, object]:
    rng = np.random.default_rng(11)
    state: dict[str, object] = {}
    for i in range(40):
        values = rng.standard_normal((i % 3 + 1, 5)).astype(np.float32)
        state[f"w{i}"] = ms.Parameter(ms.Tensor(values, ms.bfloat16 if i % 2 else ms.float32), name=f"w{i}")
    state["wide"] = ms.Parameter(ms.Tensor(np.ones((64, 4096), np.float32)), name="wide")  # tile checksums
    state["step"] = 3
    return state


def _full(raw: bytes) -> dcp.Metadata:
    """The member-by-member decode (every record made at once): a plain ``Metadata``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metadata_json, "plain_text", lambda data: False)
        return metadata_json.metadata_from_json(raw)


@pytest.fixture(name="saved")
def _saved(tmp_path: Path) -> Path:
    dcp.save(_state(), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    return tmp_path / "ckpt"


def test_the_records_are_made_on_first_access_and_equal_the_full_decode(saved: Path) -> None:
    metadata = dcp.read_metadata(saved)
    full = _full((saved / "metadata.json").read_bytes())
    assert type(full) is dcp.Metadata and isinstance(metadata, DecodedMetadata)
    assert type(metadata.__dict__["_storage"]) is PendingStorage  # nothing made by read_metadata
    assert metadata.state_dict_metadata == full.state_dict_metadata
    storage = metadata.storage_data
    assert type(storage) is dict and metadata.storage_data is storage  # made once, then the same dict
    assert list(storage) == list(full.storage_data) and storage == full.storage_data
    assert [repr(info) for info in storage.values()] == [repr(info) for info in full.storage_data.values()]
    assert all(type(index.offset) is tuple and index.index is None for index in storage)


def test_it_behaves_as_the_metadata_of_the_same_fields(saved: Path) -> None:
    metadata = dcp.read_metadata(saved)
    plain = dcp.Metadata(**{field.name: getattr(dcp.read_metadata(saved), field.name)
                            for field in dataclasses.fields(dcp.Metadata)})
    assert metadata == plain and plain == metadata and not metadata != plain and not plain != metadata
    assert metadata == dcp.read_metadata(saved) and metadata != object() and metadata != 1
    other = dataclasses.replace(plain, version="0.0")
    assert metadata != other and other != metadata
    assert repr(metadata) == repr(plain) and str(metadata) == str(plain)
    for copied in (pickle.loads(pickle.dumps(metadata)), copy.copy(metadata), copy.deepcopy(metadata)):
        assert type(copied) is dcp.Metadata and copied == plain
    replaced = dataclasses.replace(metadata, version="0.0")
    assert replaced.version == "0.0" and replaced.storage_data is metadata.storage_data
    assert replaced.state_dict_metadata is metadata.state_dict_metadata and replaced != metadata
    fresh = dcp.read_metadata(saved)  # replaced before its records exist: they come along
    assert fresh.replace(version=fresh.version) == plain
    with pytest.raises(TypeError):
        hash(metadata)
    with pytest.raises(dataclasses.FrozenInstanceError):
        metadata.storage_data = {}  # type: ignore[misc]
    assert [field.name for field in dataclasses.fields(metadata)] == [f.name for f in dataclasses.fields(plain)]


def test_threads_asking_first_get_one_dict(saved: Path) -> None:
    metadata = dcp.read_metadata(saved)
    start = threading.Barrier(4)
    seen: list[object] = []

    def ask() -> None:
        start.wait()
        seen.append(metadata.storage_data)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 4 and all(found is seen[0] for found in seen) and len(seen[0]) == 42


def test_a_chunk_listed_twice_is_still_refused_by_read_metadata(saved: Path) -> None:
    """The check that needs every key runs at once, not when the records are made."""
    path = saved / "metadata.json"
    text = path.read_text()
    start = text.index('{"fqn":"w7"')
    entry = text[start:text.index("}}", start) + 2]
    path.write_text(text.replace(entry, entry + "," + entry, 1))
    with pytest.raises(CorruptCheckpointError, match="storage_data lists a chunk twice"):
        dcp.read_metadata(saved)


def test_a_load_from_it_is_bit_exact(saved: Path) -> None:
    target = {key: (ms.Parameter(ms.Tensor(np.zeros(value.shape, np.float32), value.dtype), name=key)
                    if isinstance(value, ms.Parameter) else None) for key, value in _state().items()}
    dcp.load(target, checkpoint_id=saved, no_dist=True)
    for key, value in _state().items():
        if isinstance(value, ms.Parameter):
            np.testing.assert_array_equal(target[key].asnumpy().astype(np.float32),
                                          value.asnumpy().astype(np.float32), err_msg=key)
    assert target["step"] == 3


@pytest.mark.parametrize("verify", [True, False])
def test_a_load_looks_entries_up_by_key_and_never_makes_the_records(saved: Path, verify: bool) -> None:
    """The reader's table of entries by ``(key, offset)`` comes from the checked columns: a load makes no
    ``MetadataIndex`` per entry, and a later ``storage_data`` holds the very records the load used."""
    kept: list[dcp.Metadata] = []

    class Keeping(dcp.FileSystemReader):
        def read_metadata(self, **kwargs):  # type: ignore[no-untyped-def]
            kept.append(super().read_metadata(**kwargs))
            return kept[-1]

    reader = Keeping(saved, verify_checksums=verify)
    target = {key: (ms.Parameter(ms.Tensor(np.zeros(value.shape, np.float32), value.dtype), name=key)
                    if isinstance(value, ms.Parameter) else None) for key, value in _state().items()}
    dcp.load(target, storage_reader=reader, no_dist=True)
    for key, value in _state().items():
        if isinstance(value, ms.Parameter):
            assert np.array_equal(target[key].asnumpy(), value.asnumpy()), key
    metadata = kept[0]
    assert type(metadata.__dict__["_storage"]) is PendingStorage  # no record of storage_data made
    keyed = storage_by_key(metadata)
    assert keyed is metadata.pending_by_key() and has_storage(metadata)
    full = _full((saved / "metadata.json").read_bytes())
    assert list(keyed.items()) == list(storage_by_key(full).items())
    assert all(metadata.storage_data[MetadataIndex(key, offset)] is info for (key, offset), info in keyed.items())
    assert metadata.pending_by_key() is keyed  # (kept: the same records)
    assert storage_by_key(dataclasses.replace(metadata)) == keyed  # a copy made after: by its records


def _edited(saved: Path, change) -> dcp.Metadata:  # type: ignore[no-untyped-def]
    path = saved / "metadata.json"
    path.write_text(change(path.read_text()))
    metadata = dcp.read_metadata(saved)
    assert type(metadata.__dict__["_storage"]) is PendingStorage  # still the writer's form: decoded by runs
    return metadata


def test_the_consistency_checks_name_keys_from_the_columns(saved: Path) -> None:
    """An entry of no item and two entries sharing bytes are refused as before, named by key and offset."""
    def orphan(text: str) -> str:
        start = text.index('"w7":{')
        return text[:start] + text[text.index("}", text.index("]]]", start)) + 2:]

    metadata = _edited(saved, orphan)
    with pytest.raises(CorruptCheckpointError,
                       match=r"storage entry of key 'w7' at offset \[0, 0\] belongs to no item"):
        check_consistency(metadata, by_key=storage_by_key(metadata))


def _entry_field(text: str, key: str, field: str, old: int, new: int) -> str:
    """``text`` (metadata JSON) with the number ``field`` of ``key``'s first storage entry changed from old to new."""
    start = text.index(f'{{"fqn":"{key}"')
    entry = text[start:text.index("}}", start)]
    return text.replace(entry, entry.replace(f'"{field}":{old},', f'"{field}":{new},'), 1)


def test_overlapping_entries_are_named_from_the_columns(saved: Path) -> None:
    full = _full((saved / "metadata.json").read_bytes())
    infos = {index.fqn: info for index, info in full.storage_data.items()}
    first, second = infos["w3"], infos["w5"]
    assert first.relative_path == second.relative_path

    metadata = _edited(saved, lambda text: _entry_field(text, "w5", "byte_offset", second.offset, first.offset + 1))
    with pytest.raises(CorruptCheckpointError,
                       match=r"key '(w3|w5)' at offset \[0, 0\] starts at byte .* inside the bytes of key '(w3|w5)'"):
        check_consistency(metadata, by_key=storage_by_key(metadata))
    with pytest.raises(CorruptCheckpointError, match="inside the bytes of key"):
        dcp.load({"w3": np.zeros((1, 5), np.float32)}, checkpoint_id=saved, no_dist=True)


def test_storage_of_and_has_storage_without_storage_data() -> None:
    empty = dcp.Metadata(state_dict_metadata={}, storage_data=None)
    assert not has_storage(empty) and StorageOf(empty).get(MetadataIndex("k"), 5) == 5
    some = dcp.Metadata(state_dict_metadata={}, storage_data={MetadataIndex("k"): "info"})  # type: ignore[dict-item]
    assert has_storage(some) and StorageOf(some).get(MetadataIndex("k")) == "info"


def test_a_decoded_metadata_is_checked_by_key_as_the_full_decode(saved: Path) -> None:
    """check_consistency of a decoded metadata whose records were not made (entries by key from the columns)
    names an entry of another length, and gives a load the same facts by key as for the full decode."""
    full = _full((saved / "metadata.json").read_bytes())
    info = next(info for index, info in full.storage_data.items() if index.fqn == "w4")

    metadata = _edited(saved, lambda text: _entry_field(text, "w4", "length", info.length, info.length + 2))
    with pytest.raises(CorruptCheckpointError,
                       match=rf"key 'w4': the chunk at offset \[0, 0\] stores {info.length + 2} bytes"):
        check_consistency(metadata, by_key=storage_by_key(metadata))
    whole: dict = {}  # what a load looks up by key: the same facts as the per-key checks give
    dcp.save(_state(), checkpoint_id=saved.parent / "fresh", no_dist=True)
    fresh = dcp.read_metadata(saved.parent / "fresh")
    check_consistency(fresh, by_key=storage_by_key(fresh), whole=whole)
    full_whole: dict = {}
    plain = _full((saved.parent / "fresh" / "metadata.json").read_bytes())
    check_consistency(plain, whole=full_whole)
    assert whole == full_whole and len(whole) == 40  # every tensor but "wide" (tile checksums)
