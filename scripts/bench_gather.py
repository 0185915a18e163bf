"""What the save's commit receives and holds per chunk, with the index files built by the coordinator or by each rank.

A simulated save of R ranks x T float32 tensors, each split by rows over all
ranks (R x T chunks, as ZeRO-style optimizer sharding makes), committed in
the indexed form (docs/format.md section 12.1) by ``FileSystemWriter.finish``
two ways:

- coordinator-built: every rank sends its write results (one per chunk); the
  coordinator builds and writes every rank's index file, then ``metadata.json``;
- record-only (:mod:`._index_plan`): each rank writes its own index file and
  sends a :class:`.RankIndexSummary`; the coordinator checks the files and
  writes ``metadata.json``.

For ``--ranks`` x each of ``--tensors`` it MEASURES the pickled bytes the
coordinator receives from one rank, and the wall time and peak Python memory
(``tracemalloc``) of the coordinator's part: unpickling what every rank sent,
then the commit; per chunk. Then it MEASURES the record-only
commit itself at ``--large-ranks`` x ``--large-tensors`` (default 10,240 x
10,000, 1.02e8 chunks): the ranks' index files there are stood for by files of
the right length (sparse; above ``VERIFY_INDEX_BYTES`` the commit checks
lengths only), as writing 21 GB of them would measure the disk, not the commit.

Run: ``python scripts/bench_gather.py [--ranks 256] [--tensors 50 200] [--large-ranks 10240]
[--large-tensors 10000] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import tempfile
import time
import tracemalloc
from pathlib import Path

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._format.checksum import ALGORITHM, digest
from hyper_parallel.core.distributed_checkpoint._format.grid_holders import GridHolders
from hyper_parallel.core.distributed_checkpoint._format.rank_index import IndexRecord, index_file_name
from hyper_parallel.core.distributed_checkpoint._grid_chunks import GridChunks
from hyper_parallel.core.distributed_checkpoint._index_plan import (
    IndexPlan,
    RankIndexPlan,
    RankIndexSummary,
    summarise_rank,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemPlanData
from hyper_parallel.core.distributed_checkpoint.metadata import (
    ChunkChecksum,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan
from hyper_parallel.core.distributed_checkpoint.storage import WriteResult

__all__ = ["main"]

#: Rows of each rank's chunk; columns of every tensor.
ROWS, COLS = 4, 16
LENGTH = ROWS * COLS * 4


def _metadata(ranks: int, tensors: int) -> Metadata:
    """The merged plan's metadata: every tensor a grid of one row chunk per rank (as the layout merge makes)."""
    items = {f"layer{t}.weight": TensorStorageMetadata(TensorProperties("float32"), (ROWS * ranks, COLS),
                                                       GridChunks((ROWS * ranks, COLS), (ROWS, COLS)))
             for t in range(tensors)}
    return Metadata(state_dict_metadata=items, storage_meta=StorageMeta(world_size=ranks,
                                                                        bytes_per_rank=(tensors * LENGTH,) * ranks))


def _plan(ranks: int, tensors: int) -> IndexPlan:
    holders = {f"layer{t}.weight": GridHolders(splits=(ranks, 1), base=0, strides=(1, 0)) for t in range(tensors)}
    return IndexPlan(holders=holders, entries=(tensors,) * ranks, inline_keys=frozenset())


def _results(rank: int, tensors: int, save_id: str) -> list[WriteResult]:
    """One rank's write results, as ``write_data`` returns them."""
    return [WriteResult(index=MetadataIndex(f"layer{t}.weight", (rank * ROWS, 0)), size_in_bytes=LENGTH,
                        storage_data=StorageInfo(f"r{rank:05d}_000.{save_id}.safetensors", 4096 + t * LENGTH, LENGTH,
                                                 ChunkChecksum(ALGORITHM, 1 << 20, (f"{rank * tensors + t:016x}",))))
            for t in range(tensors)]


def _writer(path: Path, ranks: int) -> dcp.FileSystemWriter:
    writer = dcp.FileSystemWriter(path, metadata_form="indexed", sync_files=False)
    writer.set_up_storage_writer(True, rank=0, world_size=ranks)
    return writer


def _commit(writer: dcp.FileSystemWriter, metadata: Metadata, sent: list[bytes], *, traced: bool) -> tuple[float, int]:
    """The coordinator's part: unpickle what every rank sent, then ``writer.finish``. Wall seconds, and (traced)
    the peak Python memory of both in bytes."""
    gc.collect()
    if traced:
        tracemalloc.start()
    start = time.perf_counter()
    writer.finish(metadata, [pickle.loads(data) for data in sent])
    seconds = time.perf_counter() - start
    peak = 0
    if traced:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return seconds, peak


def measure(work: Path, ranks: int, tensors: int) -> dict:
    """Both commits of a ``ranks`` x ``tensors`` save: bytes received per rank, commit time and peak memory."""
    chunks = ranks * tensors
    out: dict = {"ranks": ranks, "tensors": tensors, "chunks": chunks}
    for way in ("built", "record_only"):
        figures = {}
        for traced in (False, True):
            path = work / f"{way}_{ranks}_{tensors}_{int(traced)}"
            writer = _writer(path, ranks)
            metadata = _metadata(ranks, tensors)
            if way == "built":
                received = [_results(rank, tensors, writer.save_id) for rank in range(ranks)]
            else:
                plan_data = FileSystemPlanData(save_id=writer.save_id, index=RankIndexPlan(frozenset(), tensors))
                writer.index_plan = _plan(ranks, tensors)
                received, index_seconds = [], 0.0
                for rank in range(ranks):  # each rank's own work, off the coordinator
                    start = time.perf_counter()
                    summary, data = summarise_rank(SavePlan(items=(), storage_data=plan_data),
                                                   _results(rank, tensors, writer.save_id), rank=rank,
                                                   save_id=writer.save_id)
                    (path / summary.record.file).write_bytes(data)
                    index_seconds += time.perf_counter() - start
                    received.append(summary)
                figures["rank_index_s"] = index_seconds / ranks
            sent = [pickle.dumps(message) for message in received]
            del received
            figures["received_bytes_per_rank"] = len(sent[ranks // 2])
            seconds, peak = _commit(writer, metadata, sent, traced=traced)
            figures["peak_bytes" if traced else "commit_s"] = peak if traced else seconds
            del sent, metadata
        figures["received_bytes_per_chunk"] = figures["received_bytes_per_rank"] / tensors
        figures["peak_bytes_per_chunk"] = figures["peak_bytes"] / chunks
        out[way] = figures
    return out


def measure_large(work: Path, ranks: int, tensors: int) -> dict:
    """The record-only commit at a large world: summaries in, ``metadata.json`` out (index files stood for)."""
    out: dict = {"ranks": ranks, "tensors": tensors, "chunks": ranks * tensors}
    length = tensors * 213  # bytes of a rank index of this many entries (scripts/bench_metadata.py)
    zeros = digest(bytes(length))  # what a stand-in file holds (checked when the files are small enough)
    for traced in (False, True):
        path = work / f"large_{int(traced)}"
        writer = _writer(path, ranks)
        writer.index_plan = _plan(ranks, tensors)
        received = []
        for rank in range(ranks):
            name = index_file_name(rank, writer.save_id)
            with open(path / name, "wb") as handle:
                handle.truncate(length)
            received.append(RankIndexSummary(rank=rank, record=IndexRecord(rank, name, length, zeros),
                                             entries=tensors, bytes_written=tensors * LENGTH,
                                             files=(f"r{rank:05d}_000.{writer.save_id}.safetensors",), inline=()))
        sent = [pickle.dumps(message) for message in received]
        del received
        out["received_bytes_per_rank"] = len(sent[ranks // 2])
        seconds, peak = _commit(writer, _metadata(ranks, tensors), sent, traced=traced)
        out["peak_bytes" if traced else "commit_s"] = peak if traced else seconds
        out["metadata_bytes"] = os.stat(path / "metadata.json").st_size
        del sent
    return out


def main(argv: list[str] | None = None) -> None:
    """Measure; print a table (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--tensors", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--large-ranks", type=int, default=10240)
    parser.add_argument("--large-tensors", type=int, default=10000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hp_gather_") as work:
        rows = [measure(Path(work), args.ranks, tensors) for tensors in args.tensors]
        large = measure_large(Path(work), args.large_ranks, args.large_tensors)
    print(f"{'ranks':>6} {'tensors':>7} {'chunks':>9} | {'way':>11} {'recv B/rank':>11} {'B/chunk':>8} "
          f"{'commit s':>8} {'peak MB':>8} {'peak B/chunk':>12}")
    for row in rows:
        for way in ("built", "record_only"):
            f = row[way]
            print(f"{row['ranks']:>6} {row['tensors']:>7} {row['chunks']:>9} | {way:>11} "
                  f"{f['received_bytes_per_rank']:>11} {f['received_bytes_per_chunk']:>8.1f} {f['commit_s']:>8.3f} "
                  f"{f['peak_bytes'] / 1e6:>8.1f} {f['peak_bytes_per_chunk']:>12.1f}")
    print(f"MEASURED record-only commit at {large['ranks']} ranks x {large['tensors']} tensors "
          f"({large['chunks']:,} chunks): {large['commit_s']:.2f} s, "
          f"metadata.json {large['metadata_bytes'] / 1e6:.2f} MB, "
          f"{large['received_bytes_per_rank']} B received per rank, "
          f"peak Python memory {large['peak_bytes'] / 1e6:.0f} MB")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"rows": rows, "large": large}, handle, indent=1)


if __name__ == "__main__":
    main()
