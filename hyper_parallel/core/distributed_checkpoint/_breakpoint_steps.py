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
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager

__all__ = [
    "BREAKPOINT_PREFIX",
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
