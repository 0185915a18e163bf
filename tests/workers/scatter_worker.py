"""msrun worker: the collectives whose received bytes do not grow with the world size.

Scenarios (all ranks, in order): ``platform.scatter_bytes`` of parts of
different lengths (empty included) and of every byte value; a reduce_scatter
step whose reduce fails on the coordinator (every rank raises the same
error); a reduce_scatter of the rank's own squared number;
``platform.broadcast_bytes`` (empty and 1000 bytes); ``DistWrapper.broadcast``
of a value and of a coordinator failure; ``scatter_bytes`` of one part for
every rank (sent as a broadcast); ``DistWrapper.agree`` returning each
rank's own value, and failing on the last rank (every rank raises it).
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


def _same_part() -> bytes:
    blob = bytes(range(200)) * 3
    return platform.scatter_bytes([blob] * WORLD if RANK == 0 else None)  # one object for all: a broadcast


def _broadcast_bytes() -> list[bytes]:
    return [platform.broadcast_bytes(b"" if RANK == 0 else None), platform.broadcast_bytes(
        bytes(range(250)) * 4 if RANK == 0 else None)]


def _broadcast() -> list:
    dist = DistWrapper(use_dist=True)
    value = dist.broadcast("probe", lambda: {"from": RANK, "world": WORLD})

    def fail():
        raise PlanValidationError(f"coordinator rank {RANK} refuses")

    try:
        dist.broadcast("probe", fail)
    except PlanValidationError as exc:
        return [value, f"{type(exc).__name__}: {exc}"]
    return [value, "no error"]


def _agree() -> list:
    dist = DistWrapper(use_dist=True)
    own = dist.agree("probe", lambda: RANK * 10)

    def local():
        if RANK == WORLD - 1:
            raise PlanValidationError(f"rank {RANK} cannot verify")
        return RANK

    try:
        dist.agree("verify", local)
    except PlanValidationError as exc:
        dist.barrier("after")
        return [own, f"{type(exc).__name__}: {exc}"]
    return [own, "no error"]


run_scenarios({"lengths": _lengths, "all_values": _all_values, "failing": _failing,
               "map_fails": _map_fails_on_last_rank, "squares": _squares, "broadcast_bytes": _broadcast_bytes,
               "broadcast": _broadcast, "agree": _agree, "same_part": _same_part})
