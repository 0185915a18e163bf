"""msrun worker for ``tests/test_unwritten_replicas.py``: a key only rank 1 holds, and only as a non-main replica.

Ranks send the coordinator 8-byte hashes of such keys; the refusal names the
key on the failure path. Scenarios: ``refused`` (what the save raised on this
rank, and whether a ``metadata.json`` exists), ``refused_async`` (the same
with ``async_save``), ``after`` (a save of the fixed state commits and loads:
communication still works), ``sent`` (bytes of this rank's local plan, and whether they hold the key's name).
``two_main`` / ``two_main_async`` / ``two_main_equal``: both ranks offer one ShardedTensor box as its main replica
(different data, then equal data): what the save raised; ``marked``: the same box with ``replica_id=rank``, beside
a row per rank, saved and loaded back (the bytes of the loaded values).
"""

from __future__ import annotations

import pickle

import numpy as np

from worker_lib import init_worker, run_scenarios, scenario_tmp_dir

__all__ = ["main"]


def main() -> None:
    """Run the scenarios on this rank."""
    rank, _ = init_worker()
    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel

    shared = scenario_tmp_dir("unwritten")
    state = {"w": np.full(4, 1.0, np.float32)}
    if rank == 1:
        state["decoder.only_on_1"] = dcp.ShardedTensor.from_rank_offsets(
            "decoder.only_on_1", np.arange(4, dtype=np.float32), replica_id=1)

    def refused(name: str, save, saved: dict | None = None) -> tuple[str, str, bool]:
        try:
            save(state if saved is None else saved, checkpoint_id=shared / name)
        except dcp.PlanValidationError as exc:
            return type(exc).__name__, str(exc), (shared / name / "metadata.json").exists()
        return "nothing raised", "", (shared / name / "metadata.json").exists()

    def after() -> list[float]:
        fixed = {"w": state["w"], "decoder.only_on_1": dcp.ShardedTensor.from_rank_offsets(
            "decoder.only_on_1", np.arange(4, dtype=np.float32), replica_id=0 if rank == 1 else 1)}
        dcp.save(fixed, checkpoint_id=shared / "fixed")
        loaded = {"decoder.only_on_1": np.zeros(4, np.float32)}
        dcp.load(loaded, checkpoint_id=shared / "fixed")
        return loaded["decoder.only_on_1"].tolist()

    def sent() -> tuple[int, bool]:
        planner = dcp.StandardSavePlanner()
        planner.configure_planner(state, rank=rank, world_size=2, is_coordinator=rank == 0)
        blob = pickle.dumps(planner.build_local_plan(), protocol=pickle.HIGHEST_PROTOCOL)
        return len(blob), b"only_on_1" in blob

    def two_main(name: str, save, data: np.ndarray) -> tuple[str, str, bool]:
        return refused(name, save, {"w": state["w"],
                                    "tied": dcp.ShardedTensor.from_rank_offsets("decoder.tied", data)})

    def marked() -> tuple[bytes, bytes]:
        tied = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
        rows = np.arange(8, dtype=np.float32).reshape(2, 4) * 1.5 + rank
        fixed = {"tied": dcp.ShardedTensor.from_rank_offsets("decoder.tied", tied.copy(), replica_id=rank),
                 "rows": dcp.ShardedTensor.from_rank_offsets("decoder.rows", rows.copy(), (0, rank, 2))}
        dcp.save(fixed, checkpoint_id=shared / "marked")
        loaded = {"decoder.tied": np.zeros((2, 3), np.float32), "decoder.rows": np.zeros((4, 4), np.float32)}
        dcp.load(loaded, checkpoint_id=shared / "marked")
        return loaded["decoder.tied"].tobytes(), loaded["decoder.rows"].tobytes()

    run_scenarios({
        "two_main": lambda: two_main("d", dcp.save, np.full(3, float(rank), np.float32)),
        "two_main_async": lambda: two_main("e", lambda s, **kw: dcp.async_save(s, **kw).result(),
                                           np.full(3, float(rank), np.float32)),
        "two_main_equal": lambda: two_main("f", dcp.save, np.ones(3, np.float32)),
        "marked": marked,
        "refused": lambda: refused("a", dcp.save),
        "refused_async": lambda: refused("b", lambda s, **kw: dcp.async_save(s, **kw).result()),
        "after": after,
        "sent": sent,
    })


if __name__ == "__main__":
    main()
