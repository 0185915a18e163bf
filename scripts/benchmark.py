"""Measure the "Performance contract" of DESIGN.md in one run; print a table, write JSON.

Run: ``python scripts/benchmark.py [--size-gb 1] [--state many large] [--threads 2] [--runs 3]
[--warm-runs 5] [--out DIR]``;
``--storage s3`` measures object storage instead (``bench_s3.py``: save, load and a resharded load on a
local moto S3 server against raw s3fs puts and ranged GETs of the same bytes).
For each state of MindSpore Parameters (``many``: 1,799 Parameters at 1 GiB, a
few large, 48 medium and many small, as a model with its optimizer holds;
``large``: 16 large matrices), float32 and bfloat16, it times the machine's limits (fsynced plain write, also with
the device asked to write every 8 MiB as the save's writer does; cold and warm sequential read, memcpy), MindSpore's
own save/load, this project's save (each label's thread count checked against the data files written), async
save (first call and steady, the commit timed and its thread named) and load, the cost of every protection
(``bench_protections.py``: checksums on/off for save, paired; the commit; the save lease; fsync; verify on/off
and the header check for load; replica checks), the one-line ``hyper_parallel.load_checkpoint`` (path alone
and into a net, against ``mindspore.load_checkpoint``: ``bench_one_line.py``), a resharded load on msrun ranks
(``bench_reshard_worker.py``) and the extra memory of a load, and ``hp-ckpt import`` of a 4-rank MindSpore
checkpoint against ``transform_checkpoints`` on the same files
(``bench_ms_import.py``, also runnable alone with ``--size``). This VM returns freed memory to its host, so every
timed run is preceded by touching ``--pretouch-gb`` GiB of fresh memory."""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import mindspore as ms
import numpy as np
import psutil

import bench_cold_load
import bench_ms_import
import bench_one_line
import bench_protections
import hyper_parallel.core.distributed_checkpoint as dcp
from hyper_parallel.core.distributed_checkpoint import _async_engine
from hyper_parallel.core.distributed_checkpoint._copy_threads import Copier
from hyper_parallel.core.distributed_checkpoint._stage_copies import ALIGN
from hyper_parallel.core.distributed_checkpoint._plan_cache import clear_plan_cache
from hyper_parallel.platform import tensor as host_views

__all__ = ["STATES", "build_state", "drop_page_cache", "main", "pretouch", "read_io_bytes"]

GIB = 1 << 30
CHUNK = 64 << 20
SCRIPTS = Path(__file__).resolve().parent


# ----------------------------------------------------------------- helpers (also used by the worker)

def pretouch(gib: float) -> None:
    """Allocate and touch ``gib`` GiB, then free it (makes the VM hand memory back first)."""
    if gib > 0:
        block = np.ones(int(gib * GIB), dtype=np.uint8)
        del block


def drop_page_cache(paths: list[Path]) -> str:
    """Evict ``paths`` from the page cache; return the method used.

    ``posix_fadvise(DONTNEED)`` after ``fsync`` drops clean pages without
    root; as root ``/proc/sys/vm/drop_caches`` is written too.
    """
    for path in paths:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as handle:
            handle.write("1")
        return "posix_fadvise+drop_caches"
    except OSError:
        return "posix_fadvise"


def read_io_bytes() -> int:
    """Bytes this process caused to be fetched from storage (``/proc/self/io`` read_bytes)."""
    with open("/proc/self/io", encoding="ascii") as handle:
        fields = dict(line.split(": ") for line in handle.read().splitlines())
    return int(fields["read_bytes"])


def warm_cache(paths: list[Path]) -> None:
    """Read ``paths`` once so that they are in the page cache."""
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while handle.read(CHUNK):
                pass


def data_files(directory: Path) -> list[Path]:
    """The safetensors data files of a checkpoint directory."""
    return sorted(directory.glob("*.safetensors"))


def timed(fn: Callable[[], Any], *, runs: int, pretouch_gb: float,
          setup: Callable[[], Any] | None = None) -> list[float]:
    """Run ``setup`` (untimed), pretouch, then time ``fn``; ``runs`` times. Returns seconds."""
    times = []
    for _ in range(runs):
        if setup is not None:
            setup()
        pretouch(pretouch_gb)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def remove(path: Path) -> None:
    """Delete a file or directory if present (between runs, outside the timing)."""
    shutil.rmtree(path, ignore_errors=True)  # a directory
    path.unlink(missing_ok=True)  # a file


#: The states ``--state`` chooses from.
STATES = ("many", "large")


def build_state(size_bytes: int, seed: int = 0, kind: str = "many") -> dict[str, Any]:
    """A dict of named Parameters of about ``size_bytes``.

    ``many``: 80 % in four large matrices (4096 columns), 18 % in 48 medium
    matrices (1024 columns), 2 % (at least 200) small vectors. ``large``: 16
    matrices of 4096 columns. float32 and bfloat16 alternate.
    """
    rng = np.random.default_rng(seed)
    specs = []
    shares = ((16, "layer{}_weight", 4096, 1.0),) if kind == "large" else (
        (4, "layer{}_weight", 4096, 0.8), (48, "block{}_proj", 1024, 0.18))
    for count, name, cols, share in shares:
        for i in range(count):
            rows = max(1, int(size_bytes * share / count) // (cols * (2 if i % 2 else 4)))
            specs.append((name.format(i), (rows, cols), i % 2))
    small = 0 if kind == "large" else max(200, int(size_bytes * 0.02) // (4096 * 3))
    specs += [(f"norm{i}_bias", (4096,), i % 2) for i in range(small)]
    state = {}
    for name, shape, is_bf16 in specs:
        values = rng.random(shape, dtype=np.float32)
        tensor = ms.Tensor(values, ms.bfloat16) if is_bf16 else ms.Tensor(values)
        state[name] = ms.Parameter(tensor, name=name)
    return state


# ----------------------------------------------------------------- phases

def phase_baseline(work: Path, nbytes: int, args: argparse.Namespace) -> tuple[dict[str, list[float]], str]:
    """Plain single-stream fsynced write, cold and warm sequential read of ``nbytes``."""
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.ones(nbytes, dtype=np.uint8)
    path, method = work / "plain.bin", ""

    def write() -> None:
        with open(path, "wb", buffering=0) as handle:
            for start in range(0, nbytes, CHUNK):
                handle.write(memoryview(source)[start:start + CHUNK])
            os.fsync(handle.fileno())

    def read() -> None:
        with open(path, "rb", buffering=0) as handle:
            for start in range(0, nbytes, CHUNK):
                handle.readinto(memoryview(target)[start:start + CHUNK])

    def cold_setup() -> None:
        nonlocal method
        method = drop_page_cache([path])

    times = {"plain write+fsync": timed(write, runs=args.runs, pretouch_gb=args.pretouch_gb,
                                            setup=lambda: remove(path))}
    # The same bytes with the device asked to write every 8 MiB (as the save's writer does): this disk's real floor.
    times["plain write+fsync, early writeback"] = timed(
        bench_protections.plain_write_early_writeback(path, source, nbytes), runs=args.runs,
        pretouch_gb=args.pretouch_gb, setup=lambda: remove(path))
    times["cold sequential read"] = timed(read, runs=args.runs, pretouch_gb=args.pretouch_gb, setup=cold_setup)
    times["warm sequential read"] = timed(read, runs=args.warm_runs, pretouch_gb=args.pretouch_gb)
    floor_read, floor_verified = bench_protections.verified_read_floor(path, target, threads=args.threads)
    times[f"warm read floor ({args.threads} threads)"] = timed(floor_read, runs=args.warm_runs,
                                                               pretouch_gb=args.pretouch_gb)
    times[f"warm verified read floor ({args.threads} threads)"] = timed(floor_verified, runs=args.warm_runs,
                                                                        pretouch_gb=args.pretouch_gb)
    if not np.array_equal(source[:CHUNK], target[:CHUNK]):
        raise RuntimeError("baseline read returned other bytes than written")
    remove(path)
    return times, method


def phase_memcpy(nbytes: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Host memcpy of ``nbytes`` into a pre-touched buffer, and into memory allocated for it (page faults too)."""
    source = np.ones(nbytes, dtype=np.uint8)
    target = np.ones(nbytes, dtype=np.uint8)  # np.zeros would leave the pages untouched
    times = {"host memcpy": timed(lambda: np.copyto(target, source), runs=args.warm_runs,
                                  pretouch_gb=args.pretouch_gb)}
    del source, target
    times.update(bench_one_line.phase_memcpy_new(nbytes, warm_runs=args.warm_runs,
                                                 before_each=lambda: pretouch(args.pretouch_gb)))
    return times


def phase_mindspore(state: dict[str, Any], work: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """``mindspore.save_checkpoint`` (+ an fsync, which it does not do) and load + load_param_into_net (cold).

    MindSpore's safetensors load maps the file: its pages are read on first
    access, so the timed load touches one byte of every page of every Parameter.
    Each load goes into a fresh net of Parameters in their own memory: the
    previous run's Parameters live in the file mapping, and no eviction drops
    the pages of a mapped file (the cold runs were warm).
    """
    path = work / "ms.safetensors"
    params = list(state.values())
    nets: list[Any] = []
    save_only: list[float] = []

    def fresh_net() -> None:
        nets.clear()
        gc.collect()  # the last run's Parameters, and with them the mapping
        net = ms.nn.Cell()
        for param in params:
            net.insert_param_to_cell(param.name, ms.Parameter(
                ms.Tensor(np.zeros(param.shape, np.float32), param.dtype), name=param.name))
        nets.append(net)
        drop_page_cache([path])

    def save() -> None:
        start = time.perf_counter()
        ms.save_checkpoint(params, str(path), format="safetensors")
        save_only.append(time.perf_counter() - start)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())

    def load() -> None:
        not_loaded, _ = ms.load_param_into_net(nets[0], ms.load_checkpoint(str(path), format="safetensors"))
        if not_loaded:
            raise RuntimeError(f"mindspore did not load {not_loaded[:5]}")
        for param in nets[0].get_parameters():  # the load maps the file lazily: touch every page so it is read
            param.asnumpy().reshape(-1).view(np.uint8)[::4096].max()

    times = {"ms.save_checkpoint+fsync": timed(save, runs=args.runs, pretouch_gb=args.pretouch_gb,
                                               setup=lambda: remove(path))}
    times["ms.save_checkpoint (no fsync)"] = save_only
    times.update(bench_one_line.phase_ms_load_checkpoint(
        path, runs=args.runs, warm_runs=args.warm_runs, before_each=lambda: pretouch(args.pretouch_gb),
        warm=lambda: warm_cache([path]), cold=lambda: drop_page_cache([path])))
    times["ms.load+load_param_into_net cold (pages touched)"] = timed(
        load, runs=args.runs, pretouch_gb=args.pretouch_gb, setup=fresh_net)
    nets.clear()
    gc.collect()
    path.unlink()
    return times


def phase_save(state: dict[str, Any], work: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """``dcp.save`` with fsync, every protection on: ``FileSystemWriter(thread_count=1)`` (one file, one
    thread) and ``thread_count=T``; the default writer (``None``) picks 2 from 64 MiB on. The first save of
    a layout plans it; later saves of the same layout reuse the plan (timed: the runs after the first)."""
    path = work / "save"
    times = {}
    for threads in (1, args.threads):
        def save(threads: int = threads) -> None:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads), no_dist=True)

        label = f"dcp.save (thread_count={threads})"
        times[label] = timed(save, runs=args.runs, pretouch_gb=args.pretouch_gb, setup=lambda: remove(path))
        check_files(label, path, threads)
    times["dcp.save (thread_count=1, no fsync)"] = timed(
        lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=1, sync_files=False),
                         no_dist=True), runs=args.runs, pretouch_gb=args.pretouch_gb, setup=lambda: remove(path))
    remove(path)
    return times


def check_files(label: str, path: Path, threads: int) -> None:
    """The label says ``threads`` files and threads: make sure the save wrote that many data files."""
    found = len(data_files(path))
    if found != threads:
        raise RuntimeError(f"'{label}' wrote {found} data files, not {threads}: the label does not match the run")


def phase_checksums(state: dict[str, Any], args: argparse.Namespace) -> dict[str, list[float]]:
    """The checksum protection alone: xxh3 of every Parameter's bytes as the writer stores them, one thread."""
    from hyper_parallel.core.distributed_checkpoint._format.checksum import chunk_checksum  # noqa: PLC0415
    from hyper_parallel.platform.dtypes import DTYPE_NAMES, dtype_name  # noqa: PLC0415

    arrays = [(param.asnumpy(), DTYPE_NAMES[dtype_name(param)]) for param in state.values()]

    def hash_all() -> None:
        for array, itemsize in arrays:
            chunk_checksum(memoryview(array.reshape(-1).view(np.uint8)), sizes=array.shape, itemsize=itemsize)

    return {"xxh3 checksums of the state (1 thread)": timed(hash_all, runs=args.runs, pretouch_gb=0)}


def phase_replica_check(state: dict[str, Any], args: argparse.Namespace) -> dict[str, list[float]]:
    """The replica-divergence protection: one rank's local plan in a job of 2 ranks where every tensor is a
    replica (the worst case: each holder hashes all its bytes), ``check_replicas`` on and off."""
    times = {}
    for check in (True, False):
        def plan(check: bool = check) -> None:
            planner = dcp.StandardSavePlanner(check_replicas=check)
            planner.configure_planner(state, rank=0, world_size=2, is_coordinator=True)
            planner.build_local_plan()

        times[f"local plan, 2 ranks all replicated, check_replicas={check}"] = timed(plan, runs=args.runs,
                                                                                    pretouch_gb=0)
    return times


def phase_async(state: dict[str, Any], work: Path, args: argparse.Namespace,
                notes: dict[str, str]) -> dict[str, list[float]]:
    """Time ``dcp.async_save`` until it returns (first call of the process, then steady state), the
    background writing until ``done()``, and ``result()`` called after that (what remains on the caller:
    the commit, if it is not already done in the background), and the commit itself (``writer.finish``),
    noting in ``notes`` the thread it ran on (``MainThread``: inside ``result()``).

    Every staging mode: ``copy`` (the default, labels without a suffix: reused host buffers, mapped on the first
    call), ``auto`` (a first call of one rank forks, and its background work faults in the arena the next calls
    copy into; with the filesystem writer itself, since a subclass is never forked for) and ``fork`` (copy-on-write
    child writer). Right after each call returns, one byte of every page of every source tensor is written (its
    value unchanged), as the next training step would: after a fork, each such page is copied at a page fault
    while the child lives, a cost the call's own time does not show.
    """
    path = work / "async"
    out: dict[str, list[float]] = {}
    pages = _page_writers(state)
    for staging in ("copy", "auto", "fork"):
        # A first call plans from nothing and maps a fresh staging arena, as the first save of a job does,
        # even when the sync saves of this run (same layout) left a cached plan and an arena behind.
        _async_engine._POOL.release()  # pylint: disable=protected-access
        clear_plan_cache()
        blocking: list[float] = []
        background: list[float] = []
        result: list[float] = []
        commit: list[float] = []
        first_write: list[float] = []
        caller_cpu: list[float] = []
        threads: set[str] = set()
        for _ in range(1 + args.runs):
            remove(path)
            pretouch(args.pretouch_gb)
            if staging == "auto":  # "auto" forks only for the filesystem writer itself (not a timing subclass)
                writer = dcp.FileSystemWriter(path, thread_count=args.threads)
            else:
                writer = bench_protections.TimedWriter(path, thread_count=args.threads)
            cpu = time.thread_time()
            start = time.perf_counter()
            handle = dcp.async_save(state, storage_writer=writer, no_dist=True, staging=staging)
            returned = time.perf_counter()
            caller_cpu.append(time.thread_time() - cpu)
            blocking.append(returned - start)
            pages()
            first_write.append(time.perf_counter() - returned)
            while not handle.done():
                time.sleep(0.0005)
            background.append(time.perf_counter() - returned)
            start = time.perf_counter()
            handle.result()
            result.append(time.perf_counter() - start)
            commit += getattr(writer, "commit_seconds", [])
            threads.update(getattr(writer, "commit_threads", []))
        suffix = "" if staging == "copy" else f", {staging}"
        if commit:  # the commit ran in this process (a fork child's commit is inside "background")
            out[f"dcp.async_save commit (writer.finish){suffix}"] = commit
        notes[f"async commit thread{suffix}"] = ", ".join(sorted(threads)) or "not in this process"
        out[f"dcp.async_save blocking{suffix}, first call"] = blocking[:1]
        out[f"dcp.async_save blocking{suffix}, steady"] = blocking[1:]
        out[f"dcp.async_save background until done(){suffix}"] = background
        out[f"dcp.async_save result() after done(){suffix}"] = result
        out[f"dcp.async_save first write to every page after the call{suffix}, first call"] = first_write[:1]
        out[f"dcp.async_save first write to every page after the call{suffix}, steady"] = first_write[1:]
        out[f"dcp.async_save blocking{suffix}, steady, caller's CPU"] = caller_cpu[1:]
        if staging == "copy":
            out["staging copy floor (staging threads alone, the state into the arena)"] = staging_copy_floor(
                state, args)
    # A job's first save after prepare_async_save (CheckpointCallback calls it at train begin): its buffers are
    # mapped and faulted in beforehand, the plan is not cached yet, and no tensor's host memory has been looked up
    # by the library yet (the saves above did: their numpy views are forgotten, as in a new job).
    prepared: list[float] = []
    for _ in range(args.runs):
        _async_engine._POOL.release()  # pylint: disable=protected-access
        clear_plan_cache()
        host_views._VIEWS.clear()  # pylint: disable=protected-access
        remove(path)
        dcp.prepare_async_save(state).result()
        pretouch(args.pretouch_gb)
        start = time.perf_counter()
        handle = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=args.threads),
                                no_dist=True)
        prepared.append(time.perf_counter() - start)
        handle.result()
    out["dcp.async_save blocking, first call after prepare_async_save"] = prepared
    remove(path)
    return out


def staging_copy_floor(state: dict[str, Any], args: argparse.Namespace) -> list[float]:
    """The blocking part's floor: every tensor of ``state`` copied into the staging arena (as placed by a save,
    64-byte aligned) by the library's staging threads (:class:`._copy_threads.Copier`), with no planning,
    layout pass or Python per tensor on the calling thread. Run right after copying async saves (their arena)."""
    arena = _async_engine.staging_pool()._arena  # pylint: disable=protected-access
    pairs, offset = [], 0
    for value in state.values():
        if not hasattr(value, "asnumpy"):
            continue
        source = np.ascontiguousarray(value.asnumpy()).reshape(-1).view(np.uint8)
        if arena is None or offset + source.size > arena.size:
            return []
        pairs.append((arena[offset:offset + source.size], source))
        offset += -(-source.size // ALIGN) * ALIGN

    def copy() -> None:
        copier = Copier(caller_share=False)
        for target, source in pairs:
            copier.add(target, source)
        copier.release_small()
        copier.finish()

    return timed(copy, runs=args.runs, pretouch_gb=args.pretouch_gb)


def _page_writers(state: dict[str, Any]) -> Callable[[], None]:
    """A function writing one byte of every page of every tensor of ``state`` (values unchanged)."""
    views = [np.asarray(value.asnumpy()).reshape(-1).view(np.uint8) for value in state.values()
             if hasattr(value, "asnumpy")]

    def write_pages() -> None:
        for view in views:
            view[::4096] += 0

    return write_pages


def save_for_load(state: dict[str, Any], work: Path, threads: int) -> Path:
    """Save the checkpoint the load phases read (``threads`` data files, so ``threads`` readers work),
    then check untimed that a load restores two zeroed tensors in place."""
    path = work / "load_ckpt"
    remove(path)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads), no_dist=True)
    expected = {name: state[name].asnumpy().copy() for name in (next(iter(state)), list(state)[-1])}
    for name in expected:
        state[name].asnumpy()[...] = 0
    dcp.load(state, storage_reader=dcp.FileSystemReader(path, thread_count=threads), no_dist=True)
    for name, values in expected.items():
        if not np.array_equal(state[name].asnumpy().view(np.uint8), values.view(np.uint8)):
            raise RuntimeError(f"dcp.load did not restore '{name}' in place")
    return path


def _device_read_bytes() -> int:
    """Bytes this process caused the storage devices to read (``/proc/self/io``; readahead included)."""
    with open("/proc/self/io", encoding="ascii") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("read_bytes"))


def phase_load(state: dict[str, Any], path: Path, args: argparse.Namespace,
               notes: dict[str, str]) -> dict[str, list[float]]:
    """``dcp.load`` into the existing Parameters, warm and cold cache, verification on and off.

    Verify on and off alternate run by run (paired: the machine's load drifts alike for both); the
    process CPU time of each run is recorded too (labels ending in ", CPU"). Each run's device
    reads over the data files' size go into ``notes``: for a cold load above 1.00, pages the verify
    pass read were evicted before the read pass (this VM's memory reclaim can do that); for a warm
    load above 0.00, the run was not warm (the pretouch before it evicted cached pages), and its
    time is a partly cold load's.
    """
    files = data_files(path)
    file_bytes = sum(f.stat().st_size for f in files)
    times: dict[str, list[float]] = {}
    streams = f"cold read of the data files ({args.threads} streams)"
    for cache, setup in (("warm", lambda: warm_cache(files)), ("cold", lambda: drop_page_cache(files))):
        device: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.warm_runs if cache == "warm" else args.runs):
            if cache == "cold":  # the device with as many streams as the reader (paired with the loads)
                buffer = np.ones(file_bytes, dtype=np.uint8)
                times.setdefault(streams, []).extend(timed(
                    lambda: bench_cold_load.read_streams(files, buffer, args.threads), runs=1,
                    pretouch_gb=args.pretouch_gb, setup=setup))
                del buffer
            for verify in (True, False):
                label = f"dcp.load {cache}, verify {'on' if verify else 'off'} ({args.threads} threads)"
                reader = bench_cold_load.TimedReader(path, verify_checksums=verify, thread_count=args.threads)
                setup()
                pretouch(args.pretouch_gb)
                before = _device_read_bytes()
                cpu, start = time.process_time(), time.perf_counter()
                dcp.load(state, storage_reader=reader, no_dist=True)
                end = time.perf_counter()
                times.setdefault(label, []).append(end - start)
                times.setdefault(label + ", CPU", []).append(time.process_time() - cpu)
                device[verify].append((_device_read_bytes() - before) / file_bytes)
                for part, seconds in reader.parts(start, end).items() if cache == "cold" else ():
                    times.setdefault(f"{label}: {part}", []).append(seconds)  # where a cold load's time goes
        for verify, ratios_seen in device.items():
            label = f"dcp.load {cache}, verify {'on' if verify else 'off'} ({args.threads} threads)"
            notes[f"device bytes / file bytes, {label}"] = " ".join(f"{d:.2f}" for d in ratios_seen)
    return times


def phase_small_load(state: dict[str, Any], work: Path, args: argparse.Namespace) -> tuple[dict[str, list[float]], int]:
    """Warm ``dcp.load`` of the state's small Parameters (its vectors) alone, saved on their own: their bytes
    are a few MiB, so the time per tensor is the per-tensor cost of a load. Verify on and off alternate run by
    run (paired: the machine's load drifts alike for both); the process CPU time of each run is recorded too
    (labels ending in ", CPU"). Returns the times and the count."""
    small = {name: param for name, param in state.items() if len(param.shape) == 1}
    if not small:
        return {}, 0
    path = work / "small_ckpt"
    remove(path)
    dcp.save(small, storage_writer=dcp.FileSystemWriter(path, thread_count=args.threads), no_dist=True)
    files = data_files(path)
    times: dict[str, list[float]] = {}
    for _ in range(args.warm_runs):
        for verify in (True, False):
            label = (f"dcp.load warm, small Parameters alone, verify {'on' if verify else 'off'} "
                     f"({args.threads} threads)")
            reader = dcp.FileSystemReader(path, verify_checksums=verify, thread_count=args.threads)
            warm_cache(files)
            pretouch(args.pretouch_gb)
            cpu, start = time.process_time(), time.perf_counter()
            dcp.load(small, storage_reader=reader, no_dist=True)
            times.setdefault(label, []).append(time.perf_counter() - start)
            times.setdefault(label + ", CPU", []).append(time.process_time() - cpu)
        cpu = time.thread_time()  # the metadata decode alone (every load starts with it; one thread)
        dcp.read_metadata(path)
        times.setdefault("read_metadata, small Parameters alone, CPU", []).append(time.thread_time() - cpu)
    remove(path)
    return times, len(small)


def _proc_status(field: str) -> int:
    """A byte figure of ``/proc/self/status`` (VmRSS, VmHWM)."""
    with open("/proc/self/status", encoding="ascii") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field + ":"))


def peak_extra_rss(fn: Callable[[], Any]) -> tuple[int, str]:
    """Run ``fn``; return its peak RSS above the RSS before it (a lower bound where the allocator reuses memory
    it holds) and the method: VmHWM reset through ``/proc/self/clear_refs`` if allowed, VmRSS sampled every 1 ms."""
    base = _proc_status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")  # resets VmHWM to the current RSS
        method = "VmHWM reset by clear_refs"
    except OSError:
        method = "VmRSS sampled every 1 ms"
    peak, stop = [base], threading.Event()

    def sample() -> None:
        while not stop.wait(0.001):
            peak[0] = max(peak[0], _proc_status("VmRSS"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        stop.set()
        sampler.join()
    if method.startswith("VmHWM"):
        peak[0] = max(peak[0], _proc_status("VmHWM"))
    return peak[0] - base, method


def phase_memory(state: dict[str, Any], path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Extra RSS of a cold ``dcp.load`` (untimed) against the reader's in-flight bound (default and 16 MiB)."""
    result: dict[str, Any] = {}
    default = dcp.FileSystemReader(path).max_inflight_bytes
    for verify, inflight in ((True, default), (True, 16 << 20), (False, default)):
        reader = dcp.FileSystemReader(path, verify_checksums=verify, thread_count=args.threads,
                                      max_inflight_bytes=inflight)
        drop_page_cache(data_files(path))
        extra, method = peak_extra_rss(lambda r=reader: dcp.load(state, storage_reader=r, no_dist=True))
        label = f"verify {'on' if verify else 'off'}, max_inflight_bytes {inflight >> 20} MiB x {args.threads} threads"
        result[label] = {"extra_bytes": extra, "bound_bytes": inflight * args.threads, "method": method}
    return result


def phase_reshard(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``bench_reshard_worker.py`` on ``--ranks`` msrun processes; return its JSON."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_dir, out = work / "msrun_logs", work / "reshard.json"
    cmd = [shutil.which("msrun") or "msrun", f"--worker_num={args.ranks}", f"--local_worker_num={args.ranks}",
           "--master_addr=127.0.0.1", f"--master_port={port}", f"--log_dir={log_dir}", "--join=True",
           f"--tail_worker_log={args.ranks}", str(SCRIPTS / "bench_reshard_worker.py"),
           "--dir", str(work / "reshard_ckpt"), "--out", str(out), "--size-gb", str(args.size_gb),
           "--runs", str(args.runs), "--pretouch-gb", str(args.pretouch_gb)]
    env = {**os.environ, "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ["PATH"]))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SCRIPTS.parent), env.get("PYTHONPATH", "")) if p)
    with open(work / "msrun_console.log", "wb") as console:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=console, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=args.msrun_timeout)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(proc.pid).children(recursive=True):  # workers may have own sessions
                child.kill()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "timeout"
    remove(work / "reshard_ckpt")
    if code != 0 or not out.exists():
        tails = [f"--- {p.name} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
                 for p in [*sorted(log_dir.glob("worker_*.log")), work / "msrun_console.log"] if p.exists()]
        raise RuntimeError(f"msrun reshard run failed ({code}):\n" + "\n".join(tails))
    return json.loads(out.read_text())


def profile(label: str, fn: Callable[[], Any]) -> str:
    """Run ``fn`` under cProfile; return its top 10 entries by cumulative and by own time."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    parts = [f"--- cProfile: {label} ---"]
    for key in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(10)
        rows = [r for r in text.getvalue().split("\n\n", 1)[-1].splitlines()[2:] if r.strip()]  # no "Ordered by"
        parts.append(f"top 10 by {key}:\n" + "\n".join(row.replace(str(SCRIPTS.parent) + "/", "") for row in rows))
    return "\n".join(parts)


def phase_profile(state: dict[str, Any], work: Path, path: Path) -> list[str]:
    """cProfile a save, an async save's blocking part and a cold and a warm load, each with 1 I/O thread
    (cProfile sees only the calling thread)."""
    target = work / "profile_ckpt"
    texts = [profile("dcp.save (thread_count=1)", lambda: dcp.save(
        state, storage_writer=dcp.FileSystemWriter(target, thread_count=1), no_dist=True))]
    remove(target)
    handles = []
    texts.append(profile("dcp.async_save blocking part, steady state (thread_count=1)", lambda: handles.append(
        dcp.async_save(state, storage_writer=dcp.FileSystemWriter(target, thread_count=1), no_dist=True))))
    handles[0].result()
    remove(target)
    drop_page_cache(data_files(path))
    texts.append(profile("dcp.load cold, verify on (1 thread)", lambda: dcp.load(
        state, storage_reader=dcp.FileSystemReader(path, thread_count=1), no_dist=True)))
    warm_cache(data_files(path))
    texts.append(profile("dcp.load warm, verify off (1 thread)", lambda: dcp.load(
        state, storage_reader=dcp.FileSystemReader(path, verify_checksums=False, thread_count=1), no_dist=True)))
    return texts


def ratios(t: dict[str, float], args: argparse.Namespace, memory: dict[str, Any], small_count: int = 0
           ) -> list[tuple[str, float, str, bool | None]]:
    """One state's contract ratios: (figure, value, target text, met or None when there is no target).

    ``small_count``: the small Parameters loaded alone (per-tensor cost figures; 0: none).
    """
    T = args.threads
    out: list[tuple[str, float, str, bool | None]] = []

    def add(name: str, value: float, limit: float | None, op: str = "<=") -> None:
        met = None if limit is None else (value <= limit if op == "<=" else value < limit)
        out.append((name, value, "" if limit is None else f"{op} {limit:g}", met))

    saves = [f"dcp.save (thread_count={n})" for n in dict.fromkeys((1, T))]
    for label in saves:
        add(f"{label} / plain write", t[label] / t["plain write+fsync"], 1.0)
    best_save = min(t[label] for label in saves)
    add("best dcp.save / plain write", best_save / t["plain write+fsync"], 1.0)
    add("best dcp.save / ms.save_checkpoint+fsync", best_save / t["ms.save_checkpoint+fsync"], 1.0, "<")
    add("best dcp.save / ms.save_checkpoint (no fsync)", best_save / t["ms.save_checkpoint (no fsync)"], None)
    add("best dcp.save / plain write with early writeback", best_save / t["plain write+fsync, early writeback"], None)
    add("plain write with early writeback / plain write", t["plain write+fsync, early writeback"]
        / t["plain write+fsync"], None)
    add(f"protection: checksums, save on / off (thread_count={T}, paired)",
        t[f"dcp.save (thread_count={T}), checksums on (paired)"]
        / t[f"dcp.save (thread_count={T}), checksums off (paired, benchmark-only patch)"], None)
    add(f"commit (writer.finish) / dcp.save (thread_count={T})",
        t[f"commit (writer.finish) of dcp.save (thread_count={T})"] / t[f"dcp.save (thread_count={T})"], None)
    add("protection: save lease take + release / best dcp.save", t["save lease take + release"] / best_save, None)
    add(f"protection: header check / warm load, verify off ({T} threads)",
        t[f"header check inside a warm load, verify off ({T} threads)"]
        / t[f"warm load with timed header check, verify off ({T} threads)"], None)
    add("protection: xxh3 checksums (1 thread) / best dcp.save",
        t["xxh3 checksums of the state (1 thread)"] / best_save, None)
    replica_cost = (t["local plan, 2 ranks all replicated, check_replicas=True"]
                    - t["local plan, 2 ranks all replicated, check_replicas=False"])
    add("protection: replica check (all bytes replicated) / best dcp.save", replica_cost / best_save, None)
    add("protection: fsync, save / save without fsync (1 thread)",
        t["dcp.save (thread_count=1)"] / t["dcp.save (thread_count=1, no fsync)"], None)
    add("async blocking (first call after prepare_async_save) / memcpy",
        t["dcp.async_save blocking, first call after prepare_async_save"] / t["host memcpy"], 1.0)
    # Where the blocking part's time goes: the copy alone, and the Python the caller's thread runs meanwhile.
    floor = t.get("staging copy floor (staging threads alone, the state into the arena)")
    if floor:
        add("staging copy floor / memcpy", floor / t["host memcpy"], None)
        add("async blocking (steady) / staging copy floor", t["dcp.async_save blocking, steady"] / floor, None)
    add("async blocking (steady), caller's CPU / memcpy",
        t["dcp.async_save blocking, steady, caller's CPU"] / t["host memcpy"], None)
    for mode in ("", ", auto", ", fork"):  # "": the default, staging="copy"
        for when in ("first call", "steady"):
            add(f"async{mode} blocking ({when}) / memcpy", t[f"dcp.async_save blocking{mode}, {when}"]
                / t["host memcpy"], 1.0)
        add(f"async{mode} result() after done() / memcpy", t[f"dcp.async_save result() after done(){mode}"]
            / t["host memcpy"], None)
        for when in ("first call", "steady"):  # the page faults a fork moves into training
            add(f"async{mode} first write to every page after the call ({when}) / memcpy",
                t[f"dcp.async_save first write to every page after the call{mode}, {when}"] / t["host memcpy"], None)
        add(f"async{mode} background until done() / best dcp.save",
            t[f"dcp.async_save background until done(){mode}"] / best_save, None)
        if f"dcp.async_save commit (writer.finish){mode}" in t:
            add(f"async{mode} commit (writer.finish) / best dcp.save",
                t[f"dcp.async_save commit (writer.finish){mode}"] / best_save, None)
    for verify in ("on", "off"):  # the order of the figures: cold, then warm
        add(f"cold load / cold read, verify {verify}",
            t[f"dcp.load cold, verify {verify} ({T} threads)"] / t["cold sequential read"], 1.2)
    # The device with the reader's streams, and where a cold verified load's time goes (parts / cold read).
    streams = f"cold read of the data files ({T} streams)"
    add(f"cold read, {T} streams / cold sequential read", t[streams] / t["cold sequential read"], None)
    add(f"cold load, verify on / cold read, {T} streams", t[f"dcp.load cold, verify on ({T} threads)"] / t[streams],
        None)
    for part in bench_cold_load.PARTS:
        add(f"cold load, verify on: {part} / cold sequential read",
            t[f"dcp.load cold, verify on ({T} threads): {part}"] / t["cold sequential read"], None)
    for verify in ("on", "off"):
        add(f"warm load / memcpy, verify {verify}",
            t[f"dcp.load warm, verify {verify} ({T} threads)"] / t["host memcpy"], 1.5)
    # This machine's floor for a warm load (page-cache reads; with verify-before-land, a hash pass first).
    add(f"warm read floor ({T} threads) / memcpy", t[f"warm read floor ({T} threads)"] / t["host memcpy"], None)
    add(f"warm verified read floor ({T} threads) / memcpy",
        t[f"warm verified read floor ({T} threads)"] / t["host memcpy"], None)
    for verify, floor in (("on", "warm verified read floor"), ("off", "warm read floor")):
        add(f"warm load, verify {verify} / its floor", t[f"dcp.load warm, verify {verify} ({T} threads)"]
            / t[f"{floor} ({T} threads)"], None)
    for verify in ("on", "off") if small_count else ():  # time per tensor of a load of small tensors alone
        add(f"warm load, small Parameters alone, verify {verify}: us per tensor",
            t[f"dcp.load warm, small Parameters alone, verify {verify} ({T} threads)"] / small_count * 1e6, None)
        add(f"warm load, small Parameters alone, verify {verify}: CPU us per tensor",
            t[f"dcp.load warm, small Parameters alone, verify {verify} ({T} threads), CPU"] / small_count * 1e6, None)
    if small_count:  # the metadata decode's share of it (issue 12: <= 2.5 us per tensor)
        add("read_metadata, small Parameters alone: CPU us per tensor",
            t["read_metadata, small Parameters alone, CPU"] / small_count * 1e6, 2.5)
    if small_count:  # what verify-before-land adds per tensor (paired runs)
        add("warm load, small Parameters alone: verify's own CPU us per tensor (on - off)",
            (t[f"dcp.load warm, small Parameters alone, verify on ({T} threads), CPU"]
             - t[f"dcp.load warm, small Parameters alone, verify off ({T} threads), CPU"]) / small_count * 1e6, 8.0)
    for cache in ("cold", "warm"):  # the price of verify-before-a-byte-lands (no target written before all checks)
        add(f"protection: verify, {cache} load on / off", t[f"dcp.load {cache}, verify on ({T} threads)"]
            / t[f"dcp.load {cache}, verify off ({T} threads)"], None)
    add("protection: verify, warm load on / off, CPU time (paired)",
        t[f"dcp.load warm, verify on ({T} threads), CPU"] / t[f"dcp.load warm, verify off ({T} threads), CPU"], None)
    for name, value, limit in bench_one_line.load_checkpoint_ratios(t):
        add(name, value, limit)
    for name, mem in memory.items():
        add(f"load extra memory / bound, {name.split(',')[0]}, {mem['bound_bytes'] >> 20} MiB",
            mem["extra_bytes"] / mem["bound_bytes"], 1.0)
    return out


def reshard_ratios(reshard: dict[str, Any]) -> list[tuple[str, float, str, bool | None]]:
    """Device and reader bytes over needed bytes of the resharded load, worst rank."""
    out = []
    for verify in ("on", "off"):
        for counter in ("reader bytes_read", "/proc read_bytes"):
            worst = max(r[f"verify {verify}"][counter] / r["needed_bytes"] for r in reshard["ranks"])
            out.append((f"reshard {counter.split('_')[0]} / needed, verify {verify}, worst rank", worst, "<= 1.05",
                        worst <= 1.05))
        slowest = max(r[f"verify {verify}"]["median_s"] for r in reshard["ranks"])
        out.append((f"reshard load seconds, verify {verify}, slowest rank", slowest, "", None))
        if all("alone median_s" in r[f"verify {verify}"] for r in reshard["ranks"]):
            slowest = max(r[f"verify {verify}"]["alone median_s"] for r in reshard["ranks"])
            out.append((f"reshard load seconds alone, verify {verify}, slowest rank", slowest, "", None))
    knobs = [k for k in reshard["ranks"][0] if k.startswith("verify on, ") and "max_inflight_bytes" in k]
    for setting in knobs:  # "2x max_inflight_bytes" and the worker's --inflight-mb
        if all(setting in r for r in reshard["ranks"]):
            worst = max(r[setting]["/proc read_bytes"] / r["needed_bytes"] for r in reshard["ranks"])
            out.append((f"reshard /proc read / needed, {setting}, worst rank", worst, "<= 1.05 (knob)",
                        worst <= 1.05))
    if all("verify on, alone extra RSS" in r for r in reshard["ranks"]):
        worst = max(r["verify on, alone extra RSS"]["extra_bytes"] / r["private_budget_bytes"]
                    for r in reshard["ranks"])
        out.append(("reshard load extra memory / private budget, verify on, worst rank", worst, "<= 1", worst <= 1))
    if all("async_result_s" in r for r in reshard["ranks"]):
        out.append((f"async result() ms after done(), {len(reshard['ranks'])} ranks, small state, slowest rank",
                    max(r["async_result_s"] for r in reshard["ranks"]) * 1e3, "", None))
    return out


def print_times(title: str, times: dict[str, list[float]], nbytes: int) -> None:
    """Print one state's timing table."""
    print(f"\n{title}\n{'phase':<52} {'median s':>9} {'GB/s':>7}  runs (s)")
    for name, runs in times.items():
        med = statistics.median(runs)
        rate = f"{nbytes / med / 1e9:>7.2f}" if med > 0 else f"{'-':>7}"
        print(f"{name:<52} {med:>9.3f} {rate}  {' '.join(f'{r:.3f}' for r in runs)}")


def print_reshard(reshard: dict[str, Any]) -> None:
    """Print the per-rank figures of the resharded load."""
    print(f"\nresharded load on {len(reshard['ranks'])} ranks, {reshard['description']}")
    print(f"{'rank':<5} {'verify':<7} {'needed MiB':>10} {'reader MiB':>10} {'/proc MiB':>10} {'median s':>9}")
    for r in reshard["ranks"]:
        for verify in ("on", "off"):
            fig = r[f"verify {verify}"]
            print(f"{r['rank']:<5} {verify:<7} {r['needed_bytes'] / 2**20:>10.1f} "
                  f"{fig['reader bytes_read'] / 2**20:>10.1f} {fig['/proc read_bytes'] / 2**20:>10.1f} "
                  f"{fig['median_s']:>9.3f}")
    for r in reshard["ranks"]:
        if "narrow_needed_bytes" in r:
            excess = max(0, r["narrow_needed_bytes"] - r["private_budget_bytes"])
            memory = r.get("verify on, alone extra RSS", {}).get("extra_bytes", 0)
            print(f"rank {r['rank']}: narrow bytes needed {r['narrow_needed_bytes'] / 2**20:.1f} MiB, private budget "
                  f"{r['private_budget_bytes'] / 2**20:.0f} MiB (thread_count x max_inflight_bytes): verified load "
                  f">= {1 + excess / r['needed_bytes']:.3f} x needed; extra RSS {memory / 2**20:.1f} MiB")


def print_ratios(title: str, table: list[tuple[str, float, str, bool | None]]) -> None:
    """Print a ratio table."""
    print(f"\n{title}\n{'ratio':<64} {'value':>7}  {'target':<7} result")
    for name, value, target, met in table:
        print(f"{name:<64} {value:>7.3f}  {target:<7} {'' if met is None else 'ok' if met else 'MISS'}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.0, help="state size in GiB (default 1)")
    parser.add_argument("--storage", choices=("disk", "s3"), default="disk",
                        help="disk (default): every phase below; s3: the object storage figures of bench_s3.py "
                             "against a local moto S3 server (--size-gb, --threads, --runs apply)")
    parser.add_argument("--state", nargs="+", choices=STATES, default=list(STATES),
                        help="states to measure (default: many large)")
    parser.add_argument("--ranks", type=int, default=2, help="msrun processes of the reshard phase (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="writer/reader thread_count T (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per figure; medians reported (default 3)")
    parser.add_argument("--warm-runs", type=int, default=5,
                        help="timed runs of the warm (page-cache) figures, their floors and memcpy: they take "
                             "about 0.1 s each and swing with this VM's memory reclaim (default 5)")
    parser.add_argument("--pretouch-gb", type=float, default=3.0, help="GiB touched before each timed run")
    parser.add_argument("--out", type=Path, default=None, help="working directory (default: new one under /tmp)")
    parser.add_argument("--json", type=Path, default=None, help="JSON result path (default OUT/benchmark.json)")
    parser.add_argument("--skip-msrun", action="store_true", help="skip the resharded load on msrun")
    parser.add_argument("--skip-ms-import", action="store_true",
                        help="skip hp-ckpt import of a 4-rank MindSpore checkpoint vs transform_checkpoints")
    parser.add_argument("--profile", action="store_true", help="print cProfile top 10 of a save and a load")
    parser.add_argument("--msrun-timeout", type=float, default=300.0, help="seconds before msrun is killed")
    return parser.parse_args(argv)


def run_state(kind: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every single-process phase on one state; returns its times, ratios, memory and profiles."""
    state = build_state(int(args.size_gb * GIB), kind=kind)
    nbytes = sum(param.asnumpy().nbytes for param in state.values())
    print(f"state '{kind}': {len(state)} Parameters, {nbytes / GIB:.3f} GiB", flush=True)
    times, cold_method = phase_baseline(work, nbytes, args)
    times.update(phase_memcpy(nbytes, args))
    times.update(phase_save(state, work, args))
    times.update(phase_checksums(state, args))
    times.update(phase_replica_check(state, args))
    notes: dict[str, str] = {}
    times.update(phase_async(state, work, args, notes))
    load_path = save_for_load(state, work, args.threads)
    check_files("checkpoint of the load phases", load_path, args.threads)
    times.update(phase_load(state, load_path, args, notes))
    small_times, small_count = phase_small_load(state, work, args)
    times.update(small_times)
    times.update(bench_protections.phase_protections(
        state, work, load_path, threads=args.threads, runs=args.runs, before_each=lambda: pretouch(args.pretouch_gb),
        remove=remove, warm=lambda: warm_cache(data_files(load_path))))
    memory = phase_memory(state, load_path, args)
    times.update(bench_one_line.phase_load_checkpoint(
        state, load_path, runs=args.runs, warm_runs=args.warm_runs, before_each=lambda: pretouch(args.pretouch_gb),
        warm=lambda: warm_cache(data_files(load_path)), cold=lambda: drop_page_cache(data_files(load_path))))
    profiles = phase_profile(state, work, load_path) if args.profile else []
    remove(load_path)
    times.update(phase_mindspore(state, work, args))
    medians = {name: statistics.median(runs) for name, runs in times.items()}
    table = ratios(medians, args, memory, small_count)
    return {"tensors": len(state), "small_tensors_loaded_alone": small_count, "state_bytes": nbytes,
            "cold_cache_method": cold_method, "times_s": times,
            "median_s": medians, "memory": memory, "profiles": profiles, "notes": notes,
            "ratios": [{"figure": n, "value": v, "target": tg, "met": m} for n, v, tg, m in table]}


def main(argv: list[str] | None = None) -> None:
    """Build each state, run every phase, print and write the results."""
    args = parse_args(argv)
    ms.set_device("CPU")
    if args.storage == "s3":
        import bench_s3  # pylint: disable=import-outside-toplevel

        result = bench_s3.measure(args.size_gb, threads=args.threads, runs=args.runs)
        print(bench_s3.report(result))
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=2))
        return
    work = args.out or Path(tempfile.mkdtemp(prefix="hp_bench_", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work dir {work}; {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}; pretouch "
          f"{args.pretouch_gb} GiB before each of {args.runs} runs ({args.warm_runs} for warm figures)", flush=True)
    started = time.perf_counter()
    states = {kind: run_state(kind, work, args) for kind in args.state}
    reshard = None if args.skip_msrun else phase_reshard(work, args)
    ms_import = None if args.skip_ms_import else bench_ms_import.measure(work / "ms_import", args.size_gb, args.runs)
    print(f"total {time.perf_counter() - started:.0f} s; load average now {os.getloadavg()[0]:.1f} "
          f"(other processes on these {os.cpu_count()} cpus disturb the figures)")
    for kind, figures in states.items():
        print(f"\n===== state '{kind}': {figures['tensors']} Parameters, {figures['state_bytes'] / GIB:.3f} GiB; "
              f"cold cache by {figures['cold_cache_method']}")
        print_times("times", figures["times_s"], figures["state_bytes"])
        for name, mem in figures["memory"].items():
            print(f"load extra memory, {name}: {mem['extra_bytes'] / 2**20:.1f} MiB ({mem['method']})")
        for name, note in figures["notes"].items():
            print(f"{name}: {note}")
        print_ratios(f"ratios, state '{kind}'", [(r["figure"], r["value"], r["target"], r["met"])
                                                 for r in figures["ratios"]])
        for text in figures["profiles"]:
            print("\n" + text)
    reshard_table = []
    if reshard is not None:
        print_reshard(reshard)
        reshard_table = reshard_ratios(reshard)
        print_ratios("ratios, resharded load", reshard_table)
    if ms_import is not None:
        print("\n" + bench_ms_import.report(ms_import))
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "load_average_at_end": os.getloadavg(), "states": states, "reshard": reshard, "ms_import": ms_import,
              "reshard_ratios": [{"figure": n, "value": v, "target": tg, "met": m} for n, v, tg, m in reshard_table]}
    json_path = args.json or work / "benchmark.json"
    json_path.write_text(json.dumps(result, indent=2))
    print(f"\nJSON written to {json_path}")


if __name__ == "__main__":
    main()
