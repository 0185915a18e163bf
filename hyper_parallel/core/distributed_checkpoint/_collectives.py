"""Distributed steps that never leave a rank waiting.

Every collective step of a save or load runs through :class:`DistWrapper`:
each rank runs its part inside ``try``, the outcome (value or error) is
gathered from every rank, and if any rank failed every rank raises the same
:class:`CollectiveStepError` naming the failing ranks and their messages. The
error also derives from the failing ranks' own error class when they agree,
so ``except MissingKeyError`` works on every rank.

Without distribution (one process, or ``no_dist=True``) the steps run locally
and errors propagate unchanged.

A rank that dies (SIGKILL, out of memory, a lost host) never reaches the
gather, and MindSpore's CPU collectives then wait for it forever (``msrun``
ends the job only when its scheduler times the dead rank out, about a
minute). So each gather runs on a helper thread and a rank waits at most
:func:`collective_timeout` seconds (``HP_CKPT_COLLECTIVE_TIMEOUT``, default
:data:`DEFAULT_COLLECTIVE_TIMEOUT`) before raising
:class:`CollectiveTimeoutError`; after that every collective step of the
process fails at once, since the abandoned gather still holds the channel.
"""

from __future__ import annotations

import logging
import pickle
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from hyper_parallel import platform
from hyper_parallel.core.distributed_checkpoint import errors
from hyper_parallel.core.distributed_checkpoint._options import seconds_from_env
from hyper_parallel.core.distributed_checkpoint.errors import CollectiveStepError, CollectiveTimeoutError

__all__ = [
    "COLLECTIVE_TIMEOUT_ENV",
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "DEFAULT_WAIT_NOTICE",
    "WAIT_NOTICE_ENV",
    "collective_timeout",
    "collectives_on",
    "DistWrapper",
    "RankFailure",
    "raise_failures",
]

T = TypeVar("T")
R = TypeVar("R")
_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankFailure:
    """What one rank reports when its part of a step raised.

    Attributes:
        rank: The failing rank.
        error_type: Class name of the exception.
        message: ``str`` of the exception.
        traceback: Formatted traceback.
    """

    rank: int
    error_type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class _Outcome:
    """What one rank contributes to a step: its value, or its failure."""

    value: Any = None
    failure: RankFailure | None = None


def _failure(rank: int, exc: BaseException) -> RankFailure:
    return RankFailure(
        rank=rank,
        error_type=type(exc).__name__,
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


_COMBINED: dict[str, type] = {}


def _run_outcome(fn: Callable[[], Any], rank: int) -> "_Outcome":
    """Run this rank's part of a step: its value, or its failure (interrupts and exits propagate)."""
    try:
        return _Outcome(value=fn())
    except BaseException as exc:  # pylint: disable=broad-except
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return _Outcome(failure=_failure(rank, exc))


def _error_class(error_types: set[str]) -> type[CollectiveStepError]:
    """The raised class: also the failing ranks' own error class when they agree."""
    if len(error_types) != 1:
        return CollectiveStepError
    name = next(iter(error_types))
    base = getattr(errors, name, None) if name in errors.__all__ else None
    if base is None or not isinstance(base, type) or base is CollectiveStepError:
        return CollectiveStepError
    if name not in _COMBINED:
        _COMBINED[name] = type(f"Collective{name}", (CollectiveStepError, base), {"__module__": __name__})
    return _COMBINED[name]


def raise_failures(step: str, failures: list[RankFailure]) -> None:
    """Raise the combined error for ``failures`` (no-op when empty)."""
    if not failures:
        return
    cls = _error_class({f.error_type for f in failures})
    raise cls(
        step,
        {f.rank: f"{f.error_type}: {f.message}" for f in failures},
        {f.rank: f.traceback for f in failures},
        {f.rank: f.error_type for f in failures},
    )


#: Environment variable: seconds one rank waits in one collective step (0: forever).
COLLECTIVE_TIMEOUT_ENV = "HP_CKPT_COLLECTIVE_TIMEOUT"
#: Default of :data:`COLLECTIVE_TIMEOUT_ENV`: longer than any rank's writing of its share.
DEFAULT_COLLECTIVE_TIMEOUT = 1800.0

#: Environment variable: seconds a rank waits in one collective step before it logs that it is waiting, and for
#: what (0: never). Only a log line: the step goes on waiting until :data:`COLLECTIVE_TIMEOUT_ENV`.
WAIT_NOTICE_ENV = "HP_CKPT_WAIT_NOTICE"
#: Default of :data:`WAIT_NOTICE_ENV`: far above a step's usual skew between ranks, far below the timeout.
DEFAULT_WAIT_NOTICE = 60.0

# Set once a gather was abandoned: the message every later collective step raises.
_broken: list[str] = []


def collective_timeout() -> float | None:
    """Seconds a rank waits in one collective step, from the environment (``None``: forever).

    Raises:
        CheckpointValueError: ``HP_CKPT_COLLECTIVE_TIMEOUT`` is not a number.
    """
    return seconds_from_env(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT, example=600, zero_waits_forever=True)


def _gather_within(payload: Any, *, step: str, rank: int, timeout: float | None) -> list[Any]:
    """``platform.all_gather_object`` that gives up after ``timeout`` seconds."""
    return _within(lambda: platform.all_gather_object(payload), step=step, rank=rank, timeout=timeout)


def _within(collective: Callable[[], T], *, step: str, rank: int, timeout: float | None) -> T:
    """Run one collective call, giving up after ``timeout`` seconds."""
    if _broken:
        raise CollectiveTimeoutError(_broken[0])
    if timeout is None or not timeout < threading.TIMEOUT_MAX:  # (inf: forever; Event.wait(inf) would overflow)
        try:
            return collective()
        except RuntimeError as error:
            if type(error) is RuntimeError:  # pylint: disable=unidiomatic-typecheck
                raise _gave_up(error, rank=rank, step=step) from error
            raise
    box: dict[str, Any] = {}
    done = threading.Event()

    def gather() -> None:
        try:
            box["value"] = collective()
        except BaseException as exc:  # pylint: disable=broad-except
            box["error"] = exc
        finally:
            done.set()

    notice = seconds_from_env(WAIT_NOTICE_ENV, DEFAULT_WAIT_NOTICE, example=60, zero_waits_forever=True,
                              zero_means="log no notice")
    threading.Thread(target=gather, name=f"hp-ckpt-gather-{step}", daemon=True).start()
    if notice is not None and notice < timeout and not done.wait(notice):
        _LOG.warning(_waiting(rank, step, notice, timeout))
    if not done.wait(timeout if notice is None or notice >= timeout else timeout - notice):
        _broken.append(_unusable(rank, step, f"did not complete within {timeout:g} s") +
                       f" (the timeout is {COLLECTIVE_TIMEOUT_ENV}, seconds)")
        raise CollectiveTimeoutError(_broken[-1])
    if "error" in box:
        error = box["error"]
        if type(error) is RuntimeError:  # pylint: disable=unidiomatic-typecheck
            raise _gave_up(error, rank=rank, step=step) from error
        raise error
    return box["value"]


def _gave_up(error: RuntimeError, *, rank: int, step: str) -> CollectiveTimeoutError:
    """MindSpore's own collective gave up (a plain ``RuntimeError``; CPU: after 30 s): communication of this
    process is marked unusable. (Subclasses, ``RecursionError`` or ``NotImplementedError``, are failures of this
    process and are raised as they are by the caller.)"""
    _broken.append(_unusable(rank, step, f"failed in MindSpore's collective ({str(error).splitlines()[0]})"))
    return CollectiveTimeoutError(_broken[-1])


def _waiting(rank: int, step: str, notice: float, timeout: float) -> str:
    """The log line of a step still waiting after ``notice`` seconds: a rank is slow, or never comes."""
    return (
        f"rank {rank}: checkpoint step '{step}' has waited {notice:g} s for the other ranks and waits up to "
        f"{timeout:g} s ({COLLECTIVE_TIMEOUT_ENV}): a rank is slow, died, hangs, or never called this step. Every "
        "rank calls save and load: a save on rank 0 only (if get_rank() == 0: save_checkpoint(...)) waits until "
        f"the timeout; for a state rank 0 holds whole, pass no_dist=True there (this notice: {WAIT_NOTICE_ENV}, "
        "seconds, 0 for none)"
    )


def _unusable(rank: int, step: str, what: str) -> str:
    """The message of a collective step that never completed: why, and what to do."""
    return (
        f"rank {rank}: checkpoint step '{step}' {what}: another rank died, hangs, or never called this step (every "
        "rank calls save and load: a save on rank 0 only is not a collective save; for a state rank 0 holds "
        "whole, pass no_dist=True there). Communication of this process is unusable now: restart the job and load "
        "the last committed checkpoint"
    )


def _pickled_parts(parts: list[Any]) -> list[bytes]:
    """Each rank's part pickled as ``(part, no failures)``; one blob for parts that are one object.

    A result every rank shares (the committed metadata) is pickled once, and
    :func:`platform.scatter_bytes` then broadcasts it instead of scattering.
    """
    blobs: list[bytes] = []
    previous: Any = None
    for part in parts:
        if blobs and part is previous:
            blobs.append(blobs[-1])
        else:
            blobs.append(pickle.dumps((part, []), protocol=pickle.HIGHEST_PROTOCOL))
        previous = part
    return blobs


def _communicating() -> bool:
    """Whether communication is initialised with more than one rank. Any rank; no communication."""
    return platform.is_initialized() and platform.get_world_size() > 1


def collectives_on(*, no_dist: bool, use_collectives: bool) -> bool:
    """Whether a save or load with these options runs its steps with collectives, as its :class:`DistWrapper` does.

    For a caller that needs only this flag: asked for (neither ``no_dist`` nor
    ``use_collectives=False``) and communication initialised with more than
    one rank. Any rank; no communication.
    """
    return bool(not no_dist and use_collectives) and _communicating()


class DistWrapper:
    """Runs the steps of a save or load on all ranks, with uniform errors.

    Args:
        use_dist: Use collectives (only if communication is initialised).
        coordinator_rank: The rank that merges plans and commits.
        timeout: Seconds a rank waits in one step (0: forever); ``None``
            (default): :func:`collective_timeout`, from the environment.
    """

    def __init__(self, *, use_dist: bool, coordinator_rank: int = 0, timeout: float | None = None) -> None:
        self.use_dist = bool(use_dist) and _communicating()
        self.rank = platform.get_rank() if self.use_dist else 0
        self.world_size = platform.get_world_size() if self.use_dist else 1
        self.coordinator_rank = coordinator_rank
        self.is_coordinator = self.rank == coordinator_rank
        self.timeout = collective_timeout() if timeout is None else (timeout if timeout > 0 else None)

    def _gather_outcomes(self, step: str, fn: Callable[[], T]) -> list[Any]:
        outcome = _run_outcome(fn, self.rank)
        gathered: list[_Outcome] = _gather_within(outcome, step=step, rank=self.rank, timeout=self.timeout)
        raise_failures(step, [o.failure for o in gathered if o.failure is not None])
        return [o.value for o in gathered]

    def all_gather(self, step: str, fn: Callable[[], T]) -> list[T]:
        """Run ``fn`` on every rank and return every rank's result. All ranks call it."""
        if not self.use_dist:
            return [fn()]
        return self._gather_outcomes(step, fn)

    def broadcast(self, step: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the coordinator and return its result everywhere. All ranks call it.

        The coordinator's outcome (value or failure) goes to every rank by a
        tensor broadcast: a rank receives that one outcome, whatever the
        world size.
        """
        if not self.use_dist:
            return fn()
        blob = None
        if self.is_coordinator:
            blob = pickle.dumps(_run_outcome(fn, self.rank), protocol=pickle.HIGHEST_PROTOCOL)
        outcome: _Outcome = pickle.loads(self._broadcast_bytes(step, blob))
        raise_failures(step, [outcome.failure] if outcome.failure is not None else [])
        return outcome.value

    def agree(self, step: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if any rank failed, raise the same error on every rank. All ranks call it.

        Returns this rank's own result. Only failures travel: each rank's
        (usually empty) failure goes to the coordinator (tensor gather), and
        the list of failures comes back to every rank (tensor broadcast), so
        a rank receives bytes that do not grow with the world size (unless
        ranks fail). For a step whose results other ranks do not need.
        """
        if not self.use_dist:
            return fn()
        mine = _run_outcome(fn, self.rank)
        sent = pickle.dumps(mine.failure, protocol=pickle.HIGHEST_PROTOCOL)
        received = _within(lambda: platform.gather_bytes(sent, dst=self.coordinator_rank),
                           step=step, rank=self.rank, timeout=self.timeout)
        blob = None
        if self.is_coordinator:
            failures = [f for f in (pickle.loads(part) for part in received) if f is not None]
            blob = pickle.dumps(failures, protocol=pickle.HIGHEST_PROTOCOL)
        raise_failures(step, pickle.loads(self._broadcast_bytes(step, blob)))
        return mine.value

    def _broadcast_bytes(self, step: str, blob: bytes | None) -> bytes:
        return _within(lambda: platform.broadcast_bytes(blob, src=self.coordinator_rank),
                       step=step, rank=self.rank, timeout=self.timeout)

    def reduce_scatter(self, step: str, map_fn: Callable[[], T], reduce_fn: Callable[[list[T]], list[R]]) -> R:
        """Map on every rank, reduce on the coordinator, hand each rank its part.

        All ranks call it. ``reduce_fn`` runs on the coordinator only and
        returns one result per rank.
        """
        if not self.use_dist:
            return reduce_fn([map_fn()])[0]
        # Values go to the coordinator only (tensor gather) and each rank gets back only its own part
        # (tensor scatter): a rank other than the coordinator receives bytes independent of the world size.
        mine = _run_outcome(map_fn, self.rank)
        sent = pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL)
        received = _within(lambda: platform.gather_bytes(sent, dst=self.coordinator_rank),
                           step=step, rank=self.rank, timeout=self.timeout)
        blobs = None
        if self.is_coordinator:
            outcomes = [pickle.loads(blob) for blob in received]
            failures = [o.failure for o in outcomes if o.failure is not None]
            try:
                if failures:
                    raise_failures(step, failures)
                blobs = _pickled_parts(reduce_fn([o.value for o in outcomes]))
            except BaseException as exc:  # pylint: disable=broad-except
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                failures = failures or [_failure(self.rank, exc)]
                blobs = [pickle.dumps((None, failures), protocol=pickle.HIGHEST_PROTOCOL)] * self.world_size
        blob = _within(lambda: platform.scatter_bytes(blobs, src=self.coordinator_rank),
                       step=step, rank=self.rank, timeout=self.timeout)
        value, failures = pickle.loads(blob)
        raise_failures(step, failures)
        return value

    def barrier(self, step: str) -> None:
        """Wait for every rank (an error-free :meth:`agree`). All ranks call it."""
        self.agree(step, lambda: None)
