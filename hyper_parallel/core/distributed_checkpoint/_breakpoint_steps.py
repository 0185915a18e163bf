"""The steps :class:`.CheckpointCallback`'s ``exception_save`` writes when training raises.

They are kept apart, as MindSpore keeps its ``_breakpoint`` files apart: step
``n`` is ``<directory>/breakpoint_<n:08d>``, a step of a second
:class:`CheckpointManager` (the callback's ``breakpoint_manager``, step prefix
``breakpoint_``), so a diverged state (NaN weights) costs no regular step and
is not what a plain resume loads; ``resume="breakpoint"`` takes it when it is
newer than the newest regular step.

Which step the Parameters are at when training raised is found from the step
``Model.train`` began and whether its network already returned
(:func:`trained_step`). No MindSpore import; the callback calls these on every
rank.

Only some ranks may raise (a data error on one host): the others go on
training, or wait in the step's gradient all-reduce. A save is collective, so
a rank raising alone waited in it for the collective timeout (1800 s), then
showed a communication error instead of its own. Before any collective of the
exception path, the raising ranks therefore check that every rank arrived
(:func:`everyone_arrived`, at most ``HP_CKPT_BREAKPOINT_TIMEOUT`` seconds);
otherwise nothing is saved and the training's own error propagates at once.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper, collectives_on
from hyper_parallel.core.distributed_checkpoint._options import seconds_from_env
from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager

__all__ = [
    "BREAKPOINT_PREFIX",
    "BREAKPOINT_TIMEOUT_ENV",
    "DEFAULT_BREAKPOINT_TIMEOUT",
    "arrival_problem",
    "breakpoint_timeout",
    "everyone_arrived",
    "RunningStep",
    "breakpoint_manager",
    "net_outputs",
    "resume_point",
    "save_breakpoint",
    "trained_step",
]

_LOG = logging.getLogger(__name__)
#: Step prefix of the steps ``exception_save`` writes (``<directory>/breakpoint_<n:08d>``).
BREAKPOINT_PREFIX = "breakpoint_"
#: Environment variable: seconds a rank that raised waits for the others before saving (:func:`everyone_arrived`).
BREAKPOINT_TIMEOUT_ENV = "HP_CKPT_BREAKPOINT_TIMEOUT"
#: Default of :data:`BREAKPOINT_TIMEOUT_ENV`: ranks raising at one step (a NaN loss everywhere) arrive well within.
DEFAULT_BREAKPOINT_TIMEOUT = 60.0


@dataclass(frozen=True)
class _Arrival:
    """What a rank that raised sends on reaching the exception path's first collective.

    Attributes:
        step: The step it would save.
        started: Its ``time.time()`` on arrival.
    """

    step: int
    started: float


def breakpoint_timeout() -> float:
    """Seconds a rank that raised waits for every rank (:data:`BREAKPOINT_TIMEOUT_ENV`, default 60).

    Raises:
        CheckpointValueError: Not a positive number.
    """
    seconds = seconds_from_env(BREAKPOINT_TIMEOUT_ENV, DEFAULT_BREAKPOINT_TIMEOUT, example=60, zero_waits_forever=False)
    return DEFAULT_BREAKPOINT_TIMEOUT if seconds is None else seconds  # (never None without zero_waits_forever)


def arrival_problem(found: list[Any], timeout: float) -> str | None:
    """Why the gathered messages ``found`` (one per rank) do not let the ranks save, or ``None``. Pure.

    Args:
        found: What each rank sent (an ``_Arrival``, or another step's message).
        timeout: The seconds each rank waits (:func:`breakpoint_timeout`).
    """
    arrivals = [a for a in found if isinstance(a, _Arrival)]
    if len(arrivals) < len(found):
        return f"rank(s) {[r for r, a in enumerate(found) if not isinstance(a, _Arrival)]} were in another step"
    steps = sorted({a.step for a in arrivals})
    if len(steps) > 1:
        return f"the ranks are at different steps {steps}"
    spread = max(a.started for a in arrivals) - min(a.started for a in arrivals)
    if spread > timeout - min(timeout / 2, 5.0):  # (a margin for the hosts' clocks)
        return f"the last rank arrived {spread:.1f} s after the first, which may have stopped waiting"
    return None


def everyone_arrived(step: int, reason: str) -> bool:
    """Whether every rank raised too and reached this point within :func:`breakpoint_timeout` seconds of the
    first. Every rank whose training raised calls it before any collective of the exception path.

    ``False`` (logged: the ranks, the wait, that nothing is saved) when the wait ran out or the communication
    failed (then this process's later collective steps fail at once), when the gathered messages are not all
    arrivals for ``step``, or when the last one came so late that the first may have given up: every rank that
    completed the gather decides the same from the same messages, so none of them goes on to wait alone.

    Args:
        step: The step this rank would save.
        reason: The training's exception name, for the log.
    """
    if not collectives_on(no_dist=False, use_collectives=True):
        return True  # one process: nobody to wait for (and no setting to read)
    timeout = breakpoint_timeout()
    dist = DistWrapper(use_dist=True, timeout=timeout)
    mine = _Arrival(step=step, started=time.time())
    why = None
    try:
        found = dist.all_gather("breakpoint arrival", lambda: mine)
    except Exception as exc:  # pylint: disable=broad-except  # a timeout, or MindSpore's own collective failing
        why = f"not every rank arrived within {timeout:g} s ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    else:
        why = arrival_problem(found, timeout)
    if why is None:
        return True
    _LOG.error("rank %d: training raised %s, but exception_save saves nothing: %s (did only some ranks raise? %s "
               "is the wait). The error training raised follows", dist.rank, reason, why, BREAKPOINT_TIMEOUT_ENV)
    return False


@dataclass(frozen=True, eq=False)
class RunningStep:
    """A step ``Model.train`` began (``on_train_step_begin``) whose end the callback has not seen yet.

    Attributes:
        step: Its number.
        epoch: Its epoch.
        params: ``run_context.original_args()``; ``params.net_outputs`` is replaced when the network finishes it.
        outputs: ``params.net_outputs`` when it began (the previous step's outputs, kept alive, so the identity
            test is sound).
    """

    step: int
    epoch: int
    params: Any
    outputs: Any

    @classmethod
    def began(cls, cb_params: Any) -> RunningStep:
        """The step ``cb_params`` (``run_context.original_args()`` at ``on_train_step_begin``) begins."""
        return cls(int(cb_params.cur_step_num), int(getattr(cb_params, "cur_epoch_num", 0) or 0), cb_params,
                   net_outputs(cb_params))


def net_outputs(cb_params: Any) -> Any:
    """``cb_params.net_outputs`` or ``None`` (MindSpore's internal parameters are a dict without it before the
    first step)."""
    if isinstance(cb_params, dict):
        return cb_params.get("net_outputs")
    return getattr(cb_params, "net_outputs", None)


def breakpoint_manager(directory: str | os.PathLike[str], *, max_to_keep: int) -> CheckpointManager:
    """The manager of the ``breakpoint_<n:08d>`` steps under ``directory`` (sync saves, its own retention)."""
    return CheckpointManager(directory, max_to_keep=max_to_keep, step_prefix=BREAKPOINT_PREFIX)


def resume_point(regular: CheckpointManager, breakpoints: CheckpointManager, *,
                 resume: bool | str) -> tuple[CheckpointManager, int] | None:
    """The manager and step a resume loads, or ``None`` without a committed step. All ranks.

    The newest regular step; with ``resume="breakpoint"`` the newest ``exception_save`` step instead when it
    is newer.
    """
    latest = regular.latest_step()
    if resume == "breakpoint":
        exception_step = breakpoints.latest_step()
        if exception_step is not None and (latest is None or exception_step > latest):
            return breakpoints, exception_step
    return None if latest is None else (regular, latest)


def trained_step(running: RunningStep | None, completed: int, epoch: int) -> tuple[int, int]:
    """The step (and epoch) the Parameters are at when training raised.

    The last step whose end the callback saw (``completed``, in ``epoch``), or the step running when training
    raised if its network already returned (``net_outputs`` replaced): then a callback listed before this one
    raised in ``on_train_step_end`` (MindSpore's ``LossMonitor`` on a NaN loss does), after the optimizer
    updated the Parameters; saving them under the previous step would make a resume train that batch twice.
    """
    if running is not None and running.step > completed and (
        net_outputs(running.params) is not running.outputs
    ):
        return running.step, running.epoch
    return completed, epoch


def save_breakpoint(breakpoints: CheckpointManager, regular: CheckpointManager, step: int, state: dict[str, Any],
                    *, reason: str, io_kwargs: dict[str, Any]) -> None:
    """Save ``state`` as ``step`` of ``breakpoints``, committed before it returns, after ``regular``'s pending
    saves finished; delete the breakpoint steps above it. All ranks.

    Args:
        breakpoints: The manager of the breakpoint steps.
        regular: The manager of the regular steps (waited for, never pruned).
        step: The step the Parameters are at.
        state: What to save (the training state and the appended values).
        reason: The exception's name, for the log.
        io_kwargs: Passed to the save (``strategy_file``).
    """
    _LOG.warning("training raised %s: saving step %d (exception_save)", reason, step)
    regular.wait()
    # A diverged state (NaN weights) costs no regular step and is not what a plain resume loads.
    breakpoints.save(step, state, force=True, **io_kwargs)
    # Breakpoint steps above it were saved by a run this one resumed before (a resume from an earlier regular
    # step): the newest by number, they were what resume="breakpoint" loaded, and what retention kept, instead
    # of this step.
    dropped = breakpoints._delete_after(step)  # pylint: disable=protected-access
    if dropped:
        _LOG.warning("exception_save: deleted breakpoint step(s) %s, saved by a run this one resumed before",
                     dropped)
