"""``exception_save`` when only some ranks raise: the raising rank's own error shows within
``HP_CKPT_BREAKPOINT_TIMEOUT`` seconds, and no breakpoint step is committed without every rank's shards.

Before, the breakpoint save was collective: a rank raising alone waited in it ``HP_CKPT_COLLECTIVE_TIMEOUT``
seconds (1800 by default) and then raised a ``CollectiveTimeoutError`` instead of its own error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _breakpoint_steps
from hyper_parallel.core.distributed_checkpoint._breakpoint_steps import (
    BREAKPOINT_TIMEOUT_ENV,
    arrival_problem,
    breakpoint_timeout,
    everyone_arrived,
)
from msrun_harness import run_workers

WORKER = Path(__file__).resolve().parent / "workers" / "breakpoint_alone_worker.py"
COLLECTIVE_TIMEOUT = 40
BREAKPOINT_TIMEOUT = 4


def test_a_rank_raising_alone_shows_its_error_promptly_and_commits_no_breakpoint(tmp_path: Path) -> None:
    results = run_workers(WORKER, workers=2, tmp_path=tmp_path, args=[str(tmp_path / "base")], timeout=400,
                          env={"HP_CKPT_COLLECTIVE_TIMEOUT": str(COLLECTIVE_TIMEOUT),
                               "HP_CKPT_BREAKPOINT_TIMEOUT": str(BREAKPOINT_TIMEOUT)})
    for rank in (0, 1):
        together = results[rank]["together"]
        assert together["ok"], together
        info = together["value"]
        assert info["error"] == f"RuntimeError: rank {rank}: the data loader failed at step 8 (injected)", info
        assert info["committed"] == ["breakpoint_00000007"] and "weight" in info["loaded"], info
        alone = results[rank]["alone"]
        assert alone["ok"], alone
        info = alone["value"]
        assert info["error"] == f"RuntimeError: rank {rank}: the data loader failed at step 8 (injected)", info
        assert info["committed"] == [], info  # no breakpoint step 7 with one rank's shards
        assert info["seconds"] < BREAKPOINT_TIMEOUT + 15, info


def test_the_gathered_arrivals_decide_the_same_on_every_rank(monkeypatch) -> None:
    """The decision is a pure function of what every rank sent: each rank that completed the gather decides
    the same (no rank goes on into the save to wait alone)."""
    arrival = _breakpoint_steps._Arrival  # pylint: disable=protected-access
    assert arrival_problem([arrival(7, 100.0), arrival(7, 130.0)], 60.0) is None
    assert arrival_problem([arrival(7, 100.0), arrival(7, 156.0)], 60.0) == (
        "the last rank arrived 56.0 s after the first, which may have stopped waiting")
    assert arrival_problem([arrival(7, 100.0), arrival(8, 100.0)], 60.0) == "the ranks are at different steps [7, 8]"
    assert arrival_problem([arrival(7, 100.0), "another step's message"], 60.0) == (
        "rank(s) [1] were in another step")
    assert arrival_problem([arrival(7, 100.0), arrival(7, 102.5)], 4.0) == (
        "the last rank arrived 2.5 s after the first, which may have stopped waiting")
    monkeypatch.delenv(BREAKPOINT_TIMEOUT_ENV, raising=False)
    assert breakpoint_timeout() == 60.0 and everyone_arrived(7, "RuntimeError")  # one process: nobody to wait for
    monkeypatch.setenv(BREAKPOINT_TIMEOUT_ENV, " 2.5 ")
    assert breakpoint_timeout() == 2.5
    for bad in ("soon", "0", "-3", "nan"):
        monkeypatch.setenv(BREAKPOINT_TIMEOUT_ENV, bad)
        with pytest.raises(dcp.CheckpointValueError, match=f"HP_CKPT_BREAKPOINT_TIMEOUT='{bad}' is not a positive"):
            breakpoint_timeout()
        assert everyone_arrived(7, "RuntimeError")  # one process reads no setting: a bad one costs no save
