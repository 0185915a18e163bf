"""Which checkpoint keys a command exports, and under what names.

Steps, in order: (1) unless ``everything``, the model only: keys under a
top-level ``model.`` group when the checkpoint has one (the prefix is then
stripped), otherwise every key that is not optimizer state (the patterns of
:data:`OPTIMIZER_PATTERNS`: MindSpore's ``moment1.`` / ``moment2.`` /
``beta1_power`` / ``global_step`` / ``learning_rate`` ..., an
``optimizer.`` group, PyTorch-style ``exp_avg``; the training position
``hyper_parallel.steps_per_epoch`` of ``CheckpointCallback``); (2) ``include`` globs, if
any, keep only the keys matching one; (3) ``exclude`` globs drop keys; (4)
the first matching ``strip_prefixes`` entry is cut off the name; (5) the
first matching ``renames`` pair ``(old, new)`` replaces the prefix ``old``
by ``new``. Globs use :mod:`fnmatch` on the stored key (``*`` crosses dots).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Iterable

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError

__all__ = ["OPTIMIZER_PATTERNS", "KeySelection", "parse_rename"]

#: Keys that hold optimizer (or training loop) state rather than model weights (fnmatch globs).
OPTIMIZER_PATTERNS: tuple[str, ...] = (
    "optimizer.*", "optim.*", "opt_state.*",
    "moment1.*", "moment2.*", "moments.*", "accum.*", "adam_m.*", "adam_v.*", "exp_avg*",
    "*.moment1.*", "*.moment2.*", "*.exp_avg", "*.exp_avg_sq", "*.momentum_buffer",
    "beta1_power", "beta2_power", "global_step", "learning_rate", "current_iterator_step", "last_overflow_iterator_step",
    "hyper_parallel.steps_per_epoch",
)
_MODEL_GROUP = "model."


def parse_rename(text: str) -> tuple[str, str]:
    """``"old=new"`` -> ``("old", "new")``.

    Raises:
        CheckpointValueError: no ``=`` or an empty ``old``.
    """
    old, sep, new = text.partition("=")
    if not sep or not old:
        raise CheckpointValueError(f"--rename {text!r}: expected OLD_PREFIX=NEW_PREFIX (NEW_PREFIX may be empty)")
    return old, new


@dataclass(frozen=True)
class KeySelection:
    """The keys to export and their output names (see the module docstring for the order).

    Attributes:
        everything: Export optimizer state and every group too (no model-only step).
        include: Keep only keys matching one of these globs (all when empty).
        exclude: Drop keys matching one of these globs.
        strip_prefixes: Cut the first matching prefix off each name.
        renames: ``(old, new)`` prefix replacements; the first match applies.
    """

    everything: bool = False
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    strip_prefixes: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()

    def names(self, keys: Iterable[str]) -> dict[str, str]:
        """Map every selected key to its output name, in sorted key order.

        Raises:
            CheckpointValueError: two keys end up with one output name (both named).
        """
        keys = sorted(keys)
        auto_strip: tuple[str, ...] = ()
        if not self.everything:
            grouped = [k for k in keys if k.startswith(_MODEL_GROUP)]
            if grouped:
                keys, auto_strip = grouped, (_MODEL_GROUP,)
            else:
                keys = [k for k in keys if not _matches(k, OPTIMIZER_PATTERNS)]
        if self.include:
            keys = [k for k in keys if _matches(k, self.include)]
        keys = [k for k in keys if not _matches(k, self.exclude)]
        out: dict[str, str] = {}
        owner: dict[str, str] = {}
        for key in keys:
            name = _cut(key, auto_strip + self.strip_prefixes)
            for old, new in self.renames:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            if not name:
                raise CheckpointValueError(f"key '{key}': stripping and renaming leave an empty name")
            if name in owner:
                raise CheckpointValueError(
                    f"keys '{owner[name]}' and '{key}' would both be written as '{name}'; "
                    "narrow --include / --exclude or change --strip-prefix / --rename"
                )
            owner[name] = key
            out[key] = name
        return out


def _matches(key: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)


def _cut(name: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name
