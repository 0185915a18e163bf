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
                          env={"HP_CKPT_COLLECTIVE_TIMEOUT": "100", "HP_CKPT_WAIT_NOTICE": "1.5"})
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
    # The wait is named in the log long before the collective gives up (on Ascend: HCCL's timeout, or 1800 s).
    assert first["notices"] == [
        "rank 0: checkpoint step 'plan digest' has waited 1.5 s for the other ranks and waits up to 100 s "
        "(HP_CKPT_COLLECTIVE_TIMEOUT): a rank is slow, died, hangs, or never called this step. Every rank calls "
        "save and load: a save on rank 0 only (if get_rank() == 0: save_checkpoint(...)) waits until the timeout; "
        "for a state rank 0 holds whole, pass no_dist=True there (this notice: HP_CKPT_WAIT_NOTICE, seconds, 0 for "
        "none)"], first
    # The notice only reports: a rank arriving after it (rank 1 4 s late, the notice at 1.5 s) saves as before.
    slow = [results[rank]["slow_rank"] for rank in (0, 1)]
    assert all(entry["ok"] and entry["value"]["error"] is None and entry["value"]["committed"] for entry in slow), slow
    assert len(slow[0]["value"]["notices"]) == 1 and "'plan digest' has waited 1.5 s" in slow[0]["value"]["notices"][0]
    assert slow[1]["value"]["notices"] == [], slow


def test_only_mindspores_own_collective_failure_marks_communication_unusable(monkeypatch) -> None:
    """A plain RuntimeError from a collective call (MindSpore giving up) marks communication unusable; a subclass
    (RecursionError, NotImplementedError: a failure of this process) is raised as it is and leaves communication
    usable, with a timeout and without one. An infinite timeout (HP_CKPT_COLLECTIVE_TIMEOUT=inf,
    HP_CKPT_BREAKPOINT_TIMEOUT=inf) waits instead of overflowing Event.wait."""
    import math  # pylint: disable=import-outside-toplevel

    import pytest  # pylint: disable=import-outside-toplevel

    from hyper_parallel.core.distributed_checkpoint import _collectives
    from hyper_parallel.core.distributed_checkpoint.errors import CollectiveTimeoutError

    monkeypatch.setattr(_collectives, "_broken", [])

    def raising(error: BaseException):
        def call():
            raise error
        return call

    for timeout in (5.0, None):
        for error in (RecursionError("deep"), NotImplementedError("no")):
            with pytest.raises(type(error)) as caught:
                _collectives._within(raising(error), step="plan", rank=0, timeout=timeout)
            assert caught.value is error
            assert _collectives._within(lambda: 7, step="plan", rank=0, timeout=timeout) == 7
    assert _collectives._within(lambda: 8, step="plan", rank=0, timeout=math.inf) == 8
    assert _collectives._within(lambda: 9, step="plan", rank=0, timeout=1e300) == 9
    with pytest.raises(CollectiveTimeoutError, match="failed in MindSpore's collective \\(AllGather failed\\)"):
        _collectives._within(raising(RuntimeError("AllGather failed\nC++ stack")), step="plan", rank=0, timeout=None)
    with pytest.raises(CollectiveTimeoutError, match="checkpoint step 'plan' failed in MindSpore"):
        _collectives._within(lambda: 1, step="next", rank=0, timeout=5.0)  # unusable now: at once


def test_a_step_waiting_past_the_notice_logs_once_and_completes(monkeypatch, caplog) -> None:
    """The wait notice only reports: a collective call slower than HP_CKPT_WAIT_NOTICE logs one line naming the
    step, the rank and both limits, then returns its value; with the notice at 0 nothing is logged."""
    import logging  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel

    import pytest  # pylint: disable=import-outside-toplevel

    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel

    from hyper_parallel.core.distributed_checkpoint import _collectives

    monkeypatch.setattr(_collectives, "_broken", [])
    monkeypatch.setenv("HP_CKPT_WAIT_NOTICE", "0.05")

    def slow() -> int:
        time.sleep(0.4)
        return 7

    with caplog.at_level(logging.WARNING, logger=_collectives.__name__):
        assert _collectives._within(slow, step="plan", rank=3, timeout=30) == 7  # pylint: disable=protected-access
    assert [r.getMessage()[:98] for r in caplog.records] == [
        "rank 3: checkpoint step 'plan' has waited 0.05 s for the other ranks and waits up to 30 s (HP_CKPT"]
    caplog.clear()
    monkeypatch.setenv("HP_CKPT_WAIT_NOTICE", "0")
    with caplog.at_level(logging.WARNING, logger=_collectives.__name__):
        assert _collectives._within(slow, step="plan", rank=3, timeout=30) == 7  # pylint: disable=protected-access
    assert not caplog.records
    monkeypatch.setenv("HP_CKPT_WAIT_NOTICE", "soon")  # refused before the collective call starts
    called = []
    with pytest.raises(dcp.CheckpointValueError,
                       match="HP_CKPT_WAIT_NOTICE='soon' is not a number of seconds; set e.g. 60, "
                             "or 0 to log no notice$"):
        within = _collectives._within  # pylint: disable=protected-access
        within(lambda: called.append(1), step="plan", rank=3, timeout=30)
    assert not called and not _collectives._broken  # pylint: disable=protected-access
