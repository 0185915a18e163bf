"""A real S3 endpoint for tests: moto's server on 127.0.0.1, a fresh bucket per test.

``s3_endpoint`` (session) starts ``moto.server.ThreadedMotoServer`` on a free
port and sets the usual AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``...), so ``s3fs`` and child processes (msrun workers,
the CLI) reach it exactly as they would reach S3. ``s3_url`` gives each test
its own empty bucket.

moto checks a conditional PUT (``If-None-Match: *`` / ``If-Match``) and then
stores the object in two steps, so two concurrent conditional PUTs of one key
can both succeed, where S3 decides them atomically (one gets 412). The
library's commit of racing saves relies on that atomicity; the fixture makes
moto's PUT of an object one step (a lock around it), as S3's is.
"""

from __future__ import annotations

import logging
import functools
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Iterator

import pytest

from msrun_harness import free_port

__all__ = ["S3Endpoint", "s3_endpoint", "s3_url", "s3_env", "new_filesystem"]


@dataclass(frozen=True)
class S3Endpoint:
    """A running endpoint.

    Attributes:
        url: ``http://127.0.0.1:<port>``.
        env: The variables that point clients at it.
    """

    url: str
    env: dict[str, str]


def s3_env(url: str) -> dict[str, str]:
    """The environment that makes boto / s3fs use the endpoint at ``url``."""
    return {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def new_filesystem():
    """A fresh (uncached) s3fs filesystem configured from the environment."""
    import s3fs  # pylint: disable=import-outside-toplevel

    return s3fs.S3FileSystem(skip_instance_cache=True)


def _atomic_conditional_puts() -> None:
    """Make moto decide and apply a PUT of an object under one lock (S3 decides conditional PUTs atomically)."""
    from moto.s3.responses import S3Response  # pylint: disable=import-outside-toplevel

    if getattr(S3Response.put_object, "hp_atomic", False):
        return
    lock = threading.Lock()
    unlocked = S3Response.put_object

    @functools.wraps(unlocked)
    def put_object(self, *args, **kwargs):
        with lock:
            return unlocked(self, *args, **kwargs)

    put_object.hp_atomic = True
    S3Response.put_object = put_object


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    """Start moto's S3 server on 127.0.0.1 for the session and point AWS clients at it."""
    from moto.server import ThreadedMotoServer  # pylint: disable=import-outside-toplevel

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    _atomic_conditional_puts()
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    env = s3_env(url)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield S3Endpoint(url=url, env=env)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


@pytest.fixture
def s3_url(s3_endpoint: S3Endpoint) -> str:
    """``s3://<fresh bucket>/ckpt`` on the test endpoint."""
    bucket = f"t-{uuid.uuid4().hex[:16]}"
    new_filesystem().mkdir(bucket)
    return f"s3://{bucket}/ckpt"
