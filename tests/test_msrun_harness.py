"""Tests of the msrun harness (``msrun_harness`` + ``worker_lib``) itself."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from msrun_harness import RESULT_DIR_ENV, check_scenarios, run_workers, scenario_values

pytest.importorskip("mindspore")

pytestmark = [pytest.mark.msrun]

PROBE = Path(__file__).resolve().parent / "workers" / "harness_probe_worker.py"


def _survivors(tmp_path: Path) -> list[str]:
    """Return command lines of live processes belonging to the launch in ``tmp_path``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.info["cmdline"] or [])
            if str(tmp_path) in cmdline or (
                str(PROBE) in cmdline and proc.environ().get(RESULT_DIR_ENV, "").startswith(str(tmp_path))
            ):
                found.append(f"{proc.pid}: {cmdline}")
        except psutil.Error:
            continue
    return found


def test_probe_scenarios(tmp_path: Path) -> None:
    """One 2-rank launch: values per rank, and the deliberate failure on rank 1."""
    results = run_workers(PROBE, workers=2, tmp_path=tmp_path, timeout=240)

    assert scenario_values(results, "rank_world") == [(0, 2, 0, 2, True), (1, 2, 1, 2, True)]
    gathered = [{"rank": 0, "square": 0}, {"rank": 1, "square": 1}]
    assert scenario_values(results, "all_gather") == [gathered, gathered]
    assert scenario_values(results, "broadcast_from_1") == ["payload of rank 1"] * 2
    assert scenario_values(results, "after_failure") == [[10, 11], [10, 11]]
    assert scenario_values(results, "shared_dir") == [["rank_0.txt", "rank_1.txt"]] * 2
    assert results[0]["deliberate_failure"] == {"ok": True, "value": "fine", "error": "", "traceback": ""}
    assert results[1]["deliberate_failure"]["ok"] is False
    check_scenarios(results, ["rank_world", "all_gather", "broadcast_from_1", "after_failure", "shared_dir"])

    with pytest.raises(AssertionError) as info:
        check_scenarios(results)
    message = str(info.value)
    assert message.startswith("1 scenario failure(s)")
    assert "rank 1, scenario 'deliberate_failure': ValueError: deliberate failure on rank 1" in message
    assert "raise ValueError" in message  # the traceback
    assert "rank 0, scenario" not in message
    with pytest.raises(AssertionError, match="rank 1, scenario 'deliberate_failure'"):
        scenario_values(results, "deliberate_failure")


def test_uncaught_worker_exception_shows_traceback_first(tmp_path: Path) -> None:
    """A rank dying of an exception fails the launch quickly, its traceback first."""
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_workers(PROBE, workers=2, tmp_path=tmp_path, timeout=240, args=["crash"])
    message = str(info.value)
    assert time.monotonic() - start < 120
    assert message.index("rank 1 raised RuntimeError: probe crash on rank 1") < message.index("----- worker_0.log")
    assert 'raise RuntimeError("probe crash on rank 1")' in message
    assert "----- scheduler.log" in message
    assert not _survivors(tmp_path)


def test_hanging_workers_are_killed_at_timeout(tmp_path: Path) -> None:
    """Workers sleeping forever are killed at the timeout, with log tails in the error."""
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_workers(PROBE, workers=2, tmp_path=tmp_path, timeout=45, args=["hang"])
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert 45 <= elapsed < 90
    assert "timeout" in message
    assert "no result from rank(s) [0, 1]" in message
    assert "----- worker_1.log" in message and "probe rank 1: hanging on purpose" in message
    assert not _survivors(tmp_path)
