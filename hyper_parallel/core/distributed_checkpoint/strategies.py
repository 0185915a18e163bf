"""Save and load strategies by backend and format version (Megatron-style).

The metadata of every checkpoint records the backend that wrote it and its
format version. Loading looks up the registered load strategy for them and
refuses, with a clear error, a backend or version nobody registered. The
filesystem format is registered here as backend ``"filesystem"``, version
:data:`FORMAT_VERSION`.
"""

from __future__ import annotations

import abc
import enum
from typing import Any

from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncCallsQueue, AsyncRequest
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError, UnsupportedFormatError
from hyper_parallel.core.distributed_checkpoint.metadata import BACKEND_NAME, FORMAT_VERSION, Metadata

__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "StrategyAction",
    "SaveStrategyBase",
    "LoadStrategyBase",
    "FileSystemSaveStrategy",
    "FileSystemLoadStrategy",
    "register_default_strategy",
    "get_default_strategy",
    "registered_strategies",
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

    def check_backend_compatibility(self, backend: str) -> None:
        """Raise :class:`UnsupportedFormatError` unless ``backend`` is this strategy's."""
        if backend != self.backend:
            raise UnsupportedFormatError(
                f"checkpoint backend {backend!r} cannot be handled by the {self.backend!r} strategy"
            )

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
    """Writes a state dict. ``async_capable`` strategies return an ``AsyncRequest``."""

    async_capable = False

    @abc.abstractmethod
    def save(self, state_dict: dict[str, Any], checkpoint_id: Any, **kwargs: Any) -> Any:
        """Save ``state_dict``. All ranks call it."""


class LoadStrategyBase(_StrategyBase):
    """Reads a checkpoint into a state dict."""

    @abc.abstractmethod
    def load(self, state_dict: dict[str, Any], checkpoint_id: Any, **kwargs: Any) -> None:
        """Load into ``state_dict`` in place. All ranks call it."""


class FileSystemSaveStrategy(SaveStrategyBase):
    """The filesystem format: ``dcp.save`` (sync) or ``dcp.async_save``."""

    async_capable = True

    def save(self, state_dict: dict[str, Any], checkpoint_id: Any, **kwargs: Any) -> Any:
        """Save with ``dcp.save``; with ``async_save=True`` return an ``AsyncSaveHandle``."""
        from hyper_parallel.core.distributed_checkpoint import api, async_checkpoint  # pylint: disable=import-outside-toplevel

        if kwargs.pop("async_save", False):
            return async_checkpoint.async_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)
        return api.save(state_dict, checkpoint_id=checkpoint_id, **kwargs)


class FileSystemLoadStrategy(LoadStrategyBase):
    """The filesystem format: ``dcp.load``."""

    def load(self, state_dict: dict[str, Any], checkpoint_id: Any, **kwargs: Any) -> None:
        """Load with ``dcp.load``."""
        from hyper_parallel.core.distributed_checkpoint import api  # pylint: disable=import-outside-toplevel

        api.load(state_dict, checkpoint_id=checkpoint_id, **kwargs)


_REGISTRY: dict[tuple[StrategyAction, str, str], _StrategyBase] = {}


def register_default_strategy(action: StrategyAction, backend: str, version: str, strategy: _StrategyBase) -> None:
    """Register ``strategy`` for ``action`` on ``backend`` at format ``version``."""
    if not isinstance(action, StrategyAction):
        raise CheckpointValueError(f"action must be a StrategyAction, got {action!r}")
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


def check_load_compatible(metadata: Metadata) -> _StrategyBase:
    """Return the load strategy for a checkpoint's backend and version, or raise."""
    return get_default_strategy(StrategyAction.LOAD_SHARDED, metadata.storage_meta.backend, metadata.version)


for _action, _cls in (
    (StrategyAction.SAVE_SHARDED, FileSystemSaveStrategy),
    (StrategyAction.SAVE_COMMON, FileSystemSaveStrategy),
    (StrategyAction.LOAD_SHARDED, FileSystemLoadStrategy),
    (StrategyAction.LOAD_COMMON, FileSystemLoadStrategy),
):
    register_default_strategy(_action, BACKEND_NAME, FORMAT_VERSION, _cls(BACKEND_NAME, FORMAT_VERSION))
