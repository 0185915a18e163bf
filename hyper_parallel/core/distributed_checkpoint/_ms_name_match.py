"""Which checkpoint key loads into which entry of ``load_checkpoint``'s ``net``, by MindSpore's rules.

The selection (``filter_prefix`` / ``specify_prefix`` / ``choice_func``,
:func:`selector`), the names a checkpoint answers to (its keys and the
aliases of a Parameter saved once, :func:`stored_names`), the match of the
``net``'s names to them, exact or through the one prefix the checkpoint adds
(:func:`match_names`, as ``mindspore.load_param_into_net``), and the dtype
casts MindSpore allows between a stored tensor and its target
(:func:`check_dtypes`), refused before anything is read.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np

from hyper_parallel.core.distributed_checkpoint._leaf_entry import local_data, unstorable_target
from hyper_parallel.core.distributed_checkpoint._state_items import plain_dtype_name
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, TensorStorageMetadata
from hyper_parallel.platform.tensor import is_tensor
from hyper_parallel.platform.dtypes import dtype_name

__all__ = ["check_dtypes", "every", "match_names", "selector", "shown", "stored_names"]

_LOG = logging.getLogger(__name__)
#: Names an error or log line lists before "and N more".
_SHOWN = 10


def _prefixes(name: str, prefix: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if prefix is None:
        return None
    prefixes = (prefix,) if isinstance(prefix, str) else prefix
    if not isinstance(prefixes, (list, tuple)) or not prefixes or not all(
        isinstance(p, str) and p for p in prefixes
    ):
        raise CheckpointValueError(
            f"{name} must be a non-empty str or a non-empty list of non-empty str, got {prefix!r}")
    return tuple(prefixes)


def selector(
    filter_prefix: Any, specify_prefix: Any, choice_func: Callable[[str], bool] | None
) -> Callable[[str], bool]:
    """MindSpore's rule: ``specify_prefix`` / ``filter_prefix`` when given (they override ``choice_func``)."""
    specify = _prefixes("specify_prefix", specify_prefix)
    exclude = _prefixes("filter_prefix", filter_prefix)
    if specify is None and exclude is None:
        if choice_func is None:
            return every
        if not callable(choice_func):
            raise CheckpointValueError(f"choice_func must be callable (name -> bool), got {type(choice_func).__name__}")
        return lambda name: bool(choice_func(name))
    return lambda name: (specify is None or name.startswith(specify)) and not (exclude and name.startswith(exclude))


def every(name: str) -> bool:  # pylint: disable=unused-argument
    """The selection without filter_prefix / specify_prefix / choice_func: every key."""
    return True


def stored_names(metadata: Metadata) -> dict[str, str]:
    """Checkpoint keys, plus the paths saved as aliases of them (a Parameter saved once), each -> its stored key."""
    keys = list(metadata.state_dict_metadata)
    names = dict(zip(keys, keys))
    data = metadata.planner_data
    if isinstance(data, dict):
        names.update((alias, key) for alias, key in data.get("aliases", {}).items() if key in names)
    return names


def shown(names: list[str]) -> str:
    """``names`` quoted for a message, the first :data:`_SHOWN` of them and how many more."""
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(f"'{n}'" for n in names[:_SHOWN]) + more


def match_names(wanted: list[str], stored: dict[str, str], strict_load: bool,
           select: Callable[[str], bool] = lambda key: True) -> dict[str, str]:
    """Target name -> checkpoint key (``stored``: every stored name -> its key): exact; else (not strict) through
    the prefixes the checkpoint adds.

    As MindSpore's ``load_param_into_net`` does for one prefix: a missing name
    found as the tail of a stored key (of the fewest dots, the shortest) gives a prefix,
    which is then tried for every missing name; repeated while it finds more
    (``model.`` for the network and ``optimizer.`` for the moments of a
    ``dcp.save({"model": net, "optimizer": opt})``). Only keys ``select`` keeps give prefixes, and a key another
    entry matched already (by its own name first) goes to no second entry: that entry stays unmatched.

    Raises:
        CheckpointValueError: Two prefixes of as few dots hold the name as two stored tensors (``model.`` and
            ``ema.``): which copy is meant is not known (names both and the fix).
    """
    matched = {name: name for name in wanted if name in stored}
    if strict_load:
        return matched
    # A stored key goes to one net entry: one that another entry already matched (by its own name, or through an
    # earlier prefix) is not a candidate. Two entries of one key loaded one of them only (one target per key),
    # and the other, reported loaded, kept its old values.
    claimed = set(matched.values())
    tried: set[str] = set()
    for name in wanted:
        if name in matched:
            continue
        prefixes = {key[: -len(name)] for key in stored
                    if key.endswith("." + name) and key not in claimed and select(key)} - tried
        if not prefixes:
            continue
        depth = min(prefix.count(".") for prefix in prefixes)
        nearest = sorted((prefix for prefix in prefixes if prefix.count(".") == depth), key=lambda p: (len(p), p))
        if len({stored[prefix + name] for prefix in nearest}) > 1:  # copies, not one Parameter saved once
            raise CheckpointValueError(
                f"net entry '{name}' is not in the checkpoint under its own name, and it is there under several "
                f"prefixes ({', '.join(repr(p + name) for p in nearest)}): which copy to load is not known; pass "
                "specify_prefix (e.g. specify_prefix='" + nearest[0] + "') or filter_prefix to pick one"
            )
        prefix = nearest[0]
        tried.add(prefix)
        found = {n: prefix + n for n in wanted
                 if n not in matched and prefix + n in stored and prefix + n not in claimed}
        claimed.update(found.values())
        _LOG.warning("load_checkpoint: %d checkpoint keys carry the prefix '%s'; loaded by name without it",
                     len(found), prefix)
        matched.update(found)
    return matched


#: The dtypes MindSpore's non-strict ``load_param_into_net`` converts among (its ``_type_convert``): floats
#: among floats, signed integers among signed integers; any other change of dtype it refuses.
_CONVERTIBLE = (frozenset({"float16", "float32", "float64", "bfloat16"}),
                frozenset({"int8", "int16", "int32", "int64"}))


def check_dtypes(pairs: dict[str, str], flat_values: dict[str, Any], metadata: Metadata, stored: dict[str, str],
                 *, strict_load: bool) -> None:
    """Refuse, before anything is read, the casts MindSpore refuses: any with ``strict_load``, else a change of
    dtype family (a float checkpoint into an int Parameter was truncated silently). Any rank.

    ``pairs``: target name -> checkpoint key; ``flat_values``: the targets by name; ``stored``: as
    :func:`stored_names` (a key to the stored key it aliases).
    """
    stored_of = metadata.state_dict_metadata
    for name, key in pairs.items():
        item = stored_of.get(stored.get(key, key))
        if not isinstance(item, TensorStorageMetadata):
            continue
        value = flat_values[name]
        want = plain_dtype_name(value)  # a plain Parameter or array (most targets): its dtype's name, cached
        if want is None:
            local = local_data(value)
            if not (is_tensor(local) or isinstance(local, np.ndarray)):
                continue
            refusal = unstorable_target(key, value, item, target=name)
            if refusal is not None:  # a dtype no checkpoint holds (float128, complex, structured)
                raise refusal
            want = dtype_name(local)
        have = item.properties.dtype
        if have == want:
            continue
        if strict_load:
            raise CheckpointValueError(
                f"key '{key}': stored as {have}, the target '{name}' is {want}; "
                "strict_load=True refuses the cast (pass strict_load=False to convert)"
            )
        if not any({have, want} <= family for family in _CONVERTIBLE):
            raise CheckpointValueError(
                f"key '{key}': stored as {have}, the target '{name}' is {want}: as MindSpore's load_param_into_net, "
                "load_checkpoint converts only among float dtypes or among signed int dtypes (this one would "
                "truncate or wrap values); check that the key is meant for this Parameter, or give a target of "
                "the stored dtype"
            )
