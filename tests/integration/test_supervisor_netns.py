"""NIC placement on a real interface: a network namespace with one end of a veth pair
holding a private IPv4 address; ``supervisor validate`` and ``supervisor start`` run
inside it (``ip netns exec``) with ``nic: <veth>`` and the servers must bind that NIC's
address. All traffic stays inside the namespace (its loopback and its veth address).

Needs root and iproute2's ``ip``; skipped, saying why, where the machine forbids it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from conftest import PYTHON, ROOT, free_port_base

pytestmark = pytest.mark.timeout(90)

IP = shutil.which("ip")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, timeout=10,
                          check=check)


@pytest.fixture
def netns():
    """(namespace, interface, address): a namespace holding one end of a veth pair."""
    if os.geteuid() != 0:
        pytest.skip("creating a network namespace needs root")
    if IP is None:
        pytest.skip("iproute2's ip command is not installed")
    tag = f"{os.getpid() % 100000}"
    ns, outer, inner = f"cmtest{tag}", f"cmo{tag}", f"cmi{tag}"
    octet = os.getpid() % 200 + 20
    address = f"10.213.{octet}.2"
    made = _ip("netns", "add", ns, check=False)
    if made.returncode != 0:
        pytest.skip(f"this machine forbids network namespaces: {made.stderr.strip()}")
    try:
        steps = [("link", "add", outer, "type", "veth", "peer", "name", inner),
                 ("link", "set", inner, "netns", ns),
                 ("-n", ns, "addr", "add", f"{address}/24", "dev", inner),
                 ("-n", ns, "link", "set", "lo", "up"),
                 ("-n", ns, "link", "set", inner, "up"),
                 ("link", "set", outer, "up")]
        for step in steps:
            done = _ip(*step, check=False)
            if done.returncode != 0:
                pytest.skip(f"this machine forbids a veth pair in a namespace: "
                            f"ip {' '.join(step)}: {done.stderr.strip()}")
        yield ns, inner, address
    finally:
        _ip("netns", "del", ns, check=False)
        _ip("link", "del", outer, check=False)  # gone with the namespace already
        assert ns not in _ip("netns", "list").stdout


def listening(pid: int) -> set[tuple[str, int]]:
    """The TCP (address, port) pairs process ``pid`` listens on, read from its own
    namespace's /proc/PID/net/tcp (psutil reads the caller's namespace)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    out = set()
    with open(f"/proc/{pid}/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                hex_ip, hex_port = local.split(":")
                ip = ".".join(str(b) for b in reversed(bytes.fromhex(hex_ip)))
                out.add((ip, int(hex_port, 16)))
    return out


def in_ns(ns: str, *args: str) -> list[str]:
    return [IP, "netns", "exec", ns, PYTHON, "-m", "clonemap.supervisor", *args]


def test_servers_bind_the_ipv4_address_of_their_nic(netns, procs, tmp_path):
    ns, nic, address = netns
    base = free_port_base(20)
    control = f"tcp://127.0.0.1:{free_port_base(1)}"
    config = tmp_path / "nic.yaml"
    config.write_text(yaml.safe_dump({
        "cluster": "nic", "control": control, "port_base": base, "shards": 1,
        "metrics": "off",
        "defaults": {"nic": nic, "cores": "auto"}}))

    out = subprocess.run(in_ns(ns, "validate", str(config), "--json"), cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)["shards"][0]
    for role in ("primary", "backup"):
        assert plan[role]["nic"] == nic and plan[role]["address"] == address

    # outside the namespace that NIC does not exist: a precise refusal
    out = subprocess.run([PYTHON, "-m", "clonemap.supervisor", "validate", str(config)], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert f'shards[0].primary.nic: given "{nic}": no NIC of that name' in out.stderr

    sup = procs.spawn(in_ns(ns, "start", str(config), "--no-table", "--run-dir",
                            str(tmp_path / "run")), ready="READY supervisor", timeout_s=60)
    status = subprocess.run(in_ns(ns, "status", "--json", "--control", control), cwd=ROOT,
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr
    rows = {row["name"]: row for row in json.loads(status.stdout)["servers"]}
    for name, port in (("s0/primary", base), ("s0/backup", base + 10)):
        row = rows[name]
        assert row["address"] == address and row["nic"] == nic
        bound = listening(row["pid"])
        assert bound == {(address, port + i) for i in range(4)}, (name, bound)

    stop = subprocess.run(in_ns(ns, "stop", "--control", control), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stderr
    assert sup.wait(20) == 0
