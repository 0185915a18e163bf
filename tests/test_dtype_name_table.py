"""The dtype name table of plain leaves stays bounded and keeps serving the dtypes a job uses."""

from __future__ import annotations

import mindspore as ms
import numpy as np

from hyper_parallel.core.distributed_checkpoint import _state_items


def test_a_dtype_met_after_the_table_filled_is_still_remembered() -> None:
    """Fresh big-endian dtype objects (one per array) fill the table; a dtype met after that, a MindSpore one
    included, is looked up once and then served from the table instead of being looked up at every leaf."""
    table = _state_items._DTYPE_NAMES  # pylint: disable=protected-access
    table.clear()  # as in a fresh process: nothing met yet
    for _ in range(_state_items._MAX_DTYPE_NAMES + 10):  # pylint: disable=protected-access
        big = np.arange(3, dtype=np.float32).astype(np.dtype(np.float32).newbyteorder(">"))
        assert _state_items.plain_dtype_name(big) == "float32"
    assert len(table) <= _state_items._MAX_DTYPE_NAMES  # pylint: disable=protected-access
    for value, name in ((ms.Tensor(np.ones(2, np.float16)), "float16"), (np.zeros(2, np.int8), "int8")):
        assert _state_items.plain_dtype_name(value) == name
        assert table.get(id(value.dtype)) == (value.dtype, name), f"{name} is remembered"
        assert _state_items.plain_tensor_entry("k", value).dtype == name
