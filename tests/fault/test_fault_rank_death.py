"""A rank dying under msrun during planning, writing, commit or load: the others stop, nothing half lands.

Two ways a rank is lost, each checked in a few msrun launches (a dead rank
breaks its job's communication, so one case per launch):

- ``kill``: the rank is SIGKILLed. ``msrun`` polls its workers every second
  and ends the whole job when one exits abnormally; the job must be over
  within seconds.
- ``hang``: the rank stops answering (a lost host, a rank stuck in I/O) while
  its process lives on, so ``msrun`` sees nothing. MindSpore's CPU
  collectives would wait for it forever; the checkpoint's collective steps
  give up after ``HP_CKPT_COLLECTIVE_TIMEOUT`` seconds (8 here) with a
  ``CollectiveTimeoutError`` (a ``CheckpointError`` and ``TimeoutError``) on
  every surviving rank.

After either: the interrupted checkpoint B is not committed, and checkpoint A,
saved before, loads bit-exact in a fresh process. Each launch takes about a
minute: after ending the workers, msrun waits for its scheduler to time the
dead rank out.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp

from fault_common import SCRIPTS_DIR

TIMEOUT = 8.0
#: (mode, world size, phase, victim): every phase and both sizes, in six launches.
CASES = [("kill", 2, "planning", 1), ("kill", 2, "commit", 0), ("kill", 4, "writing", 3), ("kill", 4, "load", 1),
         ("hang", 2, "writing", 1), ("hang", 4, "commit", 0)]


def _full(seed: int, world: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)  # as the worker builds it
    return {"w": rng.standard_normal((8 * world, 16)).astype(np.float32),
            **{f"r{i}": rng.standard_normal(256) for i in range(2 * world)}}


@pytest.mark.msrun
@pytest.mark.parametrize("mode,world,phase,victim", CASES, ids=[f"{m}-{w}ranks-{p}" for m, w, p, _ in CASES])
def test_a_lost_rank_stops_the_others(tmp_path: Path, mode: str, world: int, phase: str, victim: int) -> None:
    from msrun_harness import run_workers  # pylint: disable=import-outside-toplevel

    shared = tmp_path / "shared"
    shared.mkdir()
    with pytest.raises(AssertionError, match="no result from rank"):  # the lost rank never reports
        run_workers(SCRIPTS_DIR / "rank_death_worker.py", workers=world, tmp_path=tmp_path / "launch",
                    args=[str(shared), mode, phase, str(victim)], timeout=300,
                    env={"HP_CKPT_COLLECTIVE_TIMEOUT": str(TIMEOUT)})
    ended = time.time()
    killed = json.loads((shared / "killed.json").read_text())
    assert killed["rank"] == victim
    survivors = [r for r in range(world) if r != victim]
    outcomes = {r: json.loads(path.read_text()) for r in survivors if (path := shared / f"rank{r}.json").exists()}
    if mode == "kill":  # msrun ended the job: the survivors were killed in their collective, soon
        assert not outcomes, outcomes
        assert ended - killed["at"] < 45, f"msrun took {ended - killed['at']:.0f} s to end the job"
        assert "kill all other workers" in (tmp_path / "launch" / "msrun_console.log").read_text()
    else:
        assert sorted(outcomes) == survivors, outcomes
        for rank, outcome in outcomes.items():
            assert outcome.get("classes"), f"rank {rank} finished without an error: {outcome}"
            assert {"CollectiveTimeoutError", "CheckpointError", "TimeoutError"} <= set(outcome["classes"]), outcome
            assert f"rank {rank}:" in outcome["message"] and "HP_CKPT_COLLECTIVE_TIMEOUT" in outcome["message"]
            assert TIMEOUT - 0.5 <= outcome["waited"] <= TIMEOUT + 20, outcome  # bounded by the timeout
    if phase != "load":
        assert not (shared / "B" / "metadata.json").exists(), "a save with a lost rank committed"
        with pytest.raises((dcp.IncompleteCheckpointError, dcp.CheckpointNotFoundError)):
            dcp.read_metadata(shared / "B")
    want = _full(1, world)
    target = {"w": np.zeros_like(want["w"]), "step": None, **{k: np.zeros(256) for k in want if k != "w"}}
    dcp.load(target, checkpoint_id=shared / "A", no_dist=True)
    assert target["step"] == 1
    for key, value in want.items():
        assert target[key].tobytes() == value.tobytes(), key


def test_collective_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyper_parallel.core.distributed_checkpoint._collectives import (  # pylint: disable=import-outside-toplevel
        COLLECTIVE_TIMEOUT_ENV,
        DEFAULT_COLLECTIVE_TIMEOUT,
        DistWrapper,
        collective_timeout,
    )

    monkeypatch.delenv(COLLECTIVE_TIMEOUT_ENV, raising=False)
    assert collective_timeout() == DEFAULT_COLLECTIVE_TIMEOUT == 1800.0
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, " 2.5 ")
    assert collective_timeout() == 2.5 and DistWrapper(use_dist=False).timeout == 2.5
    assert DistWrapper(use_dist=False, timeout=7).timeout == 7
    assert DistWrapper(use_dist=False, timeout=0).timeout is None
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "0")
    assert collective_timeout() is None
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "ten")
    with pytest.raises(dcp.CheckpointValueError, match="HP_CKPT_COLLECTIVE_TIMEOUT='ten'"):
        collective_timeout()
