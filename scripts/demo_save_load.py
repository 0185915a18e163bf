"""Save a few MindSpore tensors with hyper_parallel, load them back, print what happened.

Run: ``python scripts/demo_save_load.py [--dir DIR]``. A real save and load on
CPU in one process: a Parameter, a bfloat16 tensor, a DTensor shard layout
resharded on load, numpy and plain values; every data file is opened with the
``safetensors`` library to show it is a standard file.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import mindspore as ms
import numpy as np
from safetensors import safe_open

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout


__all__ = ["main"]

def main() -> None:
    """Save, load, check and report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a new temporary one)")
    args = parser.parse_args()
    ms.set_device("CPU")
    path = args.dir or os.path.join(tempfile.mkdtemp(prefix="hp_demo_"), "ckpt")

    weight = ms.Parameter(ms.Tensor(np.arange(24, dtype=np.float32).reshape(4, 6)), name="weight")
    bias = ms.Tensor(np.linspace(-1, 1, 6, dtype=np.float32), ms.bfloat16)
    state = {"model": {"weight": weight, "bias": bias}, "step": 100, "lr": 3e-4, "ids": np.arange(5)}
    metadata = dcp.save(state, checkpoint_id=path, no_dist=True)
    stored = sum(info.length for info in metadata.storage_data.values())
    print(f"saved {len(metadata.state_dict_metadata)} keys ({stored} bytes) to {path}")

    fresh = ms.Parameter(ms.Tensor(np.zeros((4, 6), np.float32)), name="weight")
    # The weight as two column shards (a layout the save never used): load reshards.
    shards = [DTensor(np.zeros((4, 3), np.float32), Layout((2,), (-1, 0)), rank=r) for r in range(2)]
    target = {"model": {"weight": fresh, "bias": ms.Tensor(np.zeros(6, np.float32))}, "step": 0, "lr": 0.0,
              "ids": np.zeros(5, np.int64)}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    for shard in shards:
        dcp.load({"model.weight": shard}, checkpoint_id=path, no_dist=True)
    assert target["model"]["weight"] is fresh and np.array_equal(fresh.asnumpy(), weight.asnumpy())
    assert np.array_equal(np.concatenate([s.to_local() for s in shards], axis=1), weight.asnumpy())
    assert target["step"] == 100 and target["lr"] == 3e-4
    print(f"loaded in place: weight {fresh.asnumpy().tolist()[0]}..., step {target['step']}, lr {target['lr']}")
    print(f"bias (bfloat16 stored, float32 target): {target['model']['bias'].asnumpy().tolist()}")
    print(f"resharded into 2 column shards: {[s.to_local().shape for s in shards]}")
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="numpy") as handle:
                print(f"{name}: safetensors keys {sorted(handle.keys())}")
    print("demo OK")


if __name__ == "__main__":
    main()
