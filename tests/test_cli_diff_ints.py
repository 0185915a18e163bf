"""``hp-ckpt diff`` compares integer tensors exactly, whatever ``--rtol`` / ``--atol`` say."""

from __future__ import annotations

import numpy as np

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli import main

__all__: list[str] = []

BIG = 2**60


def _save(path, ids: np.ndarray, counts: np.ndarray, w: np.ndarray) -> None:
    dcp.save({"ids": ids, "counts": counts, "w": w, "global_step": 3}, checkpoint_id=path, no_dist=True)


def test_diff_with_tolerance_compares_integers_exactly(tmp_path, capsys):
    """Two int64 tensors differing by 1 above 2**53 were reported equal under ``--rtol``: as float64 they are one
    number. Tolerances still apply to float tensors."""
    ids = np.array([BIG, 5, -BIG], np.int64)
    counts = np.array([np.iinfo(np.uint64).max, 0], np.uint64)
    w = np.array([1.0, 2.0], np.float32)
    _save(tmp_path / "a", ids, counts, w)
    _save(tmp_path / "b", ids + np.array([1, 0, 0], np.int64), counts, w + np.float32(1e-6))
    code = main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--rtol", "1e-6"])
    out = capsys.readouterr().out
    assert code == 1
    lines = [line for line in out.splitlines() if line.startswith(("ids ", "w ", "counts "))]
    assert len(lines) == 1 and lines[0].startswith("ids ")
    assert "1 of 3 element(s) differ, max |a-b| = 1" in lines[0]

    _save(tmp_path / "c", np.array([np.iinfo(np.int64).min, 5, -BIG], np.int64),
          np.array([0, 0], np.uint64), w)
    _save(tmp_path / "d", np.array([np.iinfo(np.int64).max, 5, -BIG], np.int64),
          np.array([np.iinfo(np.uint64).max, 0], np.uint64), w)
    code = main(["diff", str(tmp_path / "c"), str(tmp_path / "d"), "--atol", "1e30"])
    out = capsys.readouterr().out
    assert code == 1
    found = {line.split()[0]: line for line in out.splitlines() if line.startswith(("ids ", "counts "))}
    assert "1 of 3 element(s) differ, max |a-b| = 1.84467e+19" in found["ids"]
    assert "1 of 2 element(s) differ, max |a-b| = 1.84467e+19" in found["counts"]
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a"), "--rtol", "1e-6"]) == 0


def test_diff_of_bfloat16_tensors_that_differ_reports_them(tmp_path, capsys):
    """Two bfloat16 tensors differing in one element: the differing elements were picked with a boolean mask on
    MindSpore's numpy bfloat16, which raises MemoryError (memcpy_s failed), so hp-ckpt diff crashed instead of
    reporting the difference."""
    import mindspore as ms  # pylint: disable=import-outside-toplevel

    for name, values in (("a", [1.0, 2.0, 3.0]), ("b", [1.0, 5.0, 3.0])):
        dcp.save({"w": ms.Tensor(np.array(values, np.float32), ms.bfloat16)}, checkpoint_id=tmp_path / name,
                 no_dist=True)
    code = main(["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("w ")]
    assert code == 1 and len(lines) == 1
    assert "1 of 3 element(s) differ, max |a-b| = 3" in lines[0]
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--atol", "3"]) == 0


def test_diff_help_says_tolerances_are_for_floats(capsys):
    assert main(["diff", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "relative tolerance for floating-point tensors" in text
    assert "integer and bool tensors and stored values are always compared exactly" in text
