"""Exact resume for :class:`.CheckpointCallback`: the steps per epoch saved with every step, and the data position.

Every step the callback saves holds ``Model.train``'s steps per epoch under
:data:`STEPS_PER_EPOCH_KEY`. ``CheckpointCallback.resume_dataset`` positions
the dataset just after the step a resume loads and keeps a
:class:`DataPosition`; when training begins the callback checks that
``Model.train`` iterates that dataset as positioned (same object, same steps
per epoch, the epoch it was positioned in), and without a position warns when
the resumed run's data will not be the uninterrupted run's. All ranks call
these; no MindSpore import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.distributed_checkpoint.api import read_metadata
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager

__all__ = [
    "DataPosition",
    "STEPS_PER_EPOCH_KEY",
    "check_steps_per_epoch",
    "saved_steps_per_epoch",
    "warn_unpositioned",
]

_LOG = logging.getLogger(__name__)
#: The value saved with every step: ``Model.train``'s steps per epoch (``batch_num``).
STEPS_PER_EPOCH_KEY = "hyper_parallel.steps_per_epoch"


@dataclass(frozen=True, eq=False)
class DataPosition:
    """Where ``CheckpointCallback.resume_dataset`` put a dataset: just after ``step`` of ``source``."""

    step: int
    steps_per_epoch: int
    dataset: Any
    source: CheckpointManager

    def check_training(self, cb_params: Any, steps_per_epoch: int) -> None:
        """Refuse a ``Model.train`` (``cb_params``, counting ``steps_per_epoch``) that does not iterate the
        dataset as positioned. All ranks, when training begins."""
        if getattr(cb_params, "train_dataset", None) is not self.dataset:
            raise CheckpointValueError(
                "Model.train got another dataset object than the one resume_dataset positioned after step "
                f"{self.step}: pass the same object to both (a dataset built again starts at its first batch)"
            )
        if steps_per_epoch != self.steps_per_epoch:
            raise CheckpointValueError(
                f"Model.train counts {steps_per_epoch} steps per epoch (sink_size) but the dataset "
                f"resume_dataset positioned after step {self.step} has "
                f"{self.steps_per_epoch} batches: pass sink_size=-1 for an exact resume"
            )
        if getattr(cb_params, "dataset_sink_mode", False) and self.step % self.steps_per_epoch:
            raise CheckpointValueError(
                f"step {self.step} was saved inside an epoch ({self.step % self.steps_per_epoch} of "
                f"{self.steps_per_epoch} batches), and dataset sink mode resumes only at epoch ends "
                "(MindSpore rounds the dataset back to the epoch's start): train with dataset_sink_mode=False"
            )

    def check_epoch(self, epoch: int) -> None:
        """Refuse a first epoch other than the one the dataset was positioned in. All ranks."""
        expected = self.step // self.steps_per_epoch + 1
        if epoch != expected:
            raise CheckpointValueError(
                f"Model.train begins at epoch {epoch}, but resume_dataset positioned the dataset after step "
                f"{self.step}, in epoch {expected}: pass initial_epoch={expected - 1} (the value "
                "resume_dataset returned) to Model.train"
            )


def saved_steps_per_epoch(manager: CheckpointManager, step: int) -> int | None:
    """The steps per epoch ``step`` of ``manager`` was saved with (``None`` before the value existed). All
    ranks (a load)."""
    if STEPS_PER_EPOCH_KEY not in read_metadata(manager.directory(step)).state_dict_metadata:
        return None
    saved = {STEPS_PER_EPOCH_KEY: 0}
    manager.load(saved, step=step)
    return int(saved[STEPS_PER_EPOCH_KEY])


def check_steps_per_epoch(manager: CheckpointManager, step: int, saved: int | None, steps_per_epoch: int,
                          source: str) -> None:
    """Refuse ``steps_per_epoch`` (what ``source`` says) if ``step`` was ``saved`` with another number
    (``None``: not known)."""
    if saved is not None and saved != steps_per_epoch:
        raise CheckpointValueError(
            f"step {step} in {manager.directory(step)} was saved with {saved} steps per epoch, but "
            f"{source} is {steps_per_epoch}: its data position (epoch {step // saved + 1}, "
            f"{step % saved} batches in) does not exist in this dataset. Resume with the saving run's "
            f"dataset, batch size and number of shards ({saved} steps per epoch), or load the weights "
            "yourself (CheckpointManager.load) and train in a new directory"
        )


def warn_unpositioned(latest: int, cb_params: Any, steps_per_epoch: int) -> None:
    """Warn when the data of a run resumed at ``latest`` without ``resume_dataset`` will not be the
    uninterrupted run's."""
    dataset = getattr(cb_params, "train_dataset", None)
    if steps_per_epoch and latest % steps_per_epoch:
        reason = (f"inside epoch {latest // steps_per_epoch + 1} of {steps_per_epoch} steps: Model.train restarts "
                  "that epoch's data from its start")
    elif latest and dataset is not None and dataset.get_init_step() == 0 and dataset.is_shuffled():
        reason = "the dataset is shuffled: Model.train restarts it in its first epoch's order"
    else:
        return
    _LOG.warning(
        "resumed from step %d, %s; pass initial_epoch=callback.resume_dataset(dataset) to Model.train for an "
        "exact replay", latest, reason,
    )
