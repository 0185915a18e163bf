"""Classifying one state-dict leaf for a planner, with errors naming its key.

Shared by :mod:`._save_planner` and :mod:`._load_planner`. A tensor of a dtype
no checkpoint holds (complex, ``float128``, a structured or string dtype) is
refused naming its key and a conversion that fits its kind; a load target of
such a dtype is refused naming the stored dtype to load into instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint.errors import UnsupportedTypeError
from hyper_parallel.core.distributed_checkpoint.mapping import ShardedTensor
from hyper_parallel.core.distributed_checkpoint.metadata import TensorStorageMetadata
from hyper_parallel.core.distributed_checkpoint._state_items import SkipEntry, TensorEntry, ValueEntry, make_entry
from hyper_parallel.platform.dtypes import dtype_name

__all__ = ["classify_leaf", "dtype_advice", "local_data", "unstorable_target"]

_STORED_KINDS = "a checkpoint holds bool, integer and float dtypes and bfloat16"


def classify_leaf(fqn: str, value: Any) -> TensorEntry | ValueEntry | SkipEntry:
    """:func:`make_entry`, with a tensor of a dtype no checkpoint stores reported against its key."""
    try:
        return make_entry(fqn, value)
    except UnsupportedTypeError as exc:  # (make_entry raises no other TypeError)
        dtype = _unstorable_dtype(value)
        if dtype is None:
            raise
        raise UnsupportedTypeError(
            f"checkpoint item {fqn!r}: dtype {dtype} cannot be stored in a checkpoint; {dtype_advice(value)}"
        ) from exc


def local_data(value: Any) -> Any:
    """The tensor holding a leaf's values: a ShardedTensor's data, a DTensor's shard, else the leaf."""
    if isinstance(value, ShardedTensor):
        return value.data
    if hasattr(value, "to_local") and hasattr(value, "layout"):
        return value.to_local()
    return value


def _unstorable_dtype(value: Any) -> str | None:
    """The name of a tensor leaf's dtype when no checkpoint holds it (a structured dtype shown with its fields);
    ``None`` for a storable dtype or a leaf that is no tensor. Error paths only."""
    local = local_data(value)
    if not hasattr(local, "dtype") or not hasattr(local, "shape"):
        return None
    try:
        dtype_name(local)
        return None
    except TypeError:
        pass
    dtype = local.dtype
    if isinstance(dtype, np.dtype) and dtype.names:
        return f"{dtype.name} (structured: {dtype})"
    return dtype.name if isinstance(dtype, np.dtype) else str(dtype).lower()


def dtype_advice(value: Any) -> str:
    """What to do with a tensor leaf of a dtype no checkpoint holds, by its kind (complex, extended float,
    structured, string)."""
    dtype = getattr(local_data(value), "dtype", None)
    text = str(dtype).lower()
    if isinstance(dtype, np.dtype) and dtype.names:
        return f"store each field as an array of its own (value['{dtype.names[0]}'], ...); {_STORED_KINDS}"
    if "complex" in text:
        return f"store its .real and .imag as two float arrays; {_STORED_KINDS}"
    if isinstance(dtype, np.dtype) and dtype.kind == "f":  # float128 / longdouble
        return f"convert it with .astype(np.float64) (precision beyond float64's is lost); {_STORED_KINDS}"
    if isinstance(dtype, np.dtype) and dtype.kind in "USO":
        return f"store it as a list (value.tolist()), saved as a value; {_STORED_KINDS}"
    return "convert it to bool, an integer or float dtype, or bfloat16"


def unstorable_target(fqn: str, value: Any, stored: Any, *, target: str | None = None) -> UnsupportedTypeError | None:
    """The refusal of a load target of a dtype no checkpoint holds (``None`` for any other target). Error paths.

    Args:
        fqn: The checkpoint key the target loads.
        value: The target.
        stored: The key's stored record (``None`` when the checkpoint lacks the key).
        target: The target's own name when it differs from ``fqn`` (``load_checkpoint``'s net entry).
    """
    dtype = _unstorable_dtype(value)
    if dtype is None:
        return None
    kind = "numpy array" if isinstance(local_data(value), np.ndarray) else type(local_data(value)).__name__
    named = f"the target '{target}'" if target is not None and target != fqn else "the target"
    if isinstance(stored, TensorStorageMetadata):
        stored_dtype, shape = stored.properties.dtype, list(stored.size)
        example = ("mindspore.Tensor(shape=..., dtype=mindspore.bfloat16, init=Zero())" if stored_dtype == "bfloat16"
                   else f"np.zeros({tuple(shape)}, dtype='{stored_dtype}')")
        fix = (f"the checkpoint stores it as {stored_dtype} of shape {shape}: load into a target of that dtype "
               f"(e.g. {example}) and convert it afterwards")
    else:
        fix = f"load into a target of a dtype a checkpoint holds ({_STORED_KINDS[len('a checkpoint holds '):]})"
    return UnsupportedTypeError(
        f"key '{fqn}': {named} is a {kind} of dtype {dtype}, which no checkpoint can hold, so no value can be "
        f"loaded into it; {fix}; nothing was loaded"
    )
