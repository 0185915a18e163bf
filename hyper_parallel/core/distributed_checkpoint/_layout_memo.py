"""A save repeating a recent save's MindSpore tensors skips its layout pass.

A training job saves the same Parameters again and again. The layout pass
(:func:`._save_layout.describe_layout`) then meets, leaf by leaf, what the
previous save met: the same keys, tensors, dtypes and shapes, hence the same
layout digest. :func:`remember` keeps what a pass found about a state of
MindSpore tensors in host memory (for the last :data:`SLOTS` states of
different names: a job saving two states in turn recalls both); :func:`recall`
hands it back when the state
holds, in the same order under the same names, the very tensor objects with
their dtype, shape and memory (``data_ptr``) unchanged, and their numpy views
(:func:`.platform.tensor.cached_views_at`) of the shape and dtype recorded. Every
leaf is still read (its ``data_ptr``, shape and dtype), column by column:

- ``Parameter.set_data`` / ``set_dtype`` / ``assign_value`` give the tensor
  new memory (a new ``data_ptr``, measured with MindSpore 2.10): missed;
- a Parameter replaced by another object, a key added, removed, renamed or
  moved: missed (the tensors are held weakly, so an id reused by a new
  object never matches);
- a changed dtype or shape (``assign_value`` of a bitcast keeps the memory): missed;
- a tensor made non-contiguous in its own memory (``assign_value(p.T)`` keeps
  ``data_ptr``, shape and dtype): its cached view is not handed out
  (:func:`.platform.tensor.cached_views_at`), missed.

Other leaves (values such as the steps per epoch a :class:`.CheckpointCallback`
saves, skipped leaves) are classified and serialised again by every save, as
the pass does: the memo holds only when each has its remembered layout row
(a value whose payload changed is a new layout).

Only states whose every tensor leaf is a whole MindSpore tensor in host
memory (C-contiguous, native byte order), without aliases or sharded
tensors, are remembered, and only for a pass that hashes no replicas (one
rank, or ``check_replicas`` off): replica digests depend on the values. The
memo holds no tensor and no view: names, ids, weak references, shapes,
dtypes, the value leaves' rows and the layout found.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from operator import attrgetter, is_, methodcaller
from typing import Any

import numpy as np

from hyper_parallel.platform.tensor import cached_views_at
from hyper_parallel.platform.tensor_readers import column_readers

__all__ = ["SLOTS", "LayoutMemo", "recall", "remember", "forget"]

_SHAPE, _DTYPE, _NBYTES = attrgetter("shape"), attrgetter("dtype"), attrgetter("nbytes")
_DEREF, _DATA_PTR = methodcaller("__call__"), methodcaller("data_ptr")


@dataclass(frozen=True)
class LayoutMemo:
    """What a layout pass found about a state of MindSpore tensors (see the module docstring).

    Attributes:
        names: The leaves' dotted names, in traversal order.
        tensor_names: The names of the tensor leaves, in order (the columns below are theirs).
        others: ``(name, layout row)`` of each other leaf (a value or a skipped leaf), in order: whoever recalls
            the memo checks each has that row again (:func:`._save_layout.describe_layout`).
        ids: ``id`` of each leaf's tensor.
        refs: A weak reference to each leaf's tensor.
        shapes: Each tensor's shape.
        dtypes: Each tensor's MindSpore dtype.
        pointers: Each tensor's ``data_ptr()``.
        view_dtypes: Each tensor's numpy view's dtype.
        nbytes: Bytes of each leaf.
        layout: The pass's result (a :class:`._save_layout.LayoutDescription`).
    """

    names: list[str]
    tensor_names: list[str]
    others: tuple[tuple[str, tuple[Any, ...]], ...]
    ids: list[int]
    refs: list[weakref.ref[Any]]
    shapes: list[tuple[int, ...]]
    dtypes: list[Any]
    pointers: list[int]
    view_dtypes: list[np.dtype]
    nbytes: list[int]
    layout: Any


#: The memos kept, the most recent first (at most :data:`SLOTS`).
_MEMOS: tuple[LayoutMemo, ...] = ()
#: States remembered at once: a job saving two states in turn (a model's and its optimizer's) recalls both.
SLOTS = 2


def remember(values: dict[str, Any], views: dict[str, np.ndarray], layout: Any, *,
             others: tuple[tuple[str, tuple[Any, ...]], ...] = ()) -> None:
    """Keep what a layout pass found about ``values`` (the flattened state: leaf name -> leaf). Any thread.

    Args:
        values: The flattened state, without aliases: whole MindSpore tensors in host memory and ``others``.
        views: Each tensor leaf's numpy view as the pass met it (C-contiguous, native byte order), by name.
        layout: The pass's result.
        others: ``(name, layout row)`` of every other leaf (skipped, or stored as a value).
    """
    global _MEMOS  # pylint: disable=global-statement
    names = list(values)
    kept = tuple(memo for memo in _MEMOS if memo.names != names)  # a state of these names again: its new pass
    _MEMOS = kept
    tensor_names = list(views)
    tensors = list(map(values.__getitem__, tensor_names)) if others else list(values.values())
    views = list(views.values())
    try:
        refs = list(map(weakref.ref, tensors))
        memo = LayoutMemo(names=names, tensor_names=tensor_names, others=others,
                          ids=list(map(id, tensors)), refs=refs,
                          shapes=list(map(_SHAPE, tensors)), dtypes=list(map(_DTYPE, tensors)),
                          pointers=list(map(_DATA_PTR, tensors)), view_dtypes=list(map(_DTYPE, views)),
                          nbytes=list(map(_NBYTES, views)), layout=layout)
    except (AttributeError, RuntimeError, TypeError, ValueError):  # pragma: no cover - a tensor class without weak
        return  # references, dtype or data_ptr (MindSpore's have them): not kept
    _MEMOS = (memo,) + kept[: SLOTS - 1]


def forget() -> None:
    """Drop the memos (the next pass walks every leaf)."""
    global _MEMOS  # pylint: disable=global-statement
    _MEMOS = ()


def recall(values: dict[str, Any]) -> tuple[LayoutMemo, list[np.ndarray]] | None:
    """The memo and each tensor leaf's numpy view, when ``values`` repeats the remembered state's names and tensors;
    else ``None``. Any thread. The caller checks the other leaves (:attr:`LayoutMemo.others`).

    Reads every leaf's identity, shape, dtype and ``data_ptr`` (through MindSpore's C readers where the tensor class
    inherits them unchanged, :func:`.platform.tensor_readers.column_readers`), and checks its cached view's shape
    and dtype.
    """
    names = None
    for memo in _MEMOS:
        if len(values) != len(memo.names):
            continue
        if names is None:
            names = list(values)
        if names == memo.names:
            found = _recall(memo, values)
            if found is not None:
                return memo, found
    return None


def _recall(memo: LayoutMemo, values: dict[str, Any]) -> list[np.ndarray] | None:
    """Each tensor leaf's numpy view, when ``values`` (of ``memo``'s names) holds ``memo``'s tensors unchanged."""
    tensors = list(map(values.__getitem__, memo.tensor_names)) if memo.others else list(values.values())
    if list(map(id, tensors)) != memo.ids or not all(map(is_, map(_DEREF, memo.refs), tensors)):
        return None
    read = column_readers(set(map(type, tensors)))
    try:
        dtypes = list(map(read.dtype, tensors))
        if list(map(read.shape, tensors)) != memo.shapes or dtypes != memo.dtypes:
            return None
        pointers = list(map(read.data_ptr, tensors))
    except (AttributeError, RuntimeError, TypeError, ValueError):  # pragma: no cover - the tensors remembered had them
        return None
    if pointers != memo.pointers:
        return None
    views = cached_views_at(tensors, pointers, dtypes, is_contiguous=read.is_contiguous)
    if views is None or list(map(_SHAPE, views)) != memo.shapes or list(map(_DTYPE, views)) != memo.view_dtypes:
        return None
    return views
