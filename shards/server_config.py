"""A shard server's settings at run time (``ServerConfig``: what ``python -m clonemap.shards``'s
options become) and the limits derived from them. The YAML config's entry for a server
is ``clonemap.shards.common.config.ServerEntry``; the supervisor turns it into these options."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from clonemap.shards import streams
from clonemap.shards.byte_marks import SUBSCRIBER_HELD_BYTES, WRITER_HELD_BYTES
from clonemap.shards.common.proto import chp
from clonemap.shards.common.routing import ShardMap
from clonemap.shards.common.timing import HEARTBEAT_S
from clonemap.shards.history import MAX_BYTES as HISTORY_BYTES, MAX_UPDATES as HISTORY_UPDATES

CLOCK_S = 0.5
"""A HUGZ carrying the server clock (ts, seq) at least this often, busy or idle."""
SNAPSHOT_CHUNK = 256
"""KVSYNCs sent to one requester per loop turn (between two collector batches)."""
SNAPSHOT_STALL_S = 30.0
"""A requester that accepts nothing for this long is abandoned."""
MAX_ACTIVE_SNAPSHOTS = 16
"""Cursors streamed at once (each holds a copy of the key list); more requests wait."""
MAX_WAITING_SNAPSHOTS = 1024
COLLECT_BATCH = 512
PUB_SNDHWM = 100_000
COLLECT_RCVHWM = 100_000
SNAPSHOT_SNDHWM = 10_000
SNAPSHOT_HELD_BYTES = 64 << 20
"""Default of ``ServerConfig.snapshot_held_bytes``: 2 MiB per requester at 16 + 16
streams."""


def request_frame_limit(limits: chp.Limits) -> int:
    """``ZMQ_MAXMSGSIZE`` of the sockets whose peers only ask (the snapshot ROUTER's
    ICANHAZ and BSTAR-TTL?, the publisher's subscriptions): the largest subtree or
    properties frame the limits allow, plus 1 KiB. A larger frame disconnects its peer
    before libzmq buffers it (four 64 MiB subscription frames once took a server to
    3 GiB)."""
    return max(limits.max_subtree, limits.max_props) + 1024


def collector_frame_limit(limits: chp.Limits) -> int:
    """The collector's ``ZMQ_MAXMSGSIZE`` (libzmq checks it per frame): twice the largest
    frame the limits allow, plus 64 KiB."""
    return 2 * max(limits.max_key, limits.max_value, limits.max_props) + (64 << 10)


def new_generation() -> str:
    """A fresh generation token: 16 hex digits, random (a restart draws a new one)."""
    return os.urandom(8).hex()


DEDUP_BYTES = 16 << 20
DEDUP_S = 120.0


@dataclass(frozen=True)
class ServerConfig:
    port: int
    host: str = "127.0.0.1"
    heartbeat_s: float = HEARTBEAT_S
    clock_s: float = CLOCK_S
    """Interval of the clock HUGZ (sent even when busy); 0 disables it."""
    limits: chp.Limits = field(default_factory=chp.Limits)
    snapshot_chunk: int = SNAPSHOT_CHUNK
    snapshot_stall_s: float = SNAPSHOT_STALL_S
    snapshot_yield_s: float = streams.YIELD_S
    """A requester that accepted nothing this long while others wait yields its slot."""
    max_active_snapshots: int = MAX_ACTIVE_SNAPSHOTS
    max_waiting_snapshots: int = MAX_WAITING_SNAPSHOTS
    collect_batch: int = COLLECT_BATCH
    pub_sndhwm: int = PUB_SNDHWM
    subscriber_held_bytes: int = SUBSCRIBER_HELD_BYTES
    """Bytes one never-reading subscriber may pin: the publisher's mark in messages is
    derived from it and the largest message so far (``clonemap.shards.byte_marks``); 0: off."""
    writer_held_bytes: int = WRITER_HELD_BYTES
    """The same for what one writer's queued KVSETs may pin in the collector."""
    history_updates: int = HISTORY_UPDATES
    """Recent updates kept for resumes (``clonemap.shards.history``); 0: none."""
    history_bytes: int = HISTORY_BYTES
    collect_rcvhwm: int = COLLECT_RCVHWM
    snapshot_sndhwm: int = SNAPSHOT_SNDHWM
    snapshot_held_bytes: int = SNAPSHOT_HELD_BYTES
    """Bytes all snapshot streams together may queue in libzmq; each of the streams that
    may be open at once (``max_active_snapshots`` + ``streams.MAX_STALLED``) gets an
    equal share: its ROUTER pipe's mark in messages is derived from it and the largest
    entry streamed so far; 0: off."""
    shard_map: ShardMap | None = None
    """The cluster's routing; None: this server owns every key (standalone use)."""
    shard_index: int = 0
    dedup_bytes: int = DEDUP_BYTES
    """The table of applied UUIDs (``clonemap.shards.applied``): its size in bytes ..."""
    dedup_s: float = DEDUP_S
    """... and its age: a resend is recognised for at least half of each."""
    io_threads: int = 1
    """libzmq I/O threads of the server's context (``ZMQ_IO_THREADS``): its subscribers'
    connections are spread over them. One is enough up to some hundreds of subscribers;
    a server fanning out to a thousand directly is bound by its one I/O thread's sends."""

    def __post_init__(self) -> None:
        if self.shard_map is not None and not 0 <= self.shard_index < self.shard_map.shards:
            raise ValueError(f"shard index {self.shard_index} is not in "
                             f"0..{self.shard_map.shards - 1}")

    def endpoint(self, offset: int) -> str:
        return f"tcp://{self.host}:{self.port + offset}"
