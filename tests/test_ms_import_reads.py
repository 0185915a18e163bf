"""``hp-ckpt import`` of per-rank files reads each stored byte once, replicas compared (``/proc/self/io``, cold).

A box the strategy gives several ranks is stored from one rank; the other ranks' copies are compared with it. The
stored copy used to be read once to take its digest while the import was planned and again when it was written: an
import larger than the page cache read it from the device twice. Now the planning reads the other copies only, and
the stored copy of a box larger than ``PLAN_CHECK_BYTES`` is compared through the checksums the writer takes of the
bytes it writes. Small boxes and the tensors the strategy does not list are compared while planning, so rank files
of different steps (a ``global_step`` that differs) are refused before a byte is written.
"""

from __future__ import annotations

import os
from pathlib import Path

import mindspore
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli import import_checkpoint
from hyper_parallel.cli._ms_replicas import PLAN_CHECK_BYTES
from hyper_parallel.cli.import_cmd import _plan_source
from hyper_parallel.core.distributed_checkpoint.errors import LayoutError
from tests.device_io import read_bytes
from tests.page_cache import evict
from tests.strategy_files import ParamStrategy, write_strategy_file

MIB = 1 << 20
#: Bytes a cold plan may read besides the copies it compares: the files' protobuf fields, read by small preads.
SLACK = 256 << 10


def _job(root: Path, *, differ: str | None = None) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """2 ranks: ``w`` (2 MiB) and ``b`` (4 KiB) replicated on both, ``s`` (4 MiB) split by rows, ``global_step``
    not in the strategy; rank files of MindSpore. Rank 1's copy of ``differ`` is off by one."""
    rng = np.random.default_rng(5)
    full = {"w": rng.standard_normal((512, 1024)).astype(np.float32),
            "b": rng.standard_normal(1024).astype(np.float32),
            "s": rng.standard_normal((1024, 1024)).astype(np.float32),
            "global_step": np.array(100, np.int32)}
    strategy = write_strategy_file(root / "strategy.ckpt", (
        ParamStrategy("w", dev_matrix=(2,), tensor_map=(-1, -1)),
        ParamStrategy("b", dev_matrix=(2,), tensor_map=(-1,)),
        ParamStrategy("s", dev_matrix=(2,), tensor_map=(0, -1)),
    ))
    src = root / "ranks"
    for rank in range(2):
        (src / f"rank_{rank}").mkdir(parents=True)
        pieces = {name: value + value.dtype.type(name == differ and rank == 1) for name, value in full.items()}
        pieces["s"] = full["s"][rank * 512:(rank + 1) * 512]
        mindspore.save_checkpoint([{"name": k, "data": mindspore.Tensor(v)} for k, v in pieces.items()],
                                  str(src / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"))
    return src, strategy, full


def _cold(src: Path) -> list[Path]:
    files = sorted(src.glob("rank_*/*.ckpt"))
    evict(files)
    probe = files[0]
    before = read_bytes()
    probe.read_bytes()
    if read_bytes() - before < probe.stat().st_size // 2:
        pytest.skip(f"{src}: no device reads accounted (tmpfs?)")
    evict(files)
    return files


def test_each_stored_byte_is_read_once_and_replicas_once(tmp_path):
    src, strategy, full = _job(tmp_path)
    files = _cold(src)
    replica_bytes = full["w"].nbytes + full["b"].nbytes + full["global_step"].nbytes  # rank 1's copies
    # Rank 0's copies compared while planning: the small ones only.
    small = sum(a.nbytes for name, a in full.items() if name != "s" and a.nbytes <= PLAN_CHECK_BYTES)
    assert full["w"].nbytes > PLAN_CHECK_BYTES >= full["b"].nbytes
    before = read_bytes()
    _plan_source(src, [strategy], False, True)
    planned = read_bytes() - before
    # The old code read rank 0's copies of "w" too (their digests), then the writer read them again.
    assert replica_bytes + small <= planned <= replica_bytes + small + SLACK, (planned, replica_bytes)

    files = _cold(src)
    before = read_bytes()
    import_checkpoint(src, tmp_path / "out", strategy_files=[strategy])
    total = read_bytes() - before
    file_bytes = sum(path.stat().st_size for path in files)
    assert sum(a.nbytes for a in full.values()) + replica_bytes <= total <= file_bytes + SLACK, (total, file_bytes)
    targets = {name: None for name in full}
    dcp.load(targets, checkpoint_id=tmp_path / "out", no_dist=True)
    assert all(np.array_equal(targets[name], full[name]) for name in full)


def test_a_replica_that_differs_fails_the_import_after_the_write_with_nothing_left(tmp_path):
    src, strategy, _ = _job(tmp_path, differ="w")
    with pytest.raises(LayoutError) as refused:
        import_checkpoint(src, tmp_path / "out", strategy_files=[strategy])
    message = str(refused.value)
    assert "parameter 'w' (global shape [512, 1024])" in message, message
    assert "ranks [1] hold other values than rank 0 for the box at [0, 0]" in message, message
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")
    import_checkpoint(src, tmp_path / "unchecked", strategy_files=[strategy], check_replicas=False)


def _written() -> int:
    """Bytes this process has passed to write calls so far (``/proc/self/io`` wchar)."""
    with open("/proc/self/io", encoding="ascii") as handle:
        return int(dict(line.split(": ") for line in handle.read().splitlines())["wchar"])


@pytest.mark.parametrize("differ, message", [
    ("global_step", "parameter 'global_step' is not in the strategy file but ranks [1] hold other values than rank 0 "
                    "(int32 [] on each), so it is no replica"),
    ("b", "parameter 'b' (global shape [1024]): the strategy makes replicas of ranks' slices that differ: ranks [1] "
          "hold other values than rank 0 for the box at [0]. "),
])
def test_small_copies_that_differ_are_refused_while_planning_before_a_byte_is_written(tmp_path, differ, message):
    # Rank files of different steps: their global_step (not in the strategy) or a small replicated box differ. 6e1977a
    # compared them after writing the whole output (then removed it): a real job wrote hundreds of GiB first.
    src, strategy, full = _job(tmp_path, differ=differ)
    with pytest.raises(LayoutError) as planned:
        _plan_source(src, [strategy], False, True)
    assert message in str(planned.value), str(planned.value)
    before = _written()
    with pytest.raises(LayoutError) as refused:
        import_checkpoint(src, tmp_path / "out", strategy_files=[strategy])
    written = _written() - before
    assert str(refused.value) == str(planned.value)
    assert written < full["s"].nbytes // 4, written  # 6e1977a: 6 MiB, the data file, before the refusal
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")
