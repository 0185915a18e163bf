"""How the coordinator's planning grows with the number of ranks.

Builds, in one process, the local save plans of N simulated ranks holding
``--tensors`` tensors each (half replicated on every rank, half sharded along
dim 0 across all ranks) and times the coordinator's merge
(deduplication, validation, metadata) for N in ``--ranks``. Each rank's plan is
pickled on its own and unpickled on its own, as it arrives over the wire (no
objects shared between ranks). Prints seconds, microseconds per item, the
growth factor against the item count, and the bytes a rank sends and a
non-coordinator rank receives with an all-gather exchange and with a
gather + scatter exchange.

Run: ``python scripts/bench_planning.py [--ranks 64 256 1024 4096 10240] [--tensors 1000]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import time

from hyper_parallel.core.distributed_checkpoint._global_plan import build_global_save_plan
from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType


__all__ = ["make_plans", "main"]

def make_plans(ranks: int, tensors: int) -> list[SavePlan]:
    """Local plans of ``ranks`` ranks, each with ``tensors`` items."""
    props = TensorProperties(dtype="float32")
    replicated = [
        WriteItem(index=MetadataIndex(f"rep.{i}", (0, 0)), type=WriteItemType.TENSOR,
                  tensor_data=TensorWriteData(ChunkStorageMetadata((0, 0), (64, 64)), props, (64, 64)))
        for i in range(tensors // 2)
    ]
    plans = []
    for rank in range(ranks):
        sharded = [
            WriteItem(index=MetadataIndex(f"shard.{i}", (rank * 8, 0)), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(ChunkStorageMetadata((rank * 8, 0), (8, 64)), props,
                                                  (ranks * 8, 64)))
            for i in range(tensors - tensors // 2)
        ]
        plans.append(SavePlan(items=tuple(replicated + sharded)))
    return plans


def _exchange(plans: list[SavePlan]) -> tuple[list[bytes], float, list[SavePlan]]:
    """Each rank's plan pickled on its own (what a rank sends) and unpickled one by one (what the coordinator
    receives: separate objects, no sharing between ranks). Returns blobs, unpickling seconds and plans."""
    blobs = [pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL) for plan in plans]
    gc.disable()  # as in dcp.save, which pauses the cyclic GC while it runs
    try:
        start = time.perf_counter()
        received = [pickle.loads(blob) for blob in blobs]
        return blobs, time.perf_counter() - start, received
    finally:
        gc.enable()


def main(argv: list[str] | None = None) -> None:
    """Time the exchange and the merge for each rank count; print a table (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096, 10240])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    for ranks in args.ranks:
        blobs, unpickle_seconds, plans = _exchange(make_plans(ranks, args.tensors))
        gc.collect()
        start = time.perf_counter()
        final, metadata = build_global_save_plan(plans)
        seconds = time.perf_counter() - start
        # What each rank gets back: its kept items as a bitmask over its own plan (the library's delta).
        deltas = [pickle.dumps((bytes((len(plan.items) + 7) // 8), f.storage_data), protocol=pickle.HIGHEST_PROTOCOL)
                  for plan, f in zip(plans, final)]
        items = ranks * args.tensors
        rows.append({
            "ranks": ranks, "items": items, "seconds": seconds, "us_per_item": seconds / items * 1e6,
            "unpickle_seconds": unpickle_seconds,
            "written_items": sum(len(plan.items) for plan in final), "tensors": len(metadata.state_dict_metadata),
            "bytes_sent_per_rank": max(len(blob) for blob in blobs),
            # all_gather of every plan, then all_gather of the coordinator's list of every delta:
            "bytes_received_per_noncoordinator_rank_allgather": sum(map(len, blobs)) + sum(map(len, deltas)),
            # gather to the coordinator, then a scatter of each rank's own delta:
            "bytes_received_per_noncoordinator_rank_scatter": max(map(len, deltas)),
            # what the library does now: plans by a tensor gather (a rank receives the 8-byte longest length),
            # each rank's own result by a tensor scatter (8-byte length + one row of the longest result + 8):
            "bytes_received_per_noncoordinator_rank_library": 8 + 16 + max(map(len, deltas)),
        })
        del plans, final, metadata
    base = rows[0]
    print(f"{'ranks':>6} {'items':>9} {'merge s':>8} {'us/item':>8} {'time x':>7} {'items x':>7} {'unpickle s':>10} "
          f"{'sent B/rank':>11} {'recv B all-gather':>17} {'recv B scatter':>14}")
    for row in rows:
        print(f"{row['ranks']:>6} {row['items']:>9} {row['seconds']:>8.2f} {row['us_per_item']:>8.2f} "
              f"{row['seconds'] / base['seconds']:>7.1f} {row['items'] / base['items']:>7.1f} "
              f"{row['unpickle_seconds']:>10.2f} {row['bytes_sent_per_rank']:>11} "
              f"{row['bytes_received_per_noncoordinator_rank_allgather']:>17} "
              f"{row['bytes_received_per_noncoordinator_rank_scatter']:>14}")
    flatness = max(row["us_per_item"] for row in rows) / min(row["us_per_item"] for row in rows)
    print(f"time per item, largest / smallest over the rank counts: {flatness:.2f} (flat: <= 1.20)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
