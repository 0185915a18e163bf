"""msrun worker for ``tests/test_load_metadata_race.py``: a save commits between two ranks' metadata reads.

Checkpoint ``a`` holds ``w`` = 1, ``b`` holds ``w`` = 2, both row-sharded over the 2 ranks. Rank 1 reads the
metadata of ``a`` only after rank 0 has read it and ``b``'s files and metadata were moved into ``a`` (a save
that committed there and has not removed the old files yet). Scenario ``raced``: what the load of ``a`` did on
this rank (the error, or the values this rank's shard received). Scenario ``after``: a load of ``a`` when no
save runs (communication still works).
"""

from __future__ import annotations

import os
import shutil
import time

import numpy as np

from worker_lib import init_worker, run_scenarios, scenario_tmp_dir

__all__ = ["main"]


def main() -> None:
    """Run the scenarios on this rank."""
    rank, _ = init_worker()
    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel
    from hyper_parallel import DTensor, Layout  # pylint: disable=import-outside-toplevel
    import mindspore as ms  # pylint: disable=import-outside-toplevel

    shared = scenario_tmp_dir("race")
    layout = Layout((2,), (0, -1))

    def state(value: float) -> dict:
        return {"w": DTensor.from_global(ms.Tensor(np.full((4, 3), value, np.float32)), layout, rank=rank)}

    dcp.save(state(1.0), checkpoint_id=shared / "a")
    dcp.save(state(2.0), checkpoint_id=shared / "b")
    read_by_0 = shared / "rank0_read"

    class RacedReader(dcp.FileSystemReader):
        """Rank 0 reads, then (rank 1) save ``b`` lands in ``a`` before rank 1 reads."""

        def read_metadata(self, **kwargs):
            if rank == 0:
                metadata = super().read_metadata(**kwargs)
                read_by_0.touch()
                return metadata
            while not read_by_0.exists():
                time.sleep(0.01)
            for name in os.listdir(shared / "b"):
                if name.endswith(".safetensors"):
                    shutil.copy(shared / "b" / name, shared / "a" / name)
            shutil.copy(shared / "b" / "metadata.json", shared / "a" / ".metadata.json.new")
            os.replace(shared / "a" / ".metadata.json.new", shared / "a" / "metadata.json")
            return super().read_metadata(**kwargs)

    def raced() -> tuple[str, list[float]]:
        target = state(0.0)
        try:
            dcp.load(target, storage_reader=RacedReader(shared / "a"))
        except dcp.CheckpointError as exc:
            return f"{type(exc).__name__}: {exc}", target["w"].to_local().asnumpy().ravel().tolist()
        return "loaded", target["w"].to_local().asnumpy().ravel().tolist()

    def after() -> list[float]:
        target = state(0.0)
        dcp.load(target, checkpoint_id=shared / "a")
        return target["w"].to_local().asnumpy().ravel().tolist()

    run_scenarios({"raced": raced, "after": after})


if __name__ == "__main__":
    main()
