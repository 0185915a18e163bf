"""A save repeating the previous layout reuses its plan; any change of a plan makes a new exchange."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _plan_cache
from hyper_parallel.core.distributed_checkpoint._plan_cache import STATS, clear_plan_cache


def _state(scale: float) -> dict:
    return {"w": ms.Parameter(ms.Tensor(np.full((4, 6), scale, np.float32)), name="w"),
            "b": ms.Parameter(ms.Tensor(np.full((6,), scale, np.float32), ms.bfloat16), name="b")}


def _counts() -> tuple[int, int]:
    return STATS.reused, STATS.exchanged


def _load(path) -> dict:
    target = _state(0.0)
    target["step"] = 0
    dcp.load(target, checkpoint_id=path, no_dist=True)
    return {"w": float(target["w"].asnumpy()[0, 0]), "b": float(target["b"].asnumpy().astype(np.float32)[0]),
            "step": target["step"]}


def test_repeated_layout_reuses_the_plan_and_saves_current_values(tmp_path):
    clear_plan_cache()
    start = _counts()
    state = _state(1.0)
    state["step"] = 7
    dcp.save(state, checkpoint_id=tmp_path / "a", no_dist=True)
    assert _counts() == (start[0], start[1] + 1)
    state["w"].asnumpy()[...] = 2.0  # new tensor values, same layout: the plan is reused
    dcp.save(state, checkpoint_id=tmp_path / "a", no_dist=True)
    assert _counts() == (start[0] + 1, start[1] + 1)
    assert _load(tmp_path / "a") == {"w": 2.0, "b": 1.0, "step": 7}
    dcp.save(state, checkpoint_id=tmp_path / "b", no_dist=True)  # another directory, same plan
    assert _counts() == (start[0] + 2, start[1] + 1)
    assert _load(tmp_path / "b") == {"w": 2.0, "b": 1.0, "step": 7}
    old = set(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    dcp.save(state, checkpoint_id=tmp_path / "a", no_dist=True)
    assert not old & set(p.name for p in (tmp_path / "a").glob("*.safetensors"))  # a new save id each time


def test_changed_value_shape_or_options_make_a_new_exchange(tmp_path):
    clear_plan_cache()
    state = _state(1.0)
    state["step"] = 1
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    reused, exchanged = _counts()
    state["step"] = 2  # a non-tensor value is part of the plan (its digest): replicas are checked again
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    assert _counts() == (reused, exchanged + 1)
    assert _load(tmp_path)["step"] == 2
    state["w"] = ms.Parameter(ms.Tensor(np.full((5, 6), 3.0, np.float32)), name="w")  # another shape
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    assert _counts() == (reused, exchanged + 2)
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True, remove_redundancy=False)  # other options
    assert _counts() == (reused, exchanged + 3)
    target = {"w": ms.Parameter(ms.Tensor(np.zeros((5, 6), np.float32)), name="w")}
    dcp.load(target, checkpoint_id=tmp_path, no_dist=True, planner=dcp.StandardLoadPlanner(allow_partial_load=True))
    assert float(target["w"].asnumpy()[4, 5]) == 3.0


def test_custom_planners_are_not_cached(tmp_path):
    class Planner(dcp.StandardSavePlanner):
        pass

    clear_plan_cache()
    before = _counts()
    for _ in range(2):
        dcp.save(_state(1.0), checkpoint_id=tmp_path, no_dist=True, planner=Planner())
    assert _counts() == before
    assert _plan_cache.plan_cache_for(dcp.FileSystemWriter(tmp_path), Planner(), None, rank=0, world_size=1) is None


def test_unhashable_options_are_not_cached(tmp_path):
    from hyper_parallel.core.distributed_checkpoint._plan_cache import plan_cache_for  # noqa: PLC0415

    assert plan_cache_for(dcp.FileSystemWriter(tmp_path), dcp.StandardSavePlanner(), {"layouts": {}},
                          rank=0, world_size=1) is None


def test_async_save_without_collectives_commits_in_the_background(tmp_path):
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415

    state = _state(4.0)
    handle = dcp.async_save(state, checkpoint_id=tmp_path / "a", no_dist=True)
    deadline = time.monotonic() + 60
    while not handle.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (tmp_path / "a" / "metadata.json").is_file()  # committed before result() is called
    assert handle.result().storage_meta.save_id == dcp.read_metadata(tmp_path / "a").storage_meta.save_id
    # A process that ends without result() leaves its last step committed.
    script = (
        "import numpy as np, mindspore as ms, hyper_parallel.core.distributed_checkpoint as dcp, os\n"
        "ms.set_device('CPU')\n"
        f"dcp.async_save({{'w': ms.Tensor(np.full((8, 8), 5.0, np.float32))}}, checkpoint_id={str(tmp_path / 'b')!r},"
        " no_dist=True)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    target = {"w": ms.Tensor(np.zeros((8, 8), np.float32))}
    dcp.load(target, checkpoint_id=tmp_path / "b", no_dist=True)
    assert float(target["w"].asnumpy()[7, 7]) == 5.0


def test_taking_an_exchange_this_rank_does_not_hold_is_refused():
    from hyper_parallel.core.distributed_checkpoint._plan_cache import PlanCache  # noqa: PLC0415

    clear_plan_cache()
    with pytest.raises(dcp.PlanValidationError, match="rank 3: the coordinator reuses the cached plan"):
        PlanCache((3, 4, None)).take("f00d")


def _sliced_net(fill: float):
    net = ms.nn.Cell()
    net.w = ms.Parameter(ms.Tensor(np.full((4, 6), fill, np.float32)), name="w")
    net.w.sliced = True
    return net


@pytest.mark.parametrize("form", ["list of per-stage files", "mapping of layouts"])
def test_a_strategy_given_as_a_list_or_mapping_reuses_the_plan(tmp_path, form):
    from hyper_parallel import Layout  # noqa: PLC0415
    from tests.strategy_files import ParamStrategy, write_strategy_file  # noqa: PLC0415

    clear_plan_cache()
    if form == "list of per-stage files":
        strategy = [write_strategy_file(tmp_path / "stage0.ckpt", (ParamStrategy("w", (1,), (0, -1)),))]
        changed = [write_strategy_file(tmp_path / "other.ckpt", (ParamStrategy("w", (1,), (-1, 0)),))]
    else:
        strategy = {"w": Layout((1,), (0, -1))}
        changed = {"w": Layout((1,), (-1, 0))}
    net = _sliced_net(1.0)
    dcp.save({"model": net}, checkpoint_id=tmp_path / "a", no_dist=True, strategy_file=strategy)
    reused, exchanged = _counts()
    net.w.set_data(ms.Tensor(np.full((4, 6), 2.0, np.float32)))
    # An equal strategy in a new list/dict object: the same plan, reused.
    again = list(strategy) if isinstance(strategy, list) else dict(strategy)
    dcp.save({"model": net}, checkpoint_id=tmp_path / "a", no_dist=True, strategy_file=again)
    assert _counts() == (reused + 1, exchanged)
    # Another strategy (the same shapes, another layout): the layout digest differs, so a new exchange.
    dcp.save({"model": net}, checkpoint_id=tmp_path / "b", no_dist=True, strategy_file=changed)
    assert _counts() == (reused + 1, exchanged + 1)
    for name, layout in (("a", again), ("b", changed)):
        target = _sliced_net(0.0)
        dcp.load({"model": target}, checkpoint_id=tmp_path / name, no_dist=True, strategy_file=layout)
        np.testing.assert_array_equal(target.w.asnumpy(), np.full((4, 6), 2.0, np.float32))


def test_a_cached_plan_names_every_chunk_whose_replicas_differ_now():
    """A reused plan (not in layout form) compares this save's replica digests by its cached groups: each chunk
    whose holders disagree is named with the ranks that agree, in one error; equal digests pass."""
    from hyper_parallel.core.distributed_checkpoint.planner import SavePlan  # pylint: disable=import-outside-toplevel

    keys = ((("w", (0,)), ("v", (0,))),) * 3
    cached = _plan_cache.CachedPlan(exchange="x", final=SavePlan(items=()), all_final=None, metadata=None,
                                    replica_keys=keys)

    def messages(*digests):
        return [_plan_cache.PlanMessage(local_digest="a", cached_exchange="", replica_digests=d) for d in digests]

    _plan_cache.check_cached_replicas(cached, messages(("1", "5"), ("1", "5"), ("1", "5")))
    with pytest.raises(dcp.PlanValidationError) as info:
        _plan_cache.check_cached_replicas(cached, messages(("1", "5"), ("1", "6"), ("2", "6")))
    advice = ("a tensor saved as replicated must be equal on every rank holding it: synchronise it, give it its "
              "layout (a DTensor or strategy_file=) if each rank holds a different part, or pass check_replicas=False "
              "to skip this check")
    assert str(info.value) == (
        "the global save plan is invalid (2 problem(s)):\n"
        f"  'w': replicas differ between ranks (ranks [0, 1]; ranks [2] each agree); {advice}\n"
        f"  'v': replicas differ between ranks (ranks [0]; ranks [1, 2] each agree); {advice}")
