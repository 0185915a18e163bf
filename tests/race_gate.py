"""Racing saves held open at a real point, so that they are sure to overlap.

Two saves to one checkpoint id started "at once" on threads may still run one
after the other (the first can commit before the second has begun), and a
test that counts clashes then fails by timing alone. Here each racing save
uses a real writer whose ``write_data`` waits at a :class:`Rendezvous` until
every other party is at that point too, or has already ended (a save that
failed at its set-up, because the first one holds the directory's lease,
never gets there). By then every save has done its set-up (taken the lease,
or noted the committed metadata its commit requires), so the saves overlap in
every run and exactly one of them can commit.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import hyper_parallel.core.distributed_checkpoint as dcp

__all__ = ["MeetingFileSystemWriter", "MeetingFsspecWriter", "Rendezvous"]

WAIT = 120.0  # seconds: a bound on every wait, never reached when the code is right


class Rendezvous:
    """A meeting point for ``parties`` racing saves (threads of one process)."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self._changed = threading.Condition()
        self._at_gate: set[int] = set()
        self._ended: set[int] = set()

    def meet(self, party: int) -> None:
        """Wait until every other party is here too or has ended."""
        with self._changed:
            self._at_gate.add(party)
            self._changed.notify_all()
            assert self._changed.wait_for(lambda: len(self._at_gate | self._ended) >= self.parties, WAIT), (
                f"party {party}: the other saves neither reached the gate nor ended"
            )

    def leave(self, party: int) -> None:
        """``party``'s save ended (committed or failed)."""
        with self._changed:
            self._ended.add(party)
            self._changed.notify_all()

    def met(self) -> int:
        """How many parties reached the gate."""
        with self._changed:
            return len(self._at_gate)

    def run(self, functions: dict[int, Callable[[], Any]]) -> dict[int, Any]:
        """Run each party's function on its own thread; return each one's result or the exception it raised."""
        assert len(functions) == self.parties
        outcomes: dict[int, Any] = {}

        def run(party: int, function: Callable[[], Any]) -> None:
            try:
                outcomes[party] = function()
            except BaseException as exc:  # pylint: disable=broad-except
                outcomes[party] = exc
            finally:
                self.leave(party)

        threads = [threading.Thread(target=run, args=pair) for pair in functions.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
            assert not thread.is_alive(), "a racing save is stuck"
        return outcomes


class _MeetBeforeWriting:
    """Mixin: ``write_data`` first waits at the rendezvous."""

    rendezvous: Rendezvous
    party: int

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.rendezvous.meet(self.party)
        return super().write_data(plan, planner)  # type: ignore[misc]


class MeetingFileSystemWriter(_MeetBeforeWriting, dcp.FileSystemWriter):
    """A real :class:`FileSystemWriter` that meets the other racing saves before writing."""

    def __init__(self, path: Path | str, *, rendezvous: Rendezvous, party: int, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.rendezvous, self.party = rendezvous, party


class MeetingFsspecWriter(_MeetBeforeWriting, dcp.FsspecWriter):
    """A real :class:`FsspecWriter` that meets the other racing saves before writing."""

    def __init__(self, path: str, *, rendezvous: Rendezvous, party: int, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.rendezvous, self.party = rendezvous, party
