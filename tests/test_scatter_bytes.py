"""Under msrun each rank receives only its own part of a coordinator's results (tensor scatter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyper_parallel import platform

WORKER = Path(__file__).parent / "workers" / "scatter_worker.py"


def test_scatter_bytes_without_communication_returns_the_first_part():
    assert platform.scatter_bytes([b"abc"]) == b"abc" and platform.scatter_bytes(None) == b""


@pytest.mark.msrun
def test_each_rank_receives_its_own_part_on_four_ranks(tmp_path: Path) -> None:
    from msrun_harness import check_scenarios, run_workers  # pylint: disable=import-outside-toplevel

    results = run_workers(WORKER, workers=4, tmp_path=tmp_path, timeout=600)
    check_scenarios(results)
    for rank, result in enumerate(results):
        assert result["lengths"]["value"] == bytes([rank]) * (rank * 3)
        assert result["all_values"]["value"] == bytes(range(256)) + bytes([rank])
        assert result["squares"]["value"] == rank * rank
        assert "rank 3 has no plan" in result["map_fails"]["value"], result["map_fails"]["value"]
        failing = result["failing"]["value"]
        assert failing.startswith("CollectivePlanValidationError") and "bad plan from 4 ranks" in failing, failing
