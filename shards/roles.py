"""What a server is for: the part of a ``clonemap.shards.server.ShardServer`` that differs between a
standalone server, a server of a Binary Star pair and a relay.

The reactor (``ShardServer``) owns the sockets, the store, the log, the publisher, the
snapshot pump, the HUGZ and the TTL timer; it takes one ``Role`` and asks it, at fixed
points, what only the role knows::

    member                    asked when                          standalone  pair (bstar)      relay
    ------------------------  ----------------------------------  ----------  ----------------  ---------------
    name                      logs, stats, READY, MDP service      standalone  primary/backup   its name
    decides_writes            HUGZ say cas=1                      yes         yes               no (forwards)
    expires_keys              the TTL timer runs                  yes         yes               no (the shard's
                                                                                                  deletes come)
    gates_publish             gate asked for each batch           no          with a lease      no
    attach(server)            made                                -           its parts         its parts
    bind()                    after P..P+2 are bound              -           P+3 state link    -
    start() / close()         on the loop / before the reactor's  active now  machine, lease,   upstream
                                                                              follower          follower
    link_options(sock)        every socket it makes               -           ZMTP heartbeats   -
                                                                              across hosts
    on_collect(frames)        a KVSET on P+2                      apply       apply if active,  forward to
                                                                              else hold         both servers
    on_snapshot_request(fr)   a message on P                      serve       TTL table, link,  serve
                                                                              votes
    admit_snapshot_request()  an ICANHAZ is answered?             active      the client vote   active
    serving()                 HUGZ serving=0?                     active      would accept      active
    term()                    HUGZ, KTHXBAI term=                 this        its bstar term    upstream's
                                                                  process's
    resumable(term, since)    a client of that term after since   its term, or  the term history  terms since
                              may resume here?                    since <= the  says so           its last copy
                                                                  start's seq
    gate(batch)               a batch may be published? (a        (none)      lease, passive's  (none)
                              Verdict; only with gates_publish)               confirmation
    on_compacted(job)         a snapshot is whole on disk         (none)      the needs-peer    (none: no
                              (optional: ``Persisting``)                      rule ends         files)
    stats()                   the reactor's stats                 {}          machine, pending  upstream

A role keeps a reference to its reactor (``attach``) and calls its public methods
(``apply_write``, ``flush``, ``set_active``, ``publish``, ...); the reactor asks a role
that gates publishing for its verdict on each batch (``gate``, ``clonemap.shards.outbox``). Where the updates come
from is part of the role too: the reactor's own collector (standalone, an active), or an
upstream ``clonemap.shards.replica.Follower`` writing into the role as its ``ReplicaSink`` (a
passive, a relay).
"""
from __future__ import annotations

import secrets
import asyncio
from typing import Protocol

import zmq

from clonemap.shards.common.drops import DropCounter
from clonemap.shards.history import History
from clonemap.shards.outbox import Batch, Verdict
from clonemap.shards.server_config import ServerConfig
from clonemap.shards.store import Store


class Reactor(Protocol):
    """What a role and the reactor's own parts (``clonemap.shards.heartbeat``,
    ``clonemap.shards.snapshots``) may use of their server: ``ShardServer`` has all of it.
    Typed here, not by importing the server, so that no part imports its owner back."""

    config: ServerConfig
    store: Store
    drops: DropCounter
    recent: History
    generation: str
    route: str
    active: bool
    disk_error: str
    loop: asyncio.AbstractEventLoop | None

    @property
    def role(self) -> "Role": ...
    def set_active(self, active: bool) -> None: ...
    def on_collect(self, frames: list[bytes]) -> None: ...
    def on_snapshot_request(self, frames: list[bytes]) -> None: ...
    def on_beat(self) -> None: ...
    def published_seq(self) -> int: ...
    def reapply_pub_mark(self) -> None: ...
    def flush_pending(self) -> None: ...


class Role(Protocol):
    name: str
    decides_writes: bool
    expires_keys: bool
    gates_publish: bool

    def attach(self, server: Reactor) -> None: ...
    def bind(self) -> None: ...
    def start(self) -> None: ...
    def close(self) -> None: ...
    def link_options(self, sock: zmq.Socket) -> None: ...
    def on_collect(self, frames: list[bytes]) -> None: ...
    def on_snapshot_request(self, frames: list[bytes]) -> None: ...
    def admit_snapshot_request(self) -> bool: ...
    def serving(self) -> bool: ...
    def term(self) -> int: ...
    def resumable(self, term: int, since: int) -> bool: ...
    def stats(self) -> dict: ...


class Persisting(Role, Protocol):
    """A role that wants to hear when a compaction's snapshot is whole on disk (the
    reactor passes ``on_compacted`` to its ``clonemap.shards.persist.driver.Persistence``)."""

    def on_compacted(self, job) -> None: ...


class GatesPublish(Role, Protocol):
    """A role with ``gates_publish``: asked before each batch is published."""

    def gate(self, batch: Batch) -> Verdict: ...


class Standalone:
    """A server on its own: active from ``start``, every write its own to decide."""

    name = "standalone"
    decides_writes = True
    expires_keys = True
    gates_publish = False

    def attach(self, server: Reactor) -> None:
        self.server = server
        self.on_collect = server.on_collect  # the reactor's write path, nothing between
        self.on_snapshot_request = server.on_snapshot_request

    def bind(self) -> None:
        pass

    def __init__(self):
        self.incarnation = secrets.randbelow(1 << 31) + 1
        """This process's term: a map restarted from its data directory may have lost
        the tail a client saw (``fsync: everysec`` and an OS crash, a restored backup),
        and gives those sequences to other updates."""
        self.started_at = 0
        """The map's sequence when this process started serving it."""

    def start(self) -> None:
        self.started_at = self.server.store.seq
        self.server.set_active(True)

    def close(self) -> None:
        pass

    def link_options(self, sock: zmq.Socket) -> None:
        pass

    def admit_snapshot_request(self) -> bool:
        return self.server.active

    def serving(self) -> bool:
        return self.server.active

    def term(self) -> int:
        return self.incarnation

    def resumable(self, term: int, since: int) -> bool:
        """A client of this process, or one whose updates are all in the map this
        process started from (``since`` at most its sequence then)."""
        return term == self.incarnation or since <= self.started_at

    def stats(self) -> dict:
        return {"term": self.incarnation}
