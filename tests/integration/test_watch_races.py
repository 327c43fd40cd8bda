"""Races between the agent loop and a watch's consumer, forced by deterministic
interleavings (hooks at the exact step), never by sleeps; and the client's start-up
deadline for its loop thread.

The lost wake-up: ``WatchCore.push`` once decided whether to wake the consumer *before*
appending. A consumer that drained the queue between that decision and the append went
to sleep with the entry queued, until the queue filled and the watch failed with a false
``SlowConsumer``.
"""
from __future__ import annotations

import threading
from collections import deque

import pytest

from clonemap.client.codec import get_codec
from clonemap.client.watch import PUT, SyncWatch, WatchCore
from clonemap.shards.common.errors import Timeout

pytestmark = pytest.mark.timeout(30)


def _entry(key: bytes, seq: int):
    return (PUT, key, b"v", seq, "s0")


class _HookedQueue(deque):
    """A deque whose ``append`` runs ``hook`` first: the consumer's turn, forced to fall
    between whatever the producer did before the append and the append itself."""

    hook = None

    def append(self, item):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        super().append(item)


def test_consumer_draining_just_before_the_append_is_woken():
    core = WatchCore(b"", get_codec("bytes"), capacity=8)
    wakes = []
    core.wake = lambda: wakes.append(len(core._queue))
    core._queue = _HookedQueue()
    assert core.push(_entry(b"a", 1))
    assert wakes == [1]  # an empty queue got an entry: woken

    drained = []

    def consumer_drains():  # the consumer empties the queue at this exact step
        while (change := core.pop()) is not None:
            drained.append(change.key)

    core._queue.hook = consumer_drains
    assert core.push(_entry(b"b", 2))
    assert drained == ["a"]
    assert list(core._queue) == [_entry(b"b", 2)]
    # the consumer now sleeps on an empty-looking queue: it must have been woken for "b"
    assert wakes == [1, 1]
    assert core.pop().key == "b"


def test_no_wake_while_the_consumer_still_has_entries_to_pop():
    core = WatchCore(b"", get_codec("bytes"), capacity=8)
    wakes = []
    core.wake = lambda: wakes.append(True)
    core.push(_entry(b"a", 1))
    core.push(_entry(b"b", 2))
    core.push(_entry(b"c", 3))
    assert len(wakes) == 1  # only the first entry into an empty queue wakes
    assert [core.pop().key for _ in range(3)] == ["a", "b", "c"]


class _WatchedCondition(threading.Condition):
    """A Condition that says when a thread has started to wait on it."""

    def __init__(self):
        super().__init__()
        self.waiting = threading.Event()
        self.woken: list[bool] = []
        """Per wait: True if a notify ended it, False if its timeout did."""

    def wait(self, timeout=None):
        self.waiting.set()
        woken = super().wait(timeout)
        self.woken.append(woken)
        return woken


def test_sync_watch_consumer_asleep_after_the_forced_interleaving_gets_the_entry():
    """A real consumer thread blocked in ``SyncWatch.get``: the producer's push of "b" is
    interleaved so that the consumer pops "a" and goes to sleep between the producer's
    start of ``push`` and its append. With the lost wake-up nothing woke the consumer:
    it found "b" only when its own timeout ended the wait. Now a notify wakes it."""
    core = WatchCore(b"", get_codec("bytes"), capacity=8)
    watch = SyncWatch(core, lambda c: None, lambda c: None)
    cond = _WatchedCondition()
    watch._cond = cond
    core.push(_entry(b"a", 1))
    core._queue = _HookedQueue(core._queue)

    got: list = []
    errors: list = []
    release = threading.Event()

    def consumer():
        try:
            release.wait(10)
            got.append(watch.get(timeout_s=10).key)  # "a"
            got.append(watch.get(timeout_s=5).key)  # sleeps, then must get "b"
        except BaseException as exc:  # reported below
            errors.append(exc)

    def let_the_consumer_drain_and_sleep():
        cond.waiting.clear()
        release.set()
        assert cond.waiting.wait(10), "the consumer never went to sleep"

    thread = threading.Thread(target=consumer)
    thread.start()
    core._queue.hook = let_the_consumer_drain_and_sleep
    assert core.push(_entry(b"b", 2))
    thread.join(15)
    assert not thread.is_alive()
    assert errors == []
    assert got == ["a", "b"]
    assert cond.woken == [True]  # woken by the producer, not by its own timeout


def test_clone_start_has_a_deadline_when_its_loop_thread_never_comes_up():
    from clonemap.client.sync import Clone

    gate = threading.Event()

    class StuckClone(Clone):
        @staticmethod
        def _loop_factory():
            gate.wait(20)  # a loop that takes forever to be made
            import uvloop
            return uvloop.new_event_loop()

    try:
        with pytest.raises(Timeout, match="loop thread did not start within 0.3 s"):
            StuckClone("tcp://127.0.0.1:1", timeout_s=0.3)
    finally:
        gate.set()


def test_clone_start_reports_a_loop_thread_that_failed():
    from clonemap.client.errors import NotRunning
    from clonemap.client.sync import Clone

    class BrokenClone(Clone):
        @staticmethod
        def _loop_factory():
            raise OSError("no event loop for you")

    with pytest.raises(NotRunning, match="no event loop for you"):
        BrokenClone("tcp://127.0.0.1:1", timeout_s=5)
