"""Object storage figures of ``scripts/benchmark.py --storage s3`` (also runnable alone).

Starts moto's S3 server in its own process on 127.0.0.1 (a real HTTP
endpoint), then in one run, with the same bytes and the same number of
connections on both sides:

- save: ``dcp.save`` to ``s3://`` against raw s3fs multipart puts of objects
  of the same sizes (``thread_count`` objects at once, ``connections`` parts
  each);
- load: ``dcp.load`` (checksums verified) against raw s3fs ranged GETs of the
  same data objects (``part_bytes`` ranges, ``connections`` at once per
  object, ``thread_count`` objects at once);
- resharded load: one row shard and one column shard of a 4-way split of a
  matrix saved whole: bytes fetched / bytes needed, and the time against raw
  ranged GETs of exactly the needed byte runs.

Run alone: ``python scripts/bench_s3.py --size-gb 0.25``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["MotoProcess", "measure", "report", "main"]

GIB = 1 << 30
MIB = 1 << 20


class MotoProcess:
    """moto's S3 server in a child process on a free port of 127.0.0.1 (a context manager)."""

    def __init__(self) -> None:
        import socket  # pylint: disable=import-outside-toplevel

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "MotoProcess":
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url, timeout=2).close()  # pylint: disable=consider-using-with
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)
        os.environ.update({"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)


def _paired(ours: Callable[[], Any], raw: Callable[[], Any], runs: int) -> tuple[float, float]:
    """Median times of ``ours`` and ``raw``, run alternately (load on a shared machine drifts)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for position, fn in enumerate((ours, raw)):
            start = time.perf_counter()
            fn()
            times[position].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _objects(fs: Any, prefix: str) -> list[tuple[str, int]]:
    fs.invalidate_cache(prefix)
    return sorted((info["name"], int(info["size"])) for info in fs.ls(prefix, detail=True)
                  if info["name"].endswith(".safetensors"))


def _raw_put(fs: Any, prefix: str, blobs: list[bytes], threads: int, connections: int, part_bytes: int) -> None:
    def put(position: int) -> None:
        fs.pipe_file(f"{prefix}/raw{position}", blobs[position], chunksize=part_bytes, max_concurrency=connections)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(put, range(len(blobs))))


def _raw_get(fs: Any, ranges: list[tuple[str, list[int], list[int]]], threads: int, connections: int) -> int:
    def get(entry: tuple[str, list[int], list[int]]) -> int:
        path, starts, ends = entry
        blobs = fs.cat_ranges([path] * len(starts), starts, ends, batch_size=connections, on_error="raise")
        return sum(len(b) for b in blobs)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return sum(pool.map(get, ranges))


def _split(start: int, end: int, part_bytes: int) -> tuple[list[int], list[int]]:
    starts = list(range(start, end, part_bytes))
    return starts, [min(s + part_bytes, end) for s in starts]


def measure(size_gb: float, *, threads: int = 2, connections: int = 4, part_bytes: int = 8 * MIB,
            runs: int = 3, state_kind: str = "large") -> dict[str, Any]:
    """Run every figure against a fresh moto server; return times, ratios and byte counts."""
    import mindspore as ms  # pylint: disable=import-outside-toplevel
    import s3fs  # pylint: disable=import-outside-toplevel

    import hyper_parallel  # pylint: disable=import-outside-toplevel
    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel
    from benchmark import build_state  # pylint: disable=import-outside-toplevel

    ms.set_device("CPU")
    with MotoProcess() as server:
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        fs.mkdir(bucket)
        url = f"s3://{bucket}/ckpt"
        state = build_state(int(size_gb * GIB), kind=state_kind)
        nbytes = sum(p.asnumpy().nbytes for p in state.values())

        def writer() -> Any:
            return dcp.FsspecWriter(url, thread_count=threads, connections=connections, part_bytes=part_bytes)

        dcp.save(state, storage_writer=writer(), no_dist=True)  # the object sizes of the raw puts
        data = _objects(fs, f"{bucket}/ckpt")
        rng = np.random.default_rng(0)
        blobs = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _, size in data]
        save_s, raw_put_s = _paired(lambda: dcp.save(state, storage_writer=writer(), no_dist=True),
                                    lambda: _raw_put(fs, f"{bucket}/raw", blobs, threads, connections, part_bytes),
                                    runs)
        del blobs
        data = _objects(fs, f"{bucket}/ckpt")

        targets = {name: ms.Parameter(ms.Tensor(np.zeros(p.shape, np.float32), p.dtype), name=name)
                   for name, p in state.items()}

        def load() -> None:
            dcp.load(targets, storage_reader=dcp.FsspecReader(url, thread_count=threads, connections=connections,
                                                              part_bytes=part_bytes), no_dist=True)

        whole = [(path, *_split(0, size, part_bytes)) for path, size in data]
        load_s, raw_get_s = _paired(load, lambda: _raw_get(fs, whole, threads, connections), runs)
        same = all(np.array_equal(targets[k].float().asnumpy(), state[k].float().asnumpy()) for k in list(state)[:2])

        # Resharded load: a matrix saved whole, one 4-way shard loaded. Rows: a matrix of the state's size
        # (at least 4096 rows, a multiple of 2048), so each shard is whole row slabs of checksum tiles (512
        # rows of 4096 float32 columns); columns: one slab, 512 rows, each a ranged GET of one 4 KiB run.
        reshard = {}
        row_count = max(4096, int(size_gb * GIB) // (4096 * 4) // 2048 * 2048)
        for label, tensor_map, rows in (("rows", (0, -1), row_count), ("columns", (-1, 0), 512)):
            cols = 4096
            matrix = np.random.default_rng(1).random((rows, cols), dtype=np.float32)
            reshard_url = f"s3://{bucket}/reshard-{label}"
            dcp.save({"m": ms.Tensor(matrix)}, storage_writer=dcp.FsspecWriter(reshard_url, thread_count=1),
                     no_dist=True)
            info = next(iter(dcp.read_metadata(reshard_url).storage_data.values()))
            data_path = f"{bucket}/reshard-{label}/{info.relative_path}"
            shape = (rows // 4, cols) if label == "rows" else (rows, cols // 4)
            layout = hyper_parallel.Layout((4,), tensor_map)
            needed = shape[0] * shape[1] * 4
            fetched: list[int] = []
            rank = 1

            def sharded_load(layout: Any = layout, shape: tuple[int, int] = shape, rows: int = rows,
                             url: str = reshard_url, fetched: list[int] = fetched) -> None:
                target = {"m": hyper_parallel.DTensor(ms.Tensor(np.zeros(shape, np.float32)), layout, (rows, cols),
                                                      rank=rank)}
                reader = dcp.FsspecReader(url, thread_count=threads, connections=connections, part_bytes=part_bytes)
                dcp.load(target, storage_reader=reader, no_dist=True)
                fetched.append(reader.bytes_fetched)

            if label == "rows":
                first = info.offset + rank * shape[0] * cols * 4
                ranges = [(data_path, *_split(first, first + needed, part_bytes))]
            else:
                run = shape[1] * 4
                starts = [info.offset + r * cols * 4 + rank * run for r in range(rows)]
                ranges = [(data_path, starts, [s + run for s in starts])]
            load_shard_s, raw_s = _paired(
                sharded_load, lambda ranges=ranges: _raw_get(fs, ranges, threads, connections), runs)
            reshard[label] = {"needed_bytes": needed, "fetched_bytes": fetched[-1], "load_s": load_shard_s,
                              "raw_get_s": raw_s}
    return {
        "endpoint": "moto server (separate process) on 127.0.0.1", "state_bytes": nbytes, "threads": threads,
        "connections": connections, "part_bytes": part_bytes, "runs": runs, "data_objects": len(data),
        "save_s": save_s, "raw_put_s": raw_put_s, "load_s": load_s, "raw_get_s": raw_get_s, "loaded_equal": same,
        "reshard": reshard,
        "ratios": {
            "save / raw put": save_s / raw_put_s,
            "load / raw ranged get": load_s / raw_get_s,
            **{f"reshard {k}: fetched / needed": v["fetched_bytes"] / v["needed_bytes"] for k, v in reshard.items()},
            **{f"reshard {k}: load / raw ranged get": v["load_s"] / v["raw_get_s"] for k, v in reshard.items()},
        },
    }


_TARGETS = {"save / raw put": 1.2, "load / raw ranged get": 1.2, "fetched / needed": 1.05}


def report(result: dict[str, Any]) -> str:
    """The figures as text, each ratio against its target where the issue sets one."""
    lines = [f"===== object storage ({result['endpoint']}): {result['state_bytes'] / GIB:.3f} GiB in "
             f"{result['data_objects']} data objects; thread_count={result['threads']}, "
             f"connections={result['connections']}, part {result['part_bytes'] >> 20} MiB; medians of "
             f"{result['runs']} runs",
             f"save {result['save_s']:.2f} s, raw put {result['raw_put_s']:.2f} s; load {result['load_s']:.2f} s, "
             f"raw ranged get {result['raw_get_s']:.2f} s; loaded values equal: {result['loaded_equal']}"]
    for label, figures in result["reshard"].items():
        lines.append(f"reshard {label}: needed {figures['needed_bytes']} B, fetched {figures['fetched_bytes']} B, "
                     f"load {figures['load_s']:.2f} s, raw ranged get of the needed runs {figures['raw_get_s']:.2f} s")
    for name, value in result["ratios"].items():
        target = next((t for key, t in _TARGETS.items() if name.endswith(key)), None)
        verdict = "" if target is None else f"  (target <= {target}: {'met' if value <= target else 'NOT met'})"
        lines.append(f"{name:45s} {value:6.3f}{verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, measure, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--part-mib", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(report(measure(args.size_gb, threads=args.threads, connections=args.connections,
                         part_bytes=args.part_mib * MIB, runs=args.runs)))


if __name__ == "__main__":
    main()
