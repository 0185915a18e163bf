"""The platform's device path (tensors whose memory numpy cannot alias), forced on CPU.

``HYPER_PARALLEL_DEVICE_COPIES=1`` makes every MindSpore tensor behave as an
Ascend tensor does: ``to_numpy`` copies it out, no writable view exists, and a
load copies regions in (``t[region] = v``). Values, identity and the host
memory bound of a load are checked as on the shared (CPU) path.
"""

from __future__ import annotations

import tracemalloc

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel import DTensor, Layout, platform

ms.set_device("CPU")


@pytest.fixture
def device_copies(monkeypatch):
    monkeypatch.setenv(platform.DEVICE_COPIES_ENV, "1")


def _param(array, name="w"):
    return ms.Parameter(ms.Tensor(array.copy()), name=name)


def test_forced_path_copies_out_and_offers_no_view(device_copies):
    param = _param(np.arange(6, dtype=np.float32))
    assert not platform.host_memory_shared(param)
    out = platform.to_numpy(param)
    assert not np.shares_memory(out, param.asnumpy())
    np.testing.assert_array_equal(out, np.arange(6))
    assert platform.writable_view(param) is None
    assert platform.host_memory_shared(np.zeros(2))


class _OnDevice:
    device = "Ascend:0"


def test_device_memory_by_the_tensor_device_and_numpy_regions():
    assert not platform.host_memory_shared(_OnDevice())
    target = np.zeros((3, 3), np.float32)
    platform.assign_region(target, (slice(0, 2), slice(1, 3)), np.ones((2, 2), np.float64))
    assert target.sum() == 4 and target[0, 0] == 0


def test_shared_path_without_the_switch():
    param = _param(np.arange(6, dtype=np.float32))
    assert platform.host_memory_shared(param)
    assert np.shares_memory(platform.to_numpy(param), param.asnumpy())


def test_save_copies_out_and_load_copies_in_resharded(tmp_path, device_copies):
    full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    rows = Layout((2,), (0, -1))
    states = [{"w": DTensor(_param(full[r * 4:(r + 1) * 4]), rows, full.shape, rank=r)} for r in range(2)]
    from sim_ranks import simulate_save

    simulate_save(states, tmp_path / "c")
    cols = Layout((2,), (-1, 0))
    for rank in range(2):
        target = _param(np.zeros((8, 3), np.float32))
        before = target.data_ptr()
        planner = dcp.StandardLoadPlanner(device_region_bytes=24)  # 2 rows of 3 float32 per region
        dcp.load({"w": DTensor(target, cols, full.shape, rank=rank)}, checkpoint_id=tmp_path / "c", no_dist=True,
                 planner=planner)
        np.testing.assert_array_equal(target.asnumpy(), full[:, rank * 3:(rank + 1) * 3])
        assert target.data_ptr() == before  # written in place, region by region


def test_bfloat16_and_scalar_targets(tmp_path, device_copies):
    state = {"b": ms.Tensor(np.arange(6, dtype=np.float32), ms.bfloat16), "s": _param(np.float32(2.5), "s"),
             "i": _param(np.arange(4, dtype=np.int64), "i")}
    dcp.save(state, checkpoint_id=tmp_path / "c", no_dist=True)
    target = {"b": _param(np.zeros(6, np.float32), "b"), "s": _param(np.float32(0), "s"),
              "i": _param(np.zeros(4, np.int64), "i")}
    target["b"].set_dtype(ms.bfloat16)
    dcp.load(target, checkpoint_id=tmp_path / "c", no_dist=True, planner=dcp.StandardLoadPlanner(device_region_bytes=4))
    np.testing.assert_array_equal(target["b"].float().asnumpy(), np.arange(6))
    assert float(target["s"].asnumpy()) == 2.5
    np.testing.assert_array_equal(target["i"].asnumpy(), np.arange(4))


@pytest.mark.parametrize("verify", [True, False])
def test_load_memory_stays_bounded(tmp_path, device_copies, verify):
    full = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB
    dcp.save({"w": full}, storage_writer=dcp.FileSystemWriter(tmp_path / "c", checksum_block_bytes=16 << 10),
             no_dist=True)
    target = _param(np.zeros((1024, 1024), np.float64))  # a cast as well
    reader = dcp.FileSystemReader(tmp_path / "c", verify_checksums=verify, max_inflight_bytes=64 << 10)
    planner = dcp.StandardLoadPlanner(device_region_bytes=64 << 10)
    tracemalloc.start()
    try:
        dcp.load({"w": target}, storage_reader=reader, planner=planner, no_dist=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(target.asnumpy(), full.astype(np.float64))
    assert peak < 1 << 20, f"peak {peak} bytes for an 8 MiB device target with 64 KiB regions"


def test_bad_region_size():
    with pytest.raises(dcp.CheckpointValueError, match="device_region_bytes"):
        dcp.StandardLoadPlanner(device_region_bytes=0)


@pytest.mark.parametrize("dtype", [ms.bfloat16, ms.float32])
def test_a_sliced_parameter_loaded_on_the_device_path_can_be_saved_again(tmp_path, device_copies, dtype):
    """A load that writes a Parameter through ``set_data`` keeps MindSpore's ``sliced`` mark: ``set_data``
    without ``slice_shape`` clears it, and a save under a strategy file then refused the Parameter as a whole
    tensor (the bfloat16 region write falls back to a whole assign on CPU; a staged target always takes it)."""
    from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import apply_mindspore_layouts
    from tests.strategy_files import ParamStrategy, write_strategy_file

    one = write_strategy_file(tmp_path / "one.ckpt", (ParamStrategy("w", (1,), (0, -1)),))
    two = write_strategy_file(tmp_path / "two.ckpt", (ParamStrategy("w", (2,), (0, -1)),))
    stored = ms.Tensor(np.arange(16, dtype=np.float32).reshape(4, 4), dtype)
    dcp.save({"w": ms.Parameter(stored, name="w")}, checkpoint_id=tmp_path / "c", no_dist=True)
    w = ms.Parameter(ms.Tensor(np.zeros((4, 4), np.float32), dtype), name="w")
    w.sliced = True  # this rank's [4, 4] slice of an [8, 4] tensor, as MindSpore's parallel compile marks it
    dcp.load({"w": w}, checkpoint_id=tmp_path / "c", no_dist=True, strategy_file=one)
    np.testing.assert_array_equal(w.float().asnumpy(), np.arange(16).reshape(4, 4))
    assert w.sliced
    state = apply_mindspore_layouts({"w": w}, source=two, rank=1)  # what the next save does on rank 1
    assert state["w"].shape == (8, 4) and state["w"].global_offset == (4, 0)
    whole = ms.Parameter(ms.Tensor(np.zeros((4, 4), np.float32), dtype), name="w")
    platform.assign(whole, np.ones((4, 4), np.float32))  # an unmarked Parameter stays unmarked
    assert not whole.sliced and float(whole.float().asnumpy().sum()) == 16
    platform.assign(w, np.full((4, 4), 2, np.float32))  # a staged target's whole assign, whatever the dtype
    assert w.sliced and float(w.float().asnumpy().sum()) == 32


_WHOLE_DTYPES = [ms.float32, ms.bfloat16, ms.float16, ms.int32, ms.int8, ms.bool_, ms.float64]


def test_whole_targets_are_copied_in_place(tmp_path, device_copies):
    """A target read as one region (a small tensor, the usual leaf) is copied into its own memory, bfloat16 too
    (MindSpore's CPU region write refuses bfloat16: it was assigned new memory)."""
    rng = np.random.default_rng(5)
    saved, targets = {}, {}
    for i, dtype in enumerate(_WHOLE_DTYPES * 2):
        values = rng.standard_normal((3, 4) if i % 3 else (7,)) * 30
        saved[f"k{i}"] = ms.Tensor(values, dtype)
        target = ms.Tensor(np.zeros_like(values), dtype)
        targets[f"k{i}"] = ms.Parameter(target, name=f"k{i}") if i % 2 else target
    dcp.save(saved, checkpoint_id=tmp_path / "c", no_dist=True)
    before = {key: (value, value.data_ptr()) for key, value in targets.items()}
    dcp.load(targets, checkpoint_id=tmp_path / "c", no_dist=True)
    for key, (value, pointer) in before.items():
        assert targets[key] is value and value.data_ptr() == pointer, key
        assert value.asnumpy().tobytes() == saved[key].asnumpy().tobytes(), key


class _NoCopy(ms.Tensor):
    """A tensor type without an in-place copy (as a framework may lack one)."""

    def copy_(self, *args, **kwargs):
        raise RuntimeError("no in-place copy")


class _NoStorage(ms.Tensor):
    """A tensor whose memory cannot be asked for (it might view another tensor's: no in-place copy into it)."""

    def storage_offset(self):
        raise RuntimeError("no storage")

    def copy_(self, *args, **kwargs):
        raise AssertionError("copy_ into a tensor that may be a view")


@pytest.mark.parametrize("kind", [_NoCopy, _NoStorage])
def test_a_whole_region_without_an_in_place_copy_is_written_the_other_way(tmp_path, device_copies, kind):
    dcp.save({"w": np.arange(6, dtype=np.float32)}, checkpoint_id=tmp_path / "c", no_dist=True)
    target = kind(np.zeros(6, np.float32))
    dcp.load({"w": target}, checkpoint_id=tmp_path / "c", no_dist=True)
    np.testing.assert_array_equal(target.asnumpy(), np.arange(6))


def test_bfloat16_regions_are_written_in_place_without_copying_the_whole_tensor(tmp_path, device_copies):
    """MindSpore's CPU region write refuses bfloat16: each region goes in through a uint16 view of the tensor's
    own memory (it copied the whole tensor out and back per region: 64 regions of a 4 MiB tensor moved 512 MiB)."""
    full = np.random.default_rng(3).standard_normal((1024, 2048)).astype(np.float32)
    dcp.save({"w": ms.Tensor(full, ms.bfloat16)}, storage_writer=dcp.FileSystemWriter(
        tmp_path / "c", checksum_block_bytes=16 << 10), no_dist=True)
    target = ms.Parameter(ms.Tensor(np.zeros((1024, 2048), np.float32), ms.bfloat16), name="w")
    pointer = target.data_ptr()
    reader = dcp.FileSystemReader(tmp_path / "c", max_inflight_bytes=64 << 10)
    tracemalloc.start()
    try:
        dcp.load({"w": target}, storage_reader=reader, planner=dcp.StandardLoadPlanner(device_region_bytes=64 << 10),
                 no_dist=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert target.data_ptr() == pointer  # written in place, not given new memory
    np.testing.assert_array_equal(target.float().asnumpy(), ms.Tensor(full, ms.bfloat16).float().asnumpy())
    assert peak < 1 << 20, f"peak {peak} bytes for a 4 MiB bfloat16 device target with 64 KiB regions"


class _NoView(ms.Tensor):
    """A tensor without a dtype view of its memory (as a framework may lack one)."""

    def view(self, *args, **kwargs):
        raise RuntimeError("no view")


class _CopiedView(ms.Tensor):
    """A tensor whose dtype view is a copy, not an alias: writing into it would change nothing."""

    def view(self, *args, **kwargs):
        return ms.Tensor(self.asnumpy().copy(), self.dtype).view(*args, **kwargs)


@pytest.mark.parametrize("kind", [_NoView, _CopiedView])
def test_a_bfloat16_region_without_an_alias_view_is_patched_into_the_whole_tensor(device_copies, kind):
    target = kind(np.zeros((4, 4), np.float32), ms.bfloat16)
    platform.assign_region(target, (slice(1, 3), slice(0, 2)), np.full((2, 2), 3, np.float32))
    expected = np.zeros((4, 4), np.float32)
    expected[1:3, :2] = 3
    np.testing.assert_array_equal(target.float().asnumpy(), expected)
