"""A process killed while retention deletes steps loses no record of the step it just saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from hyper_parallel.core.distributed_checkpoint import CheckpointManager

_CRASH_WHILE_DELETING = """
import os, sys
import numpy as np
from hyper_parallel.core.distributed_checkpoint import CheckpointManager
from hyper_parallel.core.distributed_checkpoint._step_dirs import StepDirectories

root = sys.argv[1]
manager = CheckpointManager(root, max_to_keep=2, best_fn=lambda m: m["acc"])
manager.save(1, {"w": np.full(3, 1, np.float32)}, metrics={"acc": 0.9})
manager.save(2, {"w": np.full(3, 2, np.float32)}, metrics={"acc": 0.1})
delete = StepDirectories.delete

def delete_then_die(self, step):  # the process is killed right after retention deleted a step
    delete(self, step)
    os._exit(17)

StepDirectories.delete = delete_then_die
manager.save(3, {"w": np.full(3, 3, np.float32)}, metrics={"acc": 0.95})
"""


def test_the_best_step_survives_a_crash_between_deletion_and_record(tmp_path: Path) -> None:
    """The record was written after the deletions: a crash between them lost step 3's metrics, so the next save
    ranked step 3 (the best) last and deleted it."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    child = subprocess.run([sys.executable, "-c", _CRASH_WHILE_DELETING, str(tmp_path)], env=env, timeout=300,
                           capture_output=True, text=True)
    assert child.returncode == 17, child.stderr
    record = json.loads((tmp_path / "manager.json").read_text())
    assert record["steps"]["3"]["metrics"] == {"acc": 0.95}
    manager = CheckpointManager(tmp_path, max_to_keep=2, best_fn=lambda m: m["acc"])
    manager.save(4, {"w": np.full(3, 4, np.float32)}, metrics={"acc": 0.2})
    assert manager.all_steps() == [1, 3, 4]  # 1 and 3 are the best two; 4 is the newest
    manager.save(5, {"w": np.full(3, 5, np.float32)}, metrics={"acc": 0.3})
    assert manager.all_steps() == [1, 3, 5]
    loaded = {"w": np.zeros(3, np.float32)}
    assert manager.load(loaded, step=3) == 3 and loaded["w"][0] == 3


_EXIT_WITHOUT_CLOSE = """
import sys
import numpy as np
from hyper_parallel.core.distributed_checkpoint import CheckpointManager

manager = CheckpointManager(sys.argv[1], async_save=True, max_to_keep=2, best_fn=lambda m: m["acc"])
for step, acc in ((1, 0.5), (2, 0.6), (3, 0.99)):
    manager.save(step, {"w": np.full(3, step, np.float32)}, metrics={"acc": acc})
# the script ends without manager.close(): step 3 commits as the process exits
"""


def test_the_best_step_committed_at_exit_keeps_its_metrics(tmp_path: Path) -> None:
    """Metrics were recorded only at retention, which never ran for a step committed at exit: the next run's
    best-k retention ranked step 3 (the best) last and deleted it."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(tmp_path)], env=env, timeout=300, check=True)
    manager = CheckpointManager(tmp_path, max_to_keep=2, best_fn=lambda m: m["acc"])
    assert manager.all_steps() == [1, 2, 3]
    manager.save(4, {"w": np.full(3, 4, np.float32)}, metrics={"acc": 0.1})
    assert manager.all_steps() == [2, 3, 4]  # the best two (3, 2) and the newest


_EXIT_WITHOUT_CLOSE_KEPT = """
import sys
import numpy as np
from hyper_parallel.core.distributed_checkpoint import CheckpointManager

manager = CheckpointManager(sys.argv[1], async_save=True, max_to_keep=1, keep_time_interval_seconds=3600,
                            keep_every_n_steps=int(sys.argv[2]))
manager.save(int(sys.argv[3]), {"w": np.full(3, 1, np.float32)})
# the script ends without manager.close(): the step commits as the process exits
"""


def test_a_step_committed_at_exit_keeps_its_keep_forever_promise(tmp_path: Path) -> None:
    """keep_time_interval_seconds promises the first step (and one per interval) forever, keep_every_n_steps its
    multiples; the promise was recorded only at retention, which never ran for a step committed at exit: the next
    run's retention (max_to_keep=1) deleted it. Now it is recorded when the save starts."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    for root, every, step in ((tmp_path / "time", 1000, 1), (tmp_path / "every", 5, 5)):
        subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE_KEPT, str(root), str(every), str(step)],
                       env=env, timeout=300, check=True)
        record = json.loads((root / "manager.json").read_text())
        assert record["steps"][str(step)]["keep_forever"] is True and record["steps"][str(step)]["metrics"] is None
        manager = CheckpointManager(root, max_to_keep=1)  # a new run, without the promising policy
        manager.save(step + 1, {"w": np.full(3, 2, np.float32)})
        manager.save(step + 2, {"w": np.full(3, 3, np.float32)})
        assert manager.all_steps() == [step, step + 2], root.name

