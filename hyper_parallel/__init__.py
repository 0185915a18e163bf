"""hyper_parallel: parallel training helpers for MindSpore, and its distributed checkpoint.

Public names: :class:`Layout`, :class:`DTensor`, :func:`layouts_from_strategy`, :func:`save_checkpoint`,
:func:`load_checkpoint`, :class:`CheckpointCallback` (for ``Model.train``); the checkpoint API is
``hyper_parallel.core.distributed_checkpoint``. Importing does not import
MindSpore or touch communication.

The checkpoint names are loaded on first use (PEP 562), so ``import
hyper_parallel.core.layout`` does not import the checkpoint package.
"""

from typing import Any

from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.core.layout import Layout
from hyper_parallel.core.strategy_file import layouts_from_strategy

__all__ = ["DTensor", "Layout", "layouts_from_strategy", "load_checkpoint", "save_checkpoint"]

#: Public names that live in the checkpoint package: name -> module.
_LAZY = {
    "CheckpointCallback": "hyper_parallel.core.distributed_checkpoint.callback",
    "load_checkpoint": "hyper_parallel.core.distributed_checkpoint._one_line",
    "save_checkpoint": "hyper_parallel.core.distributed_checkpoint._one_line",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hyper_parallel' has no attribute {name!r}")
    import importlib  # pylint: disable=import-outside-toplevel

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
