"""msrun worker for ``tests/test_breakpoint_alone.py``: ``exception_save`` when all ranks raise, and when one does.

Usage: ``breakpoint_alone_worker.py BASE_DIR``. A Dense network trains 8
steps (4 per epoch) under ``CheckpointCallback(exception_save=True)`` saving
every 2 steps. Scenarios, in this order (the last one leaves communication
unusable on purpose):

- ``together``: every rank raises at the start of step 8: the breakpoint step 7
  is saved by all ranks and loads; the caller sees the original error.
- ``alone``: only rank 1 raises at the start of step 8 while rank 0 is busy
  (it waits, without any collective, until rank 1's ``Model.train`` has
  returned, then raises too, as a job torn down would). Each rank reports the
  error ``Model.train`` raised, the seconds from its raise to that, and the
  committed breakpoint steps (listed from the files, no collective).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from worker_lib import init_worker, run_scenarios

RANK, WORLD = init_worker()

import mindspore as ms  # noqa: E402  (after init_worker, which sets the device)
from mindspore import dataset as ds  # noqa: E402
from mindspore import nn  # noqa: E402
from mindspore.train import Callback, Model  # noqa: E402

import hyper_parallel  # noqa: E402

BASE = Path(sys.argv[1])
RNG = np.random.default_rng(5)
X = RNG.standard_normal((16, 4)).astype(np.float32)
Y = RNG.standard_normal((16, 2)).astype(np.float32)


class _Raise(Callback):
    """Raises at the start of step ``at`` on the ranks in ``ranks``; rank 0 of ``alone`` first waits for ``gate``."""

    def __init__(self, at: int, ranks: tuple[int, ...], gate: Path | None) -> None:
        self.at, self.ranks, self.gate, self.raised_at = at, ranks, gate, None

    def on_train_step_begin(self, run_context) -> None:
        if run_context.original_args().cur_step_num != self.at or RANK not in self.ranks:
            return
        if self.gate is not None and RANK != 1:
            deadline = time.monotonic() + 240
            while not self.gate.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        self.raised_at = time.monotonic()
        raise RuntimeError(f"rank {RANK}: the data loader failed at step {self.at} (injected)")


def _committed(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("breakpoint_*") if (p / "metadata.json").exists())


def _train(name: str, at: int, ranks: tuple[int, ...], gate: Path | None) -> dict:
    root = BASE / name
    ms.set_seed(1)  # the same weights on every rank: replicas agree
    net = nn.Dense(4, 2)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    data = ds.NumpySlicesDataset({"x": X, "y": Y}, shuffle=False).batch(4)
    callback = hyper_parallel.CheckpointCallback(str(root), save_checkpoint_steps=2, async_save=False,
                                                 exception_save=True, resume=False)
    raiser = _Raise(at, ranks, gate)
    error = None
    try:
        Model(net, loss_fn=nn.MSELoss(), optimizer=opt).train(2, data, callbacks=[callback, raiser],
                                                              dataset_sink_mode=False)
    except BaseException as exc:  # pylint: disable=broad-exception-caught
        error = f"{type(exc).__name__}: {exc}"
    seconds = None if raiser.raised_at is None else time.monotonic() - raiser.raised_at
    if gate is not None:  # rank 1 is done; rank 1 then stays until rank 0 is done too (a process that ends
        # while the other still uses communication makes MindSpore abort that one)
        (gate if RANK == 1 else gate.with_suffix(".0")).write_text("done")
        deadline = time.monotonic() + 240
        while RANK == 1 and not gate.with_suffix(".0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return {"error": error, "seconds": seconds, "committed": _committed(root)}


def together() -> dict:
    info = _train("together", 8, tuple(range(WORLD)), None)
    if info["committed"]:
        loaded = hyper_parallel.load_checkpoint(str(BASE / "together" / info["committed"][-1]))
        info["loaded"] = sorted(k for k in loaded if hasattr(loaded[k], "asnumpy"))
    return info


def alone() -> dict:
    return _train("alone", 8, tuple(range(WORLD)), BASE / "gate")


run_scenarios({"together": together, "alone": alone})
