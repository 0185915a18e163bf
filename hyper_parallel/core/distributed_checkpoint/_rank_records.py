"""Per-rank results records: how a multi-rank async save commits without a collective.

A collective run from a background thread can corrupt the training thread's
own collectives (measured on MindSpore 2.10 CPU), so the background threads
of a multi-rank ``async_save`` talk through the storage instead: each rank,
once its data is durable, stores a small record of its write results
(or of its failure), whole or not at all, through :meth:`StorageWriter.write_rank_record`; the
coordinator's background thread waits for every rank's record, commits with
the same :meth:`StorageWriter.finish` as any save, and removes the records.
The step is then durable whether or not ``result()`` is ever called.

A record is UTF-8 JSON ``{"format", "save_id", "rank", "results": [{"size",
"entry"}] | null, "error": str | null}`` whose ``entry`` is a ``storage_data``
entry of docs/format.md. Records are named by save id and rank, begin with a
dot, and are never part of a committed checkpoint.

Version 2 (``"version": 2``), for a save whose ranks write their own index
files (:mod:`._index_plan`): ``"results"`` is empty and ``"index"`` holds the
rank's summary instead, ``{"record": {"rank", "file", "length", "digest"} |
null, "entries", "bytes", "files": [names], "inline": [{"size", "entry"}]}``:
its size does not grow with the chunks the rank wrote.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from hyper_parallel.core.distributed_checkpoint._format.metadata_json import (
    storage_entry_from_json,
    storage_entry_to_json,
)
from hyper_parallel.core.distributed_checkpoint._format.rank_index import records_from_json, records_to_json
from hyper_parallel.core.distributed_checkpoint._index_plan import RankIndexSummary
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CollectiveTimeoutError,
    CorruptCheckpointError,
)
from hyper_parallel.core.distributed_checkpoint.storage import StorageWriter, WriteResult

__all__ = [
    "RECORD_FORMAT",
    "RankRecord",
    "collect_rank_records",
    "decode_rank_record",
    "encode_rank_record",
    "results_of",
    "wait_for_rank_records",
]

#: Value of a record's ``"format"`` field.
RECORD_FORMAT = "hyper_parallel.rank_results"
#: First and longest pause between two looks for missing records.
_POLL_FIRST, _POLL_MAX = 0.005, 0.25


@dataclass(frozen=True)
class RankRecord:
    """One rank's outcome of writing its share of a save.

    Attributes:
        save_id: The save the record belongs to.
        rank: The rank that wrote it.
        results: Its write results; ``None`` when it failed.
        error: What failed (type and message); ``None`` on success.
        replicas: ``(key, chunk offset, xxh3 digest)`` of every possibly replicated
            tensor piece this rank holds, hashed by its writer (empty: hashed while planning).
    """

    save_id: str
    rank: int
    results: tuple[WriteResult, ...] | None
    error: str | None = None
    replicas: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    summary: RankIndexSummary | None = None


def _results_to_json(results: Iterable[WriteResult]) -> list[dict]:
    return [{"size": r.size_in_bytes, "entry": storage_entry_to_json(r.index, r.storage_data)} for r in results]


def encode_rank_record(record: RankRecord) -> bytes:
    """The record as UTF-8 JSON (version 2 when it carries a summary). Any rank; pure."""
    results = None if record.results is None else _results_to_json(record.results)
    document: dict = {"format": RECORD_FORMAT, "save_id": record.save_id, "rank": record.rank, "results": results,
                      "error": record.error}
    if record.replicas:
        document["replicas"] = [[key, list(offsets), found] for key, offsets, found in record.replicas]
    summary = record.summary
    if summary is not None:
        document["version"] = 2
        document["index"] = {
            "record": None if summary.record is None else records_to_json([summary.record])[0],
            "entries": summary.entries, "bytes": summary.bytes_written, "files": list(summary.files),
            "inline": _results_to_json(summary.inline)}
    return json.dumps(document, separators=(",", ":")).encode("utf-8")


def decode_rank_record(data: bytes, *, source: str) -> RankRecord:
    """Decode and check a record. Coordinator; pure.

    Raises:
        CorruptCheckpointError: not a record (names ``source``).
    """
    try:
        document = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{source}: not a valid rank results record ({exc})") from exc
    if not isinstance(document, dict) or document.get("format") != RECORD_FORMAT:
        raise CorruptCheckpointError(f"{source}: not a rank results record")
    save_id, rank, raw, error = (document.get(k) for k in ("save_id", "rank", "results", "error"))
    if not isinstance(save_id, str) or type(rank) is not int or not (raw is None or isinstance(raw, list)) or not (
            error is None or isinstance(error, str)) or (raw is None) == (error is None):
        raise CorruptCheckpointError(f"{source}: malformed rank results record")
    replicas = _replicas(document.get("replicas", []), source)
    if raw is None:
        return RankRecord(save_id, rank, None, error, replicas)
    summary = None if "index" not in document else _summary(document["index"], save_id, rank, source)
    return RankRecord(save_id, rank, _results(raw, source), None, replicas, summary)


def _results(raw: list, source: str) -> tuple[WriteResult, ...]:
    """A record's write results, checked."""
    results = []
    for position, item in enumerate(raw):
        if not isinstance(item, dict) or type(item.get("size")) is not int or item["size"] < 0:
            raise CorruptCheckpointError(f"{source}: malformed result {position}")
        index, info = storage_entry_from_json(item.get("entry"), position=position, source=source)
        results.append(WriteResult(index=index, size_in_bytes=item["size"], storage_data=info))
    return tuple(results)


def _summary(raw: object, save_id: str, rank: int, source: str) -> RankIndexSummary:
    """A version-2 record's ``index`` member, checked."""
    if not isinstance(raw, dict) or not all(type(raw.get(k)) is int and raw[k] >= 0 for k in ("entries", "bytes")) or (
            not isinstance(raw.get("files"), list) or not all(isinstance(n, str) for n in raw["files"])
            or not isinstance(raw.get("inline"), list)):
        raise CorruptCheckpointError(f"{source}: malformed rank index summary")
    record = None
    if raw.get("record") is not None:
        record = records_from_json([raw["record"]], save_id=save_id, world_size=rank + 1, source=source)[0]
        if record.rank != rank:
            raise CorruptCheckpointError(f"{source}: the index file of rank {record.rank} in the record of rank {rank}")
    return RankIndexSummary(rank=rank, record=record, entries=raw["entries"], bytes_written=raw["bytes"],
                            files=tuple(raw["files"]), inline=_results(raw["inline"], source))


def _replicas(raw: object, source: str) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """A record's ``replicas`` list, checked (``[key, [offsets], digest]`` each)."""
    if not isinstance(raw, list):
        raise CorruptCheckpointError(f"{source}: malformed replica digests")
    found = []
    for position, item in enumerate(raw):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and isinstance(item[1], list)
                and all(type(o) is int for o in item[1]) and isinstance(item[2], str)):
            raise CorruptCheckpointError(f"{source}: malformed replica digest {position}")
        found.append((item[0], tuple(item[1]), item[2]))
    return tuple(found)


def collect_rank_records(
    writer: StorageWriter,
    *,
    save_id: str,
    ranks: Iterable[int],
    timeout: float | None,
    wake: threading.Event | None = None,
    cancel: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[int, RankRecord]:
    """Wait until ``ranks`` each stored a record of ``save_id`` (success or failure). Coordinator.

    Args:
        writer: The coordinator's writer (reads the records).
        save_id: The save.
        ranks: The ranks whose records are awaited.
        timeout: Seconds to wait at most (``None``: forever).
        wake: Set to look again at once instead of after the current pause.
        cancel: Once set, return after one more look with what was found.
        clock: Monotonic clock (tests).

    Returns:
        The records found, by rank (all of ``ranks`` unless cancelled).

    Raises:
        CollectiveTimeoutError: records missing after ``timeout`` (names the ranks).
        CorruptCheckpointError: a record of this save's name is not a record.
    """
    missing = sorted(set(ranks))
    found: dict[int, RankRecord] = {}
    deadline = None if timeout is None else clock() + timeout
    pause = _POLL_FIRST
    while True:
        stop = cancel is not None and cancel.is_set()
        for rank in list(missing):
            data = writer.read_rank_record(rank)
            if data is None:
                continue
            record = decode_rank_record(data, source=f"results record of rank {rank}")
            if record.save_id == save_id and record.rank == rank:  # else a record of another save
                found[rank] = record
                missing.remove(rank)
        if not missing or stop:
            return found
        if deadline is not None and clock() >= deadline:
            raise CollectiveTimeoutError(
                f"async save {save_id}: no results record from rank(s) {missing} after {timeout:g} s (a rank died "
                "or is stuck writing); nothing was committed. HP_CKPT_COLLECTIVE_TIMEOUT sets the wait"
            )
        if wake is None:
            time.sleep(pause)
        elif wake.wait(pause):
            wake.clear()
        pause = min(pause * 2, _POLL_MAX)


def results_of(records: dict[int, RankRecord], *, save_id: str, world_size: int) -> list[Any]:
    """Every rank's write results in rank order (its summary, for a rank that wrote its own index), from complete
    ``records``. Coordinator; pure.

    Raises:
        CheckpointError: ranks recorded a failure (names each rank and its error).
    """
    failed = {rank: r.error for rank, r in sorted(records.items()) if r.results is None}
    if failed:
        named = "; ".join(f"rank {rank}: {error}" for rank, error in failed.items())
        raise CheckpointError(
            f"rank(s) {sorted(failed)} failed to write their part of the save (save id {save_id}): {named}; "
            "nothing was committed"
        )
    return [records[rank].summary or list(records[rank].results or ()) for rank in range(world_size)]


def wait_for_rank_records(
    writer: StorageWriter, *, save_id: str, world_size: int, timeout: float | None,
    clock: Callable[[], float] = time.monotonic,
) -> list[list[WriteResult]]:
    """Wait until every rank's record of ``save_id`` is stored; return the results in rank order. Coordinator.

    Raises:
        CheckpointError: a rank recorded a failure (names the rank and its error).
        CollectiveTimeoutError: records missing after ``timeout`` (names the ranks).
    """
    records = collect_rank_records(writer, save_id=save_id, ranks=range(world_size), timeout=timeout, clock=clock)
    return results_of(records, save_id=save_id, world_size=world_size)
