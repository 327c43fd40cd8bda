"""Hosts made of network namespaces, joined by a bridge: the partition tests' hosts and
the ``bench hosts`` scenario's.

``Hosts(["a", "b", "c", "e"])`` makes one namespace per host, each with an ``eth0`` (one
end of a veth pair) holding 10.214.X.N/24, and a bridge namespace whose ``br0`` joins
the other ends: every host reaches every other, and nothing else (no route out, no
address in the test's own namespace). Faults, all with iproute2:

* ``isolate(h)``: h's port on the bridge goes down: h reaches nobody, nobody reaches h;
* ``cut(a, b)``: a and b no longer reach each other (a ``prohibit`` route in each), both
  still reach everyone else;
* ``one_way(a, b)``: a drops what it would send to b (a ``blackhole`` route in a only);
* ``heal()``: every fault removed.

``close()`` deletes every namespace it made (their veths go with them) and checks that
none is left. Needs root and ``ip`` (``available()`` says why not); the tests skip,
saying so, where the machine forbids namespaces.
"""
from __future__ import annotations

import os
import shutil
import subprocess

IP = shutil.which("ip")


def available() -> str:
    """"" when this process may make network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if IP is None:
        return "iproute2's ip command is not installed"
    return ""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([IP, *args], capture_output=True, text=True, timeout=10)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


class Hosts:
    def __init__(self, names: list[str]):
        tag = f"{os.getpid() % 100000}"
        self.tag = tag
        self.names = list(names)
        self.bridge = f"cmb{tag}"
        octet = os.getpid() % 200 + 20
        self.address = {name: f"10.214.{octet}.{k + 1}" for k, name in enumerate(names)}
        self.made: list[str] = []
        self.faults: list[tuple] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def ns(self, name: str) -> str:
        return f"cm{self.tag}{name}"

    def pids(self, name: str) -> list[int]:
        """Every process in host ``name``'s namespace."""
        return [int(p) for p in ip("netns", "pids", self.ns(name)).stdout.split()]

    def kill(self, name: str) -> int:
        """SIGKILL every process of host ``name`` at once (a host that dies); how many."""
        import signal

        pids = self.pids(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def prefix(self, name: str) -> tuple[str, ...]:
        """Run a command on host ``name``: ``ip netns exec NS`` (it execs the command: the
        PID is the command's own)."""
        return (IP, "netns", "exec", self.ns(name))

    def _port(self, name: str) -> str:
        return f"p{self.tag}{name}"

    def _make(self) -> None:
        ip("netns", "add", self.bridge)
        self.made.append(self.bridge)
        ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge, "link", "set", "br0", "up")
        for name in self.names:
            ns, inner, outer = self.ns(name), f"h{self.tag}{name}", self._port(name)
            ip("netns", "add", ns)
            self.made.append(ns)
            ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "netns", self.bridge)
            ip("-n", ns, "link", "set", inner, "name", "eth0")
            ip("-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", self.bridge, "link", "set", outer, "master", "br0")
            ip("-n", self.bridge, "link", "set", outer, "up")

    # ------------------------------------------------------------------ faults
    def isolate(self, name: str) -> None:
        ip("-n", self.bridge, "link", "set", self._port(name), "down")
        self.faults.append(("isolate", name))

    def cut(self, a: str, b: str) -> None:
        ip("-n", self.ns(a), "route", "add", "prohibit", f"{self.address[b]}/32")
        ip("-n", self.ns(b), "route", "add", "prohibit", f"{self.address[a]}/32")
        self.faults.append(("cut", a, b))

    def one_way(self, a: str, b: str) -> None:
        ip("-n", self.ns(a), "route", "add", "blackhole", f"{self.address[b]}/32")
        self.faults.append(("one_way", a, b))

    def heal(self) -> None:
        for fault in reversed(self.faults):
            if fault[0] == "isolate":
                ip("-n", self.bridge, "link", "set", self._port(fault[1]), "up")
            elif fault[0] == "cut":
                _, a, b = fault
                ip("-n", self.ns(a), "route", "del", "prohibit", f"{self.address[b]}/32")
                ip("-n", self.ns(b), "route", "del", "prohibit", f"{self.address[a]}/32")
            else:
                _, a, b = fault
                ip("-n", self.ns(a), "route", "del", "blackhole", f"{self.address[b]}/32")
        self.faults = []

    def close(self) -> None:
        for ns in reversed(self.made):
            ip("netns", "del", ns, check=False)
        left = ip("netns", "list").stdout
        self.made = [ns for ns in self.made if ns in left.split()]
        assert not self.made, f"namespaces left behind: {self.made}"
