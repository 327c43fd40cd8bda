"""One config, a supervisor per host: ``supervisor start CONFIG --host NAME`` on two hosts
(network namespaces) runs each host's servers, both serve the same cluster map, ``status``
spans the hosts and names one that does not answer, and when a host dies outright its
shards are served from the other with every acknowledged write.

Two shards, each a pair across hosts a and b (s0's primary on a, s1's on b), etcd on e,
clients on c. Real supervisors, servers, etcd and clients; the ledger is kept by
``ledger_client.py`` (``wait=True`` writes through the cluster map).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import PYTHON, ROOT, EtcdServer, Procs
from bench.harness.netns import Hosts

pytestmark = pytest.mark.timeout(240)
LEDGER = str(Path(__file__).with_name("ledger_client.py"))
ENV = {"PYTHONPATH": str(ROOT)}


def write_config(path: Path, hosts: Hosts, etcd: EtcdServer) -> Path:
    a, b = hosts.address["a"], hosts.address["b"]
    config = {
        "cluster": "twohost", "heartbeat_s": 0.2,
        "hosts": {"a": {"control": f"tcp://{a}:5555"}, "b": {"control": f"tcp://{b}:5555"}},
        "coordination": {"etcd": [f"{etcd.host}:{etcd.port}"], "lease_s": 2},
        "shards": [
            {"name": "s0", "primary": {"at": "a", "host": a, "port": 6000},
             "backup": {"at": "b", "host": b, "port": 6000}},
            {"name": "s1", "primary": {"at": "b", "host": b, "port": 6020},
             "backup": {"at": "a", "host": a, "port": 6020}}]}
    path.write_text(yaml.safe_dump(config))
    return path


def supervisor(procs: Procs, hosts: Hosts, host: str, config: Path, tmp: Path):
    """``supervisor start CONFIG --host NAME`` on that host (READY awaited by the caller:
    each host's pairs need the other host's servers)."""
    return procs.spawn([*hosts.prefix(host), PYTHON, "-m", "clonemap.supervisor", "start",
                        str(config), "--host", host, "--no-table",
                        "--run-dir", str(tmp / f"run-{host}")], env=ENV)


def run_on(hosts: Hosts, host: str, *args: str, timeout_s: float = 30
           ) -> subprocess.CompletedProcess:
    return subprocess.run([*hosts.prefix(host), PYTHON, *args], capture_output=True,
                          text=True, timeout=timeout_s, cwd=ROOT, env={**os.environ, **ENV})


def test_a_supervisor_per_host_runs_one_cluster_and_survives_a_host(hosts, tmp_path):
    procs = Procs()
    etcd = EtcdServer(tmp_path / "etcd", host=hosts.address["e"], prefix=hosts.prefix("e"))
    try:
        config = write_config(tmp_path / "twohost.yaml", hosts, etcd)
        # validate: each host's part against that host; without --host it says to choose
        done = run_on(hosts, "a", "-m", "clonemap.supervisor", "validate", str(config), "--host", "a")
        assert done.returncode == 0, done.stderr
        assert "another host" in done.stdout
        done = run_on(hosts, "a", "-m", "clonemap.supervisor", "validate", str(config))
        assert done.returncode == 2 and "--host NAME" in done.stderr
        sup_a = supervisor(procs, hosts, "a", config, tmp_path)
        sup_b = supervisor(procs, hosts, "b", config, tmp_path)
        for sup in (sup_a, sup_b):
            ready = sup.wait_line("READY supervisor", 60)
            assert ready.startswith("READY") and "servers=2 running=2" in ready, ready
            assert "active_shards=2/2" in ready, ready

        # status from a third host: every server of both hosts
        done = run_on(hosts, "c", "-m", "clonemap.supervisor", "status", str(config), "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        status = json.loads(done.stdout)
        assert sorted(r["role"] for r in status["servers"]) == [
            "backup@a", "backup@b", "primary@a", "primary@b"]
        assert status["without_active"] == [] and status["unreachable"] == {}

        # a client given host a's control endpoint writes to both shards
        control = f"control=tcp://{hosts.address['a']}:5555"
        writer = procs.spawn([*hosts.prefix("c"), PYTHON, LEDGER, "write", control, "/k/", "300"],
                             ready="READY", timeout_s=60, env=ENV)
        writer._out.wait_for(lambda line: line.startswith("ACK /k/40"), 60)

        hosts.kill("a")  # supervisor a, s0's primary, s1's backup: all at once
        writer._out.wait_for(lambda line: line.startswith("ACK ") and
                             int(line.split("/")[-1]) > 60, 60)
        writer.signal(signal.SIGTERM)
        assert writer.wait(30) == 0
        acked = {line.split()[1] for line in writer.stdout if line.startswith("ACK ")}
        # a fresh client given both hosts' control endpoints, the dead one first
        reader = procs.spawn([*hosts.prefix("c"), PYTHON, LEDGER, "read",
                              f"control=tcp://{hosts.address['a']}:5555,"
                              f"tcp://{hosts.address['b']}:5555"], env=ENV)
        assert reader.wait(60) == 0, "\n".join(reader.stderr[-20:])
        got = dict(line.split(" ", 1) for line in reader.stdout[1:-1])
        missing = sorted(k for k in acked if got.get(k) != k.rsplit("/", 1)[-1])
        assert not missing, f"{len(missing)} of {len(acked)} acknowledged writes lost"

        # status names the host that does not answer
        done = run_on(hosts, "c", "-m", "clonemap.supervisor", "status", str(config), "--json",
                      "--timeout-s", "0.5")
        assert done.returncode == 1
        status = json.loads(done.stdout)
        assert list(status["unreachable"]) == ["a"]
        assert status["without_active"] == []  # b serves both shards now

        # a control command needs the host when the config has several; stop b's
        done = run_on(hosts, "c", "-m", "clonemap.supervisor", "stop", str(config))
        assert done.returncode == 2 and "--host NAME" in done.stderr
        done = run_on(hosts, "c", "-m", "clonemap.supervisor", "stop", str(config), "--host", "b")
        assert done.returncode == 0, done.stderr
        assert sup_b.wait(30) == 0
    finally:
        procs.stop_all()
        etcd.stop()
