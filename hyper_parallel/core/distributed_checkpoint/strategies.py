"""Save and load strategies by backend and format version (Megatron-style).

The metadata of every checkpoint records the backend that wrote it and its
format version. ``dcp.load`` reads the metadata and calls the load strategy
registered for them (refusing, with a clear error, a backend or version
nobody registered); ``dcp.save`` and ``dcp.async_save`` call the save
strategy registered for this package's backend and :data:`FORMAT_VERSION`.
The built-in strategies run the steps of :mod:`._engine` (save),
:mod:`._async_engine` (async save) and :mod:`._load_engine` (load) with whatever
storage writer or reader the caller chose; they are registered here as
backend ``"filesystem"``.
"""

from __future__ import annotations

import abc
import enum
from typing import Any

from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncCallsQueue, AsyncRequest
from hyper_parallel.core.distributed_checkpoint._async_engine import plan_async_save
from hyper_parallel.core.distributed_checkpoint._engine import SaveOptions, run_save
from hyper_parallel.core.distributed_checkpoint._load_engine import LoadOptions, run_load
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError, UnsupportedFormatError
from hyper_parallel.core.distributed_checkpoint.metadata import (
    BACKEND_NAME,
    FORMAT_VERSION,
    SAME_FORMAT_BACKENDS,
    Metadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlanner, SavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import StorageReader, StorageWriter

__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "SaveOptions",
    "LoadOptions",
    "StrategyAction",
    "SaveStrategyBase",
    "LoadStrategyBase",
    "StandardSaveStrategy",
    "StandardLoadStrategy",
    "register_default_strategy",
    "get_default_strategy",
    "registered_strategies",
    "READABLE_OLDER_VERSIONS",
    "save_strategy",
    "check_load_compatible",
]


class StrategyAction(enum.Enum):
    """What a strategy does."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


def _major(version: str) -> str:
    return version.split(".", 1)[0]


class _StrategyBase(abc.ABC):
    """A strategy bound to one backend name and format version."""

    def __init__(self, backend: str, version: str) -> None:
        self.backend = backend
        self.version = version

    def check_version_compatibility(self, version: str) -> None:
        """Raise :class:`UnsupportedFormatError` for another major or a newer minor version."""
        try:
            newer = tuple(int(p) for p in version.split(".")) > tuple(int(p) for p in self.version.split("."))
        except ValueError:
            newer = True
        if _major(version) != _major(self.version) or newer:
            raise UnsupportedFormatError(
                f"checkpoint format version {version!r} of backend {self.backend!r} is not supported "
                f"(this strategy reads version {self.version} and older {_major(self.version)}.x)"
            )


class SaveStrategyBase(_StrategyBase):
    """Runs a save. ``dcp.save`` calls :meth:`save`; ``dcp.async_save`` calls
    :meth:`async_save` of an ``async_capable`` strategy."""

    #: Whether :meth:`async_save` is implemented.
    async_capable = False

    @abc.abstractmethod
    def save(
        self, state_dict: dict[str, Any], *, storage_writer: StorageWriter, planner: SavePlanner, options: SaveOptions
    ) -> Metadata:
        """Save ``state_dict`` and return the committed metadata. All ranks call it.

        Args:
            state_dict: The state to save.
            storage_writer: Where to write (already reset to the checkpoint id).
            planner: The save planner.
            options: The save's options (``no_dist``, ``use_collectives``, ...).
        """

    def async_save(
        self,
        state_dict: dict[str, Any],
        *,
        storage_writer: StorageWriter,
        planner: SavePlanner,
        options: SaveOptions,
        staging: str,
    ) -> AsyncRequest:
        """Plan and stage a save; return the request that writes and commits it. All ranks call it.

        The returned :class:`AsyncRequest` is run by an :class:`AsyncCallsQueue`:
        its function in the background, its finalize functions (the commit, a
        collective step) on the caller's thread.

        Raises:
            UnsupportedFormatError: the strategy is not ``async_capable``.
        """
        raise UnsupportedFormatError(
            f"the save strategy of backend {self.backend!r} version {self.version} cannot save asynchronously; "
            "use dcp.save"
        )


class LoadStrategyBase(_StrategyBase):
    """Runs a load of a checkpoint whose backend and version it accepts. ``dcp.load`` calls it."""

    @abc.abstractmethod
    def load(
        self,
        state_dict: dict[str, Any],
        *,
        storage_reader: StorageReader,
        planner: LoadPlanner,
        metadata: Metadata,
        options: LoadOptions,
    ) -> None:
        """Load into ``state_dict`` in place. All ranks call it.

        Args:
            state_dict: The targets.
            storage_reader: Where to read (its metadata already read).
            planner: The load planner.
            metadata: The checkpoint's committed metadata (same on every rank).
            options: The load's options (``no_dist``, ``use_collectives``).
        """


class StandardSaveStrategy(SaveStrategyBase):
    """This package's format: plan, write and commit through any storage writer (the engine's save steps)."""

    async_capable = True

    def save(
        self, state_dict: dict[str, Any], *, storage_writer: StorageWriter, planner: SavePlanner, options: SaveOptions
    ) -> Metadata:
        """Run the save steps (:func:`._engine.run_save`). All ranks call it."""
        return run_save(state_dict, writer=storage_writer, planner=planner, options=options)

    def async_save(
        self,
        state_dict: dict[str, Any],
        *,
        storage_writer: StorageWriter,
        planner: SavePlanner,
        options: SaveOptions,
        staging: str,
    ) -> AsyncRequest:
        """Plan and stage (:func:`._async_engine.plan_async_save`). All ranks call it."""
        return plan_async_save(state_dict, writer=storage_writer, planner=planner, options=options, staging=staging)


class StandardLoadStrategy(LoadStrategyBase):
    """This package's format: plan and read through any storage reader (the engine's load steps)."""

    def load(
        self,
        state_dict: dict[str, Any],
        *,
        storage_reader: StorageReader,
        planner: LoadPlanner,
        metadata: Metadata,
        options: LoadOptions,
    ) -> None:
        """Run the load steps (:func:`._load_engine.run_load`). All ranks call it."""
        run_load(state_dict, reader=storage_reader, planner=planner, metadata=metadata, options=options)


_REGISTRY: dict[tuple[StrategyAction, str, str], _StrategyBase] = {}


def register_default_strategy(action: StrategyAction, backend: str, version: str, strategy: _StrategyBase) -> None:
    """Register ``strategy`` for ``action`` on ``backend`` at format ``version``."""
    if not isinstance(action, StrategyAction):
        raise CheckpointValueError(f"action must be a StrategyAction, got {action!r}")
    saving = action in (StrategyAction.SAVE_SHARDED, StrategyAction.SAVE_COMMON)
    wanted = SaveStrategyBase if saving else LoadStrategyBase
    if not isinstance(strategy, wanted):
        raise CheckpointValueError(
            f"a {action.value} strategy must be a {wanted.__name__}, got {type(strategy).__name__}"
        )
    _REGISTRY[(action, backend, str(version))] = strategy


def registered_strategies() -> list[tuple[StrategyAction, str, str]]:
    """Every registered ``(action, backend, version)``."""
    return sorted(_REGISTRY, key=lambda k: (k[0].value, k[1], k[2]))


def get_default_strategy(action: StrategyAction, backend: str, version: str) -> _StrategyBase:
    """Return the strategy for ``action`` on ``backend`` at ``version``.

    An exact registration wins; otherwise a strategy of the same backend whose
    version accepts ``version`` (same major, not newer).

    Raises:
        UnsupportedFormatError: nothing registered fits (names what is supported).
    """
    exact = _REGISTRY.get((action, backend, str(version)))
    if exact is not None:
        return exact
    for (reg_action, reg_backend, _), strategy in _REGISTRY.items():
        if reg_action == action and reg_backend == backend:
            try:
                strategy.check_version_compatibility(str(version))
            except UnsupportedFormatError:
                continue
            return strategy
    supported = ", ".join(f"{b} {v}" for a, b, v in registered_strategies() if a == action) or "none"
    raise UnsupportedFormatError(
        f"no {action.value} strategy for checkpoint backend {backend!r} version {version!r}; "
        f"supported: {supported}"
    )


def save_strategy() -> SaveStrategyBase:
    """The registered save strategy of this package's backend and format version."""
    return get_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND_NAME, FORMAT_VERSION)


def check_load_compatible(metadata: Metadata) -> LoadStrategyBase:
    """Return the load strategy for a checkpoint's backend and version, or raise."""
    return get_default_strategy(StrategyAction.LOAD_SHARDED, metadata.storage_meta.backend, metadata.version)


#: Older format versions the built-in load strategy still reads (docs/format.md section 12).
READABLE_OLDER_VERSIONS = ("1.0", "2.0", "2.1")

for _action, _cls in (
    (StrategyAction.SAVE_SHARDED, StandardSaveStrategy),
    (StrategyAction.SAVE_COMMON, StandardSaveStrategy),
    (StrategyAction.LOAD_SHARDED, StandardLoadStrategy),
    (StrategyAction.LOAD_COMMON, StandardLoadStrategy),
):
    register_default_strategy(_action, BACKEND_NAME, FORMAT_VERSION, _cls(BACKEND_NAME, FORMAT_VERSION))
# Every backend this package writes stores the same format: the one load strategy reads them all.
for _backend in SAME_FORMAT_BACKENDS:
    for _version in (FORMAT_VERSION, *READABLE_OLDER_VERSIONS):
        for _action in (StrategyAction.LOAD_SHARDED, StrategyAction.LOAD_COMMON):
            if _backend != BACKEND_NAME or _version != FORMAT_VERSION:
                register_default_strategy(_action, _backend, _version, StandardLoadStrategy(_backend, _version))
