"""msrun worker (2 ranks) for ``tests/test_save_kinds_race.py``: rank-local and collective saves side by side.

Scenario ``kinds_race``: on each rank a thread commits rank-local saves (``use_collectives=False``, values
``100 + 10 * rank + j``) to directory ``mix`` and loads each back alone, while the main thread commits
collective async saves (values ``i``) to the same directory and loads each back whole (``no_dist``). Each
load's values are returned, or its error.

Scenario ``alone_after_collective``: a collective ``async_save`` is pending on both ranks; rank 0 alone then
starts another save (async or sync, ``use_collectives=False`` or ``no_dist``) while rank 1 waits (up to
:data:`WAIT` seconds) before calling ``result()``. Returns rank 0's outcome and how long it took, then both
ranks finish the pending save and rank 0 repeats its save, which must then commit. The ``*_shared_writer``
cases give rank 0's sync save the very writer object the pending save uses (``storage_writer=``).

Scenario ``split_ids``: each rank passes its own checkpoint_id (``split_<kind>_<rank>``) to one collective
save, sync then async; returns each outcome (error type and text), what each directory holds after, and
the values a following save of both ranks to one id loads back. Then each rank loads its own checkpoint
(``split_load_<rank>``) in one collective load: its outcome, and whether the targets were left untouched.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from worker_lib import init_worker, run_scenarios, scenario_tmp_dir

__all__ = ["main"]

#: Seconds rank 1 waits for rank 0's alone save before calling ``result()`` (ends a hang there).
WAIT = 20.0
ROUNDS = 6


def main() -> None:
    """Run the scenarios on this rank."""
    rank, _ = init_worker()
    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel
    from hyper_parallel import DTensor, Layout  # pylint: disable=import-outside-toplevel
    import mindspore as ms  # pylint: disable=import-outside-toplevel

    shared = scenario_tmp_dir("kinds")
    layout = Layout((2,), (0, -1))

    def state(value: float) -> dict:
        return {"w": DTensor.from_global(ms.Tensor(np.full((64, 32), value, np.float32)), layout, rank=rank)}

    def plain(value: float) -> dict:
        return {"w": ms.Tensor(np.full((64, 32), value, np.float32))}

    def own(value: float) -> dict:
        """This rank's rows as a plain tensor: what a rank-local save may hold."""
        return {"w": ms.Tensor(np.full((32, 32), value, np.float32))}

    def local_values(target: dict) -> list[float]:
        return sorted(set(target["w"].asnumpy().ravel().tolist()))

    def kinds_race() -> dict:
        mix = shared / "mix"
        local_seen: list[object] = []
        whole_seen: list[object] = []

        def rank_local() -> None:
            for j in range(3 * ROUNDS):
                dcp.save(own(100 + 10 * rank + j), checkpoint_id=mix, use_collectives=False)
                target = own(-1.0)
                try:
                    dcp.load(target, checkpoint_id=mix, use_collectives=False)
                    local_seen.append((100 + 10 * rank + j, local_values(target)))
                except dcp.CheckpointError as exc:
                    local_seen.append((100 + 10 * rank + j, f"{type(exc).__name__}: {exc}"))

        thread = threading.Thread(target=rank_local)
        thread.start()
        for i in range(ROUNDS):
            dcp.async_save(state(float(i)), checkpoint_id=mix).result()
            whole = plain(-1.0)
            try:
                dcp.load(whole, checkpoint_id=mix, no_dist=True)
                whole_seen.append((i, sorted(set(whole["w"].asnumpy().ravel().tolist()))))
            except dcp.CheckpointError as exc:
                whole_seen.append((i, f"{type(exc).__name__}: {exc}"))
        thread.join()
        return {"local": local_seen, "whole": whole_seen}

    def alone_after_collective() -> dict:
        outcomes = {}
        cases = {
            "async_rank_local": lambda d, _: dcp.async_save(own(7.0), checkpoint_id=d, use_collectives=False).result(),
            "async_no_dist": lambda d, _: dcp.async_save(plain(7.0), checkpoint_id=d, no_dist=True).result(),
            "sync_rank_local": lambda d, _: dcp.save(own(7.0), checkpoint_id=d, use_collectives=False),
            "sync_no_dist": lambda d, _: dcp.save(plain(7.0), checkpoint_id=d, no_dist=True),
            "sync_rank_local_shared_writer": lambda _, w: dcp.save(own(7.0), storage_writer=w, use_collectives=False),
            "sync_no_dist_shared_writer": lambda _, w: dcp.save(plain(7.0), storage_writer=w, no_dist=True),
        }
        for name, alone in cases.items():
            marker = shared / f"{name}.tried"
            writer = dcp.FileSystemWriter(shared / f"collective_{name}")
            handle = dcp.async_save(state(3.0), storage_writer=writer)
            outcome: dict = {}
            alone_dir = writer.path if name.endswith("shared_writer") else shared / f"alone_{name}"
            if rank == 0:
                start = time.monotonic()
                try:
                    alone(alone_dir, writer)
                    outcome = {"error": None, "message": ""}
                except dcp.CheckpointError as exc:
                    outcome = {"error": type(exc).__name__, "message": str(exc)}
                outcome["seconds"] = time.monotonic() - start
                marker.touch()
            else:
                deadline = time.monotonic() + WAIT
                while not marker.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
            handle.result()
            whole = plain(0.0)
            # A collective load: result() does not wait for rank 0's background commit, and a load without
            # collectives on rank 1 could run before that commit (IncompleteCheckpointError); a collective load
            # finishes the pending save on every rank first.
            dcp.load(whole, checkpoint_id=shared / f"collective_{name}")
            outcome["collective"] = sorted(set(whole["w"].asnumpy().ravel().tolist()))
            if rank == 0:
                if outcome["error"] is not None:
                    alone(alone_dir, writer)  # nothing pending now: it commits
                target = plain(0.0) if "no_dist" in name else own(0.0)
                dcp.load(target, checkpoint_id=alone_dir, use_collectives=False,
                         no_dist="no_dist" in name)
                outcome["alone"] = local_values(target)
            outcomes[name] = outcome
        return outcomes

    def split_ids() -> dict:
        outcomes = {}
        for kind, save in (("sync", dcp.save), ("async", lambda *a, **k: dcp.async_save(*a, **k).result())):
            try:
                save(state(float(rank + 1)), checkpoint_id=shared / f"split_{kind}_{rank}")
                outcome = {"error": None, "message": ""}
            except dcp.CheckpointError as exc:
                outcome = {"error": type(exc).__name__, "message": str(exc),
                           "value_error": isinstance(exc, ValueError)}
            dcp.save(state(9.0), checkpoint_id=shared / f"split_{kind}_joined")  # the same id on both: commits
            whole = plain(0.0)
            dcp.load(whole, checkpoint_id=shared / f"split_{kind}_joined", no_dist=True)
            outcome["joined"] = local_values(whole)
            outcome["held"] = {r: sorted(p.name for p in (shared / f"split_{kind}_{r}").glob("*"))
                               if (shared / f"split_{kind}_{r}").exists() else None for r in (0, 1)}
            outcomes[kind] = outcome
        dcp.save(state(float(rank + 1)), checkpoint_id=shared / "split_load_0")  # two checkpoints: 1.0, then 2.0
        dcp.save(state(float(rank + 2)), checkpoint_id=shared / "split_load_1")
        target = state(0.0)
        try:  # each rank its own checkpoint: a mix of two across the job's ranks
            dcp.load(target, checkpoint_id=shared / f"split_load_{rank}")
            outcomes["load"] = {"error": None, "message": ""}
        except dcp.CheckpointError as exc:
            outcomes["load"] = {"error": type(exc).__name__, "message": str(exc),
                                "value_error": isinstance(exc, ValueError)}
        outcomes["load"]["untouched"] = bool(np.all(target["w"].to_local().asnumpy() == 0))
        return outcomes

    run_scenarios({"alone_after_collective": alone_after_collective, "kinds_race": kinds_race, "split_ids": split_ids})


if __name__ == "__main__":
    main()
