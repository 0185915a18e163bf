"""``hp-ckpt inspect DIR``: what a checkpoint holds and who wrote it (metadata only)."""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from typing import Any

from hyper_parallel.cli._common import (
    format_bytes,
    format_table,
    open_checkpoint,
    plain_value_text,
    rank_of_file,
    tensor_nbytes,
)
from hyper_parallel.core.distributed_checkpoint._format.indexed_storage import IndexedStorage
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

__all__ = ["inspect_checkpoint", "format_inspect", "register"]


def _shown_value(directory: Any, metadata: Any, key: str) -> str | None:
    """The value's text, or ``None`` when it is not a small plain value or its file cannot be read."""
    try:
        return plain_value_text(directory, metadata, key)
    except (CheckpointError, OSError):  # inspect reports the metadata even when data files are damaged
        return None


def inspect_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Describe a checkpoint from its metadata (data files are read only for small plain values).

    Args:
        path: The checkpoint directory.

    Returns:
        A JSON-compatible dict with ``path``, ``format_version``, ``backend``,
        ``save_id``, ``world_size``, ``total_bytes``, ``tensors`` (one dict per
        tensor: ``key``, ``dtype``, ``shape``, ``chunks``, ``bytes``),
        ``values`` (non-tensor items: ``key``, ``type``, ``entries``,
        ``bytes``, ``value``: the ``repr`` of a small int / float / bool / str /
        None / numpy scalar, read and checksum-verified, else ``None``),
        ``files`` (``file``, ``rank``, ``items``, ``bytes``), ``index_files``
        (the rank index files of the indexed form, format 2.1, as
        ``metadata.json`` records them: ``file``, ``rank``, ``bytes``,
        ``digest``; empty for the in-line form) and ``ranks`` (``rank``,
        ``files``, ``bytes``, ``bytes_planned``): bytes
        and files per rank, the rank taken from each data file's name.

    Raises:
        CheckpointError: not a committed checkpoint of a supported format.
    """
    directory, metadata = open_checkpoint(path)
    storage = metadata.storage_data or {}
    stored_bytes: dict[str, int] = defaultdict(int)
    files: dict[str, dict[str, Any]] = {}
    for index, info in storage.items():
        stored_bytes[index.fqn] += info.length
        entry = files.setdefault(
            info.relative_path, {"file": info.relative_path, "rank": rank_of_file(info.relative_path),
                                 "items": 0, "bytes": 0}
        )
        entry["items"] += 1
        entry["bytes"] += info.length
    tensors, values = [], []
    for key in sorted(metadata.state_dict_metadata):
        stored = metadata.state_dict_metadata[key]
        if isinstance(stored, TensorStorageMetadata):
            tensors.append({
                "key": key,
                "dtype": stored.properties.dtype,
                "shape": list(stored.size),
                "chunks": len(stored.chunks),
                "bytes": tensor_nbytes(stored),
            })
        elif isinstance(stored, BytesStorageMetadata):
            values.append({
                "key": key,
                "type": stored.type_name,
                "entries": len(stored.shard_offsets),
                "bytes": stored_bytes.get(key, 0),
                "value": _shown_value(directory, metadata, key),
            })
    planned = metadata.storage_meta.bytes_per_rank
    ranks: dict[Any, dict[str, Any]] = {}
    for rank in range(len(planned)):
        ranks[rank] = {"rank": rank, "files": 0, "bytes": 0, "bytes_planned": planned[rank]}
    for entry in files.values():
        row = ranks.setdefault(entry["rank"], {"rank": entry["rank"], "files": 0, "bytes": 0, "bytes_planned": None})
        row["files"] += 1
        row["bytes"] += entry["bytes"]
    ordered_ranks = sorted(ranks.values(), key=lambda r: (r["rank"] is None, r["rank"] or 0))
    records = storage.records.values() if isinstance(storage, IndexedStorage) else ()
    index_files = [{"file": r.file, "rank": r.rank, "bytes": r.length, "digest": r.digest}
                   for r in sorted(records, key=lambda r: r.rank)]
    return {
        "path": str(directory),
        "format_version": metadata.version,
        "backend": metadata.storage_meta.backend,
        "save_id": metadata.storage_meta.save_id,
        "world_size": metadata.storage_meta.world_size,
        "total_bytes": sum(f["bytes"] for f in files.values()),
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "tensors": tensors,
        "values": values,
        "files": sorted(files.values(), key=lambda f: f["file"]),
        "index_files": index_files,
        "ranks": ordered_ranks,
    }


def format_inspect(info: dict[str, Any]) -> str:
    """Render :func:`inspect_checkpoint`'s result as human-readable tables."""
    lines = [
        f"checkpoint      {info['path']}",
        f"format version  {info['format_version']}",
        f"backend         {info['backend']}",
        f"save id         {info['save_id']}",
        f"world size      {info['world_size']}",
        f"tensors         {len(info['tensors'])} ({format_bytes(info['tensor_bytes'])})",
        f"values          {len(info['values'])}",
        f"files           {len(info['files'])} ({format_bytes(info['total_bytes'])} stored)",
    ]
    if info["index_files"]:
        index_bytes = sum(f["bytes"] for f in info["index_files"])
        lines.append(f"index files     {len(info['index_files'])} ({format_bytes(index_bytes)})")
    lines.append("")
    if info["tensors"]:
        rows = [
            [t["key"], t["dtype"], str(t["shape"]), t["chunks"], t["bytes"]]
            for t in info["tensors"]
        ]
        lines += [format_table(["key", "dtype", "shape", "chunks", "bytes"], rows), ""]
    if info["values"]:
        rows = [[v["key"], v["type"], v["entries"], v["bytes"], "-" if v["value"] is None else v["value"]]
                for v in info["values"]]
        lines += [format_table(["key", "type", "entries", "bytes", "value"], rows), ""]
    rank_rows = [
        ["?" if r["rank"] is None else r["rank"], r["files"], r["bytes"],
         "-" if r["bytes_planned"] is None else r["bytes_planned"]]
        for r in info["ranks"]
    ]
    lines += [format_table(["rank", "files", "bytes", "bytes planned"], rank_rows), ""]
    file_rows = [[f["file"], "?" if f["rank"] is None else f["rank"], f["items"], f["bytes"]] for f in info["files"]]
    lines.append(format_table(["file", "rank", "items", "bytes"], file_rows))
    if info["index_files"]:
        index_rows = [[f["file"], f["rank"], f["bytes"], f["digest"]] for f in info["index_files"]]
        lines += ["", format_table(["index file", "rank", "bytes", "xxh3"], index_rows)]
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    info = inspect_checkpoint(args.dir)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=False))
    else:
        print(format_inspect(info))
    return 0


def register(subparsers: Any) -> None:
    """Add the ``inspect`` subcommand to the ``hp-ckpt`` parser."""
    parser = subparsers.add_parser(
        "inspect", help="list keys, dtypes, shapes, chunks, files and who wrote them (metadata only)",
        description="Describe a checkpoint from its metadata; no data file is read.",
    )
    parser.add_argument("dir", help="the checkpoint directory")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    parser.set_defaults(func=_run)

