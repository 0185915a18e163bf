"""msrun worker: CheckpointCallback with Model.train on Parameters sliced over 2 ranks (strategy file).

Usage: ``callback_worker.py BASE_DIR`` with ``BASE_DIR/strategies/rows.ckpt``
written by tests/test_checkpoint_callback.py: ``w`` (8, 4) and ``b`` (8,) split
by rows over the 2 ranks. Each rank trains its rows (its half of the outputs)
with Adam, so every Parameter and moment is a slice, on its shard of a
shuffled dataset (4 steps per epoch). Three runs, all through ``Model.train``
+ ``CheckpointCallback`` saving every 3 steps: an uninterrupted reference (4
epochs), a first part killed (an exception on every rank) after step 7, so
its newest committed step 6 lies inside epoch 2, and a fresh network resumed
from it to epoch 4 with ``resume_dataset``. Before that, another batch size
on rank 1 only is refused on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from worker_lib import init_worker, report, sliced_rows

RANK, WORLD = init_worker()

from mindspore import dataset as ds  # noqa: E402  (after init_worker, which sets the device)
from mindspore import nn  # noqa: E402
from mindspore.train import Model  # noqa: E402
from train_steps import StepLog  # noqa: E402

import hyper_parallel  # noqa: E402
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError  # noqa: E402

BASE = Path(sys.argv[1])
STRATEGY = str(BASE / "strategies" / "rows.ckpt")
ROWS = 8 // WORLD
RNG = np.random.default_rng(3)
W = RNG.standard_normal((8, 4)).astype(np.float32)
B = RNG.standard_normal(8).astype(np.float32)
X = RNG.standard_normal((32, 4)).astype(np.float32)
Y = (X @ RNG.standard_normal((4, 8)).astype(np.float32)).astype(np.float32)
STEPS_PER_EPOCH = 4


CRASH_AT = 7


def dataset(batch: int = 16 // STEPS_PER_EPOCH) -> ds.Dataset:
    """This rank's shard (16 of the 32 rows), shuffled anew each epoch, for this rank's outputs."""
    ds.config.set_seed(11)
    rows = slice(RANK * ROWS, (RANK + 1) * ROWS)
    return ds.NumpySlicesDataset({"x": X, "y": Y[:, rows].copy()}, shuffle=True, num_shards=WORLD,
                                 shard_id=RANK).batch(batch)


def train(root: str, epochs: int, *, fresh: bool,
          crash_at: int | None = None) -> tuple[StepLog, hyper_parallel.CheckpointCallback, nn.Cell, nn.Adam]:
    rows = slice(RANK * ROWS, (RANK + 1) * ROWS)
    w, b = (np.zeros((ROWS, 4), np.float32), np.zeros(ROWS, np.float32)) if fresh else (W[rows], B[rows])
    net = sliced_rows(w, b)
    opt = nn.Adam(net.trainable_params(), learning_rate=0.05)
    data = dataset()
    callback = hyper_parallel.CheckpointCallback(root, save_checkpoint_steps=3, keep_checkpoint_max=2,
                                                 strategy_file=STRATEGY)
    losses = StepLog(crash_at)
    try:
        Model(net, loss_fn=nn.MSELoss(), optimizer=opt).train(
            epochs, data, callbacks=[callback, losses], dataset_sink_mode=False,
            initial_epoch=callback.resume_dataset(data))
    except RuntimeError as exc:
        if crash_at is None or "killed" not in str(exc):
            raise
    return losses, callback, net, opt


reference, _, ref_net, ref_opt = train(str(BASE / "ref"), 4, fresh=False)
first, _, _, _ = train(str(BASE / "run"), 4, fresh=False, crash_at=CRASH_AT)
try:
    # Only rank 1's shard has another batch size (8 steps per epoch): every rank is stopped.
    hyper_parallel.CheckpointCallback(str(BASE / "run"), save_checkpoint_steps=3).resume_dataset(
        dataset(batch=2 if RANK == 1 else 16 // STEPS_PER_EPOCH))
    REFUSED = ""
except CheckpointValueError as error:
    REFUSED = str(error)
resumed, callback, net, opt = train(str(BASE / "run"), 4, fresh=True)
whole = hyper_parallel.load_checkpoint(str(BASE / "run" / "step_00000016"))
report({
    "reference": reference.losses, "first": first.losses, "resumed": resumed.losses, "refused": REFUSED,
    "ref_inputs": reference.inputs, "inputs": resumed.inputs,
    "resumed_step": callback.resumed_step, "steps": callback.manager.all_steps(),
    "w": net.w.asnumpy(), "ref_w": ref_net.w.asnumpy(),
    "m1": opt.moment1[0].asnumpy(), "ref_m1": ref_opt.moment1[0].asnumpy(),
    "full_w": whole["w"].asnumpy(), "full_m1": whole["moment1.w"].asnumpy(),
    "keys": sorted(whole),
})
