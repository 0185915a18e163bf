"""Rank files that hold whole tensors, not the slices their strategy describes: refused before the import writes.

Under MindSpore's auto / semi-auto parallel, ``save_checkpoint(...,
integrated_save=True)`` (the default, and ``ModelCheckpoint``'s) gathers every
sliced Parameter, so each rank's file holds the whole tensors. The strategy file
still describes the slices, and it records no global shape: the global shape an
import takes (a rank's tensor times the splits) is then too large, and the
"slices" of the ranks are copies of one tensor, placed side by side.
MindSpore's ``transform_checkpoints`` merges such files into tensors twice
(or more) their size, silently; so did this import.

:func:`refuse_whole_tensors` tells them from slices by their bytes: slices of a
trained (or randomly initialised) tensor differ, while these copies are equal.
It compares a page of each box first, then :data:`._ms_replicas.SAMPLE_PAGES`
pages (a small box whole): at the first parameter whose boxes differ it stops
(slices: usually after two pages, which the writer then finds in the page
cache). Only when every parameter the strategy splits has equal boxes, and one
of them is not a constant (a bias of zeros, a norm of ones: equal as slices
too), is the import refused: the files *look like* whole tensors. Real slices
can be equal too (a mixture-of-experts model whose experts were copied from
one dense layer, saved before training, with a strategy splitting only the
experts): ``--slices-may-be-equal`` skips this check alone (the replicas of
each slice are still compared); ``--no-check-replicas`` skips it as well.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Sequence

import numpy as np

from hyper_parallel.cli._ms_import import SourcePiece
from hyper_parallel.cli._ms_replicas import sample_starts
from hyper_parallel.core.distributed_checkpoint.errors import LayoutError

__all__ = ["refuse_whole_tensors"]


def _sample(piece: SourcePiece, *, first_page: bool, like: SourcePiece) -> bytes:
    """The first page of ``piece``'s bytes, or its sample pages (the whole box when it is small), at the positions
    in the box's bytes that ``like``'s file places on its pages: every box is sampled at the same positions, also
    when the files hold it at offsets that differ within a page."""
    nbytes = piece.entry.nbytes
    if first_page or nbytes <= 16 * mmap.PAGESIZE:
        return piece.file.peek(piece.entry.name, (0,), min(nbytes, mmap.PAGESIZE if first_page else nbytes))
    return piece.file.peek(piece.entry.name, sample_starts(nbytes, like.entry.segments[0][0]), mmap.PAGESIZE)


def _constant(data: bytes, itemsize: int) -> bool:
    """Whether ``data`` repeats one element (zeros, ones...)."""
    return len(data) <= itemsize or data == data[:itemsize] * (len(data) // itemsize)


def _listed(names: Sequence[str], limit: int = 4) -> str:
    """``names`` joined for a message, the first ``limit`` of them and how many more."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def refuse_whole_tensors(pieces: Sequence[SourcePiece], src: Path, strategy: str) -> None:
    """Refuse rank files whose every parameter split by the strategy has equal boxes (whole tensors on every
    rank). The importing process, while it plans, before a byte is written.

    Args:
        pieces: The boxes to store; those of parameters split into several boxes are looked at.
        src: The directory of the rank files, for the message.
        strategy: The strategy file(s), for the message.

    Raises:
        LayoutError: names a parameter, its files and the import that takes such files.
    """
    boxes: dict[str, list[SourcePiece]] = {}
    for piece in pieces:
        if piece.entry.shape != piece.global_shape and piece.entry.nbytes:
            boxes.setdefault(piece.fqn, []).append(piece)
    shown = None
    for fqn, split in sorted(boxes.items()):
        for first_page in (True, False):
            samples = [_sample(piece, first_page=first_page, like=split[0]) for piece in split]
            if any(sample != samples[0] for sample in samples[1:]):
                return  # slices
        itemsize = max(1, split[0].entry.nbytes // max(1, int(np.prod(split[0].entry.shape))))
        if shown is None and not _constant(samples[0], itemsize):
            shown = split
    if shown is None:
        return
    first = shown[0]
    params = _listed([f"'{fqn}'" for fqn in sorted(boxes)])
    files = _listed(sorted({str(piece.file.path) for split in boxes.values() for piece in split}))
    raise LayoutError(
        f"parameter '{first.fqn}': the strategy ({strategy}) splits it into {len(shown)} slices of "
        f"{list(first.entry.shape)}, but {first.file.path} and {shown[1].file.path} hold the same values, and so "
        f"do the slices of every parameter it splits ({len(boxes)} checked: {params}; in {files}): the rank files "
        "look like whole tensors, not slices. If they were saved with MindSpore's save_checkpoint(..., "
        "integrated_save=True) (ModelCheckpoint's default, which gathers them), importing them with the strategy "
        f"would make tensors of global shape {list(first.global_shape)}: import them as whole tensors, without "
        f"--strategy: hp-ckpt import {src} OUT --whole-tensors. If they are slices that are equal (experts copied "
        "from one layer, saved before training), import them with the strategy and --slices-may-be-equal "
        "(replicas are still compared)"
    )
