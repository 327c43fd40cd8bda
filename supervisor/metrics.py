"""Prometheus metrics of a running cluster, served by ``supervisor start`` on
``http://<metrics>/metrics`` (config ``metrics``, default ``127.0.0.1:9464``; ``off``).

One scrape reads what the supervisor already holds: every server's last stats (the
stats poller asks each server about once a second), the process states, the takeover
counts, and the broker's counters. A scrape makes no round trip to any server. The
figures are gathered on the supervisor's event loop (where they change); the HTTP
thread of ``prometheus_client`` only renders them. Each server's RSS and CPU time are
read from ``/proc`` (psutil) at scrape time.

Families (labels ``cluster``, ``shard``, ``role`` where they apply; ``reason`` for
drops). ``METRIC_NAMES`` lists them, and the Grafana dashboard's test checks that
every query names one of them:

    clonemap_server_up                 1 when the server runs and answers its stats
    clonemap_server_active             1 for the side that serves clients
    clonemap_shard_has_active          1 when some server of the shard is active
    clonemap_shard_sequence            the shard's last sequence (its highest server's)
    clonemap_shard_keys                keys in the shard (its active server's map)
    clonemap_updates_total             updates a server applied (sets, deletes, expiries)
    clonemap_drops_total{reason}       counted drops (malformed, not owner, ...)
    clonemap_snapshots_served_total    snapshots a server completed
    clonemap_snapshots_active          snapshots streaming now
    clonemap_server_restarts_total     restarts by the supervisor
    clonemap_server_rss_bytes          resident memory
    clonemap_server_cpu_seconds_total  user + system CPU time
    clonemap_failovers_total           takeovers the supervisor saw, per shard
    clonemap_pending_updates           a passive's updates heard from clients, unconfirmed
    clonemap_replica_lag_updates       how many updates a passive is behind its active
    clonemap_persist_fsync_seconds     log fsync durations (histogram)
    clonemap_server_disk_ok            0 while a server is down on a disk error
    clonemap_server_disk_errors_total  runs that stopped on a disk error
    clonemap_recovery_torn_updates     updates in a torn last record truncated at recovery
    clonemap_refused_sends_total       libzmq's TCP sends that failed with EACCES (a route
                                       became "prohibit"), handed to libzmq as a dead peer
    clonemap_access_refused_total{identity,what}  refusals (and narrowings) by identity:
                                       writes_refused, snapshots_narrowed, ... (access control)
    clonemap_broker_events_total{event}   the control broker's counters
    clonemap_broker_drops_total{reason}   its counted drops
    clonemap_broker_held_bytes         request bytes it holds
    clonemap_broker_workers            workers registered
    process_*                          the supervisor's own process (prometheus_client)

Counters restart from zero when a server restarts (Prometheus' ``rate`` handles that).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import psutil
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

log = logging.getLogger(__name__)

GATHER_TIMEOUT_S = 2.0
SERVER = ("cluster", "shard", "role")
SHARD = ("cluster", "shard")

METRIC_NAMES = (
    "clonemap_server_up", "clonemap_server_active", "clonemap_shard_has_active",
    "clonemap_shard_sequence", "clonemap_shard_keys", "clonemap_updates_total",
    "clonemap_drops_total", "clonemap_snapshots_served_total", "clonemap_snapshots_active",
    "clonemap_server_restarts_total", "clonemap_server_rss_bytes",
    "clonemap_server_cpu_seconds_total", "clonemap_failovers_total",
    "clonemap_pending_updates", "clonemap_replica_lag_updates",
    "clonemap_persist_fsync_seconds", "clonemap_broker_events_total",
    "clonemap_broker_drops_total", "clonemap_broker_held_bytes", "clonemap_broker_workers",
    "clonemap_server_disk_ok", "clonemap_server_disk_errors_total",
    "clonemap_recovery_torn_updates", "clonemap_access_refused_total",
    "clonemap_refused_sends_total")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


class ClusterCollector:
    """A ``prometheus_client`` custom collector over a ``gather()`` that returns a plain
    snapshot: ``{"cluster", "rows": [status rows], "failovers": {shard: n},
    "broker": broker stats}``."""

    def __init__(self, gather: Callable[[], dict]):
        self.gather = gather

    def describe(self):
        return []  # no descriptions: the registry then collects nothing at register time

    def collect(self):
        try:
            snap = self.gather()
        except Exception as exc:  # a scrape must not take the supervisor down
            log.warning("metrics: cannot gather the cluster's figures: %s", exc)
            return
        yield from server_families(snap)
        yield from broker_families(snap)
        yield from reshard_families(snap)


def reshard_families(snap: dict):
    """The routing's epoch, and the change under way (``supervisor reshard``)."""
    state = snap.get("reshard")
    if not state:
        return
    cluster = snap["cluster"]
    epoch = GaugeMetricFamily("clonemap_routing_epoch", "The epoch of the cluster's "
                              "routing (one more at each change)", labels=("cluster",))
    epoch.add_metric((cluster,), state.get("epoch", 0))
    running = GaugeMetricFamily("clonemap_reshard_running", "1 while a change of the "
                                "routing moves keys, by phase", labels=("cluster", "phase"))
    running.add_metric((cluster, state.get("phase") or "none"),
                       1 if state.get("running") else 0)
    copied = GaugeMetricFamily("clonemap_reshard_copied", "What the change under way (or "
                               "the last) copied so far", labels=("cluster", "unit"))
    copied.add_metric((cluster, "keys"), state.get("keys", 0))
    copied.add_metric((cluster, "bytes"), state.get("bytes", 0))
    changes = CounterMetricFamily("clonemap_reshard_changes", "Changes of the routing "
                                  "applied or tried since the supervisor started",
                                  labels=("cluster",))
    changes.add_metric((cluster,), state.get("changes", 0))
    yield from (epoch, running, copied, changes)


def server_families(snap: dict):
    cluster = snap["cluster"]
    rows = snap["rows"]
    up = GaugeMetricFamily("clonemap_server_up", "1 when the server runs and answers "
                           "its stats", labels=SERVER)
    active = GaugeMetricFamily("clonemap_server_active", "1 for the server that serves "
                               "the shard's clients", labels=SERVER)
    has_active = GaugeMetricFamily("clonemap_shard_has_active", "1 when some server of "
                                   "the shard is active", labels=SHARD)
    sequence = GaugeMetricFamily("clonemap_shard_sequence", "The shard's last sequence",
                                 labels=SHARD)
    keys = GaugeMetricFamily("clonemap_shard_keys", "Keys in the shard (its active "
                             "server's map)", labels=SHARD)
    updates = CounterMetricFamily("clonemap_updates", "Updates the server applied",
                                  labels=SERVER)
    drops = CounterMetricFamily("clonemap_drops", "Counted drops", labels=SERVER + ("reason",))
    served = CounterMetricFamily("clonemap_snapshots_served", "Snapshots completed",
                                 labels=SERVER)
    streaming = GaugeMetricFamily("clonemap_snapshots_active", "Snapshots streaming now",
                                  labels=SERVER)
    restarts = CounterMetricFamily("clonemap_server_restarts", "Restarts by the supervisor",
                                   labels=SERVER)
    rss = GaugeMetricFamily("clonemap_server_rss_bytes", "Resident memory", labels=SERVER)
    cpu = CounterMetricFamily("clonemap_server_cpu_seconds", "User + system CPU time",
                              labels=SERVER)
    failovers = CounterMetricFamily("clonemap_failovers", "Takeovers the supervisor saw",
                                    labels=SHARD)
    pending = GaugeMetricFamily("clonemap_pending_updates", "A passive's client updates "
                                "not yet confirmed by its active", labels=SERVER)
    lag = GaugeMetricFamily("clonemap_replica_lag_updates", "Updates a passive is behind "
                            "its active", labels=SERVER)
    fsync = HistogramMetricFamily("clonemap_persist_fsync_seconds", "Log fsync durations",
                                  labels=SERVER)
    disk_ok = GaugeMetricFamily("clonemap_server_disk_ok", "0 while the server's last run "
                                "stopped on a disk error and no later run is ready",
                                labels=SERVER)
    disk_errors = CounterMetricFamily("clonemap_server_disk_errors", "Runs of the server "
                                      "that stopped on a disk error (ENOSPC, EIO, EROFS, a "
                                      "failed fsync)", labels=SERVER)
    refused = CounterMetricFamily("clonemap_access_refused", "Refusals (and narrowings) "
                                  "of an identity's requests, by kind (access control)",
                                  labels=SERVER + ("identity", "what"))
    torn = GaugeMetricFamily("clonemap_recovery_torn_updates", "Updates in the torn last "
                             "record truncated when the server's current run recovered",
                             labels=SERVER)
    refused_sends = CounterMetricFamily("clonemap_refused_sends", "libzmq's TCP sends "
                                        "that failed with EACCES (a route became "
                                        "prohibit), handed to libzmq as a dead peer",
                                        labels=SERVER)
    by_shard: dict[str, list[dict]] = {}
    for row in rows:
        by_shard.setdefault(row["shard"], []).append(row)
    for shard, shard_rows in by_shard.items():
        live = [r for r in shard_rows if r.get("state") == "RUNNING" and r.get("stats")]
        serving = [r for r in live if r.get("bstar") == "ACTIVE"]
        seqs = [r["stats"]["seq"] for r in live if _number(r["stats"].get("seq")) is not None]
        has_active.add_metric((cluster, shard), 1 if serving else 0)
        if seqs:
            sequence.add_metric((cluster, shard), max(seqs))
        if serving and _number(serving[0]["stats"].get("keys")) is not None:
            keys.add_metric((cluster, shard), serving[0]["stats"]["keys"])
        failovers.add_metric((cluster, shard), snap.get("failovers", {}).get(shard, 0))
        active_seq = serving[0]["stats"].get("seq") if serving else None
        for row in shard_rows:
            labels = (cluster, shard, row["role"])
            stats = row.get("stats") or {}
            running = row.get("state") == "RUNNING" and bool(stats)
            up.add_metric(labels, 1 if running else 0)
            active.add_metric(labels, 1 if running and row.get("bstar") == "ACTIVE" else 0)
            restarts.add_metric(labels, row.get("restarts", 0))
            disk_ok.add_metric(labels, 0 if row.get("disk_error") else 1)
            disk_errors.add_metric(labels, row.get("disk_errors", 0))
            _process_figures(row.get("pid") if row.get("state") != "STOPPED" else None,
                             labels, rss, cpu)
            if not running:
                continue
            for name, family in (("updates", updates), ("snapshots_served", served)):
                if _number(stats.get(name)) is not None:
                    family.add_metric(labels, stats[name])
            if _number(stats.get("snapshots_active")) is not None:
                streaming.add_metric(labels, stats["snapshots_active"])
            for reason, count in sorted((stats.get("drops") or {}).items()):
                drops.add_metric(labels + (reason,), count)
            access = (stats.get("access") or {}).get("by_identity") or {}
            for identity, counts in sorted(access.items()):
                for what, count in sorted(counts.items()):
                    refused.add_metric(labels + (identity, what), count)
            sends = (stats.get("send_guard") or {}).get("refused_sends")
            if _number(sends) is not None:
                refused_sends.add_metric(labels, sends)
            if _number(stats.get("pending")) is not None:
                pending.add_metric(labels, stats["pending"])
            torn_updates = (stats.get("persist") or {}).get("torn_updates_recovered")
            if _number(torn_updates) is not None:
                torn.add_metric(labels, torn_updates)
            if (row.get("bstar") != "ACTIVE" and active_seq is not None
                    and _number(stats.get("seq")) is not None):
                lag.add_metric(labels, max(0, active_seq - stats["seq"]))
            buckets = ((stats.get("persist") or {}).get("fsync_buckets"))
            if buckets:
                cumulative, total = [], 0
                for bound, count in zip(buckets["le"] + ["+Inf"], buckets["counts"]):
                    total += count
                    cumulative.append((str(bound) if bound != "+Inf" else bound, total))
                fsync.add_metric(labels, cumulative,
                                 sum_value=stats["persist"].get("fsync_s_total", 0.0))
    yield from (up, active, has_active, sequence, keys, updates, drops, served, streaming,
                restarts, rss, cpu, failovers, pending, lag, fsync, disk_ok, disk_errors,
                torn, refused, refused_sends)


def _process_figures(pid: int | None, labels: tuple, rss, cpu) -> None:
    if pid is None:
        return
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            memory = proc.memory_info().rss
            times = proc.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return
    rss.add_metric(labels, memory)
    cpu.add_metric(labels, times.user + times.system)


def broker_families(snap: dict):
    cluster = snap["cluster"]
    broker = snap.get("broker") or {}
    events = CounterMetricFamily("clonemap_broker_events", "The control broker's counters",
                                 labels=("cluster", "event"))
    for name, value in sorted((broker.get("counters") or {}).items()):
        if _number(value) is not None:
            events.add_metric((cluster, name), value)
    drops = CounterMetricFamily("clonemap_broker_drops", "The control broker's counted "
                                "drops", labels=("cluster", "reason"))
    for reason, value in sorted((broker.get("drops") or {}).items()):
        drops.add_metric((cluster, reason), value)
    held = GaugeMetricFamily("clonemap_broker_held_bytes", "Request bytes the broker "
                             "holds", labels=("cluster",))
    held.add_metric((cluster,), broker.get("held_bytes", 0))
    workers = GaugeMetricFamily("clonemap_broker_workers", "Workers registered",
                                labels=("cluster",))
    workers.add_metric((cluster,), broker.get("workers", 0))
    yield from (events, drops, held, workers)


class MetricsServer:
    """The HTTP endpoint: a registry with the cluster collector and the supervisor's own
    process collector, served by ``prometheus_client.start_http_server`` on a thread."""

    def __init__(self, address: tuple[str, int], loop: asyncio.AbstractEventLoop,
                 gather: Callable[[], Any]):
        """``gather``: a coroutine function run on ``loop`` that returns the snapshot."""
        self.address = address
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ProcessCollector(registry=None))
        self.registry.register(ClusterCollector(self._gather_on(loop, gather)))
        self._server = None
        self._thread = None

    @staticmethod
    def _gather_on(loop, gather):
        def run() -> dict:
            future = asyncio.run_coroutine_threadsafe(gather(), loop)
            return future.result(GATHER_TIMEOUT_S)
        return run

    def start(self) -> None:
        """Bind and serve; ``OSError`` when the port cannot be bound."""
        host, port = self.address
        self._server, self._thread = start_http_server(port, addr=host,
                                                       registry=self.registry)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}/metrics"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)
            self._server = None
