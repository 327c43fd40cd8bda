"""The client's ``stats()`` as Prometheus metrics, for applications that run a
``prometheus_client`` registry of their own. Opt-in, and no HTTP server here::

    from prometheus_client import REGISTRY
    from clonemap.client.metrics import CloneCollector

    clone = Clone(config="configs/4shard.yaml")
    REGISTRY.register(CloneCollector(clone, client="orders-cache"))

Each scrape calls ``clone.stats()`` once (a ``Clone`` runs it on its own loop thread;
an ``AsyncClone`` is read directly, so scrape it from its loop's thread). Families, with
labels ``client`` (yours) and ``shard``:

    clonemap_client_keys                  keys held locally
    clonemap_client_last_sequence         the last sequence applied from the shard
    clonemap_client_lag_seconds           how late the shard's updates are read
    clonemap_client_applied_total         updates applied
    clonemap_client_gaps_total            sequence gaps seen (a resync each)
    clonemap_client_snapshots_total       snapshots taken
    clonemap_client_failovers_total       moves to the other server of the pair
    clonemap_client_resets_total          data-loss events (a new generation)
    clonemap_client_kvsets_sent_total     writes sent
    clonemap_client_kvsets_dropped_total  writes dropped before sending (queue full)
    clonemap_client_drops_total{reason}   counted drops of malformed input
    clonemap_client_fell_behind_total     slow-subscriber events (no shard label)
    clonemap_client_failed                1 once the client is dead (slow_policy "die",
                                          a wrong cluster map)
    clonemap_client_refused_sends_total   libzmq's TCP sends in this process that failed
                                          with EACCES (a route became "prohibit"), handed
                                          to libzmq as a dead peer (no shard label)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from clonemap.shards.common.errors import require_extra

if TYPE_CHECKING:
    from clonemap.client.clone import AsyncClone
    from clonemap.client.sync import Clone

require_extra("the client's metrics", "metrics", ("prometheus_client",))

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CLIENT_METRIC_NAMES = (
    "clonemap_client_keys", "clonemap_client_last_sequence", "clonemap_client_lag_seconds",
    "clonemap_client_applied_total", "clonemap_client_gaps_total",
    "clonemap_client_snapshots_total", "clonemap_client_failovers_total",
    "clonemap_client_resets_total", "clonemap_client_kvsets_sent_total",
    "clonemap_client_kvsets_dropped_total", "clonemap_client_drops_total",
    "clonemap_client_fell_behind_total", "clonemap_client_failed",
    "clonemap_client_refused_sends_total")

_PER_SHARD = (
    # (family, stats key, help, counter?)
    ("clonemap_client_keys", "keys", "Keys held locally", False),
    ("clonemap_client_last_sequence", "last_seq", "Last sequence applied", False),
    ("clonemap_client_lag_seconds", "lag_s", "How late the shard's updates are read", False),
    ("clonemap_client_applied", "applied", "Updates applied", True),
    ("clonemap_client_gaps", "gaps", "Sequence gaps seen", True),
    ("clonemap_client_snapshots", "snapshots", "Snapshots taken", True),
    ("clonemap_client_failovers", "failovers", "Moves to the other server", True),
    ("clonemap_client_resets", "resets", "Data-loss events", True),
    ("clonemap_client_kvsets_sent", "kvsets_sent", "Writes sent", True),
    ("clonemap_client_kvsets_dropped", "kvsets_dropped", "Writes dropped before sending",
     True),
)


class CloneCollector:
    """A ``prometheus_client`` collector over one client (``Clone`` or ``AsyncClone``)."""

    def __init__(self, clone: "Clone | AsyncClone", client: str = "clonemap") -> None:
        self.clone = clone
        self.client = client

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self.clone.stats()
        labels = ("client", "shard")
        families: list[Metric] = []
        for name, key, text, counter in _PER_SHARD:
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(
                name, text, labels=labels)
            for shard in stats["shards"]:
                value = shard.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    family.add_metric((self.client, shard["shard"]), value)
            families.append(family)
        drops = CounterMetricFamily("clonemap_client_drops", "Counted drops of malformed "
                                    "input", labels=labels + ("reason",))
        for shard in stats["shards"]:
            for reason, count in sorted((shard.get("drops") or {}).items()):
                drops.add_metric((self.client, shard["shard"], reason), count)
        behind = CounterMetricFamily("clonemap_client_fell_behind", "Slow-subscriber "
                                     "events", labels=("client",))
        behind.add_metric((self.client,), stats.get("fell_behind", 0))
        failed = GaugeMetricFamily("clonemap_client_failed", "1 once the client is dead",
                                   labels=("client",))
        failed.add_metric((self.client,), 1 if stats.get("failed") else 0)
        refused = CounterMetricFamily("clonemap_client_refused_sends", "libzmq's TCP "
                                      "sends that failed with EACCES, handed to libzmq as "
                                      "a dead peer", labels=("client",))
        refused.add_metric((self.client,),
                           (stats.get("send_guard") or {}).get("refused_sends", 0))
        yield from families
        yield from (drops, behind, failed, refused)
