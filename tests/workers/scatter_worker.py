"""msrun worker: platform.scatter_bytes and DistWrapper.reduce_scatter hand each rank its own part only.

Scenarios (all ranks, in order): parts of different lengths (empty included);
a part of every byte value; a reduce_scatter step whose reduce fails on the
coordinator (every rank raises the same error); a reduce_scatter of the
rank's own squared number.
"""

from __future__ import annotations

from worker_lib import init_worker, run_scenarios

RANK, WORLD = init_worker()

from hyper_parallel import platform  # noqa: E402
from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper  # noqa: E402
from hyper_parallel.core.distributed_checkpoint.errors import PlanValidationError  # noqa: E402


def _lengths() -> bytes:
    parts = [bytes([r]) * (r * 3) for r in range(WORLD)] if RANK == 0 else None
    return platform.scatter_bytes(parts, src=0)


def _all_values() -> bytes:
    parts = [bytes(range(256)) + bytes([r]) for r in range(WORLD)] if RANK == 0 else None
    return platform.scatter_bytes(parts, src=0)


def _failing() -> str:
    def reduce(values):
        raise PlanValidationError(f"bad plan from {len(values)} ranks")

    try:
        DistWrapper(use_dist=True).reduce_scatter("probe", lambda: RANK, reduce)
    except PlanValidationError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _map_fails_on_last_rank() -> str:
    def local():
        if RANK == WORLD - 1:
            raise PlanValidationError(f"rank {RANK} has no plan")
        return RANK

    try:
        DistWrapper(use_dist=True).reduce_scatter("probe", local, lambda values: values)
    except PlanValidationError as exc:
        return str(exc)
    return "no error"


def _squares() -> int:
    return DistWrapper(use_dist=True).reduce_scatter("probe", lambda: RANK, lambda values: [v * v for v in values])


run_scenarios({"lengths": _lengths, "all_values": _all_values, "failing": _failing, "map_fails": _map_fails_on_last_rank, "squares": _squares})
