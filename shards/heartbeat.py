"""A server's HUGZ on its publisher (P+1): one timer for both heartbeat rules, and a
welcome for each new subscription.

* The *clock*: every ``clock_s`` (0.5 s by default; 0 disables), busy or not, a HUGZ whose
  properties frame carries the server clock, ``ts=<epoch s, 6 decimals>\\nseq=<current
  sequence>\\n`` (our deviation from 12/CHP, whose HUGZ has frame 3 empty; see
  ``chp.hugz``): a client compares ``ts`` with its own clock to see how far behind the
  publisher it reads, even under a subtree filter where sequence gaps are normal.
* The *idle heartbeat*: every ``heartbeat_s``, a HUGZ if nothing else was published since
  the last beat (with the clock on, it carries the clock too). The timer runs every
  ``min(heartbeat_s, clock_s)``, and also runs the reactor's periodic duties
  (``ShardServer.on_beat``).
* The *welcome*: each new subscription is answered with one HUGZ (coalesced per loop
  turn): a client's SUB knows its subscription is live when a message arrives, and asks
  for its snapshot only then. Without it, a snapshot point taken before the publisher
  applied the subscription would lose the updates published in between (12/CHP's "slow
  joiner" gap). Sent in every role: a server that would not answer an ICANHAZ now says
  so in it (``serving=0``), and the client asks the other server of its pair at once.
  A server that becomes active sends one at once too.

Every HUGZ says the map's generation and routing, and ``cas=1`` when the role decides
conditional writes. Its sequence is the last *published* one (updates held for an fsync
or parked for the passive are not announced before they go out).
"""
from __future__ import annotations

import asyncio
import time

import zmq

from clonemap.shards.common import zio
from clonemap.shards.common.proto import chp
from clonemap.shards.roles import Reactor


SUBSCRIPTION_CHECK_S = 0.05
"""How often the publisher is checked for new subscriptions besides its FD's edges."""


class Heartbeat:
    """The HUGZ of one server (see the module doc)."""

    def __init__(self, server: Reactor):
        self.server = server
        self.sent = 0
        self.welcomed = 0
        self._reader: zio.AsyncSocket | None = None
        self._pub: zmq.Socket | None = None
        self._gate = None
        self._welcome: asyncio.Handle | None = None
        self._check: asyncio.TimerHandle | None = None
        self._beat: asyncio.TimerHandle | None = None
        self._seq_at_beat = 0
        self._beat_at = 0.0
        self._clock_at = 0.0

    @property
    def interval_s(self) -> float:
        config = self.server.config
        clock_s, heartbeat_s = config.clock_s, config.heartbeat_s
        return min(heartbeat_s, clock_s) if clock_s > 0 else heartbeat_s

    def read_subscriptions(self) -> None:
        """Apply the subscriptions waiting on the publisher now. A snapshot point is taken
        after them: a peer that subscribed and then asked for a snapshot misses nothing
        between the two (the publisher applies subscriptions itself only as it reads
        them: ``ZMQ_XPUB_MANUAL``)."""
        if self._reader is not None:
            self._reader.read_now()

    def kick(self) -> None:
        """Look at the publisher again on the next turn (after a call on it elsewhere
        that may have taken its FD's edge)."""
        if self._reader is not None:
            self._reader.kick()

    def start(self, loop: asyncio.AbstractEventLoop, pub: zmq.Socket, gate=None) -> None:
        """Beat on the publisher ``pub`` (P+1), reading its subscriptions. ``gate``
        (``clonemap.shards.gate.Gate``): the publisher applies no subscription itself
        (``ZMQ_XPUB_MANUAL``); each is applied here, narrowed to its subscriber's rights
        (``on_subscription_as``)."""
        self._pub = pub
        self._gate = gate
        if gate is None:
            self._reader = zio.AsyncSocket(pub, self.on_subscription, batch=256,
                                           loop=loop, name="publisher")
        else:
            self._reader = zio.AsyncSocket(pub, self.on_subscription_as, batch=256,
                                           loop=loop, name="publisher", with_user=True)
        self._check = loop.call_later(SUBSCRIPTION_CHECK_S, self._check_subscriptions)
        self._beat_at = self._clock_at = loop.time()
        self._beat = loop.call_later(self.interval_s, self.on_beat)

    def close(self) -> None:
        for handle in (self._beat, self._welcome, self._check):
            if handle is not None:
                handle.cancel()
        self._beat = self._welcome = self._check = None
        if self._reader is not None:
            self._reader.close(linger=0)
            self._reader = None

    @property
    def errors(self) -> int:
        return self._reader.errors if self._reader is not None else 0

    # ------------------------------------------------------------------ welcomes
    def on_subscription(self, frames: list[bytes]) -> None:
        """A (un)subscription on the publisher (XPUB, verbose, manual): applied
        (``apply``); a new one welcomed."""
        message = frames[0]
        if len(frames) != 1 or not message or message[0] > 1:
            return
        self.apply(message[0] == 1, message[1:])
        if message[0] == 1:
            self.welcome_soon()

    def apply(self, subscribe: bool, topic: bytes) -> None:
        """(Un)subscribe the connection whose message was read last to ``topic``. The
        empty topic (everything) is every key's (``chp.EVERY_KEY``): not a move's staged
        updates, which only a subscriber of their own prefix receives (a passive, a
        relay: ``chp.STAGED_PREFIX``)."""
        option = zmq.SUBSCRIBE if subscribe else zmq.UNSUBSCRIBE
        pub = self._pub
        for each in chp.EVERY_KEY if not topic else (topic,):
            pub.setsockopt(option, each)

    def use_gate(self, gate) -> None:
        """Apply subscriptions under these rights from now on (a reload)."""
        if self._gate is not None:
            self._gate = gate

    def on_subscription_as(self, frames: list[bytes], user_id: str | None) -> None:
        """A (un)subscription on a manual publisher, from ``user_id``: applied as it
        is for the cluster's own pairs; for an identity, narrowed to the prefixes of the
        keys it may read (``Scope.subscription``; HUGZ when it may read anything), or
        refused when it reaches nothing. libzmq applies a ``ZMQ_SUBSCRIBE`` set now to
        the connection whose message was read last: this one. An identity's
        unsubscription is not applied (its narrowed prefixes may be shared by another of
        its subscriptions): it keeps receiving keys it may read until it disconnects,
        when libzmq drops every subscription of the connection."""
        message = frames[0]
        if len(frames) != 1 or not message or message[0] > 1:
            return
        subscribe, topic = message[0] == 1, message[1:]
        scope = self._gate.scope(user_id)
        if scope is None:
            self.apply(subscribe, topic)
        elif subscribe:
            prefixes = scope.subscription(topic)
            shown = topic[:80].decode("utf-8", "replace")
            if not prefixes:
                self._gate.count(scope.name, "subscriptions_refused",
                                 f"identity {scope.name!r} may read nothing under "
                                 f"{shown!r}" if prefixes == [] else
                                 f"the subscription of {scope.name!r} to {shown!r} would "
                                 "take too many prefixes")
                return
            if [p for p in prefixes if p != chp.HUGZ or topic == chp.HUGZ] != [topic]:
                self._gate.count(scope.name, "subscriptions_narrowed",
                                 f"the subscription of {scope.name!r} to {shown!r} was "
                                 f"narrowed to {len(prefixes)} prefixes it may read")
            for prefix in prefixes:
                self.apply(True, prefix)
        if subscribe:
            self.welcome_soon()

    def welcome_soon(self) -> None:
        """A HUGZ after this loop turn's work (one for every subscription made in it)."""
        loop = self.server.loop
        if self._welcome is None and loop is not None:
            self._welcome = loop.call_soon(self._send_welcome)

    def _check_subscriptions(self) -> None:
        """The hot path sends on the publisher directly, which can consume the edge of
        its FD: look for unread subscriptions every SUBSCRIPTION_CHECK_S as well."""
        self._check = self.server.loop.call_later(SUBSCRIPTION_CHECK_S,
                                                  self._check_subscriptions)
        self._reader.kick()

    def _send_welcome(self) -> None:
        self._welcome = None
        server = self.server
        server.reapply_pub_mark()  # the new subscriber's pipe has the bind-time mark
        try:
            zio.send_frames5(self._pub, *self.hugz())
        except zmq.ZMQError as exc:
            server.drops.drop("welcome_unsent", f"HUGZ for a new subscriber: {exc}")
            return
        self.welcomed += 1

    # ------------------------------------------------------------------ beats
    def hugz(self) -> list[bytes]:
        """A HUGZ with the server clock and the map's generation when ``clock_s`` is on,
        else a plain one; either says ``serving=0`` when this server would not answer an
        ICANHAZ now."""
        server = self.server
        serving = server.role.serving()
        if server.config.clock_s > 0:
            return chp.hugz(time.time(), server.published_seq(), serving=serving,
                            generation=server.generation, route=server.route,
                            cas=server.role.decides_writes, term=server.role.term(),
                            epoch=server.routing_epoch)
        return chp.hugz(serving=serving, route=server.route, epoch=server.routing_epoch)

    def on_beat(self) -> None:
        """Every ``interval_s``: the reactor's duties, then a clock HUGZ when ``clock_s``
        is due (busy or not), else a HUGZ if nothing was published for ``heartbeat_s``."""
        server = self.server
        loop = server.loop
        config = server.config
        self._beat = loop.call_later(self.interval_s, self.on_beat)
        server.on_beat()
        if not server.active:
            return
        now = loop.time()
        # a margin of a tenth of the interval: timers fire a little early or late
        clock_due = config.clock_s > 0 and now - self._clock_at >= 0.9 * config.clock_s
        beat_due = now - self._beat_at >= 0.9 * config.heartbeat_s
        idle = beat_due and server.store.seq == self._seq_at_beat
        if clock_due or idle:
            zio.send_frames5(self._pub, *self.hugz())
            self.sent += 1
            self._clock_at = now
        if beat_due:
            self._seq_at_beat = server.store.seq
            self._beat_at = now
