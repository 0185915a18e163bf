"""Child process for the S3 tests: a save to an ``s3://`` id that dies before it commits.

Usage: ``python s3_save_child.py s3://bucket/prefix [--die-before-commit | --two-objects]``.
Without a flag it saves 64 MiB slowly, for the parent to SIGKILL it
mid-upload (``--two-objects``: beside a small data object that completes at
once); with ``--die-before-commit``, it saves a small state and SIGKILLs
itself just before the conditional write of the metadata (every data object
complete). The AWS variables in the environment point it at the test endpoint.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

__all__ = ["main"]


def main() -> None:
    """Save 64 MiB in 5 MiB parts, one connection, so the parent catches it uploading."""
    import mindspore  # pylint: disable=import-outside-toplevel

    import hyper_parallel.core.distributed_checkpoint as dcp  # pylint: disable=import-outside-toplevel

    mindspore.set_device("CPU")
    if "--die-before-commit" in sys.argv:
        from hyper_parallel.core.distributed_checkpoint import _fsspec_writer  # pylint: disable=import-outside-toplevel

        def die(*args, **kwargs) -> None:
            del args, kwargs
            os.kill(os.getpid(), signal.SIGKILL)

        _fsspec_writer.put_if = die
        state = {f"t{i}": mindspore.Tensor(np.full((256, 1024), i, np.float32)) for i in range(4)}
        dcp.save(state, storage_writer=dcp.FsspecWriter(sys.argv[1], thread_count=2), no_dist=True)
        return
    state = {f"t{i}": mindspore.Tensor(np.full((4 * 1024, 1024), i, np.float32)) for i in range(4)}
    threads = 1
    if "--two-objects" in sys.argv:  # a small object that completes at once beside the slow one
        state = {"big": mindspore.Tensor(np.ones((16 * 1024, 1024), np.float32)),
                 "small": mindspore.Tensor(np.ones((16,), np.float32))}
        threads = 2
    writer = dcp.FsspecWriter(sys.argv[1], part_bytes=5 << 20, connections=1, thread_count=threads)
    dcp.save(state, storage_writer=writer, no_dist=True)
    print("save finished (the parent should have killed it)", flush=True)


if __name__ == "__main__":
    main()
