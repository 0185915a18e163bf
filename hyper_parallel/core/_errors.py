"""The errors layouts and distributed tensors raise, below the checkpoint package.

:mod:`hyper_parallel.core.layout` and :mod:`hyper_parallel.core.dtensor` need
them without importing ``hyper_parallel.core.distributed_checkpoint``; that
package's :mod:`~hyper_parallel.core.distributed_checkpoint.errors` module
re-exports these very classes, so ``except dcp.LayoutError`` catches them.
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointValueError", "LayoutError", "StrategyFileError"]


class CheckpointError(Exception):
    """Base class of every error raised by the distributed checkpoint."""


class CheckpointValueError(CheckpointError, ValueError):
    """A bad argument or bad input value given by the caller."""


class LayoutError(CheckpointValueError):
    """A layout that cannot describe the given tensor or rank."""


class StrategyFileError(CheckpointValueError):
    """A MindSpore strategy file that is missing, empty, unreadable or self-contradicting."""
