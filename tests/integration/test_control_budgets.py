"""The control plane's byte budgets, against a hostile client, under ``supervisor start``
(``limits.control_*`` at their defaults: 1 MiB per frame and message, 64 MiB of held
request bytes in all, 8 MiB per client):

* 30 requests of 32 MiB from one socket: the broker refuses the oversized frames
  (ZMQ_MAXMSGSIZE: the peer is disconnected), the supervisor's RSS does not grow with
  them;
* 60 clients flooding 900 KB requests at a service nobody offers: at most the budgets
  are held, the rest is dropped and counted (``held_bytes`` / ``client_held_bytes``), and
  the supervisor's RSS stays within the budget plus a small constant.
"""
from __future__ import annotations

import json

import psutil
import pytest
import zmq

from clonemap.shards.common.mdp import codec as mdp
from clonemap.shards.common.mdp.client import SyncMdpClient
from test_supervisor_cli import start, status, wait_status, write_config

pytestmark = pytest.mark.timeout(180)
MiB = 1 << 20
SLACK = 48 * MiB
"""The small constant: ZeroMQ's receive buffers and the allocator's slack."""


def broker_stats(control: str) -> dict:
    with SyncMdpClient(control, timeout_s=5.0, retries=1) as client:
        reply = client.request("mmi.stats")
    return json.loads(reply[-1])


def test_floods_of_large_requests_stay_within_the_byte_budgets(procs, tmp_path, zctx):
    config, control = write_config(tmp_path, "1shard.yaml")
    sup = start(procs, config, tmp_path)
    wait_status(control, lambda rows: all(r["bstar"] in ("ACTIVE", "PASSIVE")
                                          for r in rows.values()))
    rss = psutil.Process(sup.pid)
    before = rss.memory_info().rss

    big = zctx.socket(zmq.DEALER)
    big.linger = 0
    big.sndhwm = 0
    monitor = zctx.socket(zmq.PAIR)
    big.monitor("inproc://big", zmq.EVENT_DISCONNECTED)
    monitor.connect("inproc://big")
    big.connect(control)
    body = b"x" * (32 * MiB)
    for _ in range(30):
        try:
            big.send_multipart(mdp.client_request(b"no.such.service", body), zmq.NOBLOCK)
        except zmq.Again:
            break
    assert monitor.poll(30_000), "the broker kept a peer that sent a 32 MiB frame"
    big.close(0)
    monitor.close(0)

    clients = []
    payload = b"y" * (900 * 1024)
    for _ in range(60):
        sock = zctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(control)
        for _ in range(12):
            sock.send_multipart(mdp.client_request(b"nobody.offers.this", payload))
        clients.append(sock)
    def accounted(stats: dict) -> int:
        """Flood requests the broker holds, dropped for the budgets, or expired (the
        request counter also counts the supervisor's stats polls and ours)."""
        held = stats["services"].get("nobody.offers.this", {}).get("queued", 0)
        drops = stats["drops"]
        return held + sum(drops.get(r, 0) for r in ("held_bytes", "client_held_bytes",
                                                    "request_expired"))

    for _ in range(200):  # until the broker has read all 720 requests
        stats = broker_stats(control)
        if accounted(stats) >= 720:
            break
    assert accounted(stats) >= 720, stats
    assert stats["held_bytes"] <= 64 * MiB
    dropped = stats["drops"].get("held_bytes", 0) + stats["drops"].get("client_held_bytes", 0)
    assert dropped >= 720 - (64 * MiB) // len(payload), stats["drops"]
    after = rss.memory_info().rss
    assert after - before <= 64 * MiB + SLACK, (before, after)
    for sock in clients:
        sock.close(0)
    assert status(control)["s0/primary"]["state"] == "RUNNING"  # the control plane lives on
