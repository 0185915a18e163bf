"""The process-wide lazy thread pools shared by save staging and exact device reads."""

from __future__ import annotations

import os
import threading

from hyper_parallel.core.distributed_checkpoint._lazy_pool import lazy_executor


def test_a_pool_is_created_once_per_name_and_names_its_threads():
    pool = lazy_executor("test-a", 2)
    assert lazy_executor("test-a", 5) is pool  # later calls return the existing pool
    assert lazy_executor("test-b", 1) is not pool
    names = set(pool.map(lambda _: threading.current_thread().name, range(8)))
    assert names and all(name.startswith("hp-ckpt-test-a") for name in names)


def test_a_forked_child_gets_a_pool_of_its_own():
    parent_pool = lazy_executor("test-fork", 1)
    assert parent_pool.submit(lambda: 7).result() == 7
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool threads do not exist here
        ok = False
        try:
            pool = lazy_executor("test-fork", 1)
            ok = pool is not parent_pool and pool.submit(lambda: 11).result(timeout=30) == 11
        finally:
            os._exit(0 if ok else 3)  # pylint: disable=protected-access
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert lazy_executor("test-fork", 1) is parent_pool
