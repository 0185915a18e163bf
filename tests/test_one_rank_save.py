"""A save called on rank 0 only under msrun (``if get_rank() == 0: save_checkpoint(...)``, a MindSpore habit).

Before, rank 0 waited in the plan step until MindSpore's collective gave up (30 s on CPU) and raised
``RuntimeError: AllGather failed.`` with a C++ stack and no word of the checkpoint: the save seemed to have
hit a bug of MindSpore. Now it raises ``CollectiveTimeoutError`` naming the step and rank, the likely cause (a
rank that never called the save) and the fix, and later steps of the process fail at once with it.
"""

from __future__ import annotations

from pathlib import Path

from msrun_harness import run_workers

WORKER = Path(__file__).resolve().parent / "workers" / "one_rank_save_worker.py"


def test_a_save_on_rank_0_only_names_the_cause_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    results = run_workers(WORKER, workers=2, tmp_path=tmp_path, args=[str(tmp_path / "base")], timeout=400,
                          env={"HP_CKPT_COLLECTIVE_TIMEOUT": "100"})
    outcome = results[0]["only_rank_0"]
    assert outcome["ok"], outcome
    first, second = outcome["value"]["first"], outcome["value"]["second"]
    assert {"CollectiveTimeoutError", "CheckpointError", "TimeoutError"} <= set(first["classes"]), first
    assert first["error"].startswith("CollectiveTimeoutError: rank 0: checkpoint step 'plan digest' failed in MindSpore's collective"), first
    assert "never called this step" in first["error"] and "a save on rank 0 only is not a collective save" in \
        first["error"] and "pass no_dist=True there" in first["error"], first
    assert not first["committed"] and not second["committed"]
    assert second["error"] == first["error"] and second["seconds"] < 5, second  # unusable: at once
    assert outcome["value"]["fixed"]
