"""Checking the types and ranges of the options callers pass (one error type, naming the option)."""

from __future__ import annotations

from typing import Any

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError

__all__ = ["check_option"]

_KIND_NAMES = {int: "an int", float: "a number", bool: "a bool"}


def check_option(name: str, value: Any, kind: type, *, minimum: float | None = None, optional: bool = False) -> None:
    """Refuse ``value`` for option ``name`` unless it is a ``kind`` (``None`` too if ``optional``) >= ``minimum``.

    ``float`` accepts ints as well; ``int`` refuses ``bool`` and floats (``1.5``, ``2.0``).

    Raises:
        CheckpointValueError: naming the option, the value and what it must be.
    """
    if value is None and optional:
        return
    if kind is float:
        fits = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        fits = isinstance(value, int) and not isinstance(value, bool)
    else:
        fits = isinstance(value, kind)
    what = _KIND_NAMES.get(kind, kind.__name__)
    if minimum is not None:
        what += f" >= {minimum}"
    if optional:
        what += " or None"
    if not fits or (minimum is not None and value < minimum) or value != value:  # (NaN)
        raise CheckpointValueError(f"option {name} must be {what}, got {value!r} ({type(value).__name__})")
