"""msrun worker for ``tests/test_s3.py``: 2 ranks save to and load from ``s3://`` (moto endpoint).

Argument: the checkpoint URL prefix. Scenarios (every rank, in order):

- ``save``: rows of ``w`` split over the 2 ranks (DTensor), a replicated
  ``bias`` and a value, saved to ``<url>/sharded``.
- ``load_columns``: loaded back resharded, columns split over the ranks.
- ``load_full``: loaded into a whole (unsharded) tensor on each rank.
- ``async_save``: an async save of the next step to ``<url>/async``, then loaded.
- ``manager``: a ``CheckpointManager`` on ``<url>/steps`` keeping 2 of 3 steps.
- ``rank_local``: ``use_collectives=False``: each rank saves and loads alone.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from worker_lib import init_worker, run_scenarios

__all__ = ["main", "full_value"]

SHAPE = (8, 12)


def full_value(step: int) -> np.ndarray:
    """The global ``w`` of ``step`` (the pytest side checks against it too)."""
    return np.arange(96, dtype=np.float32).reshape(SHAPE) * 10 + step


def main() -> None:
    """Run the object-storage scenarios on this rank."""
    rank, _ = init_worker()
    import mindspore  # pylint: disable=import-outside-toplevel

    import hyper_parallel  # pylint: disable=import-outside-toplevel
    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel

    url = sys.argv[1]
    rows = hyper_parallel.Layout((2,), (0, -1))
    columns = hyper_parallel.Layout((2,), (-1, 0))

    def state(step: int) -> dict[str, Any]:
        return {
            "w": hyper_parallel.DTensor.from_global(mindspore.Tensor(full_value(step)), rows, rank=rank),
            "bias": mindspore.Tensor(np.full(3, step, np.float32)),
            "step": step,
        }

    def blank(layout: Any, local: tuple[int, int]) -> dict[str, Any]:
        return {
            "w": hyper_parallel.DTensor(mindspore.Tensor(np.zeros(local, np.float32)), layout, SHAPE, rank=rank),
            "bias": mindspore.Tensor(np.zeros(3, np.float32)),
            "step": -1,
        }

    def save() -> str:
        return dcp.save(state(1), checkpoint_id=f"{url}/sharded").storage_meta.save_id

    def load_columns() -> dict[str, Any]:
        target = blank(columns, (8, 6))
        dcp.load(target, checkpoint_id=f"{url}/sharded")
        return {"w": target["w"].to_local().asnumpy().copy(), "bias": target["bias"].asnumpy().copy(),
                "step": target["step"]}

    def load_full() -> np.ndarray:
        target = {"w": mindspore.Tensor(np.zeros(SHAPE, np.float32))}
        dcp.load(target, checkpoint_id=f"{url}/sharded")
        return target["w"].asnumpy().copy()

    def async_save() -> np.ndarray:
        handle = dcp.async_save(state(2), checkpoint_id=f"{url}/async")
        handle.result()
        target = blank(rows, (4, 12))
        dcp.load(target, checkpoint_id=f"{url}/async")
        return target["w"].to_local().asnumpy().copy()

    def manager() -> dict[str, Any]:
        with dcp.CheckpointManager(f"{url}/steps", max_to_keep=2) as steps:
            for step in (1, 2, 3):
                steps.save(step, state(step))
            target = blank(columns, (8, 6))
            loaded = steps.load(target)
            return {"steps": steps.all_steps(), "loaded": loaded, "w": target["w"].to_local().asnumpy().copy()}

    def rank_local() -> np.ndarray:
        own = {"x": mindspore.Tensor(np.full(4, rank + 100, np.float32))}
        dcp.save(own, checkpoint_id=f"{url}/local", use_collectives=False)
        back = {"x": mindspore.Tensor(np.zeros(4, np.float32))}
        dcp.load(back, checkpoint_id=f"{url}/local", use_collectives=False)
        return back["x"].asnumpy().copy()

    run_scenarios({"save": save, "load_columns": load_columns, "load_full": load_full, "async_save": async_save,
                   "manager": manager, "rank_local": rank_local})


if __name__ == "__main__":
    main()
