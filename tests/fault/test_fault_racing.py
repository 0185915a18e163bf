"""Saves racing for one checkpoint id: one wins whole, the other fails naming the clash.

Races across processes (two Python processes started on one signal file),
threads, an async and a sync save in one process, and two
``CheckpointManager`` objects on one root. After every race the directory
loads bit-exact as the state of a save that reported success, passes
``hp-ckpt verify``, and keeps no file of the losing save; a checkpoint
committed before the race is never lost.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.cli.verify_cmd import verify_checkpoint

from fault_common import (
    assert_only_committed_files,
    assert_same_state,
    load_into_blank,
    make_state,
    same_state,
    start_script,
)
from race_gate import MeetingFileSystemWriter, Rendezvous
from test_fault_concurrency import GatedWriter

WAIT = 120
ROUNDS = 6


def _loads_as_one_of(path: Path, seeds: list[int]) -> int:
    """The seed whose state ``path`` loads as (bit-exact), after checking the directory."""
    loaded = load_into_blank(path, make_state(seeds[0]))
    matching = [seed for seed in seeds if same_state(loaded, make_state(seed))]
    assert matching, f"{path} loads as none of the states of seeds {seeds}"
    assert verify_checkpoint(path).ok
    assert_only_committed_files(path)
    return matching[0]


def _assert_one_won(outcomes: dict[int, Any], path: Path, *, ok: Callable[[Any], bool]) -> None:
    """Exactly one save won (``path`` loads as its state, whole) and the other failed naming the clash."""
    winners = [seed for seed, outcome in outcomes.items() if ok(outcome)]
    losers = [outcome for outcome in outcomes.values() if not ok(outcome)]
    assert len(winners) == 1 and len(losers) == 1, f"{path}: {outcomes}"
    _assert_clash(losers[0], path)
    assert _loads_as_one_of(path, winners) == winners[0]


def _assert_clash(error: BaseException | dict[str, Any], path: Path) -> None:
    """``error`` is the clash error: a ConcurrentSaveError naming the directory."""
    if isinstance(error, dict):
        kind, message, is_checkpoint_error = error["type"], error["message"], error["checkpoint_error"]
    else:
        kind, message, is_checkpoint_error = type(error).__name__, str(error), isinstance(error, dcp.CheckpointError)
    assert is_checkpoint_error and kind == "ConcurrentSaveError", f"{kind}: {message}"
    assert str(path) in message and "another save" in message, message


@pytest.mark.parametrize("over_committed", [False, True], ids=["fresh", "over_committed"])
def test_two_processes_race_for_one_id(tmp_path: Path, over_committed: bool) -> None:
    if over_committed:
        for rnd in range(ROUNDS):
            dcp.save(make_state(7), checkpoint_id=tmp_path / f"round{rnd}", no_dist=True)
    children = [start_script("race_child.py", str(tmp_path), str(seed), str(ROUNDS)) for seed in (1, 2)]
    try:
        for rnd in range(ROUNDS):
            deadline = time.monotonic() + WAIT
            while not all((tmp_path / f"ready.{rnd}.{seed}").exists() for seed in (1, 2)):
                assert time.monotonic() < deadline and all(c.poll() is None for c in children), "a child died"
                time.sleep(0.005)
            (tmp_path / f"go.{rnd}").touch()
        for child in children:
            _, err = child.communicate(timeout=WAIT)
            assert child.returncode == 0, err[-3000:]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    for rnd in range(ROUNDS):
        path = tmp_path / f"round{rnd}"
        outcomes = {seed: json.loads((tmp_path / f"result.{rnd}.{seed}.json").read_text()) for seed in (1, 2)}
        _assert_one_won(outcomes, path, ok=lambda outcome: outcome["ok"])


@pytest.mark.parametrize("over_committed", [False, True], ids=["fresh", "over_committed"])
def test_two_threads_race_for_one_id(tmp_path: Path, over_committed: bool) -> None:
    for rnd in range(ROUNDS):
        path = tmp_path / f"round{rnd}"
        if over_committed:
            dcp.save(make_state(7), checkpoint_id=path, no_dist=True)
        rendezvous = Rendezvous(2)
        outcomes = rendezvous.run({
            seed: lambda seed=seed: dcp.save(
                make_state(seed), no_dist=True,
                storage_writer=MeetingFileSystemWriter(path, rendezvous=rendezvous, party=seed))
            for seed in (1, 2)
        })
        _assert_one_won(outcomes, path, ok=lambda outcome: isinstance(outcome, dcp.Metadata))


@pytest.mark.parametrize("no_dist", [False, True])
@pytest.mark.parametrize("second", ["save", "async_save"])
def test_a_save_to_the_id_of_this_process_s_pending_async_save_finishes_it_first(
        tmp_path: Path, no_dist: bool, second: str) -> None:
    """A process alone saving to the id its own async save still writes finishes that save first (its result()
    needs no other rank), then replaces it, as a load of that id does. A sync save failed with
    ConcurrentSaveError, naming a clash with the caller's own save."""
    path = tmp_path / "ckpt"
    dcp.save(make_state(7), checkpoint_id=path, no_dist=no_dist)
    writer = GatedWriter(path)  # held in flight: one process commits in the background, which could win first
    handle = dcp.async_save(make_state(1), storage_writer=writer, no_dist=no_dist)
    assert writer.writing.wait(WAIT)
    opener = threading.Timer(0.5, writer.gate.set)
    opener.start()
    start = time.monotonic()
    if second == "save":
        dcp.save(make_state(2), checkpoint_id=path, no_dist=no_dist)
    else:
        dcp.async_save(make_state(2), checkpoint_id=path, no_dist=no_dist).result(timeout=WAIT)
    assert time.monotonic() - start >= 0.4  # it waited for the gated save, which committed first
    first = handle.result(timeout=WAIT)
    assert first.storage_meta.save_id != dcp.read_metadata(path).storage_meta.save_id
    assert _loads_as_one_of(path, [2, 1]) == 2


def test_two_managers_on_one_root_save_the_same_step(tmp_path: Path) -> None:
    managers = [dcp.CheckpointManager(tmp_path / "run", max_to_keep=2) for _ in range(2)]
    managers[0].save(1, make_state(7))
    for step in range(2, 2 + ROUNDS):
        rendezvous = Rendezvous(2)
        directory = managers[0].directory(step)
        outcomes = rendezvous.run({
            seed: lambda m=m, seed=seed, step=step: m.save(
                step, make_state(seed), force=True,
                storage_writer=MeetingFileSystemWriter(directory, rendezvous=rendezvous, party=seed))
            for m, seed in zip(managers, (1, 2))
        })
        _assert_one_won(outcomes, directory, ok=lambda outcome: outcome is True)
    assert managers[1].all_steps() == [2 + ROUNDS - 2, 2 + ROUNDS - 1]
