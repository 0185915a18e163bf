"""Megatron-style state no rank writes: found by the coordinator from 8-byte key hashes, named on failure only.

A rank holding a key only as a non-main replica (``replica_id`` not 0)
writes nothing of it; when no rank holds it as main replica, the save would
commit without it. Each rank's local plan lists such keys, as sorted 8-byte
xxh3-64 hashes of their names (:func:`pack_hashes`: a thousand keys cost
8 KB where their names cost about 43 KB, and ranks that are data-parallel
replicas of each other send the same bytes, merged once). The coordinator
refuses every hash that no stored key has (:func:`refuse_unwritten`),
naming the keys it holds itself; the others appear as ``key #<hash>``, which
:func:`name_refusal` resolves on the failure path only (one gather of the
few names the ranks recognise), so the refusal still names every key and
its ranks.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import xxhash

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError, CollectiveStepError, PlanValidationError
from hyper_parallel.core.distributed_checkpoint.metadata import BytesStorageMetadata, Metadata

__all__ = ["key_hash", "pack_hashes", "unwritten_hashes", "refuse_unwritten", "name_refusal"]

#: How the coordinator names a key it does not hold itself (``key #`` and 16 hex digits).
_MARK = re.compile(r"key #([0-9a-f]{16})")
#: Keys named in one refusal (the count names all).
_NAMED = 20


def key_hash(key: str) -> int:
    """The 8-byte hash of a stored key's name (xxh3-64 of its UTF-8). Any rank; pure."""
    return xxhash.xxh3_64_intdigest(key.encode("utf-8"))


def pack_hashes(keys: Iterable[str]) -> bytes:
    """The sorted hashes of ``keys``, 8 bytes each (big-endian). Any rank; pure."""
    return np.asarray(sorted({key_hash(key) for key in keys}), dtype=">u8").tobytes()


def unwritten_hashes(blob: bytes) -> np.ndarray:
    """The hashes :func:`pack_hashes` packed (``uint64``). Pure."""
    return np.frombuffer(blob, dtype=">u8").astype(np.uint64)


def _refused_keys(blobs: Sequence[bytes], metadata: Metadata) -> list[tuple[int, list[int]]]:
    """Each hash of ``blobs`` (one per rank) that no stored key has, with the ranks sending it."""
    by_blob: dict[bytes, list[int]] = {}
    for rank, blob in enumerate(blobs):
        if blob:
            by_blob.setdefault(blob, []).append(rank)
    if not by_blob:
        return []
    sent = np.unique(np.concatenate([unwritten_hashes(blob) for blob in by_blob]))
    stored = np.fromiter((key_hash(key) for key in metadata.state_dict_metadata), dtype=np.uint64)
    missing = sent[~np.isin(sent, stored)]
    if not len(missing):
        return []
    holders: dict[int, list[int]] = {int(h): [] for h in missing}
    for blob, ranks in by_blob.items():
        for found in unwritten_hashes(blob)[np.isin(unwritten_hashes(blob), missing)].tolist():
            holders[int(found)].extend(ranks)
    return [(h, sorted(ranks)) for h, ranks in holders.items()]


def refuse_unwritten(blobs: Sequence[bytes], metadata: Metadata, *,
                     names_of: Callable[[set[int]], Mapping[int, str]]) -> None:
    """Refuse keys ranks hold only as non-main replicas that no rank writes, and ShardedObjects some of whose
    grid positions no rank writes (both were silently left out). Coordinator only, after the global plan is built.

    Args:
        blobs: Each rank's :func:`pack_hashes` of the keys it holds only as non-main replicas.
        metadata: The merged metadata.
        names_of: The coordinator's own keys of some hashes (named in the message; others as ``key #<hash>``);
            called only when keys are refused.

    Raises:
        PlanValidationError: Such keys (named, with their holding ranks or missing positions, and the fix).
    """
    found = _refused_keys(blobs, metadata)
    names = names_of({h for h, _ in found}) if found else {}
    known = set(names.values())
    refused = sorted(((names.get(h, f"key #{h:016x}"), ranks) for h, ranks in found),
                     key=lambda named: (named[0] not in known, named[0]))  # names first
    problems = [
        f"{len(refused)} key(s) are held only as non-main replicas (replica_id not 0), so no rank would write "
        f"them: {'; '.join(f'{_quoted(key)} on rank(s) {ranks}' for key, ranks in refused[:_NAMED])}. Give one "
        "holder of each replica_id 0 (the main replica, which is written)"
    ] if refused else []
    for key, entry in metadata.state_dict_metadata.items():
        if type(entry) is BytesStorageMetadata and entry.global_shape and (  # pylint: disable=unidiomatic-typecheck
                len(entry.shard_offsets) != math.prod(entry.global_shape)):
            have = set(entry.shard_offsets)
            missing = [list(o) for o in itertools.islice(
                (o for o in itertools.product(*map(range, entry.global_shape)) if o not in have), 5)]
            problems.append(
                f"ShardedObject '{key}' of global_shape {list(entry.global_shape)} has {len(have)} of "
                f"{math.prod(entry.global_shape)} grid positions, e.g. {missing} missing: no rank holds them as main "
                "replica; give every position of the grid a holder with replica_id 0"
            )
    if problems:
        raise PlanValidationError("; ".join(problems))


def _quoted(key: str) -> str:
    return key if _MARK.fullmatch(key) else repr(key)


def name_refusal(error: BaseException, *, gather: Callable[[Callable[[], Any]], list[Any]],
                 names_of: Callable[[set[int]], dict[int, str]]) -> CheckpointError | None:
    """``error`` with every ``key #<hash>`` of a :func:`refuse_unwritten` refusal replaced by the key's name, or
    ``None`` when it names none. Every rank, after the plan step raised the same ``error`` on each.

    Args:
        error: What the plan step raised.
        gather: Runs a function on every rank and returns every rank's result (a collective).
        names_of: This rank's names of the given hashes (the keys it holds only as non-main replicas).
    """
    if not isinstance(error, PlanValidationError):
        return None
    message = str(error)
    wanted = {int(found, 16) for found in _MARK.findall(message)}
    if not wanted:
        return None
    named: dict[int, str] = {}
    for found in gather(lambda: names_of(wanted)):
        for h, key in found.items():
            named.setdefault(h, key)

    def name(mark: re.Match) -> str:
        found = named.get(int(mark.group(1), 16))
        return mark.group(0) if found is None else repr(found)  # a hash no rank names stays as it was

    def resolve(text: str) -> str:
        return _MARK.sub(name, text)

    if isinstance(error, CollectiveStepError):  # the same class on every rank (CollectivePlanValidationError)
        return type(error)(error.step, {rank: resolve(text) for rank, text in error.failures.items()},
                           error.tracebacks, error.error_types)
    return PlanValidationError(resolve(message))
