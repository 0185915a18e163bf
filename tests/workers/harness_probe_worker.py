"""Probe worker for ``tests/test_msrun_harness.py``.

Usage: ``harness_probe_worker.py [hang|crash]``. Without arguments it runs a
few scenarios through ``worker_lib.run_scenarios``; ``hang`` sleeps forever
after ``init`` (timeout test); ``crash`` raises an uncaught error on rank 1
while rank 0 waits in a barrier.
"""

from __future__ import annotations

import sys
import time

from worker_lib import init_worker, run_scenarios, scenario_tmp_dir

__all__ = ["main"]


def main() -> None:
    """Run the probe scenarios (or hang) on this rank."""
    rank, world = init_worker()
    if sys.argv[1:] == ["hang"]:
        print(f"probe rank {rank}: hanging on purpose", flush=True)
        while True:
            time.sleep(3600)

    from hyper_parallel.platform import comm  # pylint: disable=import-outside-toplevel

    if sys.argv[1:] == ["crash"]:
        if rank == 1:
            raise RuntimeError("probe crash on rank 1")
        comm.barrier()

    def deliberate_failure() -> str:
        if rank == 1:
            raise ValueError("deliberate failure on rank 1")
        return "fine"

    def shared_dir() -> list[str]:
        directory = scenario_tmp_dir("probe")
        (directory / f"rank_{rank}.txt").write_text(str(rank), encoding="utf-8")
        comm.all_gather_object(None)  # sync; mint barrier() does not block on CPU
        return sorted(p.name for p in directory.iterdir())

    run_scenarios({
        "rank_world": lambda: (rank, world, comm.get_rank(), comm.get_world_size(), comm.is_initialized()),
        "all_gather": lambda: comm.all_gather_object({"rank": rank, "square": rank * rank}),
        "broadcast_from_1": lambda: comm.broadcast_object(f"payload of rank {rank}" if rank == 1 else None, src=1),
        "deliberate_failure": deliberate_failure,
        "after_failure": lambda: comm.all_gather_object(rank + 10),
        "shared_dir": shared_dir,
    })


if __name__ == "__main__":
    main()
