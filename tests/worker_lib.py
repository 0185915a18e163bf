"""Worker-side helpers for scripts launched by :func:`msrun_harness.run_workers`.

A worker script calls :func:`init_worker`, does its work and hands one
picklable result to :func:`report` (or lets :func:`run_scenarios` do both, so
many checks share one launch). Results land in ``$HP_TEST_RESULT_DIR`` as
``rank_{rank}.pkl``, where the pytest side collects them.

Importing this module in a worker (``MS_ROLE=MS_WORKER``) installs an
exception hook: a script that dies of an uncaught exception reports
``{FAILURE_KEY: True, "error": ..., "traceback": ...}`` for its rank, so the
pytest side can show that traceback first. Reported objects are plain
builtins (dicts, strings) so that unpickling never needs this module.

:func:`sliced_rows` builds the small network of Parameters marked sliced that
several workers save and load with a strategy file.

Collective scenarios must fail symmetrically: a scenario that raises on one
rank before a collective the other ranks enter makes those ranks wait until
the harness timeout.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import tempfile
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Mapping

__all__ = [
    "FAILURE_KEY",
    "RESULT_DIR_ENV",
    "init_worker",
    "report",
    "run_scenarios",
    "scenario_tmp_dir",
    "sliced_rows",
]

RESULT_DIR_ENV = "HP_TEST_RESULT_DIR"
FAILURE_KEY = "__worker_failure__"

_rank: int | None = None


def init_worker() -> tuple[int, int]:
    """Initialise MindSpore communication on CPU (mccl backend).

    Returns:
        ``(rank, world_size)`` of this process.
    """
    global _rank  # pylint: disable=global-statement
    import mindspore  # pylint: disable=import-outside-toplevel
    from mindspore.communication import get_group_size, get_rank, init  # pylint: disable=import-outside-toplevel

    mindspore.set_device("CPU")
    init()  # the msrun scheduler process never returns from here
    _rank = int(get_rank())
    return _rank, int(get_group_size())


def _current_rank() -> int:
    """Return the rank from :func:`init_worker`, else msrun's ``RANK_ID``."""
    return _rank if _rank is not None else int(os.environ.get("RANK_ID", "0"))


def _result_dir() -> Path:
    """Return ``$HP_TEST_RESULT_DIR`` (raises ``KeyError`` outside the harness)."""
    return Path(os.environ[RESULT_DIR_ENV])


def report(result: Any) -> None:
    """Write this rank's result atomically to ``$HP_TEST_RESULT_DIR/rank_{rank}.pkl``.

    Args:
        result: Any picklable object; a later call replaces an earlier one.
    """
    out_dir = _result_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = pickle.dumps(result)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".rank_", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        os.replace(tmp, out_dir / f"rank_{_current_rank()}.pkl")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_scenarios(scenarios: Mapping[str, Callable[[], Any]]) -> dict[str, dict[str, Any]]:
    """Run every scenario in order, catch each failure, then :func:`report` all.

    Args:
        scenarios: Name to zero-argument callable; every rank passes the same
            names in the same order.

    Returns:
        ``{name: {"ok", "value", "error", "traceback"}}``, also reported. A
        value that cannot be pickled turns its scenario into a failure.
    """
    results: dict[str, dict[str, Any]] = {}
    for name, func in scenarios.items():
        print(f"[run_scenarios] rank {_current_rank()}: {name} ...", flush=True)
        try:
            value = func()
            pickle.dumps(value)
            entry = {"ok": True, "value": value, "error": "", "traceback": ""}
        except Exception as exc:  # pylint: disable=broad-exception-caught
            entry = {
                "ok": False,
                "value": None,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        print(f"[run_scenarios] rank {_current_rank()}: {name} {'ok' if entry['ok'] else entry['error']}", flush=True)
        results[name] = entry
    report(results)
    return results


def scenario_tmp_dir(name: str) -> Path:
    """Return a directory shared by all ranks: ``$HP_TEST_RESULT_DIR/../shared/<name>``.

    Every rank may call it; creation uses ``exist_ok``.
    """
    path = _result_dir().parent / "shared" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def sliced_rows(w: Any, b: Any) -> Any:
    """A ``mindspore.nn.Cell`` computing ``x @ w.T + b`` from this rank's slices ``w`` and ``b``.

    Its Parameters ``w`` and ``b`` (copies of the numpy arrays) are marked ``sliced``, as MindSpore's parallel
    compile marks a rank's slices, so a save or load with a strategy file takes their layouts from it. Call after
    :func:`init_worker`.
    """
    return _sliced_rows_class()(w, b)


@functools.cache
def _sliced_rows_class() -> type:
    """The Cell class of :func:`sliced_rows`, made once (MindSpore is imported only by :func:`init_worker`)."""
    import mindspore as ms  # pylint: disable=import-outside-toplevel

    class SlicedRows(ms.nn.Cell):
        """``x @ w.T + b`` for this rank's rows of ``w`` and ``b`` (sliced Parameters)."""

        def __init__(self, w: Any, b: Any) -> None:
            super().__init__()
            self.w = ms.Parameter(ms.Tensor(w.copy()), name="w")
            self.b = ms.Parameter(ms.Tensor(b.copy()), name="b")
            self.w.sliced = True
            self.b.sliced = True

        def construct(self, x):
            return ms.ops.matmul(x, self.w.T) + self.b

    return SlicedRows


def _report_uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """Exception hook: report the failure for this rank, then print as usual.

    Also drops ``rank_{rank}.crashed`` so the harness can stop the launch
    without waiting for the scheduler to notice the dead rank (~30 s).
    """
    try:
        report({
            FAILURE_KEY: True,
            "error": f"{exc_type.__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc_type, exc, tb)),
        })
        (_result_dir() / f"rank_{_current_rank()}.crashed").touch()
    finally:
        sys.__excepthook__(exc_type, exc, tb)


if os.environ.get("MS_ROLE") == "MS_WORKER" and RESULT_DIR_ENV in os.environ:
    sys.excepthook = _report_uncaught
