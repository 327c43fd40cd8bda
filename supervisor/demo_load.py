"""``supervisor start --demo-load``: a small built-in writer so the status table moves.

Every tick it sets a few keys spread over every shard (``/demo-<n>/k<m>``), each routed
with ``clonemap.shards.common.routing.ShardMap`` and sent as a 12/CHP KVSET on a PUB connected to the
collector (P+2) of both servers of the owning shard, as a client does. Optional and
small (``rate_per_s`` KVSETs a second in all): it shows the sequences, key counts and
updates/s move and a failover keep the figures going.
"""
from __future__ import annotations

import asyncio
import logging
import uuid

import zmq

from clonemap.shards.common.proto import chp
from clonemap.shards.common.routing import ShardMap
from clonemap.shards.common.zio import send_frames
from clonemap.shards.common.placement import Plan

log = logging.getLogger(__name__)

DEMO_RATE_PER_S = 20
DEMO_KEYS = 64
TICK_S = 0.25


def demo_keys(shard_map: ShardMap, count: int = DEMO_KEYS) -> list[tuple[int, bytes]]:
    """``count`` keys ``/demo-<n>/k`` with their owning shard, covering every shard that
    some ``/demo-<n>`` prefix hashes to."""
    return [(shard_map.owner(key), key.encode())
            for key in (f"/demo-{n}/k" for n in range(count))]


class DemoLoad:
    def __init__(self, plan: Plan, ctx: zmq.Context, rate_per_s: int = DEMO_RATE_PER_S,
                 security=None):
        pins = {i: list(sh.prefixes) for i, sh in enumerate(plan.shards) if sh.prefixes}
        self.keys = demo_keys(ShardMap(len(plan.shards), pins))
        self.per_tick = max(1, round(rate_per_s * TICK_S))
        self.sent = 0
        self.socks: list[zmq.Socket] = []
        for shard in plan.shards:
            sock = ctx.socket(zmq.PUB)
            sock.linger = 0
            sock.sndhwm = 1000
            if security is not None:
                security.connect_side(sock)
            for server in shard.servers:
                sock.connect(server.endpoint("collector"))
            self.socks.append(sock)

    async def run(self) -> None:
        i = 0
        try:
            while True:
                for _ in range(self.per_tick):
                    shard, key = self.keys[i % len(self.keys)]
                    value = b"%d" % self.sent
                    try:
                        send_frames(self.socks[shard], chp.kvset(key, value, uuid.uuid4().bytes))
                        self.sent += 1
                    except zmq.Again:
                        pass
                    i += 1
                await asyncio.sleep(TICK_S)
        finally:
            self.close()

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)
        self.socks = []
