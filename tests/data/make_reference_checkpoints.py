"""Write the reference checkpoint of the current format version into tests/data/.

Run once per format version, from the repository root, with the code of that
version (``PYTHONPATH=$PWD python tests/data/make_reference_checkpoints.py``).
The directories it writes are committed and never rewritten: they prove that
later code still loads what earlier code wrote (tests/test_reference_checkpoints.py).

Each reference is a 2-rank save (simulated in one process) of the values of
:func:`reference_state`: a row-split float32 DTensor, a replicated int64 array,
a float16 array, nested plain values; from version 2.0 on also a uint8 chunk
with rows of 8 KiB (so it carries tile checksums), and a second checkpoint of
the same state written with zstd compression.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

__all__ = ["reference_full_state", "reference_state", "main"]


def reference_full_state(version: str) -> dict:
    """The whole (unsharded) values a reference checkpoint of ``version`` holds."""
    state = {
        "w": np.arange(24, dtype=np.float32).reshape(4, 6) / 4,
        "ids": np.arange(5, dtype=np.int64) * 1000,
        "half": np.array([0.5, -1.25, 3.0], dtype=np.float16),
        "step": 7,
        "name": "reference",
        "opt": {"lr": 0.5, "betas": [0.9, 0.999]},
    }
    if version != "1.0":
        state["wide"] = (np.arange(2 * 8192, dtype=np.int64) % 251).astype(np.uint8).reshape(2, 8192)
    return state


def reference_state(version: str, rank: int) -> dict:
    """Rank ``rank``'s state dict (of 2) for the reference checkpoint of ``version``."""
    from hyper_parallel import DTensor, Layout  # pylint: disable=import-outside-toplevel

    state = dict(reference_full_state(version))
    state["w"] = DTensor.from_global(state["w"], Layout((2,), (0, -1)), rank=rank)
    if "wide" in state:
        state["wide"] = DTensor.from_global(state["wide"], Layout((2,), (0, -1)), rank=rank)
    return state


def main() -> None:
    """Write ``tests/data/ckpt_v<version>`` (and ``..._zstd`` from 2.0 on) for the current version."""
    # pylint: disable-next=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint.metadata import FORMAT_VERSION
    from sim_ranks import simulate_save  # pylint: disable=import-outside-toplevel

    name = "ckpt_v" + FORMAT_VERSION.replace(".", "_")
    states = [reference_state(FORMAT_VERSION, rank) for rank in range(2)]
    targets = [(HERE / name, {})]
    if FORMAT_VERSION != "1.0":
        targets.append((HERE / f"{name}_zstd", {"compression": "zstd"}))
    for path, options in targets:
        if path.exists():
            raise SystemExit(f"{path} exists: reference checkpoints are never rewritten")
        simulate_save(states, path, writer_options=options)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
