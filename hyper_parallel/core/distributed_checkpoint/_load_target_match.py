"""Which stored record each leaf of a load's target reads, checked before anything is read.

:func:`match_targets` is the first step of :meth:`.StandardLoadPlanner.configure_planner` (all ranks): it
classifies every leaf of the flattened target, finds its record in the checkpoint (or the record a Parameter
saved under another path was stored as), and refuses a load that cannot be done as asked (a shape or kind
that differs, a read-only target, a stored value this load may not decode, missing keys) before any target
changes. Pure but for the planner's tables it fills and a warning; no file access, no communication.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.deferred_storage import StorageOf
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointValueError,
    MissingKeyError,
    ShapeMismatchError,
    UnsafeCheckpointError,
    UnsupportedTypeError,
)
from hyper_parallel.core.distributed_checkpoint._flatten import FlatStateDict
from hyper_parallel.core.distributed_checkpoint._leaf_entry import classify_leaf, unstorable_target
from hyper_parallel.core.distributed_checkpoint._load_target_checks import aliased_targets, cut_containers
from hyper_parallel.core.distributed_checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from hyper_parallel.core.distributed_checkpoint._state_items import (
    SkipEntry,
    TensorEntry,
    ValueEntry,
    plain_tensor_entry,
)
from hyper_parallel.core.distributed_checkpoint.type_handlers import value_refusal

__all__ = ["match_targets"]

_LOG = logging.getLogger(__name__)
_SHOWN_REFUSALS = 5


def _shown(keys: list[str], limit: int = 20) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(f"'{k}'" for k in keys[:limit]) + more


def match_targets(
    flat: FlatStateDict,
    metadata: Metadata,
    *,
    entries: dict[str, TensorEntry | ValueEntry | SkipEntry],
    skipped: list[str],
    missing_keys: list[str],
    rank: int,
    allow_pickle: bool,
    allow_partial_load: bool,
) -> None:
    """Match every leaf of ``flat`` to its stored record and check the load can be done. All ranks.

    Args:
        flat: The flattened target state dict.
        metadata: The checkpoint's metadata.
        entries: Filled with each leaf's entry, by the leaf's dotted name (a leaf missing from the checkpoint
            has none).
        skipped: Filled with the names of the leaves that are not loaded (their entry is a ``SkipEntry``).
        missing_keys: Filled with the checkpoint keys of the leaves the checkpoint does not hold.
        rank: This rank, named in the errors.
        allow_pickle: Pickled stored values may be decoded.
        allow_partial_load: Leaves missing from the checkpoint are left as they are (a warning) instead of
            refused.

    Raises:
        ShapeMismatchError: a global shape (or a ShardedObject grid) differs from the stored one.
        CheckpointValueError: a target of the wrong kind, a read-only numpy target, two keys loading into one
            memory, a target container shorter than the stored one (all listed).
        UnsafeCheckpointError: a pickled value without ``allow_pickle`` (all refusals listed).
        UnsupportedFormatError: a stored value of a type no handler decodes.
        MissingKeyError: keys missing from the checkpoint (all listed), unless ``allow_partial_load`` and some
            key matched.
    """
    problems = []
    refused: list[CheckpointError] = []  # stored values this load may not or cannot decode
    stored_aliases = metadata.planner_data.get("aliases", {}) if isinstance(metadata.planner_data, dict) else {}
    stored_of, storage_keys = metadata.state_dict_metadata, flat.storage_keys
    for name, value in flat.values.items():
        fqn = storage_keys[name]
        stored = stored_of.get(fqn)
        if stored is None and stored_aliases.get(fqn) in stored_of:
            fqn = stored_aliases[fqn]  # a Parameter saved once under another path (e.g. the model's)
            stored = stored_of[fqn]
        entry = plain_tensor_entry(fqn, value)  # the usual leaf, in one call
        # pylint: disable-next=unidiomatic-typecheck
        if entry is not None and type(stored) is TensorStorageMetadata and stored.size == entry.global_shape:
            entries[name] = entry
            continue
        if entry is None:
            try:
                entry = classify_leaf(fqn, value)
            except UnsupportedTypeError as exc:
                refusal = unstorable_target(fqn, value, stored)  # (a dtype no checkpoint holds: what to load into)
                if refusal is None:
                    raise
                raise refusal from exc
        if isinstance(entry, SkipEntry):
            entries[name] = entry
            skipped.append(name)
            continue
        if stored is None:
            missing_keys.append(fqn)
            continue
        if isinstance(entry, TensorEntry):
            if not isinstance(stored, TensorStorageMetadata):
                problems.append(f"key '{fqn}': the target is a tensor but the checkpoint stores a value")
                continue
            if isinstance(entry.local, np.ndarray) and not entry.local.flags.writeable:
                problems.append(f"key '{fqn}': the target numpy array is read-only; pass a writable array")
                continue
            size = stored.size
            # pylint: disable-next=unidiomatic-typecheck
            if (size if type(size) is tuple else tuple(size)) != entry.global_shape and (
                    not entry.allow_shape_mismatch):
                raise ShapeMismatchError(
                    f"key '{fqn}': checkpoint global shape {list(stored.size)} differs from the target's "
                    f"global shape {list(entry.global_shape)}: the checkpoint is of a model of another "
                    "configuration, or the key names another tensor; build the target with the saved shape, or "
                    "leave the key out (load_checkpoint: filter_prefix= or choice_func=); nothing was loaded"
                )
        elif isinstance(stored, BytesStorageMetadata):
            grid = entry.grid_shape if isinstance(entry, ValueEntry) else ()
            if grid and tuple(stored.global_shape) != grid:
                raise ShapeMismatchError(  # the cell at this position of another grid is another rank's object
                    f"key '{fqn}': the checkpoint holds a ShardedObject grid of shape {list(stored.global_shape)}, "
                    f"the target's grid is {list(grid)}: its objects belong to the positions of that "
                    "grid (the ranks of another world size); give the target the saved global_shape to take "
                    "one of them, or leave the key out"
                )
            refusal = value_refusal(stored.type_name, key=fqn, allow_pickle=allow_pickle)
            if refusal is not None:
                refused.append(refusal)
        entries[name] = entry
    problems.extend(aliased_targets(flat.aliases, stored_of, stored_aliases, entries, storage=StorageOf(metadata)))
    if flat.sizes:
        problems.extend(cut_containers(flat, stored_of))
    if problems:
        raise CheckpointValueError(f"rank {rank}: " + "; ".join(problems))
    if refused:
        _refuse_values(refused, rank)
    if missing_keys:
        _report_missing(metadata, entries, missing_keys, rank=rank, allow_partial_load=allow_partial_load)


def _report_missing(metadata: Metadata, entries: dict[str, Any], missing_keys: list[str], *, rank: int,
                    allow_partial_load: bool) -> None:
    """Say what matched and what did not; refuse a load that would load nothing, even partial."""
    matched = sorted(e.fqn for e in entries.values() if not isinstance(e, SkipEntry))
    stored = sorted(metadata.state_dict_metadata)
    summary = (
        f"rank {rank}: {len(missing_keys)} of {len(missing_keys) + len(matched)} requested key(s) are "
        f"not in the checkpoint: {_shown(missing_keys)}; matched: {_shown(matched) or 'none'}; "
        f"the checkpoint holds {len(stored)} key(s), e.g. {_shown(stored, 5) or 'none'}"
    )
    if not matched:
        raise MissingKeyError(
            f"{summary}. Nothing would load, even with allow_partial_load=True: this checkpoint is of "
            "another model, or its keys carry another prefix (save and load the same structure, e.g. both "
            "{'model': net}, or use hyper_parallel.load_checkpoint(path, net), which matches MindSpore names)"
        )
    if not allow_partial_load:
        raise MissingKeyError(
            f"{summary}. Pass StandardLoadPlanner(allow_partial_load=True) to load only the matched keys"
        )
    _LOG.warning("%s; loading only the matched keys (allow_partial_load=True)", summary)


def _refuse_values(refused: list[CheckpointError], rank: int) -> None:
    """Raise the refusals of stored values, found while planning: before any target changes (all or nothing).

    A pickled value without ``allow_pickle`` first (``UnsafeCheckpointError``), else an unknown type string
    (``UnsupportedFormatError``); every refusal is listed.
    """
    refused.sort(key=lambda exc: not isinstance(exc, UnsafeCheckpointError))
    shown = "; ".join(str(exc) for exc in refused[:_SHOWN_REFUSALS])
    more = f" (and {len(refused) - _SHOWN_REFUSALS} more)" if len(refused) > _SHOWN_REFUSALS else ""
    raise type(refused[0])(f"rank {rank}: {shown}{more}; no target was changed")
