"""``CheckpointCallback``: sharded, async checkpoints for ``mindspore.train.Model.train``.

The knobs are those of MindSpore's ``CheckpointConfig`` / ``ModelCheckpoint``;
the steps are saved by a :class:`CheckpointManager` under ``directory``
(``step_<n:08d>`` directories, the manager's retention). What is saved is the
train network of ``Model`` (the network and its optimizer, each Parameter
once, under MindSpore's names, as ``ModelCheckpoint`` saves them), plus the
``append_info`` values. Everything comes through the public
``run_context.original_args()`` fields (``train_network``, ``network``,
``optimizer``, ``cur_step_num``, ``batch_num``), never ``Model`` internals.

The step ``exception_save`` saves when training raises is kept apart, as
MindSpore keeps its ``_breakpoint`` files apart: it is
``<directory>/breakpoint_<n:08d>``, a step of a second manager
(:attr:`CheckpointCallback.breakpoint_manager`, step prefix ``breakpoint_``).
Its state may be a diverged one (NaN weights), so a resume loads the newest
regular step unless ``resume="breakpoint"`` asks for the exception step. Those
steps are handled in :mod:`._breakpoint_steps`.

Exact resume: every step is saved with ``Model.train``'s steps per epoch
(the value ``hyper_parallel.steps_per_epoch``). :meth:`CheckpointCallback.resume_dataset`
positions the dataset just after the newest committed step with
MindSpore's ``Dataset.set_init_step`` (a global step: the pipeline begins at
epoch ``step // steps_per_epoch`` with that epoch's shuffle order and skips
``step % steps_per_epoch`` batches of it), so a resumed run repeats an
uninterrupted one even after a save inside an epoch. Its checks are in
:mod:`._resume_position`.

This module imports MindSpore when it is imported (the class derives from
``mindspore.train.Callback``); ``hyper_parallel.CheckpointCallback`` loads it
on first use only.
"""

from __future__ import annotations

import inspect
import logging
import os
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any, Callable

from mindspore.dataset import config as dataset_config
from mindspore.train import Callback, RunContext

from hyper_parallel.core.distributed_checkpoint._breakpoint_steps import (
    RunningStep,
    breakpoint_manager,
    everyone_arrived,
    resume_point,
    save_breakpoint,
    trained_step,
)
from hyper_parallel.core.distributed_checkpoint._collectives import DistWrapper
from hyper_parallel.core.distributed_checkpoint._metadata_file import mindspore_files
from hyper_parallel.core.distributed_checkpoint._mindspore_sliced import LayoutSources, cells_in
from hyper_parallel.core.distributed_checkpoint._ms_keywords import (
    CALLBACK_INSTEAD,
    CALLBACK_POSITIONS,
    check_keywords,
    check_positional,
)
from hyper_parallel.core.distributed_checkpoint._one_line import mindspore_state_dict
from hyper_parallel.core.distributed_checkpoint.async_checkpoint import prepare_async_save
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError
from hyper_parallel.core.distributed_checkpoint.manager import CheckpointManager
from hyper_parallel.core.distributed_checkpoint._resume_position import (
    STEPS_PER_EPOCH_KEY,
    DataPosition,
    check_steps_per_epoch,
    saved_steps_per_epoch,
    warn_unpositioned,
)

__all__ = ["CheckpointCallback"]

_LOG = logging.getLogger(__name__)
_APPEND_NAMES = ("epoch_num", "step_num")
_RESUME_CHOICES = (True, False, "breakpoint")


def _agree(step: str, check: Callable[[], None]) -> None:
    """Run ``check`` on every rank; a failure on any rank is raised on all of them. All ranks."""
    DistWrapper(use_dist=True).agree(step, check)


def _non_negative(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _append_values(append_info: list[Any] | None) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Split MindSpore's ``append_info`` into the counters asked for and the constant values."""
    if append_info is None:
        return (), {}
    if not isinstance(append_info, list):
        raise CheckpointValueError(
            f"append_info must be a list (as in CheckpointConfig), got {type(append_info).__name__}")
    counters: list[str] = []
    values: dict[str, Any] = {}
    for element in append_info:
        if isinstance(element, str) and element in _APPEND_NAMES:
            counters.append(element)
        elif isinstance(element, dict) and not values and all(isinstance(k, str) for k in element):
            values = dict(element)
        else:
            raise CheckpointValueError(
                f"append_info element {element!r}: expected 'epoch_num', 'step_num' or one dict of str keys"
            )
    return tuple(counters), values


class CheckpointCallback(Callback):
    """Save ``Model.train``'s network and optimizer every few steps; resume from the newest step.

    Every rank of an ``msrun`` job passes the same callback arguments. With
    ``resume=True`` training begins by loading the newest committed step of
    ``directory`` into the network and the optimizer (resharded to this job's
    layout) and step numbers continue after it. A step ``exception_save``
    wrote is not loaded unless ``resume="breakpoint"`` asks for it. For a resumed run that
    repeats an uninterrupted one exactly, also from a save inside an epoch
    and with a shuffled dataset, position the data before training: pass
    ``initial_epoch=callback.resume_dataset(dataset)`` to ``Model.train``
    (see :meth:`resume_dataset`).
    (``initial_epoch=callback.initial_epoch(steps_per_epoch)`` alone restarts
    the data at the start of that epoch, in the first epoch's shuffle order:
    exact only for unshuffled data and saves at epoch ends.)

    Args:
        directory: The manager root holding one ``step_<n>`` checkpoint per saved step.
        save_checkpoint_steps: Save every this many steps (0: not by steps); in dataset sink mode the
            first step end past each multiple.
        save_checkpoint_seconds: Save when this many seconds passed since the
            last save; used only when ``save_checkpoint_steps`` is 0.
        keep_checkpoint_max: Keep the newest this many steps (0: see the next).
        keep_checkpoint_per_n_minutes: Used only when ``keep_checkpoint_max``
            is 0: keep the newest step plus one step per this many minutes.
            With both 0, only the newest step is kept (as MindSpore does).
        async_save: Return to training once the state is staged; writing and
            commit run in the background.
        exception_save: When training raises, save the last completed step
            before the exception propagates, apart from the regular steps: as
            ``<directory>/breakpoint_<n:08d>`` (:attr:`breakpoint_manager`, which
            keeps the newest ``keep_checkpoint_max`` of them, at least 1, and
            deletes those above the step it saves: a run this one resumed
            before left them). It deletes no regular step, and a resume does
            not load it unless asked. Only when every rank raised (each waits
            for the others at most ``HP_CKPT_BREAKPOINT_TIMEOUT`` seconds,
            default 60); otherwise nothing is saved and training's own error
            propagates after that wait.
        append_info: MindSpore's list: ``"epoch_num"`` / ``"step_num"`` store
            the current counters, one dict stores its (plain) values.
        resume: ``True``: load the newest committed regular step when training
            begins. ``"breakpoint"``: load the newest committed step of either
            kind, so the step ``exception_save`` wrote when it is newer than the
            newest regular one (its state may have diverged: NaN weights).
            ``False``: load nothing.
        strategy_file: MindSpore strategy file(s) describing how Parameters
            are sliced, passed to every save and load.
        *mindspore_positional: None taken: arguments after the directory, as
            ``ModelCheckpoint(prefix, directory, config)`` takes them, are refused naming each by
            ModelCheckpoint's parameter and saying what to do instead.
        **mindspore_keywords: None taken: a keyword of MindSpore's ``ModelCheckpoint`` /
            ``CheckpointConfig`` (``config``, ``prefix``, ``enc_key``, ...) is refused saying what to do
            instead (``config``: the keywords giving its settings).

    Attributes:
        manager: The :class:`CheckpointManager` of the regular steps (``step_<n:08d>``).
        breakpoint_manager: The :class:`CheckpointManager` of the steps ``exception_save``
            wrote (``breakpoint_<n:08d>``): ``breakpoint_manager.all_steps()`` lists them,
            ``breakpoint_manager.load(state, step=n)`` or ``load_checkpoint(breakpoint_manager.directory(n))``
            loads one.

    Raises:
        CheckpointValueError: ``directory`` None, a knob out of range, all four save/keep knobs 0, or ``resume`` not
            ``True``, ``False`` or ``"breakpoint"``; when training begins:
            ``resume=False`` on a directory holding newer steps, or a dataset
            not as :meth:`resume_dataset` prepared it.
        TypeError: A keyword it does not take or a second positional argument (one of MindSpore's
            ``ModelCheckpoint`` / ``CheckpointConfig`` says what to do instead).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *mindspore_positional: Any,
        save_checkpoint_steps: int = 1,
        save_checkpoint_seconds: int = 0,
        keep_checkpoint_max: int = 5,
        keep_checkpoint_per_n_minutes: int = 0,
        async_save: bool = True,
        exception_save: bool = False,
        append_info: list[Any] | None = None,
        resume: bool | str = True,
        strategy_file: Any = None,
        **mindspore_keywords: Any,
    ) -> None:
        taken = [name for name in inspect.signature(CheckpointCallback).parameters if not name.startswith("mindspore_")]
        if mindspore_positional:  # ModelCheckpoint(prefix, directory, config): named in that order
            check_positional("CheckpointCallback", ("directory",), (directory, *mindspore_positional),
                             CALLBACK_POSITIONS, taken, CALLBACK_INSTEAD, origin="mindspore.train.ModelCheckpoint")
        if mindspore_keywords:
            check_keywords("CheckpointCallback", mindspore_keywords, taken, CALLBACK_INSTEAD,
                           origin="mindspore.train.ModelCheckpoint / CheckpointConfig")
        if directory is None:
            raise CheckpointValueError(
                "CheckpointCallback() got directory=None: pass the directory its steps are saved under "
                "(ModelCheckpoint's directory=None means the current directory; name it: CheckpointCallback('.'))"
            )
        super().__init__()
        steps = _non_negative("save_checkpoint_steps", save_checkpoint_steps)
        seconds = _non_negative("save_checkpoint_seconds", save_checkpoint_seconds)
        keep_max = _non_negative("keep_checkpoint_max", keep_checkpoint_max)
        per_minutes = _non_negative("keep_checkpoint_per_n_minutes", keep_checkpoint_per_n_minutes)
        if not (steps or seconds or keep_max or per_minutes):
            raise CheckpointValueError(
                "save_checkpoint_steps, save_checkpoint_seconds, keep_checkpoint_max and "
                "keep_checkpoint_per_n_minutes are all 0; set at least one (as CheckpointConfig requires)"
            )
        self.save_checkpoint_steps = steps
        self.save_checkpoint_seconds = 0 if steps else seconds
        self.exception_save = bool(exception_save)
        if not any(resume is choice or (isinstance(choice, str) and resume == choice) for choice in _RESUME_CHOICES):
            raise CheckpointValueError(f"resume must be True, False or 'breakpoint', got {resume!r}")
        self.resume: bool | str = resume
        self._counters, self._append = _append_values(append_info)
        self.strategy_file = strategy_file
        self._io_kwargs: dict[str, Any] = {"strategy_file": strategy_file}
        self.manager = CheckpointManager(
            directory,
            max_to_keep=keep_max or 1,
            save_interval_steps=steps or None,
            save_interval_seconds=self.save_checkpoint_seconds or None,
            keep_time_interval_seconds=per_minutes * 60 if (per_minutes and not keep_max) else None,
            async_save=bool(async_save),
        )
        # Saved when training raises: a committed sync save before the exception propagates, never pruning a
        # regular step (its own prefix), never taken by a plain resume.
        self.breakpoint_manager = breakpoint_manager(directory, max_to_keep=keep_max or 1)
        self.resumed_step: int | None = None
        self._position: DataPosition | None = None  # set by resume_dataset, checked at train begin
        self._steps_per_epoch = 0  # Model.train's batch_num, saved with every step
        self._last_saved: int | None = None
        self._completed = 0
        self._epoch = 0
        self._running: RunningStep | None = None  # the step begun and not yet ended here (exception_save)
        self._state: dict[str, Any] | None = None
        self._staging: Future[int] | None = None  # the staging buffers being prepared (async saves)

    def initial_epoch(self, steps_per_epoch: int) -> int:
        """The ``initial_epoch`` for ``Model.train`` that resumes at the newest committed step. All ranks.

        The data is not positioned: ``Model.train`` begins the epoch at its
        start (see :meth:`resume_dataset` for an exact resume).

        Args:
            steps_per_epoch: ``Model.train``'s steps per epoch (the dataset's
                size, or ``sink_size``).

        Returns:
            ``latest_step // steps_per_epoch``; 0 without a committed step or with ``resume=False``.

        Raises:
            CheckpointValueError: The newest step was saved with another
                number of steps per epoch.
        """
        point = self._resume_point() if self.resume else None
        if point is None:
            return 0
        source, latest = point
        steps_per_epoch = max(1, int(steps_per_epoch))
        saved = saved_steps_per_epoch(source, latest)
        _agree("initial_epoch",
               lambda: check_steps_per_epoch(source, latest, saved, steps_per_epoch, "steps_per_epoch"))
        return latest // steps_per_epoch

    def _resume_point(self) -> tuple[CheckpointManager, int] | None:
        """The manager and step a resume loads (see :func:`._breakpoint_steps.resume_point`). All ranks."""
        return resume_point(self.manager, self.breakpoint_manager, resume=self.resume)

    def resume_dataset(self, dataset: Any) -> int:
        """Position ``dataset`` after the newest committed step; return ``initial_epoch``. All ranks.

        Call it before ``Model.train`` with the very dataset object you pass
        to it, and pass the returned epoch as ``initial_epoch``. It calls
        MindSpore's ``dataset.set_init_step(step)``: the pipeline then begins
        at epoch ``step // steps_per_epoch`` with that epoch's shuffle order
        (the same ``mindspore.dataset.config.set_seed`` as the saving run) and
        skips the batches the saved run had already trained, so the resumed
        run sees the batches the uninterrupted one would have seen. Its first
        epoch is that epoch's rest; step numbers continue after the step.
        Every rank positions its own shard. When training begins the callback
        loads exactly this step and checks that ``Model.train`` got this
        dataset, ``initial_epoch`` and steps per epoch (``sink_size=-1``).
        Nothing happens with ``resume=False`` or without a committed step.

        Args:
            dataset: The ``mindspore.dataset.Dataset`` for ``Model.train``
                (one batch per step: ``get_dataset_size()`` is the steps per epoch).

        Returns:
            The epoch to pass as ``initial_epoch`` (0 when nothing is resumed).

        Raises:
            CheckpointValueError: The newest step was saved with another number
                of steps per epoch than ``dataset`` has (other batch size,
                data or number of shards), or MindSpore's dataset debug mode
                is on (it ignores the initial step); on every rank when it
                holds on any.
        """
        self._position = None
        point = self._resume_point() if self.resume else None
        if point is None:
            return 0
        source, latest = point
        steps_per_epoch = int(dataset.get_dataset_size())
        saved = saved_steps_per_epoch(source, latest)

        def check() -> None:
            check_steps_per_epoch(source, latest, saved, steps_per_epoch, "the dataset's size (get_dataset_size())")
            if latest and dataset_config.get_debug_mode():
                raise CheckpointValueError(
                    f"cannot position the dataset after step {latest}: MindSpore's dataset debug mode ignores "
                    "set_init_step (the data would restart at its first batch); call "
                    "mindspore.dataset.config.set_debug_mode(False) before resume_dataset"
                )

        _agree("resume_dataset", check)  # a rank whose shard does not fit stops every rank here
        dataset.set_init_step(latest)
        self._position = DataPosition(latest, steps_per_epoch, dataset, source)
        return latest // steps_per_epoch

    def _state_of(self, cb_params: Any) -> dict[str, Any]:
        """The train network and the optimizer as ``{MindSpore name: Parameter}`` (each once)."""
        cells = {}
        train_network = getattr(cb_params, "train_network", None)
        if train_network is not None:
            cells["train_network"] = train_network  # Model's train network holds the network and the optimizer
        elif getattr(cb_params, "network", None) is not None:
            cells["network"] = cb_params.network
        if getattr(cb_params, "optimizer", None) is not None:
            cells["optimizer"] = cb_params.optimizer  # its network Parameters are the same objects: stored once
        if not cells:
            raise CheckpointValueError("run_context.original_args() has no train_network, network or optimizer")
        # Parameters MindSpore sliced (semi-auto / auto parallel): their layouts come from the Cells'
        # parameter_layout_dict, or from strategy_file.
        self._io_kwargs = {"strategy_file": LayoutSources(self.strategy_file, cells=cells_in(cells))}
        state = mindspore_state_dict(cells, "the training state")
        clashes = sorted(set(state) & {*self._append, *self._counters, STEPS_PER_EPOCH_KEY})
        if clashes:
            raise CheckpointValueError(
                f"append_info key(s) {', '.join(repr(c) for c in clashes)} are also names of Parameters of the "
                "training state: every saved step would hold the appended value instead of the Parameter (and a "
                "resume would fail); rename the append_info entries"
            )
        return state

    def on_train_begin(self, run_context: RunContext) -> None:
        """Load the newest committed step (``resume``; an ``exception_save`` step only with
        ``resume="breakpoint"``) and continue its step numbering. All ranks.

        In a later ``Model.train`` call with this callback, after one that ended normally, the step it saved
        last is not loaded again (the Parameters are already there, with any change the script made between the
        calls); numbering continues.
        """
        cb_params = run_context.original_args()
        self._steps_per_epoch = int(getattr(cb_params, "batch_num", 0) or 0)
        position = self._position
        if position is not None:
            position.check_training(cb_params, self._steps_per_epoch)
        self._state = self._state_of(cb_params)
        trained, running = self._completed, self._running  # what an earlier Model.train call of this callback left
        self._completed, self._running = int(cb_params.cur_step_num), None
        if self.manager.async_save:  # the first save then copies into buffers already backed
            self._staging = prepare_async_save(self._state)
        point = (position.source, position.step) if position is not None else self._resume_point()
        if point is None:
            root = self.manager.root
            theirs = mindspore_files(root) if self.resume and isinstance(root, Path) else []
            if theirs:  # a ModelCheckpoint directory: a silent fresh start looked like a resume
                _LOG.warning("resume=%r: %s holds no committed step of hyper_parallel, only MindSpore checkpoint "
                             "files (%s): training starts from the network's current values. To continue from "
                             "them, load one first (mindspore.load_checkpoint and load_param_into_net) or convert "
                             "it with hp-ckpt import", self.resume, root, ", ".join(theirs))
            return
        source, latest = point
        if source is self.manager and latest == self._last_saved == trained and running is None:
            # This callback saved (or loaded) that step in this process and trained no step after it: a later
            # Model.train call with the same callback after one that ended normally. The Parameters are at that
            # step, with what the script changed in between (a learning rate, weights loaded by hand): loading
            # the step back would silently undo those changes. (After a call that raised past the last saved
            # step the Parameters are ahead of it: the step is loaded back, as a new process would.)
            cb_params.cur_step_num = self._completed = latest
            return
        if not self.resume:
            if latest > self._completed:
                raise CheckpointValueError(
                    f"{self.manager.root} already holds committed steps up to {latest} and resume=False: this run "
                    f"would save steps from {self._completed + 1} on, which never replace newer ones; use a new "
                    "directory, or resume=True to continue after them"
                )
            return
        source.load(dict(self._state), step=latest, **self._io_kwargs)  # append_info values stay as saved
        cb_params.cur_step_num = latest
        self._completed = self._last_saved = self.resumed_step = latest
        if position is None:
            warn_unpositioned(latest, cb_params, self._steps_per_epoch)
        _LOG.info("resumed from %s", source.directory(latest))

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        """Check that the first epoch is the one :meth:`resume_dataset` positioned the dataset in. All ranks."""
        position, self._position = self._position, None
        if position is None:
            return
        position.check_epoch(int(run_context.original_args().cur_epoch_num))

    def _step_state(self, step: int, epoch: int) -> dict[str, Any]:
        """The training state plus ``append_info`` (and the steps per epoch) to save as ``step``."""
        state = {**(self._state or {}), **self._append}
        if "epoch_num" in self._counters:
            state["epoch_num"] = epoch
        if "step_num" in self._counters:
            state["step_num"] = step
        if self._steps_per_epoch:
            state[STEPS_PER_EPOCH_KEY] = self._steps_per_epoch
        return state

    def _save(self, step: int, epoch: int, *, force: bool) -> None:
        """Save the training state (plus ``append_info``) as regular step ``step``. All ranks."""
        if self.manager.save(step, self._step_state(step, epoch), force=force, **self._io_kwargs):
            self._last_saved = step

    def on_train_step_begin(self, run_context: RunContext) -> None:
        """Note the step begun, for ``exception_save`` (no file access, no communication). All ranks."""
        self._running = RunningStep.began(run_context.original_args())

    def on_train_step_end(self, run_context: RunContext) -> None:
        """Save this step if the interval says so. All ranks."""
        cb_params = run_context.original_args()
        step = int(cb_params.cur_step_num)
        previous, self._completed = self._completed, step
        self._running = None
        self._epoch = int(getattr(cb_params, "cur_epoch_num", 0) or 0)
        if self._state is None:
            self._state = self._state_of(cb_params)
            self._steps_per_epoch = int(getattr(cb_params, "batch_num", 0) or 0)
        if (self.save_checkpoint_steps or self.save_checkpoint_seconds) and step != self._last_saved:
            # In dataset sink mode a step end comes every sink_size steps: the step that passed a multiple of
            # save_checkpoint_steps is saved, as MindSpore's ModelCheckpoint does (only multiples: sink_size 7
            # and 1000 steps saved every 7000).
            every = self.save_checkpoint_steps
            passed = bool(every) and step % every != 0 and step // every > previous // every
            self._save(step, self._epoch, force=passed)

    def on_train_end(self, run_context: RunContext) -> None:
        """Save the last step (if not saved yet) and wait until every save is committed. All ranks."""
        cb_params = run_context.original_args()
        step = int(cb_params.cur_step_num)
        if self._state is None:
            self._state = self._state_of(cb_params)
        if step != self._last_saved and step > 0:
            self._save(step, int(getattr(cb_params, "cur_epoch_num", 0) or 0), force=True)
        self.manager.close()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Leaving ``Model.train``: with ``exception_save``, save the last completed step on an exception, as a
        step of :attr:`breakpoint_manager` (committed before the exception propagates)."""
        if exc_type is None:
            self.manager.close()
            return
        # Training raised: its error propagates; what fails here is logged, never raised in its place.
        try:
            step, epoch = trained_step(self._running, self._completed, self._epoch)
            save = self.exception_save and self._state is not None and step != self._last_saved and step > 0
            pending = self.manager._handle is not None  # pylint: disable=protected-access
            # Every collective waits for the other ranks: first make sure they raised too (a rank raising alone
            # waited the collective timeout, then showed a communication error instead of its own).
            if (save or pending) and not everyone_arrived(step, exc_type.__name__):
                return
            if save:
                save_breakpoint(self.breakpoint_manager, self.manager, step, self._step_state(step, epoch),
                                reason=exc_type.__name__, io_kwargs=self._io_kwargs)
            self.manager.close()
        except Exception as error:  # pylint: disable=broad-except
            _LOG.error("training raised %s; %s failed too (%s: %s)", exc_type.__name__,
                       "exception_save" if self.exception_save else "finishing the last async save",
                       type(error).__name__, error)
