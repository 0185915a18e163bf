"""Checking the types and ranges of the options callers pass (one error type, naming the option).

Options passed as arguments (:func:`check_option`) and the waits set by environment variables
(:func:`seconds_from_env`).
"""

from __future__ import annotations

import os
from typing import Any

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError

__all__ = ["check_option", "seconds_from_env"]

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


def seconds_from_env(name: str, default: float, *, example: float, zero_waits_forever: bool,
                     zero_means: str = "wait forever") -> float | None:
    """Seconds to wait, from the environment variable ``name`` (``default`` when unset or blank). Any rank.

    With ``zero_waits_forever``, ``0`` or less means no limit (``None``; what that does for this variable,
    ``zero_means``, is said in the refusal); else the value must be positive.

    Raises:
        CheckpointValueError: Not a number of seconds (or, without ``zero_waits_forever``, not positive); names
            the variable, its value and ``example``.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        seconds: float | None = float(text)
    except ValueError:
        seconds = None
    if zero_waits_forever:
        if seconds is None:
            raise CheckpointValueError(
                f"{name}={text!r} is not a number of seconds; set e.g. {example:g}, or 0 to {zero_means}")
        return seconds if seconds > 0 else None
    if seconds is None or not seconds > 0:
        raise CheckpointValueError(f"{name}={text!r} is not a positive number of seconds; set e.g. {example:g}")
    return seconds
