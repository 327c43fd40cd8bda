"""The cluster map: the one document a client needs to route, and that the supervisor
serves as MDP ``cluster.map``; ``cluster_map(plan)`` builds it from a placement plan
(``clonemap.shards.common.placement.load_plan`` plans a config on this host). Shared, so that a
client reading a config and a supervisor serving it produce the same document, and the
client imports nothing from ``supervisor/``.
"""
from __future__ import annotations

from clonemap.shards.common.placement import PORT_NAMES, Plan


def cluster_map(plan: Plan) -> dict:
    """Everything a client needs to route: shards, addresses, ports, pinned prefixes,
    and the routing function's parameters (``clonemap.shards.common.routing.ShardMap.describe``)."""
    shard_map = plan.routing.shard_map()

    def server(s) -> dict:
        return {"address": s.address, "port": s.port, "nic": s.nic,
                "ports": dict(zip(PORT_NAMES, s.ports)),
                "endpoints": {n: s.endpoint(n) for n in PORT_NAMES},
                "cores": list(s.cores)}

    return {"cluster": plan.cluster, "control": plan.control,
            "heartbeat_s": plan.heartbeat_s, "silence_timeout_s": plan.silence_timeout_s,
            "routing": shard_map.describe(),
            "security": {"curve": plan.curve, "keys_dir": plan.keys_dir or None},
            "hosts": {name: control for name, control in plan.hosts},
            "shards": [{"index": sh.index, "name": sh.name, "prefixes": list(sh.prefixes),
                        "primary": server(sh.primary), "backup": server(sh.backup),
                        "relays": [dict(server(r), name=r.role) for r in plan.relays
                                   if r.index == sh.index]}
                       for sh in plan.shards]}
