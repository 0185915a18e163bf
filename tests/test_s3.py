"""Object storage backend against a real S3 endpoint (moto's server on 127.0.0.1).

Saves and loads through ``s3://`` ids, checks that the objects are the same
safetensors files and metadata JSON as on disk, that large objects go up as
multipart uploads with bounded memory, that loads fetch only the byte ranges
they need, that corruption is caught, that a racing save fails naming the
clash and that a SIGKILLed save leaves no committed checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import mindspore
import numpy as np
import pytest
from safetensors import deserialize

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._format.metadata_json import metadata_from_json
from hyper_parallel.core.distributed_checkpoint._object_io import ObjectSink, RangedSource
from hyper_parallel.core.distributed_checkpoint._engine import SaveOptions, commit_save, plan_save, write_local
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner
from race_gate import MeetingFsspecWriter, Rendezvous
from s3_server import new_filesystem, s3_endpoint, s3_url  # noqa: F401  (fixtures)
from storage_contract import StorageContract

REPO = Path(__file__).resolve().parent.parent
_MIB = 1 << 20


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": mindspore.Tensor(rng.standard_normal((256, 512)).astype(np.float32)),
        "h": mindspore.Tensor(rng.standard_normal((64,)).astype(np.float16)),
        "bf": mindspore.Tensor(rng.standard_normal((8, 16)).astype(np.float32), dtype=mindspore.bfloat16),
        "step": seed,
        "name": f"run-{seed}",
    }


def _blank() -> dict:
    return {
        "w": mindspore.Tensor(np.zeros((256, 512), np.float32)),
        "h": mindspore.Tensor(np.zeros((64,), np.float16)),
        "bf": mindspore.Tensor(np.zeros((8, 16), np.float32), dtype=mindspore.bfloat16),
        "step": -1,
        "name": "",
    }


def _assert_same(loaded: dict, expected: dict) -> None:
    for key in ("w", "h", "bf"):
        np.testing.assert_array_equal(loaded[key].float().asnumpy(), expected[key].float().asnumpy(), err_msg=key)
        assert loaded[key].dtype == expected[key].dtype
    assert (loaded["step"], loaded["name"]) == (expected["step"], expected["name"])


def _objects(url: str) -> list[str]:
    fs = new_filesystem()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url[len("s3://"):], refresh=True))


def test_round_trip_same_files_as_on_disk(s3_url: str, tmp_path: Path) -> None:
    state = _state(1)
    committed = dcp.save(state, checkpoint_id=s3_url, no_dist=True)
    loaded = _blank()
    dcp.load(loaded, checkpoint_id=s3_url, no_dist=True)
    _assert_same(loaded, state)
    assert dcp.read_metadata(s3_url).storage_meta.save_id == committed.storage_meta.save_id
    # The same layout as a directory: metadata.json plus safetensors data objects any reader opens.
    names = _objects(s3_url)
    assert names[0] == "metadata.json" and all(n.endswith(".safetensors") for n in names[1:]), names
    fs = new_filesystem()
    raw_metadata = fs.cat_file(f"{s3_url[5:]}/metadata.json")
    assert metadata_from_json(raw_metadata) == committed
    disk = dcp.save(_state(1), checkpoint_id=tmp_path / "disk", no_dist=True)
    on_disk = json.loads((tmp_path / "disk" / "metadata.json").read_bytes())
    assert json.loads(raw_metadata)["version"] == on_disk["version"]
    assert set(disk.state_dict_metadata) == set(committed.state_dict_metadata)
    tensors = dict(deserialize(fs.cat_file(f"{s3_url[5:]}/{names[1]}")))  # the safetensors library parses it
    assert tensors["bf"]["dtype"] == "BF16" and tensors["w"]["shape"] == [256, 512]
    np.testing.assert_array_equal(np.frombuffer(bytes(tensors["w"]["data"]), np.float32).reshape(256, 512),
                                  state["w"].asnumpy())


def test_explicit_writer_and_reader_with_filesystem_object(s3_url: str, s3_endpoint) -> None:  # noqa: F811
    fs = new_filesystem()
    writer = dcp.FsspecWriter(s3_url, filesystem=fs, part_bytes=5 * _MIB, connections=2)
    dcp.save(_state(2), storage_writer=writer, no_dist=True)
    reader = dcp.FsspecReader(s3_url, endpoint_url=s3_endpoint.url, key="testing", secret="testing")
    loaded = _blank()
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    _assert_same(loaded, _state(2))
    assert dcp.FsspecWriter.validate_checkpoint_id("s3://b/p") and not dcp.FsspecWriter.validate_checkpoint_id("/x")
    assert not dcp.FileSystemWriter.validate_checkpoint_id("s3://b/p")
    with pytest.raises(dcp.CheckpointValueError, match="connections"):
        dcp.FsspecReader(s3_url, connections=0)
    with pytest.raises(dcp.CheckpointValueError, match="part_bytes"):
        dcp.FsspecWriter(s3_url, part_bytes=1.5)


def test_missing_and_uncommitted_locations(s3_url: str) -> None:
    with pytest.raises(dcp.CheckpointNotFoundError, match="does not exist"):
        dcp.load(_blank(), checkpoint_id=s3_url, no_dist=True)
    fs = new_filesystem()
    fs.pipe_file(f"{s3_url[5:]}/r00000_000.0123456789ab.safetensors", b"orphan data of a killed save")
    with pytest.raises(dcp.IncompleteCheckpointError, match="did not commit"):
        dcp.read_metadata(s3_url)


def test_a_prefix_of_only_rank_local_saves_names_them(s3_url: str) -> None:
    """A collective load of rank-local saves (use_collectives=False: metadata.rank<r>.json objects) says so, names
    them and the fix, as on disk (537ebef); on S3 it said the save 'did not commit', sending the user away from a
    good checkpoint."""
    dcp.save(_state(7), checkpoint_id=s3_url, no_dist=True)
    fs, root = new_filesystem(), s3_url[len("s3://"):]
    for rank in range(4):  # what four ranks saving alone leave: a metadata object each, no metadata.json
        fs.copy(f"{root}/metadata.json", f"{root}/metadata.rank{rank:05d}.json")
    fs.rm(f"{root}/metadata.json")
    target = _blank()
    with pytest.raises(dcp.IncompleteCheckpointError) as caught:
        dcp.load(target, checkpoint_id=s3_url)
    text = str(caught.value)
    assert "metadata.rank00000.json, metadata.rank00001.json, metadata.rank00002.json, ..." in text, text
    assert "use_collectives=False" in text and "did not commit" not in text and s3_url in text, text
    assert not target["w"].asnumpy().any() and target["step"] == -1
    import s3fs  # pylint: disable=import-outside-toplevel

    class NoListing(s3fs.S3FileSystem):  # a role allowed GetObject but not ListBucket
        def ls(self, path, detail=False, **kwargs):
            raise PermissionError(f"ListObjectsV2 on {path}: AccessDenied")

    reader = dcp.FsspecReader(s3_url, filesystem=NoListing(skip_instance_cache=True))
    with pytest.raises(dcp.IncompleteCheckpointError, match="did not commit"):  # no listing: the plain message
        dcp.load(_blank(), storage_reader=reader)


_SINK_PEAK_SCRIPT = """
import sys, tracemalloc
import numpy as np
import s3fs
from hyper_parallel.core.distributed_checkpoint._object_io import ObjectSink
fs = s3fs.S3FileSystem(skip_instance_cache=True)
data = np.random.default_rng(3).integers(0, 256, size=(48 << 20) + 7, dtype=np.uint8)
fs.pipe_file(sys.argv[1] + "-warm", b"x")  # the client and its service model exist before measuring
tracemalloc.start()
sink = ObjectSink(fs, sys.argv[1], part_bytes=5 << 20, connections=2)
for start in range(0, data.size, 3 << 20):
    sink.write(memoryview(data[start : start + (3 << 20)]))
sink.commit()
print(tracemalloc.get_traced_memory()[1])
"""


def test_large_objects_stream_as_multipart_with_bounded_memory(s3_url: str, s3_endpoint) -> None:  # noqa: F811
    fs = new_filesystem()
    path = f"{s3_url[5:]}/big"
    # In a child process: the endpoint (moto) lives in this one and holds the uploaded bytes.
    env = {**os.environ, **s3_endpoint.env, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _SINK_PEAK_SCRIPT, path], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    peak = int(out.split()[-1])
    # Parts in flight (2), the filling one, and the HTTP client's transient copies: a bound set by the
    # part size and connections, far below the 48 MiB object.
    assert peak < 8 * 5 * _MIB, f"peak {peak} bytes for a 48 MiB object in 5 MiB parts"
    assert fs.info(path, refresh=True)["ETag"].strip('"').endswith("-10")  # 10 parts: a multipart upload
    data = np.random.default_rng(3).integers(0, 256, size=23 * _MIB + 7, dtype=np.uint8)
    fs.pipe_file(path, data.tobytes())
    source = RangedSource(fs, path, data.size, part_bytes=5 * _MIB, connections=3)
    back = np.empty(data.size, np.uint8)
    assert source.readinto(back, 0) == data.size
    np.testing.assert_array_equal(back, data)
    rows = [np.empty(10, np.uint8), np.empty(3, np.uint8)]
    assert source.read_rows(rows, [100, data.size - 3]) == 13
    np.testing.assert_array_equal(rows[0], data[100:110])
    np.testing.assert_array_equal(rows[1], data[-3:])
    # A failed upload leaves no object.
    sink = ObjectSink(fs, f"{path}-aborted", part_bytes=5 * _MIB, connections=2)
    sink.write(memoryview(data[: 11 * _MIB]))
    sink.abort()
    assert not fs.exists(f"{path}-aborted")


def test_large_save_round_trips_through_multipart(s3_url: str) -> None:
    rng = np.random.default_rng(4)
    state = {"big": mindspore.Tensor(rng.standard_normal((3 * 1024, 1024)).astype(np.float32))}  # 12 MiB
    writer = dcp.FsspecWriter(s3_url, part_bytes=5 * _MIB, connections=3, thread_count=1)
    dcp.save(state, storage_writer=writer, no_dist=True)
    name = [n for n in _objects(s3_url) if n.endswith(".safetensors")][0]
    assert new_filesystem().info(f"{s3_url[5:]}/{name}")["ETag"].strip('"').endswith("-3")
    target = {"big": mindspore.Tensor(np.zeros((3 * 1024, 1024), np.float32))}
    dcp.load(target, checkpoint_id=s3_url, no_dist=True)
    np.testing.assert_array_equal(target["big"].asnumpy(), state["big"].asnumpy())


def test_partial_loads_fetch_only_the_needed_bytes(s3_url: str) -> None:
    """A region of a stored tensor (a reshard's view) is fetched by ranged GETs of about its size."""
    import hyper_parallel  # pylint: disable=import-outside-toplevel

    full = np.arange(4096 * 1024, dtype=np.float32).reshape(4096, 1024)  # tiles of 1024 rows x 256 columns
    small = np.arange(256 * 1024, dtype=np.float32).reshape(256, 1024)
    dcp.save({"w": mindspore.Tensor(full), "c": mindspore.Tensor(small)}, checkpoint_id=s3_url, no_dist=True)
    for verify, bound in ((False, 1.0), (True, 1.05)):
        layout = hyper_parallel.Layout((4,), (0, -1))
        target = {"w": hyper_parallel.DTensor(mindspore.Tensor(np.zeros((1024, 1024), np.float32)), layout,
                                              (4096, 1024), rank=1)}
        reader = dcp.FsspecReader(s3_url, verify_checksums=verify)
        dcp.load(target, storage_reader=reader, no_dist=True)
        np.testing.assert_array_equal(target["w"].to_local().asnumpy(), full[1024:2048])
        needed = 1024 * 1024 * 4
        header = 4096  # the data file's safetensors header, checked against the metadata (data region at 4096)
        assert needed <= reader.bytes_fetched - header <= bound * needed, (verify, reader.bytes_fetched)
    layout = hyper_parallel.Layout((4,), (-1, 0))  # columns: 256 runs of 1 KiB each
    target = {"c": hyper_parallel.DTensor(mindspore.Tensor(np.zeros((256, 256), np.float32)), layout,
                                          (256, 1024), rank=2)}
    reader = dcp.FsspecReader(s3_url, verify_checksums=False)
    dcp.load(target, storage_reader=reader, no_dist=True)
    np.testing.assert_array_equal(target["c"].to_local().asnumpy(), small[:, 512:768])
    assert reader.bytes_fetched == 256 * 256 * 4 + 4096  # the runs, and the file's header


def test_corruption_is_detected_naming_key_and_object(s3_url: str) -> None:
    dcp.save(_state(5), checkpoint_id=s3_url, no_dist=True)
    fs = new_filesystem()
    metadata = dcp.read_metadata(s3_url)
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == "w")
    path = f"{s3_url[5:]}/{info.relative_path}"
    blob = bytearray(fs.cat_file(path))
    blob[info.offset + 1000] ^= 0xFF
    fs.pipe_file(path, bytes(blob))
    with pytest.raises(dcp.CorruptCheckpointError, match=f"checksum mismatch.*{info.relative_path}.*key 'w'"):
        dcp.load(_blank(), checkpoint_id=s3_url, no_dist=True)
    fs.rm_file(path)
    with pytest.raises(dcp.CorruptCheckpointError, match="is missing"):
        dcp.load(_blank(), checkpoint_id=s3_url, no_dist=True)


def _prepared(state: dict, url: str):
    return _prepared_with(dcp.FsspecWriter(url), state)


def _prepared_with(writer, state: dict):
    """A save planned (the writer noted the committed metadata) but not yet written."""
    return plan_save(state, writer=writer, planner=StandardSavePlanner(), options=SaveOptions(no_dist=True))


def run_save_writes(session) -> dcp.Metadata:
    return commit_save(session, lambda: write_local(session))


@pytest.mark.parametrize("over_committed", [False, True])
def test_racing_saves_one_wins_whole_the_other_names_the_clash(s3_url: str, over_committed: bool) -> None:
    if over_committed:
        dcp.save(_state(7), checkpoint_id=s3_url, no_dist=True)
    first, second = _prepared(_state(8), s3_url), _prepared(_state(9), s3_url)  # both began before either commits
    run_save_writes(first)
    with pytest.raises(dcp.ConcurrentSaveError, match=f"checkpoint {s3_url}: another save committed it") as caught:
        run_save_writes(second)
    assert isinstance(caught.value, dcp.CheckpointError)
    loaded = _blank()
    dcp.load(loaded, checkpoint_id=s3_url, no_dist=True)
    _assert_same(loaded, _state(8))
    winner = dcp.read_metadata(s3_url).storage_meta.save_id
    data = [n for n in _objects(s3_url) if n.endswith(".safetensors")]
    assert data and all(winner in n for n in data), data  # the loser's data and the superseded data are gone


def test_async_save_then_resave_keeps_old_until_commit(s3_url: str) -> None:
    dcp.save(_state(10), checkpoint_id=s3_url, no_dist=True)
    handle = dcp.async_save(_state(11), checkpoint_id=s3_url, no_dist=True)
    loaded = _blank()
    try:
        dcp.load(loaded, checkpoint_id=s3_url, no_dist=True)  # the old one, whole, meanwhile
        _assert_same(loaded, _state(loaded["step"]))
        assert loaded["step"] in (10, 11)
    except dcp.CheckpointNotFoundError as exc:  # the background commit replaced it while loading
        assert "load it again" in str(exc)
    handle.result()
    dcp.load(loaded, checkpoint_id=s3_url, no_dist=True)
    _assert_same(loaded, _state(11))
    assert len([n for n in _objects(s3_url) if n.endswith(".safetensors")]) == 1


def test_killed_save_leaves_no_committed_checkpoint(s3_url: str, s3_endpoint, tmp_path: Path) -> None:  # noqa: F811
    dcp.save(_state(12), checkpoint_id=s3_url, no_dist=True)
    before = dcp.read_metadata(s3_url)
    env = {**os.environ, **s3_endpoint.env, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, str(REPO / "tests" / "workers" / "s3_save_child.py"), s3_url],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    fs = new_filesystem()
    bucket = s3_url[5:].split("/")[0]
    deadline = time.monotonic() + 120
    killed_mid_upload = False
    try:
        while time.monotonic() < deadline and child.poll() is None:
            uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
            if uploads:
                child.send_signal(signal.SIGKILL)
                killed_mid_upload = True
                break
            time.sleep(0.02)
    finally:
        if child.poll() is None:
            child.kill()
        output = child.communicate()[0].decode(errors="replace")
    assert killed_mid_upload, f"the child never started an upload: {output[-2000:]}"
    after = dcp.read_metadata(s3_url)
    assert after.storage_meta.save_id == before.storage_meta.save_id
    loaded = _blank()
    dcp.load(loaded, checkpoint_id=s3_url, no_dist=True)
    _assert_same(loaded, _state(12))


def test_two_ranks_under_msrun_save_and_load_resharded(s3_url: str, s3_endpoint, tmp_path: Path) -> None:  # noqa: F811
    from msrun_harness import check_scenarios, run_workers, scenario_values  # pylint: disable=import-outside-toplevel
    from workers.s3_worker import full_value  # pylint: disable=import-outside-toplevel

    results = run_workers(REPO / "tests" / "workers" / "s3_worker.py", workers=2, tmp_path=tmp_path, timeout=600,
                          args=[s3_url], env=s3_endpoint.env)
    save_ids = scenario_values(results, "save")
    assert save_ids[0] == save_ids[1] == dcp.read_metadata(f"{s3_url}/sharded").storage_meta.save_id
    for rank, value in enumerate(scenario_values(results, "load_columns")):
        np.testing.assert_array_equal(value["w"], full_value(1)[:, rank * 6 : (rank + 1) * 6])
        np.testing.assert_array_equal(value["bias"], np.full(3, 1, np.float32))
        assert value["step"] == 1
    for value in scenario_values(results, "load_full"):
        np.testing.assert_array_equal(value, full_value(1))
    for rank, value in enumerate(scenario_values(results, "async_save")):
        np.testing.assert_array_equal(value, full_value(2)[rank * 4 : (rank + 1) * 4])
    for rank, value in enumerate(scenario_values(results, "rank_local")):
        np.testing.assert_array_equal(value, np.full(4, rank + 100, np.float32))
    local = _objects(f"{s3_url}/local")
    assert "metadata.rank00000.json" in local and "metadata.rank00001.json" in local
    check_scenarios(results)
    for rank, value in enumerate(scenario_values(results, "manager")):
        assert value["steps"] == [2, 3] and value["loaded"] == 3
        np.testing.assert_array_equal(value["w"], full_value(3)[:, rank * 6 : (rank + 1) * 6])
    # Both ranks wrote data objects; retention removed step 1 entirely; the
    # manager's record (best-k metrics, keep-forever steps) is an object of the root.
    names = _objects(f"{s3_url}/sharded")
    assert {n[:6] for n in names if n.endswith(".safetensors")} == {"r00000", "r00001"}
    assert _objects(f"{s3_url}/steps") == ["manager.json", "step_00000002", "step_00000003"]


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``hp-ckpt`` in a child process, configured by the AWS variables alone."""
    return subprocess.run([sys.executable, "-m", "hyper_parallel.cli.main", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env, "PYTHONPATH": str(REPO)})


def _cli_here(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """``hp-ckpt`` in this process (the endpoint's variables are set by the fixture)."""
    from hyper_parallel.cli.main import main as cli_main  # pylint: disable=import-outside-toplevel

    code = cli_main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_inspect_verify_convert_diff_on_s3(s3_url: str, s3_endpoint, tmp_path: Path,  # noqa: F811
                                               capsys: pytest.CaptureFixture) -> None:
    from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel

    state = {"w": mindspore.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)), "step": 3}
    committed = dcp.save(state, checkpoint_id=s3_url, no_dist=True)
    done = _cli("inspect", s3_url, "--json", env=s3_endpoint.env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["path"] == s3_url and report["save_id"] == committed.storage_meta.save_id
    assert [t["key"] for t in report["tensors"]] == ["w"] and report["tensors"][0]["shape"] == [3, 4]
    code, out, err = _cli_here(capsys, "verify", s3_url, "--no-progress")
    assert code == 0 and out.startswith(f"OK: {s3_url}"), out + err
    code, out, err = _cli_here(capsys, "convert", s3_url, str(tmp_path / "hf"))
    assert code == 0, err
    np.testing.assert_array_equal(load_file(tmp_path / "hf" / "model.safetensors")["w"], state["w"].asnumpy())
    code, out, err = _cli_here(capsys, "diff", s3_url, s3_url)
    assert code == 0, out + err
    info = next(iter(committed.storage_data.values()))
    fs = new_filesystem()
    path = f"{s3_url[5:]}/{info.relative_path}"
    blob = bytearray(fs.cat_file(path))
    blob[-1] ^= 0xFF
    fs.pipe_file(path, bytes(blob))
    code, out, err = _cli_here(capsys, "verify", s3_url, "--no-progress")
    assert code == 1 and "checksum mismatch" in out, out + err
    fs.rm_file(path)
    code, out, err = _cli_here(capsys, "verify", s3_url, "--no-progress")
    assert code == 1 and info.relative_path in out, out + err
    code, out, err = _cli_here(capsys, "inspect", f"{s3_url}-missing")
    assert code == 2 and "does not exist" in err, err


def test_other_fsspec_filesystems_use_the_same_backend() -> None:
    """A non-S3 fsspec filesystem (memory://): streamed writes, ranged reads, check-then-write commit."""
    import fsspec  # pylint: disable=import-outside-toplevel

    url = f"memory://hp-ckpt-{os.getpid()}/ckpt"
    fs = fsspec.filesystem("memory")
    state = _state(20)
    committed = dcp.save(state, storage_writer=dcp.FsspecWriter(url, filesystem=fs), no_dist=True)
    assert committed.storage_meta.backend == "fsspec"
    assert json.loads(fs.cat_file(f"{url}/metadata.json"))["backend"] == "fsspec"
    loaded = _blank()
    dcp.load(loaded, storage_reader=dcp.FsspecReader(url, filesystem=fs), no_dist=True)
    _assert_same(loaded, state)
    first, second = (_prepared_with(dcp.FsspecWriter(url, filesystem=fs), _state(s)) for s in (21, 22))
    run_save_writes(first)
    with pytest.raises(dcp.ConcurrentSaveError, match="another save"):
        run_save_writes(second)
    dcp.load(loaded, storage_reader=dcp.FsspecReader(url, filesystem=fs), no_dist=True)
    _assert_same(loaded, _state(21))
    with pytest.raises(dcp.UnsafeCheckpointError, match="not a plain name"):
        dcp.FsspecReader(url, filesystem=fs).resolve("../escape.safetensors", "w")
    fs.rm(f"/hp-ckpt-{os.getpid()}", recursive=True)


class TestS3Storage(StorageContract):
    """The shared storage contract, on the moto S3 endpoint."""

    backend = "s3"  # what an S3 save records; the same format as a directory, read by the same load strategy

    @pytest.fixture(autouse=True)
    def _bucket(self, s3_url: str) -> None:
        self.base = s3_url

    def make_id(self, name):
        return f"{self.base}/{name}"

    def make_writer(self, checkpoint_id):
        return dcp.FsspecWriter(checkpoint_id)

    def make_reader(self, checkpoint_id):
        return dcp.FsspecReader(checkpoint_id)

    def corrupt(self, checkpoint_id, info):
        fs = new_filesystem()
        path = f"{checkpoint_id[len('s3://'):]}/{info.relative_path}"
        blob = bytearray(fs.cat_file(path))
        blob[info.offset] ^= 0xFF
        fs.pipe_file(path, bytes(blob))


def _loads_as_one_of(url: str, seeds: list[int]) -> int:
    loaded = _blank()
    dcp.load(loaded, checkpoint_id=url, no_dist=True)
    matching = [s for s in seeds if loaded["step"] == s]
    assert matching, f"{url} loads as none of {seeds}"
    _assert_same(loaded, _state(matching[0]))
    return matching[0]


def test_the_endpoint_decides_concurrent_conditional_puts_atomically(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The racing-save tests rely on S3's atomic conditional PUT: of several concurrent ``If-None-Match: *``
    PUTs of one key exactly one succeeds, and of ``If-Match`` PUTs against one ETag exactly one. moto alone
    checks, then stores (two could both succeed under load: test_threads_racing_for_one_id_never_mix failed so
    once in CI); tests/s3_server.py makes it one step. The store step is slowed here to widen that window."""
    import threading  # pylint: disable=import-outside-toplevel

    from moto.s3.models import S3Backend  # pylint: disable=import-outside-toplevel

    from hyper_parallel.core.distributed_checkpoint._object_io import PreconditionFailed, get_with_tag, put_if

    store = S3Backend.put_object

    def slow_store(self, *args, **kwargs):
        time.sleep(0.02)
        return store(self, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "put_object", slow_store)

    fs = new_filesystem()
    for round_ in range(6):
        path = f"{s3_url[5:]}/atomic/{round_}"
        expected = None
        if round_ % 2:
            fs.pipe_file(path, b"first")
            expected = get_with_tag(fs, path).tag
        start = threading.Barrier(4)
        won: list[int] = []
        lost: list[int] = []

        def put(party: int) -> None:
            start.wait()
            try:
                put_if(fs, path, f"party {party}".encode(), expected_tag=expected)
                won.append(party)
            except PreconditionFailed:
                lost.append(party)

        threads = [threading.Thread(target=put, args=(party,)) for party in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(won) == 1 and len(lost) == 3, (round_, won, lost)
        assert fs.cat_file(path) == f"party {won[0]}".encode()


def test_threads_racing_for_one_id_never_mix(s3_url: str) -> None:
    """Both saves note the metadata object before either writes (held at a gate), so they always overlap."""
    for round_ in range(4):
        url = f"{s3_url}/r{round_}"
        if round_ % 2:
            dcp.save(_state(30), checkpoint_id=url, no_dist=True)
        rendezvous = Rendezvous(2)
        outcomes = rendezvous.run({
            seed: lambda seed=seed: dcp.save(
                _state(seed), no_dist=True,
                storage_writer=MeetingFsspecWriter(url, rendezvous=rendezvous, party=seed))
            for seed in (31, 32)
        })
        assert rendezvous.met() == 2  # both had set up before either wrote
        winners = [seed for seed, outcome in outcomes.items() if isinstance(outcome, dcp.Metadata)]
        losers = [outcome for outcome in outcomes.values() if not isinstance(outcome, dcp.Metadata)]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        error = losers[0]
        assert isinstance(error, dcp.ConcurrentSaveError), repr(error)
        assert "another save committed it" in str(error) and url in str(error), str(error)
        assert _loads_as_one_of(url, winners) == winners[0]
        saved = dcp.read_metadata(url).storage_meta.save_id
        assert all(saved in n for n in _objects(url) if n.endswith(".safetensors"))


def test_sync_save_while_an_async_save_is_pending(s3_url: str) -> None:
    dcp.save(_state(40), checkpoint_id=s3_url, no_dist=True)
    handle = dcp.async_save(_state(41), checkpoint_id=s3_url, no_dist=True)
    errors: dict[int, BaseException] = {}
    try:
        dcp.save(_state(42), checkpoint_id=s3_url, no_dist=True)
    except dcp.CheckpointError as exc:
        errors[42] = exc
    try:
        handle.result()
    except dcp.CheckpointError as exc:
        errors[41] = exc
    # The sync save finishes this process's async save to the id first (its result()), then replaces it.
    assert not errors, errors
    assert _loads_as_one_of(s3_url, [41, 42]) == 42
    assert len([n for n in _objects(s3_url) if n.endswith(".safetensors")]) == 1


def test_manager_on_s3_keeps_the_newest_steps(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from hyper_parallel.core.distributed_checkpoint import _object_steps  # pylint: disable=import-outside-toplevel

    manager = dcp.CheckpointManager(s3_url, max_to_keep=2)
    new_filesystem().pipe_file(f"{s3_url[5:]}/step_00000000/r00000_000.0123456789ab.safetensors", b"killed save")
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    assert manager.all_steps() == [2, 3]
    assert "step_00000000" in _objects(s3_url)  # uncommitted and recent: may be a save in progress, kept
    monkeypatch.setattr(_object_steps, "UNCOMMITTED_GRACE_SECONDS", -1.0)
    manager.save(4, _state(4))
    assert _objects(s3_url) == ["manager.json", "step_00000003", "step_00000004"]  # the record: metrics, promises
    loaded = _blank()
    assert manager.load(loaded) == 4
    _assert_same(loaded, _state(4))
    assert manager.directory(4) == f"{s3_url}/step_00000004"


def test_missing_bucket_fails_with_checkpoint_errors(s3_endpoint) -> None:  # noqa: F811
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/ckpt"
    with pytest.raises(dcp.CheckpointError) as caught:
        dcp.save(_state(50), checkpoint_id=url, no_dist=True)
    assert url in str(caught.value)
    with pytest.raises(dcp.CheckpointNotFoundError, match="does not exist"):
        dcp.load(_blank(), checkpoint_id=url, no_dist=True)


def test_s3_checkpoints_record_their_backend_and_load_once_copied_to_disk(s3_url: str, tmp_path: Path) -> None:
    """An S3 save records backend "s3" (metadata object and ``read_metadata``); a directory save "filesystem".

    The same files copied from S3 into a directory load there (the backend names where it was
    written, not another format), and hp-ckpt inspect shows the backend.
    """
    state = _state(30)
    committed = dcp.save(state, checkpoint_id=s3_url, no_dist=True)
    fs = new_filesystem()
    assert committed.storage_meta.backend == "s3"
    assert json.loads(fs.cat_file(f"{s3_url[5:]}/metadata.json"))["backend"] == "s3"
    assert dcp.read_metadata(s3_url).storage_meta.backend == "s3"
    disk = tmp_path / "on_disk"
    assert dcp.save(_state(30), checkpoint_id=disk, no_dist=True).storage_meta.backend == "filesystem"
    copied = tmp_path / "copied_from_s3"
    copied.mkdir()
    for name in _objects(s3_url):
        (copied / name).write_bytes(fs.cat_file(f"{s3_url[5:]}/{name}"))
    assert dcp.read_metadata(copied).storage_meta.backend == "s3"
    loaded = _blank()
    dcp.load(loaded, checkpoint_id=copied, no_dist=True)
    _assert_same(loaded, state)
    shown = subprocess.run([sys.executable, "-m", "hyper_parallel.cli.main", "inspect", str(copied), "--json"],
                           capture_output=True, text=True, check=True, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    assert json.loads(shown.stdout)["backend"] == "s3"
