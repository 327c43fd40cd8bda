"""What a server reports (``ShardServer.stats``: the control plane's ``stats``, the
supervisor's metrics and ``supervisor status``)."""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from clonemap.shards.common import zio

if TYPE_CHECKING:
    from clonemap.shards.server import ShardServer


def server_stats(server: "ShardServer") -> dict:
    """A server's counters for the control plane (JSON-able), its role's merged in."""
    store = server.store
    drops = dict(server.drops.counts)
    out = {
        "role": server.role.name,
        "active": server.active,
        "pid": os.getpid(),
        "port": server.config.port,
        "host": server.config.host,
        "seq": store.seq,
        "generation": server.generation,
        "keys": len(store),
        "updates": store.seq - server.expiry.expired,
        "ttl_keys": store.ttl_keys,
        "ttl_expired": server.expiry.expired,
        "writes": dict(server.writes),
        "applied_uuids": len(server.applied),
        "applied_uuids_window": [server.applied.half, server.applied.max_age_s / 2],
        **server.snapshots.stats(),
        "hugz_sent": server.heartbeat.sent,
        "hugz_welcome": server.heartbeat.welcomed,
        "recent": server.recent.stats(),
        "pub_hwm": server.marks.pub_hwm,
        "collect_hwm": server.marks.collect_hwm,
        "largest_published_bytes": server.marks.pub_mark,
        "largest_received_bytes": server.marks.collect_mark,
        "routing": (None if server.config.shard_map is None else
                    {"shard_index": server.config.shard_index,
                     "shards": server.config.shard_map.shards,
                     "owner_slots": len(server.owner_cache.slots)
                     if server.owner_cache else 0}),
        "drops": drops,
        "drops_total": sum(drops.values()),
        "persist": server.persist.stats() if server.persist is not None else None,
        "disk_error": server.disk_error,
        "handler_errors": sum(a.errors for a in (server._router, server._collector)
                              if a is not None) + server.heartbeat.errors,
        "rss_bytes": server._process.memory_info().rss,
        "uptime_s": round(time.monotonic() - server.started_s, 3),
        "frame_path": zio.FRAME_PATH,
    }
    out.update(server.role.stats())
    return out
