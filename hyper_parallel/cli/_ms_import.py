"""Import MindSpore per-rank files: which rank's slice of each parameter is stored where.

A MindSpore parallel job writes ``rank_<i>/<name>.ckpt`` (or ``.safetensors``)
per rank, each holding that rank's slices. With the job's strategy file(s)
every slice gets its box in the global tensor. The import stores each
distinct box once, as a chunk of the global tensor, mapped straight from the
rank file that holds it (the lowest such rank): each stored byte is written
from there, and memory holds no tensor. The other ranks' copies of a box (its
replicas) are read once, to compare their digests with the stored copy's:
while the import is planned for a small box, by sample pages there and whole
as it is written for a larger one (:mod:`._ms_replicas`;
``--no-check-replicas`` turns that off): copies that differ are refused,
naming the ranks and files (a strategy that is not the job's, or rank files
of different steps). MindSpore's
``transform_checkpoints`` takes each destination rank's copy from its own
source rank, so differing copies have no one meaning there either.

A parameter absent from the strategy is taken whole from the lowest rank
holding it (as MindSpore's ``transform_checkpoints`` does), after checking
that every rank holds it with the same shape, dtype and bytes; an optimizer state
named after a parameter (``moment1.<param>``, ``adam_m.<param>`` ...) follows
that parameter's layout when its slices have the parameter's shape.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from hyper_parallel.cli._ms_files import STRING_DTYPE, MsEntry, MsFile
from hyper_parallel.cli._ms_read_budget import ReadBudget
from hyper_parallel.cli._ms_replicas import BoxCopies, box_copies, check_copies_while_planning
from hyper_parallel.core.distributed_checkpoint._format.checksum import digest
from hyper_parallel.core.distributed_checkpoint._format.cover import check_exact_cover
from hyper_parallel.core.distributed_checkpoint._global_plan import build_global_save_plan
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointNotFoundError,
    CheckpointValueError,
    LayoutError,
    UnsupportedFormatError,
)
from hyper_parallel.core.distributed_checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from hyper_parallel.core.distributed_checkpoint.planner import (
    BytesWriteData,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from hyper_parallel.core.distributed_checkpoint.type_handlers import serialize_value
from hyper_parallel.core.layout import Layout
from hyper_parallel.core.strategy_file import OPTIMIZER_STATE_PREFIXES, layout_for_state_key, name_prefix_difference

__all__ = ["RANK_DIR_PATTERN", "SourcePiece", "PieceSavePlanner", "check_unstored_crcs", "find_rank_files",
           "plan_rank_import", "total_bytes", "whole_pieces"]

#: A MindSpore per-rank directory name.
RANK_DIR_PATTERN = re.compile(r"^rank_(\d+)$")
_SUFFIXES = (".ckpt", ".safetensors")


@dataclass(frozen=True)
class SourcePiece:
    """A box of a global tensor, held whole by one entry of one source file.

    Attributes:
        fqn: Checkpoint key.
        file: The source file.
        entry: The entry of ``file`` holding the box.
        offsets: Global offset of the box.
        global_shape: Shape of the global tensor.
    """

    fqn: str
    file: MsFile
    entry: MsEntry
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


def find_rank_files(src: Path) -> dict[int, Path]:
    """Return rank -> the one ``.ckpt``/``.safetensors`` file of each ``src/rank_<i>/``.

    Returns an empty dict when ``src`` has no ``rank_<i>`` directory.

    Raises:
        UnsupportedFormatError: a rank directory with no checkpoint file, with
            several, two directories of one rank (``rank_1``, ``rank_01``), or
            mixing ``.ckpt`` and ``.safetensors`` across ranks.
    """
    found: dict[int, Path] = {}
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        match = RANK_DIR_PATTERN.match(entry.name)
        if not match or not entry.is_dir():
            continue
        names = sorted(f.name for f in os.scandir(entry.path)
                       if f.name.endswith(_SUFFIXES) and not f.name.startswith("."))
        if len(names) != 1:
            what = "no .ckpt or .safetensors file" if not names else f"{len(names)} checkpoint files {names}"
            raise UnsupportedFormatError(
                f"{entry.path} holds {what}: each rank_<i> directory must hold exactly one MindSpore "
                "checkpoint file (move the other steps' files away)"
            )
        rank = int(match.group(1))
        if rank in found:
            raise UnsupportedFormatError(
                f"{src} holds two directories of rank {rank} ({found[rank].parent.name}/ and {entry.name}/): one "
                "would be left out; keep the one of the job's step to import"
            )
        found[rank] = Path(entry.path) / names[0]
    suffixes = {path.suffix for path in found.values()}
    if len(suffixes) > 1:
        raise UnsupportedFormatError(f"{src} mixes .ckpt and .safetensors rank files; import one format at a time")
    return found


def _layout_pieces(
    name: str, layouts: Sequence[Layout], files: Mapping[int, MsFile], check_replicas: bool
) -> tuple[list[SourcePiece], list[BoxCopies]]:
    """One piece per distinct box of ``name``, from the lowest rank holding it; its small boxes' copies compared,
    the larger boxes' other copies' digests."""
    holders = [(r, layout) for layout in layouts for r in layout.rank_list
               if r in files and name in files[r].entries]
    first_rank, first_layout = holders[0]
    first = files[first_rank].entries[name]
    global_shape = tuple(n * s for n, s in zip(first.shape, first_layout.splits_per_dim()))
    if len(first.shape) != len(first_layout.tensor_map):
        raise LayoutError(
            f"parameter '{name}': {files[first_rank].path} holds shape {list(first.shape)} but the strategy's "
            f"tensor_map {first_layout.tensor_map} describes {len(first_layout.tensor_map)} dims"
        )
    pieces: dict[tuple[int, ...], SourcePiece] = {}
    copies: dict[tuple[int, ...], list[int]] = {}
    for rank, layout in holders:
        entry = files[rank].entries[name]
        expected = layout.local_shape(global_shape, name)
        if entry.shape != expected or entry.dtype != first.dtype:
            raise LayoutError(
                f"parameter '{name}': rank {rank} ({files[rank].path}) holds {entry.dtype} {list(entry.shape)}, "
                f"the strategy says {first.dtype} {list(expected)} (global {list(global_shape)}); "
                "pass the strategy file of the job that wrote these files"
            )
        offsets = layout.shard_offsets(global_shape, rank, name)
        pieces.setdefault(offsets, SourcePiece(name, files[rank], entry, offsets, global_shape))
        copies.setdefault(offsets, []).append(rank)
    _check_cover(name, global_shape, list(pieces.values()), layouts, files)
    replicas = [box_copies(name, offsets, global_shape, ranks, files, listed=True)
                for offsets, ranks in copies.items() if check_replicas and len(ranks) > 1]
    return list(pieces.values()), check_copies_while_planning(replicas)


def _check_cover(
    name: str, global_shape: tuple[int, ...], pieces: list[SourcePiece], layouts: Sequence[Layout],
    files: Mapping[int, MsFile],
) -> None:
    chunks = [ChunkStorageMetadata(p.offsets, p.entry.shape) for p in pieces]
    if not check_exact_cover(name, global_shape, chunks):
        return
    have = {p.offsets for p in pieces}
    missing = sorted({r for layout in layouts for r in layout.rank_list
                      if layout.shard_offsets(global_shape, r, name) not in have})
    absent = [r for r in missing if r not in files]
    reason = (f"the rank directories rank_{', rank_'.join(map(str, absent))} are missing" if absent
              else f"ranks {missing} do not hold it")
    raise CheckpointNotFoundError(
        f"parameter '{name}': slices of global shape {list(global_shape)} are missing ({reason}); "
        "copy every rank's file of the job into the source directory"
    )


def _whole_piece(name: str, files: Mapping[int, MsFile]) -> tuple[SourcePiece, list[BoxCopies]]:
    """A tensor absent from the strategy: the lowest rank's copy, all copies alike in shape, dtype and bytes.

    Its copies are compared on every rank holding it, here (a small one whole, a larger one by sample pages; rank
    files of different steps are refused before a byte is written), and a larger one's returned to be compared
    whole as it is written: a parameter the strategy does not list but the job sliced has slices of one shape on
    every rank, and only their bytes tell it from a replicated tensor (stored whole, the lowest rank's slice would
    pass for it).
    """
    holders = sorted(r for r, f in files.items() if name in f.entries)
    first = files[holders[0]].entries[name]
    for rank in holders[1:]:
        entry = files[rank].entries[name]
        if (entry.shape, entry.dtype) != (first.shape, first.dtype):
            raise LayoutError(
                f"parameter '{name}' is not in the strategy file but rank {holders[0]} holds {first.dtype} "
                f"{list(first.shape)} and rank {rank} holds {entry.dtype} {list(entry.shape)}: it is sliced; "
                "pass the strategy file(s) that list it with --strategy (one per pipeline stage), not --whole-tensors"
            )
    offsets = (0,) * len(first.shape)
    later = check_copies_while_planning([box_copies(name, offsets, first.shape, holders, files, listed=False)]) \
        if len(holders) > 1 else []
    return SourcePiece(name, files[holders[0]], first, offsets, first.shape), later


def _follows_parameter(name: str, layouts: Sequence[Layout], files: Mapping[int, MsFile]) -> bool:
    """An optimizer state follows its parameter when each rank's slice has the parameter's shape."""
    param = next(name[len(p):] for p in OPTIMIZER_STATE_PREFIXES if name.startswith(p))
    for layout in layouts:
        for rank in layout.rank_list:
            held = files[rank].entries if rank in files else {}
            if name in held and (param not in held or held[name].shape != held[param].shape):
                return False
    return True


def plan_rank_import(
    files: Mapping[int, MsFile], records: Mapping[str, Sequence[Any]], *, check_replicas: bool = True
) -> tuple[list[SourcePiece], dict[str, Any], list[BoxCopies]]:
    """Decide, for every parameter of the rank files, which boxes to store from which file.

    Args:
        files: Rank -> its indexed file.
        records: :func:`hyper_parallel.core.strategy_file.read_strategy_records` output; empty for rank files
            that hold whole tensors (``integrated_save=True``): each tensor stored once, its copies compared.
        check_replicas: Compare the copies of every box the strategy gives several ranks.

    Returns:
        The pieces to store (every distinct box once), the string values, and
        the other copies of the stored boxes larger than
        :data:`~hyper_parallel.cli._ms_replicas.PLAN_CHECK_BYTES` the strategy
        gives several ranks (``check_replicas``), read here (each once) to be
        compared whole with the stored copies as they are written
        (:class:`~hyper_parallel.cli._ms_replicas.ReplicaCheckingWriter`); a
        tensor the strategy does not list is among them whatever
        ``check_replicas``. The copies of the smaller boxes are compared here,
        those of the larger boxes by sample pages.

    Raises:
        LayoutError: a slice shape or dtype that contradicts the strategy, a
            tensor absent from the strategy that differs between ranks, or
            (``check_replicas``) copies of a box that differ: of at most
            ``PLAN_CHECK_BYTES``, or of a larger box in its sample pages or between copies not stored.
        CheckpointNotFoundError: slices of a parameter are missing (names the ranks).
        CheckpointValueError: a rank directory beyond the strategy's ranks.
    """
    layouts = {name: [record.to_layout() for record in stage_records] for name, stage_records in records.items()}
    world = max((r for ls in layouts.values() for layout in ls for r in layout.rank_list), default=max(files)) + 1
    beyond = sorted(r for r in files if r >= world)
    if beyond:
        raise CheckpointValueError(
            f"rank directories rank_{', rank_'.join(map(str, beyond))} are beyond the strategy's {world} ranks: "
            "pass the strategy file(s) of the job that wrote them (one per pipeline stage)"
        )
    names = sorted({name for f in files.values() for name in f.entries})
    _refuse_prefix_difference(sorted(layouts), names, files)
    pieces: list[SourcePiece] = []
    values: dict[str, Any] = {}
    replicas: list[BoxCopies] = []
    for name in names:
        holder = next(f for _, f in sorted(files.items()) if name in f.entries)
        if holder.entries[name].dtype == STRING_DTYPE:
            values[name] = holder.text(name)
            continue
        own = layouts.get(name)
        if own is None:
            inherited = layout_for_state_key(layouts, name)
            if inherited is not None and _follows_parameter(name, inherited, files):
                own = inherited
        if own:
            boxes, copies = _layout_pieces(name, own, files, check_replicas)
            pieces.extend(boxes)
            replicas.extend(copies)
        else:
            piece, copies = _whole_piece(name, files)
            pieces.append(piece)
            replicas.extend(copies)
    return pieces, values, replicas


def _refuse_prefix_difference(listed: Sequence[str], names: Sequence[str], files: Mapping[int, MsFile]) -> None:
    """Refuse a strategy whose parameter names differ from the rank files' by one prefix (``network.``, as a
    wrapping Cell names them): none of them matches, so every slice would be taken as a whole tensor.

    MindSpore's ``transform_checkpoints`` matches names exactly too (a name absent from the strategy is not
    sliced), so such a pair has no meaning there either; the user names the right file.

    Raises:
        CheckpointValueError: names the prefix, one name of each side, the file holding it, and the fix.
    """
    if not listed or not names or set(listed) & set(names):
        return
    found = name_prefix_difference(listed, set(names))
    if found is None:
        return
    prefix, strategy_has_it = found
    if strategy_has_it:
        held = listed[0][len(prefix):]
        lacking = f"the strategy names its parameters with the prefix '{prefix}' that the rank files' names lack"
    else:
        held = prefix + listed[0]
        lacking = f"the rank files name their parameters with the prefix '{prefix}' that the strategy's names lack"
    holder = next(f for _, f in sorted(files.items()) if held in f.entries)
    raise CheckpointValueError(
        f"{lacking} ('{listed[0]}' in the strategy, '{held}' in {holder.path}; all {len(listed)} parameters the "
        "strategy lists differ only by it), so no parameter would find its layout and each rank's slice would "
        "pass for a whole tensor (MindSpore's transform_checkpoints matches names exactly too). Pass the strategy "
        "file the job that wrote these rank files saved (its strategy_ckpt_config save_file), or save the rank "
        f"files from the network the strategy was written for (a parameter named '{listed[0]}')"
    )


def whole_pieces(files: Sequence[MsFile]) -> tuple[list[SourcePiece], dict[str, Any]]:
    """Every entry of ``files`` as a whole tensor (or string value); a name in two files is refused."""
    pieces: list[SourcePiece] = []
    values: dict[str, Any] = {}
    seen: dict[str, Path] = {}
    for file in files:
        for name, entry in file.entries.items():
            if name in seen:
                raise CheckpointValueError(
                    f"tensor '{name}' appears in both {seen[name]} and {file.path}: they are not shards of one "
                    "model (two saves of one network, as ModelCheckpoint writes one per step?); import one file "
                    f"(hp-ckpt import {file.path} OUT), or move the other away"
                )
            seen[name] = file.path
            if entry.dtype == STRING_DTYPE:
                values[name] = file.text(name)
            else:
                pieces.append(SourcePiece(name, file, entry, (0,) * len(entry.shape), entry.shape))
    return pieces, values


def check_unstored_crcs(files: Iterable[MsFile], pieces: Sequence[SourcePiece]) -> None:
    """Check the stored crc of ``files`` over the entries no piece stores (replicas). Single process.

    The stored entries are accounted for as the writer reads them (the last
    one checks the file); the others are read here, once, before the save.

    Raises:
        CorruptCheckpointError: a file whose contents are all read now does not match its stored crc.
    """
    stored: dict[int, set[str]] = {}
    for piece in pieces:
        stored.setdefault(id(piece.file), set()).add(piece.entry.name)
    for file in files:
        file.check_crc_except(stored.get(id(file), set()))


class PieceSavePlanner(SavePlanner):
    """Saves :class:`SourcePiece` boxes mapped from their files, and plain values.

    Used with ``dcp.save({}, planner=..., no_dist=True)``: one process writes
    the whole checkpoint. The ``state_dict`` given to ``configure_planner`` is
    ignored; the pieces are the state.

    Args:
        pieces: The tensor boxes to store.
        values: Plain values to store (key -> value).
    """

    def __init__(self, pieces: Sequence[SourcePiece], values: Mapping[str, Any]) -> None:
        self._pieces = {MetadataIndex(p.fqn, p.offsets): p for p in pieces}
        self._values = dict(values)
        self._bytes: dict[MetadataIndex, bytes] = {}
        # The writer asks for every piece before hashing and writing them: announce (read at once,
        # exactly) what fits in a quarter of the available memory; see MsFile.raw.
        self._budget = ReadBudget.of_memory()

    def configure_planner(self, state_dict: dict[str, Any], *, rank: int = 0, world_size: int = 1,
                          is_coordinator: bool = True, remove_redundancy: bool = True,
                          save_to_minimum_rank: bool = False) -> None:
        """Nothing to configure: the pieces were given to the constructor. Single process."""

    def build_local_plan(self) -> SavePlan:
        """One item per piece and per value. Single process."""
        items = []
        for index, piece in self._pieces.items():
            whole = piece.entry.shape == piece.global_shape
            items.append(WriteItem(
                index=index,
                type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                tensor_data=TensorWriteData(ChunkStorageMetadata(piece.offsets, piece.entry.shape),
                                            TensorProperties(dtype=piece.entry.dtype), piece.global_shape),
            ))
        for key, value in self._values.items():
            type_name, payload = serialize_value(value, key=key)
            index = MetadataIndex(key, ())
            self._bytes[index] = payload
            items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO,
                                   bytes_io_data=BytesWriteData(type_name, len(payload), digest(payload))))
        return SavePlan(items=tuple(items))

    def build_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Validate and describe (exact cover, sizes). Single process."""
        return build_global_save_plan([SavePlan(p.items, p.storage_data) for p in all_plans])

    def finalize_plan(self, plan: SavePlan) -> SavePlan:
        """Keep the plan. Single process."""
        return plan

    def get_data(self, item: WriteItem) -> np.ndarray | bytes:
        """The piece's bytes mapped from its file (no copy), or a value's payload. Called by the writer."""
        index = MetadataIndex(item.index.fqn, item.index.offset)
        if item.type == WriteItemType.BYTE_IO:
            return self._bytes[index]
        piece = self._pieces[index]
        return piece.file.raw(piece.entry.name, budget=self._budget)


def total_bytes(pieces: Sequence[SourcePiece]) -> int:
    """Bytes of all pieces (what the import reads and writes)."""
    return sum(p.entry.nbytes for p in pieces)
