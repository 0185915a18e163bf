"""``hp-ckpt import SRC OUT [--strategy FILE ...]``: bring MindSpore or Hugging Face weights into this format.

Sources:

- a MindSpore ``.ckpt`` file (``mindspore.save_checkpoint``) or a
  ``.safetensors`` file (MindSpore's ``format="safetensors"`` or any writer);
- a Hugging Face directory: ``*.safetensors.index.json`` plus its shards, or a
  single ``model.safetensors``, or else every ``*.safetensors`` file in it (a
  directory with several index files is refused: name the one to use); a
  directory holding one ``.ckpt`` file and no safetensors file: that file;
- a ``*.safetensors.index.json`` file: the files its ``weight_map`` names;
- a directory of a MindSpore parallel job's per-rank files (``rank_<i>/``
  holding one ``.ckpt`` or ``.safetensors`` each) with the job's strategy
  file(s): the slices become chunks of the global tensors (see
  :mod:`hyper_parallel.cli._ms_import`). Without a strategy such a directory
  is refused: its tensors are slices, never full tensors, unless
  ``--whole-tensors`` says they are whole (``integrated_save=True``: each
  stored once, its copies compared); such files given with a strategy are
  refused (:mod:`hyper_parallel.cli._ms_whole_ranks`).

Every tensor is mapped from its file and written once (no MindSpore import,
no unpickling, memory holds no tensor). Plain values that ``hp-ckpt convert``
stored in a safetensors ``__metadata__`` come back as values. Only regular
files are opened, and an output directory that is not empty (a committed
checkpoint) is refused, never replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path
from typing import Any, Sequence

from hyper_parallel.cli._common import format_bytes, prepare_output_dir, progress
from hyper_parallel.cli.convert_cmd import VALUE_TYPES_KEY
from hyper_parallel.cli._ms_files import MsFile, open_ms_file, open_regular
from hyper_parallel.cli._ms_import import (
    PieceSavePlanner,
    SourcePiece,
    check_unstored_crcs,
    find_rank_files,
    plan_rank_import,
    total_bytes,
    whole_pieces,
)
from hyper_parallel.cli._ms_replicas import BoxCopies, ReplicaCheckingWriter
from hyper_parallel.cli._ms_whole_ranks import refuse_whole_tensors
from hyper_parallel.core.distributed_checkpoint._metadata_file import NEWEST_NOTE, newest_file
from hyper_parallel.core.distributed_checkpoint.api import save
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointValueError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import METADATA_FILE
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, TensorStorageMetadata
from hyper_parallel.core.strategy_file import read_strategy_records

__all__ = ["import_checkpoint", "restored_values", "safetensors_files", "register"]


_INDEX_SUFFIX = ".safetensors.index.json"
_INDEX_GLOB = "*" + _INDEX_SUFFIX


def _read_regular(path: Path, limit: int = 100 << 20) -> bytes:
    """The bytes of a small regular file (a FIFO is refused, not waited on)."""
    fd = open_regular(path)
    try:
        if os.fstat(fd).st_size > limit:
            raise CorruptCheckpointError(f"{path}: larger than {limit} bytes; not a safetensors index")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read()
    finally:
        os.close(fd)


def safetensors_files(directory: Path) -> list[Path]:
    """Return the safetensors files of a Hugging Face model directory.

    The index json's ``weight_map`` names them when present; else
    ``model.safetensors``; else every ``*.safetensors`` file, sorted; else the
    directory's one ``.ckpt`` file (a ``mindspore.save_checkpoint`` file). Another
    ``*.safetensors`` file beside the ones named, or a ``.ckpt`` file beside
    safetensors files, is refused (its tensors would be left out).

    Raises:
        UnsupportedFormatError: no safetensors or .ckpt file (names what the directory holds), or already a
            hyper_parallel checkpoint.
        CorruptCheckpointError: the index json is malformed.
        CheckpointValueError: a safetensors file of the directory that would not be imported, several .ckpt
            files and no safetensors file (each a checkpoint of its own: import one, named), or .ckpt files beside
            the safetensors files (both kinds named, with the command for each).
    """
    files = _named_files(directory)
    if files[0].suffix != ".ckpt":
        _refuse_ckpt_beside(directory, files)
    named = {path.resolve() for path in files}
    unread = sorted(path for path in directory.glob("*.safetensors") if path.resolve() not in named)
    if unread:
        raise CheckpointValueError(
            f"{directory}: {', '.join(p.name for p in unread)} would not be imported (the index json, or "
            f"model.safetensors, names {', '.join(p.name for p in files)}), and its tensors would be left out; "
            "list it in the index json, import a file on its own (hp-ckpt import DIR/FILE.safetensors OUT), or "
            "move the others away"
        )
    return files


def _refuse_ckpt_beside(directory: Path, files: list[Path]) -> None:
    """Refuse MindSpore ``.ckpt`` files beside the safetensors ``files`` of ``directory``: they would be left out.

    A directory is imported whole only when it holds one kind of file; which one the user means (a Hugging Face
    model and a MindSpore save beside it, or one network saved in both formats) only the user knows.

    Raises:
        CheckpointValueError: names both kinds of file and the command that imports each.
    """
    ckpts = sorted(path for path in directory.glob("*.ckpt") if path.is_file())
    if not ckpts:
        return
    index_path = _index_path(directory)
    if index_path is not None or len(files) == 1:
        model = f"hp-ckpt import {index_path or files[0]} OUT"
    else:
        model = f"move the .ckpt files out of {directory} and import it again"
    newest = newest_file(ckpts)
    raise CheckpointValueError(
        f"{directory} holds both .safetensors files ({_shown(files)}) and MindSpore .ckpt files ({_shown(ckpts)}); "
        "importing the directory would leave the .ckpt files' tensors out. Name what to import: for the "
        f"safetensors model, {model}; for a .ckpt file, hp-ckpt import {newest} OUT"
        + (NEWEST_NOTE if len(ckpts) > 1 else "")
    )


def _shown(paths: list[Path]) -> str:
    """At most five file names, then how many more."""
    return ", ".join(path.name for path in paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def _index_path(directory: Path) -> Path | None:
    """The directory's one index json (``None`` without); several are refused, naming them.

    Raises:
        CheckpointValueError: several ``*.safetensors.index.json`` files (importing one would leave the
            tensors of the others out).
    """
    indexes = sorted(directory.glob(_INDEX_GLOB))
    if len(indexes) > 1:
        raise CheckpointValueError(
            f"{directory} holds {len(indexes)} safetensors index files ({', '.join(p.name for p in indexes)}); "
            f"importing one would leave the others' tensors out: name the one to use (hp-ckpt import "
            f"{directory / indexes[0].name} OUT)"
        )
    return indexes[0] if indexes else None


def _index_files(index_path: Path) -> list[Path]:
    """The files the index json's ``weight_map`` names, each checked to be a file beside it.

    Raises:
        CorruptCheckpointError: a malformed index, or a name leaving its directory.
        CheckpointNotFoundError: a named file that does not exist.
    """
    directory = index_path.parent
    files = []
    for name in sorted(set(_weight_map(index_path).values())):
        path = (directory / name).resolve()
        if path.parent != directory.resolve():
            raise CorruptCheckpointError(f"{index_path}: file {name!r} is outside {directory}; refused")
        if not path.is_file():
            raise CheckpointNotFoundError(f"{index_path} names {name}, which does not exist")
        files.append(path)
    return files


def _check_index_held(index_path: Path, files: list[MsFile]) -> None:
    """Refuse an index listing tensors that none of ``files`` holds (nothing is imported)."""
    listed = set(_weight_map(index_path))
    missing = sorted(listed - {name for file in files for name in file.entries})
    if missing:
        raise CorruptCheckpointError(
            f"{index_path} lists {len(missing)} tensor(s) that no file of {index_path.parent} holds, e.g. "
            f"{', '.join(repr(n) for n in missing[:5])}: a shard is incomplete or from another model; "
            "nothing was imported"
        )


def _weight_map(index_path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(_read_regular(index_path).decode("utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}")
        return {str(k): str(v) for k, v in weight_map.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{index_path}: not a valid safetensors index ({exc})") from exc


def _named_files(directory: Path) -> list[Path]:
    """:func:`safetensors_files` before the check for files left out."""
    if (directory / METADATA_FILE).is_file():
        raise UnsupportedFormatError(
            f"{directory} is already a hyper_parallel checkpoint; nothing to import (see hp-ckpt inspect)"
        )
    index_path = _index_path(directory)
    if index_path is not None:
        return _index_files(index_path)
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    ckpts = sorted(path for path in directory.glob("*.ckpt") if path.is_file())
    if len(ckpts) == 1:
        return ckpts  # a directory holding one mindspore.save_checkpoint file: that file
    raise _nothing_to_import(directory, ckpts)


def _nothing_to_import(directory: Path, ckpts: list[Path]) -> CheckpointError:
    """The refusal of a directory with no .safetensors file and not one .ckpt file, naming what it holds."""
    if ckpts:
        newest = newest_file(ckpts)
        return CheckpointValueError(
            f"{directory} holds {len(ckpts)} MindSpore .ckpt files ({_shown(ckpts)}) and no .safetensors file: "
            f"each .ckpt file is a whole checkpoint of its own (ModelCheckpoint writes one per save), so import one file: "
            f"hp-ckpt import {newest} OUT (the newest). A parallel job's per-rank files are imported from the "
            "directory of their rank_<i>/ subdirectories, with --strategy FILE"
        )
    found = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in directory.iterdir())
    held = (f"it holds {', '.join(found[:5])}" + (f" and {len(found) - 5} more" if len(found) > 5 else "")
            if found else "it is empty")
    return UnsupportedFormatError(
        f"{directory} holds no checkpoint file to import ({held}): hp-ckpt import reads a MindSpore .ckpt or "
        ".safetensors file, a directory of .safetensors files (a Hugging Face model, with or without its index "
        "json) or of one .ckpt file, or a MindSpore parallel job's directory of rank_<i>/ subdirectories "
        "(with --strategy FILE)"
    )


def restored_values(file: MsFile) -> dict[str, Any]:
    """The plain values ``hp-ckpt convert`` stored as text in a safetensors ``__metadata__``.

    Convert lists them, with their types, under :data:`VALUE_TYPES_KEY`; other
    metadata (``"format"``...) is not a value and is not restored.

    Raises:
        CorruptCheckpointError: a malformed list or value text (names the file and key).
    """
    listing = file.file_metadata.get(VALUE_TYPES_KEY)
    if listing is None:
        return {}
    try:
        types = json.loads(listing)
        values = {}
        for key, type_name in types.items():
            text = file.file_metadata[key]
            values[key] = text if type_name == "str" else json.loads(text)
    except (ValueError, KeyError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{file.path}: __metadata__ {VALUE_TYPES_KEY!r} is malformed ({exc})") from exc
    return values


def _check_out(src: Path, out: Path) -> None:
    if out.exists() and out.resolve() == src.resolve():
        raise CheckpointValueError(f"import source and output are the same path {src}")
    if out.exists():
        prepare_output_dir(out)  # refuses a file, a committed checkpoint, a non-empty directory


def _plan_source(
    src: Path, strategy_files: Sequence[str | os.PathLike] | None, show_progress: bool | None,
    check_replicas: bool, whole_tensors: bool = False, slices_may_be_equal: bool = False,
) -> tuple[list[SourcePiece], dict[str, Any], list[BoxCopies]]:
    if not src.exists():
        raise CheckpointNotFoundError(f"{src} does not exist")
    rank_files = find_rank_files(src) if src.is_dir() else {}
    if slices_may_be_equal and not (rank_files and strategy_files):
        raise CheckpointValueError(
            "--slices-may-be-equal applies to MindSpore per-rank files (rank_<i>/...) imported with --strategy FILE "
            f"(it lets their slices be equal); {src} " + (
                "is imported without a strategy: drop --slices-may-be-equal" if rank_files else "is not one")
        )
    if rank_files:
        if whole_tensors == bool(strategy_files):
            raise CheckpointValueError(
                f"{src} holds MindSpore per-rank files (rank_{min(rank_files)}/...): pass the job's strategy file "
                "with --strategy FILE (once per pipeline stage) when they hold slices, or --whole-tensors when they "
                "hold whole tensors (saved with integrated_save=True, MindSpore's default), not both"
                if whole_tensors else
                f"{src} holds MindSpore per-rank files (rank_{min(rank_files)}/...) whose tensors are slices: "
                "pass the job's strategy file with --strategy FILE (once per pipeline stage); files saved with "
                "integrated_save=True (MindSpore's default) hold whole tensors: pass --whole-tensors"
            )
        records = read_strategy_records(list(strategy_files)) if strategy_files else {}
        files = {rank: open_ms_file(path) for rank, path in
                 progress(sorted(rank_files.items()), desc="index rank files", unit="file", enabled=show_progress)}
        pieces, values, replicas = plan_rank_import(files, records, check_replicas=check_replicas)
        if check_replicas and strategy_files and not slices_may_be_equal:
            refuse_whole_tensors(pieces, src, ", ".join(map(str, strategy_files)))
        check_unstored_crcs(files.values(), pieces)
        return pieces, values, replicas
    if whole_tensors:
        raise CheckpointValueError(
            f"--whole-tensors applies to a directory of MindSpore per-rank files (rank_<i>/...); {src} is not one"
        )
    if strategy_files:
        raise CheckpointValueError(
            f"--strategy applies to a directory of MindSpore per-rank files (rank_<i>/...); {src} is not one"
        )
    if src.is_dir():
        files = [open_ms_file(path) for path in safetensors_files(src)]
        index_path = _index_path(src)
        if index_path is not None:
            _check_index_held(index_path, files)
    elif src.name.endswith(_INDEX_SUFFIX):
        files = [open_ms_file(path) for path in _index_files(src)]
        _check_index_held(src, files)
    elif src.suffix in (".ckpt", ".safetensors"):
        files = [open_ms_file(src)]
    else:
        raise UnsupportedFormatError(
            f"cannot import {src}: expected a MindSpore .ckpt file, a .safetensors file, a Hugging Face "
            "directory or a directory of MindSpore per-rank files (rank_<i>/)"
        )
    pieces, values = whole_pieces(files)
    check_unstored_crcs(files, pieces)
    for file in files:
        for key, value in restored_values(file).items():
            values.setdefault(key, value)
    return pieces, values, []


def _bytes_written() -> int | None:
    try:
        with open("/proc/self/io", encoding="ascii") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("wchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def _save_with_progress(out: Path, planner: PieceSavePlanner, replicas: list[BoxCopies], total: int,
                        show_progress: bool | None) -> Metadata:
    """``dcp.save`` of the pieces, with a bar of the bytes this process writes (``/proc/self/io``); ``replicas``
    compared with the stored copies before the commit."""
    bar = progress(desc="import", unit="B", unit_scale=True, total=total, enabled=show_progress)
    start = _bytes_written()
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.2):
            bar.update(max(0, min(total, (_bytes_written() or 0) - start) - bar.n))

    watcher = threading.Thread(target=poll, name="hp-ckpt-import-progress", daemon=True)
    if not bar.disable and start is not None:
        watcher.start()
    try:
        return save({}, storage_writer=ReplicaCheckingWriter(out, replicas), planner=planner, no_dist=True)
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        bar.update(max(0, total - bar.n))
        bar.close()


def import_checkpoint(
    src: str | os.PathLike, out: str | os.PathLike, *, strategy_files: Sequence[str | os.PathLike] | None = None,
    show_progress: bool | None = None, check_replicas: bool = True, whole_tensors: bool = False,
    slices_may_be_equal: bool = False,
) -> Metadata:
    """Save MindSpore or Hugging Face weights as a checkpoint. Single process.

    Every tensor is mapped from its source file and written once; memory
    holds no tensor. Per-rank slices are stored as chunks of the global
    tensors (each distinct slice once, from its lowest rank; its replicas on
    other ranks are compared with it and not stored).

    Args:
        src: A ``.ckpt`` file, a ``.safetensors`` file, a directory of
            safetensors shards (with or without an index json; with several,
            pass the index json to use), a ``*.safetensors.index.json`` file
            (the shards it names), or a directory of MindSpore per-rank files (``rank_<i>/`` holding one ``.ckpt`` or
            ``.safetensors`` each, which needs ``strategy_files``, or ``whole_tensors``).
        out: The checkpoint directory to write (new or empty).
        strategy_files: The strategy file(s) of the job that wrote per-rank
            files (one per pipeline stage, or one merged file).
        show_progress: Progress bars on stderr; ``None``: only on a terminal.
        whole_tensors: The per-rank files hold whole tensors, not slices
            (MindSpore's ``save_checkpoint(..., integrated_save=True)``, its
            default, under auto parallel): each tensor is stored once, from the
            lowest rank holding it, its copies on the other ranks compared
            (each stage's ranks of a pipeline job hold that stage's
            tensors). Takes no ``strategy_files``.
        check_replicas: Compare every replica of a slice the strategy lists
            with the stored copy (reads each replica once); copies that
            differ are refused naming the parameter, ranks and files (before
            a byte is written, unless a large slice's copies differ only off
            the 16 pages sampled while planning). Also refuses rank files
            holding whole tensors instead of the strategy's slices
            (MindSpore's ``integrated_save=True``): the boxes of every
            parameter the strategy splits equal. ``False`` reads only the
            stored copies. A tensor the strategy does not list is compared in
            any case.
        slices_may_be_equal: The slices of every parameter the strategy
            splits may be equal (a mixture-of-experts model whose experts were
            copied from one layer, saved before training): skips only the
            refusal of rank files that look like whole tensors; replicas are
            still compared (``check_replicas``).

    Returns:
        The committed metadata of the new checkpoint.

    Raises:
        CheckpointExistsError: ``out`` is not empty (a committed checkpoint is never replaced).
        CheckpointValueError: per-rank files without a strategy (or ``whole_tensors``), or a strategy (or
            ``whole_tensors``) without them.
        CheckpointError: the source is missing, unsupported, malformed, or
            contradicts the strategy (names the parameter, rank and file).
        LayoutError: replicas of a slice differ (names the parameter, box, ranks and files), or the files hold
            whole tensors where the strategy describes slices (pass ``whole_tensors``, or
            ``slices_may_be_equal`` if they are slices).
    """
    src_path, out_path = Path(os.fspath(src)), Path(os.fspath(out))
    _check_out(src_path, out_path)
    pieces, values, replicas = _plan_source(src_path, strategy_files, show_progress, check_replicas, whole_tensors,
                                            slices_may_be_equal)
    return _save_with_progress(out_path, PieceSavePlanner(pieces, values), replicas, total_bytes(pieces),
                               show_progress)


def _run(args: argparse.Namespace) -> int:
    metadata = import_checkpoint(args.src, args.out, strategy_files=args.strategy,
                                 check_replicas=not args.no_check_replicas, whole_tensors=args.whole_tensors,
                                 slices_may_be_equal=args.slices_may_be_equal)
    stored = metadata.state_dict_metadata.values()
    tensors = [s for s in stored if isinstance(s, TensorStorageMetadata)]
    total = sum(info.length for info in (metadata.storage_data or {}).values())
    print(
        f"imported {len(tensors)} tensor(s) and {len(stored) - len(tensors)} value(s), "
        f"{format_bytes(total)}, from {args.src} into {args.out}"
    )
    return 0


def register(subparsers: Any) -> None:
    """Add the ``import`` subcommand to the ``hp-ckpt`` parser."""
    parser = subparsers.add_parser(
        "import", help="import MindSpore .ckpt/.safetensors files (one, or one per rank) or a Hugging Face directory",
        description="Save the weights of a MindSpore checkpoint file, of a MindSpore parallel job's per-rank "
                    "files (with --strategy) or of a Hugging Face safetensors model as a hyper_parallel checkpoint.",
    )
    parser.add_argument("src", metavar="SRC",
                        help=".ckpt file, .safetensors file, model directory (or one of its *.safetensors.index.json "
                             "files), or directory of rank_<i>/ files")
    parser.add_argument("out", help="the checkpoint directory to write (new or empty)")
    parser.add_argument("--strategy", action="append", metavar="FILE",
                        help="strategy file of the job that wrote rank_<i>/ files (repeat once per pipeline stage)")
    parser.add_argument("--whole-tensors", action="store_true",
                        help="the rank_<i>/ files hold whole tensors (saved with integrated_save=True, MindSpore's "
                             "default): store each once, its copies compared; instead of --strategy")
    parser.add_argument("--slices-may-be-equal", action="store_true",
                        help="the slices of every parameter the strategy splits may be equal (experts copied from "
                             "one layer, saved before training): do not refuse the rank files as whole tensors "
                             "(integrated_save); replicas are still compared")
    parser.add_argument("--no-check-replicas", action="store_true",
                        help="do not read the replicas of listed slices to compare them with the stored copy, nor "
                             "compare the slices of a parameter to tell whole tensors (integrated_save) from slices")
    parser.set_defaults(func=_run)
