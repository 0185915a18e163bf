"""msrun worker: a collective save runs out of disk space; every rank gets the same clear error.

Usage: ``disk_full_worker.py DISK_DIR`` where ``DISK_DIR`` is a small tmpfs
mounted by the pytest side. Each rank first saves a small checkpoint A
(which fits), then its half of a sharded tensor too large for the disk (B).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from worker_lib import init_worker, run_scenarios

RANK, WORLD = init_worker()

import mindspore as ms  # noqa: E402  (after init_worker, which sets the device)

import hyper_parallel.core.distributed_checkpoint as dcp  # noqa: E402
from hyper_parallel import DTensor, Layout  # noqa: E402

DISK = Path(sys.argv[1])
LAYOUT = Layout((WORLD,), (0, -1))
SMALL = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
BIG = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)  # 1 MiB


def _shard(full: np.ndarray) -> DTensor:
    return DTensor.from_global(ms.Tensor(full), LAYOUT, rank=RANK)


def _zeros(full: np.ndarray) -> DTensor:
    local = ms.Parameter(ms.Tensor(np.zeros(LAYOUT.local_shape(full.shape), full.dtype)), name="w")
    return DTensor(local, LAYOUT, full.shape)


def disk_full() -> dict:
    dcp.save({"w": _shard(SMALL), "step": 1}, checkpoint_id=DISK / "A")
    outcome: dict = {}
    try:
        dcp.save({"w": _shard(BIG), "step": 2}, checkpoint_id=DISK / "B")
    except dcp.CheckpointError as exc:
        outcome = {"classes": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
                   "failed_ranks": list(getattr(exc, "failed_ranks", ()))}
    try:
        dcp.read_metadata(DISK / "B")
        outcome["b_committed"] = True
    except dcp.IncompleteCheckpointError:
        outcome["b_committed"] = False
    target = {"w": _zeros(SMALL), "step": None}
    dcp.load(target, checkpoint_id=DISK / "A")
    local = target["w"].to_local().asnumpy()
    rows = slice(target["w"].global_offset[0], target["w"].global_offset[0] + local.shape[0])
    outcome["a_intact"] = bool(np.array_equal(local, SMALL[rows])) and target["step"] == 1
    return outcome


run_scenarios({"disk_full": disk_full})
