"""Thread pools created on first use and shared by every call of the process.

Save staging copies (:mod:`._stage_copies`) and exact device reads
(:mod:`._device_reads`) each hand work to a small pool of threads that lives
as long as the process. :func:`lazy_executor` creates such a pool the first
time it is asked for and returns the same pool afterwards, so that importing
a module starts no thread. A process forked from one holding a pool (fork
staging) gets a pool of its own: the parent's threads do not exist in it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["lazy_executor"]

_POOLS: dict[str, tuple[int, ThreadPoolExecutor]] = {}  # name -> (pid that created it, pool)
_LOCK = threading.Lock()


def lazy_executor(name: str, workers: int) -> ThreadPoolExecutor:
    """The process-wide pool ``name`` of ``workers`` threads, created on first use. Any thread, any rank.

    Args:
        name: Names the pool and prefixes its threads' names (``hp-ckpt-<name>``).
        workers: Threads of the pool when it is created (later calls return the existing pool).

    Returns:
        The pool; never shut down (its threads are idle between uses and end with the process).
    """
    pid = os.getpid()
    with _LOCK:
        entry = _POOLS.get(name)
        if entry is None or entry[0] != pid:
            entry = _POOLS[name] = (pid, ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"hp-ckpt-{name}"))
        return entry[1]
