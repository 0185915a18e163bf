"""Which steps a :class:`.CheckpointManager`'s retention keeps (no file access).

Retention keeps the newest ``max_to_keep`` committed steps (by step number;
with ``best_fn`` the best ones by metric; a NaN metric ranks last, as no
metric: such steps, newest first, fill the places the scored ones leave),
the newest committed step, the step just saved, and every step ever promised "keep forever"
(``keep_every_n_steps``, ``keep_time_interval_seconds``); it drops
uncommitted steps older than the newest committed one. The promises and
metrics come from the root's record (:mod:`._manager_record`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from hyper_parallel.core.distributed_checkpoint._manager_record import ManagerPolicy, StepRecord

__all__ = ["RetentionPlan", "plan_retention", "promised_forever"]


@dataclass(frozen=True)
class RetentionPlan:
    """The outcome of one retention decision.

    Attributes:
        steps: The record of every committed step, the one just saved included.
        doomed: Steps to delete, committed ones first, each ascending.
    """

    steps: dict[int, StepRecord]
    doomed: tuple[int, ...]


def promised_forever(policy: ManagerPolicy, step: int, now: float, steps: dict[int, StepRecord]) -> bool:
    """Whether ``step``, saved at ``now``, is promised "keep forever" (``keep_every_n_steps``, or
    ``keep_time_interval_seconds`` since the newest kept-forever step of ``steps``, the committed steps' records)."""
    if policy.keep_every_n_steps is not None and step % policy.keep_every_n_steps == 0:
        return True
    if policy.keep_time_interval_seconds is None:
        return False
    last = max((r.saved_at for s, r in steps.items() if r.keep_forever and s != step), default=None)
    return last is None or now - last >= policy.keep_time_interval_seconds


def _bounded_keep(
    policy: ManagerPolicy,
    best_fn: Callable[[dict[str, Any]], float] | None,
    committed: list[int],
    steps: dict[int, StepRecord],
) -> set[int]:
    """The steps ``max_to_keep`` keeps: the newest, or the best by ``best_fn``."""
    if policy.max_to_keep is None:
        return set(committed)
    if best_fn is None:
        return set(committed[-policy.max_to_keep :])
    scored = []
    for step in committed:
        metrics = steps[step].metrics if step in steps else None
        if metrics is not None:
            value = float(best_fn(metrics))
            if math.isnan(value):  # unordered: sorted among the others, it reordered them (the best got deleted)
                continue  # ranks last, as a step without metrics
            scored.append((value if policy.best_mode == "max" else -value, step))
    scored.sort(reverse=True)  # best first; a tie keeps the newer step
    ranked = [step for _, step in scored]
    # Steps without a usable metric rank last, newest first: they fill the places the scored steps leave free
    # (dropped outright, a root whose record is gone lost every step but the newest at its first best-k save).
    ranked_set = set(ranked)
    ranked += [step for step in reversed(committed) if step not in ranked_set]
    return set(ranked[: policy.max_to_keep])


def plan_retention(
    policy: ManagerPolicy,
    *,
    best_fn: Callable[[dict[str, Any]], float] | None,
    committed: list[int],
    uncommitted: list[int],
    recorded: dict[int, StepRecord],
    committing: tuple[int, dict[str, Any] | None] | None,
    now: float,
) -> RetentionPlan:
    """Decide which steps to delete after a commit. Coordinator only.

    Args:
        policy: The manager's retention policy.
        best_fn: ``metrics -> float`` ranking steps for ``max_to_keep``, or ``None`` (newest first).
        committed: The committed steps, ascending (not empty).
        uncommitted: The uncommitted steps, ascending.
        recorded: The root's record of steps (entries of steps no longer committed are ignored).
        committing: The step just saved and its metrics, or ``None``.
        now: The commit time (seconds since the epoch).

    Returns:
        The updated step records and the steps to delete.
    """
    steps = {s: r for s, r in recorded.items() if s in committed}
    just_saved = None
    if committing is not None and committing[0] in committed:
        just_saved, metrics = committing
        # A fresh entry: its own promise only (an earlier entry of this step number belonged to another save)
        forever = promised_forever(policy, just_saved, now, steps)
        steps[just_saved] = StepRecord(saved_at=now, keep_forever=forever, metrics=metrics)
    keep = _bounded_keep(policy, best_fn, committed, steps) | {committed[-1]}
    keep.update(s for s, r in steps.items() if r.keep_forever)
    if just_saved is not None:
        keep.add(just_saved)
    if policy.keep_every_n_steps is not None:
        keep.update(s for s in committed if s % policy.keep_every_n_steps == 0)
    doomed = [s for s in committed if s not in keep] + [s for s in uncommitted if s < committed[-1]]
    return RetentionPlan(steps=steps, doomed=tuple(doomed))
