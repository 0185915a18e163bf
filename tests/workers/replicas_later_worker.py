"""msrun worker for ``tests/test_async_replicas_later.py``: a forked writer hashes the replicas, not the caller.

Every rank saves a row-sharded DTensor, a replicated Tensor, a replicated
Parameter and a value with ``async_save(..., staging="fork")``, and again
with ``staging="copy"`` (scenarios suffixed ``_copy``: the background thread
hashes the staged copies). Scenarios: ``equal`` counts the digests the
caller's thread makes while ``async_save`` blocks (none of a tensor),
changes the replicas right after the call and loads the step back (with
``"copy"`` twice: a first save and one reusing its plan and staging layout);
``diverging`` saves a Parameter that differs on rank 1, then reports what
``result()`` and the next collective step (a load) raised, whether the step
was committed, and that a save after it works.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from worker_lib import init_worker, run_scenarios, scenario_tmp_dir

__all__ = ["main", "BIG_SHAPE"]

BIG_SHAPE = (64, 256)


def main() -> None:
    """Run the scenarios on this rank."""
    rank, _ = init_worker()
    import mindspore  # pylint: disable=import-outside-toplevel

    import hyper_parallel  # pylint: disable=import-outside-toplevel
    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel
    import threading  # pylint: disable=import-outside-toplevel

    from hyper_parallel.core.distributed_checkpoint import _async_engine, _save_layout  # pylint: disable=C0415

    layout = hyper_parallel.Layout((2,), (0, -1))
    shared = scenario_tmp_dir("replicas_later")
    hashed: list[int] = []
    original_digest = _save_layout.digest

    def counting_digest(data: Any) -> str:  # digests of tensors on the caller's thread
        if threading.current_thread() is threading.main_thread():
            hashed.append(len(memoryview(data)))
        return original_digest(data)

    _save_layout.digest = counting_digest
    _async_engine.digest = counting_digest  # the copy staging's digests (background thread)

    def full(seed: float) -> np.ndarray:
        return np.arange(32 * 6, dtype=np.float32).reshape(32, 6) + seed

    def big(seed: float) -> np.ndarray:
        return np.linspace(0, 1, BIG_SHAPE[0] * BIG_SHAPE[1], dtype=np.float32).reshape(BIG_SHAPE) + seed

    def state(seed: float, skew: float = 0.0) -> dict[str, Any]:
        return {"w": hyper_parallel.DTensor.from_global(mindspore.Tensor(full(seed)), layout, rank=rank),
                "bias": mindspore.Tensor(np.full(5, seed, np.float32)),
                "big": mindspore.Parameter(mindspore.Tensor(big(seed) + skew), name="big"),
                "step": int(seed)}

    def load(path: Any) -> dict[str, np.ndarray]:
        target = state(-100.0)
        dcp.load(target, checkpoint_id=path)
        return {"w": target["w"].to_local().asnumpy().copy(), "bias": target["bias"].asnumpy().copy(),
                "big": target["big"].asnumpy().copy(), "step": target["step"]}

    def equal(staging: str = "fork", name: str = "equal") -> dict[str, Any]:
        out: dict[str, Any] = {"hashed_in_call": [], "w_ok": True, "bias_ok": True, "big_ok": True, "steps": []}
        for repeat in range(1 if staging == "fork" else 2):
            saved = state(3.0 + repeat)
            saved["step"] = 3  # the same layout: the second save reuses the plan and the staging layout
            planner = dcp.StandardSavePlanner()
            hashed.clear()
            handle = dcp.async_save(saved, checkpoint_id=shared / f"{name}{repeat}", staging=staging, planner=planner)
            out["hashed_in_call"] += [n for n in hashed if n > 64]  # tensor pieces; values' payloads are a few bytes
            out["kept"] = sorted((fqn, offsets) for fqn, offsets, _ in planner.later_replicas)
            saved["bias"].asnumpy()[...] = -1.0  # the caller changes its replicas at once
            saved["big"].asnumpy()[...] = -1.0
            handle.result()
            found = load(shared / f"{name}{repeat}")
            expected = state(3.0 + repeat)
            out["w_ok"] &= found["w"].tobytes() == expected["w"].to_local().asnumpy().tobytes()
            out["bias_ok"] &= found["bias"].tobytes() == expected["bias"].asnumpy().tobytes()
            out["big_ok"] &= found["big"].tobytes() == expected["big"].asnumpy().tobytes()
            out["steps"].append(found["step"])
        return out

    def diverging(staging: str = "fork", name: str = "diverging") -> dict[str, Any]:
        path = shared / name
        handle = dcp.async_save(state(5.0, skew=0.5 if rank == 1 else 0.0), checkpoint_id=path, staging=staging)
        result_error = ""
        try:
            handle.result()
        except dcp.CheckpointError as exc:
            result_error = f"{type(exc).__name__}: {exc}"
        next_error = ""
        try:
            load(path)
        except dcp.CheckpointError as exc:
            next_error = f"{type(exc).__name__}: {exc}"
        committed = (path / "metadata.json").exists()
        dcp.async_save(state(6.0), checkpoint_id=shared / f"after_{name}", staging=staging).result()
        after = load(shared / f"after_{name}")
        return {"result_error": result_error, "next_error": next_error, "committed": committed,
                "after_ok": after["big"].tobytes() == big(6.0).tobytes() and after["step"] == 6}

    run_scenarios({"equal": equal, "diverging": diverging,
                   "equal_copy": lambda: equal("copy", "equal_copy"),
                   "diverging_copy": lambda: diverging("copy", "diverging_copy")})


if __name__ == "__main__":
    main()
