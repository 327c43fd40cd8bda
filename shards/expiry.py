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
from typing import Callable


class Expiry:
    """The TTL timer (see the module doc). ``next_expiry()``: the store's earliest
    expiry (epoch s) or None; ``expire()``: delete and publish what is due, how many
    (the server does nothing while not active); ``enabled``: the role expires keys."""

    def __init__(self, *, next_expiry: Callable[[], float | None], expire: Callable[[], int],
                 enabled: bool):
        self._next_expiry = next_expiry
        self._expire = expire
        self.enabled = enabled
        self.expired = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        """The server's loop (set when it starts)."""
        self._handle: asyncio.TimerHandle | None = None
        self._when: float | None = None

    def arm(self) -> None:
        """(Re)arm the timer for the earliest expiry, if that is sooner than armed."""
        if not self.enabled or self.loop is None:
            return
        expiry_s = self._next_expiry()
        if expiry_s is None:
            return
        when = self.loop.time() + max(0.0, expiry_s - time.time())
        if self._handle is not None:
            if self._when is not None and self._when <= when:
                return
            self._handle.cancel()
        self._when = when
        self._handle = self.loop.call_at(when, self.on_tick)

    def due_now(self) -> bool:
        """Keys are due already (they expired while this server was not serving)."""
        due = self._next_expiry() if self.enabled else None
        return due is not None and due <= time.time()

    def on_tick(self) -> None:
        """Delete every due key and publish each delete (empty value, UUID, properties),
        in one burst."""
        self._handle = None
        self._when = None
        self.expired += self._expire()
        self.arm()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
