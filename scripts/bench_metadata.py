"""Metadata at scale: its size, ``read_metadata`` time and one rank's load planning, as the world grows.

Builds, in one process, the committed metadata of a checkpoint saved by R
ranks with T tensors each, every tensor split along dim 0 over all ranks (so
R x T chunks, each with a storage entry and a checksum), writes it as
``metadata.json``, and times ``dcp.read_metadata`` (parse and checks) and one
rank's load planning (``StandardLoadPlanner`` configure + local plan) for
the same layout, reporting microseconds per chunk. The contract asks for
10,240 ranks x 10,000 tensors; the chunk-per-rank metadata of this format
grows linearly with R x T (about 10^8 entries there, tens of GB of JSON),
so the script measures smaller worlds, fits ``cost = a + b * chunks`` by least
squares to the measured sizes (metadata bytes, ``read_metadata`` seconds, peak
and retained resident memory of the read) and prints the fit, each size's
deviation from it, and the EXTRAPOLATED figures for the target world. A rank's
load planning is reported per tensor: it finds its chunks by binary search in
each tensor's sorted chunk list (an index, not a scan), so its time per tensor
stays flat as the world grows.

The indexed form (format 2.1, docs/format.md section 12.1) is MEASURED at the
target world itself: the metadata of ``--indexed-ranks`` x ``--indexed-tensors``
grid tensors is built by the commit's own builder (holders fitted by
``fit_holders``, ``indexed_metadata``, ``metadata_to_json``; the in-line
form's metadata would be the extrapolated size above), written with the
index files of the ranks the measured loads read (the other ranks' records
stand for index files of the same length that nothing reads), and the script
reports its size, ``read_metadata`` time and peak memory, and the load
planning of one rank loading its own shard and of one rank of a resharded
load (half the ranks, two holders each): the planner's time (chunks found by
division) and the storage lookups of its plan (reading and checking the
holders' index files).

The commit itself (``FileSystemWriter.finish``: encoding and writing the
metadata, and in the indexed form every rank's index file, from every rank's
write results) is MEASURED for ``--commit-ranks`` x ``--commit-tensors`` in
both forms, with the bytes of write results the coordinator gathers per chunk.

Run: ``python scripts/bench_metadata.py [--ranks 16 64 256] [--tensors 1000] [--target-ranks 10240]
[--target-tensors 10000] [--indexed-ranks 10240] [--indexed-tensors 10000] [--commit-ranks 1024]
[--commit-tensors 500] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

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
    """One rank's load planning (CPU seconds of this thread): its row chunk of every tensor as the target."""
    from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardLoadPlanner  # noqa: PLC0415

    state = {f"layer{t}.weight": dcp.ShardedTensor.from_rank_offsets(
        f"layer{t}.weight", np.zeros((ROWS, COLS), np.float32), (0, rank, ranks)) for t in range(tensors)}
    planner = StandardLoadPlanner()
    start = time.thread_time()
    planner.configure_planner(state, metadata, rank=rank, world_size=ranks, is_coordinator=rank == 0)
    plan = planner.build_local_plan()
    seconds = time.thread_time() - start
    if len(plan.items) != tensors:
        raise RuntimeError(f"rank {rank} planned {len(plan.items)} reads for {tensors} tensors")
    return seconds


def _read_with_memory(path: Path) -> tuple[Metadata, float, float, int, int]:
    """``dcp.read_metadata(path)`` with its wall and CPU seconds.

    Also its peak and retained resident-memory growth, in bytes.
    """
    process = psutil.Process()
    gc.collect()
    base = process.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start, cpu_start = time.perf_counter(), time.thread_time()
    read = dcp.read_metadata(path)
    seconds, cpu_seconds = time.perf_counter() - start, time.thread_time() - cpu_start
    stop.set()
    sampler.join()
    gc.collect()
    retained = process.memory_info().rss
    return read, seconds, cpu_seconds, max(peak[0], retained) - base, retained - base


def _plan_and_lookup(metadata: Metadata, fqns: list[str], rows: int, rank: int, world: int) -> tuple[float, float, int]:
    """One rank's load planning of ``rows`` rows of every tensor at ``rank * rows``: planner CPU seconds, CPU seconds
    of its plan's storage lookups (the index files they read), reads planned."""
    from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardLoadPlanner  # noqa: PLC0415

    state = {fqn: dcp.ShardedTensor.from_rank_offsets(fqn, np.zeros((rows, COLS), np.float32), (0, rank, world))
             for fqn in fqns}
    planner = StandardLoadPlanner()
    start = time.thread_time()
    planner.configure_planner(state, metadata, rank=rank, world_size=world, is_coordinator=rank == 0)
    plan = planner.build_local_plan()
    planned = time.thread_time() - start
    start = time.thread_time()
    lookup = metadata.storage_data.lookup  # type: ignore[union-attr]
    for item in plan.items:
        if lookup(item.storage_index.fqn, tuple(item.storage_index.offset)) is None:
            raise RuntimeError(f"no storage entry for {item.storage_index}")
    return planned, time.thread_time() - start, len(plan.items)


def measure_indexed(work: Path, ranks: int, tensors: int) -> dict:
    """The indexed form of ``ranks`` x ``tensors`` (one row chunk per rank and tensor), measured."""
    # pylint: disable=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint._format.grid_holders import fit_holders
    from hyper_parallel.core.distributed_checkpoint._format.rank_index import IndexRecord, index_file_name
    from hyper_parallel.core.distributed_checkpoint._grid_chunks import GridChunks
    from hyper_parallel.core.distributed_checkpoint._index_form import index_files, indexed_metadata

    save_id = "0123456789ab"
    length = ROWS * COLS * 4
    fqns = [f"layer{t}.weight" for t in range(tensors)]
    items = {fqn: TensorStorageMetadata(TensorProperties("float32"), (ROWS * ranks, COLS),
                                        GridChunks((ROWS * ranks, COLS), (ROWS, COLS))) for fqn in fqns}
    metadata = Metadata(state_dict_metadata=items, storage_meta=StorageMeta(
        save_id=save_id, world_size=ranks, bytes_per_rank=(tensors * length,) * ranks))
    own, reshard = ranks // 2, ranks // 4 + 1  # the reshard rank reads the chunks of ranks 2k and 2k + 1
    read_ranks = sorted({own, 2 * reshard, 2 * reshard + 1})
    per_rank = {r: {(fqn, (r * ROWS, 0)): StorageInfo(
        relative_path=f"r{r:05d}_000.{save_id}.safetensors", offset=4096 + t * length, length=length,
        checksum=ChunkChecksum(ALGORITHM, 1 << 20, (f"{t:016x}",))) for t, fqn in enumerate(fqns)} for r in read_ranks}
    start = time.process_time()
    holders = {fqn: fit_holders((ranks, 1), range(ranks)) for fqn in fqns}  # as the commit fits each tensor's
    files = dict((record.rank, (record, data)) for record, data in index_files(per_rank, save_id=save_id))
    sample = files[own][0]
    records = tuple(files[r][0] if r in files else IndexRecord(r, index_file_name(r, save_id), sample.length, "0" * 16)
                    for r in range(ranks))
    encoded = metadata_to_json(indexed_metadata(metadata, holders=holders, inline={}, records=records, save_id=save_id))
    build_seconds = time.process_time() - start
    path = work / "indexed"
    path.mkdir()
    (path / "metadata.json").write_bytes(encoded)
    for record, data in files.values():
        (path / record.file).write_bytes(data)
    del metadata, holders, encoded
    gc.collect()
    read, read_seconds, read_cpu, peak_rss, retained_rss = _read_with_memory(path)
    own_plan, own_lookup, own_reads = _plan_and_lookup(read, fqns, ROWS, own, ranks)
    re_plan, re_lookup, re_reads = _plan_and_lookup(read, fqns, 2 * ROWS, reshard, ranks // 2)
    if own_reads != tensors or re_reads != 2 * tensors:
        raise RuntimeError(f"planned {own_reads} and {re_reads} reads for {tensors} tensors")
    chunks = ranks * tensors
    size = (path / "metadata.json").stat().st_size
    return {"label": "MEASURED", "ranks": ranks, "tensors": tensors, "chunks": chunks, "metadata_bytes": size,
            "metadata_bytes_per_chunk": size / chunks, "index_file_bytes": sample.length,
            "index_bytes_per_chunk": sample.length / tensors, "build_cpu_s": build_seconds,
            "read_metadata_s": read_seconds, "read_metadata_cpu_s": read_cpu, "read_peak_rss_bytes": peak_rss,
            "read_retained_rss_bytes": retained_rss, "own_shard_planning_s": own_plan,
            "own_shard_lookup_s": own_lookup, "reshard_planning_s": re_plan, "reshard_lookup_s": re_lookup,
            "index_files_read_own": 1, "index_files_read_reshard": 2}


def measure_commit(work: Path, ranks: int, tensors: int) -> dict:
    """The coordinator's commit of a ``ranks`` x ``tensors`` save (one row chunk per rank and tensor), in each form.

    Every rank's write results are built as ``write_data`` returns them and handed to
    ``FileSystemWriter.finish`` (the commit itself: index files, ``metadata.json``); the data files are not
    written (the commit does not read them). Reports the commit's CPU and wall seconds, the bytes it
    writes, and the pickled bytes the coordinator receives from the ranks (the gather; unchanged by the form).
    """
    # pylint: disable=import-outside-toplevel
    import pickle

    from hyper_parallel.core.distributed_checkpoint.storage import WriteResult

    length = ROWS * COLS * 4
    out = {"ranks": ranks, "tensors": tensors, "chunks": ranks * tensors}
    for form in ("inline", "indexed"):
        path = work / f"commit_{form}"
        writer = dcp.FileSystemWriter(path, metadata_form=form, sync_files=False)
        writer.set_up_storage_writer(True, rank=0, world_size=ranks)
        save_id = writer.save_id
        metadata = make_metadata(ranks, tensors)
        digest = ("0" * 16,)
        results = [[WriteResult(index=MetadataIndex(f"layer{t}.weight", (r * ROWS, 0)), size_in_bytes=length,
                                storage_data=StorageInfo(f"r{r:05d}_000.{save_id}.safetensors", 4096 + t * length,
                                                         length, ChunkChecksum(ALGORITHM, 1 << 20, digest)))
                    for t in range(tensors)] for r in range(ranks)]
        if form == "inline":
            out["gathered_bytes_per_chunk"] = len(pickle.dumps(results[0])) / tensors
        metadata = metadata.replace(storage_data=None)
        gc.collect()
        start, cpu = time.perf_counter(), time.process_time()
        writer.finish(metadata, results)
        out[f"{form}_commit_s"] = time.perf_counter() - start
        out[f"{form}_commit_cpu_s"] = time.process_time() - cpu
        out[f"{form}_metadata_bytes"] = (path / "metadata.json").stat().st_size
        out[f"{form}_index_bytes"] = sum(p.stat().st_size for p in path.glob("r*_index.*.json"))
        del results, metadata
        gc.collect()
    return out


def _fit(xs: list[float], ys: list[float]) -> dict:
    """Least-squares ``y = intercept + slope * x`` and each point's relative deviation from it."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1) if len(xs) > 1 else (
        ys[0] / xs[0], 0.0)
    deviations = [abs(y - (intercept + slope * x)) / y if y else 0.0 for x, y in zip(xs, ys)]
    return {"slope": float(slope), "intercept": float(intercept), "max_relative_deviation": max(deviations)}


def main(argv: list[str] | None = None) -> None:
    """Measure each world size; print a table with the extrapolation (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--target-ranks", type=int, default=10240)
    parser.add_argument("--target-tensors", type=int, default=10000)
    parser.add_argument("--indexed-ranks", type=int, default=10240)
    parser.add_argument("--indexed-tensors", type=int, default=10000)
    parser.add_argument("--commit-ranks", type=int, default=1024)
    parser.add_argument("--commit-tensors", type=int, default=500)
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
            read, read_seconds, read_cpu, peak_rss, retained_rss = _read_with_memory(path)
            plan_seconds = _rank_plan_seconds(read, ranks, args.tensors, rank=ranks // 2)
            chunks = ranks * args.tensors
            rows.append({"ranks": ranks, "tensors": args.tensors, "chunks": chunks, "metadata_bytes": size,
                         "read_metadata_s": read_seconds, "read_metadata_cpu_s": read_cpu,
                         "rank_load_planning_s": plan_seconds,
                         "bytes_per_chunk": size / chunks,
                         "read_peak_rss_bytes": peak_rss, "read_retained_rss_bytes": retained_rss,
                         "read_peak_rss_per_file_byte": peak_rss / size,
                         "read_retained_rss_per_file_byte": retained_rss / size,
                         "read_us_per_chunk": read_seconds / chunks * 1e6,
                         "planning_us_per_tensor": plan_seconds / args.tensors * 1e6})
            del read
            (path / "metadata.json").unlink()
        indexed = measure_indexed(Path(work), args.indexed_ranks, args.indexed_tensors)
        commit = measure_commit(Path(work), args.commit_ranks, args.commit_tensors)
    target_chunks = args.target_ranks * args.target_tensors
    chunk_counts = [row["chunks"] for row in rows]
    fits = {name: _fit(chunk_counts, [row[name] for row in rows]) for name in
            ("metadata_bytes", "read_metadata_s", "read_metadata_cpu_s", "read_peak_rss_bytes",
             "read_retained_rss_bytes")}
    planning = [row["planning_us_per_tensor"] for row in rows]
    extrapolated = {"label": "EXTRAPOLATED from the least-squares linear fit over the measured sizes",
                    "ranks": args.target_ranks, "tensors": args.target_tensors, "chunks": target_chunks,
                    **{name: fit["intercept"] + fit["slope"] * target_chunks for name, fit in fits.items()},
                    "rank_load_planning_s": max(planning) * args.target_tensors / 1e6}
    print(f"{'ranks':>6} {'tensors':>7} {'chunks':>9} {'metadata MB':>11} {'B/chunk':>7} {'read s':>7} "
          f"{'us/chunk':>8} {'peak/file':>9} {'kept/file':>9} {'rank plan s':>11} {'us/tensor':>9}")
    for row in rows:
        print(f"{row['ranks']:>6} {row['tensors']:>7} {row['chunks']:>9} {row['metadata_bytes'] / 1e6:>11.1f} "
              f"{row['bytes_per_chunk']:>7.0f} {row['read_metadata_s']:>7.2f} {row['read_us_per_chunk']:>8.2f} "
              f"{row['read_peak_rss_per_file_byte']:>9.2f} {row['read_retained_rss_per_file_byte']:>9.2f} "
              f"{row['rank_load_planning_s']:>11.3f} {row['planning_us_per_tensor']:>9.1f}")
    for name, fit in fits.items():
        print(f"linear fit {name}: {fit['slope']:.4g} per chunk + {fit['intercept']:.4g}, "
              f"max deviation of a measured size {fit['max_relative_deviation']:.1%}")
    print(f"rank load planning per tensor across sizes: {min(planning):.1f} to {max(planning):.1f} us "
          f"(largest / smallest world: {planning[-1] / planning[0]:.2f}x for "
          f"{chunk_counts[-1] / chunk_counts[0]:.0f}x the chunks)")
    print(f"MEASURED indexed form (format 2.1) at {indexed['ranks']} ranks x {indexed['tensors']} tensors "
          f"({indexed['chunks']:,} chunks): metadata.json {indexed['metadata_bytes'] / 1e6:.2f} MB "
          f"({indexed['metadata_bytes_per_chunk']:.3f} B/chunk; "
          f"one rank index {indexed['index_file_bytes'] / 1e6:.2f} MB, "
          f"{indexed['index_bytes_per_chunk']:.0f} B/chunk, read only by the ranks that need it), built in "
          f"{indexed['build_cpu_s']:.2f} s CPU; read_metadata {indexed['read_metadata_s']:.3f} s "
          f"(CPU {indexed['read_metadata_cpu_s']:.3f} s, peak memory +{indexed['read_peak_rss_bytes'] / 1e6:.0f} MB); "
          f"one rank's load planning, own shard: planner {indexed['own_shard_planning_s']:.3f} s + storage lookups "
          f"{indexed['own_shard_lookup_s']:.3f} s (1 index file read); resharded (2 holders): planner "
          f"{indexed['reshard_planning_s']:.3f} s + lookups {indexed['reshard_lookup_s']:.3f} s (2 index files)")
    print(f"MEASURED commit (FileSystemWriter.finish) of {commit['ranks']} ranks x {commit['tensors']} tensors "
          f"({commit['chunks']:,} chunks): in-line {commit['inline_commit_s']:.2f} s (CPU "
          f"{commit['inline_commit_cpu_s']:.2f} s), metadata.json {commit['inline_metadata_bytes'] / 1e6:.1f} MB; "
          f"indexed {commit['indexed_commit_s']:.2f} s (CPU {commit['indexed_commit_cpu_s']:.2f} s), metadata.json "
          f"{commit['indexed_metadata_bytes'] / 1e6:.3f} MB + "
          f"index files {commit['indexed_index_bytes'] / 1e6:.1f} MB; "
          f"the coordinator gathers {commit['gathered_bytes_per_chunk']:.0f} B per chunk of write results "
          "in both forms")
    print(f"EXTRAPOLATED in-line form, for comparison (linear fit) to {args.target_ranks} ranks x "
          f"{args.target_tensors} tensors: "
          f"metadata {extrapolated['metadata_bytes'] / 1e9:.1f} GB, read_metadata "
          f"{extrapolated['read_metadata_s']:.0f} s (CPU {extrapolated['read_metadata_cpu_s']:.0f} s), "
          f"read peak memory {extrapolated['read_peak_rss_bytes'] / 1e9:.1f} GB, "
          f"one rank's load planning {extrapolated['rank_load_planning_s']:.1f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"measured": rows, "fits": fits, "extrapolated": extrapolated, "indexed": indexed,
                       "commit": commit}, handle, indent=2)


if __name__ == "__main__":
    main()
