"""msrun worker for ``tests/test_background_commit.py``: a multi-rank async save commits in the background.

Scenarios, in order, on every rank (row-sharded DTensor + replicated tensor):
``commit_without_result`` waits until its request is ``done()`` and looks,
before any ``result()``, for the committed metadata and for leftover results
records; ``failure_reaches_all`` makes rank 1's write fail and reports what
``result()`` raised on each rank. Then (after the report) a last save waits
for ``done()`` and every rank SIGKILLs itself without calling ``result()``:
the pytest side loads that checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from worker_lib import init_worker, run_scenarios, scenario_tmp_dir

__all__ = ["main", "full_value"]

LAYOUT_ARGS = ((2,), (0, -1))


def full_value(seed: int) -> np.ndarray:
    """The global tensor a scenario saves."""
    return np.arange(64 * 6, dtype=np.float32).reshape(64, 6) + seed


def _wait_done(request: Any, timeout: float = 120.0) -> float:
    start = time.monotonic()
    while not request.done():
        if time.monotonic() - start > timeout:
            raise AssertionError("async save not done in time")
        time.sleep(0.01)
    return time.monotonic() - start


def main() -> None:
    """Run the scenarios on this rank."""
    rank, world = init_worker()
    import mindspore  # pylint: disable=import-outside-toplevel

    import hyper_parallel  # pylint: disable=import-outside-toplevel
    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel

    layout = hyper_parallel.Layout(*LAYOUT_ARGS)
    shared = scenario_tmp_dir("bgcommit")

    def state(seed: int) -> dict[str, Any]:
        return {"w": hyper_parallel.DTensor.from_global(mindspore.Tensor(full_value(seed)), layout, rank=rank),
                "bias": mindspore.Tensor(np.full(5, seed, np.float32)), "step": seed}

    class FailingWriter(dcp.FileSystemWriter):
        """Fails writing on rank 1 only."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            if rank == 1:
                raise OSError("disk full (injected on rank 1)")
            return super().write_data(plan, planner)

    def commit_without_result() -> dict[str, Any]:
        path = shared / "c1"
        request = dcp.async_save(state(1), checkpoint_id=path)
        _wait_done(request)
        committed = rank != 0 or (path / "metadata.json").exists()  # rank 0's done(): its thread committed
        metadata = request.result()  # the coordinator's outcome reached every rank: its records are gone
        records = sorted(p.name for p in path.glob(".*.results"))
        target = {"w": hyper_parallel.DTensor.from_global(mindspore.Tensor(np.zeros((64, 6), np.float32)), layout,
                                                          rank=rank),
                  "bias": mindspore.Tensor(np.zeros(5, np.float32)), "step": 0}
        dcp.load(target, checkpoint_id=path)
        expected = full_value(1)[rank * 32:(rank + 1) * 32]
        return {"committed_before_result": committed, "records": records,
                "result_is_metadata": metadata.storage_meta.world_size == world,
                "values_ok": bool(np.array_equal(target["w"].to_local().asnumpy(), expected))
                and bool((target["bias"].asnumpy() == 1).all()) and target["step"] == 1}

    def failure_reaches_all() -> dict[str, Any]:
        path = shared / "c2"
        request = dcp.async_save(state(2), storage_writer=FailingWriter(path))
        _wait_done(request)
        try:
            request.result()
            raised = ""
        except dcp.CheckpointError as exc:
            raised = f"{type(exc).__name__}: {exc}"
        hyper_parallel.platform.barrier()  # the coordinator's abort is over on every rank
        return {"raised": raised, "committed": (path / "metadata.json").exists(),
                "left": sorted(p.name for p in path.iterdir()) if path.exists() else []}

    class SlowCommitWriter(dcp.FileSystemWriter):
        """The coordinator's commit waits (at most 30 s) until every rank says its result() returned."""

        flags = [shared / f"rank{r}.result_returned" for r in range(world)]
        saw_flag: list[bool] = []

        def finish(self, metadata: Any, results: Any, *, background_cleanup: bool = False) -> Any:
            deadline = time.monotonic() + 30
            while not all(f.exists() for f in self.flags) and time.monotonic() < deadline:
                time.sleep(0.01)
            self.saw_flag.append(all(f.exists() for f in self.flags))
            return super().finish(metadata, results, background_cleanup=background_cleanup)

    class FailingCommitWriter(dcp.FileSystemWriter):
        """The coordinator's background commit fails."""

        def finish(self, metadata: Any, results: Any, *, background_cleanup: bool = False) -> Any:
            raise OSError(5, "I/O error during commit (injected)")

    class LeaseThiefWriter(dcp.FileSystemWriter):
        """The save lease disappears before the background commit (another process judged it stale)."""

        def finish(self, metadata: Any, results: Any, *, background_cleanup: bool = False) -> Any:
            (self.path / ".metadata.json.lease").unlink()
            return super().finish(metadata, results, background_cleanup=background_cleanup)

    def zeros() -> dict[str, Any]:
        return {"w": hyper_parallel.DTensor.from_global(mindspore.Tensor(np.zeros((64, 6), np.float32)), layout,
                                                        rank=rank),
                "bias": mindspore.Tensor(np.zeros(5, np.float32)), "step": -1}

    def loaded_ok(target: dict[str, Any], seed: int) -> bool:
        expected = full_value(seed)[rank * 32:(rank + 1) * 32]
        return (bool(np.array_equal(target["w"].to_local().asnumpy(), expected))
                and bool((target["bias"].asnumpy() == seed).all()) and target["step"] == seed)

    def result_does_not_wait_for_commit() -> dict[str, Any]:
        path = shared / "c4"
        request = dcp.async_save(state(4), storage_writer=SlowCommitWriter(path))
        start = time.monotonic()
        metadata = request.result()  # no rank waits for the commit, held back until every rank got here
        blocked = time.monotonic() - start
        committed_at_return = (path / "metadata.json").exists()
        SlowCommitWriter.flags[rank].write_text("1")
        target = zeros()
        dcp.load(target, checkpoint_id=path)  # the next collective step: waits for the commit's outcome
        return {"blocked": blocked, "committed_at_return": committed_at_return, "saw_flag": SlowCommitWriter.saw_flag,
                "world": metadata.storage_meta.world_size,
                "same_as_committed": metadata == dcp.read_metadata(path),
                "values_ok": loaded_ok(target, 4), "records": sorted(p.name for p in path.glob(".*.results"))}

    def commit_failure_reaches_all_at_next_step() -> dict[str, Any]:
        path = shared / "c5"
        dcp.save(state(5), checkpoint_id=path)  # an earlier complete checkpoint
        request = dcp.async_save(state(6), storage_writer=FailingCommitWriter(path))
        request.result()  # the writes all succeeded: the commit's outcome comes with the next step
        try:
            dcp.load(zeros(), checkpoint_id=path)
            raised: dict[str, Any] = {}
        except dcp.CheckpointError as exc:
            raised = {"type": type(exc).__name__, "message": str(exc),
                      "failed_ranks": list(getattr(exc, "failed_ranks", ()))}
        target = zeros()
        dcp.load(target, checkpoint_id=path)  # settled: the earlier checkpoint loads whole
        dcp.async_save(state(6), storage_writer=FailingCommitWriter(path)).result()
        try:  # a save's plan step shares the commit's outcome, before that save takes its directory
            dcp.save(state(9), checkpoint_id=shared / "c6")
            raised_by_save: dict[str, Any] = {}
        except dcp.CheckpointError as exc:
            raised_by_save = {"failed_ranks": list(getattr(exc, "failed_ranks", ())), "message": str(exc),
                              "committed": (shared / "c6" / "metadata.json").exists()}
        dcp.save(state(9), checkpoint_id=shared / "c6")
        hyper_parallel.platform.barrier()
        return {"raised": raised, "raised_by_save": raised_by_save, "old_ok": loaded_ok(target, 5),
                "left": sorted(p.name for p in path.iterdir() if p.name.endswith((".results", ".lease")))}

    def manager_reports_lost_lease() -> dict[str, Any]:
        root = shared / "managed"
        manager = dcp.CheckpointManager(root, async_save=True)
        manager.save(1, state(1))
        manager.save(2, state(2), storage_writer=LeaseThiefWriter(manager.directory(2)))  # waits for step 1 first
        try:
            manager.wait()
            raised: dict[str, Any] = {}
        except dcp.ConcurrentSaveError as exc:
            raised = {"type": type(exc).__name__, "failed_ranks": list(getattr(exc, "failed_ranks", ())),
                      "message": str(exc)}
        return {"raised": raised, "steps": manager.all_steps()}

    class CoordinatorFailingWriter(dcp.FileSystemWriter):
        """Fails writing on rank 0 (the coordinator) only."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            if rank == 0:
                raise OSError("disk full (injected on rank 0)")
            return super().write_data(plan, planner)

    def coordinator_failure_reaches_all() -> dict[str, Any]:
        path = shared / "c7"
        request = dcp.async_save(state(7), storage_writer=CoordinatorFailingWriter(path))
        try:
            request.result()
            raised: dict[str, Any] = {}
        except dcp.CheckpointError as exc:
            raised = {"failed_ranks": list(getattr(exc, "failed_ranks", ())), "message": str(exc)}
        hyper_parallel.platform.barrier()  # the coordinator's abort is over
        left = sorted(p.name for p in path.iterdir()) if path.exists() else []
        hyper_parallel.platform.barrier()  # every rank looked before the next save takes the directory
        dcp.save(state(8), checkpoint_id=path)  # the lease was released: a new save takes the directory
        target = zeros()
        dcp.load(target, checkpoint_id=path)
        return {"raised": raised, "left": left, "resave_ok": loaded_ok(target, 8)}

    class DelayedCommitWriter(dcp.FileSystemWriter):
        """The coordinator's commit waits (at most 3 s) for a flag file of this save."""

        def finish(self, metadata: Any, results: Any, *, background_cleanup: bool = False) -> Any:
            deadline = time.monotonic() + 3
            while not (self.path.parent / f"{self.path.name}.go").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            return super().finish(metadata, results, background_cleanup=background_cleanup)

    def reads_after_result_see_the_commit() -> dict[str, Any]:
        path = shared / "c9"
        dcp.async_save(state(9), storage_writer=DelayedCommitWriter(path)).result()
        try:  # rank 0 waits for its own commit; rank 1 cannot know it without a collective step
            read = {"world": dcp.read_metadata(path).storage_meta.world_size}
        except dcp.IncompleteCheckpointError as exc:
            read = {"error": str(exc)}
        (shared / "c9.go").write_text("1")
        loaded = hyper_parallel.load_checkpoint(str(path))  # every rank: settles the commit first
        path = shared / "c10"  # no flag: the commit takes 3 s, and load_checkpoint must wait for it
        dcp.async_save(state(10), storage_writer=DelayedCommitWriter(path)).result()
        again = hyper_parallel.load_checkpoint(str(path))
        path = shared / "lone_load"  # a load without collectives on rank 0: waits for its own commit, not the save before
        dcp.save(state(11), checkpoint_id=path)
        dcp.async_save(state(12), storage_writer=DelayedCommitWriter(path)).result()
        lone = {"bias": mindspore.Tensor(np.zeros(5, np.float32)), "step": -1}
        if rank == 0:
            start = time.monotonic()
            dcp.load(lone, checkpoint_id=path, no_dist=True)
            lone_waited = time.monotonic() - start
        else:
            lone_waited = 0.0
        dcp.load(zeros(), checkpoint_id=path)  # every rank: settles the commit
        step = loaded["step"]
        return {"read": read, "lone_step": lone["step"], "lone_bias": lone["bias"].asnumpy().tolist(),
                "lone_waited": lone_waited,
                "first_ok": bool(np.array_equal(loaded["w"].asnumpy(), full_value(9)))
                and int(np.asarray(step.asnumpy() if hasattr(step, "asnumpy") else step)) == 9,
                "second_ok": bool(np.array_equal(again["w"].asnumpy(), full_value(10)))
                and bool((again["bias"].asnumpy() == 10).all())}

    from hyper_parallel.core.distributed_checkpoint._file_ops import FileOps  # pylint: disable=import-outside-toplevel
    # pylint: disable-next=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint._manager_record import read_record

    class BlockedCommitOps(FileOps):
        """Once, the commit's rename of metadata.json meets a directory of that name: the kernel refuses it.

        Only the coordinator commits, so only rank 0 meets it; ``step`` limits it to one step directory.
        """

        def __init__(self, step: str | None = None) -> None:
            self.step = step
            self.fired = False

        def replace(self, source: Path, target: Path) -> None:
            target = Path(target)
            if target.name == "metadata.json" and not self.fired and self.step in (None, target.parent.name):
                self.fired = True
                os.mkdir(target)  # rename(2) of a file onto a directory: EISDIR
            super().replace(source, target)

    class ErrorLog(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.ERROR)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    def described(exc: BaseException) -> dict[str, Any]:
        return {"type": type(exc).__name__, "message": str(exc), "io": isinstance(exc, dcp.CheckpointIOError),
                "failed_ranks": list(getattr(exc, "failed_ranks", ()))}

    def commit_failure_is_explained() -> dict[str, Any]:
        path = shared / "c11"
        log = ErrorLog()
        logging.getLogger("hyper_parallel.core.distributed_checkpoint._background_commit").addHandler(log)
        request = dcp.async_save(state(11), storage_writer=dcp.FileSystemWriter(path, file_ops=BlockedCommitOps()))
        out: dict[str, Any] = {"result_ok": isinstance(request.result(), dcp.Metadata)}  # every write succeeded
        try:  # rank 0 waits for its commit and names its failure; rank 1 cannot know it without a step
            dcp.read_metadata(path)
            out["read"] = {}
        except dcp.CheckpointError as exc:
            out["read"] = described(exc)
        local = shared / f"c11_alone_rank{rank}"
        alone = {"bias": mindspore.Tensor(np.full(5, 12, np.float32)), "step": 12}  # no shard of other ranks
        try:  # a save without collectives: the coordinator raises the failed commit here, once
            dcp.save(alone, checkpoint_id=local, use_collectives=False)
            out["alone_first"] = {}
        except dcp.CheckpointError as exc:
            out["alone_first"] = dict(described(exc), saved=local.exists() and any(local.glob("metadata*.json")))
        dcp.save(alone, checkpoint_id=local, use_collectives=False)
        out["alone_second_saved"] = (local / f"metadata.rank{rank:05d}.json").is_file()
        try:  # the next collective step raises it on every rank, and that save does not run
            dcp.save(state(13), checkpoint_id=shared / "c13")
            out["collective"] = {}
        except dcp.CheckpointError as exc:
            out["collective"] = dict(described(exc), committed=(shared / "c13" / "metadata.json").exists())
        out["logged"] = list(log.messages)
        out["uncommitted"] = not (path / "metadata.json").is_file()
        hyper_parallel.platform.barrier()
        if rank == 0:
            os.rmdir(path / "metadata.json")
        hyper_parallel.platform.barrier()

        root = shared / "managed_blocked"  # step 2's commit fails: the manager must not count it as saved
        manager = dcp.CheckpointManager(root, async_save=True, max_to_keep=1,
                                        writer_options={"file_ops": BlockedCommitOps("step_00000002")})
        manager.save(1, state(1))
        manager.save(2, state(2))  # finishes step 1 (committed, retained) first
        try:
            manager.wait()
            out["manager"] = {}
        except dcp.CheckpointError as exc:
            out["manager"] = described(exc)
        out["steps_after_failure"] = manager.all_steps()
        target = zeros()
        out["latest_loaded"] = manager.load(target)
        out["latest_values_ok"] = loaded_ok(target, 1)
        if rank == 0:
            out["recorded_steps"] = sorted(read_record(root).steps)
            os.rmdir(manager.directory(2) / "metadata.json")
        hyper_parallel.platform.barrier()
        manager.save(2, state(2))  # saved again once the cause is gone
        manager.close()
        out["steps_after_resave"] = manager.all_steps()
        return out

    class HeldCommitWriter(dcp.FileSystemWriter):
        """The coordinator's background commit starts 1.5 s late: rank 1 uses what result() returned meanwhile."""

        def finish(self, metadata: Any, results: Any, *, background_cleanup: bool = False) -> Any:
            time.sleep(1.5)
            return super().finish(metadata, results, background_cleanup=background_cleanup)

    def wide(count: int, seed: int) -> dict[str, Any]:
        """``count`` row-sharded tensors: the metadata lists 2 x count chunks."""
        return {f"p{t:03d}": hyper_parallel.DTensor.from_global(
            mindspore.Tensor(np.full((4, 2), seed + t, np.float32)), layout, rank=rank) for t in range(count)}

    def refused(metadata: Any) -> dict[str, Any]:
        try:
            return {"save_id": metadata.storage_meta.save_id}
        except dcp.CheckpointError as exc:
            return {"type": type(exc).__name__, "message": str(exc)}

    def async_result_receipt() -> dict[str, Any]:
        """What result() of a multi-rank async save hands rank 1: a receipt, then the metadata when used."""
        import pickle  # pylint: disable=import-outside-toplevel

        from hyper_parallel import platform  # pylint: disable=import-outside-toplevel

        out: dict[str, Any] = {}
        scatter = platform.scatter_bytes
        received: list[int] = []

        def counted(parts: Any, src: int = 0) -> bytes:
            blob = scatter(parts, src=src)
            received.append(len(blob))
            return blob

        for count in (4, 400):  # (a) result()'s "async write" step (same-length names)
            request = dcp.async_save(wide(count, count), checkpoint_id=shared / f"receipt_{count:03d}")
            _wait_done(request)  # written (rank 0: committed): result() only runs its step
            received.clear()
            platform.scatter_bytes = counted
            try:
                metadata = request.result()
            finally:
                platform.scatter_bytes = scatter
            out[f"received_{count}"] = list(received)
            out[f"kind_{count}"] = type(metadata).__name__
            if rank == 0:  # what every rank received before: the committed metadata itself
                out[f"inline_{count}"] = len(pickle.dumps((metadata, []), protocol=pickle.HIGHEST_PROTOCOL))
            out[f"chunks_{count}"] = sum(len(m.chunks) for m in metadata.state_dict_metadata.values()
                                         if hasattr(m, "chunks"))
        path = shared / "receipt_held"  # (b) the previous save is in place while the commit is held back
        previous = dcp.save(wide(3, 30), checkpoint_id=path).storage_meta.save_id
        metadata = dcp.async_save(wide(3, 40), storage_writer=HeldCommitWriter(path)).result()
        unread = rank == 0 or vars(metadata).get("_loaded", "not a view") is None  # nothing read yet
        start = time.monotonic()
        out["held"] = {"previous": previous, "unread_at_return": unread, "kind": type(metadata).__name__,
                       "save_id": metadata.storage_meta.save_id, "metadata": metadata,
                       "values": sorted(metadata.state_dict_metadata), "waited": time.monotonic() - start}
        target = wide(3, 0)
        dcp.load(target, checkpoint_id=path)
        out["held"]["loaded_ok"] = all(bool((target[f"p{t:03d}"].to_local().asnumpy() == 40 + t).all())
                                       for t in range(3))
        path = shared / "receipt_failed"  # (c) the background commit fails: rank 1's use refuses
        previous = dcp.save(wide(3, 50), checkpoint_id=path).storage_meta.save_id
        metadata = dcp.async_save(wide(3, 60), storage_writer=FailingCommitWriter(path)).result()
        out["failed"] = {"previous": previous, "kind": type(metadata).__name__, "used": refused(metadata)}
        try:  # the next collective step shares the commit's failure (as before)
            dcp.load(wide(3, 0), checkpoint_id=path)
            out["failed"]["settled"] = ""
        except dcp.CheckpointError as exc:
            out["failed"]["settled"] = type(exc).__name__
        path = shared / "receipt_replaced"  # (d) a later save replaces the checkpoint before rank 1 uses it
        metadata = dcp.async_save(wide(3, 70), checkpoint_id=path).result()
        later = dcp.save(wide(3, 80), checkpoint_id=path)
        out["replaced"] = {"kind": type(metadata).__name__, "used": refused(metadata),
                           "later": later.storage_meta.save_id}
        return out

    run_scenarios({"commit_without_result": commit_without_result,
                   "reads_after_result_see_the_commit": reads_after_result_see_the_commit,
                   "failure_reaches_all": failure_reaches_all,
                   "coordinator_failure_reaches_all": coordinator_failure_reaches_all,
                   "result_does_not_wait_for_commit": result_does_not_wait_for_commit,
                   "commit_failure_reaches_all_at_next_step": commit_failure_reaches_all_at_next_step,
                   "manager_reports_lost_lease": manager_reports_lost_lease,
                   "commit_failure_is_explained": commit_failure_is_explained,
                   "async_result_receipt": async_result_receipt})
    # Last: the step must survive a job killed after the save, with no result() on any rank.
    path = shared / "c3"
    request = dcp.async_save(state(3), checkpoint_id=path)
    waited = _wait_done(request)
    (shared / f"rank{rank}.done").write_text(f"{waited:.3f}")
    if rank != 0:  # msrun kills every worker once one dies: let rank 0's done() (its commit) come first
        deadline = time.monotonic() + 120
        while not (shared / "rank0.done").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
