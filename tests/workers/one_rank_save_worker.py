"""msrun worker for ``tests/test_one_rank_save.py``: ``save_checkpoint`` called on rank 0 only (a MindSpore habit).

Usage: ``one_rank_save_worker.py BASE_DIR``. Rank 1 never calls the save:
it waits (no collective) until rank 0 is done. Rank 0 reports what its
save raised (class names and message), the seconds it took, whether a
``metadata.json`` exists, and what a second save raised (at once: the
communication is marked unusable). Then the fix: a save with
``no_dist=True`` on rank 0 alone, loaded back. Both report the notices
logged while a step waited (``HP_CKPT_WAIT_NOTICE``); ``slow_rank`` first:
rank 1 calls the save seconds after rank 0, and both commit.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import numpy as np

from worker_lib import init_worker, run_scenarios

RANK, WORLD = init_worker()

import mindspore as ms  # noqa: E402  (after init_worker, which sets the device)
from mindspore import nn  # noqa: E402

import hyper_parallel  # noqa: E402

BASE = Path(sys.argv[1])
NOTICES: list[str] = []


class _Notices(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        NOTICES.append(record.getMessage())


logging.getLogger("hyper_parallel.core.distributed_checkpoint._collectives").addHandler(_Notices(logging.WARNING))


def _attempt(path: Path) -> dict:
    net = nn.Dense(4, 2)
    start = time.monotonic()
    try:
        hyper_parallel.save_checkpoint(net, str(path))
        error, classes = None, []
    except BaseException as exc:  # pylint: disable=broad-exception-caught
        error, classes = f"{type(exc).__name__}: {exc}", [c.__name__ for c in type(exc).__mro__]
    return {"error": error, "classes": classes, "seconds": time.monotonic() - start,
            "committed": (path / "metadata.json").exists()}


def slow_rank() -> dict:
    """Rank 1 calls the save 4 s after rank 0: the notice is logged on rank 0 and the save still commits."""
    ms.set_seed(1)  # the same network on both ranks (a replica everywhere)
    if RANK == 1:
        time.sleep(4)
    outcome = _attempt(BASE / "slow")
    notices = list(NOTICES)
    NOTICES.clear()
    return {**outcome, "notices": notices}


def only_rank_0() -> dict | None:
    gate = BASE / "rank0_done"
    if RANK != 0:
        deadline = time.monotonic() + 240
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    ms.set_seed(1)
    first = _attempt(BASE / "c")
    first["notices"] = list(NOTICES)
    second = _attempt(BASE / "c2")
    net = nn.Dense(4, 2)
    hyper_parallel.save_checkpoint(net, str(BASE / "alone"), no_dist=True)
    loaded = hyper_parallel.load_checkpoint(str(BASE / "alone"), no_dist=True)
    gate.write_text("done")
    return {"first": first, "second": second,
            "fixed": np.array_equal(loaded["weight"].asnumpy(), net.weight.asnumpy())}


run_scenarios({"slow_rank": slow_rank, "only_rank_0": only_rank_0})
