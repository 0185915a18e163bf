"""How the plan exchange and the coordinator's merge grow with the number of ranks.

Simulates, in one process, N ranks holding ``--tensors`` tensors each: half
replicated on every rank (plain tensors, each rank sending its replica
digest, as ``check_replicas`` does by default), half DTensors sharded along
dim 0 over all ranks. Each rank's plan is what ``dcp.save`` sends: the
layout form (:func:`compact_save_plan`; the script checks that ranks' real
local plans compact to exactly these bytes), pickled on its own. The timed
coordinator work is the whole exchange on its side: unpickling every rank's
plan separately (as it arrives over the wire: no objects shared between
ranks), the merge (deduplication, replica checks, writer balancing,
metadata) and pickling each rank's own result for the scatter.

Printed per N (the median of ``--repeat`` runs): seconds, microseconds per item (N x tensors items), the
flatness of the time per item, the bytes a rank sends, and the bytes a
non-coordinator rank receives (the library's gather + scatter, against an
all-gather of every plan). With ``--general-up-to M`` the per-item merge of
expanded plans (the general path) is timed too for N <= M, and the results
of both are compared. The last columns time the coordinator's side of a
repeated save's digest round (every rank's layout digest and replica
digests in, the replica check with this save's digests, one decision out),
and "rank ms" what one rank spends compacting and pickling its plan (on
every rank in parallel, outside the coordinator's time).

Run: ``python scripts/bench_planning.py [--ranks 64 256 1024 4096 10240] [--tensors 1000]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import time
from dataclasses import replace

from hyper_parallel.core.distributed_checkpoint._commit_receipt import commit_answers
from hyper_parallel.core.distributed_checkpoint._engine import _PlanDelta
from hyper_parallel.core.distributed_checkpoint._global_plan import build_global_save_plan
from hyper_parallel.core.distributed_checkpoint._layout_merge import keep_masks, merge_layout_plans
from hyper_parallel.core.distributed_checkpoint._layout_plan import LayoutSavePlan, compact_save_plan
from hyper_parallel.core.distributed_checkpoint._plan_cache import (
    CachedPlan,
    PlanDecision,
    PlanMessage,
    check_cached_replicas,
    exchange_digest,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemPlanData
from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from hyper_parallel.core.layout import Layout

__all__ = ["local_plan", "rank_blobs", "main"]

_ROWS = 8  # rows of each sharded tensor per rank
_DIGEST = "0123456789abcdef"  # every replica equal (as a valid save has them)
_SAVE_ID = "0123456789abcdef0123456789abcdef"  # a save id's length
_LOCATION = "/checkpoints/run/step_00001000"  # a checkpoint path


def local_plan(rank: int, ranks: int, tensors: int) -> tuple[SavePlan, dict[MetadataIndex, Layout | None]]:
    """Rank ``rank``'s local plan as the planner builds it, and the layouts it hands the compaction."""
    props = TensorProperties(dtype="float32")
    sharded = Layout((ranks,), (0, -1))
    items, layouts = [], {}
    for i in range(tensors // 2):
        index = MetadataIndex(f"rep.{i}", (0, 0))
        items.append(WriteItem(index=index, type=WriteItemType.TENSOR, tensor_data=TensorWriteData(
            ChunkStorageMetadata((0, 0), (64, 64)), props, (64, 64), replica_digest=_DIGEST)))
        layouts[index] = None
    for i in range(tensors - tensors // 2):
        index = MetadataIndex(f"shard.{i}", (rank * _ROWS, 0))
        items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            ChunkStorageMetadata((rank * _ROWS, 0), (_ROWS, 64)), props, (ranks * _ROWS, 64))))
        layouts[index] = sharded
    return SavePlan(items=tuple(items)), layouts


def rank_blobs(ranks: int, tensors: int, timing: dict[str, float] | None = None) -> list[bytes]:
    """What each rank sends: its layout-form plan, pickled on its own.

    Ranks 0, 1 and the last compact their real local plans; the others reuse
    rank 0's table (equal bytes, checked) with their own digests. ``timing``
    receives the seconds one rank spends compacting and pickling its plan.
    """
    real = {}
    for rank in sorted({0, 1, ranks - 1}):
        plan, layouts = local_plan(rank, ranks, tensors)
        start = time.perf_counter()
        real[rank] = compact_save_plan(plan, layouts, rank=rank, world_size=ranks)
        pickle.dumps(real[rank], protocol=pickle.HIGHEST_PROTOCOL)
        if timing is not None and rank == 0:
            timing["rank_send_seconds"] = time.perf_counter() - start
        assert isinstance(real[rank], LayoutSavePlan)
        assert real[rank].table == real[0].table and real[rank].digests == real[0].digests
    template = real[0]
    blobs = []
    for rank in range(ranks):
        plan = real.get(rank) or LayoutSavePlan(table=bytes(template.table), general=(),
                                                digests=bytes(template.digests))
        blobs.append(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
    return blobs


def _coordinator(blobs: list[bytes]) -> dict[str, float | list[bytes] | object]:
    """The coordinator's side of one exchange, timed step by step."""
    start = time.perf_counter()
    plans = [pickle.loads(blob) for blob in blobs]
    unpickled = time.perf_counter()
    masks, metadata = merge_layout_plans(plans)
    merged = time.perf_counter()
    storage = FileSystemPlanData(save_id="bench")
    results = [pickle.dumps((_PlanDelta(keep=mask, storage_data=storage, planner_data=None), []),
                            protocol=pickle.HIGHEST_PROTOCOL) for mask in masks]
    done = time.perf_counter()
    return {"unpickle": unpickled - start, "merge": merged - unpickled, "results": done - merged,
            "total": done - start, "masks": masks, "metadata": metadata, "result_blobs": results, "plans": plans}


def _reuse_round(plans: list, ranks: int, tensors: int) -> tuple[float, int, int]:
    """The coordinator's side of a repeated save's digest round (cached plan): seconds, bytes sent, received.

    Every rank sends its layout digest, the exchange it holds and its replica digests (pickled on its own);
    the coordinator unpickles them, checks the replicas with this save's digests and answers each rank.
    """
    digests = tuple(_DIGEST for _ in range(tensors // 2))
    exchange = exchange_digest(["layout"] * ranks)
    blobs = [pickle.dumps(PlanMessage(local_digest="layout", cached_exchange=exchange, replica_digests=digests),
                          protocol=pickle.HIGHEST_PROTOCOL) for _ in range(ranks)]
    cached = CachedPlan(exchange=exchange, final=SavePlan(items=()), all_final=None, metadata=None,
                        local_plans=tuple(plans))
    storage = FileSystemPlanData(save_id="bench")
    start = time.perf_counter()
    messages = [pickle.loads(blob) for blob in blobs]
    assert exchange_digest([m.local_digest for m in messages]) == exchange
    check_cached_replicas(cached, messages)
    answers = [pickle.dumps((PlanDecision(exchange=exchange, reuse=True, storage_data=storage), []),
                            protocol=pickle.HIGHEST_PROTOCOL) for _ in range(ranks)]
    return time.perf_counter() - start, max(map(len, blobs)), 8 + 8 + 8 + max(map(len, answers))


def _general(ranks: int, tensors: int) -> tuple[float, list[bytes], object]:
    """The per-item merge of every rank's expanded plan (separately unpickled), timed."""
    blobs = [pickle.dumps(local_plan(rank, ranks, tensors)[0], protocol=pickle.HIGHEST_PROTOCOL)
             for rank in range(ranks)]
    start = time.perf_counter()
    plans = [pickle.loads(blob) for blob in blobs]
    final, metadata = build_global_save_plan(plans)
    seconds = time.perf_counter() - start
    return seconds, keep_masks(plans, final), metadata


def _commit_bytes(metadata: object, ranks: int) -> dict[str, int]:
    """Bytes a non-coordinator rank receives from the commit step: the receipt, against the metadata it replaced.

    The commit broadcasts one answer to every rank (8-byte length, then the pickled answer). The metadata
    figure is a lower bound of what a rank received before (the plan's metadata, without the storage entries
    the commit adds, about 131 bytes per chunk).
    """
    committed = metadata.replace(storage_meta=replace(metadata.storage_meta, save_id=_SAVE_ID))
    receipt = commit_answers(committed, world_size=ranks, location=_LOCATION, read_back=lambda: committed)[1]
    return {"commit_bytes_received_per_noncoordinator_rank":
            8 + len(pickle.dumps((receipt, []), protocol=pickle.HIGHEST_PROTOCOL)),
            "commit_bytes_received_per_noncoordinator_rank_before_at_least":
            8 + len(pickle.dumps((committed, []), protocol=pickle.HIGHEST_PROTOCOL))}


def main(argv: list[str] | None = None) -> list[dict]:
    """Time the exchange and the merge for each rank count; print a table (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096, 10240])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--general-up-to", type=int, default=0,
                        help="also time the per-item merge of expanded plans up to this many ranks")
    parser.add_argument("--repeat", type=int, default=3, help="runs per rank count; the median run is reported")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    for ranks in args.ranks:
        timing: dict[str, float] = {}
        blobs = rank_blobs(ranks, args.tensors, timing)
        runs = []
        for _ in range(args.repeat):  # each run unpickles fresh objects from the blobs
            gc.collect()
            gc.disable()  # as in dcp.save, which pauses the cyclic GC while it runs
            try:
                runs.append(_coordinator(blobs))
            finally:
                gc.enable()
        side = sorted(runs, key=lambda run: run["total"])[len(runs) // 2]  # the median run
        del runs
        items = ranks * args.tensors
        longest_result = max(map(len, side["result_blobs"]))
        row = {
            "ranks": ranks, "items": items, "seconds": side["total"], "us_per_item": side["total"] / items * 1e6,
            "unpickle_seconds": side["unpickle"], "merge_seconds": side["merge"],
            "results_seconds": side["results"],
            # on each rank, in parallel (not part of the coordinator's time): compacting and pickling its plan
            "rank_send_seconds": timing["rank_send_seconds"],
            "written_items": sum(sum(bin(b).count("1") for b in mask) for mask in side["masks"]),
            "tensors": len(side["metadata"].state_dict_metadata),
            "bytes_sent_per_rank": max(map(len, blobs)),
            # gather: a rank receives the 8-byte longest length; scatter: the 8-byte longest result length, then
            # one row of that width (8-byte length + the longest result):
            "bytes_received_per_noncoordinator_rank": 8 + 8 + 8 + longest_result,
            # an all-gather of every plan and of every result, for comparison:
            "bytes_received_per_noncoordinator_rank_allgather": sum(map(len, blobs)) + sum(
                map(len, side["result_blobs"])),
        }
        row.update(_commit_bytes(side["metadata"], ranks))
        reuses = []
        for _ in range(args.repeat):
            gc.collect()
            gc.disable()
            try:
                reuses.append(_reuse_round(side["plans"], ranks, args.tensors))
            finally:
                gc.enable()
        reuses.sort()
        row["reuse_seconds"], row["reuse_bytes_sent_per_rank"], row["reuse_bytes_received_per_rank"] = (
            reuses[len(reuses) // 2])
        row["reuse_us_per_item"] = row["reuse_seconds"] / items * 1e6
        if ranks <= args.general_up_to:
            seconds, masks, metadata = _general(ranks, args.tensors)
            row["general_seconds"] = seconds
            row["general_us_per_item"] = seconds / items * 1e6
            row["same_result_as_general"] = masks == side["masks"] and metadata == side["metadata"]
        rows.append(row)
        del blobs, side
    _print(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)
    return rows


def _print(rows: list[dict]) -> None:
    print(f"{'ranks':>6} {'items':>9} {'total s':>8} {'us/item':>8} {'unpickle':>8} {'merge':>7} {'results':>7} "
          f"{'sent B/rank':>11} {'recv B/rank':>11} {'recv B all-gather':>17} {'general us/item':>15} "
          f"{'reuse s':>7} {'reuse us/item':>13} {'rank ms':>7} {'commit recv B':>13} {'(before >=)':>11}")
    for row in rows:
        general = f"{row['general_us_per_item']:.2f}" if "general_us_per_item" in row else "-"
        print(f"{row['ranks']:>6} {row['items']:>9} {row['seconds']:>8.2f} {row['us_per_item']:>8.3f} "
              f"{row['unpickle_seconds']:>8.2f} {row['merge_seconds']:>7.2f} {row['results_seconds']:>7.2f} "
              f"{row['bytes_sent_per_rank']:>11} {row['bytes_received_per_noncoordinator_rank']:>11} "
              f"{row['bytes_received_per_noncoordinator_rank_allgather']:>17} {general:>15} "
              f"{row['reuse_seconds']:>7.2f} {row['reuse_us_per_item']:>13.3f} {row['rank_send_seconds'] * 1e3:>7.1f} "
              f"{row['commit_bytes_received_per_noncoordinator_rank']:>13} "
              f"{row['commit_bytes_received_per_noncoordinator_rank_before_at_least']:>11}")
    growth = max(row["us_per_item"] for row in rows) / rows[0]["us_per_item"]
    spread = max(row["us_per_item"] for row in rows) / min(row["us_per_item"] for row in rows)
    print(f"time per item, largest over the rank counts / at {rows[0]['ranks']} ranks: {growth:.2f} "
          f"(flat or falling: <= 1.20); largest / smallest: {spread:.2f} (per-tensor work is shared by the ranks)")
    same = [row["same_result_as_general"] for row in rows if "same_result_as_general" in row]
    if same:
        print(f"same writers and metadata as the per-item merge: {all(same)} ({len(same)} sizes compared)")


if __name__ == "__main__":
    main()
