"""Loading into tensors whose memory numpy cannot alias (device memory, e.g. on Ascend).

On CPU a load reads straight into the target's memory. A tensor in device
memory offers no such view: each read region goes into a host buffer of the
target's dtype and is then copied into its region of the tensor
(:func:`hyper_parallel.platform.assign_region`: MindSpore's ``t[region] = v``,
or ``t.copy_(v)`` for a region that is all of a tensor's own memory, as a small tensor's is).
Reads into such a target are cut into regions of at most ``device_region_bytes``
when planned, and each buffer is dropped once copied in, so the host memory
of a load stays bounded (about the reader threads times that size) whatever
the tensor sizes. Targets held as flat slices (a ``ShardedTensor`` with
``flattened_range``) and scalars keep the whole-tensor staging of the planner.

``HYPER_PARALLEL_DEVICE_COPIES=1`` sends CPU tensors down this path too (tests).
"""

from __future__ import annotations

import threading

import numpy as np

from hyper_parallel.core.distributed_checkpoint._format.byte_ranges import split_box
from hyper_parallel.core.distributed_checkpoint._state_items import TensorEntry
from hyper_parallel.core.distributed_checkpoint.planner import ReadItem
from hyper_parallel.platform.tensor import assign_region, host_memory_shared
from hyper_parallel.platform.dtypes import DTYPE_NAMES, numpy_dtype

__all__ = ["DeviceRegions"]


class DeviceRegions:
    """The device targets of one load, and the host buffers of their regions in flight."""

    def __init__(self) -> None:
        self._names: set[str] = set()
        self._buffers: dict[ReadItem, np.ndarray] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __bool__(self) -> bool:
        """Whether the load has a device target at all (most CPU loads have none)."""
        return bool(self._names)

    def plan(self, name: str, entry: TensorEntry, reads: list[ReadItem], region_bytes: int) -> list[ReadItem]:
        """Return ``reads``, cut into regions of at most ``region_bytes`` when ``entry`` is a device target.

        Called while planning, by every rank for its own targets.
        """
        if (
            host_memory_shared(entry.local)
            or not entry.local_shape
            or len(entry.pieces) != 1
            or entry.pieces[0].flat_start is not None
            or tuple(entry.local.shape) != entry.local_shape
        ):
            return reads
        self._names.add(name)
        itemsize = DTYPE_NAMES[entry.dtype]
        out: list[ReadItem] = []
        for item in reads:
            for offsets, lengths in split_box(item.lengths, itemsize, region_bytes):
                out.append(ReadItem(
                    type=item.type,
                    dest_index=item.dest_index,
                    dest_offsets=tuple(d + o for d, o in zip(item.dest_offsets, offsets)),
                    storage_index=item.storage_index,
                    storage_offsets=tuple(s + o for s, o in zip(item.storage_offsets, offsets)),
                    lengths=lengths,
                ))
        return out

    def buffer(self, item: ReadItem, entry: TensorEntry) -> np.ndarray:
        """A host buffer of the target's dtype for one region (the reader fills it)."""
        array = np.empty(item.lengths, dtype=numpy_dtype(entry.dtype))
        with self._lock:
            self._buffers[item] = array
        return array

    def holds(self, item: ReadItem) -> bool:
        """Whether ``item``'s region waits in a host buffer."""
        return bool(self._buffers) and item in self._buffers  # hashing a read item costs: skip it when none wait

    def write(self, item: ReadItem, entry: TensorEntry, value: np.ndarray | None = None) -> None:
        """Copy a region into the device tensor (``value``, or the item's buffer, then dropped)."""
        if value is None:
            with self._lock:
                value = self._buffers.pop(item)
        region = tuple(slice(o, o + n) for o, n in zip(item.dest_offsets, item.lengths))
        assign_region(entry.local, region, np.asarray(value).reshape(item.lengths))
