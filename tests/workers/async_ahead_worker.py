"""msrun worker for ``tests/test_async_ahead.py``: copies ahead on ranks of a job of several.

Every rank holds four replicated large Parameters (each rank writes some of
them), a row-sharded DTensor and a small tensor. ``steady`` prepares, then
saves four times with ``async_save`` (changing every Parameter right after
each call) and loads each step back; it reports, per save, the copies ahead
this rank adopted and missed. ``changed`` then replaces one large Parameter
(the old one kept alive) and saves: the stale copy ahead is dropped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from worker_lib import init_worker, run_scenarios, scenario_tmp_dir

__all__ = ["main", "LARGE"]

LARGE = (512, 1024)


def main() -> None:
    """Run the scenarios on this rank."""
    rank, _ = init_worker()
    import mindspore  # pylint: disable=import-outside-toplevel

    import hyper_parallel  # pylint: disable=import-outside-toplevel
    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint import _async_engine  # pylint: disable=import-outside-toplevel

    pool = _async_engine.staging_pool()
    layout = hyper_parallel.Layout((2,), (0, -1))
    shared = scenario_tmp_dir("async_ahead")

    def values(seed: float) -> dict[str, np.ndarray]:
        base = np.linspace(0, 1, LARGE[0] * LARGE[1], dtype=np.float32).reshape(LARGE)
        return {**{f"big{i}": base + seed + i for i in range(4)}, "rows": base * 2 + seed,
                "small": np.full((3, 5), seed, np.float32)}

    state: dict[str, Any] = {
        **{f"big{i}": mindspore.Parameter(mindspore.Tensor(np.zeros(LARGE, np.float32)), name=f"big{i}")
           for i in range(4)},
        "rows": hyper_parallel.DTensor.from_global(mindspore.Tensor(np.zeros(LARGE, np.float32)), layout, rank=rank),
        "small": mindspore.Parameter(mindspore.Tensor(np.zeros((3, 5), np.float32)), name="small"),
    }

    def local(name: str) -> np.ndarray:
        value = state[name]
        return (value.to_local() if name == "rows" else value).asnumpy()

    def fill(seed: float) -> dict[str, np.ndarray]:
        wanted = values(seed)
        for name, value in wanted.items():
            local(name)[...] = value if name != "rows" else value[rank * LARGE[0] // 2 : (rank + 1) * LARGE[0] // 2]
        return {name: local(name).copy() for name in wanted}

    def loaded(path: Any) -> dict[str, np.ndarray]:
        target = {name: mindspore.Parameter(mindspore.Tensor(np.full(LARGE, -9.0, np.float32)), name=name)
                  for name in ("big0", "big1", "big2", "big3")}
        target["rows"] = hyper_parallel.DTensor.from_global(mindspore.Tensor(np.full(LARGE, -9.0, np.float32)),
                                                           layout, rank=rank)
        target["small"] = mindspore.Parameter(mindspore.Tensor(np.full((3, 5), -9.0, np.float32)), name="small")
        dcp.load(target, checkpoint_id=path)
        return {name: (value.to_local() if name == "rows" else value).asnumpy().copy() for name, value in target.items()}

    def save(seed: float, name: str) -> tuple[int, int, bool]:
        expected = fill(seed)
        before = (pool.ahead_adopted, pool.ahead_missed)
        handle = dcp.async_save(state, checkpoint_id=shared / name)
        fill(-1.0)  # the next training step writes every tensor at once
        handle.result()
        found = loaded(shared / name)
        exact = all(found[key].tobytes() == expected[key].tobytes() for key in expected)
        return pool.ahead_adopted - before[0], pool.ahead_missed - before[1], exact

    def steady() -> list[tuple[int, int, bool]]:
        dcp.prepare_async_save(state).result(timeout=120)
        return [save(float(step), f"steady{step}") for step in range(4)]

    def changed() -> tuple[int, int, bool]:
        old = state["big2"]
        state["big2"] = mindspore.Parameter(mindspore.Tensor(np.zeros(LARGE, np.float32)), name="big2")
        outcome = save(7.0, "changed")
        assert old.asnumpy().shape == LARGE
        return outcome

    run_scenarios({"steady": steady, "changed": changed})


if __name__ == "__main__":
    main()
