"""Train with ``mindspore.train.Model.train`` and ``hyper_parallel.CheckpointCallback``; kill it; resume.

The MindSpore-user path: a plain network, an optimizer, ``Model.train``, and
one callback in place of ``ModelCheckpoint``::

    python scripts/train_model_example.py --ckpt /tmp/run --epochs 5 --crash-at 10   # dies at step 10
    python scripts/train_model_example.py --ckpt /tmp/run --epochs 5                 # resumes, ends at 20
    python scripts/train_model_example.py --ckpt /tmp/ref --epochs 5                 # uninterrupted reference

The dataset is shuffled (4 batches per epoch, a new order each epoch) and the
callback saves every 3 steps, asynchronously, into ``--ckpt/step_<n>``: most
saves fall inside an epoch. A rerun positions the dataset just after the
newest committed step (``callback.resume_dataset(dataset)``, which also
returns the ``initial_epoch`` for ``Model.train``), loads that step into the
network and the Adam optimizer (moments included) and continues the step
numbering after it, so the resumed run trains on the same batches and logs the
same losses as the uninterrupted one, bit for bit.

``--crash-at S`` kills the process (``os._exit``, no cleanup) at the end of
step S, after the callback has started that step's save if it saves there.
Under ``msrun`` every rank trains the same replica (no parallel context); the
replicated Parameters are written once. Rank 0 prints ``step N loss X`` and
appends ``{"step", "loss"}`` JSON lines to ``--log``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import dataset as ds
from mindspore import nn
from mindspore.train import Callback, Model

import hyper_parallel

__all__ = ["build", "main", "parse_args"]

IN_DIM, OUT_DIM, BATCH, STEPS_PER_EPOCH, SAVE_EVERY, SEED = 8, 4, 16, 4, 3, 7


class _Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(IN_DIM, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Dense(16, OUT_DIM)

    def construct(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _dataset() -> ds.Dataset:
    ds.config.set_seed(SEED)  # the shuffle order of every epoch, the same in every run
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((BATCH * STEPS_PER_EPOCH, IN_DIM)).astype(np.float32)
    y = (x @ rng.standard_normal((IN_DIM, OUT_DIM)).astype(np.float32)).astype(np.float32)
    return ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=True).batch(BATCH)


class _LossLog(Callback):
    """Rank 0 logs every step's loss; ``crash_at`` kills the process at the end of that step."""

    def __init__(self, log: Path | None, crash_at: int | None, rank: int) -> None:
        super().__init__()
        self.log, self.crash_at, self.rank = log, crash_at, rank

    def on_train_step_end(self, run_context):
        params = run_context.original_args()
        step, loss = int(params.cur_step_num), float(params.net_outputs.asnumpy())
        if self.rank == 0:
            print(f"step {step} loss {loss!r}", flush=True)
            if self.log is not None:
                with open(self.log, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps({"step": step, "loss": loss}) + "\n")
        if step == self.crash_at:
            os._exit(17)  # pylint: disable=protected-access


def build() -> tuple[Model, nn.Cell, nn.Optimizer]:
    """The network, its Adam optimizer and the ``Model`` (same initial values in every run)."""
    ms.set_seed(SEED)
    net = _Net()
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    return Model(net, loss_fn=nn.MSELoss(), optimizer=opt), net, opt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="checkpoint root (the callback's directory)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--log", type=Path, default=None, help="append {step, loss} JSON lines here (rank 0)")
    parser.add_argument("--crash-at", type=int, default=None, help="kill the process at the end of this step")
    parser.add_argument("--sync", action="store_true", help="save synchronously (async_save=False)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ms.set_device("CPU")
    rank = 0
    if "MS_WORKER_NUM" in os.environ or "RANK_SIZE" in os.environ:
        from mindspore import communication  # pylint: disable=import-outside-toplevel

        communication.init()
        rank = communication.get_rank()
    model, _, _ = build()
    callback = hyper_parallel.CheckpointCallback(
        args.ckpt, save_checkpoint_steps=SAVE_EVERY, keep_checkpoint_max=3, async_save=not args.sync,
        append_info=["epoch_num", "step_num"],
    )
    dataset = _dataset()
    first = callback.resume_dataset(dataset)  # after the newest committed step (none: epoch 0, batch 0)
    if first >= args.epochs:
        print(f"nothing to do: {args.ckpt} already holds epoch {first}")
        return 0
    model.train(args.epochs, dataset, callbacks=[callback, _LossLog(args.log, args.crash_at, rank)],
                dataset_sink_mode=False, initial_epoch=first)
    if rank == 0:
        print(f"resumed from step {callback.resumed_step}; newest step {callback.manager.latest_step()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
