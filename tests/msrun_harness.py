"""Pytest-side launcher for multi-process MindSpore (msrun) tests.

:func:`run_workers` starts ``msrun`` for one worker script, waits for it, and
returns the object every rank handed to ``worker_lib.report``, indexed by
rank. Any failure (non-zero exit, timeout, missing result, uncaught worker
exception) raises ``AssertionError`` with the reason, the failing ranks'
tracebacks and the tails of all msrun logs. No process of the launch survives
the call.

Coverage: the launched processes inherit this process's environment, so with
``[run] patch = subprocess`` in ``.coveragerc`` coverage.py measures them too.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Mapping, Sequence

import psutil

__all__ = [
    "FAILURE_KEY",
    "RESULT_DIR_ENV",
    "check_scenarios",
    "free_port",
    "run_workers",
    "scenario_values",
]

RESULT_DIR_ENV = "HP_TEST_RESULT_DIR"  # same names as in worker_lib
FAILURE_KEY = "__worker_failure__"

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
LOG_TAIL_LINES = 60
_CRASH_GRACE = 2.0  # seconds

_handed_out_ports: set[int] = set()


def free_port() -> int:
    """Return a free TCP port on 127.0.0.1 not handed out before in this process."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out_ports:
            _handed_out_ports.add(port)
            return port
    raise RuntimeError("no fresh free TCP port found")


def run_workers(
    script: str | Path,
    *,
    workers: int,
    tmp_path: Path,
    timeout: float = 300.0,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``script`` on ``workers`` ranks with msrun and collect their results.

    Args:
        script: Worker script; it reports through ``worker_lib``.
        workers: Number of ranks (all local).
        tmp_path: Per-test directory; receives ``msrun_logs/``, ``results/``,
            ``shared/`` and ``msrun_console.log``; also the processes' cwd.
        timeout: Seconds before the whole launch is killed.
        args: Extra command-line arguments for the script.
        env: Extra environment variables for all processes.

    Returns:
        The object reported by each rank, indexed by rank.

    Raises:
        AssertionError: On non-zero exit, timeout, a missing result or a worker
            that died of an uncaught exception.
    """
    script = Path(script).resolve()
    tmp_path = Path(tmp_path).resolve()
    log_dir, result_dir = tmp_path / "msrun_logs", tmp_path / "results"
    log_dir.mkdir(parents=True, exist_ok=True)
    result_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*result_dir.glob("rank_*.pkl"), *result_dir.glob("rank_*.crashed")]:
        stale.unlink()

    run_env = {**os.environ, **(env or {}), RESULT_DIR_ENV: str(result_dir)}
    run_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(TESTS_DIR), str(REPO_ROOT), run_env.get("PYTHONPATH", "")) if p
    )
    # msrun starts every rank as a bare `python script`: make that this interpreter.
    run_env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), run_env.get("PATH", "")))
    cmd = [
        sys.executable, "-m", "mindspore.parallel.cluster.run",  # the `msrun` entry point
        f"--worker_num={workers}", f"--local_worker_num={workers}",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        f"--log_dir={log_dir}", "--join=True",
        f"--tail_worker_log={workers}",  # out of range: no `tail -f` children
        str(script), *args,
    ]

    with open(tmp_path / "msrun_console.log", "wb") as console:
        proc = subprocess.Popen(  # pylint: disable=consider-using-with
            cmd, cwd=tmp_path, env=run_env, stdout=console, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            reason = _wait(proc, result_dir, timeout)
        finally:
            _kill_launch(proc, script, result_dir)

    results: dict[int, Any] = {}
    for rank in range(workers):
        path = result_dir / f"rank_{rank}.pkl"
        if path.exists():
            results[rank] = pickle.loads(path.read_bytes())
    crashed = {r: v for r, v in results.items() if isinstance(v, dict) and v.get(FAILURE_KEY)}
    missing = [r for r in range(workers) if r not in results]
    if reason is None and (crashed or missing):
        reason = "msrun exited with code 0 but results are missing or failed"
    if reason is not None:
        raise AssertionError(_failure_message(reason, crashed, missing, tmp_path))
    return [results[rank] for rank in range(workers)]


def _wait(proc: subprocess.Popen[bytes], result_dir: Path, timeout: float) -> str | None:
    """Wait for msrun; return why the launch failed, or ``None`` on exit code 0.

    A rank that died of an uncaught exception (``rank_*.crashed``) ends the
    wait after a short grace period: msrun itself would wait ~30 s for the
    scheduler to time the dead rank out.
    """
    start = time.monotonic()
    crash_seen: float | None = None
    while (code := proc.poll()) is None:
        now = time.monotonic()
        if now - start >= timeout:
            return f"timeout: msrun still running after {timeout:.0f} s, all its processes were killed"
        if crash_seen is None and any(result_dir.glob("rank_*.crashed")):
            crash_seen = now
        if crash_seen is not None and now - crash_seen >= _CRASH_GRACE:
            return f"a rank died of an uncaught exception; launch killed after {now - start:.1f} s"
        time.sleep(0.2)
    return None if code == 0 else f"msrun exited with code {code} after {time.monotonic() - start:.1f} s"


def _is_launch_process(proc: psutil.Process, script: Path, result_dir: Path) -> bool:
    """Tell whether ``proc`` runs ``script`` for the launch writing to ``result_dir``."""
    with suppress(psutil.Error):
        if str(script) in " ".join(proc.cmdline()):
            return proc.environ().get(RESULT_DIR_ENV) == str(result_dir)
    return False


def _kill_launch(proc: subprocess.Popen[bytes], script: Path, result_dir: Path) -> None:
    """SIGKILL msrun, its descendants (workers have their own sessions) and stragglers."""
    victims: list[psutil.Process] = []
    with suppress(psutil.Error):
        parent = psutil.Process(proc.pid)
        victims = [parent, *parent.children(recursive=True)]
    victims += [p for p in psutil.process_iter() if _is_launch_process(p, script, result_dir)]
    victims = [p for p in {p.pid: p for p in victims}.values() if p.pid != os.getpid()]
    with suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # msrun's own session/group
    for victim in victims:
        with suppress(OSError):
            group = os.getpgid(victim.pid)
            if group != os.getpgrp():
                os.killpg(group, signal.SIGKILL)
        with suppress(psutil.Error):
            victim.kill()
    psutil.wait_procs(victims, timeout=15)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=15)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """Return the last ``lines`` lines of a text file."""
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(text[-lines:])


def _failure_message(reason: str, crashed: dict[int, Any], missing: list[int], tmp_path: Path) -> str:
    """Build the AssertionError text: reason, worker tracebacks, log tails."""
    parts = [f"msrun launch failed: {reason}"]
    for rank, failure in sorted(crashed.items()):
        parts.append(f"rank {rank} raised {failure['error']}\n{failure['traceback']}")
    if missing:
        parts.append(f"no result from rank(s) {missing}")
    log_dir = tmp_path / "msrun_logs"
    logs = sorted(log_dir.glob("worker_*.log"), key=lambda p: int(p.stem.rpartition("_")[2] or 0))
    for path in [*logs, log_dir / "scheduler.log", tmp_path / "msrun_console.log"]:
        if path.exists():
            parts.append(f"----- {path.name} (last {LOG_TAIL_LINES} lines) -----\n{_tail(path)}")
    return "\n\n".join(parts)


def check_scenarios(results: Sequence[Mapping[str, Mapping[str, Any]]], names: Sequence[str] | None = None) -> None:
    """Assert that scenarios passed on every rank.

    Args:
        results: ``run_workers`` output of a script using ``run_scenarios``.
        names: Scenarios to check; all reported ones when ``None``.

    Raises:
        AssertionError: Listing every failed or missing (rank, scenario) with
            its error and traceback.
    """
    problems = []
    for rank, per_rank in enumerate(results):
        for name in names if names is not None else list(per_rank):
            entry = per_rank.get(name)
            if entry is None:
                problems.append(f"rank {rank}, scenario {name!r}: not run")
            elif not entry["ok"]:
                problems.append(f"rank {rank}, scenario {name!r}: {entry['error']}\n{entry['traceback']}")
    if problems:
        raise AssertionError(f"{len(problems)} scenario failure(s):\n\n" + "\n\n".join(problems))


def scenario_values(results: Sequence[Mapping[str, Mapping[str, Any]]], name: str) -> list[Any]:
    """Return each rank's value for scenario ``name`` (asserting it passed everywhere)."""
    check_scenarios(results, [name])
    return [per_rank[name]["value"] for per_rank in results]
