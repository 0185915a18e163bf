"""A data file truncated while the verify pass hashes it fails the load with a ``CheckpointError``, not a signal.

The verify pass reads every window it hashes (also sparse ones: a subset of
keys, a column reshard) into its own buffer with ``pread``; it maps no data
file, so a file another process truncates meanwhile gives a short read, not
``SIGBUS``. Each case runs in a child process (a ``SIGBUS`` would kill it,
which the test reports, instead of killing the test run); the truncation is
made at the moment the window is hashed, or just before it is read.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout

ms.set_device("CPU")

ROOT = Path(__file__).resolve().parent.parent

#: The child: load (a subset of keys, or a column half of "wide") with a hook that truncates the data file
#: once, when the verify pass hashes a sparse window (``hashing``) or just before it reads one (``reading``).
_CHILD = textwrap.dedent('''
    import os, sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import mindspore as ms
    ms.set_device("CPU")
    import hyper_parallel.core.distributed_checkpoint as dcp
    from hyper_parallel import DTensor, Layout
    from hyper_parallel.core.distributed_checkpoint import _verify_reads

    path, data_file, keep, when, case = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
    done = []

    def cut():
        if not done:
            done.append(True)
            os.truncate(data_file, keep)

    mismatch, window = _verify_reads._mismatch, _verify_reads._window

    def hashing(view, window_, blocks):
        if not window_.whole:
            cut()
        return mismatch(view, window_, blocks)

    def reading(source, path_, window_):
        if not window_.whole:
            cut()
        return window(source, path_, window_)

    if when == "hashing":
        _verify_reads._mismatch = hashing
    else:
        _verify_reads._window = reading
    if case == "flat":
        state = {f"small{i}": np.full(300, -1.0, np.float32) for i in range(0, 64, 2)}
        before = {key: value.copy() for key, value in state.items()}
        reader = dcp.FileSystemReader(path, thread_count=1)
    else:
        param = ms.Parameter(ms.Tensor(np.full((64, 1024), -1.0, np.float32)), name="wide")
        state = {"wide": DTensor(param, Layout((2,), (-1, 0)), (64, 2048), rank=1)}
        before = {"wide": param.asnumpy().copy()}
        reader = dcp.FileSystemReader(path, thread_count=1, no_readahead=True)
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
        print("LOADED", bool(done))
    except dcp.CheckpointError as exc:
        values = {k: (v.to_local().asnumpy() if hasattr(v, "to_local") else v) for k, v in state.items()}
        unchanged = all(np.array_equal(values[k], before[k]) for k in before)
        print("ERROR", type(exc).__name__, "unchanged" if unchanged else "CHANGED", bool(done), "|", exc)
''')


def _save(path: Path) -> dict:
    """One data file: 64 small float32 vectors around a (64, 2048) float32 matrix with tiles; entries by key."""
    rng = np.random.default_rng(5)
    state = {f"small{i}": rng.standard_normal(300).astype(np.float32) for i in range(32)}
    state["wide"] = rng.standard_normal((64, 2048)).astype(np.float32)
    state.update({f"small{i}": rng.standard_normal(300).astype(np.float32) for i in range(32, 64)})
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=1, checksum_block_bytes=32 << 10),
             no_dist=True)
    entries = {e["fqn"]: e for e in json.loads((path / "metadata.json").read_text())["storage_data"]}
    assert entries["wide"]["checksum"]["block_shape"] == [32, 256]  # 2 slabs of 8 column tiles
    return entries


@pytest.mark.parametrize("when", ["hashing", "reading"])
@pytest.mark.parametrize("case", ["flat", "tiles"])
def test_a_file_truncated_during_the_verify_pass_fails_the_load_not_the_process(tmp_path, case, when):
    path = tmp_path / "ckpt"
    entries = _save(path)
    data_file = path / entries["wide"]["file"]
    keep = entries["small20"]["byte_offset"] if case == "flat" else entries["wide"]["byte_offset"] + 3000
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ROOT), str(path), str(data_file), str(keep), when, case],
        capture_output=True, text=True, timeout=300, check=False)
    assert child.returncode != -signal.SIGBUS, f"killed by SIGBUS: {child.stderr[-2000:]}"
    assert child.returncode == 0, child.stderr[-3000:]
    out = child.stdout.strip().splitlines()[-1]
    assert out.startswith("ERROR") and " True |" in out, out  # the hook truncated the file, the load failed
    assert data_file.name in out and "unchanged" in out, out


def test_sparse_windows_are_read_not_mapped(tmp_path, monkeypatch):
    """A load of every other small key and of a column half: sparse windows only, no data file mapped."""
    path = tmp_path / "ckpt"
    _save(path)
    import mmap  # pylint: disable=import-outside-toplevel

    from hyper_parallel.core.distributed_checkpoint import _verify_reads  # pylint: disable=import-outside-toplevel

    sparse = []
    window = _verify_reads._window
    monkeypatch.setattr(_verify_reads, "_window", lambda s, p, w: sparse.append(not w.whole) or window(s, p, w))
    monkeypatch.setattr(mmap, "mmap", lambda fd, *a, **k: pytest.fail(f"mapped descriptor {fd}") if fd >= 0 else None)
    state = {f"small{i}": np.zeros(300, np.float32) for i in range(0, 64, 2)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path, thread_count=1), no_dist=True)
    param = ms.Parameter(ms.Tensor(np.zeros((64, 1024), np.float32)), name="wide")
    dcp.load({"wide": DTensor(param, Layout((2,), (-1, 0)), (64, 2048), rank=1)},
             storage_reader=dcp.FileSystemReader(path, thread_count=1, no_readahead=True), no_dist=True)
    assert any(sparse)
    rng = np.random.default_rng(5)
    smalls = [rng.standard_normal(300).astype(np.float32) for _ in range(32)]
    wide = rng.standard_normal((64, 2048)).astype(np.float32)
    assert all(np.array_equal(state[f"small{i}"], smalls[i]) for i in range(0, 32, 2))
    assert np.array_equal(param.asnumpy(), wide[:, 1024:])


@pytest.mark.parametrize("ranges,expected", [
    ([], []),
    ([(10, 20)], [(10, 20)]),
    # rows of 1 KiB every 2 KiB: every page holds bytes of a range, one read
    ([(r * 2048, r * 2048 + 1024) for r in range(8)], [(0, 7 * 2048 + 1024)]),
    # the gap holds page 1 whole: two reads; a gap inside pages 2-3 only: merged
    ([(0, 100), (8192, 8200), (12000, 12500)], [(0, 100), (8192, 12500)]),
    # ranges on the same or neighbouring pages merge; page 3 lies free between pages 2 and 4
    ([(0, 4095), (4096, 5000), (9000, 9001), (17000, 17001)], [(0, 9001), (17000, 17001)]),
])
def test_page_runs_merge_only_ranges_with_no_free_page_between(ranges, expected):
    from hyper_parallel.core.distributed_checkpoint._verify_reads import page_runs  # pylint: disable=import-outside-toplevel

    assert page_runs(ranges) == expected
    pages = lambda spans: {p for low, high in spans for p in range(low // 4096, (high - 1) // 4096 + 1)}
    assert pages(page_runs(ranges)) == pages(ranges)  # the device reads the same pages
