"""The synchronous client, ``Clone``: an ``AsyncClone`` run on a uvloop loop in a background
thread (see ``clonemap.client.clone`` for what the client does; applications import it as
``from clonemap import Clone``).

Calls from other threads reach the loop two ways: blocking calls (``start``, ``flush``,
``set(..., wait=True)``, ``items``) run a coroutine on the loop and wait for it with a
deadline; fire-and-forget ``set``/``delete`` go through an outbox the loop drains in one
wake-up, so a burst of writes costs one cross-thread call, not one per write.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
from collections import deque
from typing import Any, Callable, Coroutine, TypeVar

import uvloop

from clonemap.shards.common.errors import Timeout
from clonemap.client.clone import AsyncClone
from clonemap.client.codec import Codec
from clonemap.client.errors import NotRunning
from clonemap.client.events import KeyMeta
from clonemap.client.router import Cluster
from clonemap.client.watch import DELIVER_MODES, DELIVER_THREAD, Change, SyncWatch, WatchCore

T = TypeVar("T")
SWITCH_INTERVAL_S = 0.0005
"""The thread switch interval a ``Clone`` asks for (CPython's default is 5 ms)."""
READ_TRIES = 3
"""Copies of the maps ``items``/``keys`` try on the calling thread before the loop's."""


class Clone:
    """The synchronous client: the same agents, run on a uvloop loop in a background
    thread. Every method is thread-safe; blocking calls have a deadline (``timeout_s``)
    and raise ``clonemap.shards.common.errors.Timeout``. ``get``/``len`` read the map directly (one dict
    operation, atomic in CPython); ``set``/``delete`` queue the KVSET for the loop thread
    and return at once (fire-and-forget); ``items``/``keys`` copy on the calling thread."""

    def __init__(self, servers: Any = None, *, deliver: str = DELIVER_THREAD,
                 switch_interval_s: float | None = SWITCH_INTERVAL_S,
                 **kwargs: Any) -> None:
        """``servers``/``shards``/``config``/``control``, ``context`` and the options
        (``clonemap.client.options.ClientOptions``: its fields as keywords, or ``options=``) are
        ``AsyncClone``'s.

        ``switch_interval_s``: the interpreter's thread switch interval is lowered to this
        (``sys.setswitchinterval``; never raised; None leaves it). The loop thread applies
        updates only when it holds the GIL, and a thread that computes (or reads the map in
        a loop) keeps it for the whole interval: at CPython's 5 ms, a reader saw changes
        3.5 ms late at the median and 7 ms at p99 (``bench peers --workloads read``)."""
        if switch_interval_s is not None:
            if not switch_interval_s > 0:
                raise ValueError(f"switch_interval_s must be > 0, got {switch_interval_s!r}")
            if sys.getswitchinterval() > switch_interval_s:
                sys.setswitchinterval(switch_interval_s)
        if deliver not in DELIVER_MODES:
            raise ValueError(f"deliver is one of {', '.join(DELIVER_MODES)}, got {deliver!r}")
        self.deliver = deliver
        """Default for ``watch(callback=...)``: "thread" (a dispatcher thread per watch
        decodes and calls back) or "inline" (on the client's loop thread)."""
        self._async = AsyncClone(servers, **kwargs)
        # a read is the async client's own method, called from this thread: no hop, and
        # no second call on the way (``get`` below documents it)
        self.get = self._async.get  # type: ignore[method-assign]
        self.options = self._async.options
        """Every option this client was made with (``clonemap.client.options.ClientOptions``)."""
        self.timeout_s = timeout_s = self._async.timeout_s
        self._outbox: deque[tuple[Callable[[Any], Any], Any]] = deque()
        self._wake_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._loop_ready = threading.Event()
        self._closed = False
        self._linger_s = 0.0
        self._watches: list[SyncWatch] = []
        self._thread = threading.Thread(target=self._run, name="clonemap-client", daemon=True)
        self._loop_error: BaseException | None = None
        self._thread.start()
        if not self._loop_ready.wait(timeout_s) or self._loop_error is not None:
            # the loop thread did not come up in time, or died first: never hang here.
            # A thread that comes up later sees _closed (set before _loop is read here)
            # or is stopped through _stopped, and ends.
            self._closed = True
            if self._loop is not None and self._stopped is not None:
                self._loop.call_soon_threadsafe(self._stopped.set)
            self._async.release_unstarted()
            if self._loop_error is not None:
                raise NotRunning(f"the client's loop thread failed to start: "
                                 f"{self._loop_error!r}") from self._loop_error
            raise Timeout(f"the client's loop thread did not start within {timeout_s} s",
                          what="loop thread", deadline_s=timeout_s)
        try:
            self._call(self._async.start(), timeout_s + 1.0)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        try:
            with asyncio.Runner(loop_factory=self._loop_factory) as runner:
                self._loop = runner.get_loop()
                runner.run(self._serve())
        except BaseException as exc:  # reported to __init__ if it is still waiting
            self._loop_error = exc
            self._loop_ready.set()
            if self._stopped is None:
                return
            raise

    _loop_factory = staticmethod(uvloop.new_event_loop)
    """How the loop thread makes its loop (a seam for the start-up deadline test)."""

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        self._loop_ready.set()
        if self._closed:  # __init__ gave up waiting for this thread
            return
        await self._stopped.wait()
        await self._async.close(self._linger_s)

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop thread and wait for it, with a deadline."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking Clone call from its own loop thread")
        if self._closed or not self._thread.is_alive() or self._loop is None:
            coro.close()
            raise NotRunning("this client is closed")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:  # the builtin TimeoutError since 3.11
            if fut.done():
                raise  # the coroutine's own error (e.g. start()'s Timeout)
            fut.cancel()
            raise Timeout(f"client call not done within {timeout_s} s", what="call",
                          deadline_s=timeout_s) from None

    def _post(self, fn: Callable[[Any], Any], arg: Any) -> None:
        """Queue ``fn(arg)`` for the loop thread; one wake-up per burst."""
        if self._closed or self._loop is None:
            raise NotRunning("this client is closed")
        self._outbox.append((fn, arg))
        if not self._wake_scheduled:
            self._wake_scheduled = True
            self._loop.call_soon_threadsafe(self._flush_outbox)

    def _flush_outbox(self) -> None:
        self._wake_scheduled = False
        outbox = self._outbox
        while outbox:
            fn, arg = outbox.popleft()
            fn(arg)

    # ------------------------------------------------------------------ lifecycle
    def close(self, linger_s: float = 0.0) -> None:
        """Stop the loop thread and close every socket (``linger_s`` as for
        ``AsyncClone.close``)."""
        if self._closed:
            return
        self._linger_s = linger_s
        for watch in list(self._watches):
            watch.close()
        self._closed = True
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._flush_and_stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(self.timeout_s)

    def _flush_and_stop(self) -> None:
        self._flush_outbox()
        if self._stopped is not None:
            self._stopped.set()

    def __enter__(self) -> "Clone":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ reads
    def get(self, key: str, default: Any = None) -> Any:
        """``key``'s value in the local map, or ``default``: read on the calling thread,
        no round trip, no lock (``AsyncClone.get``; each instance calls it directly)."""
        return self._async.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self._async

    def __len__(self) -> int:
        return len(self._async)

    def properties(self, key: str) -> dict[str, str]:
        return self._async.properties(key)

    def meta(self, key: str) -> KeyMeta | None:
        """``AsyncClone.meta``: the sequence that last changed ``key``, its expiry and
        properties (a ``KeyMeta``), or None."""
        return self._async.meta(key)

    def items(self, prefix: str = "") -> list[tuple[str, Any]]:
        """``AsyncClone.items``, read on the calling thread: each shard's map is copied
        in one step (the loop thread cannot change it half-way), shards one after the
        other, as the loop thread would."""
        return self._read(self._async.items, prefix)

    def keys(self, prefix: str = "") -> list[str]:
        """``AsyncClone.keys``, read on the calling thread like ``items``."""
        return self._read(self._async.keys, prefix)

    def _read(self, read: Callable[[str], T], prefix: str) -> T:
        if self._closed:
            raise NotRunning("this client is closed")
        for _ in range(READ_TRIES):
            try:
                return read(prefix)
            except RuntimeError:  # a map changed while copied: only if the copy ran
                continue          # Python code (a finalizer) and the loop thread got in
        return self._call(_run_sync(read, prefix))

    @property
    def version_vector(self) -> dict[str, int]:
        return self._async.version_vector

    @property
    def subtree(self) -> str:
        return self._async.subtree

    def stats(self) -> dict[str, Any]:
        return self._call(_run_sync(self._async.stats))

    def rights(self, timeout_s: float | None = None) -> dict[str, Any]:
        """``AsyncClone.rights``: this identity's rights as the cluster sees them."""
        return self._call(self._async.rights(timeout_s))

    @property
    def narrowed(self) -> bool:
        """``AsyncClone.narrowed``."""
        return self._async.narrowed

    # ------------------------------------------------------------------ writes
    def set(self, key: str, value: Any, ttl: float | None = None, *, wait: bool = False,
            timeout_s: float | None = None, if_seq: int | None = None,
            create: bool = False) -> Any:
        """Queue a KVSET (fire-and-forget); returns its 16-byte UUID. ``wait=True``:
        block until the owning shard published it back (``Timeout`` otherwise).
        ``if_seq`` / ``create``: a conditional write, as ``AsyncClone.set`` (returns its
        sequence, or raises ``Conflict``)."""
        if value is None:
            raise ValueError("value is None: use delete() to delete a key")
        if wait or create or if_seq is not None:
            return self._wait_call(self._async.set(key, value, ttl, wait=True,
                                                   timeout_s=timeout_s, if_seq=if_seq,
                                                   create=create), timeout_s)
        agent, frames, uuid = self._async.prepare_write(key, value, ttl)
        self._post(agent.writes.send_kvset, frames)
        return uuid

    def delete(self, key: str, *, wait: bool = False, timeout_s: float | None = None,
               if_seq: int | None = None) -> Any:
        if wait or if_seq is not None:
            return self._wait_call(self._async.delete(key, wait=True, timeout_s=timeout_s,
                                                      if_seq=if_seq), timeout_s)
        agent, frames, uuid = self._async.prepare_write(key, None, None)
        self._post(agent.writes.send_kvset, frames)
        return uuid

    def _wait_call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
        # queued fire-and-forget writes go first, so per-key order holds
        self._post(lambda _: None, None)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return self._call(coro, timeout_s + 1.0)

    def flush(self, timeout_s: float | None = None) -> None:
        """Until every queued KVSET has been handed to ZeroMQ."""
        self._post(lambda _: None, None)
        self._call(self._async.flush(timeout_s))

    @property
    def codec(self) -> Codec:
        """The value codec (``codec=``)."""
        return self._async.codec

    @property
    def shard_names(self) -> list[str]:
        return self._async.shard_names

    @property
    def cluster(self) -> Cluster | None:
        return self._async.cluster

    @property
    def routing_epoch(self) -> int:
        """The epoch of the routing this client routes by (0: no cluster yet), as
        ``AsyncClone.routing_epoch``."""
        return self._async.routing_epoch

    @property
    def routing_followed(self) -> int:
        """How many later routings this client followed in place."""
        return self._async.routing_followed

    # ------------------------------------------------------------------ watches
    def watch(self, prefix: str = "", callback: Callable[[Change], Any] | None = None, *,
              on_error: Callable[[BaseException], None] | None = None,
              capacity: int | None = None, deliver: str | None = None) -> SyncWatch:
        """With ``callback``: call it with each ``Change`` until ``close()``, on a
        dispatcher thread (``deliver="thread"``, the client's default) or on the client's
        loop thread (``"inline"``: see ``SyncWatch``). Without: a blocking iterator
        (``with clone.watch(p) as w: for c in w``). Either way: items under the prefix,
        a ``synced`` marker, live changes."""
        if deliver is None:
            deliver = self.deliver if callback is not None else DELIVER_THREAD
        core = self._async.new_watch_core(prefix, capacity)

        def open_core(c: WatchCore) -> None:
            self._call(_run_sync(self._async.open_watch_core, c))

        def close_core(c: WatchCore) -> None:
            if not self._closed and self._thread.is_alive() and self._loop is not None:
                self._loop.call_soon_threadsafe(self._async.close_watch_core, c)
            if watch in self._watches:
                self._watches.remove(watch)

        watch = SyncWatch(core, open_core, close_core, callback, on_error, deliver)
        self._watches.append(watch)
        return watch.open()


async def _run_sync(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)
