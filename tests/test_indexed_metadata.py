"""The indexed metadata form (format 2.1): grid tensors, per-rank storage index files, lazy lookups."""

from __future__ import annotations

import json
import os
import re

import mindspore as ms
import numpy as np
import pytest
from safetensors.numpy import load_file

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint._format.indexed_storage import IndexedStorage
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointValueError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from s3_server import new_filesystem, s3_endpoint, s3_url  # noqa: F401  (fixtures)
from sim_ranks import simulate_save

FULL = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
BIAS = np.arange(8, dtype=np.float32) * 0.5


def _states(layout: Layout, ranks: int) -> list[dict]:
    return [{"w": DTensor.from_global(ms.Tensor(FULL), layout, rank=r),
             "b": DTensor.from_global(ms.Tensor(BIAS), Layout((ranks,), (0,)), rank=r),
             "step": 7} for r in range(ranks)]


def _save(path, layout=Layout((2, 2), (1, 0)), ranks=4, form="indexed"):
    return simulate_save(_states(layout, ranks), path, writer_options={"metadata_form": form})


def _load(path, layout, ranks, *, verify=True):
    out = []
    for rank in range(ranks):
        param = ms.Parameter(ms.Tensor(np.zeros(layout.local_shape(FULL.shape), np.float32)), name="w")
        target = DTensor(param, layout, FULL.shape, rank=rank)
        dcp.load({"w": target}, checkpoint_id=path, no_dist=True,
                 storage_reader=dcp.FileSystemReader(path, verify_checksums=verify))
        out.append((target.global_offset, param.asnumpy()))
    return out


def _check(out):
    for offset, local in out:
        rows, cols = local.shape
        assert np.array_equal(local, FULL[offset[0]:offset[0] + rows, offset[1]:offset[1] + cols])


def test_indexed_round_trip_and_reshard(tmp_path):
    path = tmp_path / "c"
    committed, _ = _save(path)
    document = json.loads((path / "metadata.json").read_bytes())
    assert document["version"] == "2.2"
    assert "grid" in document["state_dict_metadata"]["w"] and "chunks" not in document["state_dict_metadata"]["w"]
    assert document["state_dict_metadata"]["w"]["grid"]["splits"] == [2, 2]
    assert {e["fqn"] for e in document["storage_data"]} == {"step"}  # grid tensors' entries are in the indexes
    names = sorted(n for n in os.listdir(path) if "_index." in n)
    assert [r["file"] for r in document["rank_indexes"]] == names and len(names) == 4
    assert isinstance(committed.storage_data, IndexedStorage)
    _check(_load(path, Layout((2, 2), (1, 0)), 4))  # each rank its own shard
    _check(_load(path, Layout((2,), (-1, 0)), 2))  # reshard: column split
    _check(_load(path, Layout((3,), (-1, 0)), 3))  # reshard: chunks cut in parts
    whole = {"w": np.zeros_like(FULL), "b": np.zeros_like(BIAS), "step": 0}
    dcp.load(whole, checkpoint_id=path, no_dist=True)
    assert np.array_equal(whole["w"], FULL) and np.array_equal(whole["b"], BIAS) and whole["step"] == 7
    metadata = dcp.read_metadata(path)
    assert len(metadata.storage_data) == 4 + 4 + 1
    assert sorted((i.fqn, i.offset) for i in metadata.storage_data)[:2] == [("b", (0,)), ("b", (2,))]


def test_data_files_open_with_safetensors(tmp_path):
    path = tmp_path / "c"
    _save(path)
    pieces = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            pieces.update(load_file(str(path / name)))
    assert sum(v.size for k, v in pieces.items() if k.startswith("w")) == FULL.size


def test_small_save_stays_inline(tmp_path):
    path = tmp_path / "c"
    _save(path, form="auto")
    document = json.loads((path / "metadata.json").read_bytes())
    assert "rank_indexes" not in document and "chunks" in document["state_dict_metadata"]["w"]
    assert not [n for n in os.listdir(path) if "_index." in n]
    _check(_load(path, Layout((2,), (0, -1)), 2))


def test_bad_form_refused(tmp_path):
    with pytest.raises(CheckpointValueError, match="metadata_form"):
        dcp.FileSystemWriter(tmp_path, metadata_form="compact")


# --- corruption and hostile input: clear errors, no target changed ---------------------------------------------

def _documents(path):
    meta = json.loads((path / "metadata.json").read_bytes())
    return meta, {r["rank"]: r for r in meta["rank_indexes"]}


def _rewrite_index(path, rank, edit):
    """Edit rank ``rank``'s index document and record its new length and digest in metadata.json (a forgery)."""
    import xxhash  # the independent digest

    meta, records = _documents(path)
    name = records[rank]["file"]
    document = json.loads((path / name).read_bytes())
    edit(document)
    data = json.dumps(document, separators=(",", ":")).encode()
    (path / name).write_bytes(data)
    records[rank]["length"], records[rank]["digest"] = len(data), xxhash.xxh3_64_hexdigest(data)
    (path / "metadata.json").write_text(json.dumps(meta))
    return name


def _refused(path, error, match):
    target = {"w": np.zeros_like(FULL)}
    with pytest.raises(error, match=match):
        dcp.load(target, checkpoint_id=path, no_dist=True)
    assert not target["w"].any()


def test_flipped_byte_in_an_index_is_refused(tmp_path):
    path = tmp_path / "c"
    _save(path)
    name = _documents(path)[1][2]["file"]
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 1
    (path / name).write_bytes(bytes(data))
    _refused(path, CorruptCheckpointError, "index file of rank 2 does not match its length and digest recorded in")


def test_deleted_index_is_refused(tmp_path):
    path = tmp_path / "c"
    _save(path)
    name = _documents(path)[1][3]["file"]
    (path / name).unlink()
    _refused(path, CorruptCheckpointError, f"{name}: the rank index file listed in the metadata is missing")


def test_wrong_digest_in_metadata_is_refused(tmp_path):
    path = tmp_path / "c"
    _save(path)
    meta, records = _documents(path)
    records[0]["digest"] = "0" * 16
    (path / "metadata.json").write_text(json.dumps(meta))
    _refused(path, CorruptCheckpointError, "rank 0 does not match its length and digest")


def test_entry_claiming_another_ranks_chunk_is_refused(tmp_path):
    path = tmp_path / "c"
    _save(path)
    theirs = json.loads((path / _documents(path)[1][2]["file"]).read_bytes())["storage_data"]
    stolen = next(e for e in theirs if e["fqn"] == "w")
    _rewrite_index(path, 1, lambda d: d["storage_data"].append(stolen))
    _refused(path, CorruptCheckpointError, re.escape(f"offset {stolen['offset']} is no chunk of rank 1"))


def test_overlapping_ranges_are_refused(tmp_path):
    path = tmp_path / "c"
    _save(path)

    def overlap(document):
        first, second = document["storage_data"][:2]
        second["byte_offset"] = first["byte_offset"] + 1 if first["file"] == second["file"] else second["byte_offset"]
        assert first["file"] == second["file"]

    _rewrite_index(path, 1, overlap)
    _refused(path, CorruptCheckpointError, "two items never share bytes")


def test_missing_entry_names_key_rank_and_index(tmp_path):
    path = tmp_path / "c"
    _save(path)
    name = _rewrite_index(path, 2, lambda d: d["storage_data"].__setitem__(
        slice(None), [e for e in d["storage_data"] if e["fqn"] != "w"]))
    _refused(path, CorruptCheckpointError, f"held by rank 2, but the index file {name} does not list it")
    with pytest.raises(CorruptCheckpointError, match="does not list it"):
        list(dcp.read_metadata(path).storage_data.items())  # full iteration (hp-ckpt verify, inspect)


def test_index_symlink_out_of_the_directory_is_refused(tmp_path):
    path = tmp_path / "c"
    _save(path)
    name = _documents(path)[1][1]["file"]
    outside = tmp_path / "outside.json"
    os.replace(path / name, outside)
    os.symlink(outside, path / name)
    _refused(path, UnsafeCheckpointError, "link leading outside")
    os.unlink(path / name)
    os.symlink(name + ".x", path / name)  # a link inside is no regular file either
    os.replace(outside, path / (name + ".x"))
    _refused(path, UnsafeCheckpointError, "not a regular file")


@pytest.mark.parametrize("grid,error,match", [
    ({"splits": [3, 2]}, CorruptCheckpointError, "do not divide the shape"),
    ({"splits": [0, 2]}, CorruptCheckpointError, "one integer >= 1 per dim"),
    ({"splits": [2]}, CorruptCheckpointError, "one integer >= 1 per dim"),
    ({"splits": [2, 2.0]}, CorruptCheckpointError, "one integer >= 1 per dim"),
    ({"splits": [1 << 13, 1 << 12]}, UnsafeCheckpointError, "over the limit"),
    ({"splits": [2, 2], "holder_base": 0, "holder_strides": [2, 1 << 40]}, CorruptCheckpointError,
     "outside the save's 4 ranks"),
    ({"splits": [2, 2], "holder_base": -1, "holder_strides": [2, 1]}, CorruptCheckpointError, "outside"),
    ({"splits": [2, 2], "holders": [0, 1, 2]}, CorruptCheckpointError, "one rank per chunk"),
    ({"splits": [2, 2]}, CorruptCheckpointError, "holder_base"),
])
def test_hostile_grid_members_are_refused(tmp_path, grid, error, match):
    path = tmp_path / "c"
    _save(path)
    meta, _ = _documents(path)
    if "holders" not in grid and "holder_base" not in grid and grid != {"splits": [2, 2]}:
        grid = {**meta["state_dict_metadata"]["w"]["grid"], **grid}
    meta["state_dict_metadata"]["w"]["grid"] = grid
    (path / "metadata.json").write_text(json.dumps(meta))
    _refused(path, error, match)


def test_hostile_rank_index_records_are_refused(tmp_path):
    path = tmp_path / "c"
    _save(path)
    meta, records = _documents(path)
    records[1]["file"] = "../" + records[1]["file"]
    (path / "metadata.json").write_text(json.dumps(meta))
    _refused(path, UnsafeCheckpointError, "is not named")
    records[1]["file"], records[1]["rank"] = records[2]["file"], 2
    (path / "metadata.json").write_text(json.dumps(meta))
    _refused(path, CorruptCheckpointError, "is not a new rank")
    del meta["rank_indexes"]
    (path / "metadata.json").write_text(json.dumps(meta))
    _refused(path, CorruptCheckpointError, "rank_indexes is missing")


# --- other writer paths ---------------------------------------------------------------------------------------

def test_indexed_on_s3_round_trip_and_resave_sweeps_old_indexes(s3_url):
    simulate_save(_states(Layout((2, 2), (1, 0)), 4), s3_url, writer_options={"metadata_form": "indexed"},
                  writer_class=dcp.FsspecWriter)
    fs = new_filesystem()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(s3_url[len("s3://"):], refresh=True))
    first = [n for n in names if "_index." in n]
    assert len(first) == 4
    for layout, ranks in ((Layout((2, 2), (1, 0)), 4), (Layout((2,), (-1, 0)), 2)):
        for rank in range(ranks):
            param = ms.Parameter(ms.Tensor(np.zeros(layout.local_shape(FULL.shape), np.float32)), name="w")
            target = DTensor(param, layout, FULL.shape, rank=rank)
            dcp.load({"w": target}, checkpoint_id=s3_url, no_dist=True)
            _check([(target.global_offset, param.asnumpy())])
    simulate_save(_states(Layout((2, 2), (0, 1)), 4), s3_url, writer_options={"metadata_form": "indexed"},
                  writer_class=dcp.FsspecWriter)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(s3_url[len("s3://"):], refresh=True))
    assert not set(first) & set(names) and len([n for n in names if "_index." in n]) == 4
    assert len({n.split(".")[1] for n in names if n != "metadata.json"}) == 1  # only the new save's objects
    whole = {"w": np.zeros_like(FULL)}
    dcp.load(whole, checkpoint_id=s3_url, no_dist=True)
    assert np.array_equal(whole["w"], FULL)
    index = next(n for n in names if "r00001_index." in n)
    fs.rm_file(f"{s3_url[len('s3://'):]}/{index}")
    target = {"w": np.zeros_like(FULL)}
    with pytest.raises(CorruptCheckpointError, match=f"{index}: the rank index listed in the metadata is missing"):
        dcp.load(target, checkpoint_id=s3_url, no_dist=True)
    assert not target["w"].any()


def test_indexed_async_save(tmp_path):
    path = tmp_path / "c"
    state = {"w": ms.Parameter(ms.Tensor(FULL.copy()), name="w"), "step": 3}
    for staging in ("copy", "fork", "auto"):
        dcp.async_save(state, checkpoint_id=path, no_dist=True, staging=staging,
                       storage_writer=dcp.FileSystemWriter(path, metadata_form="indexed")).result()
        document = json.loads((path / "metadata.json").read_bytes())
        assert [r["rank"] for r in document["rank_indexes"]] == [0] and "grid" in document["state_dict_metadata"]["w"]
        assert [e["fqn"] for e in document["storage_data"]] == ["step"]
        whole = {"w": np.zeros_like(FULL), "step": 0}
        dcp.load(whole, checkpoint_id=path, no_dist=True)
        assert np.array_equal(whole["w"], FULL) and whole["step"] == 3


# --- holders: formula and list, lazy loading --------------------------------------------------------------------

def test_fit_holders_formula_and_list():
    from hyper_parallel.core.distributed_checkpoint._format.grid_holders import GridHolders, fit_holders

    ranks = [5 + 4 * i + 1 * j for i in range(3) for j in range(4)]
    assert fit_holders((3, 4), ranks) == GridHolders(splits=(3, 4), base=5, strides=(4, 1))
    assert fit_holders((2, 1), [7, 3]) == GridHolders(splits=(2, 1), base=7, strides=(-4, 0))
    assert fit_holders((1,), [9]).holder((0,)) == 9
    odd = [0, 3, 1, 2]
    listed = fit_holders((2, 2), odd)
    assert listed.ranks == (0, 3, 1, 2) and [listed.holder((i, j)) for i in range(2) for j in range(2)] == odd
    assert listed.rank_range() == (0, 3) and GridHolders((3,), base=6, strides=(-3,)).rank_range() == (0, 6)


@pytest.mark.parametrize("layout,ranks,formula", [
    (Layout((2, 2), (1, 0)), 4, True),  # 2x2 device matrix
    (Layout((2, 2), (0, -1)), 4, True),  # rows over one axis, the other a replica axis
    (Layout((4, 2), (0, 1)), 8, True),
    (Layout((2, 2), (0, 1), rank_list=(3, 1, 2, 0)), 4, True),  # a custom rank order: negative strides
    (Layout((2, 2), (0, 1), rank_list=(0, 3, 1, 2)), 4, False),  # not affine: a list
])
def test_holders_match_the_ranks_that_wrote_each_chunk(tmp_path, layout, ranks, formula):
    states = [{"w": DTensor.from_global(ms.Tensor(FULL), layout, rank=r)} for r in range(ranks)]
    committed, _ = simulate_save(states, tmp_path / "c", writer_options={"metadata_form": "indexed"})
    item, holders = committed.storage_data.grids["w"]
    assert bool(holders.strides) == formula and bool(holders.ranks) != formula
    metadata = dcp.read_metadata(tmp_path / "c")
    for chunk in item.chunks:
        position = tuple(o // s for o, s in zip(chunk.offsets, chunk.sizes))
        rank = holders.holder(position)
        info = metadata.storage_data[dcp.MetadataIndex("w", chunk.offsets)]
        assert info.relative_path.startswith(f"r{rank:05d}_")
    _check(_load(tmp_path / "c", Layout((2,), (0, -1)), 2))


class _CountingReader(dcp.FileSystemReader):
    """A reader recording which index files its load opened."""

    opened: list

    def read_metadata(self, *, rank=None):
        metadata = super().read_metadata(rank=rank)
        storage, self.opened = metadata.storage_data, []
        opener = storage._opener  # pylint: disable=protected-access

        def counted(name, limit):
            self.opened.append(name)
            return opener(name, limit)

        storage.bind(counted)
        return metadata


def test_a_rank_loads_only_the_indexes_it_needs(tmp_path):
    path = tmp_path / "c"
    _save(path, layout=Layout((4, 2), (0, 1)), ranks=8)
    layout = Layout((4, 2), (0, 1))
    for rank in (0, 5):
        param = ms.Parameter(ms.Tensor(np.zeros(layout.local_shape(FULL.shape), np.float32)), name="w")
        reader = _CountingReader(path)
        dcp.load({"w": DTensor(param, layout, FULL.shape, rank=rank)}, checkpoint_id=path, no_dist=True,
                 storage_reader=reader)
        assert reader.opened == [f"r{rank:05d}_index.{dcp.read_metadata(path).storage_meta.save_id}.json"]
        assert param.asnumpy().any() or rank == 0
    reshard = Layout((2,), (0, -1))  # rows 0-3: the chunks of ranks 0-3 (a 4x2 grid over 8 ranks)
    param = ms.Parameter(ms.Tensor(np.zeros((4, 12), np.float32)), name="w")
    reader = _CountingReader(path)
    dcp.load({"w": DTensor(param, reshard, FULL.shape, rank=0)}, checkpoint_id=path, no_dist=True,
             storage_reader=reader)
    item, holders = reader.metadata.storage_data.grids["w"]
    needed = sorted({holders.holder((c.offsets[0] // c.sizes[0], c.offsets[1] // c.sizes[1]))
                     for c in item.chunks if c.offsets[0] < 4})  # the chunks holding rows 0-3
    assert sorted(int(n[1:6]) for n in reader.opened) == needed and len(needed) == 4
    assert np.array_equal(param.asnumpy(), FULL[:4])


_CRASH_CHILD = """
import os, signal, sys
import numpy as np
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _writer_index_form as fw
path = sys.argv[1]
dcp.save({"w": np.full((4, 6), 1.0, np.float32), "step": 1}, checkpoint_id=path, no_dist=True,
         storage_writer=dcp.FileSystemWriter(path, metadata_form="indexed"))
original = fw.write_atomically
def hooked(target, *args, **kwargs):
    original(target, *args, **kwargs)
    if "_index." in str(target):
        os.kill(os.getpid(), signal.SIGKILL)
fw.write_atomically = hooked
dcp.save({"w": np.full((4, 6), 2.0, np.float32), "step": 2}, checkpoint_id=path, no_dist=True,
         storage_writer=dcp.FileSystemWriter(path, metadata_form="indexed"))
"""


def test_sigkill_after_an_index_before_the_commit(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "c"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _CRASH_CHILD, str(path)], env=env, timeout=300, check=False)
    assert done.returncode == -9
    committed = dcp.read_metadata(path).storage_meta.save_id
    leftovers = [n for n in os.listdir(path) if "_index." in n and committed not in n]
    assert len(leftovers) == 1  # the killed save's index, written, never committed
    state = {"w": np.zeros((4, 6), np.float32), "step": 0}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert state["step"] == 1 and (state["w"] == 1.0).all()  # the previous checkpoint, whole
    dcp.save({"w": np.full((4, 6), 3.0, np.float32), "step": 3}, checkpoint_id=path, no_dist=True,
             storage_writer=dcp.FileSystemWriter(path, metadata_form="indexed"))
    save_id = dcp.read_metadata(path).storage_meta.save_id
    assert sorted(os.listdir(path)) == sorted(["metadata.json", f"r00000_000.{save_id}.safetensors",
                                               f"r00000_index.{save_id}.json"])
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert state["step"] == 3 and (state["w"] == 3.0).all()


def test_cli_verify_inspect_diff_convert_read_every_index(tmp_path, capsys):
    from hyper_parallel.cli.main import main

    path = tmp_path / "c"
    _save(path)
    inline = tmp_path / "inline"
    _save(inline, form="inline")
    assert main(["verify", str(path)]) == 0
    assert "error" not in capsys.readouterr().out.lower()
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format_version"] == "2.2" and info["world_size"] == 4
    assert main(["diff", str(path), str(inline)]) == 0
    assert main(["convert", str(path), str(tmp_path / "out"), "--all", "--no-progress"]) == 0
    merged = {}
    for name in os.listdir(tmp_path / "out"):
        if name.endswith(".safetensors"):
            merged.update(load_file(str(tmp_path / "out" / name)))
    assert np.array_equal(merged["w"], FULL) and np.array_equal(merged["b"], BIAS)
    (path / _documents(path)[1][3]["file"]).unlink()
    capsys.readouterr()
    assert main(["verify", str(path)]) != 0
    assert "index file listed in the metadata is missing" in capsys.readouterr().err


def test_committed_metadata_pickles_small_and_reads_its_indexes(tmp_path):
    import pickle

    path = tmp_path / "c"
    committed, _ = _save(path, layout=Layout((4, 2), (0, 1)), ranks=8)
    blob = pickle.dumps(committed)  # what the coordinator hands every rank after the commit
    assert len(blob) < 4000
    copy = pickle.loads(blob)
    assert dict(copy.storage_data.items()) == dict(committed.storage_data.items())
    unread = dcp.read_metadata(path)
    assert unread == pickle.loads(pickle.dumps(unread))  # equal index records: equal, no index read
    assert not unread.storage_data._loaded  # pylint: disable=protected-access
    read = pickle.loads(pickle.dumps(dcp.read_metadata(path)))
    info = read.storage_data[dcp.MetadataIndex("w", (0, 0))]
    assert info == committed.storage_data[dcp.MetadataIndex("w", (0, 0))]


# --- codec units -------------------------------------------------------------------------------------------------

def test_rank_index_codec_refusals():
    from hyper_parallel.core.distributed_checkpoint._format import rank_index
    from hyper_parallel.core.distributed_checkpoint.metadata import StorageInfo

    info = StorageInfo("r00001_000.0123456789ab.safetensors", 64, 16)
    data, record = rank_index.encode_rank_index(save_id="0123456789ab", rank=1,
                                                entries=[(dcp.MetadataIndex("w", (0,)), info)])
    assert record.file == "r00001_index.0123456789ab.json" and record.length == len(data)
    decoded = rank_index.decode_rank_index(data, record=record, save_id="0123456789ab", source="i")
    assert decoded == {("w", (0,)): info}

    def forged(document):
        raw = json.dumps(document).encode()
        return raw, rank_index.IndexRecord(1, record.file, len(raw), __import__("xxhash").xxh3_64_hexdigest(raw))

    for document, match in (
        ({"format": "x"}, "not the index file of rank 1"),
        ({**json.loads(data), "save_id": "ffffffffffff"}, "not the index file of rank 1"),
        ({**json.loads(data), "storage_data": {}}, "storage_data must be a list"),
        ({**json.loads(data), "storage_data": json.loads(data)["storage_data"] * 2}, "listed twice"),
        ({**json.loads(data), "storage_data": [{"fqn": "w"}]}, "expected a list of integers"),
    ):
        raw, forged_record = forged(document)
        with pytest.raises(CorruptCheckpointError, match=match):
            rank_index.decode_rank_index(raw, record=forged_record, save_id="0123456789ab", source="i")
    raw, forged_record = forged(None)
    with pytest.raises(CorruptCheckpointError, match="not the index file"):
        rank_index.decode_rank_index(raw, record=forged_record, save_id="0123456789ab", source="i")
    with pytest.raises(CorruptCheckpointError, match="not a valid index file"):
        rank_index.decode_rank_index(b"{", record=rank_index.IndexRecord(1, record.file, 1,
                                     __import__("xxhash").xxh3_64_hexdigest(b"{")), save_id="0123456789ab", source="i")
    for raw_records, match in (
        ({}, "must be a list"), ([1], "expected an object"),
        ([{"rank": 9, "file": record.file, "length": 1, "digest": "0" * 16}], "not a new rank"),
        ([{"rank": 1, "file": record.file, "length": -1, "digest": "0" * 16}], "length must be"),
        ([{"rank": 1, "file": record.file, "length": 1, "digest": "0" * 15}], "digest must be"),
    ):
        with pytest.raises(CorruptCheckpointError, match=match):
            rank_index.records_from_json(raw_records, save_id="0123456789ab", world_size=4, source="m")


def test_grid_of_and_unbound_storage(tmp_path):
    from hyper_parallel.core.distributed_checkpoint._index_form import grid_of
    from hyper_parallel.core.distributed_checkpoint._metadata_form import wants_index_form
    from hyper_parallel.core.distributed_checkpoint._format.metadata_json import metadata_from_json
    from hyper_parallel.core.distributed_checkpoint.metadata import (
        ChunkStorageMetadata as C, TensorProperties, TensorStorageMetadata)

    def item(size, *chunks):
        return TensorStorageMetadata(TensorProperties("float32"), size, tuple(C(o, s) for o, s in chunks))

    assert grid_of(item((4, 6), ((0, 0), (2, 6)), ((2, 0), (2, 6)))).splits == (2, 1)
    assert grid_of(item((4, 6), ((0, 0), (4, 6)))).splits == (1, 1)
    assert grid_of(item((5, 6), ((0, 0), (2, 6)), ((2, 0), (3, 6)))) is None  # uneven
    assert grid_of(item((4, 6), ((0, 0), (2, 6)), ((0, 0), (2, 6)))) is None  # one box twice
    assert grid_of(item((4, 6), ((0, 0), (2, 6)), ((1, 0), (2, 6)))) is None  # off the grid
    assert grid_of(item((), ((), ()))) is None and grid_of(item((0, 3), ((0, 0), (0, 3)))) is None
    assert wants_index_form("auto", 300_000) and not wants_index_form("auto", 1000)
    assert wants_index_form("indexed", 1) and not wants_index_form("inline", 10 ** 9)
    path = tmp_path / "c"
    _save(path)
    unbound = metadata_from_json((path / "metadata.json").read_bytes())
    assert len(unbound.storage_data) == 9  # counted without reading an index
    with pytest.raises(CheckpointValueError, match="decoded without its checkpoint"):
        unbound.storage_data[dcp.MetadataIndex("w", (0, 0))]
    assert unbound.storage_data.get(dcp.MetadataIndex("w", (1, 0))) is None  # no chunk starts there
    assert unbound.storage_data.get(dcp.MetadataIndex("nope", ())) is None
    meta, records = _documents(path)
    meta["rank_indexes"] = [r for r in meta["rank_indexes"] if r["rank"] != 3]
    (path / "metadata.json").write_text(json.dumps(meta))
    _refused(path, CorruptCheckpointError, "rank 3 holds chunks of grid tensors but the metadata lists no index")
    meta["storage_data"].append({**meta["storage_data"][0], "fqn": "w", "offset": [0, 0]})
    (path / "metadata.json").write_text(json.dumps(meta))
    _refused(path, CorruptCheckpointError, "a grid tensor whose entries are in rank indexes")


def test_auto_form_indexes_a_large_save(tmp_path, monkeypatch):
    from hyper_parallel.core.distributed_checkpoint import _metadata_form

    monkeypatch.setattr(_metadata_form, "AUTO_INDEX_BYTES", 2000)  # 9 entries x 225 bytes: over it
    _save(tmp_path / "big", form="auto")
    assert "rank_indexes" in json.loads((tmp_path / "big" / "metadata.json").read_bytes())
    _check(_load(tmp_path / "big", Layout((2,), (0, -1)), 2))
    monkeypatch.setattr(_metadata_form, "AUTO_INDEX_BYTES", 2100)
    _save(tmp_path / "small", form="auto")
    assert "rank_indexes" not in json.loads((tmp_path / "small" / "metadata.json").read_bytes())


def test_index_of_a_checkpoint_replaced_while_loading(tmp_path):
    from hyper_parallel.core.distributed_checkpoint.errors import CheckpointNotFoundError

    path = tmp_path / "c"
    _save(path)
    stale = dcp.read_metadata(path)
    _save(path, layout=Layout((2,), (0, -1)), ranks=2)  # another save: its commit removes the old index files
    with pytest.raises(CheckpointNotFoundError, match="deleted or replaced by another save while loading"):
        stale.storage_data[dcp.MetadataIndex("w", (0, 0))]
