"""Classifying one state-dict leaf for a planner, with errors naming its key.

Shared by :mod:`._save_planner` and :mod:`._load_planner`.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.core.distributed_checkpoint.errors import UnsupportedTypeError
from hyper_parallel.core.distributed_checkpoint._state_items import SkipEntry, TensorEntry, ValueEntry, make_entry

__all__ = ["classify_leaf"]


def classify_leaf(fqn: str, value: Any) -> TensorEntry | ValueEntry | SkipEntry:
    """:func:`make_entry`, with a tensor of a dtype no checkpoint stores reported against its key."""
    try:
        return make_entry(fqn, value)
    except TypeError as exc:
        if isinstance(exc, UnsupportedTypeError):
            raise
        raise UnsupportedTypeError(
            f"checkpoint item {fqn!r}: {exc}; convert it to bool, an integer or float dtype, or bfloat16"
        ) from exc
