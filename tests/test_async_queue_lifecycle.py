"""The async queue's kept threads across a fork and a thread that cannot start: no later save waits forever."""

from __future__ import annotations

import os
import threading
import time

import pytest

from hyper_parallel.core.distributed_checkpoint import _async_queue
from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncCallsQueue, AsyncRequest


def test_a_forked_child_does_not_wait_for_its_parents_running_call() -> None:
    """The parent's thread running a call does not exist in a forked child: the child finalizes and schedules
    without waiting for it (it used to wait forever)."""
    calls = AsyncCallsQueue()
    release = threading.Event()
    calls.schedule_async_request(AsyncRequest(async_fn=release.wait, async_fn_args=(30,)))
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if both steps end within a few seconds
        code = 1
        try:
            timer = threading.Timer(10, lambda: os._exit(3))
            timer.start()
            calls.maybe_finalize_async_calls(blocking=True)
            calls.schedule_async_request(AsyncRequest(async_fn=lambda: 7))
            calls.maybe_finalize_async_calls(blocking=True)
            code = 0
        finally:
            os._exit(code)
    release.set()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    calls.maybe_finalize_async_calls(blocking=True)
    assert calls.maybe_finalize_async_calls() == 0


def test_a_call_whose_thread_cannot_start_is_not_left_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread that cannot start raises to the caller and leaves no call that later finalizes wait for."""
    calls = AsyncCallsQueue()
    monkeypatch.setattr(_async_queue._RUNNERS, "_idle", [])  # no kept idle thread: the call needs a new one

    def refuse(thread: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            calls.schedule_async_request(AsyncRequest(async_fn=lambda: 1))
    started = time.monotonic()
    assert calls.maybe_finalize_async_calls(blocking=True) == 0
    assert time.monotonic() - started < 5
    assert calls.schedule_async_request(AsyncRequest(async_fn=lambda: 2)).join(5)
    calls.maybe_finalize_async_calls(blocking=True)
