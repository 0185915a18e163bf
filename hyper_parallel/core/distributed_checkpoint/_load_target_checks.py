"""The checks of a load's targets against the checkpoint, made while planning (before any target changes).

Two keys whose targets are one memory (one stored value would silently win over the other), containers of
the target shorter than the checkpoint's (the target's structure would silently cut the load), and MindSpore
tensors viewing another tensor's memory (the load would fill a copy, leaving the viewed tensor unchanged). Used by
:class:`.StandardLoadPlanner` on every rank; pure, no file access, no communication.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint._flatten import FlatStateDict
from hyper_parallel.core.distributed_checkpoint._state_items import TensorEntry
from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from hyper_parallel.platform.tensor import host_memory_shared, is_parameter, is_tensor, view_of_other_memory

__all__ = ["aliased_targets", "cut_containers", "view_target"]


def aliased_targets(aliases: dict[str, str], stored_of: dict[str, Any], stored_aliases: dict[str, str],
                    entries: dict[str, Any], *, storage: Any = None) -> list[str]:
    """The state-dict entries that would load two stored values into one memory (one would silently win).

    A Parameter reached at two paths is loaded once, under its first path: refused when the checkpoint stores the
    later path as a tensor of its own (two values for one Parameter). Other target tensors: the same object at two
    paths (unless the checkpoint stores both keys with the same bytes, as a save of that tied state dict does:
    ``storage`` is the metadata's storage data), numpy views of one array whose memory overlaps, or a numpy array
    on a target tensor's memory (``p.asnumpy()`` beside ``p``: a view on CPU).
    """
    problems = [
        f"state_dict paths '{name}' and '{key}' are the same Parameter, but the checkpoint stores '{name}' and "
        f"'{stored_aliases.get(key, key)}' as two tensors: only one of them could land in it; load them into two "
        "Parameters, or leave one path out of the state dict"
        for name, key in aliases.items() if name in stored_of and name != key
    ]
    first: dict[int, str] = {}
    views: dict[int, list[tuple[str, np.ndarray]]] = {}
    foreign: list[tuple[str, np.ndarray]] = []  # arrays on memory no numpy array owns (a tensor's, a buffer's)
    for name, entry in entries.items():
        if type(entry) is not TensorEntry:  # pylint: disable=unidiomatic-typecheck
            continue
        local = entry.local
        other = first.setdefault(id(local), name)
        if other is not name:
            if _same_stored_bytes(stored_of, storage, entries[other].fqn, entry.fqn):
                continue  # a tied tensor saved at both keys: either stored value is the same
            problems.append(f"state_dict entries '{other}' and '{name}' are the same tensor object: it can hold "
                            "one stored value, the other would silently win; pass a tensor of its own for each key")
        elif type(local) is np.ndarray:  # pylint: disable=unidiomatic-typecheck
            root = local
            while isinstance(root.base, np.ndarray):
                root = root.base
            views.setdefault(id(root), []).append((name, local))
            if root.base is not None:
                foreign.append((name, local))
    for group in views.values():
        if len(group) > 1:  # one view of an array overlaps nothing: most targets are arrays of their own
            problems.extend(_overlapping_views(group))
    if foreign:  # rare: most arrays own their memory, or view an array that does
        problems.extend(_arrays_on_tensor_memory(foreign, entries, stored_of, storage))
    return problems


def _arrays_on_tensor_memory(arrays: list[tuple[str, np.ndarray]], entries: dict[str, Any],
                             stored_of: dict[str, Any], storage: Any) -> list[str]:
    """The pairs of a target tensor in host memory and an array of ``arrays`` sharing bytes with it, as refusals.

    Each is filled from its own stored value, the array through the tensor's memory: one value silently wins;
    unless the array is all of the tensor's memory and the checkpoint stores both keys with the same bytes (a
    save of that state dict).
    """
    spans = []
    for name, entry in entries.items():
        local = entry.local if type(entry) is TensorEntry else None  # pylint: disable=unidiomatic-typecheck
        if local is None or isinstance(local, np.ndarray) or not is_tensor(local) or not host_memory_shared(local):
            continue
        try:
            start, size = int(local.data_ptr()), int(local.nbytes)
        except (AttributeError, RuntimeError, TypeError, ValueError):
            continue
        if size:
            spans.append((start, start + size, name))
    if not spans:
        return []
    spans.sort()
    starts = np.array([span[0] for span in spans], dtype=np.int64)
    reach = np.maximum.accumulate(np.array([span[1] for span in spans], dtype=np.int64))  # furthest end so far
    problems = []
    for name, array in arrays:
        if not array.size:
            continue
        low, high = np.byte_bounds(array)
        below = int(np.searchsorted(starts, high))  # the spans starting before the array ends
        if not below or int(reach[below - 1]) <= low:  # none of them reaches into it (most arrays: one test)
            continue
        for start, end, tensor in spans[:below]:
            if low < end and not ((low, high) == (start, end)
                                  and _same_stored_bytes(stored_of, storage, entries[tensor].fqn, entries[name].fqn)):
                problems.append(
                    f"state_dict entries '{tensor}' and '{name}' share memory: the numpy array views the tensor's "
                    "memory (e.g. tensor.asnumpy() on CPU), so the two stored values would land in one place and "
                    "one would silently win; pass a copy (tensor.asnumpy().copy()) or leave one key out")
    return problems


def _same_stored_bytes(stored_of: dict[str, Any], storage: Any, first: str, second: str) -> bool:
    """Whether the checkpoint stores keys ``first`` and ``second`` as the same tensor, chunk for chunk, with equal
    checksums of equal stored bytes (a tied tensor saved at two keys): loading both into one target loses nothing."""
    one, two = stored_of.get(first), stored_of.get(second)
    # pylint: disable-next=unidiomatic-typecheck
    if (type(one) is not TensorStorageMetadata or type(two) is not TensorStorageMetadata
            or one.properties != two.properties or tuple(one.size) != tuple(two.size) or storage is None):
        return False
    chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in one.chunks]
    if chunks != [(tuple(c.offsets), tuple(c.sizes)) for c in two.chunks]:
        return False
    for offsets, _ in chunks:
        a, b = storage.get(MetadataIndex(first, offsets)), storage.get(MetadataIndex(second, offsets))
        if (a is None or b is None or a.checksum is None or a.checksum != b.checksum or a.length != b.length
                or a.compression != b.compression):
            return False
    return True


def _overlapping_views(group: list[tuple[str, np.ndarray]]) -> list[str]:
    """The pairs of ``group`` (views of one array) whose memory overlaps, each as a refusal.

    Sorted by the first byte each view spans, a view is compared only with the earlier views whose span reaches
    past its first byte: disjoint views (a flat buffer cut into thousands of tensors) cost a sort, not every pair.
    """
    problems: list[str] = []
    spans = sorted(((*np.byte_bounds(array), position) for position, (_, array) in enumerate(group)))
    open_spans: list[tuple[int, int]] = []  # (end, position) of earlier views whose span may still overlap
    for start, end, position in spans:
        open_spans = [span for span in open_spans if span[0] > start]
        name, array = group[position]
        for _, earlier in open_spans:
            other, other_array = group[earlier]
            if np.shares_memory(array, other_array):
                first, second = (other, name) if earlier < position else (name, other)
                problems.append(
                    f"state_dict entries '{first}' and '{second}' are numpy arrays whose memory overlaps: the "
                    "overlap can hold one stored value, the other would silently win; pass separate arrays")
        open_spans.append((end, position))
    return problems


def cut_containers(flat: FlatStateDict, stored_of: dict[str, Any]) -> list[str]:
    """The lists and tuples of the target shorter than the checkpoint's, and its empty dicts the checkpoint fills.

    The target's structure says what is loaded, so a list of 2 given for a list of 3 saved loaded 2 items and
    dropped the third; an empty dict (an optimizer state not created yet) loaded nothing of what is stored under it.
    """
    keys = sorted(stored_of)
    # A ShardedTensor / ShardedObject is stored under its own global key, which need not follow its local path
    # (a pipeline stage's list of 2 layers may hold keys 'layers.2.*' of a 4-layer model): its containers are
    # not checked.
    global_keys = {path[:depth] for name, path in flat.paths.items() if flat.storage_keys[name] != name
                   for depth in range(1, len(path))}
    problems = []
    for path, size in flat.sizes.items():
        if not path or path in global_keys:
            continue
        name = ".".join(map(str, path))
        prefix = name + "."
        kind = flat.containers[path]
        for key in itertools.islice(keys, bisect.bisect_left(keys, prefix), None):
            if not key.startswith(prefix):
                break
            item = key[len(prefix):].split(".", 1)[0]
            if kind == "dict":
                problems.append(f"key '{name}': the target is an empty dict, but the checkpoint holds keys under it "
                                f"(e.g. '{key}'); put placeholders there (None receives a stored value or tensor), "
                                f"or leave '{name}' out of the state dict")
                break
            if item.isdigit() and int(item) >= size:
                problems.append(f"key '{name}': the target {kind} has {size} item(s), but the checkpoint holds more "
                                f"(e.g. '{key}'); give a {kind} of the saved length (None placeholders receive the "
                                "values)")
                break
    return problems


def view_target(fqn: str, target: Any) -> str | None:
    """Why a target without a writable view cannot be loaded into, if it is a MindSpore Tensor viewing another
    tensor's memory (``t[0:2]``, ``t.T``, ``t.reshape(-1)``); else ``None``.

    Its values would land in memory of its own (``asnumpy()`` copies a view, and MindSpore cannot copy into a
    view in place on CPU), never in the tensor it views: the load would report success with that tensor
    unchanged. A Parameter is not refused: it receives the values in memory of its own, as MindSpore's
    ``load_param_into_net`` gives them (``set_data``), whatever memory it viewed before.
    """
    if is_parameter(target):
        return None
    what = view_of_other_memory(target)
    if what is None:
        return None
    return (f"key '{fqn}': the target Tensor is a view ({what}): a load would fill a copy of it and leave the "
            "tensor it views unchanged; load into the tensor it views (the whole tensor, then take the view), or "
            "pass a tensor of its own (view.copy()) and copy its values where they belong")
