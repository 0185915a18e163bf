"""hyper_parallel: parallel training helpers for MindSpore, and its distributed checkpoint.

Public names: :class:`Layout`, :class:`DTensor`, :func:`save_checkpoint`,
:func:`load_checkpoint`; the checkpoint API is
``hyper_parallel.core.distributed_checkpoint``. Importing does not import
MindSpore or touch communication.
"""

# The checkpoint package first: it imports the layout and DTensor modules in an
# order that has no cycles.
import hyper_parallel.core.distributed_checkpoint  # noqa: F401  pylint: disable=unused-import
from hyper_parallel.core.distributed_checkpoint.one_line import load_checkpoint, save_checkpoint
from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.core.layout import Layout

__all__ = ["DTensor", "Layout", "load_checkpoint", "save_checkpoint"]
