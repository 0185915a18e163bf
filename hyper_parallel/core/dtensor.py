"""A distributed tensor: this rank's shard plus the layout that places it.

The shard (the "local tensor") is a MindSpore Tensor, a Parameter or a numpy
array, kept as the very object given, so loading into a DTensor can write into
the Parameter a network holds.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hyper_parallel import platform
from hyper_parallel.core._errors import LayoutError
from hyper_parallel.core.layout import Layout

__all__ = ["DTensor"]


def _shape_of(tensor: Any) -> tuple[int, ...]:
    """Return the shape of a MindSpore tensor or numpy array as a tuple of ints."""
    if not (isinstance(tensor, np.ndarray) or platform.is_tensor(tensor)):
        raise TypeError(f"expected a MindSpore Tensor/Parameter or numpy array, got {type(tensor).__name__}")
    return tuple(int(s) for s in tensor.shape)


class DTensor:
    """One rank's shard of a global tensor, with its layout.

    Args:
        local_tensor: The shard: a MindSpore Tensor or Parameter, or a numpy array.
        layout: Anything :meth:`Layout.from_any` accepts (e.g. a MindSpore Layout).
        global_shape: The full tensor's shape; default: local shape times the
            splits per dim.
        rank: The global rank holding this shard; default
            :func:`hyper_parallel.platform.get_rank` at construction.

    Raises:
        LayoutError: The local shape differs from ``layout.local_shape(global_shape)``,
            or an explicit ``rank`` is not in the layout's rank_list.
        TypeError: ``local_tensor`` is not a tensor or array.
    """

    def __init__(
        self,
        local_tensor: Any,
        layout: Any,
        global_shape: Sequence[int] | None = None,
        *,
        rank: int | None = None,
    ) -> None:
        self._local = local_tensor
        self._layout = Layout.from_any(layout)
        local_shape = _shape_of(local_tensor)
        if global_shape is None:
            if len(local_shape) != len(self._layout.tensor_map):
                raise LayoutError(
                    f"local tensor has {len(local_shape)} dims (shape {local_shape}) "
                    f"but tensor_map {self._layout.tensor_map} describes {len(self._layout.tensor_map)}"
                )
            global_shape = tuple(n * s for n, s in zip(local_shape, self._layout.splits_per_dim()))
        self._shape = tuple(int(s) for s in global_shape)
        expected = self._layout.local_shape(self._shape)
        if expected != local_shape:
            raise LayoutError(
                f"local tensor shape {local_shape} does not match the shard shape {expected} "
                f"of global shape {self._shape} under tensor_map {self._layout.tensor_map}"
            )
        if rank is not None:
            self._layout.mesh_coordinate(rank)  # validates the explicit rank
        self._rank = platform.get_rank() if rank is None else int(rank)

    @classmethod
    def from_global(cls, full: Any, layout: Any, rank: int | None = None) -> DTensor:
        """Cut ``rank``'s shard out of a full tensor.

        Args:
            full: The whole tensor (MindSpore Tensor/Parameter or numpy array).
            layout: Anything :meth:`Layout.from_any` accepts.
            rank: Whose shard to cut; default the current rank.

        Returns:
            A DTensor whose local tensor is a new MindSpore Tensor (if ``full``
            is one) or a numpy copy (if ``full`` is numpy).

        Raises:
            LayoutError: The shape does not split evenly, or the rank is not in the layout.
        """
        layout = Layout.from_any(layout)
        rank = platform.get_rank() if rank is None else int(rank)
        global_shape = _shape_of(full)
        name = getattr(full, "name", None) if isinstance(getattr(full, "name", None), str) else None
        offsets = layout.shard_offsets(global_shape, rank, name=name)
        local_shape = layout.local_shape(global_shape, name=name)
        window = tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))
        piece = platform.to_numpy(full)[window]
        if isinstance(full, np.ndarray):
            local = np.array(piece, copy=True)
        else:
            local = platform.from_numpy(piece, copy=True)
        return cls(local, layout, global_shape, rank=rank)

    def to_local(self) -> Any:
        """Return the local tensor (the very object given)."""
        return self._local

    @property
    def layout(self) -> Layout:
        """The layout, as a hyper_parallel :class:`Layout`."""
        return self._layout

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape."""
        return self._shape

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the local shard."""
        return _shape_of(self._local)

    @property
    def dtype(self) -> Any:
        """The local tensor's dtype object, as-is (MindSpore or numpy dtype)."""
        return self._local.dtype

    @property
    def rank(self) -> int:
        """The global rank this shard belongs to."""
        return self._rank

    @property
    def global_offset(self) -> tuple[int, ...]:
        """The global offset of this rank's shard, per dim.

        Raises:
            LayoutError: The rank is not in the layout's rank_list.
        """
        return self._layout.shard_offsets(self._shape, self._rank)

    def __repr__(self) -> str:
        return (
            f"DTensor(shape={self._shape}, local_shape={self.local_shape}, dtype={self.dtype}, "
            f"rank={self._rank}, layout={self._layout!r})"
        )
