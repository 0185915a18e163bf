"""``scripts/train_example.py``: killed under msrun on 2 workers, resumed on 1 process, same losses.

Three runs of the real script share one checkpoint root per scenario:

* A: the reference, 8 uninterrupted steps in one process (no msrun).
* B: 2 msrun workers, save every 2 steps, every rank SIGKILLs itself right
  after step 6 (its async save of step 6 started, never committed). The
  launch is then killed: msrun would otherwise wait ~30 s for its scheduler to
  notice the dead workers.
* C: one process resumes the same root from the newest committed step (4)
  and runs steps 5..8.

The losses must be bit-identical to A's: B's steps 1..6 on 2 ranks and C's
steps 5..8 on 1 rank after a reshard on load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import psutil
import pytest

from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager
from msrun_harness import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "train_example.py"
STEPS, SAVE_EVERY, CRASH_AT = 8, 2, 6
TIMEOUT = 120.0  # seconds, per run


def _env() -> dict[str, str]:
    """Environment for the runs: this interpreter and this checkout."""
    env = {k: v for k, v in os.environ.items() if k != "MS_ROLE"}  # the script inits comm only under msrun
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    # msrun starts every rank as a bare `python script`: make that this interpreter.
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    return env


def _losses(log: Path, skip: int = 0) -> dict[int, float]:
    """Read the script's JSON-lines log, without its first ``skip`` lines: step -> loss.

    A last line still being written (no newline yet) is ignored.
    """
    if not log.exists():
        return {}
    lines = log.read_text(encoding="utf-8").split("\n")[:-1][skip:]
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def _run_single(ckpt: Path, log: Path) -> str:
    """Run the script in one plain process (world size 1); return its stdout."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--ckpt", str(ckpt), "--steps", str(STEPS),
         "--save-every", str(SAVE_EVERY), "--log", str(log)],
        env=_env(), capture_output=True, text=True, timeout=TIMEOUT, check=False,
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL msrun and everything it started (workers run in sessions of their own)."""
    victims: list[psutil.Process] = []
    with suppress(psutil.Error):
        victims = psutil.Process(proc.pid).children(recursive=True)
    with suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    for victim in victims:
        with suppress(psutil.Error):
            victim.kill()
    psutil.wait_procs(victims, timeout=15)
    proc.wait(timeout=15)


def _run_msrun_until_crash(tmp_path: Path, ckpt: Path, log: Path, workers: int) -> None:
    """Launch the script on ``workers`` msrun ranks with ``--crash-at``; kill the launch once it crashed."""
    log_dir = tmp_path / "msrun_logs"
    cmd = [
        sys.executable, "-m", "mindspore.parallel.cluster.run",  # the `msrun` entry point
        f"--worker_num={workers}", f"--local_worker_num={workers}", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", f"--log_dir={log_dir}", "--join=True", f"--tail_worker_log={workers}",
        str(SCRIPT), "--ckpt", str(ckpt), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
        "--log", str(log), "--crash-at", str(CRASH_AT),
    ]
    with open(tmp_path / "msrun_console.log", "wb") as console:
        proc = subprocess.Popen(  # pylint: disable=consider-using-with
            cmd, cwd=tmp_path, env=_env(), stdout=console, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + TIMEOUT
        try:
            # Step CRASH_AT logged means step CRASH_AT - 2 is committed, and nothing later can
            # commit: a save commits at the next step's wait(), which --crash-at never reaches.
            while CRASH_AT not in _losses(log) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            _kill_tree(proc)
    if CRASH_AT not in _losses(log):
        tails = [f"----- {p.name} -----\n" + "\n".join(p.read_text(errors="replace").splitlines()[-40:])
                 for p in sorted(log_dir.glob("*.log")) + [tmp_path / "msrun_console.log"] if p.exists()]
        pytest.fail(f"the msrun launch never logged step {CRASH_AT}\n" + "\n".join(tails))


@pytest.mark.msrun
def test_killed_on_two_workers_resumes_on_one_process_with_same_losses(tmp_path: Path) -> None:
    """A: reference; B: 2 msrun workers killed after step 6; C: 1 process resumes from step 4."""
    reference = tmp_path / "reference.jsonl"
    _run_single(tmp_path / "ckpt_reference", reference)
    expected = _losses(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))

    ckpt, log = tmp_path / "ckpt", tmp_path / "resumed.jsonl"
    _run_msrun_until_crash(tmp_path, ckpt, log, workers=2)
    crashed = _losses(log)
    assert crashed == {s: expected[s] for s in range(1, CRASH_AT + 1)}  # 2 ranks compute what 1 does
    assert CheckpointManager(ckpt).all_steps() == [2, 4]  # step 6 was still in flight: never committed

    stdout = _run_single(ckpt, log)
    assert f"resumed from step {CRASH_AT - SAVE_EVERY} on 1 rank(s)" in stdout
    resumed = _losses(log, skip=CRASH_AT)
    assert resumed == {s: expected[s] for s in range(CRASH_AT - SAVE_EVERY + 1, STEPS + 1)}  # bit for bit
    assert CheckpointManager(ckpt).all_steps() == [4, 6, 8]  # max_to_keep=3
