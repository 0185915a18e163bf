"""Every error the distributed checkpoint raises.

All errors derive from :class:`CheckpointError`. Where a builtin exception fits
as well, the error also derives from it, so callers can catch either: a missing
checkpoint is a ``FileNotFoundError``, a bad argument a ``ValueError``.

The classes a layout needs (:class:`CheckpointError`, :class:`StrategyFileError`,
:class:`CheckpointValueError`, :class:`LayoutError`) are defined below this
package, in :mod:`hyper_parallel.core._errors`, so ``hyper_parallel.core.layout``
imports them without importing the checkpoint package; they are re-exported
here unchanged (same classes). Every other module imports errors from here.
"""

from __future__ import annotations

from hyper_parallel.core._errors import CheckpointError, CheckpointValueError, LayoutError, StrategyFileError

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "CheckpointValueError",
    "LayoutError",
    "StrategyFileError",
    "SlicedParameterError",
    "MissingKeyError",
    "ShapeMismatchError",
    "PlanValidationError",
    "UnsupportedTypeError",
    "UnsupportedFormatError",
    "CollectiveStepError",
    "CollectiveTimeoutError",
    "CheckpointExistsError",
    "CheckpointIOError",
    "ConcurrentSaveError",
]


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory (or a file it references) does not exist."""

    def __str__(self) -> str:  # FileNotFoundError formats (errno, strerror) pairs
        return str(self.args[0]) if self.args else ""


class IncompleteCheckpointError(CheckpointError):
    """The directory exists but holds no committed metadata.

    A save that crashed, or one still running, leaves such a directory.
    """


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match their checksum, or a file is malformed."""


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint asks for something refused for safety.

    Examples: a path leaving the checkpoint directory, an absurd size, or a
    pickled object when the caller did not pass ``allow_pickle=True``.
    """




class MissingKeyError(CheckpointError, KeyError):
    """A key requested by the load is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SlicedParameterError(CheckpointValueError):
    """A Parameter MindSpore sliced (``Parameter.sliced``) whose layout is unknown or does not fit it."""


class ShapeMismatchError(CheckpointValueError):
    """The target's global shape differs from the stored one."""


class PlanValidationError(CheckpointValueError):
    """The global save plan is inconsistent across ranks (all problems listed)."""


class UnsupportedTypeError(CheckpointValueError, TypeError):
    """A value of a type with no registered handler (and pickle not allowed)."""


class UnsupportedFormatError(CheckpointError):
    """The checkpoint was written by a backend or format version not supported."""


class CheckpointExistsError(CheckpointValueError, FileExistsError):
    """The checkpoint id points at something that is not a checkpoint directory."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CollectiveStepError(CheckpointError):
    """One or more ranks failed during a collective step.

    Raised identically on every rank. ``failures`` maps each failing rank to a
    short description (exception type and message) and ``tracebacks`` maps it to
    its formatted traceback.
    """

    def __init__(
        self,
        step: str,
        failures: dict[int, str],
        tracebacks: dict[int, str] | None = None,
        error_types: dict[int, str] | None = None,
    ) -> None:
        self.step = step
        self.failures = dict(sorted(failures.items()))
        self.tracebacks = dict(tracebacks or {})
        self.error_types = dict(error_types or {})
        ranks = ", ".join(str(rank) for rank in self.failures)
        lines = [f"checkpoint step '{step}' failed on rank(s) {ranks}:"]
        lines += [f"  rank {rank}: {message}" for rank, message in self.failures.items()]
        super().__init__("\n".join(lines))

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        """The ranks that raised, in increasing order."""
        return tuple(self.failures)


class CollectiveTimeoutError(CheckpointError, TimeoutError):
    """A collective step of a save or load did not finish in time on this rank.

    Usually another rank died (killed, out of memory, lost its host) or never
    called the step (a save on rank 0 only), and the collective can never
    complete. The message names the step, this rank and the timeout (or
    MindSpore's own collective failure, its cause). Communication is unusable afterwards: every later
    collective step of this process raises this error at once; restart the
    job. The timeout is ``HP_CKPT_COLLECTIVE_TIMEOUT`` seconds (default 1800;
    0 waits forever).
    """


class CheckpointIOError(CheckpointError, OSError):
    """Writing or reading a checkpoint file failed at the operating-system level.

    Disk full (ENOSPC), I/O errors (EIO), permission problems.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConcurrentSaveError(CheckpointError):
    """Another save is writing the same checkpoint id (or committed it meanwhile).

    The message names the other save (its save id, host and process) and the
    lease file. The checkpoint committed before either save stays intact; this
    save's data was removed. Raised by the committing rank (on every rank under
    collectives).
    """
