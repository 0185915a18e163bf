"""``hp-ckpt export-mindspore CKPT OUT [--strategy FILE ...] [--format ckpt|safetensors]``.

Writes what a MindSpore job loads with ``mindspore.load_checkpoint`` +
``load_param_into_net``:

- with the destination job's strategy file(s) (one per pipeline stage, or one
  merged file): ``OUT/rank_<i>/<name>_<i>.<format>`` for every rank ``i`` of
  the job, holding that rank's slice of every parameter of its stage, as
  ``mindspore.parallel.transform_checkpoints(..., "<name>_", ...)`` names them;
- without: one unified file ``OUT/<name>.<format>`` of full tensors.

A tensor the strategy does not list goes whole into every rank's file (as
``transform_checkpoints`` does with ``global_step`` and the like); an
optimizer state named after a parameter (``moment1.<param>``...) of the same
global shape follows that parameter's layout. Int, float, bool and numpy
scalar values are written as MindSpore's ``save_checkpoint(append_dict=...)``
writes them, 0-d tensors (Int64, Float32, Bool, the numpy dtype), into every
file; string values go into ``.ckpt`` files as MindSpore ``str`` values; other
values are left out (listed).
Each slice is read from the checkpoint (only the chunks it overlaps), written
and dropped before the next: memory holds one slice.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from hyper_parallel.cli._common import (
    format_bytes,
    open_checkpoint,
    prepare_output_dir,
    progress,
    read_region,
    read_stored_bytes,
)
from hyper_parallel.cli._ms_write import MsItem, scalar_item, string_item, write_ms_file
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.type_handlers import deserialize_value
from hyper_parallel.core.layout import Layout
from hyper_parallel.core.strategy_file import OPTIMIZER_STATE_PREFIXES, read_strategy_records
from hyper_parallel.platform.dtypes import DTYPE_NAMES

__all__ = ["ExportResult", "export_mindspore", "register"]

_FORMATS = ("ckpt", "safetensors")


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_mindspore` wrote.

    Attributes:
        out: The output directory.
        files: The files written (rank order, or the one unified file).
        total_bytes: Bytes of tensor content written over all files.
        skipped: Keys left out, with the reason (and the destination strategy's parameters the checkpoint
            does not hold).
    """

    out: str
    files: tuple[str, ...]
    total_bytes: int
    skipped: tuple[tuple[str, str], ...]


def _tensor_item(directory: Path, metadata: Metadata, fqn: str, stored: TensorStorageMetadata,
                 offsets: tuple[int, ...], sizes: tuple[int, ...]) -> MsItem:
    dtype = stored.properties.dtype
    nbytes = DTYPE_NAMES[dtype]
    for n in sizes:
        nbytes *= n
    content: Callable[[], Any] = lambda: read_region(directory, metadata, fqn, offsets, sizes)
    return MsItem(fqn, dtype, sizes, nbytes, content)


#: Stored value types written as MindSpore 0-d tensors, as ``mindspore.save_checkpoint(append_dict=...)``
#: stores an int (Int64), a float (Float32) or a bool (Bool); a numpy scalar keeps its dtype.
_SCALAR_TYPES = ("int", "float", "bool", "numpy.scalar")


def _scalar_array(type_name: str, value: Any) -> tuple[np.ndarray | None, str]:
    """The 0-d array MindSpore would store for a plain number, or ``None`` and why it cannot."""
    if type_name == "int":
        if not np.iinfo(np.int64).min <= value <= np.iinfo(np.int64).max:
            return None, f"int {value} does not fit MindSpore's Int64 (mindspore.save_checkpoint cannot store it)"
        return np.array(value, np.int64), ""
    if type_name == "float":
        with np.errstate(over="ignore"):
            array = np.array(value, np.float32)
        if math.isfinite(value) and not np.isfinite(array):
            return None, f"float {value!r} overflows MindSpore's Float32 (as mindspore.save_checkpoint stores floats)"
        return array, ""
    return np.array(value), ""  # a stored numpy scalar has a dtype of this library: each is a MindSpore dtype


def _value_items(directory: Path, metadata: Metadata, fmt: str) -> tuple[list[MsItem], list[tuple[str, str]]]:
    """The non-tensor values MindSpore files hold, as MindSpore stores them, and notes for the others.

    An int, float, bool or numpy scalar becomes a 0-d tensor (``mindspore.load_checkpoint`` returns it as a
    Parameter, like ``epoch_num`` / ``step_num`` of MindSpore's own checkpoints); a ``str`` a MindSpore string
    value in ``.ckpt`` files (safetensors files hold no strings); anything else is left out with a note.
    """
    items, skipped = [], []
    for fqn, stored in sorted(metadata.state_dict_metadata.items()):
        if not isinstance(stored, BytesStorageMetadata):
            continue
        scalar = stored.type_name in _SCALAR_TYPES
        if stored.global_shape or not (scalar or (stored.type_name == "str" and fmt == "ckpt")):
            why = ("a per-rank value" if stored.global_shape else
                   "safetensors files hold no strings" if stored.type_name == "str" else
                   "MindSpore files hold tensors, numbers and strings")
            skipped.append((fqn, f"value of type {stored.type_name!r} left out ({why})"))
            continue
        value = deserialize_value(stored.type_name, read_stored_bytes(directory, metadata, MetadataIndex(fqn, ())),
                                  key=fqn)
        if not scalar:
            items.append(string_item(fqn, value))
            continue
        array, why = _scalar_array(stored.type_name, value)
        if array is None:
            skipped.append((fqn, f"left out: {why}"))
        else:
            items.append(scalar_item(fqn, array))
    return items, skipped


def _file_order(tensors: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The tensors in file order: fewest name components first, then the checkpoint's order.

    MindSpore's non-strict ``load_param_into_net``, for a network name missing from the file, takes the prefix
    of the first file key ending with that name and loads every name under it. An optimizer state is one
    component deeper than its parameter (``adam.moment1.weight`` beside ``net.weight``); in name order it
    could come first, and the network received its moments as weights.
    """
    return [item for _, item in sorted(enumerate(tensors), key=lambda pair: (pair[1][0].count("."), pair[0]))]


def _rank_layouts(records: Mapping[str, Sequence[Any]], rank: int) -> tuple[dict[str, Layout], set[str]]:
    """The layouts of the parameters on ``rank``'s stage, and every parameter the strategy lists."""
    layouts = {}
    for name, stage_records in records.items():
        for record in stage_records:
            if rank in record.stage_ranks():
                layouts[name] = record.to_layout()
                break
    return layouts, set(records)


_SKIP = object()


def _placement(fqn: str, stored: TensorStorageMetadata, metadata: Metadata, layouts: Mapping[str, Layout],
               listed: set[str]) -> Layout | object | None:
    """``fqn``'s layout on this rank, :data:`_SKIP` (another stage's), or ``None`` (whole)."""
    if fqn in layouts:
        return layouts[fqn]
    if fqn in listed:
        return _SKIP
    param = next((fqn[len(p):] for p in OPTIMIZER_STATE_PREFIXES if fqn.startswith(p)), None)
    owner = metadata.state_dict_metadata.get(param) if param in listed else None
    if owner is None or tuple(owner.size) != tuple(stored.size):
        return None
    return layouts.get(param, _SKIP)


def _rank_items(directory: Path, metadata: Metadata, rank: int, layouts: Mapping[str, Layout],
                listed: set[str], tensors: list[tuple[str, TensorStorageMetadata]]) -> list[MsItem]:
    items = []
    for fqn, stored in tensors:
        layout = _placement(fqn, stored, metadata, layouts, listed)
        if layout is _SKIP:
            continue
        global_shape = tuple(stored.size)
        if layout is None:
            offsets, sizes = (0,) * len(global_shape), global_shape
        else:
            sizes = layout.local_shape(global_shape, fqn)
            offsets = layout.shard_offsets(global_shape, rank, fqn)
        items.append(_tensor_item(directory, metadata, fqn, stored, offsets, sizes))
    return items


def export_mindspore(
    ckpt: str | os.PathLike, out: str | os.PathLike, *, strategy_files: Sequence[str | os.PathLike] | None = None,
    fmt: str = "ckpt", name: str = "checkpoint",
) -> ExportResult:
    """Write a checkpoint as MindSpore files: per rank for a strategy, else one unified file.

    Args:
        ckpt: The checkpoint directory.
        out: The output directory (created; must be new or empty).
        strategy_files: The destination job's strategy file(s), one per
            pipeline stage or one merged file; ``None`` for one unified file.
        fmt: ``"ckpt"`` or ``"safetensors"``.
        name: File name stem: ``rank_<i>/<name>_<i>.<fmt>`` or ``<name>.<fmt>``.

    Returns:
        What was written.

    Raises:
        CheckpointValueError: an unknown format or a bad name.
        CheckpointExistsError: ``out`` is not an empty directory.
        LayoutError: a tensor the destination layout cannot split evenly
            (names the parameter).
        CheckpointError: ``ckpt`` is not a readable checkpoint.
    """
    if fmt not in _FORMATS:
        raise CheckpointValueError(f"unknown format {fmt!r}: use one of {', '.join(_FORMATS)}")
    if not name or os.sep in name or name.startswith("."):
        raise CheckpointValueError(f"file name stem {name!r} must be a plain, non-hidden file name")
    directory, metadata = open_checkpoint(ckpt)
    out_dir = Path(os.fspath(out))
    records = read_strategy_records(list(strategy_files)) if strategy_files else None
    tensors = _file_order([(fqn, s) for fqn, s in metadata.state_dict_metadata.items()
                           if isinstance(s, TensorStorageMetadata)])
    values, skipped = _value_items(directory, metadata, fmt)
    if records is not None:
        skipped += _absent_parameters(records, metadata, strategy_files or [])
    prepare_output_dir(out_dir)
    written: list[str] = []
    total = 0
    if records is None:
        items = [_tensor_item(directory, metadata, fqn, s, (0,) * len(s.size), tuple(s.size)) for fqn, s in tensors]
        path = out_dir / f"{name}.{fmt}"
        write_ms_file(path, items + values, fmt=fmt)
        return ExportResult(str(out_dir), (str(path),), sum(i.nbytes for i in items), tuple(skipped))
    world = max(r for rs in records.values() for record in rs for r in record.stage_ranks()) + 1
    for rank in progress(range(world), desc="export ranks", unit="rank"):
        layouts, listed = _rank_layouts(records, rank)
        items = _rank_items(directory, metadata, rank, layouts, listed, tensors)
        rank_dir = out_dir / f"rank_{rank}"
        rank_dir.mkdir()
        path = rank_dir / f"{name}_{rank}.{fmt}"
        write_ms_file(path, items + values, fmt=fmt)
        written.append(str(path))
        total += sum(i.nbytes for i in items)
    return ExportResult(str(out_dir), tuple(written), total, tuple(skipped))


def _absent_parameters(records: Mapping[str, Sequence[Any]], metadata: Metadata,
                       strategy_files: Sequence[str | os.PathLike]) -> list[tuple[str, str]]:
    """The destination strategy's parameters the checkpoint does not hold, as notes; none held at all is refused.

    Raises:
        CheckpointValueError: No parameter the strategy lists is in the checkpoint (another network, or keys
            under a prefix such as ``model.``): every tensor would be written whole to every rank.
    """
    stored = metadata.state_dict_metadata
    absent = sorted(name for name in records if name not in stored)
    if absent and len(absent) == len(records):
        prefixed = sorted(key for key in stored if any(key.endswith("." + name) for name in absent[:50]))
        hint = (f"; the checkpoint holds them under a prefix (e.g. {prefixed[0]!r}): save it under MindSpore's "
                "names (hyper_parallel.save_checkpoint(net, ...))") if prefixed else ""
        raise CheckpointValueError(
            f"none of the {len(records)} parameter(s) the strategy {', '.join(map(str, strategy_files))} lists is in "
            f"the checkpoint (e.g. {absent[0]!r}){hint}: every tensor would be written whole to every rank; pass "
            "the strategy of the job this checkpoint is for"
        )
    return [(name, "listed in the destination strategy but not in the checkpoint: the job's Parameter keeps the "
                   "value it is initialised with") for name in absent]


def _run(args: argparse.Namespace) -> int:
    result = export_mindspore(args.ckpt, args.out, strategy_files=args.strategy, fmt=args.format, name=args.name)
    print(f"wrote {len(result.files)} MindSpore {args.format} file(s), {format_bytes(result.total_bytes)}, "
          f"to {result.out}")
    for key, reason in result.skipped:
        print(f"note: '{key}': {reason}")
    return 0


def register(subparsers: Any) -> None:
    """Add the ``export-mindspore`` subcommand to the ``hp-ckpt`` parser."""
    parser = subparsers.add_parser(
        "export-mindspore", help="write MindSpore files: one per rank of a strategy, or one unified file",
        description="Write the checkpoint as MindSpore .ckpt/.safetensors files that mindspore.load_checkpoint "
                    "+ load_param_into_net accept: OUT/rank_<i>/NAME_<i>.FORMAT for each rank of the destination "
                    "strategy, or OUT/NAME.FORMAT with full tensors when no strategy is given.",
    )
    parser.add_argument("ckpt", metavar="CKPT", help="the checkpoint directory")
    parser.add_argument("out", help="the output directory (new or empty)")
    parser.add_argument("--strategy", action="append", metavar="FILE",
                        help="destination job's strategy file (repeat once per pipeline stage)")
    parser.add_argument("--format", choices=_FORMATS, default="ckpt", help="MindSpore file format")
    parser.add_argument("--name", default="checkpoint", help="file name stem (default: checkpoint)")
    parser.set_defaults(func=_run)
