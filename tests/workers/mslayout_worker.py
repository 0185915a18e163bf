"""msrun worker: Parameters sliced the way MindSpore slices them, saved and loaded with strategy files.

Usage: ``mslayout_worker.py PHASE BASE_DIR`` with the strategy files written
by tests/test_mindspore_parallel.py under ``BASE_DIR/strategies``. Phase
``two`` (2 ranks) saves; phase ``four`` (4 ranks) loads into other strategies
(another world size, another split, 2 pipeline stages) and saves again.
Every Parameter holds the rank's slice of a known full tensor, cut here by
hand with numpy slicing (not with the code under test).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from worker_lib import init_worker, run_scenarios

RANK, WORLD = init_worker()

import mindspore as ms  # noqa: E402  (after init_worker, which sets the device)

import hyper_parallel  # noqa: E402
import hyper_parallel.core.distributed_checkpoint as dcp  # noqa: E402

PHASE, BASE = sys.argv[1], Path(sys.argv[2])
STRATEGIES = BASE / "strategies"
W = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
B = np.linspace(-1, 1, 4).astype(np.float32)
M1, M2 = W * 10, W * 100  # Adam's moment1.w / moment2.w


class Net(ms.nn.Cell):
    """A network holding ``w`` and/or ``b`` as this rank's slices."""

    def __init__(self, w: np.ndarray | None, b: np.ndarray | None) -> None:
        super().__init__()
        if w is not None:
            self.w = ms.Parameter(ms.Tensor(w.copy()), name="w")
            self.w.sliced = True
        if b is not None:
            self.b = ms.Parameter(ms.Tensor(b.copy()), name="b")


def _with_adam(net: Net, m1: np.ndarray, m2: np.ndarray) -> dict:
    opt = ms.nn.Adam(net.trainable_params())
    opt.moment1[0].set_data(ms.Tensor(m1.copy()))
    opt.moment2[0].set_data(ms.Tensor(m2.copy()))
    return {"model": net, "optim": opt}


def _error(fn) -> dict:
    try:
        fn()
    except dcp.CheckpointError as exc:
        return {"type": type(exc).__name__, "message": str(exc),
                "is_sliced_error": isinstance(exc, dcp.SlicedParameterError),
                "is_validation": isinstance(exc, dcp.PlanValidationError)}
    return {"type": None}


def _full(path: Path) -> dict:
    loaded = hyper_parallel.load_checkpoint(str(path))
    return {k: v.asnumpy() for k, v in loaded.items() if hasattr(v, "asnumpy")}


def _rows(array: np.ndarray, parts: int, index: int) -> np.ndarray:
    step = array.shape[0] // parts
    return array[index * step:(index + 1) * step]


# ---------------------------------------------------------------- phase two (2 ranks)
# strategy "a": dev (2,), w rows split, b replicated.

def silent_loss_refused() -> dict:
    net = Net(_rows(W, 2, RANK), B)
    return {"dcp": _error(lambda: dcp.save({"model": net}, checkpoint_id=BASE / "loss")),
            "one_line": _error(lambda: hyper_parallel.save_checkpoint(net, str(BASE / "loss1"))),
            "committed": (BASE / "loss" / "metadata.json").exists()}


def save_with_strategy() -> dict:
    state = _with_adam(Net(_rows(W, 2, RANK), B), _rows(M1, 2, RANK), _rows(M2, 2, RANK))
    hyper_parallel.save_checkpoint(state, str(BASE / "a"), strategy_file=str(STRATEGIES / "a.ckpt"))
    full = _full(BASE / "a")
    return {"w": np.array_equal(full["w"], W), "b": np.array_equal(full["b"], B),
            "m1": np.array_equal(full["moment1.w"], M1), "m2": np.array_equal(full["moment2.w"], M2),
            "keys": sorted(full)}


def layout_dict_by_itself() -> dict:
    net = Net(W[:, RANK * 2:(RANK + 1) * 2], None)  # columns split, as the layout dict says
    net.parameter_layout_dict = {"w": [[2], [-1, 0], [8, 2], 0, True, "", [8, 4], [8, 2]]}
    dcp.save({"model": net}, checkpoint_id=BASE / "dict")
    target = Net(np.zeros((8, 2), np.float32), None)
    target.parameter_layout_dict = {"w": [[2], [-1, 0], [8, 2], 0, True, "", [8, 4], [8, 2]]}
    dcp.load({"model": target}, checkpoint_id=BASE / "dict")
    return {"full": np.array_equal(_full(BASE / "dict")["model.w"], W),
            "back": np.array_equal(target.w.asnumpy(), W[:, RANK * 2:(RANK + 1) * 2])}


def async_with_strategy() -> dict:
    net = Net(_rows(W, 2, RANK), B)
    handle = dcp.async_save({"model": net}, checkpoint_id=BASE / "async", strategy_file=str(STRATEGIES / "a.ckpt"))
    net.w.set_data(ms.Tensor(np.zeros((4, 4), np.float32)))  # after staging: not in the checkpoint
    handle.result()
    return {"w": np.array_equal(_full(BASE / "async")["model.w"], W)}


def replicas_diverge() -> dict:
    def state():
        return {"r": ms.Tensor(np.full(3, RANK, np.float32)), "same": ms.Tensor(B)}
    failed = _error(lambda: dcp.save(state(), checkpoint_id=BASE / "div"))
    dcp.save(state(), checkpoint_id=BASE / "div_off", check_replicas=False)
    return {"failed": failed, "off_committed": (BASE / "div_off" / "metadata.json").is_file(),
            "committed": (BASE / "div" / "metadata.json").is_file()}


def reused_plan_still_checks_replicas() -> dict:
    from hyper_parallel.core.distributed_checkpoint._plan_cache import STATS

    split = hyper_parallel.Layout((2,), (0, -1))
    state = {"r": ms.Tensor(np.ones(4, np.float32)),
             "s": hyper_parallel.DTensor(ms.Tensor(_rows(W, 2, RANK).copy()), split, W.shape)}
    dcp.save(state, checkpoint_id=BASE / "reuse")
    before = STATS.reused
    state["r"] = ms.Tensor(np.full(4, 2, np.float32))  # new values, equal on both ranks: plan reused
    dcp.save(state, checkpoint_id=BASE / "reuse")
    reused = STATS.reused - before
    state["r"] = ms.Tensor(np.full(4, 3 + RANK, np.float32))  # diverging replicas, same layout
    failed = _error(lambda: dcp.save(state, checkpoint_id=BASE / "reuse"))
    return {"reused": reused, "reused_on_divergence": STATS.reused - before - reused, "failed": failed,
            "kept": float(_full(BASE / "reuse")["r"][0])}


# ---------------------------------------------------------------- phase four (4 ranks)
# strategy "b": dev (2, 2), w rows over mesh dim 0, columns over mesh dim 1; b split over mesh dim 0.
# strategy "pp": 2 stages of 2 ranks; stage 0 holds w (optimizer parallel over both ranks), stage 1 holds b.
# strategy "c": dev (4,), w columns over all 4 ranks.

def load_other_split_and_size() -> dict:
    row, col = RANK // 2, RANK % 2
    state = _with_adam(Net(np.zeros((4, 2), np.float32), np.zeros(2, np.float32)),
                       np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32))
    state["model"].b.sliced = True
    loaded = hyper_parallel.load_checkpoint(str(BASE / "a"), state, strategy_file=str(STRATEGIES / "b.ckpt"))
    box = (slice(row * 4, row * 4 + 4), slice(col * 2, col * 2 + 2))
    opt = state["optim"]
    return {"w": np.array_equal(state["model"].w.asnumpy(), W[box]),
            "b": np.array_equal(state["model"].b.asnumpy(), B[row * 2:row * 2 + 2]),
            "m1": np.array_equal(opt.moment1[0].asnumpy(), M1[box]),
            "m2": np.array_equal(opt.moment2[0].asnumpy(), M2[box]),
            "returned_is_param": loaded["w"] is state["model"].w}


def device_copies_with_shared_reads() -> dict:
    """The device path (forced on CPU) under real collectives, regions read once and sent to the others."""
    row, col = RANK // 2, RANK % 2
    net = Net(np.zeros((4, 2), np.float32), np.zeros(2, np.float32))
    net.b.sliced = True  # b.ckpt splits b too: this rank's slice, as MindSpore would mark it
    os.environ["HYPER_PARALLEL_DEVICE_COPIES"] = "1"
    try:
        planner = dcp.StandardLoadPlanner(single_replica_read=True, device_region_bytes=16, allow_partial_load=True)
        hyper_parallel.load_checkpoint(str(BASE / "a"), net, strategy_file=str(STRATEGIES / "b.ckpt"),
                                       planner=planner, allow_partial_load=True)
    finally:
        del os.environ["HYPER_PARALLEL_DEVICE_COPIES"]
    return {"w": np.array_equal(net.w.asnumpy(), W[row * 4:row * 4 + 4, col * 2:col * 2 + 2]),
            "b": np.array_equal(net.b.asnumpy(), B[row * 2:row * 2 + 2])}


def _stage_state() -> dict:
    if RANK < 2:  # stage 0: w split by optimizer parallel: rank 0 rows 0:4, rank 1 rows 4:8
        return _with_adam(Net(np.zeros((4, 4), np.float32), None),
                          np.zeros((4, 4), np.float32), np.zeros((4, 4), np.float32))
    net = Net(None, np.zeros(2, np.float32))  # stage 1: b split over its 2 ranks
    net.b.sliced = True
    return {"model": net}


def _check_stage(state: dict) -> dict:
    if RANK < 2:
        rows = slice(RANK * 4, RANK * 4 + 4)
        return {"w": np.array_equal(state["model"].w.asnumpy(), W[rows]),
                "m1": np.array_equal(state["optim"].moment1[0].asnumpy(), M1[rows])}
    return {"b": np.array_equal(state["model"].b.asnumpy(), B[(RANK - 2) * 2:(RANK - 2) * 2 + 2])}


def load_into_pipeline_stages() -> dict:
    state = _stage_state()
    files = [str(STRATEGIES / "pp_stage0.ckpt"), str(STRATEGIES / "pp_stage1.ckpt")]
    hyper_parallel.load_checkpoint(str(BASE / "a"), state, strategy_file=files)
    return _check_stage(state)


def save_from_pipeline_then_load_elsewhere() -> dict:
    state = _stage_state()
    files = [str(STRATEGIES / "pp_stage0.ckpt"), str(STRATEGIES / "pp_stage1.ckpt")]
    hyper_parallel.load_checkpoint(str(BASE / "a"), state, strategy_file=files)
    hyper_parallel.save_checkpoint(state, str(BASE / "pp"), strategy_file=files)
    full = _full(BASE / "pp")
    target = _with_adam(Net(np.zeros((8, 1), np.float32), None),
                        np.zeros((8, 1), np.float32), np.zeros((8, 1), np.float32))
    hyper_parallel.load_checkpoint(str(BASE / "pp"), target, strategy_file=str(STRATEGIES / "c.ckpt"))
    cols = slice(RANK, RANK + 1)
    return {"w": np.array_equal(full["w"], W), "b": np.array_equal(full["b"], B),
            "m1": np.array_equal(full["moment1.w"], M1),
            "c_w": np.array_equal(target["model"].w.asnumpy(), W[:, cols]),
            "c_m1": np.array_equal(target["optim"].moment1[0].asnumpy(), M1[:, cols])}


PHASES = {
    "two": {
        "silent_loss_refused": silent_loss_refused,
        "save_with_strategy": save_with_strategy,
        "layout_dict_by_itself": layout_dict_by_itself,
        "async_with_strategy": async_with_strategy,
        "replicas_diverge": replicas_diverge,
        "reused_plan_still_checks_replicas": reused_plan_still_checks_replicas,
    },
    "four": {
        "load_other_split_and_size": load_other_split_and_size,
        "device_copies_with_shared_reads": device_copies_with_shared_reads,
        "load_into_pipeline_stages": load_into_pipeline_stages,
        "save_from_pipeline_then_load_elsewhere": save_from_pipeline_then_load_elsewhere,
    },
}

run_scenarios(PHASES[PHASE])
