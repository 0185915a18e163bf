"""The one-line MindSpore-style load, ``hyper_parallel.load_checkpoint``, against the machine and MindSpore.

``scripts/benchmark.py`` runs these on each state (they are not run alone):

- :func:`phase_load_checkpoint`: ``hyper_parallel.load_checkpoint(path)`` (the
  full values, returned as new Parameters, as ``mindspore.load_checkpoint``
  returns them) and ``hyper_parallel.load_checkpoint(path, net)`` (into the
  net's own Parameters, in place), warm and cold cache, the two forms
  alternating run by run; each run's process CPU time too (labels ending in
  ``", CPU"``). Every protection is on (checksums verified).
- :func:`phase_ms_load_checkpoint`: ``mindspore.load_checkpoint`` of the same
  state saved by ``mindspore.save_checkpoint`` (safetensors), warm and cold.
  It maps the file and reads its pages on first access, so the timed call
  touches one byte of every page of every returned Parameter; the returned
  Parameters are collected after each run (their mapping outlives the call
  until then, and no eviction drops the pages of a mapped file).
- :func:`load_checkpoint_ratios`: the figures: each form over the machine's
  limits (cold sequential read; memcpy, and for the path form, which fills
  new memory, a memcpy into new memory too) and over MindSpore's load.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any, Callable

import mindspore as ms
import numpy as np

import hyper_parallel

__all__ = [
    "MEMCPY_NEW",
    "phase_load_checkpoint",
    "phase_memcpy_new",
    "phase_ms_load_checkpoint",
    "load_checkpoint_ratios",
]

#: The label of a host memcpy into freshly allocated memory (the floor of a load that returns new tensors).
MEMCPY_NEW = "host memcpy into new memory"
_PATH = "hyper_parallel.load_checkpoint(path)"
_NET = "hyper_parallel.load_checkpoint(path, net)"
_MS_NET = "ms.load+load_param_into_net cold (pages touched)"


def _ms_label(cache: str) -> str:
    return f"ms.load_checkpoint {cache} (pages touched)"


def _net_of(state: dict[str, Any]) -> Any:
    """A Cell holding the state's Parameters under their names (as a MindSpore script's network does)."""
    net = ms.nn.Cell()
    for name, param in state.items():
        net.insert_param_to_cell(name, param)
    return net


def _check(state: dict[str, Any], path: Path, net: Any) -> None:
    """Untimed: the path form returns every Parameter's values; the net form restores two zeroed ones in place."""
    loaded = hyper_parallel.load_checkpoint(str(path))
    missing = [name for name in state if name not in loaded]
    if missing:
        raise RuntimeError(f"hyper_parallel.load_checkpoint(path) did not return {missing[:5]}")
    names = (next(iter(state)), list(state)[-1])
    for name in names:
        if not np.array_equal(loaded[name].asnumpy().view(np.uint8), state[name].asnumpy().view(np.uint8)):
            raise RuntimeError(f"hyper_parallel.load_checkpoint(path) returned other values for '{name}'")
    expected = {name: state[name].asnumpy().copy() for name in names}
    for name in names:
        state[name].asnumpy()[...] = 0
    returned = hyper_parallel.load_checkpoint(str(path), net)
    for name, values in expected.items():
        if returned[name] is not state[name] or not np.array_equal(state[name].asnumpy().view(np.uint8),
                                                                    values.view(np.uint8)):
            raise RuntimeError(f"hyper_parallel.load_checkpoint(path, net) did not restore '{name}' in place")


def phase_load_checkpoint(state: dict[str, Any], path: Path, *, runs: int, warm_runs: int,
                          before_each: Callable[[], None], warm: Callable[[], None],
                          cold: Callable[[], None]) -> dict[str, list[float]]:
    """Time both forms of ``hyper_parallel.load_checkpoint`` on checkpoint ``path`` of ``state``, warm and cold.

    Args:
        state: The Parameters ``path`` holds (the net form loads into them).
        path: A checkpoint of ``state``.
        runs: Cold runs of each form.
        warm_runs: Warm runs of each form.
        before_each: Called right before each timed run (the pretouch).
        warm: Puts the data files in the page cache.
        cold: Evicts them.
    """
    net = _net_of(state)
    _check(state, path, net)
    forms: dict[str, Callable[[], Any]] = {
        _PATH: lambda: hyper_parallel.load_checkpoint(str(path)),
        _NET: lambda: hyper_parallel.load_checkpoint(str(path), net),
    }
    times: dict[str, list[float]] = {}
    for cache, setup, count in (("warm", warm, warm_runs), ("cold", cold, runs)):
        for _ in range(count):
            for form, load in forms.items():  # alternating: the machine's drift touches both alike
                setup()
                before_each()
                cpu, start = time.process_time(), time.perf_counter()
                loaded = load()
                times.setdefault(f"{form} {cache}", []).append(time.perf_counter() - start)
                times.setdefault(f"{form} {cache}, CPU", []).append(time.process_time() - cpu)
                del loaded  # the path form's Parameters: freed before the next run
                gc.collect()  # (a MindSpore Parameter sits in a reference cycle: only the collector frees it, and
                # left to run inside the next timed load it charged that load with freeing 1 GiB: net form, large
                # state, median 0.138 s against 0.101 s with the collection here, 5 runs each)
    return times


def phase_memcpy_new(nbytes: int, *, warm_runs: int, before_each: Callable[[], None]) -> dict[str, list[float]]:
    """Host memcpy of ``nbytes`` into memory allocated for it (its page faults included)."""
    source = np.ones(nbytes, dtype=np.uint8)
    seconds = []
    for _ in range(warm_runs):
        before_each()
        start = time.perf_counter()
        target = np.empty_like(source)
        np.copyto(target, source)
        seconds.append(time.perf_counter() - start)
        del target
    return {MEMCPY_NEW: seconds}


def phase_ms_load_checkpoint(path: Path, *, runs: int, warm_runs: int, before_each: Callable[[], None],
                             warm: Callable[[], None], cold: Callable[[], None]) -> dict[str, list[float]]:
    """Time ``mindspore.load_checkpoint`` of ``path`` (a safetensors file), warm and cold, every page touched."""

    def load() -> None:
        loaded = ms.load_checkpoint(str(path), format="safetensors")
        for param in loaded.values():  # the load maps the file lazily: touch every page so that it is read
            param.asnumpy().reshape(-1).view(np.uint8)[::4096].max()

    times: dict[str, list[float]] = {}
    for cache, setup, count in (("warm", warm, warm_runs), ("cold", cold, runs)):
        for _ in range(count):
            setup()
            before_each()
            start = time.perf_counter()
            load()
            times.setdefault(_ms_label(cache), []).append(time.perf_counter() - start)
            gc.collect()  # unmaps the file: the next cold run's eviction then drops its pages
    return times


def load_checkpoint_ratios(t: dict[str, float]) -> list[tuple[str, float, float | None]]:
    """The figures of ``hyper_parallel.load_checkpoint``: (name, value, target or ``None``) from median times.

    The net form loads into existing tensors: the contract's load targets
    (cold <= 1.2x a cold sequential read, warm <= 1.5x a memcpy) apply. The
    path form fills new memory (as ``mindspore.load_checkpoint`` returns new
    Parameters): reported against the same limits and a memcpy into new
    memory, without a target.
    """
    out: list[tuple[str, float, float | None]] = []
    for form, target_cold, target_warm in ((_NET, 1.2, 1.5), (_PATH, None, None)):
        out.append((f"{form} cold / cold read", t[f"{form} cold"] / t["cold sequential read"], target_cold))
        out.append((f"{form} warm / memcpy", t[f"{form} warm"] / t["host memcpy"], target_warm))
    out.append((f"{_PATH} warm / {MEMCPY_NEW}", t[f"{_PATH} warm"] / t[MEMCPY_NEW], None))
    for cache in ("cold", "warm"):
        out.append((f"{_PATH} {cache} / ms.load_checkpoint {cache}", t[f"{_PATH} {cache}"] / t[_ms_label(cache)],
                    None))
    out.append((f"{_NET} cold / ms.load+load_param_into_net cold", t[f"{_NET} cold"] / t[_MS_NET], None))
    return out
