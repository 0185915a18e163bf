"""``hp-ckpt convert DIR OUT --to safetensors``: consolidate into Hugging Face safetensors.

Each tensor is assembled whole from its chunks, written at its precomputed
offset and dropped before the next one, so memory stays bounded by the
largest tensor, never by the model. Shard headers are computed from the
metadata before any byte is written. Output: ``model.safetensors`` (or
``model-00001-of-0000N.safetensors`` when it exceeds ``max_shard_size``) and
``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: file}}``).

Which keys, under which names: a :class:`KeySelection` (``hp-ckpt convert``
exports the model only by default: ``--all`` for everything, ``--include`` /
``--exclude`` globs, ``--strip-prefix``, ``--rename OLD=NEW``). A progress bar
(tqdm, on a terminal) counts the bytes written.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hyper_parallel.cli._key_select import KeySelection, parse_rename
from hyper_parallel.cli._common import (
    atomic_output,
    format_bytes,
    prepare_output_dir,
    progress,
    open_checkpoint,
    parse_size,
    read_full_tensor,
    read_stored_bytes,
    tensor_nbytes,
)
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import HeaderEntry, build_header

__all__ = ["ConvertResult", "INDEX_FILE", "VALUE_TYPES_KEY", "convert_to_safetensors", "format_convert", "register"]

#: Name of the Hugging Face index written next to the shards.
INDEX_FILE = "model.safetensors.index.json"
#: ``__metadata__`` key listing the plain values stored as text, as JSON ``{key: type name}``
#: (a ``"str"`` value is its raw text, any other type is JSON), so ``hp-ckpt import`` restores them.
VALUE_TYPES_KEY = "hyper_parallel.value_types"
#: Plain values whose stored payload is at most this long go into ``__metadata__``.
_MAX_METADATA_VALUE_BYTES = 4096
#: Value types shown as text in ``__metadata__`` (decoded without running code).
_TEXT_TYPES = ("int", "float", "bool", "str", "none")


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert_to_safetensors` wrote.

    Attributes:
        out: The output directory.
        files: The safetensors files written, in order.
        weight_map: Tensor name -> file name.
        total_size: Bytes of all tensors.
        skipped: Non-tensor keys left out of the tensors, with the reason.
        left_out: Keys the selection left out (optimizer state, excluded globs).
    """

    out: str
    files: tuple[str, ...]
    weight_map: dict[str, str]
    total_size: int
    skipped: tuple[tuple[str, str], ...]
    left_out: tuple[str, ...] = ()


def _plan_shards(tensors: list[tuple[str, TensorStorageMetadata]], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for fqn, stored in tensors:
        nbytes = tensor_nbytes(stored)
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(fqn)
        used += nbytes
    return shards


def _value_texts(
    directory: Path, metadata: Metadata, names: dict[str, str]
) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Small plain values as text for ``__metadata__``; every other value is skipped with a reason."""
    # pylint: disable-next=import-outside-toplevel
    from hyper_parallel.core.distributed_checkpoint.type_handlers import deserialize_value

    texts: dict[str, str] = {}
    types: dict[str, str] = {}
    skipped: list[tuple[str, str]] = []
    for fqn in sorted(names):
        stored = metadata.state_dict_metadata[fqn]
        if not isinstance(stored, BytesStorageMetadata):
            continue
        info = (metadata.storage_data or {}).get(MetadataIndex(fqn, ()))
        if stored.type_name not in _TEXT_TYPES or stored.global_shape or info is None:
            skipped.append((fqn, f"non-tensor value of type {stored.type_name!r} skipped"))
            continue
        if info.length > _MAX_METADATA_VALUE_BYTES:
            skipped.append((fqn, f"value of {info.length} bytes too large for __metadata__; skipped"))
            continue
        value = deserialize_value(stored.type_name, read_stored_bytes(directory, metadata, MetadataIndex(fqn, ())),
                                  key=fqn)
        texts[names[fqn]] = value if isinstance(value, str) else json.dumps(value)
        types[names[fqn]] = stored.type_name
        skipped.append((fqn, "non-tensor value stored as text in __metadata__ of the first file"))
    if types:
        texts[VALUE_TYPES_KEY] = json.dumps(types, sort_keys=True)
    return texts, skipped


def _write_shard(
    directory: Path, metadata: Metadata, path: Path, names: list[str], file_metadata: dict[str, str],
    out_names: dict[str, str], bar: Any,
) -> None:
    entries = []
    for fqn in names:
        stored = metadata.state_dict_metadata[fqn]
        entries.append(HeaderEntry(out_names[fqn], stored.properties.dtype, tuple(stored.size), tensor_nbytes(stored)))
    header, offsets = build_header(entries, file_metadata)
    with atomic_output(path) as handle:
        handle.write(header)
        for fqn, offset in zip(names, offsets):
            tensor = read_full_tensor(directory, metadata, fqn)
            if handle.tell() != offset:
                raise CheckpointValueError(f"key '{fqn}': writing at byte {handle.tell()}, header says {offset}")
            handle.write(memoryview(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)))
            bar.update(tensor.nbytes)
            del tensor


def convert_to_safetensors(
    src: str | os.PathLike,
    out: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    *,
    selection: KeySelection | None = None,
    show_progress: bool | None = False,
) -> ConvertResult:
    """Consolidate a checkpoint into full tensors in Hugging Face safetensors files.

    Args:
        src: The checkpoint directory.
        out: The output directory (created; must be new or empty).
        max_shard_size: Largest file size (int bytes or ``"5GB"``, ``"500MiB"``);
            a tensor larger than it gets a file of its own.
        selection: The keys to write and their names; ``None`` writes every
            key under its own name (the CLI defaults to the model only).
        show_progress: Draw a progress bar on stderr (``None``: on a terminal).

    Returns:
        What was written.

    Raises:
        CheckpointError: ``src`` is not a checkpoint, is corrupt, or ``out``
            is not an empty directory.
    """
    limit = parse_size(max_shard_size)
    directory, metadata = open_checkpoint(src)
    names = (selection or KeySelection(everything=True)).names({
        fqn: tuple(stored.size) if isinstance(stored, TensorStorageMetadata) else None
        for fqn, stored in metadata.state_dict_metadata.items()
    })
    out_dir = Path(os.fspath(out))
    prepare_output_dir(out_dir)
    tensors = sorted(
        (fqn, stored) for fqn, stored in metadata.state_dict_metadata.items()
        if isinstance(stored, TensorStorageMetadata) and fqn in names
    )
    texts, skipped = _value_texts(directory, metadata, names)
    shards = _plan_shards(tensors, limit)
    count = len(shards)
    file_names = ["model.safetensors"] if count == 1 else [
        f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)
    ]
    weight_map: dict[str, str] = {}
    total = sum(tensor_nbytes(stored) for _, stored in tensors)
    bar = progress(desc="convert", total=total, unit="B", unit_scale=True, enabled=show_progress)
    try:
        for position, (file_name, keys) in enumerate(zip(file_names, shards)):
            file_metadata = {"format": "pt"}
            if position == 0:
                file_metadata.update(texts)
            _write_shard(directory, metadata, out_dir / file_name, keys, file_metadata, names, bar)
            weight_map.update({names[fqn]: file_name for fqn in keys})
    finally:
        bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    left_out = tuple(sorted(k for k in metadata.state_dict_metadata if k not in names))
    return ConvertResult(str(out_dir), tuple(file_names), weight_map, total, tuple(skipped), left_out)


def format_convert(result: ConvertResult) -> str:
    """Render a :class:`ConvertResult` for people."""
    lines = [
        f"wrote {len(result.weight_map)} tensor(s), {format_bytes(result.total_size)}, "
        f"in {len(result.files)} file(s) to {result.out}"
    ]
    lines += [f"  {name}" for name in result.files] + [f"  {INDEX_FILE}"]
    lines += [f"note: '{key}': {reason}" for key, reason in result.skipped]
    if result.left_out:
        shown = ", ".join(f"'{k}'" for k in result.left_out[:10]) + (" ..." if len(result.left_out) > 10 else "")
        lines.append(f"note: {len(result.left_out)} key(s) not selected: {shown} (--all exports everything)")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    if args.to != "safetensors":  # pragma: no cover - argparse restricts choices
        raise CheckpointValueError(f"unsupported output format {args.to!r}")
    selection = KeySelection(
        everything=args.all,
        include=tuple(args.include),
        exclude=tuple(args.exclude),
        strip_prefixes=tuple(args.strip_prefix),
        renames=tuple(parse_rename(text) for text in args.rename),
    )
    result = convert_to_safetensors(args.dir, args.out, max_shard_size=args.max_shard_size, selection=selection,
                                    show_progress=False if args.no_progress else None)
    print(format_convert(result))
    return 0


def register(subparsers: Any) -> None:
    """Add the ``convert`` subcommand to the ``hp-ckpt`` parser."""
    parser = subparsers.add_parser(
        "convert", help="consolidate into full tensors in Hugging Face safetensors files",
        description="Write full (unsharded) tensors as safetensors shards plus model.safetensors.index.json, "
                    "one tensor in memory at a time.",
    )
    parser.add_argument("dir", help="the checkpoint directory")
    parser.add_argument("out", help="the output directory (new or empty)")
    parser.add_argument("--to", choices=["safetensors"], default="safetensors", help="output format")
    parser.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 5GB or 500MiB")
    parser.add_argument("--all", action="store_true",
                        help="export every key (optimizer state and all groups); default: the model only "
                             "(the 'model.' group, prefix stripped; else, for a checkpoint of groups such as "
                             "{'net': net, 'opt': opt}, the group whose Parameters the optimizer's group holds the "
                             "state of, prefix stripped; else every key that is not optimizer state)")
    parser.add_argument("--include", action="append", default=[], metavar="GLOB",
                        help="export only keys matching this glob (repeatable; '*' crosses dots)")
    parser.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                        help="leave out keys matching this glob (repeatable)")
    parser.add_argument("--strip-prefix", action="append", default=[], metavar="PREFIX",
                        help="cut this prefix off the names (repeatable; the first match applies)")
    parser.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                        help="replace the name prefix OLD by NEW (repeatable; after --strip-prefix)")
    parser.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    parser.set_defaults(func=_run)
