"""Concurrency inside one job: saves side by side, loads during async saves, retention during loads.

Interleavings are forced with events (a writer or reader that waits at a
chosen point), never with sleeps, so every run checks the same schedule.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import hyper_parallel.core.distributed_checkpoint as dcp

from fault_common import assert_same_state, blank_like, load_into_blank, make_state

WAIT = 60  # seconds: a bound on every wait, never reached when the code is right


def run_at_once(*functions: Callable[[], Any]) -> list[Any]:
    """Run ``functions`` at once on their own threads; return each one's result or the exception it raised."""
    outcomes: list[Any] = [None] * len(functions)
    start = threading.Barrier(len(functions))

    def run(position: int, function: Callable[[], Any]) -> None:
        try:
            start.wait(WAIT)
            outcomes[position] = function()
        except BaseException as exc:  # pylint: disable=broad-except
            outcomes[position] = exc

    threads = [threading.Thread(target=run, args=pair) for pair in enumerate(functions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
        assert not thread.is_alive(), "a thread is stuck"
    return outcomes


def _run_threads(*functions: Callable[[], Any]) -> list[Any]:
    """Run ``functions`` at once; return their results, re-raise the first error."""
    outcomes = run_at_once(*functions)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes


class GatedWriter(dcp.FileSystemWriter):
    """Writes only once ``gate`` opens; sets ``writing`` when it is asked to."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.gate = threading.Event()
        self.writing = threading.Event()

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.writing.set()
        assert self.gate.wait(WAIT)
        return super().write_data(plan, planner)


class GatedReader(dcp.FileSystemReader):
    """Waits for ``gate`` once, at ``at``: ``"verify"``, before the verify pass opens any data file (the metadata
    is read, the plan made), or ``"read"``, after the verify pass opened and checked every data file."""

    def __init__(self, path: Path, at: str = "verify", **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.at = at
        self.gate = threading.Event()
        self.reading = threading.Event()

    def _wait(self, at: str) -> None:
        if self.at == at and not self.reading.is_set():
            self.reading.set()
            assert self.gate.wait(WAIT)

    def verify_data(self, plan: Any) -> Any:
        self._wait("verify")
        return super().verify_data(plan)

    def read_data(self, plan: Any, planner: Any) -> Any:
        self._wait("read")
        return super().read_data(plan, planner)


class PausingPlanner(dcp.StandardLoadPlanner):
    """Stops at the first tensor region handed to the reader (its data file is open by then)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.inside = threading.Event()

    def acquire_tensor(self, read_item: Any) -> np.ndarray:
        if not self.inside.is_set():
            self.inside.set()
            assert self.gate.wait(WAIT)
        return super().acquire_tensor(read_item)


# ------------------------------------------------------------------ saves side by side


@pytest.mark.parametrize("rounds", [4])
def test_two_saves_at_once_to_different_ids(tmp_path: Path, rounds: int) -> None:
    for rnd in range(rounds):
        paths = [tmp_path / f"r{rnd}_a", tmp_path / f"r{rnd}_b"]
        _run_threads(
            lambda: dcp.save(make_state(1), checkpoint_id=paths[0], no_dist=True),
            lambda: dcp.save(make_state(2), checkpoint_id=paths[1], no_dist=True),
        )
        assert_same_state(load_into_blank(paths[0], make_state(1)), make_state(1))
        assert_same_state(load_into_blank(paths[1], make_state(2)), make_state(2))


def test_save_while_an_async_save_writes(tmp_path: Path) -> None:
    writer = GatedWriter(tmp_path / "async")
    handle = dcp.async_save(make_state(1), storage_writer=writer, no_dist=True)
    assert writer.writing.wait(WAIT)
    dcp.save(make_state(2), checkpoint_id=tmp_path / "sync", no_dist=True)  # while the async one is held
    writer.gate.set()
    handle.result(timeout=WAIT)
    assert_same_state(load_into_blank(tmp_path / "async", make_state(1)), make_state(1))
    assert_same_state(load_into_blank(tmp_path / "sync", make_state(2)), make_state(2))


def test_two_async_saves_from_two_threads(tmp_path: Path) -> None:
    """A second thread's async save waits for the first one's staging; both commit their own values."""
    staging, resume = threading.Event(), threading.Event()

    class SlowStaging(dcp.StandardSavePlanner):
        def get_data(self, item: Any) -> Any:
            if not staging.is_set():
                staging.set()
                assert resume.wait(WAIT)
            return super().get_data(item)

    handles: dict[str, Any] = {}
    first = threading.Thread(target=lambda: handles.update(a=dcp.async_save(
        make_state(1), checkpoint_id=tmp_path / "A", no_dist=True, planner=SlowStaging())))
    first.start()
    assert staging.wait(WAIT)
    second = threading.Thread(target=lambda: handles.update(b=dcp.async_save(
        make_state(2), checkpoint_id=tmp_path / "B", no_dist=True)))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second async save must wait while the first one stages"
    resume.set()
    first.join(WAIT)
    second.join(WAIT)
    handles["b"].result(timeout=WAIT)
    handles["a"].result(timeout=WAIT)
    assert_same_state(load_into_blank(tmp_path / "A", make_state(1)), make_state(1))
    assert_same_state(load_into_blank(tmp_path / "B", make_state(2)), make_state(2))


# ------------------------------------------------------------------ loads during an async save


def _load_in_thread(path: Path, like: dict) -> tuple[threading.Thread, list[Any]]:
    """Start loading ``path`` into a blank copy of ``like`` in a thread; its outcome lands in the list."""
    outcome: list[Any] = []

    def load() -> None:
        try:
            outcome.append(load_into_blank(path, like))
        except BaseException as exc:  # pylint: disable=broad-except
            outcome.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    return thread, outcome


def test_load_while_an_async_save_to_another_id_is_in_flight(tmp_path: Path) -> None:
    """A load of another id does not wait for the async save; a load of its own id finishes it first and reads
    it (d0d4c08, 30184f4: a load right after async_save reads that save), instead of refusing it as uncommitted."""
    dcp.save(make_state(1), checkpoint_id=tmp_path / "A", no_dist=True)
    state = make_state(2)
    writer = GatedWriter(tmp_path / "B")
    handle = dcp.async_save(state, storage_writer=writer, no_dist=True)
    state["model"]["big"][:] = 0.0  # the checkpoint keeps the values at call time
    assert writer.writing.wait(WAIT)
    assert not handle.done()
    assert_same_state(load_into_blank(tmp_path / "A", make_state(1)), make_state(1))
    assert dcp.CheckpointManager(tmp_path).all_steps() == []  # (not a step layout: nothing listed)
    thread, outcome = _load_in_thread(tmp_path / "B", make_state(2))
    thread.join(0.5)
    assert thread.is_alive() and not outcome, "the load of B did not wait for B's async save"
    writer.gate.set()
    thread.join(WAIT)
    assert not thread.is_alive()
    assert_same_state(outcome[0], make_state(2))
    handle.result(timeout=WAIT)


def test_load_while_an_async_resave_of_the_same_id_is_in_flight(tmp_path: Path) -> None:
    """The load finishes this process's resave of the id first, then reads the new save, whole."""
    dcp.save(make_state(1), checkpoint_id=tmp_path / "A", no_dist=True)
    writer = GatedWriter(tmp_path / "A")
    handle = dcp.async_save(make_state(2), storage_writer=writer, no_dist=True)
    assert writer.writing.wait(WAIT)
    thread, outcome = _load_in_thread(tmp_path / "A", make_state(1))
    thread.join(0.5)
    assert thread.is_alive() and not outcome, "the load did not wait for the resave"
    writer.gate.set()
    thread.join(WAIT)
    assert not thread.is_alive()
    assert_same_state(outcome[0], make_state(2))
    handle.result(timeout=WAIT)
    assert_same_state(load_into_blank(tmp_path / "A", make_state(2)), make_state(2))


# ------------------------------------------------------------------ retention during a load


@pytest.mark.parametrize("at", ["verify", "read"])
def test_manager_deletes_the_step_a_load_is_about_to_read(tmp_path: Path, at: str) -> None:
    """The step is deleted between the load's planning and its verify pass: a clear error, never wrong values;
    between its verify pass and its read pass: the load completes with the verified bytes (the files stay open)."""
    trainer = dcp.CheckpointManager(tmp_path / "run", max_to_keep=1)
    trainer.save(1, make_state(1))
    evaluator = dcp.CheckpointManager(tmp_path / "run", max_to_keep=1)
    reader = GatedReader(evaluator.directory(1), at)
    target = blank_like(make_state(1))
    errors: list[BaseException] = []

    def load() -> None:
        try:
            evaluator.load(target, storage_reader=reader)
        except BaseException as exc:  # pylint: disable=broad-except
            errors.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    assert reader.reading.wait(WAIT)
    trainer.save(2, make_state(2))  # retention deletes step 1
    assert not evaluator.directory(1).exists()
    reader.gate.set()
    thread.join(WAIT)
    if at == "read":
        assert not errors, errors
        assert_same_state(target, make_state(1))
        return
    assert len(errors) == 1, "the load must fail: its checkpoint is gone"
    error = errors[0]
    assert isinstance(error, dcp.CheckpointNotFoundError), repr(error)
    assert str(evaluator.directory(1)) in str(error) and "deleted or replaced" in str(error)
    assert_same_state(load_into_blank(evaluator.directory(2), make_state(2)), make_state(2))


def test_manager_deletes_the_step_a_load_is_reading(tmp_path: Path) -> None:
    """The data file is open when the step is deleted: the load finishes with exact values."""
    trainer = dcp.CheckpointManager(tmp_path / "run", max_to_keep=1)
    trainer.save(1, make_state(1))
    evaluator = dcp.CheckpointManager(tmp_path / "run", max_to_keep=1)
    planner = PausingPlanner()
    target = blank_like(make_state(1))
    loaded: list[int] = []
    thread = threading.Thread(target=lambda: loaded.append(evaluator.load(target, planner=planner)))
    thread.start()
    assert planner.inside.wait(WAIT)
    trainer.save(2, make_state(2))
    assert not evaluator.directory(1).exists()
    planner.gate.set()
    thread.join(WAIT)
    assert loaded == [1]
    assert_same_state(target, make_state(1))


@pytest.mark.parametrize("at", ["verify", "read"])
def test_resave_replaces_the_checkpoint_a_load_is_about_to_read(tmp_path: Path, at: str) -> None:
    """As above, for a save to the same id that commits and then removes the previous save's data files."""
    dcp.save(make_state(1), checkpoint_id=tmp_path / "A", no_dist=True)
    reader = GatedReader(tmp_path / "A", at)
    target = blank_like(make_state(1))
    errors: list[BaseException] = []

    def load() -> None:
        try:
            dcp.load(target, storage_reader=reader, no_dist=True)
        except BaseException as exc:  # pylint: disable=broad-except
            errors.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    assert reader.reading.wait(WAIT)
    old_files = sorted((tmp_path / "A").glob("*.safetensors"))
    dcp.save(make_state(2), checkpoint_id=tmp_path / "A", no_dist=True)  # commits, then drops the old files
    assert old_files and not any(path.exists() for path in old_files)
    reader.gate.set()
    thread.join(WAIT)
    if at == "read":
        assert not errors, errors
        assert_same_state(target, make_state(1))
    else:
        assert len(errors) == 1 and isinstance(errors[0], dcp.CheckpointNotFoundError), errors
        assert "load it again" in str(errors[0])
    assert_same_state(load_into_blank(tmp_path / "A", make_state(2)), make_state(2))
