"""Racing saver: saves ``make_state(seed)`` to round ``r``'s directory once ``go.<r>`` appears.

Usage: ``race_child.py ROOT SEED ROUNDS``

Two of these run at once with different seeds. For each round the child
writes ``ready.<r>.<seed>``, waits for the test's ``go.<r>`` file, saves to
``ROOT/round<r>`` and writes ``result.<r>.<seed>.json``: ``{"ok": true}`` or
the error's type, message and whether it is a ``CheckpointError``. Starting
on a file that both children poll puts the two saves within a millisecond
of each other.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import hyper_parallel.core.distributed_checkpoint as dcp

from fault_common import make_state


def main(argv: list[str]) -> int:
    root, seed, rounds = pathlib.Path(argv[1]), int(argv[2]), int(argv[3])
    state = make_state(seed)
    for rnd in range(rounds):
        (root / f"ready.{rnd}.{seed}").touch()
        deadline = time.monotonic() + 120
        while not (root / f"go.{rnd}").exists():
            if time.monotonic() > deadline:
                return 2
            time.sleep(0.0005)
        try:
            dcp.save(state, checkpoint_id=root / f"round{rnd}", no_dist=True)
            outcome = {"ok": True}
        except Exception as exc:  # pylint: disable=broad-except
            outcome = {"ok": False, "type": type(exc).__name__, "message": str(exc),
                       "checkpoint_error": isinstance(exc, dcp.CheckpointError)}
        (root / f"result.{rnd}.{seed}.json").write_text(json.dumps(outcome))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
