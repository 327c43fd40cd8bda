"""What the supervisor knows about each shard as a whole: which server serves it, and when
that changed (a takeover). Fed by the stats poller after every round; read by the status
service, the READY line and the metrics.

A shard *has an active server* when one of its servers is RUNNING and its latest stats
(from this run of the process) say ACTIVE. A *takeover* is the serving role changing
from one server to the other between two rounds; it is counted
(``clonemap_failovers_total``) and kept as an event line ("s0: backup took over from
primary"), the last ``EVENTS_KEPT`` of them.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterable

EVENTS_KEPT = 20


def active_roles(rows: Iterable[dict]) -> dict[str, list[str]]:
    """Shard -> the roles whose server is RUNNING and says ACTIVE (from status rows)."""
    out: dict[str, list[str]] = {}
    for row in rows:
        roles = out.setdefault(row["shard"], [])
        if row.get("state") == "RUNNING" and row.get("bstar") == "ACTIVE":
            roles.append(row["role"])
    return out


def shards_without_active(rows: Iterable[dict], across: Iterable[str] = ()) -> list[str]:
    """The shards none of whose servers is RUNNING and ACTIVE, in row order. ``across``:
    shards whose other server runs on another host (this supervisor sees one of the
    two): a RUNNING PASSIVE server there follows an active one, so the shard counts."""
    rows = list(rows)
    across = set(across)
    following = {row["shard"] for row in rows if row["shard"] in across
                 and row.get("state") == "RUNNING" and row.get("bstar") == "PASSIVE"}
    return [shard for shard, roles in active_roles(rows).items()
            if not roles and shard not in following]


class ClusterHealth:
    """Takeovers per shard, observed from successive status rows."""

    def __init__(self, shards: Iterable[str], on_event: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.time):
        self.serving: dict[str, str | None] = dict.fromkeys(shards)
        """Shard -> the role that served at the last observation with one ACTIVE."""
        self.failovers: dict[str, int] = dict.fromkeys(self.serving, 0)
        self.events: deque[dict] = deque(maxlen=EVENTS_KEPT)
        self.on_event = on_event or (lambda text: None)
        self.clock = clock

    def observe(self, rows: list[dict]) -> None:
        for shard, roles in active_roles(rows).items():
            if len(roles) != 1:
                continue  # none (an outage: no takeover yet) or two (a moment of overlap)
            role = roles[0]
            before = self.serving.get(shard)
            self.serving[shard] = role
            if before is not None and before != role:
                self.failovers[shard] = self.failovers.get(shard, 0) + 1
                text = f"{shard}: {role} took over from {before}"
                self.events.append({"at": round(self.clock(), 3), "text": text})
                self.on_event(text)

    def summary(self) -> dict:
        return {"failovers": dict(self.failovers), "events": list(self.events)}
