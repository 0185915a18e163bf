"""Crash driver: for each case, save a checkpoint, then SIGKILL the process inside the next save.

Usage: ``crash_child.py CASES_JSON RESULTS_JSON [--no-fork]``

Each case is ``{"name", "dir", "scenario", "hook": {"target", "nth", "when"}}``.
The driver forks one child per case (so the imports are paid once); the child
saves checkpoint A completely, arms the fault hook, starts the scenario's
next save, and the hook kills the child with SIGKILL at the chosen point: the
``nth`` call of ``target``, ``before`` it runs, ``after`` it returns, or in
the ``mid``dle (half of the bytes written), counting only calls made
``within`` a given writer function if asked; or once the data files of the
save hold ``at_byte`` bytes (positions taken from A's data files: the states
have the same layout). With ``--no-fork`` the single case runs in this
process (used for the MindSpore case: MindSpore does not survive a fork).
RESULTS_JSON maps each case name to how its process ended.

No library code is changed: hooks wrap functions the writer looks up at call
time (module globals of ``filesystem_writer`` and ``_data_file``, the methods of the file
operations class the writer changes the disk through, planner and writer
methods).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Any, Callable

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _data_file as df
from hyper_parallel.core.distributed_checkpoint import filesystem_writer as fw
from hyper_parallel.core.distributed_checkpoint import _step_dirs as step_dirs_module
from hyper_parallel.core.distributed_checkpoint._file_ops import FileOps
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner

from fault_common import make_state


_ORIGINAL_WRITE = FileOps.write


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


def _mid(original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Write half of the bytes of this call, then die."""
    if original is _ORIGINAL_WRITE:
        ops, fd, data = args
        original(ops, fd, memoryview(data)[: len(data) // 2])
        die()
    raise ValueError(f"no 'mid' hook for {original}")


def _wrap(original: Callable[..., Any], nth: int, when: str, active: Callable[[], bool]) -> Callable[..., Any]:
    """``original``, except that its ``nth`` call while ``active()`` dies ``when`` asked."""
    calls = {"count": 0}
    lock = threading.Lock()

    def hooked(*args: Any, **kwargs: Any) -> Any:
        with lock:
            if active():
                calls["count"] += 1
            fire = active() and calls["count"] == nth
        if not fire:
            return original(*args, **kwargs)
        if when == "before":
            die()
        if when == "mid":
            return _mid(original, args, kwargs)
        result = original(*args, **kwargs)
        die()
        return result  # pragma: no cover

    return hooked


def _write_until(limit: int) -> Callable[..., Any]:
    """``os.write`` that dies once ``limit`` bytes of data files are written (cut inside a buffer)."""
    written = {"count": 0}
    lock = threading.Lock()

    def hooked(ops: FileOps, fd: int, data: Any) -> int:
        with lock:  # several writer threads: one running total
            room = limit - written["count"]
            if len(data) < room:
                written["count"] += len(data)
        if len(data) < room:
            return _ORIGINAL_WRITE(ops, fd, data)
        if room > 0:
            _ORIGINAL_WRITE(ops, fd, memoryview(data)[:room])
        die()
        return 0  # pragma: no cover

    return hooked


def _byte_position(spec: str, reference: pathlib.Path) -> int:
    """Resolve ``"8"``, ``"header/2"``, ``"header+1"``, ``"0.5"``, ``"-1"``, ``"size"``.

    Against the data files of checkpoint ``reference``: ``size`` is their total,
    ``header`` the header length of the first.
    """
    files = sorted(reference.glob("*.safetensors"))
    raw = files[0].read_bytes()
    header, size = 8 + int.from_bytes(raw[:8], "little"), sum(f.stat().st_size for f in files)
    named = {"header/2": header // 2, "header": header, "header+1": header + 1, "size": size}
    if spec in named:
        return named[spec]
    number = float(spec)
    if number < 0:
        return size + int(number)
    return int(number) if number >= 1 else int(size * number)


def _inside(function: str | None) -> Callable[[], bool]:
    """A flag that is up while the writer module's ``function`` runs (always up for ``None``)."""
    if function is None:
        return lambda: True
    name = function[len("fs."):]
    original = getattr(fw, name)
    depth = {"now": 0}

    def tracked(*args: Any, **kwargs: Any) -> Any:
        depth["now"] += 1
        try:
            return original(*args, **kwargs)
        finally:
            depth["now"] -= 1

    setattr(fw, name, tracked)
    return lambda: depth["now"] > 0


def arm(hook: dict[str, Any], reference: pathlib.Path) -> None:
    """Install the fault hook ``{"target", "nth", "when", "within"}`` or ``{"target": "fs.os.write", "at_byte"}``.

    ``at_byte`` positions refer to ``reference``, a checkpoint of the same layout saved before;
    ``within`` counts only the calls made while that writer-module function runs.
    """
    target, nth, when = hook["target"], int(hook.get("nth", 1)), hook.get("when", "before")
    # Gathered writes count as one write of their bytes, so byte positions and write counts hold.
    FileOps.writev = lambda ops, fd, buffers: FileOps.write(ops, fd, b"".join(buffers))
    active = _inside(hook.get("within"))
    if "at_byte" in hook:
        FileOps.write = _write_until(_byte_position(hook["at_byte"], reference))
    elif target.startswith("fs.os."):  # the file operations the writer changes the disk with
        name = target[len("fs.os."):]
        setattr(FileOps, name, _wrap(getattr(FileOps, name), nth, when, active))
    elif target.startswith("fs."):
        name = target[len("fs."):]
        setattr(fw, name, _wrap(getattr(fw, name), nth, when, active))
    elif target.startswith("df."):  # the data file's layout (header, checksums)
        name = target[len("df."):]
        setattr(df, name, _wrap(getattr(df, name), nth, when, active))
    elif target.startswith(("FileSystemWriter.", "StandardSavePlanner.")):
        owner, name = target.split(".")
        cls = fw.FileSystemWriter if owner == "FileSystemWriter" else StandardSavePlanner
        setattr(cls, name, _wrap(getattr(cls, name), nth, when, active))
    elif target == "step_dirs.os.rename":  # the manager's retention renames a step away before deleting it
        step_dirs_module.os = _Proxy(os, {"rename": _wrap(os.rename, nth, when, active)})
    elif target == "os.unlink":  # shutil.rmtree looks it up at call time
        os.unlink = _wrap(os.unlink, nth, when, active)
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
        arm(hook, mgr.directory(2))
        mgr.save(3, make_state(3))
    elif scenario == "resave_same_writer":
        writer = dcp.FileSystemWriter(a_dir)
        dcp.save(make_state(1), storage_writer=writer, no_dist=True)
        arm(hook, a_dir)
        dcp.save(make_state(2), storage_writer=writer, no_dist=True)
    elif scenario == "async_fork":  # the hook kills the forked writer process; this one must see it
        dcp.save(make_state(1), checkpoint_id=a_dir, no_dist=True)
        arm(hook, a_dir)
        handle = dcp.async_save(make_state(2), checkpoint_id=b_dir, no_dist=True, staging="fork")
        try:
            handle.result(timeout=60)
        except dcp.CheckpointError as exc:
            (root / "error.json").write_text(json.dumps({"type": type(exc).__name__, "message": str(exc)}))
        die()
    elif scenario.startswith("async"):
        dcp.save(make_state(1), checkpoint_id=a_dir, no_dist=True)
        target = a_dir if scenario == "async_resave" else b_dir
        arm(hook, a_dir)
        # staging="copy": the hooks act in this process (the default's first call would fork a writer, the
        # "async_fork" scenario's case).
        handle = dcp.async_save(make_state(2), checkpoint_id=target, no_dist=True, staging="copy")
        if hook["target"] == "async.done":
            while not handle.done():
                time.sleep(0.005)
            die()
        handle.result(timeout=60)
    else:
        dcp.save(states(1), checkpoint_id=a_dir, no_dist=True)
        target = a_dir if scenario.endswith("resave") else b_dir
        writer = None
        if scenario == "threads":
            writer = dcp.FileSystemWriter(target, thread_count=4)
        elif scenario.startswith("auto_threads"):  # the automatic 2-file, 2-thread choice, at 1 MiB
            writer = dcp.FileSystemWriter(target, auto_thread_bytes=1 << 20)
        arm(hook, a_dir)
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
