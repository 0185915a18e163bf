"""Async calls run on kept threads: no thread is started at the end of an async save's blocking part."""

from __future__ import annotations

import os
import threading

from hyper_parallel.core.distributed_checkpoint import _async_queue
from hyper_parallel.core.distributed_checkpoint._async_queue import AsyncCallsQueue, AsyncRequest


def _recording(threads: list[threading.Thread], names: list[str]):
    def work() -> int:
        threads.append(threading.current_thread())
        names.append(threading.current_thread().name)
        return len(threads)

    return work


def test_a_call_after_a_finished_one_reuses_its_thread_and_names_it_per_call() -> None:
    threads: list[threading.Thread] = []
    names: list[str] = []
    queue = AsyncCallsQueue()
    first = queue.schedule_async_request(AsyncRequest(async_fn=_recording(threads, names)))
    assert first.join(10) and first.background_done()
    queue.maybe_finalize_async_calls(blocking=True)
    started = threading.active_count()
    second = queue.schedule_async_request(AsyncRequest(async_fn=_recording(threads, names)))
    assert threading.active_count() == started, "no thread started for the second call"
    assert second.join(10)
    assert second.finalize() == 2
    assert threads[0] is threads[1], "the second call ran on the first call's (kept) thread"
    assert names[0] != names[1] and all(name.startswith("hp-ckpt-async-") for name in names)
    queue.close()


def test_a_call_scheduled_while_the_previous_still_runs_gets_a_thread_of_its_own() -> None:
    """The previous call let its finalization run (``ready``) and goes on (a coordinator's commit): the next call
    does not wait for it."""
    ready, release = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []
    names: list[str] = []

    def committing() -> str:
        threads.append(threading.current_thread())
        ready.set()
        release.wait(10)
        return "committed"

    queue = AsyncCallsQueue()
    first = queue.schedule_async_request(AsyncRequest(async_fn=committing, ready=ready))
    assert first.wait(10)
    second = queue.schedule_async_request(AsyncRequest(async_fn=_recording(threads, names)))
    assert second.join(10), "the second call ran while the first one still runs"
    assert not first.background_done() and threads[0] is not threads[1]
    release.set()
    assert first.join(10)
    queue.close()


def test_a_forked_child_runs_its_calls_on_threads_of_its_own() -> None:
    """The parent's kept (idle) threads do not exist in a forked child: its calls still run."""
    queue = AsyncCallsQueue()
    parent = queue.schedule_async_request(AsyncRequest(async_fn=lambda: "parent"))
    assert parent.finalize() == "parent"  # an idle kept thread now waits in the parent
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's outcome is its exit code
        code = 1
        try:
            child = AsyncCallsQueue().schedule_async_request(AsyncRequest(async_fn=lambda: "child"))
            code = 0 if child.join(5) and child.finalize() == "child" else 2
        finally:
            os._exit(code)  # pylint: disable=protected-access
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, "the child's call ran"
    queue.close()


def test_a_call_ends_once_its_thread_is_idle_again_and_named_so() -> None:
    """A call counts as ended only once its kept thread is idle again: a call scheduled right after the previous
    one ended runs on that thread (no thread started, no ``Thread.start`` wait), and an idle thread no longer
    carries the name of the call it ran."""
    threads: list[threading.Thread] = []
    release = threading.Event()

    def work() -> int:
        threads.append(threading.current_thread())
        release.wait(10)
        return len(threads)

    queue = AsyncCallsQueue()
    queue.maybe_finalize_async_calls(blocking=True)
    first = queue.schedule_async_request(AsyncRequest(async_fn=work))
    with _async_queue._RUNNERS._lock:  # pylint: disable=protected-access  # the thread cannot become idle yet
        release.set()
        assert not first.join(0.5), "the call counted as ended while its thread was not idle yet"
    assert first.join(10) and first.finalize() == 1
    assert threads[0].name == _async_queue._Runners.IDLE_NAME  # pylint: disable=protected-access
    for expected in range(2, 12):  # each call scheduled as soon as the previous one ended
        call = queue.schedule_async_request(AsyncRequest(async_fn=work))
        assert call.join(10) and call.finalize() == expected
    assert set(threads) == {threads[0]}, "every call ran on the one kept thread"
    queue.close()
