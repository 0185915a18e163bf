"""msrun worker for ``tests/test_manager.py``: an async ``CheckpointManager`` on 2 ranks.

Each rank saves 4 steps of a DTensor-sharded state (rows split over the 2
ranks) plus a replicated tensor and a plain value, with ``async_save=True``
and ``max_to_keep=2``, scribbling over its tensors after every ``save``
returns; it records the committed steps seen after each save, then loads the
latest step and step 3 into fresh targets. The pytest side checks the
directory and every rank's values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from worker_lib import init_worker, run_scenarios, scenario_tmp_dir

__all__ = ["main"]

LAYOUT_ARGS = ((2,), (0, -1))


def _full(step: int) -> np.ndarray:
    return np.arange(24, dtype=np.float32).reshape(4, 6) * 10 + step


def main() -> None:
    """Run the manager scenarios on this rank."""
    rank, _ = init_worker()
    import mindspore  # pylint: disable=import-outside-toplevel

    import hyper_parallel  # pylint: disable=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint.manager import (  # pylint: disable=import-outside-toplevel
        CheckpointManager,
    )

    layout = hyper_parallel.Layout(*LAYOUT_ARGS)
    root = scenario_tmp_dir("manager")
    manager = CheckpointManager(root, max_to_keep=2, async_save=True)

    def state(step: int) -> dict[str, Any]:
        return {
            "w": hyper_parallel.DTensor.from_global(mindspore.Tensor(_full(step)), layout, rank=rank),
            "bias": mindspore.Tensor(np.full(3, step, dtype=np.float32)),
            "count": step,
        }

    def save_steps() -> list[list[int]]:
        seen = []
        for step in range(1, 5):
            current = state(step)
            if not manager.save(step, current):
                raise AssertionError(f"step {step} not saved")
            current["w"].to_local().asnumpy()[...] = -1.0  # staged already: must not reach the file
            current["bias"].asnumpy()[...] = -1.0
            if current["w"].to_local().asnumpy()[0, 0] != -1.0:
                raise AssertionError("in-place change of the local shard did not take")
            seen.append(manager.all_steps())
        manager.wait()
        seen.append(manager.all_steps())
        return seen

    def target() -> dict[str, Any]:
        return {
            "w": hyper_parallel.DTensor(mindspore.Tensor(np.zeros((2, 6), np.float32)), layout, (4, 6), rank=rank),
            "bias": mindspore.Tensor(np.zeros(3, np.float32)),
            "count": -1,
        }

    def load_latest() -> dict[str, Any]:
        loaded = target()
        step = manager.load(loaded)
        return {
            "step": step,
            "local": loaded["w"].to_local().asnumpy().copy(),
            "bias": loaded["bias"].asnumpy().copy(),
            "count": loaded["count"],
        }

    def load_step_3() -> np.ndarray:
        loaded = target()
        manager.load(loaded, step=3)
        return loaded["w"].to_local().asnumpy().copy()

    def rank_local_saves_refused() -> dict[str, Any]:
        """use_collectives=False / no_dist=True commit no step the manager lists: refused, nothing written."""
        # pylint: disable-next=import-outside-toplevel
        from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError

        local_root = scenario_tmp_dir("manager_rank_local")
        local = CheckpointManager(local_root, max_to_keep=2)
        refused = {}
        for option in ("use_collectives", "no_dist"):
            try:
                local.save(1, state(1), **{option: option == "no_dist"})
                refused[option] = ""
            except CheckpointValueError as exc:
                refused[option] = str(exc)
        # pylint: disable-next=import-outside-toplevel
        from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper

        # Listed by rank 0 inside a collective step: every rank is past its refusal, none saves yet.
        written_before = DistWrapper(use_dist=True).broadcast(
            "list", lambda: sorted(p.name for p in local_root.iterdir() if p.name.startswith("step_")))
        local.save(1, state(1))
        return {"refused": refused, "written_before": written_before, "steps": local.all_steps()}

    run_scenarios({"save_steps": save_steps, "load_latest": load_latest, "load_step_3": load_step_3,
                   "rank_local_saves_refused": rank_local_saves_refused})
    manager.close()


if __name__ == "__main__":
    main()
