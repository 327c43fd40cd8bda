"""Watches: a bounded stream of changes under a prefix, with an explicit end of snapshot.

Producer side (the agents' event loop thread): ``WatchHub`` keeps the open watches and
turns what the agents do into entries on each matching watch's queue:

* when a shard's first snapshot is installed (or at once, for a watch opened after it),
  the shard's current items under the prefix go in as ONE queue entry (a "chunk": a list
  captured at that instant, so a 1M-key snapshot does not overflow a 10k queue); once
  every shard has delivered its items, a ``synced`` marker follows;
* a resync (a later snapshot of a shard) goes in as one chunk of differences: a
  ``delete`` for each key that vanished, a ``put`` for each key that is new or changed;
* each applied KVPUB is one entry (``put``, or ``delete`` for an empty value);
* a data loss (the shard's server holds another map than the one this client had: see
  ``clonemap.client.agent.ResetInfo``) goes in as one chunk: a ``reset`` marker (its ``value`` is
  the ``ResetInfo``, its ``shard`` the shard) meaning "forget what you hold of this
  shard", then a ``put`` for each key of the new map under the prefix. Not a flood of
  deletes: a consumer that sees ``reset`` rebuilds that shard's part from what follows.

A watch's queue is bounded (``capacity`` entries). When it is full, the watch fails: it
is removed from the hub, and the consumer's next read raises ``SlowConsumer`` with the
counts (delivered, dropped). It never grows without bound, and never skips silently.

Consumer side: ``Watch`` (asyncio: ``async with clone.watch(p) as w: async for change in
w``) and ``SyncWatch`` (threads, for ``clonemap.client.sync.Clone``) share ``WatchCore``; only how a
consumer waits differs (a waker callable set by the front end). Values are decoded by the
consumer, not the agent, so a slow codec never slows the agent down.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, NamedTuple

from clonemap.shards.common.errors import ClonemapError, SlowConsumer, Timeout
from clonemap.client.codec import Codec
from clonemap.client.options import WATCH_CAPACITY

if TYPE_CHECKING:
    from clonemap.client.agent_view import AgentView
    from clonemap.client.events import ResetInfo

log = logging.getLogger(__name__)

PUT = "put"
DELETE = "delete"
SYNCED = "synced"
RESET = "reset"


RawChange = tuple[str, bytes, Any, int, str]
"""A change as the agents queue it: (kind, key, value bytes or a ``ResetInfo``, seq, shard)."""
Entry = RawChange | list[RawChange]
"""What a watch's queue holds: one change, or a chunk of them."""


class Change(NamedTuple):
    """One change seen by a watch. ``value`` is None for ``delete`` and ``synced``;
    ``key`` of the ``synced`` and ``reset`` markers is the watch's prefix; the value of
    ``reset`` is the ``clonemap.client.agent.ResetInfo``."""
    kind: str
    key: str
    value: Any
    seq: int
    shard: str = ""


class WatchCore:
    """The bounded queue between the agent loop (``push``) and one consumer (``pop``).

    Entries are raw tuples ``(kind, key: bytes, value: bytes, seq, shard)`` or a list of
    them (a chunk). ``deque.append``/``popleft`` are atomic, so a consumer on another
    thread may ``pop`` while the loop thread pushes."""

    def __init__(self, prefix: bytes, codec: Codec, capacity: int = WATCH_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("a watch needs capacity >= 1")
        self.prefix = prefix
        self.codec = codec
        self.capacity = capacity
        self.pending_shards: set[str] = set()
        self.delivered = 0
        self.dropped = 0
        self.failed: ClonemapError | None = None
        """Why this watch ended: it overflowed (``SlowConsumer``), or its client failed."""
        self.closed = False
        self.synced = False
        self.wake: Callable[[], None] = _nothing
        self._queue: deque[Entry] = deque()
        self._chunk: list[RawChange] = []
        self._chunk_pos = 0

    # ------------------------------------------------------------ producer (loop thread)
    def push(self, entry: Entry) -> bool:
        """Queue one entry (a tuple or a chunk). False if the watch failed on it."""
        if self.failed is not None or self.closed:
            return False
        queue = self._queue
        if len(queue) >= self.capacity:
            self.dropped = sum(len(e) if type(e) is list else 1 for e in queue) + (
                len(entry) if type(entry) is list else 1)
            queue.clear()
            self.failed = SlowConsumer(
                f"watch {self.prefix.decode('utf-8', 'replace')!r} fell behind: its queue "
                f"of {self.capacity} entries was full; {self.dropped} changes dropped "
                f"after {self.delivered} delivered", dropped=self.dropped,
                delivered=self.delivered)
            self.wake()
            return False
        queue.append(entry)
        # Decide on the wake-up *after* appending: a consumer on another thread may drain
        # the queue at any moment, and one that drained it between an emptiness check and
        # the append would sleep with this entry queued (a lost wake-up). Here, if the
        # consumer emptied the queue before the append, its length is now 1 and it is
        # woken; if it drains after the append, it pops this entry itself.
        if len(queue) == 1:
            self.wake()
        return True

    # ------------------------------------------------------------ consumer
    def pop(self) -> Change | None:
        """The next change, or None if none is queued now. Raises ``SlowConsumer`` once the
        watch has failed, ``StopIteration``-free: the caller checks ``closed``."""
        if self.failed is not None:
            self._chunk = []
            raise self.failed
        if self._chunk_pos < len(self._chunk):
            raw = self._chunk[self._chunk_pos]
            self._chunk_pos += 1
            return self._decode(raw)
        queue = self._queue
        while queue:
            try:
                entry = queue.popleft()
            except IndexError:  # cleared by a concurrent failure
                break
            if isinstance(entry, list):
                if not entry:
                    continue
                self._chunk = entry
                self._chunk_pos = 1
                return self._decode(entry[0])
            return self._decode(entry)
        if self.failed is not None:
            raise self.failed
        return None

    def pop_raw(self, limit: int) -> list[RawChange]:
        """Up to ``limit`` queued entries as raw tuples ``(kind, key: bytes, value: bytes,
        seq, shard)`` (chunks flattened), not decoded: for a consumer that hands them to
        other processes (``clonemap.client.workers``). Raises ``SlowConsumer`` like ``pop``."""
        if self.failed is not None:
            self._chunk = []
            raise self.failed
        out: list[RawChange] = []
        queue = self._queue
        while len(out) < limit:
            if self._chunk_pos < len(self._chunk):
                take = self._chunk[self._chunk_pos:self._chunk_pos + limit - len(out)]
                self._chunk_pos += len(take)
                out.extend(take)
                continue
            try:
                entry = queue.popleft()
            except IndexError:  # empty, or cleared by a concurrent failure
                break
            if isinstance(entry, list):
                self._chunk, self._chunk_pos = entry, 0
            else:
                out.append(entry)
        if not out and self.failed is not None:
            raise self.failed
        self.delivered += len(out)
        if any(raw[0] == SYNCED for raw in out):
            self.synced = True
        return out

    def has_pending(self) -> bool:
        """Something to pop (or a failure to raise)."""
        return (self.failed is not None or self._chunk_pos < len(self._chunk)
                or bool(self._queue))

    def _decode(self, raw: RawChange) -> Change:
        kind, key, value, seq, shard = raw
        self.delivered += 1
        if kind == SYNCED:
            self.synced = True
            return Change(SYNCED, key.decode("utf-8"), None, seq, shard)
        if kind == RESET:
            return Change(RESET, key.decode("utf-8"), value, seq, shard)
        return Change(kind, key.decode("utf-8"),
                      self.codec.decode(value) if value else None, seq, shard)


def _nothing() -> None:
    pass


class WatchHub:
    """The open watches of one client, fed by its shard agents (loop thread only)."""

    def __init__(self) -> None:
        self.watches: list[WatchCore] = []

    def add(self, core: WatchCore, agents: Iterable["AgentView"]) -> None:
        """Register ``core``; deliver what the synced shards already hold."""
        self.watches.append(core)
        last_seq = 0
        for agent in agents:
            if agent.synced:
                last_seq = agent.last_seq
                core.push(_items_chunk(agent.map, core.prefix, agent.last_seq, agent.name,
                                       agent.seqs))
            else:
                core.pending_shards.add(agent.name)
        if not core.pending_shards:
            core.push((SYNCED, core.prefix, b"", last_seq, ""))

    def remove(self, core: WatchCore) -> None:
        try:
            self.watches.remove(core)
        except ValueError:
            pass

    def changed(self, shard: str, key: bytes, value: bytes, seq: int) -> None:
        """One applied KVPUB (hot path: called only when there are watches)."""
        entry = (PUT if value else DELETE, key, value, seq, shard)
        failed = None
        for core in self.watches:
            if key.startswith(core.prefix) and not core.push(entry):
                failed = True
        if failed:
            self._drop_failed()

    def installed(self, shard: str, old: dict[bytes, bytes], new: dict[bytes, bytes],
                  seq: int, seqs: Mapping[bytes, int]) -> None:
        """A snapshot of ``shard`` (at ``seq``; ``seqs``: each key's own) replaced ``old``
        by ``new``."""
        if not self.watches:
            return
        diff = None
        for core in self.watches:
            if shard in core.pending_shards:
                core.pending_shards.discard(shard)
                core.push(_items_chunk(new, core.prefix, seq, shard, seqs))
                if not core.pending_shards:
                    core.push((SYNCED, core.prefix, b"", seq, shard))
                continue
            if diff is None:
                diff = snapshot_diff(old, new, seq, shard, seqs)
            part = [e for e in diff if e[1].startswith(core.prefix)] if core.prefix else diff
            if part:
                core.push(part)
        self._drop_failed()

    def reset(self, shard: str, info: "ResetInfo", new: dict[bytes, bytes] | None, seq: int,
              seqs: Mapping[bytes, int]) -> None:
        """``shard`` lost its data: a ``reset`` marker, then the new map's items (none
        when ``new`` is None: the client keeps its old copy)."""
        if not self.watches:
            return
        for core in self.watches:
            if shard in core.pending_shards:
                continue  # this watch has nothing of the shard yet: nothing to forget
            chunk: list[RawChange] = [(RESET, core.prefix, info, seq, shard)]
            if new is not None:
                chunk.extend(_items_chunk(new, core.prefix, seq, shard, seqs))
            core.push(chunk)
        self._drop_failed()

    def _drop_failed(self) -> None:
        self.watches = [c for c in self.watches if c.failed is None and not c.closed]

    def end_all(self, failed: ClonemapError | None = None) -> None:
        """Every watch ends: it raises ``failed`` (the client failed), or, with None,
        ends as closed (the client closed). None is watched from now on."""
        for core in self.watches:
            if failed is not None:
                core.failed = failed
            else:
                core.closed = True
            core.wake()
        self.watches.clear()


def _items_chunk(data: dict[bytes, bytes], prefix: bytes, seq: int, shard: str,
                 seqs: Mapping[bytes, int]) -> list[RawChange]:
    """A put for each key of ``data`` under ``prefix``, with the key's own sequence (the
    one ``meta(key).seq`` and ``--if-seq`` use; ``seq``, the snapshot's, where the server
    sent none or 0, as the guide's server does)."""
    own = seqs.get
    return [(PUT, k, v, own(k, 0) or seq, shard) for k, v in data.items()
            if not prefix or k.startswith(prefix)]


def snapshot_diff(old: dict[bytes, bytes], new: dict[bytes, bytes], seq: int,
                  shard: str, seqs: Mapping[bytes, int]) -> list[RawChange]:
    """The changes that turn ``old`` into ``new``: deletes (keys that vanished, the
    "ghosts" a guide client would keep; at the snapshot's ``seq``), then puts (new or
    changed keys, at their own sequences)."""
    out: list[RawChange] = [(DELETE, k, b"", seq, shard) for k in old.keys() - new.keys()]
    get, own = old.get, seqs.get
    out.extend((PUT, k, v, own(k, 0) or seq, shard) for k, v in new.items() if get(k) != v)
    return out


class Watch:
    """An asyncio watch: ``async with clone.watch("/orders/") as w: async for change in w``.

    Yields ``Change`` items: the current items under the prefix (``put``), then one
    ``synced`` marker (``w.synced`` is True from then on), then live changes. Raises
    ``SlowConsumer`` if the bounded queue overflowed. Ends when closed."""

    def __init__(self, core: WatchCore, open_fn: Callable[[WatchCore], None],
                 close_fn: Callable[[WatchCore], None]):
        self._core = core
        self._open_fn = open_fn
        self._close_fn = close_fn
        self._waiter: asyncio.Future[None] | None = None
        self._opened = False
        core.wake = self._wake

    @property
    def synced(self) -> bool:
        return self._core.synced

    @property
    def delivered(self) -> int:
        return self._core.delivered

    @property
    def prefix(self) -> str:
        return self._core.prefix.decode("utf-8")

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def open(self) -> "Watch":
        if not self._opened:
            self._opened = True
            self._open_fn(self._core)
        return self

    def close(self) -> None:
        if not self._core.closed:
            self._core.closed = True
            self._close_fn(self._core)
            self._wake()

    async def __aenter__(self) -> "Watch":
        return self.open()

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __aiter__(self) -> "Watch":
        self.open()
        return self

    async def __anext__(self) -> Change:
        core = self._core
        while True:
            change = core.pop()
            if change is not None:
                return change
            if core.closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


DELIVER_THREAD = "thread"
DELIVER_INLINE = "inline"
DELIVER_MODES = (DELIVER_THREAD, DELIVER_INLINE)


class SyncWatch:
    """A watch for the synchronous ``Clone``: a blocking iterator, or a callback.

    Where a callback runs (``deliver``; the guide's Black Box hands updates to workers):

    * ``"thread"`` (default): on a dispatcher thread of its own, which also decodes the
      values. The agents' loop thread only queues raw entries, so a slow callback cannot
      stall the sockets: it fills this watch's bounded queue and then fails it
      (``SlowConsumer``).
    * ``"inline"``: on the agents' loop thread, at once, as each change is applied
      (decode included). No queue builds up here and no thread hop is paid, but every
      microsecond the callback takes is a microsecond the loop is not reading the
      sockets: a slow callback makes the *client* fall behind (the server clock then
      reports it: ``max_lag_s``, ``slow_policy``). Keep it short.

    With a callback, a ``SlowConsumer`` goes to ``on_error`` (or is logged) and is kept in
    ``error``; without one, iteration raises it."""

    def __init__(self, core: WatchCore, open_fn: Callable[[WatchCore], None],
                 close_fn: Callable[[WatchCore], None],
                 callback: Callable[[Change], Any] | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 deliver: str = DELIVER_THREAD) -> None:
        if deliver not in DELIVER_MODES:
            raise ValueError(f"deliver is one of {', '.join(DELIVER_MODES)}, got {deliver!r}")
        if deliver == DELIVER_INLINE and callback is None:
            raise ValueError("deliver='inline' needs a callback")
        self.deliver = deliver
        self._core = core
        self._open_fn = open_fn
        self._close_fn = close_fn
        self._cond = threading.Condition()
        self.callback = callback
        self.on_error = on_error
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._draining = False
        core.wake = self._wake
        if deliver == DELIVER_INLINE:
            core.wake = self._drain_inline
        elif callback is not None:
            self._thread = threading.Thread(
                target=self._dispatch, daemon=True,
                name=f"clonemap-watch {core.prefix.decode('utf-8', 'replace')}")

    @property
    def synced(self) -> bool:
        return self._core.synced

    @property
    def delivered(self) -> int:
        return self._core.delivered

    def has_pending(self) -> bool:
        """Changes are queued that no iterator or callback has taken yet."""
        return self._core.has_pending()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def open(self) -> "SyncWatch":
        self._open_fn(self._core)
        if self._thread is not None:
            self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        if not self._core.closed:
            self._core.closed = True
            self._close_fn(self._core)
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread() \
                and self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> "SyncWatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, timeout_s: float | None = None) -> Change | None:
        """The next change; None once the watch is closed. Raises ``SlowConsumer``, or
        ``Timeout`` if nothing came within ``timeout_s``."""
        core = self._core
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            change = core.pop()
            if change is not None:
                return change
            with self._cond:
                while not core.has_pending() and not core.closed:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise Timeout(f"watch {core.prefix!r}: no change within "
                                      f"{timeout_s} s", what="change", deadline_s=timeout_s)
                    self._cond.wait(remaining)
            if core.closed and not core.has_pending():
                return None

    def get_raw(self, limit: int, timeout_s: float) -> list[RawChange]:
        """Up to ``limit`` raw, undecoded entries (``WatchCore.pop_raw``), waiting at most
        ``timeout_s`` for the first; [] if none came or the watch is closed."""
        core = self._core
        out = core.pop_raw(limit)
        if out:
            return out
        with self._cond:
            if not core.has_pending() and not core.closed:
                self._cond.wait(timeout_s)
        return core.pop_raw(limit)

    def __iter__(self) -> Iterator[Change]:
        return self

    def __next__(self) -> Change:
        change = self.get()
        if change is None:
            raise StopIteration
        return change

    def _drain_inline(self) -> None:
        """``deliver="inline"``: the core's waker, on the loop thread: run the callback
        on everything queued (one entry, or one snapshot chunk), now."""
        callback = self.callback
        if self._draining or callback is None:  # a callback that made the hub push again:
            return                              # its loop drains it
        self._draining = True
        core = self._core
        try:
            while True:
                change = core.pop()
                if change is None:
                    return
                try:
                    callback(change)
                except Exception:
                    logging.getLogger(__name__).exception(
                        "watch callback failed on %s %r", change.kind, change.key)
        except SlowConsumer as exc:
            if self.error is None:
                self.error = exc
                if self.on_error is not None:
                    self.on_error(exc)
                else:
                    logging.getLogger(__name__).error("%s", exc)
        finally:
            self._draining = False
        with self._cond:
            self._cond.notify_all()

    def _dispatch(self) -> None:
        log = logging.getLogger(__name__)
        callback = self.callback
        if callback is None:
            return
        try:
            for change in self:
                try:
                    callback(change)
                except Exception:
                    log.exception("watch callback failed on %s %r", change.kind, change.key)
        except SlowConsumer as exc:
            self.error = exc
            if self.on_error is not None:
                self.on_error(exc)
            else:
                log.error("%s", exc)
