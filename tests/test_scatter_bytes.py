"""Under msrun each rank receives only its own part of a coordinator's results (tensor scatter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyper_parallel import platform

WORKER = Path(__file__).parent / "workers" / "scatter_worker.py"


def test_scatter_bytes_without_communication_returns_the_first_part():
    assert platform.scatter_bytes([b"abc"]) == b"abc" and platform.scatter_bytes(None) == b""


def test_broadcast_bytes_without_communication_returns_the_data():
    assert platform.broadcast_bytes(b"abc") == b"abc" and platform.broadcast_bytes(None) == b""


@pytest.mark.msrun
@pytest.mark.parametrize("workers", [2, 4])
def test_each_rank_receives_its_own_part(tmp_path: Path, workers: int) -> None:
    from msrun_harness import check_scenarios, run_workers  # pylint: disable=import-outside-toplevel

    results = run_workers(WORKER, workers=workers, tmp_path=tmp_path, timeout=600)
    check_scenarios(results)
    for rank, result in enumerate(results):
        assert result["broadcast_bytes"]["value"] == [b"", bytes(range(250)) * 4]
        assert result["same_part"]["value"] == bytes(range(200)) * 3
        value, error = result["broadcast"]["value"]
        assert value == {"from": 0, "world": workers}
        assert error.startswith("CollectivePlanValidationError") and "coordinator rank 0 refuses" in error, error
        own, error = result["agree"]["value"]
        assert own == rank * 10  # each rank's own value; no rank receives the others'
        assert error.startswith("CollectivePlanValidationError") and f"rank {workers - 1} cannot verify" in error
        assert "verify" in error, error
        assert result["lengths"]["value"] == bytes([rank]) * (rank * 3)
        assert result["all_values"]["value"] == bytes(range(256)) + bytes([rank])
        assert result["squares"]["value"] == rank * rank
        assert f"rank {workers - 1} has no plan" in result["map_fails"]["value"], result["map_fails"]["value"]
        failing = result["failing"]["value"]
        assert failing.startswith("CollectivePlanValidationError"), failing
        assert f"bad plan from {workers} ranks" in failing, failing


def test_a_result_shared_by_every_rank_is_pickled_once():
    import pickle  # pylint: disable=import-outside-toplevel

    # pylint: disable-next=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint._collectives import _pickled_parts

    shared = {"metadata": list(range(100))}
    blobs = _pickled_parts([shared, shared, shared, {"own": 3}])
    assert blobs[0] is blobs[1] is blobs[2] and blobs[3] is not blobs[2]  # scatter_bytes then broadcasts
    assert [pickle.loads(b) for b in blobs] == [(shared, [])] * 3 + [({"own": 3}, [])]
