"""``hp-ckpt import FILE_OR_DIR OUT``: bring MindSpore or Hugging Face weights into this format.

Sources:

- a MindSpore ``.ckpt`` file (``mindspore.save_checkpoint``), read with
  ``mindspore.load_checkpoint``;
- a ``.safetensors`` file (MindSpore's ``format="safetensors"`` or any other
  writer);
- a Hugging Face directory: ``*.safetensors.index.json`` plus its shards, or a
  single ``model.safetensors``, or else every ``*.safetensors`` file in it.

Safetensors tensors are memory-mapped from their header offsets (bfloat16
viewed with MindSpore's numpy ``bfloat16``), so the import streams from the
page cache instead of holding the model in memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from hyper_parallel.cli._common import format_bytes
from hyper_parallel.core.distributed_checkpoint.api import save
from hyper_parallel.core.distributed_checkpoint.errors import (
    CheckpointNotFoundError,
    CheckpointValueError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import METADATA_FILE
from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, TensorStorageMetadata
from hyper_parallel.core.distributed_checkpoint._format.safetensors_file import DTYPE_FROM_SAFETENSORS, read_header
from hyper_parallel.platform.tensor import is_tensor, numpy_dtype, to_numpy

__all__ = ["import_checkpoint", "safetensors_files", "read_safetensors", "read_mindspore_ckpt", "register"]


def safetensors_files(directory: Path) -> list[Path]:
    """Return the safetensors files of a Hugging Face model directory.

    The index json's ``weight_map`` names them when present; else
    ``model.safetensors``; else every ``*.safetensors`` file, sorted.

    Raises:
        UnsupportedFormatError: no safetensors file, or already a hyper_parallel checkpoint.
        CorruptCheckpointError: the index json is malformed.
    """
    if (directory / METADATA_FILE).is_file():
        raise UnsupportedFormatError(
            f"{directory} is already a hyper_parallel checkpoint; nothing to import (see hp-ckpt inspect)"
        )
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    preferred = directory / "model.safetensors.index.json"
    if indexes:
        index_path = preferred if preferred in indexes else indexes[0]
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{index_path}: not a valid safetensors index ({exc})") from exc
        files = []
        for name in names:
            path = (directory / name).resolve()
            if path.parent != directory.resolve():
                raise CorruptCheckpointError(f"{index_path}: file {name!r} is outside {directory}; refused")
            if not path.is_file():
                raise CheckpointNotFoundError(f"{index_path} names {name}, which does not exist")
            files.append(path)
        return files
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UnsupportedFormatError(f"{directory} holds no .safetensors file to import")
    return files


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Map every tensor of a safetensors file as a read-only numpy array (no copy).

    Raises:
        CorruptCheckpointError: a malformed header or an unsupported dtype (names the file).
    """
    header, data_start = read_header(path)
    tensors: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        dtype = numpy_dtype(DTYPE_FROM_SAFETENSORS[entry["dtype"]])
        shape = tuple(int(s) for s in entry["shape"])
        begin = data_start + int(entry["data_offsets"][0])
        count = math.prod(shape)
        if count == 0:
            tensors[name] = np.zeros(shape, dtype=dtype)
            continue
        mapped = np.memmap(path, dtype=dtype, mode="r", offset=begin, shape=(count,))
        tensors[name] = mapped.reshape(shape)
    return tensors


def read_mindspore_ckpt(path: Path) -> dict[str, Any]:
    """Read a MindSpore ``.ckpt`` file into ``{name: numpy array or plain value}``."""
    import mindspore  # pylint: disable=import-outside-toplevel

    try:
        loaded = mindspore.load_checkpoint(str(path))
    except (ValueError, RuntimeError, TypeError) as exc:
        raise CorruptCheckpointError(f"{path}: mindspore cannot read this .ckpt file ({exc})") from exc
    return {name: np.array(to_numpy(value), copy=True) if is_tensor(value) else value
            for name, value in loaded.items()}


def _read_source(src: Path) -> dict[str, Any]:
    if not src.exists():
        raise CheckpointNotFoundError(f"{src} does not exist")
    if src.is_dir():
        state: dict[str, Any] = {}
        for path in safetensors_files(src):
            for name, tensor in read_safetensors(path).items():
                if name in state:
                    raise CorruptCheckpointError(f"tensor '{name}' appears in more than one file of {src}")
                state[name] = tensor
        return state
    if src.suffix == ".ckpt":
        return read_mindspore_ckpt(src)
    if src.suffix == ".safetensors":
        return read_safetensors(src)
    raise UnsupportedFormatError(
        f"cannot import {src}: expected a MindSpore .ckpt file, a .safetensors file or a Hugging Face directory"
    )


def import_checkpoint(src: str | os.PathLike, out: str | os.PathLike) -> Metadata:
    """Save the weights of a MindSpore or Hugging Face file/directory as a checkpoint.

    Args:
        src: A ``.ckpt`` file, a ``.safetensors`` file, or a directory of
            safetensors shards (with or without an index json).
        out: The checkpoint directory to write (``dcp.save(..., no_dist=True)``).

    Returns:
        The committed metadata of the new checkpoint.

    Raises:
        CheckpointError: the source is missing, unsupported or malformed.
    """
    src_path, out_path = Path(os.fspath(src)), Path(os.fspath(out))
    if src_path.exists() and out_path.resolve() == src_path.resolve():
        raise CheckpointValueError(f"import source and output are the same path {src_path}")
    state = _read_source(src_path)
    return save(state, checkpoint_id=out_path, no_dist=True)


def _run(args: argparse.Namespace) -> int:
    metadata = import_checkpoint(args.src, args.out)
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
        "import", help="import a MindSpore .ckpt/.safetensors file or a Hugging Face directory",
        description="Save the weights of a MindSpore checkpoint file or a Hugging Face safetensors model "
                    "as a hyper_parallel checkpoint.",
    )
    parser.add_argument("src", metavar="FILE_OR_DIR", help=".ckpt file, .safetensors file or model directory")
    parser.add_argument("out", help="the checkpoint directory to write")
    parser.set_defaults(func=_run)
