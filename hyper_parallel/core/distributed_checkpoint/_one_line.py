"""``save_checkpoint`` / ``load_checkpoint``: the one-line forms for MindSpore scripts.

``save_checkpoint(net, path)`` saves a Cell's parameters (or any state dict);
``load_checkpoint(path, net)`` loads into a Cell or state dict in place, and
``load_checkpoint(path)`` returns the full, unsharded tensors as a flat
``{name: mindspore.Tensor}`` dict plus the non-tensor values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyper_parallel.core.distributed_checkpoint import api
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointValueError, UnsafeCheckpointError
from hyper_parallel.core.distributed_checkpoint.metadata import TensorStorageMetadata
from hyper_parallel.core.distributed_checkpoint.standard_planner import StandardLoadPlanner, StandardSavePlanner
from hyper_parallel.platform.tensor import from_numpy, is_cell, numpy_dtype

__all__ = ["save_checkpoint", "load_checkpoint"]


def _as_state_dict(obj: Any, what: str) -> dict[str, Any]:
    if is_cell(obj):
        return dict(obj.parameters_dict())
    if isinstance(obj, dict):
        return obj
    raise CheckpointValueError(f"{what} must be a mindspore.nn.Cell or a state dict, got {type(obj).__name__}")


def save_checkpoint(save_obj: Any, checkpoint_id: Any, **kwargs: Any) -> Any:
    """Save a Cell's parameters or a state dict. All ranks call it.

    Args:
        save_obj: A ``mindspore.nn.Cell`` or a state dict.
        checkpoint_id: The checkpoint directory.
        **kwargs: ``allow_pickle`` and any argument of ``dcp.save``.

    Returns:
        The committed metadata.
    """
    allow_pickle = kwargs.pop("allow_pickle", False)
    if "planner" not in kwargs:
        kwargs["planner"] = StandardSavePlanner(allow_pickle=allow_pickle)
    return api.save(_as_state_dict(save_obj, "save_obj"), checkpoint_id=checkpoint_id, **kwargs)


def load_checkpoint(checkpoint_id: Any, net: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Load a checkpoint. All ranks call it.

    Args:
        checkpoint_id: The checkpoint directory.
        net: A Cell or state dict to load into in place; ``None`` to get the
            whole checkpoint back.
        **kwargs: ``allow_pickle``, ``allow_partial_load`` and any argument of ``dcp.load``.

    Returns:
        The loaded state dict: ``net``'s (with ``net``), otherwise
        ``{name: mindspore.Tensor}`` of full tensors plus non-tensor values.
    """
    allow_pickle = kwargs.pop("allow_pickle", False)
    allow_partial = kwargs.pop("allow_partial_load", False)
    if "planner" not in kwargs:
        kwargs["planner"] = StandardLoadPlanner(allow_partial_load=allow_partial, allow_pickle=allow_pickle)
    if net is not None:
        state_dict = _as_state_dict(net, "net")
        api.load(state_dict, checkpoint_id=checkpoint_id, **kwargs)
        return state_dict
    metadata = api.read_metadata(checkpoint_id)
    target: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            try:
                target[fqn] = np.zeros(item.size, dtype=numpy_dtype(item.properties.dtype))
            except (MemoryError, ValueError) as exc:  # sizes come from the checkpoint
                raise UnsafeCheckpointError(
                    f"key '{fqn}': the checkpoint declares shape {list(item.size)}, too large to allocate; "
                    "load into an existing state dict instead"
                ) from exc
        elif item.global_shape:
            continue  # per-rank ShardedObjects have no single value
        else:
            target[fqn] = None
    api.load(target, checkpoint_id=checkpoint_id, **kwargs)
    return {key: from_numpy(value) if isinstance(value, np.ndarray) else value for key, value in target.items()}
