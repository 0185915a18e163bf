"""Train a small sharded MindSpore MLP with checkpoints; kill it, resume on another world size.

Run in one process, or under msrun on any world size that divides 64 (1, 2, 4, 8...)::

    python scripts/train_example.py --ckpt runs/mlp --steps 8
    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --log_dir=msrun_log --join=True \\
        scripts/train_example.py --ckpt runs/mlp --steps 12 --save-every 2 --log runs/mlp.jsonl

Rerunning with the same ``--ckpt``, on any world size, resumes after the newest
committed step and produces the same losses as an uninterrupted run.

How the training stays independent of the world size: every weight matrix and
its momentum is sharded over the ranks as a :class:`hyper_parallel.DTensor`
(``fc1.weight`` by rows, ``fc2.weight`` by columns, ``fc1.bias`` split,
``fc2.bias`` replicated). Each step, as in FSDP / ZeRO-3, the shards are
all-gathered into the full weights of an ``nn.Cell``; every rank computes the
loss and gradients of the same global batch on that full model (no data
parallelism, so no gradient reduction: the floating-point operations are
those of a 1-process run), then updates only its own shard with SGD +
momentum (element-wise, hence bit-identical whatever the split). The batch
comes from a ``numpy`` generator whose state is checkpointed too.

Checkpoints: ``CheckpointManager(--ckpt, max_to_keep=3, async_save=True)``
saves every ``--save-every`` steps; each async save is written in the
background during the next training step and committed (collectively) right
after it. ``--crash-at S`` simulates ``kill -9`` of the whole job: after step S
is logged and its save (if any) has started, every rank SIGKILLs itself, so
step S itself is never committed. The last step (``--steps``) is always saved.

Rank 0 prints ``step N loss X`` (``X`` the full float repr) and appends
``{"step", "loss", "world_size"}`` JSON lines to ``--log``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout, platform

__all__ = ["MLP", "build_state", "main", "parse_args", "train_step"]

IN_DIM, HIDDEN, OUT_DIM, BATCH = 32, 64, 16, 64
LR, MOMENTUM, SEED = 0.05, 0.9, 1234

#: Global shape and tensor map (over a 1-D mesh of all ranks) of every parameter.
PARAM_SPECS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "fc1.weight": ((HIDDEN, IN_DIM), (0, -1)),  # rows split
    "fc1.bias": ((HIDDEN,), (0,)),
    "fc2.weight": ((OUT_DIM, HIDDEN), (-1, 0)),  # columns split
    "fc2.bias": ((OUT_DIM,), (-1,)),  # replicated on every rank
}


def _init_mindspore() -> tuple[int, int]:
    """Select the CPU and, when launched by msrun, initialise communication.

    Returns:
        ``(rank, world_size)``; ``(0, 1)`` in a plain process.
    """
    ms.set_device("CPU")
    if os.environ.get("MS_ROLE"):  # set by msrun for its scheduler and workers
        from mindspore.communication import init  # pylint: disable=import-outside-toplevel

        init()  # the msrun scheduler process never returns from here
    return platform.get_rank(), platform.get_world_size()


class MLP(nn.Cell):
    """``tanh(x W1^T + b1) W2^T + b2``: the full (gathered) model every rank computes with."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(IN_DIM, HIDDEN, activation="tanh")
        self.fc2 = nn.Dense(HIDDEN, OUT_DIM)

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        """Forward pass."""
        return self.fc2(self.fc1(x))


def _initial_weights() -> dict[str, np.ndarray]:
    """Full initial weights from a fixed seed: identical on every rank and world size."""
    rng = np.random.default_rng(SEED)
    scale = {"fc1.weight": IN_DIM**-0.5, "fc1.bias": 0.1, "fc2.weight": HIDDEN**-0.5, "fc2.bias": 0.1}
    return {name: (rng.standard_normal(shape) * scale[name]).astype(np.float32) for name, (shape, _) in
            PARAM_SPECS.items()}


def _batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draw the next global batch; the targets come from a fixed random teacher."""
    teacher = np.random.default_rng(SEED + 1).standard_normal((IN_DIM, OUT_DIM)).astype(np.float32)
    x = rng.standard_normal((BATCH, IN_DIM)).astype(np.float32)
    return x, np.sin(x @ teacher).astype(np.float32)


def _local(dtensor: DTensor) -> np.ndarray:
    """Return a writable numpy view of a DTensor's local Parameter (CPU tensors share memory)."""
    view = platform.writable_view(dtensor.to_local())
    if view is None:
        raise RuntimeError("expected a CPU tensor whose numpy view aliases its memory")
    return view


def _box(dtensor: DTensor, rank: int) -> tuple[slice, ...]:
    """Return the slices of the full tensor that ``rank`` holds under ``dtensor``'s layout."""
    offsets = dtensor.layout.shard_offsets(dtensor.shape, rank)
    return tuple(slice(o, o + n) for o, n in zip(offsets, dtensor.local_shape))


def build_state(world: int, rank: int) -> dict[str, Any]:
    """Build this rank's state dict: initial weights, zero momentum, step 0.

    Args:
        world: World size (the mesh is 1-D over all ranks).
        rank: This process's rank.

    Returns:
        ``{"model": {name: DTensor}, "optim": {name: DTensor}, "step": int, "rng": dict}``.
    """
    model: dict[str, DTensor] = {}
    optim: dict[str, DTensor] = {}
    for name, full in _initial_weights().items():
        layout = Layout((world,), PARAM_SPECS[name][1])
        shard = np.ascontiguousarray(DTensor.from_global(full, layout, rank=rank).to_local())
        model[name] = DTensor(ms.Parameter(ms.Tensor(shard), name=name), layout, full.shape)
        momentum = ms.Parameter(ms.Tensor(np.zeros_like(shard)), name=f"momentum.{name}")
        optim[name] = DTensor(momentum, layout, full.shape)
    return {"model": model, "optim": optim, "step": 0, "rng": np.random.default_rng(SEED + 2).bit_generator.state}


def train_step(net: MLP, state: dict[str, Any], x: np.ndarray, y: np.ndarray) -> float:
    """Gather the shards into ``net``, compute loss and gradients, update this rank's shards.

    All ranks call it (it all-gathers). Returns the loss, the same on every rank.
    """
    model, optim = state["model"], state["optim"]
    names = list(PARAM_SPECS)
    # Object all-gather (pickled numpy arrays): simple and exact; a large model would use a tensor all-gather.
    gathered = platform.all_gather_object([np.array(_local(model[n])) for n in names])
    params = dict(net.parameters_and_names())
    for i, name in enumerate(names):
        full = np.empty(PARAM_SPECS[name][0], np.float32)
        for rank, shards in enumerate(gathered):
            full[_box(model[name], rank)] = shards[i]
        platform.assign(params[name], full)

    def loss_fn(inputs: Any, targets: Any) -> Any:
        return ms.ops.mean((net(inputs) - targets) ** 2)

    weights = [params[n] for n in names]
    loss, grads = ms.value_and_grad(loss_fn, None, weights)(ms.Tensor(x), ms.Tensor(y))
    for name, grad in zip(names, grads):
        g = grad.asnumpy()[_box(model[name], model[name].rank)]
        m, w = _local(optim[name]), _local(model[name])
        m[...] = np.float32(MOMENTUM) * m + g
        w[...] = w - np.float32(LR) * m
    return float(loss.asnumpy())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, type=Path, help="checkpoint root directory (shared by all ranks)")
    parser.add_argument("--steps", type=int, required=True, help="train until this step (inclusive)")
    parser.add_argument("--save-every", type=int, default=2, help="save every K steps (default 2)")
    parser.add_argument("--log", type=Path, default=None, help="append rank 0's losses here as JSON lines")
    parser.add_argument("--crash-at", type=int, default=None, help="SIGKILL every rank after this step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Train, saving every few steps; resume after the newest committed step if there is one."""
    rank, world = _init_mindspore()
    args = parse_args(argv)
    if rank == 0 and args.log is not None:
        args.log.parent.mkdir(parents=True, exist_ok=True)
    net, state = MLP(), build_state(world, rank)
    manager = dcp.CheckpointManager(args.ckpt, max_to_keep=3, save_interval_steps=args.save_every, async_save=True)
    start = 1
    if manager.latest_step() is not None:  # all ranks: the listing is broadcast from rank 0
        loaded = manager.load(state)  # reshards whatever world size saved it
        start = loaded + 1
        if rank == 0:
            print(f"resumed from step {loaded} on {world} rank(s)", flush=True)
    rng = np.random.default_rng()
    rng.bit_generator.state = state["rng"]
    for step in range(start, args.steps + 1):
        loss = train_step(net, state, *_batch(rng))
        manager.wait()  # commit the previous save, written in the background during this step
        if rank == 0:
            print(f"step {step} loss {loss!r}", flush=True)
            if args.log is not None:
                with open(args.log, "a", encoding="utf-8") as log:
                    log.write(json.dumps({"step": step, "loss": loss, "world_size": world}) + "\n")
        state["step"], state["rng"] = step, rng.bit_generator.state
        manager.save(step, state)
        if step == args.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)  # like `kill -9`: no cleanup, no commit
    if start <= args.steps and args.steps % args.save_every:
        manager.save(args.steps, state, force=True)  # always keep the final step
    manager.close()


if __name__ == "__main__":
    main()
