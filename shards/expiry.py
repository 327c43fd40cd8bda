"""A server's TTL timer: one ``call_at`` for the earliest expiry in the store's heap.

When it fires, every due key is deleted and each delete is published as a KVPUB with an
empty value, an empty UUID and empty properties, in one burst. It is armed again after
each write with a TTL, at each heartbeat (a wall-clock step could have moved the
earliest expiry) and when the server becomes active (keys that expired while it was
down go before any snapshot). A role whose keys expire upstream (a relay: its shard's
deletes come to it) runs none (``Role.expires_keys``).
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from clonemap.shards.server import ShardServer


class Expiry:
    def __init__(self, server: "ShardServer"):
        self.server = server
        self.expired = 0
        self._handle: asyncio.TimerHandle | None = None
        self._when: float | None = None

    def arm(self) -> None:
        """(Re)arm the timer for the earliest expiry, if that is sooner than armed."""
        server = self.server
        if not server.role.expires_keys or server.loop is None:
            return
        expiry_s = server.store.next_expiry()
        if expiry_s is None:
            return
        when = server.loop.time() + max(0.0, expiry_s - time.time())
        if self._handle is not None:
            if self._when is not None and self._when <= when:
                return
            self._handle.cancel()
        self._when = when
        self._handle = server.loop.call_at(when, self.on_tick)

    def due_now(self) -> bool:
        """Keys are due already (they expired while this server was not serving)."""
        due = self.server.store.next_expiry() if self.server.role.expires_keys else None
        return due is not None and due <= time.time()

    def on_tick(self) -> None:
        """Delete every due key and publish each delete (empty value, UUID, properties)."""
        self._handle = None
        self._when = None
        server = self.server
        if not server.active:
            return
        for key, seq in server.store.pop_expired(time.time()):
            server.publish_delete(seq, key)
            self.expired += 1
        server._flush_log()  # the deletes go out now, in one burst
        self.arm()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
