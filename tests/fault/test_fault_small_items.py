"""Issue 15 point 5: small ways a careless caller or a racing process broke the promises."""

from __future__ import annotations

import os
from pathlib import Path

import mindspore
import numpy as np
import pytest
from safetensors.numpy import load_file

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli.main import main as cli_main
from hyper_parallel.core.distributed_checkpoint import filesystem_reader


def test_key_named_like_the_safetensors_metadata_makes_a_valid_file(tmp_path: Path) -> None:
    state = {"__metadata__": np.arange(6, dtype=np.float32), "w": np.ones(3, np.float32)}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    (data,) = (tmp_path / "ckpt").glob("*.safetensors")
    opened = load_file(data)  # the reference reader accepts the file
    assert np.array_equal(opened["__metadata__#"], state["__metadata__"]) and np.array_equal(opened["w"], state["w"])
    target = {"__metadata__": np.zeros(6, np.float32), "w": np.zeros(3, np.float32)}
    dcp.load(target, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert np.array_equal(target["__metadata__"], state["__metadata__"])


def test_convert_refuses_a_tensor_named_metadata(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dcp.save({"__metadata__": np.arange(6, dtype=np.float32)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    code = cli_main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and "'__metadata__'" in err and "rename the key" in err, err
    assert not list((tmp_path / "hf").glob("*.safetensors")) if (tmp_path / "hf").exists() else True


def test_data_file_deleted_between_check_and_open(tmp_path: Path) -> None:
    dcp.save({"w": np.ones(8, np.float32)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)

    class Racing(dcp.FileSystemReader):
        def resolve(self, relative_path: str, fqn: str) -> Path:
            path = super().resolve(relative_path, fqn)
            path.unlink()  # another process deletes it right after the check
            return path

    with pytest.raises(dcp.CheckpointNotFoundError, match="was deleted while loading") as caught:
        dcp.load({"w": np.zeros(8, np.float32)}, storage_reader=Racing(tmp_path / "ckpt"), no_dist=True)
    assert "'w'" in str(caught.value) and "load it again" in str(caught.value)


def test_metadata_deleted_between_check_and_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dcp.save({"w": np.ones(8, np.float32)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    original = filesystem_reader.os.path.commonpath

    def commonpath_then_delete(paths):  # runs between the existence check and the open
        (tmp_path / "ckpt" / "metadata.json").unlink(missing_ok=True)
        return original(paths)

    monkeypatch.setattr(filesystem_reader.os.path, "commonpath", commonpath_then_delete)
    with pytest.raises(dcp.CheckpointNotFoundError, match="deleted while being opened"):
        dcp.read_metadata(tmp_path / "ckpt")


@pytest.mark.parametrize("make,option", [
    (lambda p: dcp.FileSystemWriter(p, thread_count=1.5), "thread_count"),
    (lambda p: dcp.FileSystemWriter(p, thread_count=True), "thread_count"),
    (lambda p: dcp.FileSystemWriter(p, checksum_block_bytes=2.0), "checksum_block_bytes"),
    (lambda p: dcp.FileSystemWriter(p, compression_level="3"), "compression_level"),
    (lambda p: dcp.FileSystemWriter(p, lease_timeout="long"), "lease_timeout"),
    (lambda p: dcp.FileSystemReader(p, thread_count=1.5), "thread_count"),
    (lambda p: dcp.FileSystemReader(p, max_inflight_bytes="64M"), "max_inflight_bytes"),
    (lambda p: dcp.FileSystemReader(p, max_inflight_bytes=0), "max_inflight_bytes"),
])
def test_bad_option_types_name_the_option(tmp_path: Path, make, option: str) -> None:
    with pytest.raises(dcp.CheckpointValueError, match=f"option {option} must be") as caught:
        make(tmp_path)
    assert isinstance(caught.value, ValueError)


def test_dotted_and_nested_key_collision_names_both_paths(tmp_path: Path) -> None:
    with pytest.raises(dcp.CheckpointValueError) as caught:
        dcp.save({"a.b": np.zeros(2), "a": {"b": np.ones(2)}}, checkpoint_id=tmp_path / "c", no_dist=True)
    message = str(caught.value)
    assert "state_dict['a.b']" in message and "state_dict['a']['b']" in message and "'a.b'" in message, message
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_refused_before_anything_is_written(tmp_path: Path, dtype: str) -> None:
    tensor = mindspore.Tensor(np.ones((2, 3), np.float32), dtype=getattr(mindspore, dtype))
    with pytest.raises(dcp.CheckpointError) as caught:
        dcp.save({"ok": np.ones(2), "layer.w": tensor}, checkpoint_id=tmp_path / "f8", no_dist=True)
    message = str(caught.value)
    assert "'layer.w'" in message and dtype.replace("_", "") in message.replace("_", ""), message
    assert not (tmp_path / "f8").exists(), os.listdir(tmp_path / "f8")
