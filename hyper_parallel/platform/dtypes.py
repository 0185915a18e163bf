"""Framework-neutral dtype names: the names a checkpoint stores, and their numpy and MindSpore dtypes.

A checkpoint records dtypes as plain strings (``"float32"``, ``"bfloat16"``,
...; docs/format.md). Nothing here imports MindSpore except to build a
``bfloat16`` numpy dtype or a MindSpore dtype on request.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np

__all__ = ["DTYPE_NAMES", "dtype_name", "ms_dtype", "numpy_dtype", "tensor_dtype_name", "to_numpy_dtype"]

#: Every dtype name the checkpoint stores, with its element size in bytes.
DTYPE_NAMES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}


def to_numpy_dtype(value: Any) -> np.dtype:
    """Return the numpy dtype of a tensor or array without copying its data."""
    if isinstance(value, np.ndarray):
        return value.dtype
    return numpy_dtype(dtype_name(value))


def dtype_name(value: Any) -> str:
    """Return the framework-neutral dtype name of a tensor, array or dtype.

    Raises:
        TypeError: the dtype is not one the checkpoint stores.
    """
    ms = sys.modules.get("mindspore")  # a MindSpore tensor (as tensor.is_tensor tells; mindspore stays unimported)
    if ms is not None and isinstance(value, ms.Tensor):
        return tensor_dtype_name(value)  # no asnumpy(): building a bf16 view parses a buffer format
    dtype = value.dtype if hasattr(value, "dtype") else np.dtype(value)
    name = np.dtype(dtype).name
    if name not in DTYPE_NAMES:
        raise TypeError(f"dtype {name} cannot be stored in a checkpoint")
    return name


def tensor_dtype_name(value: Any) -> str:
    """:func:`dtype_name` of a value known to be a MindSpore tensor (spares the type test).

    Raises:
        TypeError: the dtype is not one the checkpoint stores.
    """
    name = _ms_dtype_name(value.dtype)
    if name not in DTYPE_NAMES:
        raise TypeError(f"dtype {name} cannot be stored in a checkpoint")
    return name


# id() of a MindSpore dtype -> (the dtype, its name): str() of a dtype costs a microsecond and hashing one
# half of that; the dtype is held, so the identity check below makes a reused id harmless.
_MS_DTYPE_NAMES: dict[int, tuple[Any, str]] = {}


def _ms_dtype_name(dtype: Any) -> str:
    hit = _MS_DTYPE_NAMES.get(id(dtype))
    if hit is not None and hit[0] is dtype:
        return hit[1]
    text = str(dtype).lower()
    name = {"bool_": "bool", "bool": "bool"}.get(text, text)
    _MS_DTYPE_NAMES[id(dtype)] = (dtype, name)
    return name


@functools.cache
def numpy_dtype(name: str) -> np.dtype:
    """Return the numpy dtype for a stored dtype name (bfloat16 needs MindSpore); looked up once per name."""
    if name == "bfloat16":
        from mindspore.common import np_dtype  # pylint: disable=import-outside-toplevel

        return np.dtype(np_dtype.bfloat16)
    if name not in DTYPE_NAMES:
        raise TypeError(f"unknown stored dtype {name!r}")
    return np.dtype(name)


def ms_dtype(name: str) -> Any:
    """Return the MindSpore dtype object for a stored dtype name."""
    import mindspore as ms  # pylint: disable=import-outside-toplevel

    return {"bool": ms.bool_}.get(name) or getattr(ms, name)
