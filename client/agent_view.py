"""What a shard agent's parts read of their agent (``AgentView``).

``clonemap.client.agent.ShardAgent`` is composed of parts: the snapshot being received
(``incoming``), failovers and resets (``outages``), the writes (``writes``), and the
client's watches (``watch.WatchHub``). Each holds its agent and reads it through this
protocol, which the agent satisfies; typed here rather than by importing the agent, so
that no part imports its owner back (the layout test counts import cycles, those under
``TYPE_CHECKING`` included). What a part changes is its own state, or the agent through
the event it returns (``Incoming.on_message``) or the callbacks it was given.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol

import zmq

from clonemap.client import shard_machine as sm
from clonemap.client.collector import ServerAddress
from clonemap.client.link import Link
from clonemap.shards.common.drops import DropCounter
from clonemap.shards.common.proto.chp import Limits
from clonemap.shards.common.security import Security


class AgentView(Protocol):
    """The read side of one shard agent, as its parts see it."""

    name: str
    subtree: bytes
    servers: tuple[ServerAddress, ...]
    relays: bool
    limits: Limits
    drops: DropCounter
    state: sm.State
    map: dict[bytes, bytes]
    props: dict[bytes, bytes]
    seqs: dict[bytes, int]
    last_seq: int
    synced: bool
    snapshots: int
    reset_policy: str
    kvset_queue_max: int
    affinity: int
    ctx: zmq.Context[Any]
    security: Security
    clock: Callable[[], float]
    loop: asyncio.AbstractEventLoop | None
    link: Link | None
    on_read_refused: Callable[[Any], None] | None
    narrowed: bool

    @property
    def server(self) -> ServerAddress: ...

    @property
    def closed(self) -> bool: ...
