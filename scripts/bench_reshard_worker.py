"""msrun worker of ``benchmark.py``: bytes read by a resharded load, per rank.

Launched by ``benchmark.py`` as ``msrun --worker_num=N ... bench_reshard_worker.py --dir D --out F``.
Every rank saves its row shard (``Layout((N,), (0, -1))``: dim 0 split over
the mesh) of a few matrices, then loads column shards (``Layout((N,), (-1, 0))``)
with a cold page cache, verification on and off. Per rank it measures the bytes
read from storage against the bytes of its shard: the reader's ``bytes_read``
and the time of a collective load (all ranks at once), and the
``/proc/self/io`` read_bytes delta (page cache and readahead included) and the
time of a load run by each rank alone, so that no rank's reads warm another's
cache. The verified load alone is also measured with twice the default
``max_inflight_bytes`` and with each ``--inflight-mb`` (the private-buffer
budget of narrow regions is ``thread_count x max_inflight_bytes``); each rank
reports its narrow bytes needed against that budget (narrow bytes beyond it
are read twice: amplification >= 1 + excess / needed) and the peak extra RSS
of its verified load at default settings. Rank 0 writes every rank's figures
as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore.communication import get_group_size, get_rank, init

import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint._device_reads import MAX_PAGE_AMPLIFICATION, page_amplification
from hyper_parallel.core.distributed_checkpoint.filesystem_reader import DEFAULT_MAX_INFLIGHT_BYTES
from hyper_parallel import DTensor, Layout, platform

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import GIB, data_files, drop_page_cache, peak_extra_rss, pretouch, read_io_bytes  # noqa: E402

__all__ = ["main"]

#: (name, columns, dtype) of the matrices; rows follow from the size. Rows of 16 to 64 KiB, and narrow
#: rows of 4 KiB and 2 KiB (column halves narrower than a page).
_MATRICES = (("w_f32_4096", 4096, "float32"), ("w_bf16_8192", 8192, "bfloat16"), ("w_f32_16384", 16384, "float32"),
             ("w_f32_1024", 1024, "float32"), ("w_bf16_1024", 1024, "bfloat16"))


def _shapes(size_bytes: int, world: int) -> dict[str, tuple[tuple[int, int], str]]:
    """Global shape and dtype of each matrix; rows a multiple of ``world``; about ``size_bytes`` in all."""
    shapes = {}
    for name, cols, dtype in _MATRICES:
        itemsize = 4 if dtype == "float32" else 2
        rows = max(world, size_bytes // len(_MATRICES) // (cols * itemsize) // world * world)
        shapes[name] = ((rows, cols), dtype)
    return shapes


def _values(shape: tuple[int, int], rows: slice, cols: slice) -> np.ndarray:
    """The region ``[rows, cols]`` of a matrix whose values (integers < 256) are exact in bfloat16."""
    i = np.arange(shape[0], dtype=np.int32)[rows, None]
    j = np.arange(shape[1], dtype=np.int32)[None, cols]
    return ((i * 7 + j * 13) % 256).astype(np.float32)


def _tensor(values: np.ndarray, dtype: str) -> ms.Tensor:
    """``values`` as a MindSpore tensor of ``dtype``."""
    return ms.Tensor(values, ms.bfloat16 if dtype == "bfloat16" else ms.float32)


def _targets(shapes: dict, layout: Layout, world: int) -> dict:
    """Zeroed column shards (DTensors) of every matrix."""
    return {name: DTensor(_tensor(np.zeros((rows, cols // world), np.float32), dtype), layout,
                          global_shape=(rows, cols))
            for name, ((rows, cols), dtype) in shapes.items()}


def _check(targets: dict, shapes: dict, rank: int, world: int) -> None:
    """Raise unless every column shard holds the saved values."""
    for name, ((rows, cols), _) in shapes.items():
        part = slice(rank * cols // world, (rank + 1) * cols // world)
        got = targets[name].to_local().asnumpy().astype(np.float32)
        if not np.array_equal(got, _values((rows, cols), slice(None), part)):
            raise RuntimeError(f"rank {rank}: resharded load of '{name}' returned wrong values")


def _collective_load(directory: Path, shapes: dict, layout: Layout, rank: int, world: int, verify: bool,
                     pretouch_gb: float) -> tuple[float, int]:
    """One cold collective load on all ranks at once; returns (seconds, reader bytes_read)."""
    targets = _targets(shapes, layout, world)
    drop_page_cache(data_files(directory))
    pretouch(pretouch_gb)
    platform.barrier()
    reader = dcp.FileSystemReader(directory, verify_checksums=verify)
    start = time.perf_counter()
    dcp.load(targets, storage_reader=reader)
    seconds = time.perf_counter() - start
    _check(targets, shapes, rank, world)
    return seconds, reader.bytes_read


def _alone_load(directory: Path, shapes: dict, layout: Layout, rank: int, world: int, verify: bool,
                inflight: int = DEFAULT_MAX_INFLIGHT_BYTES) -> tuple[int, float]:
    """Cold loads one rank at a time (``use_collectives=False``), so that no rank's
    readahead fills another's page cache; returns this rank's ``/proc/self/io`` read_bytes delta and seconds."""
    targets = _targets(shapes, layout, world)
    fetched, seconds = 0, 0.0
    for turn in range(world):
        if turn == rank:
            drop_page_cache(data_files(directory))
            before = read_io_bytes()
            start = time.perf_counter()
            reader = dcp.FileSystemReader(directory, verify_checksums=verify, max_inflight_bytes=inflight)
            dcp.load(targets, storage_reader=reader, use_collectives=False)
            seconds = time.perf_counter() - start
            fetched = read_io_bytes() - before
            _check(targets, shapes, rank, world)
        platform.barrier()
    return fetched, seconds


def _alone_figures(args: argparse.Namespace, shapes: dict, layout: Layout, rank: int, world: int, verify: bool,
                   inflight: int = DEFAULT_MAX_INFLIGHT_BYTES) -> dict:
    """Medians of ``--runs`` alone loads: device bytes and seconds (the time exact narrow reads cost)."""
    runs = [_alone_load(args.dir, shapes, layout, rank, world, verify, inflight) for _ in range(args.runs)]
    return {"/proc read_bytes": statistics.median(r[0] for r in runs), "/proc runs": [r[0] for r in runs],
            "alone median_s": statistics.median(r[1] for r in runs)}


def _narrow_bytes(shapes: dict, rank: int, world: int) -> int:
    """Bytes of this rank's column shards whose rows share pages with bytes it does not need.

    These are the regions a verified load reads with exact device reads into
    private buffers (within ``thread_count x max_inflight_bytes``); the rest of
    them is read twice. Chunks of whole pages start on a page (the writer's rule).
    """
    total = 0
    for (rows, cols), dtype in shapes.values():
        itemsize = 4 if dtype == "float32" else 2
        width = cols // world * itemsize
        starts = np.arange(min(rows, 256), dtype=np.int64) * cols * itemsize + rank * width
        if page_amplification(starts, width) > MAX_PAGE_AMPLIFICATION:
            total += rows * width
    return total


def _alone_memory(directory: Path, shapes: dict, layout: Layout, rank: int, world: int) -> tuple[int, str]:
    """Peak RSS above the start of a cold verified load run by each rank alone (targets allocated before)."""
    targets = _targets(shapes, layout, world)
    extra, method = 0, ""
    for turn in range(world):
        if turn == rank:
            drop_page_cache(data_files(directory))
            reader = dcp.FileSystemReader(directory)
            extra, method = peak_extra_rss(lambda: dcp.load(targets, storage_reader=reader, use_collectives=False))
            _check(targets, shapes, rank, world)
        platform.barrier()
    return extra, method


def _async_result_seconds(directory: Path, *, runs: int) -> float:
    """Median seconds ``result()`` of a multi-rank async save blocks once this rank's writing is over.

    A small state (200 tensors of 16 KiB and one of 4 MiB); each save waits
    for ``done()`` and a barrier first, so only what ``result()`` itself
    costs is timed (the commit runs in the background since issue 12).
    """
    state = {f"p{i}": ms.Tensor(np.full(4096, i, np.float32)) for i in range(200)}
    state["big"] = ms.Tensor(np.ones(1 << 20, np.float32))
    times = []
    for run in range(runs):
        handle = dcp.async_save(state, checkpoint_id=directory / f"run{run}")
        while not handle.done():
            time.sleep(0.001)
        platform.barrier()
        start = time.perf_counter()
        handle.result()
        times.append(time.perf_counter() - start)
    dcp.load({k: np.zeros(v.shape, np.float32) for k, v in state.items()}, checkpoint_id=directory / f"run{runs - 1}")
    return statistics.median(times)


def main() -> None:
    """Save row-split, load column-split (cold), report bytes read per rank."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="JSON output (written by rank 0)")
    parser.add_argument("--size-gb", type=float, default=1.0, help="global size of the matrices in GiB")
    parser.add_argument("--runs", type=int, default=3, help="loads per setting (medians reported)")
    parser.add_argument("--pretouch-gb", type=float, default=3.0, help="GiB touched before each load")
    parser.add_argument("--inflight-mb", type=float, nargs="*", default=[],
                        help="also measure the verified load alone with these max_inflight_bytes (MiB); e.g. the "
                             "default scaled to a smaller --size-gb (16 at 0.25 GiB is what 64 is at 1 GiB)")
    args = parser.parse_args()
    ms.set_device("CPU")
    init()
    rank, world = int(get_rank()), int(get_group_size())
    shapes = _shapes(int(args.size_gb * GIB), world)
    rows_split, cols_split = Layout((world,), (0, -1)), Layout((world,), (-1, 0))
    source = {}
    for name, ((rows, cols), dtype) in shapes.items():
        mine = slice(rank * rows // world, (rank + 1) * rows // world)
        source[name] = DTensor(_tensor(_values((rows, cols), mine, slice(None)), dtype), rows_split,
                               global_shape=(rows, cols))
    start = time.perf_counter()
    dcp.save(source, checkpoint_id=args.dir)
    save_seconds = time.perf_counter() - start
    del source
    result_seconds = _async_result_seconds(args.dir.parent / f"{args.dir.name}_async", runs=max(args.runs, 5))

    needed = sum(rows * (cols // world) * (4 if dtype == "float32" else 2)
                 for (rows, cols), dtype in shapes.values())
    defaults = dcp.FileSystemReader(args.dir)
    figures = {"rank": rank, "needed_bytes": needed, "save_s": save_seconds, "async_result_s": result_seconds,
               "narrow_needed_bytes": _narrow_bytes(shapes, rank, world),
               "private_budget_bytes": defaults.thread_count * defaults.max_inflight_bytes}
    for verify in (True, False):
        runs = [_collective_load(args.dir, shapes, cols_split, rank, world, verify, args.pretouch_gb)
                for _ in range(args.runs)]
        figures[f"verify {'on' if verify else 'off'}"] = {
            "median_s": statistics.median(r[0] for r in runs),
            "reader bytes_read": statistics.median(r[1] for r in runs),
            "runs": runs,
            **_alone_figures(args, shapes, cols_split, rank, world, verify),
        }
    # Verified narrow regions are read once into private buffers of thread_count x max_inflight_bytes;
    # what does not fit costs its pages' other bytes. The same load with twice the default in-flight bound,
    # and with each --inflight-mb asked for:
    figures["verify on, 2x max_inflight_bytes"] = _alone_figures(args, shapes, cols_split, rank, world, True,
                                                                 2 * DEFAULT_MAX_INFLIGHT_BYTES)
    extra, method = _alone_memory(args.dir, shapes, cols_split, rank, world)
    figures["verify on, alone extra RSS"] = {"extra_bytes": extra, "method": method}
    for mib in args.inflight_mb:
        figures[f"verify on, max_inflight_bytes {mib:g} MiB"] = _alone_figures(
            args, shapes, cols_split, rank, world, True, int(mib * (1 << 20)))
    everyone = platform.all_gather_object(figures)
    if rank == 0:
        description = ", ".join(f"{n} {list(s)} {d}" for n, (s, d) in shapes.items())
        args.out.write_text(json.dumps({
            "description": f"saved Layout(({world},), (0, -1)), loaded Layout(({world},), (-1, 0)): {description}",
            "ranks": everyone,
        }, indent=2))
    platform.barrier()


if __name__ == "__main__":
    main()
