"""Metadata at scale: its size, ``read_metadata`` time and one rank's load planning, as the world grows.

Builds, in one process, the committed metadata of a checkpoint saved by R
ranks with T tensors each, every tensor split along dim 0 over all ranks (so
R x T chunks, each with a storage entry and a checksum), writes it as
``metadata.json``, and times ``dcp.read_metadata`` (parse and checks) and one
rank's load planning (``StandardLoadPlanner`` configure + local plan) for
the same layout, reporting microseconds per chunk. The contract asks for
10,240 ranks x 10,000 tensors; the chunk-per-rank metadata of this format
grows linearly with R x T (about 10^8 entries there, tens of GB of JSON),
so the script measures smaller worlds and prints the linear extrapolation.

Run: ``python scripts/bench_metadata.py [--ranks 16 64 256] [--tensors 1000] [--target-ranks 10240]
[--target-tensors 10000] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import numpy as np

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._format.checksum import ALGORITHM
from hyper_parallel.core.distributed_checkpoint._format.metadata_json import metadata_to_json
from hyper_parallel.core.distributed_checkpoint.metadata import (
    ChunkChecksum,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

__all__ = ["make_metadata", "main"]

#: Rows of each rank's chunk; columns of every tensor.
ROWS, COLS = 4, 16


def make_metadata(ranks: int, tensors: int) -> Metadata:
    """Metadata of ``tensors`` float32 tensors of shape (ROWS * ranks, COLS), one row chunk per rank."""
    items, storage = {}, {}
    length = ROWS * COLS * 4
    digest = "0" * 16
    for t in range(tensors):
        fqn = f"layer{t}.weight"
        chunks = tuple(ChunkStorageMetadata((r * ROWS, 0), (ROWS, COLS)) for r in range(ranks))
        items[fqn] = TensorStorageMetadata(TensorProperties("float32"), (ROWS * ranks, COLS), chunks)
        for r in range(ranks):
            storage[MetadataIndex(fqn, (r * ROWS, 0))] = StorageInfo(
                relative_path=f"r{r:05d}_000.000000000000.safetensors", offset=4096 + t * length, length=length,
                checksum=ChunkChecksum(ALGORITHM, 1 << 20, (digest,)))
    return Metadata(state_dict_metadata=items, storage_data=storage,
                    storage_meta=StorageMeta(world_size=ranks, bytes_per_rank=(tensors * length,) * ranks))


def _rank_plan_seconds(metadata: Metadata, ranks: int, tensors: int, rank: int) -> float:
    """One rank's load planning: its row chunk of every tensor as the target."""
    from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardLoadPlanner  # noqa: PLC0415

    state = {f"layer{t}.weight": dcp.ShardedTensor.from_rank_offsets(
        f"layer{t}.weight", np.zeros((ROWS, COLS), np.float32), (0, rank, ranks)) for t in range(tensors)}
    planner = StandardLoadPlanner()
    start = time.perf_counter()
    planner.configure_planner(state, metadata, rank=rank, world_size=ranks, is_coordinator=rank == 0)
    plan = planner.build_local_plan()
    seconds = time.perf_counter() - start
    if len(plan.items) != tensors:
        raise RuntimeError(f"rank {rank} planned {len(plan.items)} reads for {tensors} tensors")
    return seconds


def main(argv: list[str] | None = None) -> None:
    """Measure each world size; print a table with the extrapolation (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--target-ranks", type=int, default=10240)
    parser.add_argument("--target-tensors", type=int, default=10000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hp_meta_") as work:
        for ranks in args.ranks:
            metadata = make_metadata(ranks, args.tensors)
            path = Path(work) / f"w{ranks}"
            path.mkdir()
            (path / "metadata.json").write_bytes(metadata_to_json(metadata))
            size = (path / "metadata.json").stat().st_size
            del metadata
            gc.collect()
            start = time.perf_counter()
            read = dcp.read_metadata(path)
            read_seconds = time.perf_counter() - start
            plan_seconds = _rank_plan_seconds(read, ranks, args.tensors, rank=ranks // 2)
            chunks = ranks * args.tensors
            rows.append({"ranks": ranks, "tensors": args.tensors, "chunks": chunks, "metadata_bytes": size,
                         "read_metadata_s": read_seconds, "rank_load_planning_s": plan_seconds,
                         "bytes_per_chunk": size / chunks, "read_us_per_chunk": read_seconds / chunks * 1e6,
                         "planning_us_per_tensor": plan_seconds / args.tensors * 1e6})
            del read
            (path / "metadata.json").unlink()
    last = rows[-1]
    target_chunks = args.target_ranks * args.target_tensors
    extrapolated = {"ranks": args.target_ranks, "tensors": args.target_tensors, "chunks": target_chunks,
                    "metadata_bytes": last["bytes_per_chunk"] * target_chunks,
                    "read_metadata_s": last["read_us_per_chunk"] * target_chunks / 1e6,
                    "rank_load_planning_s": last["planning_us_per_tensor"] * args.target_tensors / 1e6}
    print(f"{'ranks':>6} {'tensors':>7} {'chunks':>9} {'metadata MB':>11} {'B/chunk':>7} {'read s':>7} "
          f"{'us/chunk':>8} {'rank plan s':>11} {'us/tensor':>9}")
    for row in rows:
        print(f"{row['ranks']:>6} {row['tensors']:>7} {row['chunks']:>9} {row['metadata_bytes'] / 1e6:>11.1f} "
              f"{row['bytes_per_chunk']:>7.0f} {row['read_metadata_s']:>7.2f} {row['read_us_per_chunk']:>8.2f} "
              f"{row['rank_load_planning_s']:>11.3f} {row['planning_us_per_tensor']:>9.1f}")
    print(f"extrapolated to {args.target_ranks} ranks x {args.target_tensors} tensors (linear in chunks): "
          f"metadata {extrapolated['metadata_bytes'] / 1e9:.1f} GB, read_metadata "
          f"{extrapolated['read_metadata_s']:.0f} s, one rank's load planning {extrapolated['rank_load_planning_s']:.1f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"measured": rows, "extrapolated": extrapolated}, handle, indent=2)


if __name__ == "__main__":
    main()
