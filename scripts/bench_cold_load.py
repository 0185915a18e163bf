"""Where a cold ``dcp.load`` spends its time, and the device's own speed with as many streams as the reader.

Used by ``benchmark.py``'s load phase. A cold verified load is all or
nothing: it reads and hashes every byte it needs (the verify pass) before it
copies any into a target (the read pass, from the page cache). Its time is
therefore the planning before the verify pass, the verify pass (bound by the
device), the read pass (bound by memory) and what follows. :class:`TimedReader`
times those parts through the reader's public methods; :func:`read_streams`
reads the checkpoint's data files cold with one thread per file group, as the
reader's I/O threads do (the device's speed with that many streams, against
the benchmark's single-stream "cold sequential read").
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import hyper_parallel.core.distributed_checkpoint as dcp

__all__ = ["PARTS", "TimedReader", "read_streams"]

#: The parts of a load :meth:`TimedReader.parts` reports, in order.
PARTS = ("before the verify pass", "verify pass", "read pass", "after the read pass")

#: Bytes per read of :func:`read_streams` (as the benchmark's sequential read).
_CHUNK = 64 << 20


class TimedReader(dcp.FileSystemReader):
    """A filesystem reader that notes when its verify pass and its read pass start and end (same behaviour)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spans: dict[str, tuple[float, float]] = {}

    def verify_data(self, plan: Any) -> Any:
        start = time.perf_counter()
        future = super().verify_data(plan)
        self.spans.setdefault("verify", (start, time.perf_counter()))  # read_data's own call finds it done
        return future

    def read_data(self, plan: Any, planner: Any) -> Any:
        start = time.perf_counter()
        future = super().read_data(plan, planner)
        self.spans["read"] = (start, time.perf_counter())
        return future

    def parts(self, start: float, end: float) -> dict[str, float]:
        """Seconds of each of :data:`PARTS` of a load that ran from ``start`` to ``end`` (empty if not timed)."""
        if "verify" not in self.spans or "read" not in self.spans:
            return {}
        (verify_start, verify_end), (read_start, read_end) = self.spans["verify"], self.spans["read"]
        return dict(zip(PARTS, (verify_start - start, verify_end - verify_start, read_end - read_start,
                                end - read_end)))


def read_streams(files: list[Path], target: np.ndarray, streams: int) -> None:
    """Read ``files`` into ``target`` (at least their total size), the files dealt to ``streams`` threads."""
    places, offset = [], 0
    for path in files:
        size = path.stat().st_size
        places.append((path, offset, size))
        offset += size
    view = memoryview(target.reshape(-1).view(np.uint8))

    def read(mine: list[tuple[Path, int, int]]) -> None:
        for path, at, size in mine:
            fd = os.open(path, os.O_RDONLY)
            try:
                done = 0
                while done < size:
                    got = os.preadv(fd, [view[at + done:at + min(size, done + _CHUNK)]], done)
                    if got <= 0:
                        raise OSError(f"{path} ended at byte {done} of {size}")
                    done += got
            finally:
                os.close(fd)

    threads = [threading.Thread(target=read, args=(places[i::streams],)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
