"""A save committing while the ranks of a load read the metadata: refused on every rank, never a mix."""

from __future__ import annotations

from pathlib import Path

from msrun_harness import run_workers

WORKER = Path(__file__).resolve().parent / "workers" / "metadata_race_worker.py"


def test_metadata_of_two_saves_on_two_ranks_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 read the metadata of save 'a' (w = 1), a save of w = 2 committed in place, rank 1 read its metadata:
    each rank read only its own metadata, so rank 0 loaded its rows from the first save and rank 1 from the
    second (the old files were still there), a mixed state no checksum catches. Now the ranks compare save ids
    (the coordinator, on the step that reads the metadata) and every rank raises naming both saves."""
    results = run_workers(WORKER, workers=2, tmp_path=tmp_path)
    for rank in (0, 1):
        assert results[rank]["raced"]["ok"], results[rank]["raced"]
        outcome, values = results[rank]["raced"]["value"]
        assert outcome.startswith("CollectiveCheckpointNotFoundError"), outcome
        assert "replaced by another save while the ranks read its metadata" in outcome and "ranks [0]" in outcome
        assert values == [0.0] * 6  # nothing landed
        assert results[rank]["after"]["value"] == [2.0] * 6
