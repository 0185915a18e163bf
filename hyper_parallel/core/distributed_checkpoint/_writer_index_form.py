"""The filesystem writer's metadata forms: in-line storage entries, or rank index files (docs/format.md 12.1).

:class:`IndexFormWriting` is the part of :class:`.FileSystemWriter` (and so of
:class:`.FsspecWriter`, which overrides the three storage calls
:meth:`~IndexFormWriting.bind_indexes`, :meth:`~IndexFormWriting.store_rank_index`
and :meth:`~IndexFormWriting.check_rank_indexes`) that decides which form a
save commits and builds it: at plan time the coordinator decides the form and
the chunk holders (:mod:`._index_plan`); after its data is durable each rank
writes its own index file and sends the coordinator a summary; at the commit
the coordinator checks the files and lists them in ``metadata.json``. A save
that did not decide at plan time (a custom plan) gets the indexes built by the
coordinator from every rank's results (:func:`._index_form.build_indexed`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from hyper_parallel.core.distributed_checkpoint._file_ops import FileOps, write_atomically
from hyper_parallel.core.distributed_checkpoint._format.rank_index import IndexRecord
from hyper_parallel.core.distributed_checkpoint._index_form import build_indexed
from hyper_parallel.core.distributed_checkpoint._index_plan import (
    IndexPlan,
    RankIndexSummary,
    check_stored_indexes,
    inline_results,
    record_only_metadata,
    summarise_rank,
    with_rank_plans,
)
from hyper_parallel.core.distributed_checkpoint._metadata_file import bind_index_files
from hyper_parallel.core.distributed_checkpoint._metadata_form import extra_digests, plan_wants_index, wants_index_form
from hyper_parallel.core.distributed_checkpoint._safe_files import read_regular
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointIOError
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, MetadataIndex, StorageInfo
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan
from hyper_parallel.core.distributed_checkpoint.storage import WriteResult

__all__ = ["MAX_RECORD_BYTES", "IndexFormWriting"]

#: Largest results record or index file of one rank that is read (one entry per item it wrote).
MAX_RECORD_BYTES = 1 << 30


class IndexFormWriting:
    """The metadata-form methods of the filesystem writer (see the module docstring).

    The writer sets these attributes: ``path``, ``rank``, ``rank_local``,
    ``save_id``, ``backend_name``, ``metadata_form``, ``checksum_block_bytes``, ``tile_checksums``,
    ``compression``, ``sync_files``, ``file_ops`` and ``index_plan`` (the holders decided at plan
    time, or ``None``).
    """

    path: Any
    rank: int
    rank_local: bool
    save_id: str
    metadata_form: str
    checksum_block_bytes: int
    tile_checksums: bool
    compression: str | None
    sync_files: bool
    file_ops: FileOps
    index_plan: IndexPlan | None
    backend_name: str

    def committed_metadata(self, metadata: Metadata, results: list[list[WriteResult]]) -> Metadata:
        """The metadata :meth:`finish` commits: every rank's storage entries, this save's id. Coordinator; pure.

        When every rank wrote its own index and sent a :class:`.RankIndexSummary` instead of its results, the
        indexed metadata listing those files (the grid tensors' holders from the plan)."""
        storage_data: dict[MetadataIndex, StorageInfo] = {}
        for rank_results in results:
            for result in inline_results(rank_results):
                key = MetadataIndex(result.index.fqn, result.index.offset)
                storage_data.setdefault(key, result.storage_data)
        committed = metadata.replace(
            storage_data=storage_data,
            storage_meta=replace(metadata.storage_meta, backend=self.backend_name, save_id=self.save_id),
        )
        if results and isinstance(results[0], RankIndexSummary):
            committed = record_only_metadata(
                committed, results, self.index_plan, save_id=self.save_id)  # type: ignore[arg-type]
            return self.bind_indexes(committed)
        return committed

    def indexed_metadata(self, committed: Metadata, results: list[list[WriteResult]]) -> tuple[Metadata, list[Any]]:
        """``committed`` in the form ``metadata_form`` picks, and the rank index files to write first. Coordinator.

        Returns:
            The metadata to commit and ``(IndexRecord, bytes)`` of each index file (none in the in-line form).
        """
        if results and isinstance(results[0], RankIndexSummary):  # every rank wrote its own index: check the files
            self.check_rank_indexes(list(committed.storage_data.records.values()))  # type: ignore[union-attr]
            return committed, []
        storage = committed.storage_data or {}
        # The digests are counted only when they may matter.
        wanted = self.index_plan is not None or wants_index_form(self.metadata_form, len(storage)) or (
            self.metadata_form == "auto" and wants_index_form("auto", len(storage), extra_digests(storage)))
        if self.rank_local or not wanted:
            return committed, []
        committed, files = build_indexed(committed, results, save_id=self.save_id)
        return self.bind_indexes(committed), files

    def bind_indexes(self, committed: Metadata) -> Metadata:
        """Let the indexed metadata handed to every rank read the index files of this directory. Coordinator."""
        if isinstance(self.path, Path):
            bind_index_files(committed, self.path)
        return committed

    def wants_rank_indexes(self, metadata: Metadata) -> bool:
        """Whether the save of ``metadata`` commits the indexed form, decided at plan time (``metadata_form``, or
        its size estimated from the plan). Coordinator."""
        return not self.rank_local and plan_wants_index(self.metadata_form, metadata,
                                                        block_bytes=self.checksum_block_bytes,
                                                        tiles=self.tile_checksums and not self.compression)

    def use_index_plan(self, plans: list[SavePlan], plan: IndexPlan) -> list[SavePlan]:
        """Commit this save from rank index summaries; stamp each rank's plan with its part. Coordinator."""
        self.index_plan = plan
        return with_rank_plans(plans, plan)

    def write_rank_index(self, plan: SavePlan, results: list[WriteResult]) -> RankIndexSummary:
        """Write this rank's index file durably (after its data is durable); return what the coordinator needs.

        All ranks of a save whose plan carries :attr:`FileSystemPlanData.index`.

        Raises:
            CheckpointIOError: the file cannot be written.
            CheckpointValueError: the results disagree with the plan.
        """
        self.save_id = plan.storage_data.save_id  # also in a forked writer's parent (its child wrote the data)
        summary, data = summarise_rank(plan, results, rank=self.rank, save_id=self.save_id)
        if summary.record is not None:
            self.store_rank_index(summary.record, data)  # type: ignore[arg-type]
        return summary

    def store_rank_index(self, record: IndexRecord, data: bytes) -> None:
        """Write one index file atomically and (with ``sync_files``) durably. The rank it belongs to."""
        try:
            write_atomically(self.path / record.file, data, sync=self.sync_files, tag=self.save_id, ops=self.file_ops)
        except OSError as exc:
            raise CheckpointIOError(f"rank {self.rank}: writing its index file {self.path / record.file} failed: "
                                    f"{exc}") from exc

    def check_rank_indexes(self, records: list[IndexRecord]) -> None:
        """The index files the ranks wrote have the lengths and digests they reported. Coordinator."""
        check_stored_indexes(records, size_of=lambda name: os.lstat(self.path / name).st_size,
                             read=lambda name: read_regular(self.path / name, limit=MAX_RECORD_BYTES),
                             where=str(self.path))

