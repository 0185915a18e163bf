"""Which checkpoint keys a command exports, and under what names.

Steps, in order: (1) unless ``everything``, the model only: keys under a
top-level ``model.`` group when the checkpoint has one (the prefix is then
stripped), otherwise every key that is not optimizer state (the patterns of
:data:`OPTIMIZER_PATTERNS`: MindSpore's ``moment1.`` / ``moment2.`` /
``beta1_power`` / ``global_step`` / ``learning_rate`` ..., an
``optimizer.`` group, PyTorch-style ``exp_avg``; the training position
``hyper_parallel.steps_per_epoch`` of ``CheckpointCallback``; and a
MindSpore optimizer's per-parameter state ``<prefix>.<param>`` for a prefix
of :data:`SHADOW_PREFIXES` (``lamb_m.``, ``mean_square.``, ``linear.``,
``moment.``...) when ``<param>`` is itself a key of the same shape, the
Parameter it shadows: ``linear.`` or ``moment.`` alone are ordinary layer
names, so no glob can tell); a state dict of groups
(``dcp.save({"net": net, "opt": opt})``, any group names) is read the same way
one level down: a group whose every key is optimizer state (by those patterns,
or ``<group>.<prefix>.<param>`` beside ``<other group>.<param>`` or
``<param>`` of the same shape) and which holds the optimizer's bookkeeping
(``global_step``, ``learning_rate``, ``beta1_power``...) is the optimizer's
group and left out; when its state shadows the keys of one other group
(``opt.moment1.linear.weight`` -> ``net.linear.weight``), that group is the
network: its keys alone are kept, its prefix stripped, as for ``model.``
(:func:`optimizer_groups`); (2) ``include`` globs, if
any, keep only the keys matching one; (3) ``exclude`` globs drop keys; (4)
the first matching ``strip_prefixes`` entry is cut off the name; (5) the
first matching ``renames`` pair ``(old, new)`` replaces the prefix ``old``
by ``new``. Globs use :mod:`fnmatch` on the stored key (``*`` crosses dots).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.metadata import TensorStorageMetadata
from hyper_parallel.core.strategy_file import OPTIMIZER_STATE_PREFIXES

__all__ = [
    "OPTIMIZER_PATTERNS", "SHADOW_PREFIXES", "KeySelection", "parse_rename", "is_shadow_state", "optimizer_groups",
]

#: Keys that hold optimizer (or training loop) state rather than model weights (fnmatch globs).
OPTIMIZER_PATTERNS: tuple[str, ...] = (
    "optimizer.*", "optim.*", "opt_state.*",
    "moment1.*", "moment2.*", "moments.*", "accum.*", "adam_m.*", "adam_v.*", "exp_avg*",
    "*.moment1.*", "*.moment2.*", "*.exp_avg", "*.exp_avg_sq", "*.momentum_buffer",
    "beta1_power", "beta2_power", "global_step", "learning_rate",
    "current_iterator_step", "last_overflow_iterator_step",
    "hyper_parallel.steps_per_epoch", "momentum", "fake_lr", "fake_param",
)
#: The ``Parameter.clone(prefix=...)`` prefixes of MindSpore's optimizers (``mindspore/nn/optim``,
#: ``mindspore/experimental/optim``; ``ax_.`` is ``nn.ASGD``'s): ``<prefix>.<param>`` is optimizer state when
#: ``<param>`` is a key of the same shape.
SHADOW_PREFIXES: tuple[str, ...] = OPTIMIZER_STATE_PREFIXES + ("ax_.",)
#: ``nn.ASGD``'s per-parameter 0-d state ``eta_<param>`` / ``mu_<param>`` (``<param>`` a tensor key).
_SCALAR_SHADOW_PREFIXES = ("eta_", "mu_")
_MODEL_GROUP = "model."
#: An optimizer's bookkeeping keys: a group holding one of them and optimizer state only is an optimizer's group.
_BOOKKEEPING = ("beta1_power", "beta2_power", "global_step", "learning_rate", "momentum")


def parse_rename(text: str) -> tuple[str, str]:
    """``"old=new"`` -> ``("old", "new")``.

    Raises:
        CheckpointValueError: no ``=`` or an empty ``old``.
    """
    old, sep, new = text.partition("=")
    if not sep or not old:
        raise CheckpointValueError(f"--rename {text!r}: expected OLD_PREFIX=NEW_PREFIX (NEW_PREFIX may be empty)")
    return old, new


def is_shadow_state(key: str, shapes: Mapping[str, tuple[int, ...] | None]) -> bool:
    """Whether ``key`` is a MindSpore optimizer's state of another key of the checkpoint.

    ``<prefix>.<param>`` for a prefix of :data:`SHADOW_PREFIXES` is, when ``<param>`` is a tensor of the same
    shape (``moment.linear.weight`` beside ``linear.weight``; FTRL's ``linear.linear.weight`` beside
    ``linear.weight``); ASGD's ``eta_<param>`` / ``mu_<param>`` is, when 0-d and ``<param>`` is a tensor.

    Args:
        key: The checkpoint key.
        shapes: Every key of the checkpoint -> its tensor shape (``None`` for a non-tensor value).
    """
    return bool(_owners(key, key, shapes, ()))


def optimizer_groups(shapes: Mapping[str, tuple[int, ...] | None]) -> tuple[frozenset[str], str | None]:
    """The optimizers' groups of a state dict of groups, and the network's group when one is told.

    A top-level group ``<g>.`` is an optimizer's when it holds a bookkeeping key (``<g>.global_step``,
    ``<g>.learning_rate``, ``<g>.beta1_power``...) and every key of it is optimizer state: one of
    :data:`OPTIMIZER_PATTERNS` below ``<g>.``, or ``<g>.<prefix>.<param>`` (a prefix of :data:`SHADOW_PREFIXES`)
    beside a tensor ``<other group>.<param>`` or ``<param>`` of the same shape. The network's group is the one
    other group that this state shadows (``opt.moment1.linear.weight`` -> ``net.linear.weight``); ``None`` when
    none or several are, or when the state shadows ungrouped keys too.

    Args:
        shapes: Every key of the checkpoint -> its tensor shape (``None`` for a non-tensor value).
    """
    groups: dict[str, list[str]] = {}
    for key in shapes:
        group, dot, rest = key.partition(".")
        if dot:
            groups.setdefault(group, []).append(rest)
    optimizers: set[str] = set()
    owners: set[str] = set()
    for group, rests in groups.items():
        if not any(rest in _BOOKKEEPING for rest in rests):
            continue
        found: set[str] = set()
        others = [other for other in groups if other != group]
        for rest in rests:
            shadowed = _owners(f"{group}.{rest}", rest, shapes, others)
            if not shadowed and not _matches(rest, OPTIMIZER_PATTERNS):
                break
            found |= shadowed
        else:
            optimizers.add(group)
            owners |= found
    network = next(iter(owners)) if len(owners) == 1 else None
    return frozenset(optimizers), network or None


def _owners(key: str, rest: str, shapes: Mapping[str, tuple[int, ...] | None], groups: Iterable[str]) -> set[str]:
    """The groups (``""``: ungrouped, else one of ``groups``) holding the ``<param>`` that ``key`` is a MindSpore
    optimizer's state of, ``rest`` being ``key`` without its group (``<prefix>.<param>``): ``<param>`` (or
    ``<group>.<param>``) of the same shape, or any tensor for ASGD's 0-d ``eta_`` / ``mu_`` state."""
    shape = shapes.get(key)
    if shape is None:
        return set()
    params = [(rest[len(prefix):], shape) for prefix in SHADOW_PREFIXES if rest.startswith(prefix)]
    if shape == ():  # nn.ASGD's eta_<param> / mu_<param>: beside a tensor of any shape
        params += [(rest[len(prefix):], None) for prefix in _SCALAR_SHADOW_PREFIXES if rest.startswith(prefix)]
    found = set()
    for param, want in params:
        for other, name in [("", param)] + [(other, f"{other}.{param}") for other in groups]:
            if shapes.get(name) is not None and want in (None, shapes.get(name)):
                found.add(other)
    return found


def _shapes(given: Mapping[str, Any] | Iterable[str]) -> dict[str, tuple[int, ...] | None]:
    """Key -> tensor shape from shapes, metadata entries or the keys alone (shapes unknown: ``None``)."""
    if not isinstance(given, Mapping):
        return dict.fromkeys(given)
    return {key: tuple(value.size) if isinstance(value, TensorStorageMetadata) else
            value if isinstance(value, tuple) else None for key, value in given.items()}


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

    def names(self, shapes: Mapping[str, Any] | Iterable[str]) -> dict[str, str]:
        """Map every selected key to its output name, in sorted key order.

        Args:
            shapes: Every key of the checkpoint -> its tensor shape (``None`` for a non-tensor value) or its
                metadata entry (``Metadata.state_dict_metadata``); the shapes tell a MindSpore optimizer's state
                from a layer of the same name (:func:`is_shadow_state`) and an optimizer's group from a network's
                (:func:`optimizer_groups`). The keys alone (no shapes) are also
                taken: optimizer state is then told by :data:`OPTIMIZER_PATTERNS` only.

        Raises:
            CheckpointValueError: two keys end up with one output name (both named).
        """
        shapes = _shapes(shapes)
        keys = sorted(shapes)
        auto_strip: tuple[str, ...] = ()
        if not self.everything:
            grouped = [k for k in keys if k.startswith(_MODEL_GROUP)]
            optimizers, network = optimizer_groups(shapes) if not grouped else (frozenset(), None)
            if network is not None:
                grouped, auto_strip = [k for k in keys if k.startswith(network + ".")], (network + ".",)
            if grouped:
                keys, auto_strip = grouped, auto_strip or (_MODEL_GROUP,)
            else:
                keys = [k for k in keys if not _matches(k, OPTIMIZER_PATTERNS) and not is_shadow_state(k, shapes)
                        and k.partition(".")[0] not in optimizers]
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
