"""Bad input to the API: every documented error case gives its documented type and names the problem.

Each case lists the error class, the builtin it must also be (so callers
can catch either), and words the message must hold: the key, the shapes,
the rank, the path.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout
from hyper_parallel.core.distributed_checkpoint.type_handlers import IntHandler
from sim_ranks import plan_ranks


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad_input") / "ckpt"
    dcp.save({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "v": 1, "n": np.arange(4, dtype=np.int64)},
             checkpoint_id=path, no_dist=True)
    return path


def _load(path: Path, state: dict[str, Any]) -> Callable[[], None]:
    return lambda: dcp.load(state, checkpoint_id=path, no_dist=True)


def _plan(states: list[dict[str, Any]]) -> Callable[[], Any]:
    """The coordinator's validation of the simulated ranks' plans."""
    def run() -> Any:
        planners, plans = plan_ranks(states)
        return planners[0].build_global_plan(plans)

    return run


def _sharded(full: np.ndarray, layout: Layout, rank: int) -> DTensor:
    return DTensor.from_global(ms.Tensor(full), layout, rank=rank)


# (name, make the call from the fixture path and tmp_path, error, builtin, words in the message)
CASES: list[tuple[str, Callable[[Path, Path], Callable[[], Any]], type, type | None, tuple[str, ...]]] = [
    ("missing_key", lambda c, t: _load(c, {"a": np.zeros((2, 3), np.float32), "zzz": np.zeros(1)}),
     dcp.MissingKeyError, KeyError, ("'zzz'", "allow_partial_load=True")),
    ("shape_mismatch", lambda c, t: _load(c, {"a": np.zeros((3, 2), np.float32)}),
     dcp.ShapeMismatchError, ValueError, ("'a'", "[2, 3]", "[3, 2]")),
    ("tensor_target_for_a_value", lambda c, t: _load(c, {"v": np.zeros(2)}),
     dcp.CheckpointValueError, ValueError, ("'v'", "stores a value")),
    ("dtype_differs_between_ranks", lambda c, t: _plan([{"a": np.ones(4, np.float32)}, {"a": np.ones(4, np.float16)}]),
     dcp.PlanValidationError, ValueError, ("'a'", "dtype differs", "float32 on ranks [0]", "float16 on ranks [1]")),
    ("global_shape_differs_between_ranks", lambda c, t: _plan([{"a": np.ones(4)}, {"a": np.ones(5)}]),
     dcp.PlanValidationError, ValueError, ("'a'", "[4] on ranks [0]", "[5] on ranks [1]")),
    ("value_differs_between_ranks", lambda c, t: _plan([{"step": 1}, {"step": 2}]),
     dcp.PlanValidationError, ValueError, ("'step'", "differs between ranks", "ShardedObject")),
    ("shards_leave_a_gap", lambda c, t: _plan([{"w": _sharded(np.ones((4, 4), np.float32), Layout((2,), (0, -1)), 0)}]),
     dcp.PlanValidationError, ValueError, ("'w'", "8 of 16")),
    ("unsupported_type", lambda c, t: lambda: dcp.save({"o": object()}, checkpoint_id=t / "x", no_dist=True),
     dcp.UnsupportedTypeError, TypeError, ("'o'", "builtins.object", "register_type_handler", "allow_pickle=True")),
    ("unsupported_dtype", lambda c, t: lambda: dcp.save({"c": np.ones(2, np.complex64)}, checkpoint_id=t / "x",
                                                        no_dist=True),
     dcp.UnsupportedTypeError, TypeError, ("'c'", "complex64")),
    ("unsupported_target_dtype", lambda c, t: _load(c, {"a": np.zeros((2, 3), np.complex64)}),
     dcp.UnsupportedTypeError, TypeError, ("'a'", "complex64")),
    ("read_only_target", lambda c, t: _load(c, {"a": np.broadcast_to(np.zeros(3, np.float32), (2, 3))}),
     dcp.CheckpointValueError, ValueError, ("'a'", "read-only")),
    ("layout_tensor_map_out_of_range", lambda c, t: lambda: Layout((2,), (1, -1)),
     dcp.LayoutError, ValueError, ("tensor_map entry 1", "[0, 1)")),
    ("layout_empty_mesh_dim", lambda c, t: lambda: Layout((0,), (0,)),
     dcp.LayoutError, ValueError, ("device_matrix", "(0,)")),
    ("layout_rank_list_length", lambda c, t: lambda: Layout((2,), (0,), rank_list=(0,)),
     dcp.LayoutError, ValueError, ("rank_list has 1", "2 positions")),
    ("layout_mesh_dim_twice", lambda c, t: lambda: Layout((2, 2), (0, 0)),
     dcp.LayoutError, ValueError, ("(0, 0)", "more than once")),
    ("layout_more_dims_than_tensor", lambda c, t: lambda: _sharded(np.ones(4, np.float32), Layout((2,), (0, -1)), 0),
     dcp.LayoutError, ValueError, ("1 dims", "(0, -1)")),
    ("rank_not_in_rank_list", lambda c, t: lambda: _sharded(np.ones((4, 4), np.float32), Layout((2,), (0, -1)), 5),
     dcp.LayoutError, ValueError, ("rank 5", "[0, 1]")),
    ("uneven_split", lambda c, t: lambda: _sharded(np.ones((5, 4), np.float32), Layout((2,), (0, -1)), 0),
     dcp.LayoutError, ValueError, ("size 5", "2 shards", "(5, 4)")),
    ("uneven_split_named", lambda c, t: lambda: Layout((2,), (0, -1)).local_shape((5, 4), "layer.w"),
     dcp.LayoutError, ValueError, ("'layer.w'", "size 5", "2 shards")),
    ("save_over_a_file", lambda c, t: (t / "file").write_text("x") and (
        lambda: dcp.save({"a": np.ones(1)}, checkpoint_id=t / "file", no_dist=True)),
     dcp.CheckpointExistsError, FileExistsError, ("file", "not a directory", "choose another checkpoint_id")),
    ("save_below_a_file", lambda c, t: (t / "file").write_text("x") and (
        lambda: dcp.save({"a": np.ones(1)}, checkpoint_id=t / "file" / "sub", no_dist=True)),
     dcp.CheckpointIOError, OSError, ("cannot create checkpoint directory", "Not a directory")),
    ("save_where_nothing_can_be_created", lambda c, t: lambda: dcp.save(
        {"a": np.ones(1)}, checkpoint_id="/proc/hp_ckpt_fault_test", no_dist=True),
     dcp.CheckpointIOError, OSError, ("cannot create checkpoint directory", "/proc/hp_ckpt_fault_test")),
    ("load_missing_checkpoint", lambda c, t: _load(t / "nope", {"a": np.zeros(1)}),
     dcp.CheckpointNotFoundError, FileNotFoundError, ("nope", "does not exist")),
    ("load_a_file", lambda c, t: (t / "file").write_text("x") and _load(t / "file", {"a": np.zeros(1)}),
     dcp.CheckpointValueError, ValueError, ("file", "not a directory")),
    ("load_uncommitted", lambda c, t: (t / "half").mkdir() or _load(t / "half", {"a": np.zeros(1)}),
     dcp.IncompleteCheckpointError, None, ("half", "no metadata.json", "did not commit")),
    ("state_dict_not_a_dict", lambda c, t: lambda: dcp.save([np.ones(1)], checkpoint_id=t / "x", no_dist=True),
     dcp.CheckpointValueError, ValueError, ("must be a dict", "list")),
    ("key_not_a_string", lambda c, t: lambda: dcp.save({1: np.ones(1)}, checkpoint_id=t / "x", no_dist=True),
     dcp.CheckpointValueError, ValueError, ("key 1", "str keys")),
    ("writer_thread_count", lambda c, t: lambda: dcp.FileSystemWriter(t / "x", thread_count=0),
     dcp.CheckpointValueError, ValueError, ("thread_count", "0")),
    ("reader_inflight_bound", lambda c, t: lambda: dcp.FileSystemReader(c, max_inflight_bytes=0),
     dcp.CheckpointValueError, ValueError, ("max_inflight_bytes",)),
    ("duplicate_type_handler", lambda c, t: lambda: dcp.register_type_handler(int, IntHandler()),
     dcp.CheckpointValueError, ValueError, ("builtins.int", "override=True")),
    ("manager_retention", lambda c, t: lambda: dcp.CheckpointManager(t, max_to_keep=0),
     dcp.CheckpointValueError, ValueError, ("max_to_keep", "0")),
    ("manager_step", lambda c, t: lambda: dcp.CheckpointManager(t).save(-1, {}),
     dcp.CheckpointValueError, ValueError, ("step", "-1")),
]

BAD_IDS = [None, "", "nosuchproto://bucket/ckpt", 123, b"/tmp/x"]
for _bad in BAD_IDS:
    _words = ("checkpoint_id",) if _bad is None else (repr(_bad), "not a filesystem path")
    if isinstance(_bad, str) and "://" in _bad:  # a URL: fsspec is asked and names the protocol
        _words = (repr(_bad), "Protocol not known: nosuchproto", "s3://bucket/prefix")
    for _name, _call in (
        ("save", lambda c, t, b=_bad: lambda: dcp.save({"a": np.ones(1)}, checkpoint_id=b, no_dist=True)),
        ("async_save", lambda c, t, b=_bad: lambda: dcp.async_save({"a": np.ones(1)}, checkpoint_id=b, no_dist=True)),
        ("load", lambda c, t, b=_bad: lambda: dcp.load({"a": np.ones(1)}, checkpoint_id=b, no_dist=True)),
        ("read_metadata", lambda c, t, b=_bad: lambda: dcp.read_metadata(b)),
    ):
        CASES.append((f"invalid_checkpoint_id_{_name}_{_bad!r}", _call, dcp.CheckpointValueError, ValueError, _words))


@pytest.mark.parametrize("name,make,error,builtin,words", CASES, ids=[c[0] for c in CASES])
def test_documented_error(ckpt: Path, tmp_path: Path, name: str, make: Callable, error: type,
                          builtin: type | None, words: tuple[str, ...]) -> None:
    call = make(ckpt, tmp_path)
    with pytest.raises(dcp.CheckpointError) as caught:
        call()
    assert isinstance(caught.value, error), f"{name}: {type(caught.value).__name__}: {caught.value}"
    if builtin is not None:
        assert isinstance(caught.value, builtin)
    text = str(caught.value)
    for word in words:
        assert word in text, f"{name}: {word!r} not in: {text}"


def test_dtype_of_the_target_is_kept(ckpt: Path) -> None:
    """Not an error: stored values are cast to the target's dtype (documented)."""
    target = {"a": np.zeros((2, 3), np.float64), "n": np.zeros(4, np.float32)}
    dcp.load(target, checkpoint_id=ckpt, no_dist=True)
    assert target["a"].dtype == np.float64 and np.array_equal(target["a"], np.arange(6).reshape(2, 3))
    assert target["n"].dtype == np.float32 and np.array_equal(target["n"], np.arange(4))
    bf16 = ms.Parameter(ms.Tensor(np.zeros((2, 3)), ms.bfloat16), name="a")
    dcp.load({"a": bf16}, checkpoint_id=ckpt, no_dist=True)
    assert bf16.dtype == ms.bfloat16 and np.array_equal(bf16.asnumpy().astype(np.float32), np.arange(6).reshape(2, 3))


def test_partial_load_is_the_documented_way_out(ckpt: Path) -> None:
    target = {"a": np.zeros((2, 3), np.float32), "zzz": np.full(2, 7.0)}
    dcp.load(target, checkpoint_id=ckpt, no_dist=True, planner=dcp.StandardLoadPlanner(allow_partial_load=True))
    assert np.array_equal(target["a"], np.arange(6).reshape(2, 3)) and np.array_equal(target["zzz"], [7.0, 7.0])


def test_async_result_timeout(tmp_path: Path) -> None:
    gate = threading.Event()

    class Held(dcp.FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            assert gate.wait(60)
            return super().write_data(plan, planner)

    handle = dcp.async_save({"a": np.ones(3)}, storage_writer=Held(tmp_path / "c"), no_dist=True)
    with pytest.raises(TimeoutError, match="still writing"):
        handle.result(timeout=0.01)
    gate.set()
    handle.result(timeout=60)
    assert np.array_equal(dcp.read_metadata(tmp_path / "c").state_dict_metadata["a"].size, (3,))


def test_uneven_split_of_a_parameter_names_it() -> None:
    param = ms.Parameter(ms.Tensor(np.ones((5, 4), np.float32)), name="layer.w")
    with pytest.raises(dcp.LayoutError, match="layer.w"):
        DTensor.from_global(param, Layout((2,), (0, -1)), rank=0)
