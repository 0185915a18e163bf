"""Racing saver: saves ``make_state(seed)`` to round ``r``'s directory once ``go.<r>`` appears.

Usage: ``race_child.py ROOT SEED ROUNDS``

Two of these run at once with different seeds. For each round the child
writes ``ready.<r>.<seed>``, waits for the test's ``go.<r>`` file, saves to
``ROOT/round<r>`` and writes ``result.<r>.<seed>.json``: ``{"ok": true}`` or
the error's type, message and whether it is a ``CheckpointError``. Starting
on a file that both children poll puts the two saves within a millisecond
of each other, and the writer holds them open until they overlap: before
writing data it writes ``writing.<r>.<seed>`` and waits until the other
child's ``writing`` or ``result`` file of the round exists (the other save
then has done its set-up, or has already failed).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import hyper_parallel.core.distributed_checkpoint as dcp

from fault_common import make_state


WAIT = 120.0


class MeetingWriter(dcp.FileSystemWriter):
    """A real writer that waits, before writing data, for the other child's save to get there too or end."""

    def __init__(self, path: pathlib.Path, *, root: pathlib.Path, rnd: int, seed: int, other: int) -> None:
        super().__init__(path)
        self.root, self.rnd, self.seed, self.other = root, rnd, seed, other

    def write_data(self, plan, planner):  # noqa: D102
        (self.root / f"writing.{self.rnd}.{self.seed}").touch()
        marks = [self.root / f"writing.{self.rnd}.{self.other}", self.root / f"result.{self.rnd}.{self.other}.json"]
        deadline = time.monotonic() + WAIT
        while not any(mark.exists() for mark in marks):
            if time.monotonic() > deadline:
                raise TimeoutError(f"round {self.rnd}: the other save neither wrote nor ended")
            time.sleep(0.0005)
        return super().write_data(plan, planner)


def main(argv: list[str]) -> int:
    root, seed, rounds = pathlib.Path(argv[1]), int(argv[2]), int(argv[3])
    other = 3 - seed
    state = make_state(seed)
    for rnd in range(rounds):
        (root / f"ready.{rnd}.{seed}").touch()
        deadline = time.monotonic() + 120
        while not (root / f"go.{rnd}").exists():
            if time.monotonic() > deadline:
                return 2
            time.sleep(0.0005)
        try:
            writer = MeetingWriter(root / f"round{rnd}", root=root, rnd=rnd, seed=seed, other=other)
            dcp.save(state, storage_writer=writer, no_dist=True)
            outcome = {"ok": True}
        except Exception as exc:  # pylint: disable=broad-except
            outcome = {"ok": False, "type": type(exc).__name__, "message": str(exc),
                       "checkpoint_error": isinstance(exc, dcp.CheckpointError)}
        partial = root / f"result.{rnd}.{seed}.json.partial"
        partial.write_text(json.dumps(outcome))
        partial.rename(root / f"result.{rnd}.{seed}.json")  # seen whole by the other child and the test
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
