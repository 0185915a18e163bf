"""Tests of the ``hp-ckpt`` command line and its functions, on real checkpoints.

Multi-rank checkpoints are written by driving the save planners and writers of
ranks 0..N-1 in one process, exactly as ``dcp.save`` does across processes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import mindspore
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.cli import (
    convert_to_safetensors,
    diff_checkpoints,
    import_checkpoint,
    inspect_checkpoint,
    main,
    verify_checkpoint,
)
from hyper_parallel.cli._common import parse_size
from hyper_parallel.platform import numpy_dtype
from sim_ranks import simulate_save

mindspore.set_device("CPU")

BF16 = numpy_dtype("bfloat16")


def _full_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((8, 6)).astype(np.float32),
        "b": rng.standard_normal((4, 4)).astype(np.float32).astype(BF16),
        "bias": np.arange(3, dtype=np.float16),
        "optim.exp_avg": rng.standard_normal((4, 8)).astype(np.float32),
        "counts": np.arange(12, dtype=np.int64).reshape(3, 4),
    }


def _rank_state(full: dict[str, np.ndarray], rank: int, world_size: int) -> dict:
    rows, cols = Layout((world_size,), (0, -1)), Layout((world_size,), (-1, 0))
    grid = Layout((2, world_size // 2), (1, 0)) if world_size >= 2 else rows
    return {
        "w": DTensor.from_global(mindspore.Tensor(full["w"]), rows, rank=rank),
        "b": DTensor.from_global(full["b"], grid, rank=rank),
        "bias": full["bias"].copy(),
        "optim": {"exp_avg": DTensor.from_global(full["optim.exp_avg"], cols, rank=rank)},
        "counts": full["counts"].copy(),
        "step": 7,
        "name": "run-1",
    }


def save_ranks(states: list[dict], path: Path) -> dcp.Metadata:
    """The planner protocol of ``dcp.save`` for ranks 0..N-1 in one process."""
    world_size = len(states)
    planners, writers, plans = [], [], []
    for rank, state in enumerate(states):
        planner = dcp.StandardSavePlanner()
        planner.configure_planner(state, rank=rank, world_size=world_size, is_coordinator=rank == 0)
        writer = dcp.FileSystemWriter(path)
        writer.set_up_storage_writer(rank == 0, rank=rank, world_size=world_size)
        planners.append(planner)
        writers.append(writer)
        plans.append(writer.prepare_local_plan(planner.build_local_plan()))
    final, metadata = planners[0].build_global_plan(plans)
    final = writers[0].prepare_global_plan(final)
    results = [writers[r].write_data(final[r], planners[r]).result() for r in range(world_size)]
    return writers[0].finish(metadata, results)


def make_checkpoint(path: Path, world_size: int = 4, full: dict | None = None) -> dict[str, np.ndarray]:
    full = _full_tensors() if full is None else full
    save_ranks([_rank_state(full, r, world_size) for r in range(world_size)], path)
    return full


@pytest.fixture(name="ckpt")
def fixture_ckpt(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "ckpt"
    return path, make_checkpoint(path)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def raw_safetensors(path: Path, name: str) -> tuple[str, list[int], bytes]:
    """dtype code, shape and raw bytes of one tensor, read straight from the file."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    entry = json.loads(data[8 : 8 + length])[name]
    begin, end = entry["data_offsets"]
    return entry["dtype"], entry["shape"], data[8 + length + begin : 8 + length + end]


def data_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix == ".safetensors")


# ---------------------------------------------------------------- inspect


def test_inspect_table_lists_keys_and_writers(ckpt, capsys):
    path, _ = ckpt
    code, out, err = run(capsys, "inspect", path)
    assert code == 0 and err == ""
    for text in ("format version  2.2", "backend         filesystem", "world size      4", "bfloat16",
                 "optim.exp_avg", "[8, 6]", "step", "str"):
        assert text in out
    for rank in range(4):
        assert f"r{rank:05d}_000." in out


def test_inspect_json_matches_function(ckpt, capsys):
    path, full = ckpt
    code, out, _ = run(capsys, "inspect", path, "--json")
    info = json.loads(out)
    assert code == 0 and info == inspect_checkpoint(path)
    tensors = {t["key"]: t for t in info["tensors"]}
    assert set(tensors) == set(full)
    assert tensors["w"] == {"key": "w", "dtype": "float32", "shape": [8, 6], "chunks": 4, "bytes": 192}
    assert tensors["b"]["dtype"] == "bfloat16" and tensors["b"]["chunks"] == 4
    assert tensors["bias"]["chunks"] == 1
    assert {v["key"]: v["type"] for v in info["values"]} == {"step": "int", "name": "str"}
    assert info["format_version"] == "2.2" and info["backend"] == "filesystem" and info["world_size"] == 4
    assert [r["rank"] for r in info["ranks"]] == [0, 1, 2, 3]
    assert all(r["files"] == 1 and r["bytes"] == r["bytes_planned"] for r in info["ranks"])
    on_disk = {p.name: p.stat().st_size for p in data_files(path)}
    assert sorted(f["file"] for f in info["files"]) == sorted(on_disk)
    assert {f["rank"] for f in info["files"]} == {0, 1, 2, 3}
    assert info["total_bytes"] == sum(r["bytes"] for r in info["ranks"])


def test_inspect_reads_metadata_only(ckpt, capsys):
    path, _ = ckpt
    for file in data_files(path):
        file.unlink()
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and "optim.exp_avg" in out


def test_inspect_lists_the_rank_index_files_with_their_sizes(tmp_path, capsys):
    """The indexed form (format 2.1) keeps the chunk entries of grid tensors in one index file per rank: inspect
    lists them (file, rank, bytes, digest) as metadata.json records them; the in-line form has none."""
    path = tmp_path / "indexed"
    simulate_save([_rank_state(_full_tensors(), r, 4) for r in range(4)], path,
                  writer_options={"metadata_form": "indexed"})
    on_disk = {p.name: p.stat().st_size for p in path.iterdir() if "_index." in p.name}
    assert len(on_disk) >= 2
    info = inspect_checkpoint(path)
    assert {f["file"]: f["bytes"] for f in info["index_files"]} == on_disk
    recorded = {r["file"]: r for r in json.loads((path / "metadata.json").read_bytes())["rank_indexes"]}
    for entry in info["index_files"]:
        assert entry["rank"] == recorded[entry["file"]]["rank"] and entry["file"].startswith(f"r{entry['rank']:05d}_")
        assert entry["digest"] == recorded[entry["file"]]["digest"]
    assert [f["rank"] for f in info["index_files"]] == sorted(f["rank"] for f in info["index_files"])
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and f"index files     {len(on_disk)} (" in out
    assert "index file" in out.splitlines()[-len(on_disk) - 2]  # the table's header, last in the output
    for name, size in on_disk.items():
        row = next(line for line in out.splitlines() if line.startswith(name))
        assert row.split()[2] == str(size), row
    code, out, _ = run(capsys, "inspect", path, "--json")
    assert code == 0 and json.loads(out)["index_files"] == info["index_files"]
    inline = tmp_path / "inline"
    simulate_save([_rank_state(_full_tensors(), r, 4) for r in range(4)], inline,
                  writer_options={"metadata_form": "inline"})
    assert inspect_checkpoint(inline)["index_files"] == []
    code, out, _ = run(capsys, "inspect", inline)
    assert code == 0 and "index file" not in out


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_not_a_checkpoint_is_one_line_exit_2(tmp_path, capsys, command):
    (tmp_path / "empty").mkdir()
    code, out, err = run(capsys, command, tmp_path / "empty")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "metadata.json" in err and err.startswith(f"hp-ckpt {command}: error:")
    code, _, err = run(capsys, command, tmp_path / "missing")
    assert code == 2 and "does not exist" in err


def test_bad_usage_exits_2(capsys):
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["diff", "only-one"]) == 2
    assert "usage" in capsys.readouterr().err


def test_console_script_help():
    script = shutil.which("hp-ckpt")
    assert script is not None, "hp-ckpt is not installed: pip install -e ."
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    for command in ("inspect", "verify", "convert", "import", "diff"):
        assert command in done.stdout


# ---------------------------------------------------------------- verify


def test_verify_sound_checkpoint(ckpt, capsys):
    path, _ = ckpt
    code, out, err = run(capsys, "verify", path)
    assert code == 0 and out.startswith("OK:") and err == ""  # no progress bar when stderr is no terminal
    report = verify_checkpoint(path)
    assert report.ok and report.files_checked == 4
    assert report.chunks_checked == len(dcp.read_metadata(path).storage_data)
    assert report.bytes_checked == sum(i.length for i in dcp.read_metadata(path).storage_data.values())


def _chunk_location(path: Path, fqn: str, offset: tuple[int, ...]) -> dcp.StorageInfo:
    return dcp.read_metadata(path).storage_data[dcp.MetadataIndex(fqn, offset)]


def test_verify_flipped_byte_names_file_and_key(ckpt, capsys):
    path, _ = ckpt
    info = _chunk_location(path, "w", (4, 0))
    target = path / info.relative_path
    data = bytearray(target.read_bytes())
    data[info.offset + 5] ^= 0xFF
    target.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", path)
    assert code == 1 and out.startswith("FAILED:")
    line = next(line for line in out.splitlines() if "checksum mismatch" in line)
    assert info.relative_path in line and "'w'" in line
    report = verify_checkpoint(path)
    assert [(p.file, p.key) for p in report.problems] == [(info.relative_path, "w")]


def test_verify_truncated_file(ckpt, capsys):
    path, _ = ckpt
    info = _chunk_location(path, "w", (6, 0))
    target = path / info.relative_path
    os.truncate(target, info.offset + 3)
    code, out, _ = run(capsys, "verify", path)
    assert code == 1
    report = verify_checkpoint(path)
    assert any(p.file == info.relative_path and p.key == "w" and "truncated" in p.message for p in report.problems)
    assert any(p.file == info.relative_path and "header" in p.message for p in report.problems)
    assert "truncated" in out and info.relative_path in out


def test_verify_missing_file_and_bad_coverage(ckpt, capsys):
    path, _ = ckpt
    info = _chunk_location(path, "optim.exp_avg", (0, 2))
    (path / info.relative_path).unlink()
    meta_file = path / "metadata.json"
    doc = json.loads(meta_file.read_text())
    doc["state_dict_metadata"]["w"]["chunks"] = doc["state_dict_metadata"]["w"]["chunks"][1:]
    meta_file.write_text(json.dumps(doc))
    code, out, _ = run(capsys, "verify", path)
    assert code == 1
    report = verify_checkpoint(path)
    assert any(p.file == info.relative_path and "missing" in p.message and "optim.exp_avg" in p.message
               for p in report.problems)
    assert any(p.key == "w" and "coverage" in p.message for p in report.problems)
    assert any(p.key == "w" and "belongs to no item" in p.message for p in report.problems)
    assert "coverage" in out


def test_verify_progress_bar_only_on_terminal(ckpt, capsys, monkeypatch):
    path, _ = ckpt
    assert verify_checkpoint(path).ok
    assert capsys.readouterr().err == ""
    assert verify_checkpoint(path, progress=True).ok
    err = capsys.readouterr().err
    assert err.startswith("\rverify") and "100%" in err and err.endswith("\n")  # a tqdm bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["verify", str(path)]) == 0
    assert "100%" in capsys.readouterr().err
    assert main(["verify", "--no-progress", str(path)]) == 0
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- convert


def _check_converted(out: Path, full: dict[str, np.ndarray]) -> dict:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"] == {"total_size": sum(a.nbytes for a in full.values())}
    assert set(index["weight_map"]) == set(full)
    for name, array in full.items():
        file = out / index["weight_map"][name]
        if array.dtype == BF16:
            dtype, shape, raw = raw_safetensors(file, name)
            assert (dtype, shape, raw) == ("BF16", list(array.shape), array.tobytes())
        else:
            with safe_open(str(file), framework="numpy") as handle:
                got = handle.get_tensor(name)
            assert got.dtype == array.dtype and np.array_equal(got, array)
    files = sorted(set(index["weight_map"].values()))
    for file in files:
        with safe_open(str(out / file), framework="numpy") as handle:
            assert sorted(handle.keys()) == sorted(k for k, f in index["weight_map"].items() if f == file)
    return index


def test_convert_single_file(ckpt, tmp_path, capsys):
    path, full = ckpt
    out = tmp_path / "hf"
    code, stdout, _ = run(capsys, "convert", path, out, "--to", "safetensors", "--all")
    assert code == 0 and "note: 'step'" in stdout
    index = _check_converted(out, full)
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "model.safetensors.index.json"]
    with safe_open(str(out / "model.safetensors"), framework="numpy") as handle:
        assert handle.metadata() == {"format": "pt", "step": "7", "name": "run-1",
                                     "hyper_parallel.value_types": '{"name": "str", "step": "int"}'}


def test_convert_sharded_names_and_index(ckpt, tmp_path, capsys):
    path, full = ckpt
    out = tmp_path / "hf"
    code, _, _ = run(capsys, "convert", path, out, "--max-shard-size", "200B", "--all")
    assert code == 0
    index = _check_converted(out, full)
    files = sorted(set(index["weight_map"].values()))
    count = len(files)
    assert count > 1 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    for file in files:
        tensors = [full[k] for k, f in index["weight_map"].items() if f == file]
        assert len(tensors) == 1 or sum(a.nbytes for a in tensors) <= 200


def test_convert_streams_one_tensor_at_a_time(tmp_path):
    big = {f"layer{i}.w": np.full((512, 1024), i, dtype=np.float32) for i in range(6)}  # 2 MiB each
    dcp.save(dict(big), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = convert_to_safetensors(tmp_path / "ckpt", tmp_path / "hf", max_shard_size="5GB")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.files == ("model.safetensors",) and result.total_size == 12 << 20
    assert peak < 5 << 20, f"peak {peak} bytes: more than ~2 tensors held at once"
    _check_converted(tmp_path / "hf", big)


def test_convert_errors(ckpt, tmp_path, capsys):
    path, _ = ckpt
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    code, _, err = run(capsys, "convert", path, busy)
    assert code == 2 and "not empty" in err
    code, _, err = run(capsys, "convert", path, tmp_path / "new", "--max-shard-size", "lots")
    assert code == 2 and "cannot parse size" in err


def test_convert_corrupt_checkpoint_names_file_and_key(ckpt, tmp_path, capsys):
    path, _ = ckpt
    info = _chunk_location(path, "optim.exp_avg", (0, 4))
    target = path / info.relative_path
    data = bytearray(target.read_bytes())
    data[info.offset] ^= 0x01
    target.write_bytes(bytes(data))
    code, out, err = run(capsys, "convert", path, tmp_path / "hf", "--all")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "checksum mismatch" in err and info.relative_path in err and "'optim.exp_avg'" in err
    assert not list((tmp_path / "hf").glob("*.safetensors"))  # no partial output left under a final name


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 << 20 and parse_size(1024) == 1024
    assert parse_size("1.5 kb") == 1500
    with pytest.raises(dcp.CheckpointValueError):
        parse_size("0")


# ---------------------------------------------------------------- import


def _mindspore_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "net.dense.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "net.dense.bias": rng.standard_normal((4,)).astype(np.float32),
        "net.embed": rng.standard_normal((5, 2)).astype(np.float32).astype(BF16),
        "global_step": np.array([11], dtype=np.int32),
    }


def _load_back(path: Path, expected: dict[str, np.ndarray]) -> None:
    targets = {name: np.zeros(array.shape, dtype=array.dtype) for name, array in expected.items()}
    dcp.load(targets, checkpoint_id=path, no_dist=True)
    for name, array in expected.items():
        assert targets[name].tobytes() == array.tobytes(), name


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_import_mindspore_file(tmp_path, capsys, fmt):
    params = _mindspore_params()
    src = tmp_path / f"model.{fmt}"
    save_list = [{"name": name, "data": mindspore.Tensor(array)} for name, array in params.items()]
    mindspore.save_checkpoint(save_list, str(src), format=fmt)
    code, out, _ = run(capsys, "import", src, tmp_path / "ckpt")
    assert code == 0 and "imported 4 tensor(s)" in out
    assert dcp.read_metadata(tmp_path / "ckpt").state_dict_metadata["net.embed"].properties.dtype == "bfloat16"
    _load_back(tmp_path / "ckpt", params)


def test_import_mindspore_cell(tmp_path):
    net = mindspore.nn.Dense(3, 2)
    src = tmp_path / "net.ckpt"
    mindspore.save_checkpoint(net, str(src))
    import_checkpoint(src, tmp_path / "ckpt")
    _load_back(tmp_path / "ckpt", {name: p.asnumpy() for name, p in net.parameters_dict().items()})


def test_import_hugging_face_directories(ckpt, tmp_path, capsys):
    path, full = ckpt
    convert_to_safetensors(path, tmp_path / "hf", max_shard_size="100B")
    code, _, _ = run(capsys, "import", tmp_path / "hf", tmp_path / "back")
    assert code == 0
    _load_back(tmp_path / "back", full)
    code, out, _ = run(capsys, "diff", path, tmp_path / "back")
    assert code == 0, out  # convert's __metadata__ values (step=7, name="run-1") come back with their types
    restored = {"step": None, "name": None}
    dcp.load(restored, checkpoint_id=tmp_path / "back", no_dist=True)
    assert restored == {"step": 7, "name": "run-1"}

    single = tmp_path / "single"
    single.mkdir()
    plain = {"a.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "empty": np.zeros((0, 4), np.float16)}
    save_file(plain, str(single / "model.safetensors"), metadata={"format": "pt"})
    assert run(capsys, "import", single, tmp_path / "single_ckpt")[0] == 0
    _load_back(tmp_path / "single_ckpt", plain)


def test_import_errors(ckpt, tmp_path, capsys):
    code, _, err = run(capsys, "import", ckpt[0], tmp_path / "out")
    assert code == 2 and "already a hyper_parallel checkpoint" in err
    (tmp_path / "weights.bin").write_bytes(b"x")
    code, _, err = run(capsys, "import", tmp_path / "weights.bin", tmp_path / "out")
    assert code == 2 and "cannot import" in err
    (tmp_path / "nothing").mkdir()
    assert run(capsys, "import", tmp_path / "nothing", tmp_path / "out")[0] == 2
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 400) + b"{}  ")
    code, _, err = run(capsys, "import", tmp_path / "bad.safetensors", tmp_path / "out")
    assert code == 2 and "bad.safetensors" in err and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- diff


def test_diff_equal_across_layouts(tmp_path, capsys):
    full = _full_tensors()
    make_checkpoint(tmp_path / "four", world_size=4, full=full)
    make_checkpoint(tmp_path / "two", world_size=2, full=full)
    code, out, _ = run(capsys, "diff", tmp_path / "four", tmp_path / "two")
    assert code == 0 and out.startswith("equal:")
    assert diff_checkpoints(tmp_path / "four", tmp_path / "two").compared == 7


def test_diff_reports_changed_value(tmp_path, capsys):
    full = _full_tensors()
    make_checkpoint(tmp_path / "a", full=full)
    changed = dict(full, w=full["w"].copy())
    changed["w"][5, 2] += 1e-3
    make_checkpoint(tmp_path / "b", full=changed)
    code, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert code == 1
    line = next(line for line in out.splitlines() if line.startswith("w "))
    assert "values" in line and "1 of 48 element(s) differ" in line
    assert run(capsys, "diff", tmp_path / "a", tmp_path / "b", "--atol", "1e-2")[0] == 0
    assert run(capsys, "diff", tmp_path / "a", tmp_path / "b", "--rtol", "1e-9")[0] == 1


def test_diff_presence_shape_dtype_and_values(tmp_path, capsys):
    dcp.save({"same": np.ones(3), "shape": np.ones(3), "dtype": np.ones(2, np.float32), "only_a": 1,
              "ints": np.arange(4), "flag": True, "kind": np.ones(1)}, checkpoint_id=tmp_path / "a", no_dist=True)
    dcp.save({"same": np.ones(3), "shape": np.ones(4), "dtype": np.ones(2, np.float16), "only_b": 2,
              "ints": np.arange(4) * 2, "flag": False, "kind": "text"}, checkpoint_id=tmp_path / "b", no_dist=True)
    report = diff_checkpoints(tmp_path / "a", tmp_path / "b")
    found = {d.key: d.what for d in report.differences}
    assert found == {"only_a": "presence", "only_b": "presence", "shape": "shape", "dtype": "dtype",
                     "ints": "values", "flag": "values", "kind": "kind"}
    assert report.compared == 6 and not report.equal
    code, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert code == 1 and "7 key(s) differ" in out
    code, _, err = run(capsys, "diff", tmp_path / "a", tmp_path / "b", "--atol", "-1")
    assert code == 2 and "atol" in err


def test_import_refuses_a_hugging_face_directory_it_would_import_in_part(tmp_path, capsys):
    """A shard the index json does not name, a shard beside model.safetensors, and a tensor the index lists but no
    shard holds: the import succeeded without those tensors."""
    shards = tmp_path / "shards"
    shards.mkdir()
    save_file({"w": np.ones(3, np.float32)}, str(shards / "model-00001-of-00002.safetensors"))
    save_file({"b": np.full(3, 2, np.float32)}, str(shards / "model-00002-of-00002.safetensors"))
    index = shards / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors"}}))
    code, _, err = run(capsys, "import", shards, tmp_path / "out1")
    assert code == 2 and "model-00002-of-00002.safetensors would not be imported" in err
    index.write_text(json.dumps({"metadata": {}, "weight_map": {
        "w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    code, _, err = run(capsys, "import", shards, tmp_path / "out2")
    assert code == 2 and "lists 1 tensor(s) that no file" in err and "'lm_head.weight'" in err
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()
    index.write_text(json.dumps({"metadata": {}, "weight_map": {
        "w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert run(capsys, "import", shards, tmp_path / "out3")[0] == 0
    _load_back(tmp_path / "out3", {"w": np.ones(3, np.float32), "b": np.full(3, 2, np.float32)})

    beside = tmp_path / "beside"
    beside.mkdir()
    save_file({"w": np.ones(3, np.float32)}, str(beside / "model.safetensors"))
    save_file({"extra": np.ones(2, np.float32)}, str(beside / "extra.safetensors"))
    code, _, err = run(capsys, "import", beside, tmp_path / "out4")
    assert code == 2 and "extra.safetensors would not be imported" in err
    assert run(capsys, "import", beside / "model.safetensors", tmp_path / "out5")[0] == 0


def test_import_refuses_a_directory_with_several_index_files(tmp_path, capsys):
    """Two index files (a model and its draft model beside it): the import took model.safetensors.index.json,
    then refused the draft's shard as a stray file to list in that index, and no SRC could pick one model. Now the
    refusal names both index files, and the index json passed as SRC imports the shards it names."""
    both = tmp_path / "both"
    both.mkdir()
    save_file({"w": np.ones(3, np.float32)}, str(both / "model-00001-of-00001.safetensors"))
    save_file({"d": np.full(2, 5, np.float32)}, str(both / "draft-00001-of-00001.safetensors"))
    (both / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    (both / "draft.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"d": "draft-00001-of-00001.safetensors"}}))
    code, _, err = run(capsys, "import", both, tmp_path / "out1")
    assert code == 2
    assert "holds 2 safetensors index files (draft.safetensors.index.json, model.safetensors.index.json)" in err
    assert f"name the one to use (hp-ckpt import {both / 'draft.safetensors.index.json'} OUT)" in err
    assert not (tmp_path / "out1").exists()
    assert run(capsys, "import", both / "draft.safetensors.index.json", tmp_path / "draft")[0] == 0
    _load_back(tmp_path / "draft", {"d": np.full(2, 5, np.float32)})
    assert dcp.read_metadata(tmp_path / "draft").state_dict_metadata.keys() == {"d"}
    draft = "draft-00001-of-00001.safetensors"
    (both / "draft.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"d": draft, "lost": draft}}))
    code, _, err = run(capsys, "import", both / "draft.safetensors.index.json", tmp_path / "out2")
    assert code == 2 and "lists 1 tensor(s) that no file" in err and "'lost'" in err
