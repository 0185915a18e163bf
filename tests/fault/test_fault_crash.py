"""SIGKILL at many points of a save: earlier checkpoints survive bit-exact, the interrupted one is plainly not there.

A child process (``scripts/crash_child.py``, numpy-only state, one fork per
case) saves checkpoint A completely, then starts another save and kills
itself with SIGKILL at a chosen point: planning, each data write (before,
in the middle of the buffer, after), fsyncs, the metadata's temporary file,
the rename that commits, the cleanup of old files. Each point runs in three
scenarios: a new checkpoint id (B), a re-save over A's own directory, and a
few async (a killed forked writer too), multi-thread, checkpoint-manager and
MindSpore-tensor variants.

After every kill: A loads bit-exact and passes ``hp-ckpt verify``; an
interrupted new checkpoint raises ``IncompleteCheckpointError`` (or is
absent); a re-saved directory loads as the complete old state or the
complete new state, never a mix; saving again to the same id succeeds and
leaves no debris.
"""

from __future__ import annotations

import json
from pathlib import Path

import mindspore
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli.verify_cmd import verify_checkpoint

from fault_common import (
    assert_only_committed_files,
    assert_same_state,
    blank_like,
    files_of,
    load_into_blank,
    make_state,
    run_script,
    same_state,
    start_script,
)

# (name, hook, the save had committed when killed)
POINTS: list[tuple[str, dict, bool]] = [
    ("plan.configure", {"target": "StandardSavePlanner.configure_planner", "when": "before"}, False),
    ("plan.directory_created", {"target": "FileSystemWriter.set_up_storage_writer", "when": "after"}, False),
    ("plan.local_plan", {"target": "StandardSavePlanner.build_local_plan", "when": "after"}, False),
    ("plan.global_plan", {"target": "StandardSavePlanner.build_global_plan", "when": "after"}, False),
    ("plan.storage_plan", {"target": "FileSystemWriter.prepare_global_plan", "when": "after"}, False),
    ("plan.finalized", {"target": "StandardSavePlanner.finalize_plan", "when": "after"}, False),
    ("data.first_get_data", {"target": "StandardSavePlanner.get_data", "nth": 1, "when": "before"}, False),
    ("data.header_built", {"target": "df.header_bytes", "when": "after"}, False),
    ("data.file_created", {"target": "fs.os.open", "nth": 1, "when": "after"}, False),
    ("data.length_prefix_written", {"target": "fs.os.write", "at_byte": "8"}, False),
    ("data.header_half_written", {"target": "fs.os.write", "at_byte": "header/2"}, False),
    ("data.header_written", {"target": "fs.os.write", "at_byte": "header"}, False),
    ("data.first_data_byte_written", {"target": "fs.os.write", "at_byte": "header+1"}, False),
    ("data.third_checksum", {"target": "df.digest", "nth": 3, "when": "before"}, False),
    ("data.quarter_written", {"target": "fs.os.write", "at_byte": "0.25"}, False),
    ("data.half_written", {"target": "fs.os.write", "at_byte": "0.5"}, False),
    ("data.nine_tenths_written", {"target": "fs.os.write", "at_byte": "0.9"}, False),
    ("data.all_but_the_last_byte", {"target": "fs.os.write", "at_byte": "-1"}, False),
    ("data.all_written_not_synced", {"target": "fs.os.write", "at_byte": "size"}, False),
    ("data.before_fsync", {"target": "fs.os.fsync", "nth": 1, "when": "before"}, False),
    ("data.after_fsync", {"target": "fs.os.fsync", "nth": 1, "when": "after"}, False),
    ("data.directory_synced", {"target": "fs.fsync_directory", "nth": 1, "when": "after"}, False),
    ("commit.start", {"target": "FileSystemWriter.finish", "when": "before"}, False),
    ("commit.metadata_encoded", {"target": "fs.metadata_to_json", "when": "after"}, False),
    ("commit.temp_file_created", {"target": "fs.os.open", "within": "fs.write_atomically", "when": "after"}, False),
    ("commit.temp_file_half_written", {"target": "fs.os.write", "within": "fs.write_atomically", "when": "mid"},
     False),
    ("commit.before_temp_fsync", {"target": "fs.os.fsync", "within": "fs.write_atomically", "when": "before"},
     False),
    ("commit.before_rename", {"target": "fs.os.replace", "when": "before"}, False),
    ("commit.after_rename", {"target": "fs.os.replace", "when": "after"}, True),
    ("commit.before_directory_sync", {"target": "fs.os.fsync_directory", "within": "fs.write_atomically",
                                      "when": "before"}, True),
    ("commit.before_cleanup", {"target": "fs.write_atomically", "when": "after"}, True),
    ("cleanup.start", {"target": "FileSystemWriter._stale_files", "when": "before"}, True),
    ("save.returned", {"target": "save.return"}, True),
]
# Only a re-save has old data files to remove after its commit.
RESAVE_POINTS = POINTS + [
    ("cleanup.before_old_file_removed", {"target": "fs.os.unlink", "nth": 1, "when": "before"}, True),
    ("cleanup.after_old_file_removed", {"target": "fs.os.unlink", "nth": 1, "when": "after"}, True),
]
OTHER_CASES: list[tuple[str, str, dict, object]] = [
    ("threads", "two_files_half_written", {"target": "fs.os.write", "at_byte": "0.5"}, False),
    ("resave_same_writer", "half_written", {"target": "fs.os.write", "at_byte": "0.5"}, False),
    ("resave_same_writer", "after_rename", {"target": "fs.os.replace", "when": "after"}, True),
    ("async", "staging", {"target": "StandardSavePlanner.get_data", "nth": 1, "when": "before"}, False),
    ("async", "background_half_written", {"target": "fs.os.write", "at_byte": "0.5"}, False),
    # done() before result(): writing and the commit both ran in the background (DESIGN), so it is committed.
    ("async", "done_before_result", {"target": "async.done"}, True),
    ("async", "commit_before_rename", {"target": "fs.os.replace", "when": "before"}, False),
    ("async", "commit_before_cleanup", {"target": "fs.write_atomically", "when": "after"}, True),
    ("async_fork", "writer_process_killed", {"target": "fs.os.write", "at_byte": "0.5"}, False),
    ("async_resave", "background_half_written", {"target": "fs.os.write", "at_byte": "0.5"}, False),
    ("async_resave", "after_rename", {"target": "fs.os.replace", "when": "after"}, True),
    # Saves large enough for the writer's automatic choice of 2 files and 2 threads (threshold lowered to 1 MiB).
    ("auto_threads", "half_written", {"target": "fs.os.write", "at_byte": "0.5"}, False),
    ("auto_threads", "first_file_synced", {"target": "fs.os.fsync", "nth": 1, "when": "after"}, False),
    ("auto_threads", "second_file_synced", {"target": "fs.os.fsync", "nth": 2, "when": "after"}, False),
    ("auto_threads", "data_directory_synced", {"target": "fs.fsync_directory", "nth": 1, "when": "after"}, False),
    ("auto_threads", "after_rename", {"target": "fs.os.replace", "when": "after"}, True),
    ("auto_threads_resave", "three_quarters_written", {"target": "fs.os.write", "at_byte": "0.75"}, False),
    ("auto_threads_resave", "before_rename", {"target": "fs.os.replace", "when": "before"}, False),
    ("auto_threads_resave", "after_rename", {"target": "fs.os.replace", "when": "after"}, True),
    ("auto_threads_resave", "first_old_file_removed", {"target": "fs.os.unlink", "nth": 1, "when": "after"}, True),
    ("manager", "step3_half_written", {"target": "fs.os.write", "at_byte": "0.5"}, [1, 2]),
    ("manager", "retention_before_rename", {"target": "step_dirs.os.rename", "when": "before"}, [1, 2, 3]),
    ("manager", "retention_mid_delete", {"target": "os.unlink", "nth": 1, "when": "after"}, [2, 3]),
    # The record is written before the deletions (so a crash loses no record of the step just saved), by
    # write_atomically: the 1st replace commits step 3's metadata, the 2nd would commit manager.json; nothing is
    # deleted yet. The old record stays whole; its temporary file is swept.
    ("manager", "record_before_rename", {"target": "fs.os.replace", "nth": 2, "when": "before"}, [1, 2, 3]),
]


def _cases(base: Path) -> list[dict]:
    cases = []
    for scenario, points in (("new", POINTS), ("resave", RESAVE_POINTS)):
        for name, hook, committed in points:
            cases.append({"name": f"{scenario}:{name}", "scenario": scenario, "hook": hook, "expect": committed})
    for scenario, name, hook, expect in OTHER_CASES:
        cases.append({"name": f"{scenario}:{name}", "scenario": scenario, "hook": hook, "expect": expect})
    for position, case in enumerate(cases):
        case["dir"] = str(base / f"case{position:03d}")
    return cases


MS_CASE = {"name": "mindspore:half_written", "scenario": "mindspore",
           "hook": {"target": "fs.os.write", "at_byte": "0.5"}, "expect": False}
ALL_NAMES = [c["name"] for c in _cases(Path("."))] + [MS_CASE["name"]]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Run every case once (one forking driver, plus the MindSpore case without fork, in parallel)."""
    base = tmp_path_factory.mktemp("crash")
    cases = _cases(base)
    ms_case = dict(MS_CASE, dir=str(base / "mindspore"))
    (base / "cases.json").write_text(json.dumps(cases))
    (base / "ms_case.json").write_text(json.dumps([ms_case]))
    ms_proc = start_script("crash_child.py", str(base / "ms_case.json"), str(base / "ms_result.json"), "--no-fork")
    try:
        driver = run_script("crash_child.py", str(base / "cases.json"), str(base / "results.json"), timeout=240)
        _, ms_err = ms_proc.communicate(timeout=240)
    finally:
        if ms_proc.poll() is None:
            ms_proc.kill()
            ms_proc.wait()
    assert driver.returncode == 0, driver.stderr[-3000:]
    results = json.loads((base / "results.json").read_text())
    # The MindSpore child kills itself, so it writes no results file: its exit status is the result.
    results[ms_case["name"]] = {"signal": -ms_proc.returncode if ms_proc.returncode < 0 else None,
                                "exit": ms_proc.returncode, "stderr": ms_err[-2000:]}
    by_name = {case["name"]: dict(case, **results[case["name"]]) for case in cases}
    by_name[ms_case["name"]] = dict(ms_case, **results[ms_case["name"]])
    by_name["_driver_stderr"] = {"text": driver.stderr}
    return by_name


def _check_interrupted_new(path: Path) -> None:
    with pytest.raises((dcp.IncompleteCheckpointError, dcp.CheckpointNotFoundError)) as caught:
        load_into_blank(path, make_state(2))
    assert str(path) in str(caught.value)
    if isinstance(caught.value, dcp.IncompleteCheckpointError):
        assert "did not commit" in str(caught.value)
    with pytest.raises((dcp.IncompleteCheckpointError, dcp.CheckpointNotFoundError)):
        dcp.read_metadata(path)


def _check_recovery(path: Path, seed: int = 3) -> None:
    """Saving again to the interrupted id works and leaves only the new save's files."""
    dcp.save(make_state(seed), checkpoint_id=path, no_dist=True)
    assert_same_state(load_into_blank(path, make_state(seed)), make_state(seed))
    assert_only_committed_files(path)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_kill_point(crashed: dict[str, dict], name: str) -> None:
    case = crashed[name]
    assert case["signal"] == 9, f"the fault hook never fired: {case}\n{crashed['_driver_stderr']['text'][-2000:]}"
    root = Path(case["dir"])
    scenario, expect = case["scenario"], case["expect"]
    if scenario == "manager":
        _check_manager(root / "steps", expect)
        return
    if scenario == "mindspore":
        _check_mindspore(root)
        return
    old, new = make_state(1), make_state(2)
    if scenario.startswith("auto_threads") and expect:  # the committed save really used two files
        committed = root / ("A" if scenario.endswith("resave") else "B")
        save_id = dcp.read_metadata(committed).storage_meta.save_id
        assert len([n for n in files_of(committed) if f".{save_id}.safetensors" in n]) == 2
    if scenario in ("resave", "resave_same_writer", "async_resave", "auto_threads_resave"):
        loaded = load_into_blank(root / "A", old)
        assert same_state(loaded, new if expect else old), "the re-saved directory holds neither whole state"
        assert verify_checkpoint(root / "A").ok
        _check_recovery(root / "A")
        return
    assert_same_state(load_into_blank(root / "A", old), old)
    assert verify_checkpoint(root / "A").ok
    if scenario == "async_fork":  # the job lived on and got a clear error from result()
        error = json.loads((root / "error.json").read_text())
        assert error["type"] == "CheckpointIOError" and "writer process" in error["message"], error
    if expect:
        assert_same_state(load_into_blank(root / "B", new), new)
    else:
        _check_interrupted_new(root / "B")
    _check_recovery(root / "B")


def _check_manager(root: Path, expect_steps: list[int]) -> None:
    manager = dcp.CheckpointManager(root, max_to_keep=2)
    assert manager.all_steps() == expect_steps
    for step in expect_steps:
        assert_same_state(load_into_blank(manager.directory(step), make_state(step)), make_state(step))
    target = blank_like(make_state(0))
    assert manager.load(target) == expect_steps[-1]  # the latest committed step
    assert_same_state(target, make_state(expect_steps[-1]))
    # The next save completes, retention keeps two steps and sweeps every leftover.
    manager.save(4, make_state(4))
    assert manager.all_steps() == [expect_steps[-1], 4]
    steps = [name for name in files_of(root) if name not in (".manager.lock", "manager.json")]  # the manager's own
    assert steps == [manager.directory(s).name for s in (expect_steps[-1], 4)]


def _check_mindspore(root: Path) -> None:
    rng = np.random.default_rng(101)
    bf16 = rng.standard_normal((48, 40))
    f32 = rng.standard_normal((33, 7)).astype(np.float32)
    target = blank_like(make_state(1))
    target["ms"] = {
        "bf16": mindspore.Parameter(mindspore.Tensor(np.zeros((48, 40)), mindspore.bfloat16), name="bf16"),
        "f32": mindspore.Tensor(np.zeros((33, 7), np.float32)),
    }
    dcp.load(target, checkpoint_id=root / "A", no_dist=True)
    want_bf16 = mindspore.Tensor(bf16, mindspore.bfloat16).asnumpy()
    assert target["ms"]["bf16"].dtype == mindspore.bfloat16
    assert target["ms"]["bf16"].asnumpy().tobytes() == want_bf16.tobytes()
    assert target["ms"]["f32"].asnumpy().tobytes() == f32.tobytes()
    del target["ms"]
    assert_same_state(target, make_state(1))
    _check_interrupted_new(root / "B")


def test_kill_point_figures(crashed: dict[str, dict]) -> None:
    """Enough distinct points, every one reached (the figures of the closing report)."""
    cases = [c for name, c in crashed.items() if not name.startswith("_")]
    distinct = {json.dumps(c["hook"], sort_keys=True) for c in cases}
    killed = [c for c in cases if c["signal"] == 9]
    assert len(distinct) >= 20 and len(killed) == len(cases)
    print(f"kill points: {len(distinct)} distinct, {len(cases)} kills tried, {len(killed)} reached")
