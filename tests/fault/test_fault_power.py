"""Power cuts at every moment of a save: the crash states the file system allows, each loaded.

SIGKILL keeps the page cache, so the kill-point suite cannot tell a write
that reached the disk from one that did not. Here the writer runs with a
:class:`RecordingFileOps`: the save really happens, and its log of creates,
writes (offsets and bytes), fsyncs, renames, unlinks, mkdirs and directory
fsyncs is turned into the crash states a power cut can leave
(``crash_states.py``: un-synced writes lost or torn at 4 KiB blocks, names
not made durable by a directory fsync undone, in any combination). Each
distinct state is written out as a real directory and loaded: it must load
the old checkpoint bit-exact, the new one bit-exact, or raise
``IncompleteCheckpointError`` (a fresh id may also not exist at all); never
wrong data, never another error. A re-saved id never loses its old
checkpoint, and once ``save`` returned only the new one is left.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._file_ops import RecordingFileOps

from crash_states import Tree, apply, crash_states, fingerprint, materialise, micro_ops, snapshot
from fault_common import blank_like, same_state

#: Each scenario must produce at least this many distinct crash states.
MIN_STATES = 1000


def small_state(seed: int) -> dict[str, Any]:
    """A state of about 70 KB (17 blocks of data): small enough to load thousands of times."""
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((100, 140), dtype=np.float32),
        "m": {"b": rng.standard_normal(700), "emb": rng.integers(-(2**40), 2**40, size=(50, 20))},
        "h": rng.standard_normal((8, 8)).astype(np.float16),
        "step": seed,
        "name": f"run-{seed}",
        "blob": bytes((seed * 7 + i) % 256 for i in range(300)),
    }


def _outcome(path: Path, old: dict, new: dict) -> str:
    target = blank_like(new)
    try:
        dcp.load(target, checkpoint_id=path, no_dist=True)
    except dcp.IncompleteCheckpointError:
        return "incomplete"
    except dcp.CheckpointNotFoundError:
        return "absent" if not path.exists() else "error: CheckpointNotFoundError on an existing directory"
    except Exception as exc:  # pylint: disable=broad-except
        return f"error: {type(exc).__name__}: {exc}"
    if same_state(target, new):
        return "new"
    if same_state(target, old):
        return "old"
    return "wrong data"


def _run(scenario: str, root: Path) -> tuple[list, dict, Tree, Path]:
    """Commit the old state, then record the scenario's save of the new one."""
    old, new = small_state(1), small_state(2)
    dcp.save(old, checkpoint_id=root / "A", no_dist=True)
    before = snapshot(root)
    recorder = RecordingFileOps()
    target = root / ("B" if scenario == "new" else "A")
    options: dict[str, Any] = {"file_ops": recorder}
    if scenario == "threads":
        options["auto_thread_bytes"] = 1  # the automatic two-file, two-thread path, on a small state
    writer = dcp.FileSystemWriter(target, **options)
    if scenario == "async":
        # staging="copy": the writing is recorded in this process (the default's first call forks a writer).
        dcp.async_save(new, storage_writer=writer, no_dist=True, staging="copy").result(timeout=60)
        writer.wait_cleanup()
    else:
        dcp.save(new, storage_writer=writer, no_dist=True)
    ops, contents = micro_ops(recorder.log, root, before)
    return ops, contents, before, target


@pytest.mark.parametrize("scenario", ["new", "resave", "async", "threads"])
def test_power_cut_states(tmp_path: Path, scenario: str) -> None:
    old, new = small_state(1), small_state(2)
    ops, contents, before, target = _run(scenario, tmp_path / "run")
    kinds = Counter(op.kind for op in ops)
    assert kinds["block"] >= 8 and kinds["sync_file"] >= 2 and kinds["sync_dir"] >= 2 and kinds["rename"] == 1
    if scenario == "threads":
        assert sum(1 for op in ops if op.kind == "link" and op.path.endswith(".safetensors")) == 2
    relative = target.name
    seen: dict[str, str] = {}
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    work = tmp_path / "state"
    last_point = len(ops)
    for point, persisted in crash_states(ops, random_per_point=250, seed=15):
        tree = apply(before, contents, ops, persisted)
        key = fingerprint(tree)
        if key not in seen:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            materialise(tree, work)
            if scenario == "new":  # the old checkpoint's files are never touched by a save elsewhere
                old_files = {p: c for p, c in tree.files.items() if p.startswith("A/")}
                assert old_files == {p: c for p, c in before.files.items() if p.startswith("A/")}
            seen[key] = _outcome(work / relative, old, new)
            outcomes[seen[key]] += 1
        result = seen[key]
        allowed = {"new", "incomplete", "absent"} if scenario == "new" else {"new", "old"}
        if result not in allowed:
            failures.append(f"crash point {point}/{last_point} ({ops[point - 1].kind if point else 'start'} "
                            f"{ops[point - 1].path if point else ''}): {result}")
    assert not failures, f"{len(failures)} bad crash states, e.g.:\n" + "\n".join(failures[:10])
    assert len(seen) >= MIN_STATES, (len(seen), outcomes)
    # Both sides of the commit were explored.
    assert outcomes["new"] > 0 and outcomes["incomplete" if scenario == "new" else "old"] > 0, outcomes
    print(f"{scenario}: {len(ops)} micro-ops, {len(seen)} distinct crash states: {dict(outcomes)}")


@pytest.mark.parametrize("scenario", ["new", "resave"])
def test_save_is_durable_when_it_returns(tmp_path: Path, scenario: str) -> None:
    """After ``save`` returned, a power cut that loses everything not synced leaves the new checkpoint."""
    old, new = small_state(1), small_state(2)
    ops, contents, before, target = _run(scenario, tmp_path / "run")
    states = [s for p, s in crash_states(ops, random_per_point=0) if p == len(ops)]
    synced_only = min(states, key=len)
    work = tmp_path / "state"
    work.mkdir()
    materialise(apply(before, contents, ops, synced_only), work)
    assert _outcome(work / target.name, old, new) == "new"


def test_crash_state_model(tmp_path: Path) -> None:
    """The model itself: what a sync makes durable stays, everything else may be lost, torn or undone."""
    import os  # pylint: disable=import-outside-toplevel

    root = tmp_path / "fs"
    root.mkdir()
    (root / "old").write_bytes(b"o" * 10)
    before = snapshot(root)
    ops = RecordingFileOps()
    fd = ops.open(root / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    ops.pwrite(fd, b"a" * 5000, 0)  # two blocks
    ops.fdatasync(fd)
    ops.write(fd, b"b" * 100)  # at the current position (0): un-synced overwrite
    ops.close(fd)
    ops.replace(root / "f", root / "g")  # un-synced rename
    ops.unlink(root / "old")
    ops.mkdir(root / "d")
    ops.fsync_directory(root)
    assert [op.kind for op in ops.log] == ["create", "write", "fdatasync", "write", "rename", "unlink", "mkdir",
                                           "fsync_dir"]
    micro, contents = micro_ops(ops.log, root, before)
    states = [apply(before, contents, micro, s) for _, s in crash_states(micro, random_per_point=0)]
    files = [t.files for t in {fingerprint(t): t for t in states}.values()]
    # Before the directory fsync the create may be lost; synced bytes are durable only under a name that survived.
    assert {"old": b"o" * 10} in files
    assert any(f.get("f") == b"a" * 5000 for f in files) and any(f.get("g") == b"b" * 100 + b"a" * 4900 for f in files)
    assert any(f.get("f") == b"b" * 100 + b"a" * 4900 for f in files)  # an un-synced write may land, unrenamed
    assert any("g" not in f and "f" not in f for f in files)  # the whole create undone
    final = [t for p, s in crash_states(micro, random_per_point=0) if p == len(micro)
             for t in [apply(before, contents, micro, s)]]
    for tree in final:  # after the directory fsync: renamed, unlinked, made; only the un-synced overwrite may be lost
        assert "old" not in tree.files and "f" not in tree.files and "d" in tree.dirs
        assert tree.files["g"] in (b"a" * 5000, b"b" * 100 + b"a" * 4900)
