"""``hp-ckpt import`` of per-rank files reads each stored byte once, replicas compared (``/proc/self/io``, cold).

A box the strategy gives several ranks is stored from one rank; the other ranks' copies are compared with it. The
stored copy used to be read once to take its digest while the import was planned and again when it was written: an
import larger than the page cache read it from the device twice. Now the planning reads the other copies only, and
the stored copy of a box larger than ``PLAN_CHECK_BYTES`` is compared through the checksums the writer takes of the
bytes it writes. Small boxes and the tensors the strategy does not list are compared while planning, so rank files
of different steps (a ``global_step`` that differs) are refused before a byte is written; so is a larger box whose
copies differ in its sample pages (a strategy that is not the job's: slices of another layout differ all over), the
sample of the stored copy read once (the writer finds it in the page cache).
"""

from __future__ import annotations

import os
from pathlib import Path

import mindspore
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli import import_checkpoint
from hyper_parallel.cli._ms_replicas import PLAN_CHECK_BYTES, SAMPLE_PAGES, sample_starts
from hyper_parallel.cli.import_cmd import _plan_source
from hyper_parallel.core.distributed_checkpoint.errors import LayoutError
from tests.device_io import read_bytes
from tests.page_cache import evict
from tests.strategy_files import ParamStrategy, write_strategy_file

mindspore.set_device("CPU")

MIB = 1 << 20
#: Bytes a cold plan may read besides the copies it compares: the files' protobuf fields, read by small preads.
SLACK = 256 << 10


def _job(root: Path, *, differ: str | None = None, element: int | None = None
         ) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """2 ranks: ``w`` (2 MiB) and ``b`` (4 KiB) replicated on both, ``s`` (4 MiB) split by rows, ``global_step``
    not in the strategy; rank files of MindSpore. Rank 1's copy of ``differ`` is off by one (in its flat
    ``element`` only, when given)."""
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
        pieces = {name: value + value.dtype.type(name == differ and rank == 1 and element is None)
                  for name, value in full.items()}
        if differ and rank == 1 and element is not None:
            pieces[differ].reshape(-1)[element] += 1
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
    # Rank 0's copies compared while planning: the small ones, and the sample pages of "w" (2 pages at most each).
    small = sum(a.nbytes for name, a in full.items() if name != "s" and a.nbytes <= PLAN_CHECK_BYTES)
    assert full["w"].nbytes > PLAN_CHECK_BYTES >= full["b"].nbytes
    sample = SAMPLE_PAGES * 4096
    before = read_bytes()
    _plan_source(src, [strategy], False, True)
    planned = read_bytes() - before
    # The old code read rank 0's copies of "w" too (their digests), then the writer read them again.
    assert replica_bytes + small + sample <= planned <= replica_bytes + small + 2 * sample + SLACK, (planned,
                                                                                                    replica_bytes)

    files = _cold(src)
    before = read_bytes()
    import_checkpoint(src, tmp_path / "out", strategy_files=[strategy])
    total = read_bytes() - before
    file_bytes = sum(path.stat().st_size for path in files)
    assert sum(a.nbytes for a in full.values()) + replica_bytes <= total <= file_bytes + SLACK, (total, file_bytes)
    targets = {name: None for name in full}
    dcp.load(targets, checkpoint_id=tmp_path / "out", no_dist=True)
    assert all(np.array_equal(targets[name], full[name]) for name in full)


def test_a_replica_that_differs_off_its_sample_fails_the_import_after_the_write_with_nothing_left(tmp_path):
    # One float of rank 1's copy of "w" differs, on a page the planning does not sample: compared whole as written.
    starts = sample_starts(512 * 1024 * 4, 0)
    element = (starts[1] + starts[2]) // 2 // 4
    assert not any(start <= element * 4 < start + 2 * 4096 for start in starts)
    src, strategy, _ = _job(tmp_path, differ="w", element=element)
    _plan_source(src, [strategy], False, True)  # the sample pages agree
    before = _written()
    with pytest.raises(LayoutError) as refused:
        import_checkpoint(src, tmp_path / "out", strategy_files=[strategy])
    assert _written() - before > 4 * MIB  # refused after the write
    message = str(refused.value)
    assert "parameter 'w' (global shape [512, 1024])" in message, message
    assert ("ranks [1] hold other values than rank 0 for the box at [0, 0] (files: rank 0 "
            f"{src}/rank_0/checkpoint_0.ckpt, rank 1 {src}/rank_1/checkpoint_1.ckpt)") in message, message
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")
    import_checkpoint(src, tmp_path / "unchecked", strategy_files=[strategy], check_replicas=False)


def _written() -> int:
    """Bytes this process has passed to write calls so far (``/proc/self/io`` wchar)."""
    with open("/proc/self/io", encoding="ascii") as handle:
        return int(dict(line.split(": ") for line in handle.read().splitlines())["wchar"])


_FILES = "files: rank 0 {src}/rank_0/checkpoint_0.ckpt, rank 1 {src}/rank_1/checkpoint_1.ckpt"


@pytest.mark.parametrize("differ, message", [
    ("global_step", "parameter 'global_step' is not in the strategy file but ranks [1] hold other values than rank 0 "
                    "(int32 [] on each; " + _FILES + "), so it is no replica"),
    ("b", "parameter 'b' (global shape [1024]): the strategy makes replicas of ranks' slices that differ: ranks [1] "
          "hold other values than rank 0 for the box at [0] (" + _FILES + "). "),
    ("w", "parameter 'w' (global shape [512, 1024]): the strategy makes replicas of ranks' slices that differ: ranks "
          "[1] hold other values than rank 0 for the box at [0, 0] (" + _FILES + "). Either the strategy file is not "
          "the one of the job that wrote these files (pass that job's strategy file(s), one per pipeline stage)"),
])
def test_copies_that_differ_are_refused_while_planning_before_a_byte_is_written(tmp_path, differ, message):
    # Rank files of different steps: their global_step (not in the strategy) or a replicated box differ. 6e1977a
    # compared them after writing the whole output (then removed it): a real job wrote hundreds of GiB first.
    # f279388 compared boxes of at most 1 MiB while planning, larger ones ("w", 2 MiB) only after the write.
    src, strategy, full = _job(tmp_path, differ=differ)
    with pytest.raises(LayoutError) as planned:
        _plan_source(src, [strategy], False, True)
    assert message.format(src=src) in str(planned.value), str(planned.value)
    before = _written()
    with pytest.raises(LayoutError) as refused:
        import_checkpoint(src, tmp_path / "out", strategy_files=[strategy])
    written = _written() - before
    assert str(refused.value) == str(planned.value)
    assert written < full["s"].nbytes // 4, written  # 6e1977a: 6 MiB, the data file, before the refusal
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")


def test_a_strategy_of_another_layout_is_refused_before_a_byte_is_written_where_transform_checkpoints_merges(
        tmp_path):
    # A real job: "w" and "v" (4 MiB each) split by rows over 4 ranks, rank files made by MindSpore. The strategy
    # of another job (2 data-parallel x 2 model-parallel) makes ranks 0 and 1 replicas of rows that are not theirs.
    rng = np.random.default_rng(9)
    full = {name: rng.standard_normal((1024, 1024)).astype(np.float32) for name in ("v", "w")}
    right = write_strategy_file(tmp_path / "right.ckpt", tuple(ParamStrategy(n, (4,), (0, -1)) for n in full))
    wrong = write_strategy_file(tmp_path / "wrong.ckpt", tuple(ParamStrategy(n, (2, 2), (1, -1)) for n in full))
    (tmp_path / "full" / "rank_0").mkdir(parents=True)
    mindspore.save_checkpoint([{"name": k, "data": mindspore.Tensor(v)} for k, v in full.items()],
                              str(tmp_path / "full" / "rank_0" / "full.ckpt"))
    src = tmp_path / "ranks"
    mindspore.parallel.transform_checkpoints(str(tmp_path / "full"), str(src), "checkpoint_", None, right)
    before = _written()
    with pytest.raises(LayoutError) as refused:
        import_checkpoint(src, tmp_path / "out", strategy_files=[wrong])
    assert _written() - before < 64 << 10  # f279388: 8 MiB written, then refused
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")
    assert str(refused.value).startswith(
        "parameter 'v' (global shape [512, 1024]): the strategy makes replicas of ranks' slices that differ: ranks [1] "
        f"hold other values than rank 0 for the box at [0, 0] (files: rank 0 {src}/rank_0/checkpoint_0.ckpt, rank 1 "
        f"{src}/rank_1/checkpoint_1.ckpt); ranks [3] hold other values than rank 2 for the box at [256, 0] (files: "
        f"rank 2 {src}/rank_2/checkpoint_2.ckpt, rank 3 {src}/rank_3/checkpoint_3.ckpt). Either the strategy file is "
        "not the one of the job that wrote these files (pass that job's strategy file(s)"), str(refused.value)
    # MindSpore's own merge with that strategy gives tensors of half the rows, silently.
    mindspore.parallel.transform_checkpoints(str(src), str(tmp_path / "ms"), "m_", wrong, None)
    merged = mindspore.load_checkpoint(str(tmp_path / "ms" / "rank_0" / "m_0.ckpt"))
    assert merged["w"].shape == (512, 1024) and not np.array_equal(merged["w"].asnumpy(), full["w"][:512])
    import_checkpoint(src, tmp_path / "right", strategy_files=[right])  # the job's strategy: the full tensors
    targets = {name: None for name in full}
    dcp.load(targets, checkpoint_id=tmp_path / "right", no_dist=True)
    assert all(np.array_equal(targets[name], full[name]) for name in full)


def test_other_copies_that_differ_from_each_other_off_the_sample_are_refused_while_planning(tmp_path):
    # "w" (2 MiB) replicated on 4 ranks; rank 3's copy differs from the others in one float off the sample pages.
    # The copies of ranks 1-3 are read whole while planning: compared with each other there.
    value = np.random.default_rng(3).standard_normal((512, 1024)).astype(np.float32)
    strategy = write_strategy_file(tmp_path / "strategy.ckpt", (ParamStrategy("w", (4,), (-1, -1)),))
    starts = sample_starts(value.nbytes, 0)
    src = tmp_path / "ranks"
    for rank in range(4):
        copy = value.copy()
        copy.reshape(-1)[(starts[5] + starts[6]) // 8] += rank == 3
        (src / f"rank_{rank}").mkdir(parents=True)
        mindspore.save_checkpoint([{"name": "w", "data": mindspore.Tensor(copy)}],
                                  str(src / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"))
    with pytest.raises(LayoutError) as refused:
        _plan_source(src, [strategy], False, True)
    assert (f"ranks [3] hold other values than rank 1 for the box at [0, 0] (files: rank 1 "
            f"{src}/rank_1/checkpoint_1.ckpt, rank 3 {src}/rank_3/checkpoint_3.ckpt)") in str(refused.value)


def test_two_directories_of_one_rank_are_refused_naming_both(tmp_path):
    # rank_1/ and rank_01/ (two copies of one rank, say of two steps): the second one scanned silently replaced
    # the first, so one rank's file was left out unread.
    src, strategy, _ = _job(tmp_path)
    (src / "rank_01").mkdir()
    mindspore.save_checkpoint([{"name": "s", "data": mindspore.Tensor(np.zeros((512, 1024), np.float32))}],
                              str(src / "rank_01" / "checkpoint_1.ckpt"))
    with pytest.raises(dcp.UnsupportedFormatError) as refused:
        import_checkpoint(src, tmp_path / "out", strategy_files=[strategy])
    assert str(refused.value) == (f"{src} holds two directories of rank 1 (rank_01/ and rank_1/): one would be left "
                                  "out; keep the one of the job's step to import")
    assert not (tmp_path / "out").exists()
