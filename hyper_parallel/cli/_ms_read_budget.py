"""How much of a MindSpore file an import announces to the kernel: the read-ahead window and a budget of memory.

:class:`~hyper_parallel.cli._ms_files.MsFile` announces the contents it maps
(``MADV_WILLNEED``) one read-ahead window (:func:`read_ahead_window`) per
call, so the device reads them at once, exactly. The writer asks for each
tensor only when its turn comes (just before it hashes and writes it), so
what is announced is used soon after; the bytes announced over a whole
import are still bounded by a :class:`ReadBudget` (a quarter of the
available memory, spent and never given back).
"""

from __future__ import annotations

import functools
import os

__all__ = ["ReadBudget", "read_ahead_window"]


def _available_memory() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (0 where unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


@functools.lru_cache(maxsize=None)
def read_ahead_window(device: int) -> int | None:
    """Bytes the kernel reads ahead in a file on ``device`` (an ``st_dev``), or None where unknown.

    The ``read_ahead_kb`` of the device's backing device (``/sys/dev/block``,
    the whole disk for a partition, or ``/sys/class/bdi``).
    """
    name = f"{os.major(device)}:{os.minor(device)}"
    for path in (f"/sys/dev/block/{name}/bdi/read_ahead_kb", f"/sys/dev/block/{name}/../bdi/read_ahead_kb",
                 f"/sys/class/bdi/{name}/read_ahead_kb"):
        try:
            with open(path, encoding="ascii") as handle:
                return int(handle.read()) * 1024
        except (OSError, ValueError):
            continue
    return None


class ReadBudget:
    """Bytes an import may announce to the kernel before the writer uses them. Single process.

    Announced bytes (``MADV_WILLNEED``) are read at once, exactly. The writer
    asks for each tensor only when its turn comes, just before it hashes and
    writes it; the budget bounds what one import announces in all (it is
    spent, never given back), so pages announced cannot outgrow memory.

    Args:
        nbytes: The budget.
    """

    def __init__(self, nbytes: int) -> None:
        self.left = nbytes

    @classmethod
    def of_memory(cls) -> "ReadBudget":
        """A quarter of the available memory."""
        return cls(_available_memory() // 4)

    def take(self, nbytes: int) -> bool:
        """Spend ``nbytes`` if they are left; return whether they were."""
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True
