"""Child process for ``tests/test_s3.py``: a large save to an ``s3://`` id, to be SIGKILLed mid-upload.

Usage: ``python s3_save_child.py s3://bucket/prefix``. The AWS variables in
the environment point it at the test endpoint.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["main"]


def main() -> None:
    """Save 64 MiB in 5 MiB parts, one connection, so the parent catches it uploading."""
    import mindspore  # pylint: disable=import-outside-toplevel

    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel

    mindspore.set_device("CPU")
    state = {f"t{i}": mindspore.Tensor(np.full((4 * 1024, 1024), i, np.float32)) for i in range(4)}
    writer = dcp.FsspecWriter(sys.argv[1], part_bytes=5 << 20, connections=1, thread_count=1)
    dcp.save(state, storage_writer=writer, no_dist=True)
    print("save finished (the parent should have killed it)", flush=True)


if __name__ == "__main__":
    main()
