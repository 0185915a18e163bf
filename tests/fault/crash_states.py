"""Crash states a power cut can leave, built from a recorded log of file-system operations.

The model follows the ALICE study (Pillai et al., "All File Systems Are Not
Created Equal", OSDI 2014): each recorded system call becomes logical
micro-operations, and a crash state is a prefix of them (the calls issued
before the cut) of which only some reached the disk. What may be missing is
what POSIX lets a file system lose, a superset of what ext4's ordered mode
loses:

- file contents: each write splits into 4 KiB block pieces; a piece is
  durable only once an ``fsync`` / ``fdatasync`` of that file completed
  after it. Pieces not durable may be lost independently (a torn write; a
  lost block inside the file's size reads as zeros) and in any order;
- names: a create, rename, unlink or mkdir is durable only once an ``fsync``
  of its directory (both directories for a rename) completed after it;
  names not durable may be undone independently of each other and of the
  file contents (reordering among un-synced operations).

For every crash point (every micro-operation boundary) the enumerator
yields, ALICE-style: the state where everything issued reached the disk,
the state where only what was synced did, each single un-synced operation
left out, each single un-synced operation alone, and then every subset of
the un-synced operations when there are few, seeded random subsets when
there are many.
``materialise`` writes a state out as a real directory tree.
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from hyper_parallel.core.distributed_checkpoint._file_ops import FileOp

__all__ = ["BLOCK", "MicroOp", "Tree", "snapshot", "micro_ops", "crash_states", "materialise", "fingerprint"]

BLOCK = 4096
_CONTENT = ("trunc", "block")
_NAMES = ("link", "rename", "unlink", "mkdir")
_SYNCS = ("sync_file", "sync_dir")


@dataclass(frozen=True)
class MicroOp:
    """One logical operation on the disk image.

    ``inode`` numbers the file a content op or a name op refers to, fixed when
    the call was made (a rename moves that file, whatever its source name
    holds in the crash state).
    """

    kind: str
    path: str = ""
    target: str = ""
    inode: int = -1
    offset: int = 0
    data: bytes = b""


@dataclass(frozen=True)
class Tree:
    """A directory tree: directories and file contents by path relative to the root."""

    dirs: frozenset[str]
    files: dict[str, bytes]


def snapshot(root: Path) -> Tree:
    """Read the durable starting state of ``root`` (everything under it)."""
    dirs, files = set(), {}
    for directory, subdirs, names in os.walk(root):
        rel = os.path.relpath(directory, root)
        for sub in subdirs:
            dirs.add(os.path.normpath(os.path.join(rel, sub)))
        for name in names:
            files[os.path.normpath(os.path.join(rel, name))] = Path(directory, name).read_bytes()
    return Tree(frozenset(dirs), files)


def _parent(path: str) -> str:
    return os.path.dirname(path) or "."


def micro_ops(log: list[FileOp], root: Path, before: Tree) -> tuple[list[MicroOp], dict[int, bytes]]:
    """Turn a recorded log into micro-operations; also return the starting content of each inode."""
    names: dict[str, int] = {}
    contents: dict[int, bytes] = {}
    for number, (path, data) in enumerate(sorted(before.files.items())):
        names[path], contents[number] = number, data
    next_inode = len(contents)

    def rel(path: Path) -> str:
        return os.path.normpath(os.path.relpath(path, root))

    ops: list[MicroOp] = []
    for op in log:
        path = rel(op.path)
        if op.kind == "create":
            names[path], contents[next_inode] = next_inode, b""
            ops.append(MicroOp("link", path, inode=next_inode))
            next_inode += 1
        elif op.kind == "truncate":
            ops.append(MicroOp("trunc", path, inode=names[path]))
        elif op.kind == "write":
            start, end = op.offset, op.offset + len(op.data)
            position = start
            while position < end:
                stop = min(end, (position // BLOCK + 1) * BLOCK)
                piece = op.data[position - start : stop - start]
                ops.append(MicroOp("block", path, inode=names[path], offset=position, data=piece))
                position = stop
        elif op.kind in ("fsync", "fdatasync"):
            ops.append(MicroOp("sync_file", path, inode=names[path]))
        elif op.kind == "rename":
            target = rel(op.target)
            inode = names.pop(path)
            names[target] = inode
            ops.append(MicroOp("rename", path, target=target, inode=inode))
        elif op.kind == "unlink":
            ops.append(MicroOp("unlink", path, inode=names.pop(path)))
        elif op.kind == "mkdir":
            ops.append(MicroOp("mkdir", path))
        elif op.kind == "fsync_dir":
            ops.append(MicroOp("sync_dir", path))
        else:
            raise ValueError(f"unknown recorded operation {op.kind!r}")
    return ops, contents


def _synced_at(ops: list[MicroOp]) -> list[float]:
    """For each op, the index of the first later sync that makes it durable (inf: none)."""
    result = [float("inf")] * len(ops)
    for index, op in enumerate(ops):
        if op.kind in _SYNCS:
            continue
        if op.kind in _CONTENT:
            need = [("sync_file", op.inode)]
        elif op.kind == "rename":
            need = [("sync_dir", _parent(op.path)), ("sync_dir", _parent(op.target))]
        else:
            need = [("sync_dir", _parent(op.path))]
        found = []
        for kind, key in set(need):
            later = (
                j for j in range(index + 1, len(ops))
                if ops[j].kind == kind and (ops[j].inode == key if kind == "sync_file" else ops[j].path == key)
            )
            found.append(next(later, float("inf")))
        result[index] = max(found)
    return result


def crash_states(
    ops: list[MicroOp], *, random_per_point: int, exhaustive: int = 64, seed: int = 0
) -> Iterator[tuple[int, frozenset[int]]]:
    """Yield ``(crash point, indices of the ops that reached the disk)``; deterministic for a seed.

    At a crash point with at most ``exhaustive`` subsets of un-synced ops every
    subset is yielded; above that, ``random_per_point`` seeded random ones.
    """
    synced_at = _synced_at(ops)
    rng = random.Random(seed)
    for point in range(len(ops) + 1):
        issued = [i for i in range(point) if ops[i].kind not in _SYNCS]
        forced = frozenset(i for i in issued if synced_at[i] < point)
        pending = [i for i in issued if i not in forced]
        yield point, forced | frozenset(pending)  # everything issued reached the disk
        yield point, forced  # only what was synced did
        for left_out in pending:
            yield point, forced | frozenset(p for p in pending if p != left_out)
            yield point, forced | {left_out}
        if 2 ** len(pending) <= exhaustive:
            for mask in range(2 ** len(pending)):
                yield point, forced | frozenset(p for bit, p in enumerate(pending) if mask >> bit & 1)
            continue
        for _ in range(random_per_point):
            yield point, forced | frozenset(p for p in pending if rng.random() < 0.5)


def apply(before: Tree, contents: dict[int, bytes], ops: list[MicroOp], persisted: frozenset[int]) -> Tree:
    """The tree after the ``persisted`` ops (in program order) reached the disk."""
    names = {path: number for number, path in enumerate(sorted(before.files))}
    dirs = set(before.dirs)
    data = {number: bytearray(content) for number, content in contents.items()}
    for index in sorted(persisted):
        op = ops[index]
        if op.kind == "link":
            names[op.path] = op.inode
        elif op.kind == "mkdir":
            dirs.add(op.path)
        elif op.kind == "rename":
            if names.get(op.path) == op.inode:
                del names[op.path]
            names[op.target] = op.inode
        elif op.kind == "unlink":
            if names.get(op.path) == op.inode:
                del names[op.path]
        elif op.kind == "trunc":
            data[op.inode] = bytearray()
        elif op.kind == "block":
            buffer = data[op.inode]
            end = op.offset + len(op.data)
            if len(buffer) < end:
                buffer.extend(bytes(end - len(buffer)))  # a lost block before this one reads as zeros
            buffer[op.offset : end] = op.data
    files = {}
    for path, inode in names.items():
        if _parent(path) == "." or _parent(path) in dirs:
            files[path] = bytes(data[inode])
    reachable = {d for d in dirs if all(p in dirs for p in _ancestors(d))}
    return Tree(frozenset(reachable), {p: c for p, c in files.items() if _parent(p) in reachable | {"."}})


def _ancestors(path: str) -> list[str]:
    parts = path.split(os.sep)
    return [os.sep.join(parts[:n]) for n in range(1, len(parts))]


def fingerprint(tree: Tree) -> str:
    """A hash of the tree's directories and file contents."""
    digest = hashlib.sha256()
    for directory in sorted(tree.dirs):
        digest.update(b"d" + directory.encode() + b"\0")
    for path in sorted(tree.files):
        digest.update(b"f" + path.encode() + b"\0" + hashlib.sha256(tree.files[path]).digest())
    return digest.hexdigest()


def materialise(tree: Tree, root: Path) -> None:
    """Write ``tree`` under the empty directory ``root``."""
    for directory in sorted(tree.dirs, key=len):
        (root / directory).mkdir(parents=True, exist_ok=True)
    for path, content in tree.files.items():
        (root / path).write_bytes(content)
