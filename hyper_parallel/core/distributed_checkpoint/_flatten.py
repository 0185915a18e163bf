"""Flattening nested state dicts to dotted keys, and writing values back.

``{"optim": {"state": [{"exp_avg": t}]}}`` becomes ``{"optim.state.0.exp_avg": t}``.
A ``mindspore.nn.Cell`` stands for its ``parameters_dict()``, keys prefixed
with its path. ``ShardedTensor`` and ``ShardedObject`` leaves are stored under
their own global ``key`` whatever their path. Each flat key remembers its path
so a load can put new non-tensor values back where they were (rebuilding
tuples, which cannot change in place).

A ``mindspore.Parameter`` (or the DTensor wrapping one) reached twice (a network's weight is also in its
optimizer's ``parameters_dict()``) is one leaf: the first path keeps it, the
later paths become *aliases* of its key, so it is stored and loaded once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.mapping import ShardedObject, ShardedTensor, is_main_replica
from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.platform.tensor import all_plain_leaves, is_cell, is_parameter, parameter_and_cell_types

__all__ = ["PathElement", "FlatStateDict", "cell_parameters", "check_one_main_replica_per_box", "flatten_state_dict",
           "set_by_path"]

#: One step of a path: a dict key, a list/tuple index, or a Cell parameter name.
PathElement = Union[str, int]


@dataclass(frozen=True)
class FlatStateDict:
    """A flattened state dict.

    Attributes:
        values: Leaf value by dotted name, in traversal order.
        paths: Path of every dotted name in the nested state dict.
        containers: For every path prefix (as a tuple) the container kind
            (``"dict"``, ``"list"``, ``"tuple"``, ``"cell"``).
        storage_keys: Checkpoint key of every dotted name (its own ``key``
            for a ShardedTensor/ShardedObject, else the dotted name).
        key_users: The dotted names stored under each checkpoint key.
        aliases: Dotted name of every later path to a Parameter already
            reached -> the checkpoint key of its first path.
        sizes: The length of every list and tuple (a load checks the
            checkpoint holds no more items), and 0 for every empty dict.
        shared_keys: The checkpoint keys several ShardedTensors/ShardedObjects share.
    """

    values: dict[str, Any]
    paths: dict[str, tuple[PathElement, ...]]
    containers: dict[tuple[PathElement, ...], str]
    storage_keys: dict[str, str] = field(default_factory=dict)
    key_users: dict[str, list[str]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    sizes: dict[tuple[PathElement, ...], int] = field(default_factory=dict)
    shared_keys: set[str] = field(default_factory=set)


def _own_key(value: Any) -> str | None:
    if isinstance(value, (ShardedTensor, ShardedObject)):
        return value.key
    return None


def _spelled(path: tuple[PathElement, ...]) -> str:
    """A state-dict path as the caller wrote it: ``state_dict['a']['b'][0]``."""
    return "state_dict" + "".join(f"[{p!r}]" for p in path)


def _add_leaf(
    flat: "FlatStateDict", path: tuple[PathElement, ...], value: Any, seen: dict[int, str], parameter: bool = False
) -> None:
    """Add leaf ``value`` at ``path`` (``parameter``: the caller knows it is a Parameter)."""
    top = path[0]
    # pylint: disable-next=unidiomatic-typecheck
    name = top if len(path) == 1 and type(top) is str else ".".join(map(str, path))
    if parameter or is_parameter(value) or isinstance(value, DTensor):
        first = seen.get(id(value))
        if first is not None:
            if name != first:
                flat.aliases[name] = flat.storage_keys[first]
            return
        seen[id(value)] = name
    own = _own_key(value)
    key = own or name
    if name in flat.values:
        raise CheckpointValueError(
            f"state_dict paths {_spelled(flat.paths[name])} and {_spelled(path)} have the same dotted name "
            f"'{name}'; rename one"
        )
    users = flat.key_users.setdefault(key, [])
    # Several ShardedTensors/ShardedObjects may share a global key (different boxes); nothing else may.
    if users and (own is None or any(flat.storage_keys[u] == u for u in users)):
        first = ".".join(str(p) for p in flat.paths[users[0]])
        raise CheckpointValueError(
            f"state_dict paths '{first}' and '{name}' both map to checkpoint key '{key}'; rename one of them"
        )
    if users:
        flat.shared_keys.add(key)
    users.append(name)
    flat.values[name] = value
    flat.paths[name] = path
    flat.storage_keys[name] = key


def check_one_main_replica_per_box(flat: "FlatStateDict") -> None:
    """Refuse two main replicas of one box of a shared key on this rank (a save would keep one, silently).

    Several ShardedTensors (or ShardedObjects) of one key are the boxes of one global tensor (or object): two
    with the same global offset (and flat range) that are both main replicas both claim to be the copy written,
    and the writer kept one of them without a word. Checks :attr:`FlatStateDict.shared_keys` only. Any rank.

    Raises:
        CheckpointValueError: names both state-dict paths, the key, the box and the fix.
    """
    for key in sorted(flat.shared_keys):
        claimed: dict[tuple[Any, ...], str] = {}
        for name in flat.key_users[key]:
            value = flat.values[name]
            if not is_main_replica(value.replica_id):
                continue
            flat_range = getattr(value, "flattened_range", None)
            box = (tuple(value.global_offset),
                   None if flat_range is None else (flat_range.start, flat_range.stop))
            first = claimed.setdefault(box, name)
            if first != name and flat.values[first] is not value:  # one object under two paths (tied) is one box
                raise CheckpointValueError(
                    f"state_dict paths {_spelled(flat.paths[first])} and {_spelled(flat.paths[name])} are both the "
                    f"main replica of checkpoint key '{key}' at global offset {list(box[0])}"
                    f"{'' if box[1] is None else f' (flat range {box[1][0]}:{box[1][1]})'}: only one of them could "
                    "be saved; give the other a replica_id other than 0 if it is a copy, or its own key or offset"
                )


def cell_parameters(cell: Any, where: str) -> dict[str, Any]:
    """``cell.parameters_dict()``: its Parameters by name, refusing two different Parameters of one name.

    ``parameters_dict()`` (and ``mindspore.save_checkpoint``) keeps the last of them: the other was silently
    neither saved nor loaded. Any rank; no communication.

    Args:
        cell: The Cell.
        where: The Cell as the error names it (e.g. ``"the Cell at state_dict['model']"``).

    Raises:
        CheckpointValueError: Two Parameters share a name (names both attribute paths and the fix).
    """
    params: dict[str, Any] = {}
    for _, param in cell.parameters_and_names():  # (get_parameters()'s own loop, without its generator around it)
        other = params.setdefault(param.name, param)
        if other is not param:
            paths = [name for name, found in cell.parameters_and_names() if found is other or found is param]
            raise CheckpointValueError(
                f"{where} holds two different Parameters named '{param.name}' (at "
                f"{' and '.join(repr(p) for p in paths)}): only one of them would be saved or loaded, the other "
                "silently left out; give them unique names (e.g. auto_prefix=True on the Cells holding them)"
            )
    return params


def flatten_state_dict(state_dict: dict[str, Any]) -> FlatStateDict:
    """Flatten ``state_dict`` (see module docstring).

    Raises:
        CheckpointValueError: a non-string dict key, or two leaves that map to
            the same storage key (the message names both paths).
    """
    if not isinstance(state_dict, dict):
        raise CheckpointValueError(
            f"state_dict must be a dict, got {type(state_dict).__name__}; wrap a Cell as {{'model': net}}"
        )
    flat = FlatStateDict(values={}, paths={}, containers={(): "dict"})
    if _top_level_parameters(state_dict, flat):
        return flat
    containers = flat.containers
    values, paths, storage_keys, key_users = flat.values, flat.paths, flat.storage_keys, flat.key_users
    # An explicit stack, not nested recursive closures: those would form a
    # reference cycle holding every tensor of the state dict until the next
    # cyclic garbage collection.
    stack: list[tuple[tuple[PathElement, ...], Any]] = []
    seen: dict[int, str] = {}  # id of every Parameter reached -> its first dotted name
    parameter_type, cell_type = parameter_and_cell_types()
    for key in reversed(list(state_dict)):
        if not isinstance(key, str):
            raise CheckpointValueError(f"state_dict key {key!r} is a {type(key).__name__}; only str keys can be saved")
        stack.append(((key,), state_dict[key]))
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            containers[path] = "dict"
            if not value:
                flat.sizes[path] = 0
            for key in reversed(list(value)):
                if not isinstance(key, str):
                    raise CheckpointValueError(
                        f"state_dict key {key!r} at '{'.'.join(str(p) for p in path)}' is a "
                        f"{type(key).__name__}; only str keys can be saved"
                    )
                stack.append((path + (key,), value[key]))
        elif isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            containers[path] = "list" if isinstance(value, list) else "tuple"
            flat.sizes[path] = len(value)
            stack.extend((path + (position,), item) for position, item in reversed(list(enumerate(value))))
        elif isinstance(value, parameter_type):  # most leaves (a Parameter is no Cell)
            top = path[0]
            if (len(path) == 1 and type(top) is str and id(value) not in seen  # pylint: disable=unidiomatic-typecheck
                    and top not in values and top not in key_users):
                # The usual leaf: a Parameter at the top, reached first, its name free (_add_leaf's steps).
                seen[id(value)] = top
                key_users[top] = [top]
                values[top] = value
                paths[top] = path
                storage_keys[top] = top
            else:
                _add_leaf(flat, path, value, seen, parameter=True)
        elif isinstance(value, cell_type):
            containers[path] = "cell"
            for name, param in cell_parameters(value, f"the Cell at {_spelled(path)}").items():
                _add_leaf(flat, path + (name,), param, seen)
        else:
            _add_leaf(flat, path, value, seen)
    return flat


def _top_level_parameters(state_dict: dict[str, Any], flat: FlatStateDict) -> bool:
    """Flatten ``state_dict`` into ``flat`` when it is a dict of distinct Parameters or plain numpy arrays under str
    keys (the usual state: every leaf the loop's usual leaf, at the top reached once, its key its own), with maybe
    a few plain scalars beside them (the steps per epoch a CheckpointCallback saves: leaves of their own key too),
    column by column; else leave ``flat`` as it is and return ``False``."""
    leaves = list(state_dict.values())
    tensors = leaves if _SCALARS.isdisjoint(map(type, leaves)) else [v for v in leaves if type(v) not in _SCALARS]
    if not all_plain_leaves(tensors) or set(map(type, state_dict)) != {str} or len(set(map(id, leaves))) != len(leaves):
        return False
    keys = list(state_dict)
    flat.values.update(state_dict)
    flat.paths.update(zip(keys, zip(keys)))
    flat.storage_keys.update(zip(keys, keys))
    flat.key_users.update(zip(keys, map(list, zip(keys))))
    return True


#: Leaf types the column flattening takes beside tensors (each a leaf under its own key, as the walk makes it).
_SCALARS = frozenset({int, float, bool, str, type(None)})


def set_by_path(root: dict[str, Any], path: tuple[PathElement, ...], value: Any) -> None:
    """Replace the leaf at ``path`` in the nested ``root`` by ``value``.

    Tuples on the way are rebuilt and put back into their parent.
    """
    if len(path) == 1:
        root[path[0]] = value  # type: ignore[index]
        return
    parents: list[Any] = [root]
    node: Any = root
    for step in path[:-1]:
        node = node[step]
        parents.append(node)
    new_value = value
    for depth in range(len(path) - 1, -1, -1):
        container = parents[depth]
        step = path[depth]
        if isinstance(container, tuple):
            items = list(container)
            items[step] = new_value  # type: ignore[index]
            new_value = type(container)(items)
            continue
        if is_cell(container):
            return  # Cell parameters are loaded in place, never replaced
        container[step] = new_value
        return
