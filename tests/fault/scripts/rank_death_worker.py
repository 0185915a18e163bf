"""msrun worker: one rank is SIGKILLed inside a collective save or load; the others must not hang.

Usage: ``rank_death_worker.py SHARED_DIR MODE PHASE VICTIM``. ``MODE`` is
``kill`` (the victim SIGKILLs itself: ``msrun`` sees the process exit and ends
the job) or ``hang`` (the victim stops answering for the timeout plus 8 s,
then dies: what a lost host or a rank stuck in I/O looks like to the others;
the survivors' collective timeout must fire). ``PHASE`` is one of
``planning`` (the victim dies before its local plan), ``writing`` (inside
its data write), ``commit`` (the coordinator, inside the commit, before the
metadata is written) and ``load`` (inside its reads). Every rank first saves
checkpoint A together (a sharded tensor plus replicated values, so every
rank writes data), then starts saving B (or loading A) and the victim kills
itself at the chosen point. Each survivor writes ``rank<r>.json`` to
SHARED_DIR: the error class chain, message and the seconds it waited, then
leaves with ``os._exit`` (its abandoned gather thread is still blocked).
The pytest side sets ``HP_CKPT_COLLECTIVE_TIMEOUT``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from worker_lib import init_worker

RANK, WORLD = init_worker()

import mindspore as ms  # noqa: E402  (after init_worker, which sets the device)

import hyper_parallel.core.distributed_checkpoint as dcp  # noqa: E402
from hyper_parallel import DTensor, Layout  # noqa: E402
from hyper_parallel.core.distributed_checkpoint.filesystem_reader import FileSystemReader  # noqa: E402
from hyper_parallel.core.distributed_checkpoint.filesystem_writer import FileSystemWriter  # noqa: E402
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardSavePlanner  # noqa: E402

SHARED, MODE, PHASE, VICTIM = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
LAYOUT = Layout((WORLD,), (0, -1))


def full(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((8 * WORLD, 16)).astype(np.float32),
            **{f"r{i}": rng.standard_normal(256) for i in range(2 * WORLD)}}


def state(seed: int) -> dict:
    values = full(seed)
    out: dict = {"w": DTensor.from_global(ms.Tensor(values.pop("w")), LAYOUT, rank=RANK), "step": seed}
    out.update(values)
    return out


def die_in(owner: type, name: str) -> None:
    original = getattr(owner, name)

    def dying(*args, **kwargs):
        if MODE == "hang":
            time.sleep(float(os.environ["HP_CKPT_COLLECTIVE_TIMEOUT"]) + 8)
        (SHARED / "killed.json").write_text(json.dumps({"rank": RANK, "at": time.time()}))
        os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)  # pragma: no cover - never reached

    setattr(owner, name, dying)


dcp.save(state(1), checkpoint_id=SHARED / "A")
if RANK == VICTIM:
    target = {"planning": (StandardSavePlanner, "build_local_plan"), "writing": (FileSystemWriter, "write_data"),
              "commit": (FileSystemWriter, "finish"), "load": (FileSystemReader, "read_data")}[PHASE]
    die_in(*target)
outcome: dict = {"rank": RANK}
start = time.monotonic()
try:
    if PHASE == "load":
        local = ms.Parameter(ms.Tensor(np.zeros((8, 16), np.float32)), name="w")
        blank = {"w": DTensor(local, LAYOUT, (8 * WORLD, 16)), "step": None,
                 **{f"r{i}": np.zeros(256) for i in range(2 * WORLD)}}
        dcp.load(blank, checkpoint_id=SHARED / "A")
    else:
        dcp.save(state(2), checkpoint_id=SHARED / "B")
    outcome["error"] = None
except BaseException as exc:  # pylint: disable=broad-except
    outcome.update(classes=[c.__name__ for c in type(exc).__mro__], message=str(exc))
outcome["waited"] = time.monotonic() - start
(SHARED / f"rank{RANK}.json").write_text(json.dumps(outcome))
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # pylint: disable=protected-access
