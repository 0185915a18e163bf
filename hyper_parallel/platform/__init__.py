"""The one place where the checkpoint talks to the framework.

Communication (rank, world size, object collectives) lives in
:mod:`hyper_parallel.platform.comm`; tensor conversion in
:mod:`hyper_parallel.platform.tensor`; dtype names in :mod:`hyper_parallel.platform.dtypes`.
Nothing here runs at import time.
"""

from hyper_parallel.platform.comm import (
    all_gather_object,
    barrier,
    broadcast_object,
    get_rank,
    get_world_size,
    is_initialized,
    scatter_bytes,
    broadcast_bytes,
    gather_bytes,
)
from hyper_parallel.platform.tensor import (
    DEVICE_COPIES_ENV,
    assign,
    assign_region,
    from_numpy,
    host_memory_shared,
    is_cell,
    is_parameter,
    is_tensor,
    to_numpy,
    writable_view,
)
from hyper_parallel.platform.dtypes import DTYPE_NAMES, dtype_name, ms_dtype, numpy_dtype

__all__ = [
    "DEVICE_COPIES_ENV",
    "DTYPE_NAMES",
    "all_gather_object",
    "assign",
    "assign_region",
    "barrier",
    "broadcast_object",
    "dtype_name",
    "from_numpy",
    "get_rank",
    "get_world_size",
    "host_memory_shared",
    "is_cell",
    "is_initialized",
    "is_parameter",
    "scatter_bytes",
    "broadcast_bytes",
    "gather_bytes",
    "is_tensor",
    "ms_dtype",
    "numpy_dtype",
    "to_numpy",
    "writable_view",
]
