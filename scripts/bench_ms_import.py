"""Import of a MindSpore 4-rank checkpoint vs MindSpore's ``transform_checkpoints`` on the same files.

Run: ``python scripts/bench_ms_import.py [--size 1] [--runs 3] [--out DIR]`` (``--size`` in GiB of the
model; ``scripts/benchmark.py`` runs it as its ``ms_import`` phase).

The job: 4 ranks on a (2, 2) mesh; 2/3 of the bytes in matrices split over
both mesh dims, 1/3 in matrices split over one (each slice on 2 ranks), plus
replicated vectors. The per-rank files are written by ``mindspore.save_checkpoint``.
Each tool then turns them into global tensors, each in a fresh process with
the rank files evicted from the page cache first:

- ``hp-ckpt import SRC OUT --strategy FILE`` (this project's checkpoint);
- ``mindspore.parallel.transform_checkpoints(SRC, OUT, "full_", strategy, None)``
  (one unified ``.ckpt``).

Reported per tool: wall time (median), bytes read from storage
(``/proc/self/io`` ``read_bytes``; ``rchar`` too, which memory-mapped reads
do not count) and peak RSS above the RSS before the call (for the import it
counts the mapped file pages the writer touches, which are page cache, not
copies; so the anonymous part, ``RssAnon`` sampled every 10 ms, is reported
too), and the ratios import / transform.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["build_job", "measure", "main"]

GIB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent


def _io() -> dict[str, int]:
    with open("/proc/self/io", encoding="ascii") as handle:
        return {k: int(v) for k, v in (line.split(": ") for line in handle.read().splitlines())}


def _evict(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _params(size_bytes: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """name -> (global shape, tensor_map on the (2, 2) mesh), float32, about ``size_bytes`` in all."""
    cols = 1024
    both_rows = max(4, (size_bytes * 2 // 3) // (8 * cols * 4) // 4 * 4)
    one_rows = max(2, (size_bytes // 3) // (4 * cols * 4) // 2 * 2)
    params = {f"layer{i}.dense.weight": ((both_rows, cols), (1, 0)) for i in range(8)}
    params.update({f"layer{i}.proj.weight": ((one_rows, cols), (0, -1)) for i in range(4)})
    params.update({f"layer{i}.norm.gamma": ((cols,), (-1,)) for i in range(8)})
    return params


def build_job(work: Path, size_gib: float) -> tuple[Path, Path, int]:
    """Write the strategy file and the 4 rank files; return (rank dir root, strategy, model bytes)."""
    import mindspore as ms  # pylint: disable=import-outside-toplevel
    from mindspore.train import node_strategy_pb2  # pylint: disable=import-outside-toplevel

    ms.set_device("CPU")
    params = _params(int(size_gib * GIB))
    strategy = node_strategy_pb2.ParallelStrategyMap()
    strategy.current_stage = 0
    node = strategy.parallel_strategy_item.add()
    node.node_name = "MatMul-op0"
    node.parallel_strategys.stage = 0
    for name, (_, tensor_map) in params.items():
        item = strategy.parallel_layout_item.add()
        item.param_name = name
        item.parallel_layouts.dev_matrix.add().dim.extend([2, 2])
        item.parallel_layouts.tensor_map.add().dim.extend(tensor_map)
        item.parallel_layouts.param_split_shape.add()
        item.parallel_layouts.indices_offset.add()
        item.parallel_layouts.field = 0
        item.parallel_layouts.opt_weight_shard_step = 0
        item.parallel_layouts.opt_weight_shard_size = 0
    strategy_path = work / "strategy.ckpt"
    strategy_path.write_bytes(strategy.SerializeToString())
    rng = np.random.default_rng(0)
    full = {name: rng.standard_normal(shape, dtype=np.float32) for name, (shape, _) in params.items()}
    src = work / "ranks"
    for rank in range(4):
        coordinate = (rank // 2, rank % 2)
        pieces = []
        for name, (shape, tensor_map) in params.items():
            window = []
            for dim, entry in enumerate(tensor_map):
                if entry == -1:
                    window.append(slice(None))
                    continue
                index = coordinate[1 - entry]  # tensor_map counts mesh dims from the right
                step = shape[dim] // 2
                window.append(slice(index * step, (index + 1) * step))
            pieces.append({"name": name, "data": ms.Tensor(np.ascontiguousarray(full[name][tuple(window)]))})
        (src / f"rank_{rank}").mkdir(parents=True)
        ms.save_checkpoint(pieces, str(src / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"))
    return src, strategy_path, sum(a.nbytes for a in full.values())


def _child(tool: str, src: Path, strategy: Path, out: Path) -> dict[str, Any]:
    """Run one tool in this (fresh) process; return its own time, I/O and peak RSS."""
    if tool == "import":
        # Both tools import MindSpore before the timer (the strategy file is parsed with its protobuf module).
        import mindspore.train.node_strategy_pb2  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import

        from hyper_parallel.cli import import_checkpoint  # pylint: disable=import-outside-toplevel

        def run() -> None:
            import_checkpoint(src, out, strategy_files=[strategy])
    else:
        import mindspore as ms  # pylint: disable=import-outside-toplevel

        ms.set_device("CPU")

        def run() -> None:
            ms.parallel.transform_checkpoints(str(src), str(out), "full_", str(strategy), None)
    with open("/proc/self/statm", encoding="ascii") as handle:
        rss_before = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    anon_before = _anon_rss()
    peak_anon = [anon_before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak_anon[0] = max(peak_anon[0], _anon_rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    before, start = _io(), time.perf_counter()
    run()
    seconds, after = time.perf_counter() - start, _io()
    done.set()
    sampler.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "read_bytes": after["read_bytes"] - before["read_bytes"],
            "rchar": after["rchar"] - before["rchar"], "peak_extra_rss_bytes": max(0, peak - rss_before),
            "peak_extra_anon_bytes": max(0, peak_anon[0] - anon_before)}


def _anon_rss() -> int:
    """This process's anonymous resident memory (``RssAnon``: not file pages, which are page cache)."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(work: Path, size_gib: float, runs: int) -> dict[str, Any]:
    """Build the job, time both tools ``runs`` times each (cold cache); return figures and ratios."""
    work.mkdir(parents=True, exist_ok=True)
    src, strategy, model_bytes = build_job(work, size_gib)
    rank_files = sorted(src.glob("rank_*/*.ckpt"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    results: dict[str, list[dict[str, Any]]] = {"import": [], "transform_checkpoints": []}
    for run in range(runs):
        for tool in results:
            out = work / f"out_{tool}_{run}"
            _evict(rank_files)
            proc = subprocess.run(
                [sys.executable, __file__, "--child", "import" if tool == "import" else "transform",
                 "--src", str(src), "--strategy", str(strategy), "--out", str(out)],
                env=env, capture_output=True, text=True, check=False)
            if proc.returncode:
                raise RuntimeError(f"{tool} failed: {proc.stderr[-2000:]}")
            results[tool].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            subprocess.run(["rm", "-rf", str(out)], check=True)
    medians = {tool: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
               for tool, rows in results.items()}
    ours, theirs = medians["import"], medians["transform_checkpoints"]
    return {
        "model_bytes": model_bytes,
        "rank_file_bytes": sum(p.stat().st_size for p in rank_files),
        "runs": results,
        "median": medians,
        "ratios": {
            "time import / transform_checkpoints": ours["seconds"] / theirs["seconds"],
            "read_bytes import / transform_checkpoints": ours["read_bytes"] / max(1, theirs["read_bytes"]),
            "read_bytes import / model bytes": ours["read_bytes"] / model_bytes,
            "peak extra RSS import / transform_checkpoints": ours["peak_extra_rss_bytes"]
            / max(1, theirs["peak_extra_rss_bytes"]),
            "peak extra anonymous RSS import / transform_checkpoints": ours["peak_extra_anon_bytes"]
            / max(1, theirs["peak_extra_anon_bytes"]),
        },
    }


def report(figures: dict[str, Any]) -> str:
    """The figures as text."""
    lines = [f"MindSpore 4-rank import: model {figures['model_bytes'] / GIB:.3f} GiB, rank files "
             f"{figures['rank_file_bytes'] / GIB:.3f} GiB"]
    for tool, row in figures["median"].items():
        lines.append(f"  {tool:<22} {row['seconds']:8.2f} s  read_bytes {row['read_bytes'] / GIB:7.3f} GiB  "
                     f"rchar {row['rchar'] / GIB:7.3f} GiB  "
                     f"peak extra RSS {row['peak_extra_rss_bytes'] / GIB:6.3f} GiB "
                     f"(anonymous {row['peak_extra_anon_bytes'] / GIB:6.3f} GiB)")
    lines += [f"  {name}: {value:.3f}" for name, value in figures["ratios"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Standalone run, or one measured child process (``--child``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=1.0, help="model size in GiB (default 1)")
    parser.add_argument("--runs", type=int, default=3, help="runs per tool; medians reported (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="working directory (default: new one in /tmp)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument("--child", choices=["import", "transform"], help=argparse.SUPPRESS)
    parser.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--strategy", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.src, args.strategy, args.out)))
        return
    work = args.out or Path(tempfile.mkdtemp(prefix="hp_ms_import_", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    figures = measure(work, args.size, args.runs)
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
