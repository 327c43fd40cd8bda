"""A pair split over two hosts, coordinated by a real etcd, under network partitions:
no acknowledged write is lost, whatever the fault.

Hosts are network namespaces (``bench.harness.netns.Hosts``): a supervisor per host from
one config (``supervisor start CONFIG --host NAME``) runs the primary on host a and the
backup on host b, etcd runs on host e, and real clients (``ledger_client.py``,
``wait=True`` writes) on a, b and c. Each test injects one fault of issue 26's list with iproute2, heals it,
stops the writers and checks the ledger: every write a writer was told was acknowledged
is in the map a fresh client reads afterwards, with its value.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from conftest import PYTHON, ROOT, EtcdServer, Procs
from helpers import acknowledged
from bench.harness.netns import Hosts

pytestmark = pytest.mark.timeout(180)

LEASE_S = 2.0
HEARTBEAT_S = 0.2
CLUSTER = "part"
PORT = 6000
LEDGER = str(Path(__file__).with_name("ledger_client.py"))
WRITER_RATE = 300
"""Each ledger writer's writes a second: a steady load, as a user's writer. Flat out (one
write at a time, as fast as the pair acknowledged), this module and test_hosts_supervised
took 70.6 s of CPU where they take 43.2 s paced, in the same wall time."""


class Cluster:
    """etcd on e, the pair on a (primary) and b (backup) under a supervisor per host from
    one config (``supervisor start CONFIG --host NAME``), writers wherever asked."""

    def __init__(self, hosts: Hosts, tmp: Path):
        self.hosts = hosts
        self.procs = Procs()
        self.etcd = EtcdServer(tmp / "etcd", host=hosts.address["e"], prefix=hosts.prefix("e"))
        self.tmp = tmp
        self.writers: dict[str, object] = {}
        self.endpoints = ",".join(f"tcp://{hosts.address[h]}:{PORT}" for h in ("a", "b"))
        config = tmp / "part.yaml"
        a, b = hosts.address["a"], hosts.address["b"]
        config.write_text(yaml.safe_dump({
            "cluster": CLUSTER, "heartbeat_s": HEARTBEAT_S,
            "hosts": {"a": {"control": f"tcp://{a}:5555"}, "b": {"control": f"tcp://{b}:5555"}},
            "coordination": {"etcd": [f"{self.etcd.host}:{self.etcd.port}"],
                             "lease_s": LEASE_S},
            "shards": [{"name": "s0", "primary": {"at": "a", "host": a, "port": PORT},
                        "backup": {"at": "b", "host": b, "port": PORT}}]}))
        self.supervisors = {
            host: self.procs.spawn([*hosts.prefix(host), PYTHON, "-m", "clonemap.supervisor", "start",
                                    str(config), "--host", host, "--no-table", "--run-dir",
                                    str(tmp / f"run-{host}")], env={"PYTHONPATH": str(ROOT)})
            for host in ("a", "b")}
        for host, sup in self.supervisors.items():  # each host's pair needs the other's
            ready = sup.wait_line("READY supervisor", 60)
            assert ready.startswith("READY"), f"host {host}: {ready}"

    def writer(self, host: str, prefix: str):
        proc = self.procs.spawn([*self.hosts.prefix(host), PYTHON, LEDGER, "write",
                                 self.endpoints, prefix, str(WRITER_RATE)], ready="READY", timeout_s=40,
                                env={"PYTHONPATH": str(ROOT)})
        self.writers[prefix] = proc
        return proc

    def acks(self, prefix: str) -> int:
        return sum(1 for line in self.writers[prefix].stdout if line.startswith("ACK "))

    def wait_acks(self, prefix: str, more: int, timeout_s: float = 30.0) -> None:
        """Until ``prefix``'s writer has ``more`` acknowledgements beyond its count now
        (each awaited as the writer's next output line: an event, not a poll)."""
        want = self.acks(prefix) + more
        deadline = time.monotonic() + timeout_s
        pump = self.writers[prefix]._out
        while self.acks(prefix) < want:
            try:
                pump.wait_for(lambda line: line.startswith("ACK "),
                              max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                raise AssertionError(f"{prefix}: {self.acks(prefix)} ACKs, not {want}, "
                                     f"within {timeout_s} s\n{self.dump()}") from None

    def wait_fail(self, prefix: str, timeout_s: float = 30.0) -> None:
        """Until ``prefix``'s writer reports a write that was not acknowledged."""
        try:
            self.writers[prefix]._out.wait_for(lambda line: line.startswith("FAIL "),
                                               timeout_s)
        except TimeoutError:
            raise AssertionError(f"{prefix}: no failed write within {timeout_s} s\n"
                                 f"{self.dump()}") from None

    def alone(self) -> str:
        """Who etcd says went on alone ("" for nobody), asked from host c."""
        proc = self.procs.spawn(
            [*self.hosts.prefix("c"), PYTHON, "-c",
             "import sys; from shards import coord; "
             "print((coord.Etcd([(sys.argv[1], int(sys.argv[2]))]).get("
             f"coord.alone_key('{CLUSTER}-s0')) or b'').decode())",
             self.etcd.host, str(self.etcd.port)], env={"PYTHONPATH": str(ROOT)})
        assert proc.wait(30) == 0, "\n".join(proc.stderr[-10:])
        return proc.stdout[0] if proc.stdout else ""

    def wait_alone(self, who: str, timeout_s: float = 30.0) -> None:
        """Until etcd's alone record names ``who`` ("": until it is cleared); each check is
        a round trip to etcd."""
        deadline = time.monotonic() + timeout_s
        while (now := self.alone()) != who:
            assert time.monotonic() < deadline, f"alone record {now!r}, not {who!r}"

    def dump(self) -> str:
        """The last lines of every process, for a failure's message."""
        out = []
        for proc in self.procs.started:
            name = " ".join(proc.args[4:8])
            out.append(f"--- {name}: stdout")
            out += proc.stdout[-8:]
            out.append(f"--- {name}: stderr")
            out += proc.stderr[-25:]
        return "\n".join(out)

    def ledger(self) -> dict[str, str]:
        """Stop every writer; every acknowledged (key, value)."""
        return acknowledged(self.writers)

    def read(self, host: str = "c") -> dict[str, str]:
        proc = self.procs.spawn([*self.hosts.prefix(host), PYTHON, LEDGER, "read",
                                 self.endpoints], env={"PYTHONPATH": str(ROOT)})
        assert proc.wait(60) == 0, "\n".join(proc.stderr[-20:])
        lines = proc.stdout
        assert lines[-1].startswith("END ")
        return dict(line.split(" ", 1) for line in lines[1:-1])

    def stop(self) -> None:
        self.procs.stop_all()
        self.etcd.stop()


@pytest.fixture
def cluster(hosts, tmp_path):
    made = Cluster(hosts, tmp_path)
    try:
        yield made
    finally:
        made.stop()


def check_ledger(cluster: Cluster) -> dict[str, str]:
    acked = cluster.ledger()
    assert acked, "no write was acknowledged at all"
    got = cluster.read()
    missing = {k: v for k, v in acked.items() if got.get(k) != v}
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged writes lost: " \
                        f"{sorted(missing)[:10]}"
    return acked


def fails(cluster: Cluster, prefix: str) -> int:
    return sum(1 for line in cluster.writers[prefix].stdout if line.startswith("FAIL "))


def test_the_active_isolated_with_a_writer_on_its_host_loses_nothing(cluster, hosts):
    """Issue 26's 562 lost writes: the primary's host cut off from everyone while a
    writer on that host goes on; the backup takes over for the others."""
    cluster.writer("a", "/wa/")
    cluster.writer("c", "/wc/")
    cluster.wait_acks("/wa/", 20)
    cluster.wait_acks("/wc/", 20)
    hosts.isolate("a")
    cluster.wait_fail("/wa/")  # a acknowledges nothing without its peer and etcd
    cluster.wait_acks("/wc/", 20, timeout_s=LEASE_S + 30)  # served by b now
    cluster.wait_alone(f"backup@{hosts.address['b']}:{PORT}")  # b went on alone
    # a longer fault on request (the benchmark's question: how soon is a healed link
    # seen); the test itself heals at once
    time.sleep(float(os.environ.get("CLONEMAP_PARTITION_HOLD_S", "0")))
    hosts.heal()
    healed = time.monotonic()
    cluster.wait_alone("")  # a copied b's map: b waits for it again
    print(f"the pair whole again {time.monotonic() - healed:.2f} s after the heal")
    cluster.wait_acks("/wa/", 5, timeout_s=60)  # a's writer reaches the new active
    cluster.wait_acks("/wc/", 5)
    check_ledger(cluster)


def test_a_cut_between_the_servers_with_writers_on_both_sides_loses_nothing(cluster, hosts):
    """A and B cannot talk; both reach etcd and the clients of their own side. The
    active keeps its lease and goes on alone (recorded in etcd); the passive cannot
    take over, so b's writer is refused, never acknowledged by a second server."""
    cluster.writer("a", "/wa/")
    cluster.writer("b", "/wb/")
    cluster.wait_acks("/wa/", 20)
    cluster.wait_acks("/wb/", 20)
    hosts.cut("a", "b")
    cluster.wait_alone(f"primary@{hosts.address['a']}:{PORT}")
    cluster.wait_acks("/wa/", 20, timeout_s=30)  # a serves its side, alone
    cluster.wait_fail("/wb/")  # b's side: refused, not acknowledged by b
    b_acks = cluster.acks("/wb/")  # one write at a time: any ACK from now on is b's
    cluster.wait_fail("/wb/")
    cluster.wait_acks("/wa/", 20, timeout_s=30)
    assert cluster.acks("/wb/") == b_acks, "b acknowledged writes while a did"
    hosts.heal()
    cluster.wait_acks("/wb/", 5, timeout_s=60)
    cluster.wait_acks("/wa/", 5)
    check_ledger(cluster)


def test_a_client_cut_from_the_active_only_loses_nothing(cluster, hosts):
    """c reaches only the passive: its writes time out (nothing acknowledges them),
    and the pair does not change hands for it."""
    cluster.writer("a", "/wa/")
    cluster.writer("c", "/wc/")
    cluster.wait_acks("/wc/", 20)
    hosts.cut("c", "a")
    cluster.wait_fail("/wc/")
    # the error names the cause: one server unreachable, the other passive
    try:
        line = cluster.writers["/wc/"]._out.wait_for(
            lambda text: text.startswith("FAIL ") and "cut off from the active" in text, 30)
    except TimeoutError:  # (once in a clean clone on a busy host: say what it did say)
        raise AssertionError("no failure naming the cut within 30 s\n"
                             f"{cluster.dump()}") from None
    assert line is not None and "not serving" in line, line
    cluster.wait_acks("/wa/", 20, timeout_s=30)
    assert cluster.alone() == ""  # the pair itself never noticed
    hosts.heal()
    cluster.wait_acks("/wc/", 5, timeout_s=60)
    check_ledger(cluster)


@pytest.mark.parametrize("dropper", ["a", "b"])
def test_a_one_way_cut_between_the_servers_loses_nothing(cluster, hosts, dropper):
    """One server drops what it would send to the other (a blackhole route on one side
    only): the state messages flow one way, the link's confirmations do not."""
    cluster.writer("c", "/wc/")
    cluster.wait_acks("/wc/", 20)
    hosts.one_way(dropper, "b" if dropper == "a" else "a")
    # the active stops hearing confirmations: it records going on alone, then goes on
    cluster.wait_alone(f"primary@{hosts.address['a']}:{PORT}")
    cluster.wait_acks("/wc/", 20, timeout_s=30)
    hosts.heal()
    cluster.wait_alone("")
    cluster.wait_acks("/wc/", 20, timeout_s=60)
    check_ledger(cluster)


def test_the_active_host_killed_outright_loses_nothing(cluster, hosts):
    """Every process of host a killed at once (no release of the lease): b takes over
    once the lease has expired, with every write a acknowledged."""
    cluster.writer("a", "/wa/")
    cluster.writer("c", "/wc/")
    cluster.wait_acks("/wa/", 20)
    cluster.wait_acks("/wc/", 20)
    assert cluster.alone() == ""  # both servers hold every write: no fault yet
    before = cluster.acks("/wc/")
    assert hosts.kill("a") >= 3  # supervisor, server and writer of host a, all at once
    cluster.wait_acks("/wc/", 20, timeout_s=LEASE_S + 30)  # b serves (the takeover's
    # time is measured by `python -m bench hosts`, not asserted here)
    assert cluster.acks("/wc/") > before
    cluster.writers.pop("/wa/").stop()
    acked = {k: v for k, v in check_ledger(cluster).items()}
    a_lines = [line for line in cluster.procs.started if "/wa/" in " ".join(line.args)]
    wa = {line.split()[1] for p in a_lines for line in p.stdout if line.startswith("ACK ")}
    got = cluster.read()
    assert wa and all(got.get(k) == k[len("/wa/"):] for k in wa), "a's writes lost"
    assert acked


def test_a_random_partition_schedule_loses_nothing(cluster, hosts):
    """A nemesis: a seeded random schedule of the faults above, each held for up to
    twice the lease and then healed; the writers on a and c must make progress after
    each heal, and the ledger is checked at the end."""
    import random

    seed = int(os.environ.get("CLONEMAP_NEMESIS_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    print(f"nemesis seed {seed} (CLONEMAP_NEMESIS_SEED={seed} repeats it)")
    cluster.writer("a", "/wa/")
    cluster.writer("c", "/wc/")
    cluster.wait_acks("/wc/", 10)
    faults = [lambda: hosts.isolate("a"), lambda: hosts.isolate("b"),
              lambda: hosts.cut("a", "b"), lambda: hosts.one_way("a", "b"),
              lambda: hosts.one_way("b", "a"), lambda: hosts.cut("c", "a")]
    names = ["isolate a", "isolate b", "cut a|b", "a drops to b", "b drops to a", "cut c|a"]
    try:
        _nemesis_rounds(cluster, hosts, rng, faults, names)
    except AssertionError as exc:  # the seed repeats the schedule
        raise AssertionError(f"nemesis seed {seed}: {exc}\n{cluster.dump()}") from None
    acked = check_ledger(cluster)
    print(f"{len(acked)} acknowledged writes, none lost")


def _nemesis_rounds(cluster: Cluster, hosts: Hosts, rng, faults, names) -> None:
    for round_ in range(5):
        k = rng.randrange(len(faults))
        hold_s = rng.uniform(0.5, 2 * LEASE_S)
        print(f"round {round_}: {names[k]} for {hold_s:.1f} s")
        faults[k]()
        # the fault is held for a drawn time (the schedule itself: nothing to await)
        time.sleep(hold_s)
        hosts.heal()
        cluster.wait_acks("/wc/", 5, timeout_s=60)
        cluster.wait_acks("/wa/", 5, timeout_s=60)
        # the ledger so far, read back by a fresh client while the writers go on
        so_far = {line.split()[1] for proc in cluster.writers.values()
                  for line in list(proc.stdout) if line.startswith("ACK ")}
        got = cluster.read()
        lost = sorted(k for k in so_far if got.get(k) != k.rsplit("/", 1)[-1])
        assert not lost, f"round {round_}: {len(lost)} of {len(so_far)} lost: {lost[:10]}"
