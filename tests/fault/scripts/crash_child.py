"""Crash driver: for each case, save a checkpoint, then SIGKILL the process inside the next save.

Usage: ``crash_child.py CASES_JSON RESULTS_JSON [--no-fork]``

Each case is ``{"name", "dir", "scenario", "hook": {"target", "nth", "when"}}``.
The driver forks one child per case (so the imports are paid once); the child
saves checkpoint A completely, arms the fault hook, starts the scenario's
next save, and the hook kills the child with SIGKILL at the chosen point: the
``nth`` call of ``target``, ``before`` it runs, ``after`` it returns, or in
the ``mid``dle (half of the bytes written). With ``--no-fork`` the single case
runs in this process (used for the MindSpore case: MindSpore does not survive
a fork). RESULTS_JSON maps each case name to how its process ended.

No library code is changed: hooks wrap functions the writer looks up at call
time (module globals of ``filesystem_writer``, planner and writer methods).
"""

from __future__ import annotations

import builtins
import json
import os
import pathlib
import signal
import sys
import time
from typing import Any, Callable

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import filesystem_writer as fw
from hyper_parallel.core.distributed_checkpoint import manager as manager_module
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner

from fault_common import make_state


def die() -> None:
    """SIGKILL this process: no cleanup, no flush, no atexit."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # pragma: no cover - never reached


class _Proxy:
    """Stands for a module; chosen attributes are replaced."""

    def __init__(self, module: Any, overrides: dict[str, Callable[..., Any]]) -> None:
        self._module = module
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides.get(name) or getattr(self._module, name)


class _HalfWriter:
    """A file whose first ``write`` writes half of the bytes, flushes, then dies."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def __enter__(self) -> "_HalfWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.close()

    def write(self, data: bytes) -> int:
        self._handle.write(data[: len(data) // 2])
        self._handle.flush()
        die()
        return 0  # pragma: no cover

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _mid(original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``original`` on half of its byte argument, then die."""
    if original is os.write:
        fd, data = args
        os.write(fd, memoryview(data)[: len(data) // 2])
    elif original is builtins.open:
        return _HalfWriter(original(*args, **kwargs))
    else:
        raise ValueError(f"no 'mid' hook for {original}")
    die()
    return None  # pragma: no cover


def _wrap(original: Callable[..., Any], nth: int, when: str, method: bool = False) -> Callable[..., Any]:
    calls = {"count": 0}

    def hooked(*args: Any, **kwargs: Any) -> Any:
        calls["count"] += 1
        if calls["count"] != nth:
            return original(*args, **kwargs)
        if when == "before":
            die()
        if when == "mid":
            return _mid(original, args, kwargs)
        result = original(*args, **kwargs)
        die()
        return result  # pragma: no cover

    return hooked


def arm(hook: dict[str, Any]) -> None:
    """Install the fault hook ``{"target", "nth", "when"}``."""
    target, nth, when = hook["target"], int(hook.get("nth", 1)), hook.get("when", "before")
    if target.startswith("fs.os."):  # os functions as the writer module sees them
        name = target[len("fs.os."):]
        fw.os = _Proxy(os, {name: _wrap(getattr(os, name), nth, when)})
    elif target == "fs.open":  # the metadata's temporary file (write_atomically)
        fw.open = _wrap(builtins.open, nth, when)
    elif target.startswith("fs."):
        name = target[len("fs."):]
        setattr(fw, name, _wrap(getattr(fw, name), nth, when))
    elif target.startswith(("FileSystemWriter.", "StandardSavePlanner.")):
        owner, name = target.split(".")
        cls = fw.FileSystemWriter if owner == "FileSystemWriter" else StandardSavePlanner
        setattr(cls, name, _wrap(getattr(cls, name), nth, when))
    elif target == "Path.unlink":
        pathlib.Path.unlink = _wrap(pathlib.Path.unlink, nth, when)
    elif target == "manager.os.rename":
        manager_module.os = _Proxy(os, {"rename": _wrap(os.rename, nth, when)})
    elif target == "os.unlink":  # shutil.rmtree looks it up at call time
        os.unlink = _wrap(os.unlink, nth, when)
    elif target not in ("save.return", "async.done"):
        raise ValueError(f"unknown hook target {target!r}")


def _mindspore_state(seed: int) -> dict[str, Any]:
    import mindspore  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    mindspore.set_device("CPU")
    state = make_state(seed)
    rng = np.random.default_rng(seed + 100)
    state["ms"] = {
        "bf16": mindspore.Parameter(mindspore.Tensor(rng.standard_normal((48, 40)), mindspore.bfloat16), name="bf16"),
        "f32": mindspore.Tensor(rng.standard_normal((33, 7)).astype(np.float32)),
    }
    return state


def run_case(case: dict[str, Any]) -> None:
    """Save A, arm the hook, run the interrupted save. Returns only if the hook never fired."""
    root = pathlib.Path(case["dir"])
    scenario = case["scenario"]
    hook = case["hook"]
    states = _mindspore_state if scenario.startswith("mindspore") else make_state
    a_dir, b_dir = root / "A", root / "B"
    if scenario == "manager":
        mgr = dcp.CheckpointManager(root / "steps", max_to_keep=2)
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
        arm(hook)
        mgr.save(3, make_state(3))
    elif scenario == "resave_same_writer":
        writer = dcp.FileSystemWriter(a_dir)
        dcp.save(make_state(1), storage_writer=writer, no_dist=True)
        arm(hook)
        dcp.save(make_state(2), storage_writer=writer, no_dist=True)
    elif scenario.startswith("async"):
        dcp.save(make_state(1), checkpoint_id=a_dir, no_dist=True)
        target = a_dir if scenario == "async_resave" else b_dir
        arm(hook)
        handle = dcp.async_save(make_state(2), checkpoint_id=target, no_dist=True)
        if hook["target"] == "async.done":
            while not handle.done():
                time.sleep(0.005)
            die()
        handle.result(timeout=60)
    else:
        dcp.save(states(1), checkpoint_id=a_dir, no_dist=True)
        target = a_dir if scenario == "resave" else b_dir
        writer = dcp.FileSystemWriter(target, thread_count=2) if scenario == "threads" else None
        arm(hook)
        if writer is not None:
            dcp.save(states(2), storage_writer=writer, no_dist=True)
        else:
            dcp.save(states(2), checkpoint_id=target, no_dist=True)
    if hook["target"] == "save.return":
        die()


def main(argv: list[str]) -> int:
    cases = json.loads(pathlib.Path(argv[1]).read_text())
    results: dict[str, dict[str, Any]] = {}
    if "--no-fork" in argv:
        (case,) = cases
        run_case(case)
        results[case["name"]] = {"signal": None, "exit": 0, "note": "hook never fired"}
    else:
        for case in cases:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    run_case(case)
                except BaseException as exc:  # pylint: disable=broad-except
                    sys.stderr.write(f"case {case['name']}: {type(exc).__name__}: {exc}\n")
                    code = 3
                sys.stderr.flush()
                os._exit(code)  # pylint: disable=protected-access
            _, status = os.waitpid(pid, 0)
            results[case["name"]] = {
                "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            }
    pathlib.Path(argv[2]).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
