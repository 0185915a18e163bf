"""Process-group facts and object collectives, on top of MindSpore communication.

Every function works whether or not ``mindspore.communication.init()`` was
called: without it the process is rank 0 of a world of 1, and the collectives
return at once. Nothing is looked up at import time; MindSpore is imported only
when a function is called and only if the caller already imported it (a job
that never imported MindSpore cannot have initialised its communication).

``broadcast_object`` is built on ``all_gather_object`` because MindSpore 2.10's
``broadcast_object_list`` looks up the ``hccl`` group and fails on CPU.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = [
    "is_initialized",
    "get_rank",
    "get_world_size",
    "all_gather_object",
    "broadcast_object",
    "scatter_bytes",
    "broadcast_bytes",
    "gather_bytes",
    "barrier",
]


def is_initialized() -> bool:
    """Tell whether MindSpore communication was initialised in this process.

    Called by any rank. Never initialises anything.
    """
    if "mindspore" not in sys.modules:
        return False
    from mindspore.communication import GlobalComm  # pylint: disable=import-outside-toplevel

    return bool(getattr(GlobalComm, "INITED", False))


def get_rank() -> int:
    """Return this process's global rank (0 when communication is not initialised)."""
    if not is_initialized():
        return 0
    from mindspore.communication import get_rank as _ms_get_rank  # pylint: disable=import-outside-toplevel

    return int(_ms_get_rank())


def get_world_size() -> int:
    """Return the number of processes in the job (1 when not initialised)."""
    if not is_initialized():
        return 1
    from mindspore.communication import get_group_size  # pylint: disable=import-outside-toplevel

    return int(get_group_size())


def all_gather_object(obj: Any) -> list[Any]:
    """Gather one picklable object from every rank, in rank order.

    All ranks call it. Without initialised communication returns ``[obj]``.
    """
    if not is_initialized() or get_world_size() == 1:
        return [obj]
    from mindspore.mint.distributed import all_gather_object as _gather  # pylint: disable=import-outside-toplevel

    out: list[Any] = [None] * get_world_size()
    _gather(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Return rank ``src``'s ``obj`` on every rank.

    All ranks call it; only ``src``'s argument matters (the others may pass
    ``None``, which keeps the gathered payload small).
    """
    gathered = all_gather_object(obj if get_rank() == src else None)
    return gathered[src]


def scatter_bytes(parts: list[bytes] | None, src: int = 0) -> bytes:
    """Hand each rank its own ``parts[rank]`` from rank ``src``. All ranks call it.

    Only ``src`` passes ``parts`` (one byte string per rank); the others pass
    ``None``. A rank receives 8 bytes (the longest part's length, a tensor
    broadcast) plus that longest length: not every rank's part, as with
    ``all_gather_object``. When every part is the same object, it goes to
    every rank by a tensor broadcast instead (the source builds no row per
    rank). Built on tensor ``broadcast`` and ``scatter``
    because on MindSpore 2.10 CPU ``scatter_object_list``, ``gather_object``,
    ``send``/``recv``, ``all_to_all_single`` and ``reduce_scatter_tensor``
    fail (measured under msrun).
    """
    if not is_initialized() or get_world_size() == 1:
        return parts[0] if parts else b""
    import numpy as np  # pylint: disable=import-outside-toplevel
    from mindspore import Tensor  # pylint: disable=import-outside-toplevel
    from mindspore.mint.distributed import broadcast, scatter  # pylint: disable=import-outside-toplevel

    world, rank = get_world_size(), get_rank()
    longest = max(map(len, parts)) if rank == src else 0
    if rank == src and all(part is parts[0] for part in parts):
        longest = -1 - longest  # one part for every rank (e.g. the committed metadata): a broadcast
    length = Tensor(np.array([longest], np.int64))
    broadcast(length, src=src)
    longest = int(length.asnumpy()[0])
    if longest < 0:
        return _broadcast_payload(parts[0] if rank == src else None, -1 - longest, src)
    width = longest + 8  # each part carries its own length first
    if rank == src:
        rows = np.zeros((world, width), np.uint8)
        for index, part in enumerate(parts):
            rows[index, :8] = np.frombuffer(len(part).to_bytes(8, "little"), np.uint8)
            rows[index, 8:8 + len(part)] = np.frombuffer(part, np.uint8)
        scatter_list = [Tensor(row) for row in rows]
    else:
        scatter_list = [Tensor(np.zeros(width, np.uint8))] * world  # ignored off the source
    out = Tensor(np.zeros(width, np.uint8))
    scatter(out, scatter_list, src=src)
    data = out.asnumpy().tobytes()
    return data[8:8 + int.from_bytes(data[:8], "little")]


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """Return rank ``src``'s ``data`` on every rank. All ranks call it.

    Only ``src`` passes ``data`` (the others pass ``None``). A rank receives
    8 bytes (the length, a tensor broadcast) plus the data (a tensor
    broadcast of bytes): unlike :func:`broadcast_object` (an all-gather), not
    a payload per rank.
    """
    if not is_initialized() or get_world_size() == 1:
        return data or b""
    import numpy as np  # pylint: disable=import-outside-toplevel
    from mindspore import Tensor  # pylint: disable=import-outside-toplevel
    from mindspore.mint.distributed import broadcast  # pylint: disable=import-outside-toplevel

    length = Tensor(np.array([len(data) if get_rank() == src else 0], np.int64))
    broadcast(length, src=src)
    return _broadcast_payload(data, int(length.asnumpy()[0]), src)


def _broadcast_payload(data: bytes | None, size: int, src: int) -> bytes:
    """Broadcast ``size`` bytes of ``data`` from ``src`` (the size already known everywhere)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    from mindspore import Tensor  # pylint: disable=import-outside-toplevel
    from mindspore.mint.distributed import broadcast  # pylint: disable=import-outside-toplevel

    row = np.zeros(max(size, 1), np.uint8)
    if get_rank() == src and size:
        row[:size] = np.frombuffer(data, np.uint8)
    payload = Tensor(row)
    broadcast(payload, src=src)
    return payload.asnumpy().tobytes()[:size]


def gather_bytes(part: bytes, dst: int = 0) -> list[bytes] | None:
    """Collect every rank's ``part`` on rank ``dst`` (``None`` elsewhere). All ranks call it.

    A rank other than ``dst`` receives 8 bytes (the longest length, a tensor
    broadcast). Built on tensor ``gather`` and ``broadcast`` (see
    :func:`scatter_bytes`).
    """
    if not is_initialized() or get_world_size() == 1:
        return [part]
    import numpy as np  # pylint: disable=import-outside-toplevel
    from mindspore import Tensor  # pylint: disable=import-outside-toplevel
    from mindspore.mint.distributed import broadcast, gather  # pylint: disable=import-outside-toplevel

    world, rank = get_world_size(), get_rank()
    lengths = [Tensor(np.zeros(1, np.int64)) for _ in range(world)]
    gather(Tensor(np.array([len(part)], np.int64)), lengths if rank == dst else [lengths[0]] * world, dst=dst)
    sizes = [int(t.asnumpy()[0]) for t in lengths] if rank == dst else []
    longest = Tensor(np.array([max(sizes) if sizes else 0], np.int64))
    broadcast(longest, src=dst)
    width = max(int(longest.asnumpy()[0]), 1)
    row = np.zeros(width, np.uint8)
    row[:len(part)] = np.frombuffer(part, np.uint8)
    rows = [Tensor(np.zeros(width, np.uint8)) for _ in range(world)] if rank == dst else None
    gather(Tensor(row), rows if rank == dst else [Tensor(row)] * world, dst=dst)
    if rank != dst:
        return None
    return [t.asnumpy().tobytes()[:size] for t, size in zip(rows, sizes)]


def barrier() -> None:
    """Block until every rank reaches this call. All ranks call it.

    Built on ``all_gather_object``: MindSpore 2.10's ``barrier`` returns at
    once on CPU without waiting for the other ranks.
    """
    if not is_initialized() or get_world_size() == 1:
        return
    all_gather_object(None)
