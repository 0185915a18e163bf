"""The read pass overlaps: large items are read on the I/O threads while the caller reads the small ones.

Every load is checked bit for bit against what was saved, with checksums on
and off and 1 to 3 reader threads; which thread read which item is recorded
by a planner that asks for every target; a failure on one side still waits
for the other side's reads before it is raised.
"""

from __future__ import annotations

import threading
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._read_items import SMALL_ITEM_BYTES


def _state(zero: bool = False) -> dict[str, object]:
    """Three large Parameters (over :data:`SMALL_ITEM_BYTES`, float32 and bf16) and 40 small ones."""
    rng = np.random.default_rng(3)
    state: dict[str, object] = {}
    for i, rows in enumerate((300, 613, 520)):
        values = rng.standard_normal((rows, 1024)).astype(np.float32)
        data = np.zeros_like(values) if zero else values
        state[f"big{i}.w"] = ms.Parameter(ms.Tensor(data, ms.bfloat16 if i == 1 else ms.float32), name=f"big{i}")
    for i in range(40):
        values = rng.standard_normal((i % 5 + 1, 16)).astype(np.float32)
        data = np.zeros_like(values) if zero else values
        state[f"small{i}.b"] = ms.Parameter(ms.Tensor(data, ms.float16 if i % 3 else ms.float32), name=f"s{i}")
    return state


def _bits(state: dict[str, object]) -> dict[str, bytes]:
    return {name: value.asnumpy().tobytes() for name, value in state.items()}


class _ThreadRecording(dcp.StandardLoadPlanner):
    """Asks for every target (no direct reads) and records the thread that asked."""

    def __init__(self, fail_on: str | None = None) -> None:
        super().__init__()
        self.threads: dict[str, str] = {}
        self.fail_on = fail_on

    def acquire_tensor(self, read_item, shared=True):
        self.threads[read_item.dest_index.fqn] = threading.current_thread().name
        if read_item.dest_index.fqn == self.fail_on:
            raise dcp.CheckpointValueError(f"refusing {self.fail_on}")
        return super().acquire_tensor(read_item, shared)


def test_the_state_has_large_and_small_items() -> None:
    sizes = {name: value.asnumpy().nbytes for name, value in _state().items()}
    assert sum(size > SMALL_ITEM_BYTES for size in sizes.values()) == 3
    assert sum(size <= SMALL_ITEM_BYTES for size in sizes.values()) == 40


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_items_are_read_on_io_threads_while_the_caller_reads_small_ones(tmp_path: Path, threads: int) -> None:
    saved = _state()
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=2), no_dist=True)
    for verify in (True, False):
        targets = _state(zero=True)
        planner = _ThreadRecording()
        dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path, thread_count=threads, verify_checksums=verify),
                 planner=planner, no_dist=True)
        assert _bits(targets) == _bits(saved)
        caller = threading.current_thread().name
        assert {name for name, thread in planner.threads.items() if thread != caller} == {"big0.w", "big1.w", "big2.w"}
        assert all(planner.threads[f"big{i}.w"].startswith("hp-ckpt-read") for i in range(3))


def test_the_direct_path_overlaps_bit_exact(tmp_path: Path) -> None:
    saved = _state()
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    for verify in (True, False):
        targets = _state(zero=True)
        dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path, verify_checksums=verify), no_dist=True)
        assert _bits(targets) == _bits(saved)


def test_a_failure_of_the_small_reads_waits_for_the_large_ones(tmp_path: Path) -> None:
    saved = _state()
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    targets = _state(zero=True)
    planner = _ThreadRecording(fail_on="small7.b")
    with pytest.raises(dcp.CheckpointValueError, match="refusing small7.b"):
        dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path, verify_checksums=False), planner=planner,
                 no_dist=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("hp-ckpt-read")]  # every read ended
    after, expected, zero = _bits(targets), _bits(saved), _bits(_state(zero=True))
    for i in range(3):  # a large read started ran to its end before the error was raised: never torn
        assert after[f"big{i}.w"] in (expected[f"big{i}.w"], zero[f"big{i}.w"])


def test_a_failure_of_a_large_read_is_raised_after_the_small_reads(tmp_path: Path) -> None:
    saved = _state()
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    targets = _state(zero=True)
    planner = _ThreadRecording(fail_on="big2.w")
    with pytest.raises(dcp.CheckpointValueError, match="refusing big2.w"):
        dcp.load(targets, storage_reader=dcp.FileSystemReader(tmp_path, verify_checksums=False), planner=planner,
                 no_dist=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("hp-ckpt-read")]
    after, expected = _bits(targets), _bits(saved)
    assert all(after[f"small{i}.b"] == expected[f"small{i}.b"] for i in range(40))
    assert after["big2.w"] == _bits(_state(zero=True))["big2.w"]  # the refused target is unchanged


def test_a_kept_reader_holds_no_per_load_records_after_a_load_and_loads_again(tmp_path: Path) -> None:
    import gc  # pylint: disable=import-outside-toplevel

    saved = _state()
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    reader = dcp.FileSystemReader(tmp_path, verify_checksums=False)
    for failing in (None, "small3.b", None):
        targets = _state(zero=True)
        planner = _ThreadRecording(fail_on=failing)
        if failing is None:
            dcp.load(targets, storage_reader=reader, planner=planner, no_dist=True)
            assert _bits(targets) == _bits(saved)  # the same reader loads again, bit exact
        else:
            with pytest.raises(dcp.CheckpointValueError):
                dcp.load(targets, storage_reader=reader, planner=planner, no_dist=True)
        # Dropped at the end, failed or not: the reader holds no read item, so the collector has none to walk.
        assert reader._items is None and not reader._headers and reader._grouped is None  # pylint: disable=protected-access
        assert not [o for o in gc.get_referents(*vars(reader).values()) if isinstance(o, dcp.ReadItem)]
        assert reader.metadata is not None and reader.bytes_read > 0
    with pytest.raises(dcp.CheckpointValueError, match="before set_up_storage_reader"):
        reader.read_data(dcp.LoadPlan(items=()), dcp.StandardLoadPlanner()).result()


def test_facts_of_a_file_list_are_kept_in_order_and_equal_the_per_item_facts(tmp_path: Path) -> None:
    from hyper_parallel.core.distributed_checkpoint._read_items import ItemIndex  # pylint: disable=import-outside-toplevel

    dcp.save(_state(), checkpoint_id=tmp_path, no_dist=True)
    metadata = dcp.FileSystemReader(tmp_path).read_metadata()
    planner = dcp.StandardLoadPlanner()
    planner.configure_planner(_state(zero=True), metadata)
    items = planner.build_local_plan().items
    index = ItemIndex(metadata)
    groups = index.by_file(items)
    assert groups and sum(map(len, groups.values())) == len(items)
    for group in groups.values():
        kept = index.facts_list(group)
        assert index.facts_list(group) is kept  # the by_file list: its facts, kept
        assert kept == [ItemIndex(metadata).facts(item) for item in group]  # equal to facts looked up afresh
        copy = list(group)
        assert index.facts_list(copy) == kept and index.facts_list(copy) is not kept  # another list: looked up
        assert {facts.info.relative_path for facts in kept} == {kept[0].info.relative_path}
    small = {item.dest_index.fqn for item in items if index.facts(item).small}
    assert small == {f"small{i}.b" for i in range(40)}
