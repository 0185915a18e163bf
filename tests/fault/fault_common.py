"""Helpers shared by the fault-injection suite (``tests/fault``) and its child scripts.

Nothing here imports MindSpore: the crash children save numpy-only state, so
they start fast and a SIGKILL hits the checkpoint code, not a framework.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

import hyper_parallel.core.distributed_checkpoint as dcp

__all__ = [
    "FAULT_DIR",
    "SCRIPTS_DIR",
    "REPO_ROOT",
    "make_state",
    "blank_like",
    "assert_same_state",
    "same_state",
    "load_into_blank",
    "files_of",
    "assert_only_committed_files",
    "snapshot_tree",
    "mounted_tmpfs",
    "start_script",
    "run_script",
]

FAULT_DIR = Path(__file__).resolve().parent
SCRIPTS_DIR = FAULT_DIR / "scripts"
REPO_ROOT = FAULT_DIR.parents[1]


def make_state(seed: int) -> dict[str, Any]:
    """A nested numpy-only training state whose every value depends on ``seed``.

    One tensor is 1 MiB, so a kill "in the middle of a write" really lands
    inside one ``os.write`` of a big buffer. The stored sizes do not depend on
    ``seed`` (for seeds below 10), so byte positions carry over between saves.
    """
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "big": rng.standard_normal((256, 1024), dtype=np.float32),
            "w": rng.standard_normal((64, 32), dtype=np.float32),
            "b": rng.standard_normal(32),
        },
        "emb": rng.integers(-(2**62), 2**62, size=(100, 8), dtype=np.int64),
        "optim": {
            "step": seed,
            "lr": 0.1 * seed + 0.5,
            "name": f"run-{seed}",
            "beta": np.float32(0.5 + seed),
            "betas": [0.9 * seed, 0.999],
        },
        "blob": bytes((seed + i) % 256 for i in range(200)),
        "flag": bool(seed % 2),
    }


def blank_like(state: Any) -> Any:
    """Load targets for ``state``: zeroed arrays of the same dtype, ``None`` for values."""
    if isinstance(state, dict):
        return {k: blank_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [blank_like(v) for v in state]
    if isinstance(state, np.ndarray):
        return np.zeros_like(state)
    return None


def _differences(got: Any, want: Any, path: str) -> list[str]:
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else type(got)} != {sorted(want)}"]
        return [d for k in want for d in _differences(got[k], want[k], f"{path}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: {got!r:.60} is not a list of {len(want)}"]
        return [d for i, w in enumerate(want) for d in _differences(got[i], w, f"{path}.{i}")]
    if isinstance(want, (np.ndarray, np.generic)):
        ok = (
            type(got) is type(want)
            and got.dtype == want.dtype
            and np.shape(got) == np.shape(want)
            and np.asarray(got).tobytes() == np.asarray(want).tobytes()
        )
        return [] if ok else [f"{path}: array differs ({type(got).__name__} {getattr(got, 'dtype', '')})"]
    if type(got) is not type(want) or got != want:
        return [f"{path}: {got!r:.60} != {want!r:.60}"]
    return []


def same_state(got: Any, want: Any) -> bool:
    """True when ``got`` equals ``want`` bit for bit, with the same types."""
    return not _differences(got, want, "state")


def assert_same_state(got: Any, want: Any) -> None:
    """Assert ``got`` equals ``want`` bit for bit (arrays by bytes, values by type and value)."""
    problems = _differences(got, want, "state")
    assert not problems, "loaded state differs:\n  " + "\n  ".join(problems[:10])


def load_into_blank(path: str | os.PathLike, like: Any, **kwargs: Any) -> Any:
    """Load checkpoint ``path`` into fresh targets shaped like ``like``; return them."""
    target = blank_like(like)
    dcp.load(target, checkpoint_id=path, no_dist=True, **kwargs)
    return target


def files_of(path: Path) -> list[str]:
    """Sorted names of the entries of directory ``path``."""
    return sorted(os.listdir(path))


def assert_only_committed_files(path: Path) -> None:
    """``path`` holds its metadata and the data files of the committed save, nothing else."""
    save_id = dcp.read_metadata(path).storage_meta.save_id
    extra = [n for n in files_of(path) if n != "metadata.json" and f".{save_id}." not in n]
    assert not extra, f"{path} keeps files of other saves: {extra}"


def snapshot_tree(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``root`` (symlinks not followed) with its size and content hash."""
    snap: dict[str, tuple[int, str]] = {}
    for directory, dirs, names in os.walk(root):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
            full = os.path.join(directory, name)
            if os.path.islink(full):
                snap[os.path.relpath(full, root)] = (-1, os.readlink(full))
            elif os.path.isfile(full):
                with open(full, "rb") as handle:
                    snap[os.path.relpath(full, root)] = (os.path.getsize(full), hashlib.sha1(handle.read()).hexdigest())
    return snap


def _script_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULT_DIR), str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")  # the crash driver forks: no BLAS thread pool
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_script(name: str, *args: str) -> subprocess.Popen[str]:
    """Start ``tests/fault/scripts/<name>`` in a fresh Python (stdout and stderr piped)."""
    return subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, str(SCRIPTS_DIR / name), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_script_env(),
    )


def run_script(name: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run ``tests/fault/scripts/<name>`` in a fresh Python; return the finished process."""
    return subprocess.run(
        [sys.executable, str(SCRIPTS_DIR / name), *args],
        capture_output=True, text=True, timeout=timeout, env=_script_env(), check=False,
    )


@contextlib.contextmanager
def mounted_tmpfs(path: Path, options: str) -> Iterator[Path]:
    """Mount a tmpfs at ``path`` (``mount -t tmpfs -o OPTIONS``) for the block; unmount after.

    Raises:
        OSError: the mount is not permitted here (the caller skips).
    """
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"cannot mount a tmpfs at {path}: {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
