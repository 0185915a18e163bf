"""msrun worker for tests/test_collective_audit.py: CheckpointCallback when one rank's save fails.

Usage: ``callback_fail_worker.py BASE_DIR``. A data-parallel network (the same
data on every rank, so replicas stay equal) trains 8 steps with
``CheckpointCallback`` saving every 2 steps (sync and async); rank 1's disk is
'full' for the writing of step 4 only. Every rank must stop with a
``CheckpointError`` naming rank 1, steps 2 (and none after it) stay committed
and load, and a resumed run saves the later steps.
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import numpy as np

from worker_lib import init_worker, run_scenarios

RANK, WORLD = init_worker()

import mindspore as ms  # noqa: E402  (after init_worker, which sets the device)
from mindspore import dataset as ds  # noqa: E402
from mindspore import nn  # noqa: E402
from mindspore.train import Model  # noqa: E402

import hyper_parallel  # noqa: E402
import hyper_parallel.core.distributed_checkpoint as dcp  # noqa: E402

BASE = Path(sys.argv[1])
RNG = np.random.default_rng(5)
X = RNG.standard_normal((16, 4)).astype(np.float32)
Y = RNG.standard_normal((16, 2)).astype(np.float32)
FAIL = {"armed": False}
_WRITE = dcp.FileSystemWriter.write_data


def _write_data(self, plan, planner):
    if FAIL["armed"] and RANK == 1 and "step_00000004" in str(self.path):
        FAIL["armed"] = False
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    return _WRITE(self, plan, planner)


dcp.FileSystemWriter.write_data = _write_data  # the disk of rank 1 fails once


def _train(root: Path, *, use_async: bool, epochs: int, resume: bool) -> dict:
    ms.set_seed(1)
    net = nn.Dense(4, 2)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    data = ds.NumpySlicesDataset({"x": X, "y": Y}, shuffle=False).batch(4)  # 4 steps per epoch
    callback = hyper_parallel.CheckpointCallback(str(root), save_checkpoint_steps=2, keep_checkpoint_max=5,
                                                 async_save=use_async, resume=resume)
    info: dict = {"error": None, "failed_ranks": []}
    try:
        Model(net, loss_fn=nn.MSELoss(), optimizer=opt).train(
            epochs, data, callbacks=[callback], dataset_sink_mode=False,
            initial_epoch=callback.resume_dataset(data) if resume else 0)
        callback.manager.wait()
    except dcp.CheckpointError as exc:
        info = {"error": f"{type(exc).__name__}: {exc}", "failed_ranks": list(getattr(exc, "failed_ranks", ()))}
    except Exception as exc:  # pylint: disable=broad-exception-caught
        info = {"error": f"not a CheckpointError: {type(exc).__name__}: {exc}", "failed_ranks": []}
    info["steps"] = callback.manager.all_steps()
    info["resumed_step"] = getattr(callback, "resumed_step", None)
    return info


def _run(use_async: bool) -> dict:
    root = BASE / f"callback_{use_async}"
    FAIL["armed"] = True
    first = _train(root, use_async=use_async, epochs=2, resume=False)
    loaded = hyper_parallel.load_checkpoint(str(root / "step_00000002"))
    first["step2_keys"] = sorted(k for k in loaded if hasattr(loaded[k], "asnumpy"))
    second = _train(root, use_async=use_async, epochs=2, resume=True)
    return {"first": first, "second": second}


def callback_sync() -> dict:
    return _run(False)


def callback_async() -> dict:
    return _run(True)


run_scenarios({"callback_sync": callback_sync, "callback_async": callback_async})
