"""msrun worker for tests/test_collective_audit.py: one rank failing a collective save, and reshards.

Usage: ``collective_audit_worker.py PHASE BASE_DIR``. Phase ``four`` (4 ranks)
runs the failure scenarios (one rank raising in planning, writing or the
commit; sync and async; ``CheckpointManager``), the mismatch scenarios and the
saves that phase ``three`` (3 ranks) loads resharded.
Each scenario returns plain values that the pytest side asserts.
"""

from __future__ import annotations

import errno
import functools
import sys
import time
from pathlib import Path

import numpy as np

from worker_lib import init_worker, run_scenarios, sliced_rows

RANK, WORLD = init_worker()

import mindspore as ms  # noqa: E402  (after init_worker, which sets the device)

import hyper_parallel  # noqa: E402
import hyper_parallel.core.distributed_checkpoint as dcp  # noqa: E402
from hyper_parallel import DTensor, Layout  # noqa: E402

PHASE, BASE = sys.argv[1], Path(sys.argv[2])
STRATEGIES = BASE / "strategies"
FULL_W = np.arange(12 * 6, dtype=np.float32).reshape(12, 6)
FULL_B = np.linspace(-3, 3, 12, dtype=np.float32)
SAVE_LAYOUT = Layout((2, 2), (1, 0))  # rows over mesh dim 0, columns over mesh dim 1
SAVE_REPL = Layout((2, 2), (1, -1))  # rows over mesh dim 0, replicated over mesh dim 1
FAIL_RANK = 2


def _failure(fn) -> dict:
    """Run ``fn`` expecting a CheckpointError; describe it."""
    start = time.monotonic()
    try:
        fn()
    except dcp.CheckpointError as exc:
        return {"type": type(exc).__name__, "failed_ranks": list(getattr(exc, "failed_ranks", ())),
                "message": str(exc), "seconds": time.monotonic() - start}
    except Exception as exc:  # pylint: disable=broad-exception-caught
        return {"type": f"not a CheckpointError: {type(exc).__name__}", "message": str(exc),
                "failed_ranks": [], "seconds": time.monotonic() - start}
    return {"type": None, "failed_ranks": [], "message": "", "seconds": time.monotonic() - start}


class Boom(RuntimeError):
    """The injected failure."""


class PlanFailing(dcp.StandardSavePlanner):
    """Raises in build_local_plan on FAIL_RANK."""

    def build_local_plan(self):
        if RANK == FAIL_RANK:
            raise Boom(f"planning failed on rank {RANK} (injected)")
        return super().build_local_plan()


class WriteFailing(dcp.FileSystemWriter):
    """Fails in write_data on FAIL_RANK, or in the commit."""

    def __init__(self, path, *, where: str) -> None:
        super().__init__(path)
        self.where = where

    def write_data(self, plan, planner):
        if self.where == "write" and RANK == FAIL_RANK:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return super().write_data(plan, planner)

    def finish(self, metadata, results, **kwargs):
        if self.where == "commit":
            raise OSError(errno.EIO, "I/O error during commit (injected)")
        return super().finish(metadata, results, **kwargs)


def _state(value: float) -> dict:
    full = FULL_W + value
    return {"w": DTensor.from_global(ms.Tensor(full), SAVE_LAYOUT, rank=RANK),
            "b": ms.Tensor(FULL_B + value), "step": int(value)}


def _load_values(path: Path) -> dict:
    target = {"w": DTensor(ms.Parameter(ms.Tensor(np.zeros((6, 3), np.float32)), name="w"), SAVE_LAYOUT,
                           FULL_W.shape), "b": np.zeros(12, np.float32), "step": -1}
    dcp.load(target, checkpoint_id=path)
    local = target["w"].to_local().asnumpy()
    off = target["w"].global_offset
    base = local - FULL_W[off[0]:off[0] + 6, off[1]:off[1] + 3]
    return {"w": sorted(set(np.unique(base).tolist())), "b": sorted(set(np.unique(target["b"] - FULL_B).tolist())),
            "step": target["step"]}


def _failing_save(name: str, how: str, *, use_async: bool) -> dict:
    """Commit value 1 at the id, fail a save of value 2 there, then save value 3."""
    path = BASE / name
    dcp.save(_state(1.0), checkpoint_id=path)
    kwargs: dict = {"checkpoint_id": path}
    if how == "plan":
        kwargs["planner"] = PlanFailing()
    else:
        kwargs = {"storage_writer": WriteFailing(path, where=how)}
    if use_async:
        def run():
            dcp.async_save(_state(2.0), **kwargs).result(timeout=120)
            if how == "commit":  # the background commit's failure is shared by the next collective step
                _load_values(path)
    else:
        def run():
            dcp.save(_state(2.0), **kwargs)
    info = _failure(run)
    info["after_failure"] = _load_values(path)
    dcp.save(_state(3.0), checkpoint_id=path)
    info["next_save"] = _load_values(path)
    return info


#: One rank failing a save (plan, write on FAIL_RANK; the commit on the coordinator), sync and async.
FAILING_SAVES = {f"{mode}_{how}": functools.partial(_failing_save, f"{mode}_{how}", how, use_async=mode == "async")
                 for mode in ("sync", "async") for how in ("plan", "write", "commit")}


def _manager(use_async: bool) -> dict:
    root = BASE / f"manager_{use_async}"
    manager = dcp.CheckpointManager(root, async_save=use_async, max_to_keep=3)
    manager.save(1, _state(1.0))
    manager.wait()
    state = _state(2.0)
    if RANK == FAIL_RANK:
        state["bad"] = object()  # refused in planning on this rank only
    else:
        state["bad"] = 0

    def run():
        manager.save(2, state)
        manager.wait()
    info = _failure(run)
    info["steps_after_failure"] = manager.all_steps()
    info["after_failure"] = _load_values(root / "step_1") if (root / "step_1").exists() else None
    manager.save(3, _state(3.0))
    manager.wait()
    info["steps"] = manager.all_steps()
    target = {"w": DTensor(ms.Parameter(ms.Tensor(np.zeros((6, 3), np.float32)), name="w"), SAVE_LAYOUT,
                           FULL_W.shape), "b": np.zeros(12, np.float32), "step": -1}
    info["loaded_step"] = manager.load(target)
    info["loaded_value"] = target["step"]
    manager.close()
    return info


def manager_sync() -> dict:
    return _manager(False)


def manager_async() -> dict:
    return _manager(True)


def key_on_one_rank() -> dict:
    state = {"a": ms.Tensor(np.ones(4, np.float32))}
    if RANK == 1:
        state["extra"] = ms.Tensor(np.full(3, 5.0, np.float32))
    info = _failure(lambda: dcp.save(state, checkpoint_id=BASE / "key_one"))
    if info["type"] is None:
        meta = dcp.read_metadata(BASE / "key_one")
        info["keys"] = sorted(k for k in meta.state_dict_metadata)
        target = {"a": np.zeros(4, np.float32), "extra": np.zeros(3, np.float32)}
        dcp.load(target, checkpoint_id=BASE / "key_one")
        info["extra"] = target["extra"].tolist()
    return info


def shape_on_one_rank() -> dict:
    shape = (5,) if RANK == 3 else (4,)
    return _failure(lambda: dcp.save({"a": ms.Tensor(np.ones(shape, np.float32))}, checkpoint_id=BASE / "shape_one"))


def dtype_on_one_rank() -> dict:
    dtype = np.float16 if RANK == 3 else np.float32
    return _failure(lambda: dcp.save({"a": ms.Tensor(np.ones(4, dtype))}, checkpoint_id=BASE / "dtype_one"))


def dtensor_shape_on_one_rank() -> dict:
    full = np.zeros((12, 6) if RANK != 1 else (12, 8), np.float32)
    layout = Layout((4,), (0, -1))
    return _failure(lambda: dcp.save({"w": DTensor.from_global(ms.Tensor(full), layout, rank=RANK)},
                                     checkpoint_id=BASE / "dshape_one"))


def save_reshard() -> dict:
    """The DTensor save that phase three (and the no_dist load) reshard."""
    state = {"w": DTensor.from_global(ms.Tensor(FULL_W), SAVE_LAYOUT, rank=RANK),
             "r": DTensor.from_global(ms.Tensor(FULL_W * 2), SAVE_REPL, rank=RANK),
             "b": ms.Tensor(FULL_B)}
    dcp.save(state, checkpoint_id=BASE / "reshard")
    return True


def _strategy_state(world: int, zero: bool = False) -> tuple[ms.nn.Cell, str]:
    path = str(STRATEGIES / f"s{world}.ckpt")
    layouts = hyper_parallel.layouts_from_strategy(path, rank=RANK)
    w = DTensor.from_global(FULL_W, layouts["w"], rank=RANK).to_local()
    b = DTensor.from_global(FULL_B, layouts["b"], rank=RANK).to_local()
    w, b = np.asarray(w), np.asarray(b)
    if zero:
        w, b = np.zeros_like(w), np.zeros_like(b)
    return sliced_rows(w, b), path


def save_strategy() -> dict:
    net, path = _strategy_state(WORLD)
    hyper_parallel.save_checkpoint(net, str(BASE / "strategy"), strategy_file=path)
    return True


def _load_reshard() -> dict:
    layout = Layout((WORLD,), (0, -1))
    target = {"w": DTensor(ms.Parameter(ms.Tensor(np.zeros(layout.local_shape(FULL_W.shape), np.float32)),
                                        name="w"), layout, FULL_W.shape),
              "r": DTensor(ms.Parameter(ms.Tensor(np.zeros(layout.local_shape(FULL_W.shape), np.float32)),
                                        name="r"), layout, FULL_W.shape),
              "b": np.zeros(12, np.float32)}
    dcp.load(target, checkpoint_id=BASE / "reshard")
    out = {}
    for key, full in (("w", FULL_W), ("r", FULL_W * 2)):
        local = target[key].to_local().asnumpy()
        box = tuple(slice(o, o + s) for o, s in zip(target[key].global_offset, local.shape))
        out[key] = bool(np.array_equal(local, full[box]))
    out["b"] = bool(np.array_equal(target["b"], FULL_B))
    return out


def load_strategy() -> dict:
    net, path = _strategy_state(WORLD, zero=True)
    hyper_parallel.load_checkpoint(str(BASE / "strategy"), net, strategy_file=path)
    layouts = hyper_parallel.layouts_from_strategy(path, rank=RANK)
    return {"w": bool(np.array_equal(net.w.asnumpy(),
                                      np.asarray(DTensor.from_global(FULL_W, layouts["w"], rank=RANK).to_local()))),
            "b": bool(np.array_equal(net.b.asnumpy(),
                                      np.asarray(DTensor.from_global(FULL_B, layouts["b"], rank=RANK).to_local())))}


def _values_or_error(path):
    """What a load of ``path`` gives on this rank: its values, or the error's type and text."""
    try:
        return _load_values(path)
    except dcp.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"


def async_then_load() -> dict:
    """Async saves on all ranks, then at once a load of that id on all ranks (no result() first)."""
    path = BASE / "async_then_load"
    dcp.save(_state(1.0), checkpoint_id=path)
    handle = dcp.async_save(_state(4.0), checkpoint_id=path)
    info = {"loaded": _values_or_error(path)}
    handle.result(timeout=120)
    info["after"] = _load_values(path)
    # A fresh id: nothing committed there until the async save finishes.
    fresh = BASE / "async_then_load_fresh"
    handle = dcp.async_save(_state(5.0), checkpoint_id=fresh)
    info["fresh"] = _values_or_error(fresh)
    handle.result(timeout=120)
    info["fresh_after"] = _load_values(fresh)
    return info


class SlowWriter(dcp.FileSystemWriter):
    """Writes after a second on every rank: the async save still holds its id when the next save comes."""

    def write_data(self, plan, planner):
        time.sleep(1.0)
        return super().write_data(plan, planner)


def async_then_save() -> dict:
    """A save to the id this job's async save still writes: with collectives it finishes that save first."""
    path = BASE / "async_then_save"
    dcp.save(_state(1.0), checkpoint_id=path)
    handle = dcp.async_save(_state(4.0), storage_writer=SlowWriter(path))
    info = {"sync": _failure(lambda: dcp.save(_state(9.0), checkpoint_id=path))}
    info["first_step"] = _failure(lambda: handle.result(timeout=120))["type"]
    info["after_sync"] = _load_values(path)
    handle = dcp.async_save(_state(10.0), storage_writer=SlowWriter(path))
    dcp.async_save(_state(11.0), checkpoint_id=path).result(timeout=120)
    handle.result(timeout=120)
    info["after_async"] = _load_values(path)
    # Alone in a job of several ranks: the async save's result() is a step the other ranks may not reach now.
    handle = dcp.async_save(_state(12.0), storage_writer=SlowWriter(path))
    if RANK == 0:
        info["alone"] = _failure(lambda: dcp.save({"x": np.ones(2, np.float32)}, checkpoint_id=path, no_dist=True))
    info["local"] = _failure(lambda: dcp.save({"x": np.full(2, RANK, np.float32)}, checkpoint_id=path,
                                              use_collectives=False))
    handle.result(timeout=120)
    info["after_alone"] = _load_values(path)
    target = {"x": np.zeros(2, np.float32)}
    info["local_load"] = _failure(lambda: dcp.load(target, checkpoint_id=path, use_collectives=False))
    info["local_x"] = target["x"].tolist()
    return info


def two_async_other_order() -> dict:
    first = dcp.async_save(_state(6.0), checkpoint_id=BASE / "two_a")
    second = dcp.async_save(_state(7.0), checkpoint_id=BASE / "two_b")
    second.result(timeout=120)
    first.result(timeout=120)
    return {"a": _load_values(BASE / "two_a"), "b": _load_values(BASE / "two_b")}


def local_then_collective() -> dict:
    """Rank-local saves (per-rank values) loaded by a collective load, and by rank-local loads."""
    path = BASE / "local_saves"
    dcp.save({"mine": np.full(4, RANK, np.int32), "shared": np.ones(3, np.float32)}, checkpoint_id=path,
             use_collectives=False)
    hyper_parallel.platform.barrier()
    target = {"mine": np.full(4, -1, np.int32), "shared": np.zeros(3, np.float32)}
    info = {"collective": _failure(lambda: dcp.load(target, checkpoint_id=path))}
    info["collective_mine"] = target["mine"].tolist()
    target = {"mine": np.full(4, -1, np.int32), "shared": np.zeros(3, np.float32)}
    dcp.load(target, checkpoint_id=path, use_collectives=False)
    info["local_mine"] = target["mine"].tolist()
    info["sharded"] = _failure(lambda: dcp.save(_state(8.0), checkpoint_id=BASE / "local_sharded",
                                                use_collectives=False))
    return info


PHASES = {
    "four": [*FAILING_SAVES.values(), manager_sync, manager_async, key_on_one_rank, shape_on_one_rank,
             dtype_on_one_rank, dtensor_shape_on_one_rank, save_reshard, save_strategy, async_then_load,
             async_then_save, two_async_other_order, local_then_collective],
    "three": [_load_reshard, load_strategy],
}

NAMES = {fn: name for name, fn in FAILING_SAVES.items()}
run_scenarios({NAMES.get(fn) or fn.__name__.strip("_"): fn for fn in PHASES[PHASE]})
