"""How the coordinator's planning grows with the number of ranks.

Builds, in one process, the local save plans of N simulated ranks holding
``--tensors`` tensors each (half replicated on every rank, half sharded along
dim 0 across all ranks) and times the coordinator's merge
(deduplication, validation, metadata) for N in ``--ranks``. Prints seconds,
microseconds per item and the growth factor against the item count.

Run: ``python scripts/bench_planning.py [--ranks 64 128 256 512 1024] [--tensors 1000]``.
"""

from __future__ import annotations

import argparse
import gc
import json
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


def main() -> None:
    """Time the merge for each rank count and print a table (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        plans = make_plans(ranks, args.tensors)
        gc.collect()
        start = time.perf_counter()
        final, metadata = build_global_save_plan(plans)
        seconds = time.perf_counter() - start
        items = ranks * args.tensors
        written = sum(len(plan.items) for plan in final)
        rows.append({"ranks": ranks, "items": items, "seconds": seconds, "us_per_item": seconds / items * 1e6,
                     "written_items": written, "tensors": len(metadata.state_dict_metadata)})
        del plans, final, metadata
    base = rows[0]
    print(f"{'ranks':>6} {'items':>9} {'seconds':>8} {'us/item':>8} {'time x':>7} {'items x':>7}")
    for row in rows:
        print(f"{row['ranks']:>6} {row['items']:>9} {row['seconds']:>8.2f} {row['us_per_item']:>8.2f} "
              f"{row['seconds'] / base['seconds']:>7.1f} {row['items'] / base['items']:>7.1f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
