"""``hp-ckpt diff A B``: which keys differ in presence, kind, shape, dtype or values.

Tensors are compared one at a time (each assembled whole from its chunks,
whatever layout or world size saved it), in slices, so memory stays bounded
by two copies of the largest tensor. Non-tensor values are compared by type
and stored bytes; a differing small int / float / bool / str / None / numpy
scalar is shown decoded (``10 vs 11``); nothing else is decoded (a pickled
value is never unpickled). A progress bar (tqdm, on a terminal) counts keys.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyper_parallel.cli._common import (
    format_table,
    open_checkpoint,
    plain_value_text,
    progress,
    read_full_tensor,
    read_stored_bytes,
)
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

__all__ = ["KeyDifference", "DiffReport", "compare_arrays", "diff_checkpoints", "format_diff", "register"]

_SLICE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class KeyDifference:
    """One key that differs between the two checkpoints.

    Attributes:
        key: The checkpoint key.
        what: ``"presence"``, ``"kind"``, ``"dtype"``, ``"shape"`` or ``"values"``.
        a: Short description on side A.
        b: Short description on side B.
        detail: For ``"values"``: how many elements differ and by how much.
    """

    key: str
    what: str
    a: str
    b: str
    detail: str = ""


@dataclass(frozen=True)
class DiffReport:
    """The result of :func:`diff_checkpoints`.

    Attributes:
        a: Checkpoint A.
        b: Checkpoint B.
        differences: Every differing key, sorted by key.
        compared: Number of keys present on both sides.
        rtol: Relative tolerance used for floating-point tensors.
        atol: Absolute tolerance used for floating-point tensors.
    """

    a: str
    b: str
    differences: tuple[KeyDifference, ...]
    compared: int
    rtol: float
    atol: float

    @property
    def equal(self) -> bool:
        """``True`` when no key differs."""
        return not self.differences


def _describe(stored: Any) -> str:
    if isinstance(stored, TensorStorageMetadata):
        return f"tensor {stored.properties.dtype} {list(stored.size)}"
    return f"value {stored.type_name}"


def _integer_gap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|a - b|`` of same-dtype integer arrays, exact (as ``uint64``, which holds any 64-bit gap)."""
    high, low = np.maximum(a, b).astype(np.uint64), np.minimum(a, b).astype(np.uint64)
    return high - low  # modulo 2**64: the true gap, which is below 2**64


def compare_arrays(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> tuple[int, float]:
    """Count elements of same-shaped arrays that differ beyond ``atol + rtol * |b|``.

    The tolerances apply to floating-point arrays only: integer and boolean
    arrays are compared exactly (an int64 above 2**53 is never rounded to a
    float64 first). NaNs in the same position are equal. Returns the count and
    the largest absolute difference among differing elements (``nan`` if not
    finite).
    """
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    boolean = np.issubdtype(a.dtype, np.bool_)
    integer = np.issubdtype(a.dtype, np.integer)
    exact = boolean or integer
    differing, worst = 0, 0.0
    for start in range(0, flat_a.size, _SLICE_ELEMENTS):
        part_a = flat_a[start : start + _SLICE_ELEMENTS]
        part_b = flat_b[start : start + _SLICE_ELEMENTS]
        if exact:
            mismatch = part_a != part_b
        else:
            # float64 copies first: a boolean mask on MindSpore's numpy bfloat16 raises MemoryError (memcpy_s)
            part_a, part_b = part_a.astype(np.float64), part_b.astype(np.float64)
            mismatch = ~np.isclose(part_a, part_b, rtol=rtol, atol=atol, equal_nan=True)
        count = int(np.count_nonzero(mismatch))
        if not count:
            continue
        differing += count
        if boolean:
            worst = 1.0
            continue
        if integer:
            worst = max(worst, float(_integer_gap(part_a[mismatch], part_b[mismatch]).max()))
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            gap = np.abs(part_a[mismatch] - part_b[mismatch])
        worst = max(worst, float(np.max(gap))) if np.all(np.isfinite(gap)) else float("nan")
    return differing, worst


def diff_checkpoints(
    a: str | os.PathLike, b: str | os.PathLike, rtol: float = 0.0, atol: float = 0.0
) -> DiffReport:
    """Compare two checkpoints key by key.

    Args:
        a: Checkpoint A (a directory).
        b: Checkpoint B.
        rtol: Relative tolerance for floating-point tensors (default exact).
        atol: Absolute tolerance for floating-point tensors (default exact).
            Integer and bool tensors and non-tensor values are always compared exactly.

    Returns:
        The differing keys (presence, kind, dtype, shape, values).

    Raises:
        CheckpointError: either side is not a checkpoint, or is corrupt.
    """
    if rtol < 0 or atol < 0:
        raise CheckpointValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    dir_a, meta_a = open_checkpoint(a)
    dir_b, meta_b = open_checkpoint(b)
    keys_a, keys_b = meta_a.state_dict_metadata, meta_b.state_dict_metadata
    found: list[KeyDifference] = []
    compared = 0
    all_keys = sorted(set(keys_a) | set(keys_b))
    for key in progress(all_keys, desc="diff", unit="key"):
        if key not in keys_b:
            found.append(KeyDifference(key, "presence", _describe(keys_a[key]), "missing"))
            continue
        if key not in keys_a:
            found.append(KeyDifference(key, "presence", "missing", _describe(keys_b[key])))
            continue
        compared += 1
        sa, sb = keys_a[key], keys_b[key]
        if isinstance(sa, TensorStorageMetadata) != isinstance(sb, TensorStorageMetadata):
            found.append(KeyDifference(key, "kind", _describe(sa), _describe(sb)))
        elif isinstance(sa, TensorStorageMetadata):
            if sa.properties.dtype != sb.properties.dtype:
                found.append(KeyDifference(key, "dtype", sa.properties.dtype, sb.properties.dtype))
            elif tuple(sa.size) != tuple(sb.size):
                found.append(KeyDifference(key, "shape", str(list(sa.size)), str(list(sb.size))))
            else:
                count, worst = compare_arrays(
                    read_full_tensor(dir_a, meta_a, key), read_full_tensor(dir_b, meta_b, key), rtol, atol
                )
                if count:
                    total = max(1, int(np.prod(sa.size)))
                    found.append(KeyDifference(
                        key, "values", _describe(sa), _describe(sb),
                        f"{count} of {total} element(s) differ, max |a-b| = {worst:.6g}",
                    ))
        else:
            found.extend(_diff_values(key, dir_a, meta_a, sa, dir_b, meta_b, sb))
    return DiffReport(str(dir_a), str(dir_b), tuple(found), compared, rtol, atol)


def _diff_values(key, dir_a, meta_a, sa: BytesStorageMetadata, dir_b, meta_b, sb: BytesStorageMetadata):
    if sa.type_name != sb.type_name:
        return [KeyDifference(key, "kind", _describe(sa), _describe(sb))]
    if tuple(sa.global_shape) != tuple(sb.global_shape) or set(sa.shard_offsets) != set(sb.shard_offsets):
        return [KeyDifference(key, "shape", f"grid {list(sa.global_shape)}", f"grid {list(sb.global_shape)}")]
    changed = [
        offset for offset in sorted(sa.shard_offsets)
        if read_stored_bytes(dir_a, meta_a, MetadataIndex(key, tuple(offset)))
        != read_stored_bytes(dir_b, meta_b, MetadataIndex(key, tuple(offset)))
    ]
    if not changed:
        return []
    if changed == [()]:
        text_a, text_b = plain_value_text(dir_a, meta_a, key), plain_value_text(dir_b, meta_b, key)
        if text_a is not None and text_b is not None:
            return [KeyDifference(key, "values", text_a, text_b, f"{_describe(sa)}: {text_a} vs {text_b}")]
    where = "" if changed == [()] else f" at grid position(s) {[list(o) for o in changed]}"
    return [KeyDifference(key, "values", _describe(sa), _describe(sb), f"stored value differs{where}")]


def format_diff(report: DiffReport) -> str:
    """Render a :class:`DiffReport` for people: a table of differences and a summary."""
    if report.equal:
        return f"equal: {report.a} and {report.b} ({report.compared} key(s) compared)"
    rows = [[d.key, d.what, d.a, d.b, d.detail] for d in report.differences]
    table = format_table(["key", "differs in", "A", "B", "detail"], rows)
    return (
        f"{table}\n\n{len(report.differences)} key(s) differ between {report.a} (A) and {report.b} (B); "
        f"{report.compared} key(s) on both sides"
    )


def _run(args: argparse.Namespace) -> int:
    report = diff_checkpoints(args.a, args.b, rtol=args.rtol, atol=args.atol)
    print(format_diff(report))
    return 0 if report.equal else 1


def register(subparsers: Any) -> None:
    """Add the ``diff`` subcommand to the ``hp-ckpt`` parser."""
    parser = subparsers.add_parser(
        "diff", help="compare two checkpoints key by key (exit 0 equal, 1 different)",
        description="Report keys that differ in presence, kind, dtype, shape or values.",
    )
    parser.add_argument("a", help="checkpoint A")
    parser.add_argument("b", help="checkpoint B")
    parser.add_argument("--rtol", type=float, default=0.0,
                        help="relative tolerance for floating-point tensors (default 0: exact); "
                             "integer and bool tensors and stored values are always compared exactly")
    parser.add_argument("--atol", type=float, default=0.0,
                        help="absolute tolerance for floating-point tensors (default 0: exact); "
                             "integer and bool tensors and stored values are always compared exactly")
    parser.set_defaults(func=_run)
