"""Shared fixtures: free ports, real processes ended by PID, zmq sockets closed with linger 0.

Every process a test starts goes through ``procs.spawn``; teardown ends exactly those
PIDs (SIGTERM, then SIGKILL after a grace period) and reports any that had to be killed.
Readiness is awaited on the process's own stdout line (an event), never by sleeping.
"""
from __future__ import annotations

import collections

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clonemap.shards.common.children import LinePump, terminate
from clonemap.shards.common.ports import ports_free

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# ------------------------------------------------------------------ kinds of test
KINDS = {"unit": "unit", "integration": "integration", "bench": "bench"}
"""The directory a test module sits in is its kind, and its marker:

* ``tests/unit/``: pure tests: no sockets, no processes, no zmq; real files in a temporary
  directory at most (``make test-unit``);
* ``tests/integration/``: real sockets and real processes;
* ``tests/bench/``: smoke runs of the benchmarks."""


LONGEST_FIRST = (
    "integration/test_reshard_hosts.py", "integration/test_reshard_hosts_cuts.py",
    "integration/test_reshard_hosts_kills.py", "integration/test_partitions.py",
    "integration/test_hosts_supervised.py",
    "integration/test_routing_epoch.py", "bench/test_bench_all.py",
    "bench/test_bench_scenarios.py", "integration/test_disk_faults.py", "integration/test_wheel.py",
    "integration/test_relay_conformance.py", "integration/test_operator_first_hour.py",
    "bench/test_bench_load.py", "integration/test_doc_examples.py",
    "integration/test_pair_lease.py", "integration/test_access_control.py",
    "integration/test_supervisor_cli.py", "integration/test_chp_cli.py",
    "integration/test_durable_cluster.py", "integration/test_conditional.py",
    "integration/test_identities.py", "integration/test_operations.py")
"""The modules that took longest in a full run (``--junitxml``, 27-157 s each, summed
over their tests, on 2 cores), longest first. With ``--no-loadscope-reorder`` (the
Makefile's), pytest-xdist's ``--dist loadfile`` hands whole modules to idle workers in
collection order, so these are collected first: a long module started last would
otherwise run on alone after the others finished. (Without that option pytest-xdist
orders modules by their number of tests, and ``test_bench_all``, one test of 2 minutes,
started last: 617 s of ``make test`` where this order predicts 536.)"""


ONE_AT_A_TIME = {
    "integration/test_reshard_hosts.py": "hosts", "integration/test_reshard_hosts_cuts.py": "hosts",
    "integration/test_reshard_hosts_kills.py": "hosts", "integration/test_partitions.py": "hosts",
    "integration/test_hosts_supervised.py": "hosts"}
"""Modules that run one after another in one worker (the same group), whatever the number
of workers: the pairs across hosts, each with 2 s leases in etcd. Two of them at once on 2
cores starved each other's lease renewals, and their growths rolled back until their 60 s
passed. They are listed in ``LONGEST_FIRST`` so the group starts first."""


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, with the ``ONE_AT_A_TIME`` modules as one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return ONE_AT_A_TIME.get(path.removeprefix("tests/"), path)

    return GroupedFiles(config, log)


def pytest_collection_modifyitems(config, items):
    """Mark every test ``unit``, ``integration`` or ``bench`` by its directory; a unit
    module that imports zmq, or a test outside the three directories, is refused. The
    ``LONGEST_FIRST`` modules are moved to the front, in that order (the rest keep
    theirs)."""
    tests_dir = Path(__file__).parent
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(tests_dir).as_posix()
                                         if item.path.is_relative_to(tests_dir) else "",
                                         len(rank)))
    for item in items:
        kind = KINDS.get(item.path.parent.name)
        if kind is None:
            raise pytest.UsageError(f"{item.path}: a test lives in tests/unit, "
                                    "tests/integration or tests/bench")
        if kind == "unit" and "zmq" in vars(item.module):
            raise pytest.UsageError(f"{item.path.name} is a unit test but imports zmq")
        item.add_marker(getattr(pytest.mark, kind))


TEST_PORTS = (20000, 32760)
RANGE_GAP = 20
"""Ports kept free between two ranges handed out in this run."""
RECENT_RANGES = 80
"""How many of the latest ranges a new one keeps clear of, over the whole of
``TEST_PORTS``; a worker of pytest-xdist, with its slice, keeps clear of its share."""


def _workers() -> tuple[int, int]:
    """(this worker's index, how many workers): (0, 1) outside pytest-xdist."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    return index, count


def _share(lo: int, hi: int, step: int = 1) -> tuple[int, int]:
    """This process's share of the ports ``lo``-``hi``: all of them, or under pytest-xdist
    one slice per worker (its width a multiple of ``step``), so that two workers never
    pick the same range between a check and a bind."""
    index, count = _workers()
    width = (hi - lo) // count // step * step
    return lo + index * width, lo + (index + 1) * width


def _worker_ports() -> tuple[int, int]:
    """This process's share of ``TEST_PORTS``."""
    return _share(*TEST_PORTS)


def _bench_ports() -> str:
    """This worker's slice of the benchmarks' ports (``bench.harness.procs.PORT_RANGE``),
    as ``_worker_ports`` slices the tests'."""
    from bench.harness.procs import PORT_RANGE

    lo, hi = _share(*PORT_RANGE, step=10)
    return f"{lo}-{hi}"


# every benchmark a test starts takes its ports from this worker's slice: with four
# workers, two benchmarks run at once took the same port between one's check and its bind
os.environ["CLONEMAP_BENCH_PORTS"] = _bench_ports()  # (bench.harness.procs.PORTS_ENV)

_used_ranges: collections.deque[tuple[int, int]] = collections.deque(
    maxlen=RECENT_RANGES // _workers()[1])
"""The ranges handed out most recently: a new range keeps clear of them. Older ones may
be handed out again (their tests ended their processes by PID long ago); keeping every
range of a run fragments the ports until a 205-port range (the doc examples') cannot be
found."""


def free_port_base(count: int = 4, host: str = "127.0.0.1") -> int:
    """A base P such that P..P+count-1 are free on ``host`` now (checked by binding).

    Bases come from 20000-32760 (this worker's slice of it, under pytest-xdist): below
    Linux's default ephemeral range (32768-60999), so an outgoing connection cannot take
    a port between this check and the bind, and above the benchmarks' 10000-19990.
    A range never overlaps one of the latest handed out in this process, nor comes
    within ``RANGE_GAP`` of it (the oldest of those are forgotten first when no gap is
    wide enough); among the bases that qualify (multiples of 10, in a random order),
    the first whose ports all bind is taken."""
    lo, hi = _worker_ports()
    while True:
        bases = [base for base in range(lo, hi - count, 10)
                 if all(base + count + RANGE_GAP <= used_lo or base >= used_hi + RANGE_GAP
                        for used_lo, used_hi in _used_ranges)]
        random.shuffle(bases)
        for base in bases:
            if ports_free(host, base, count):
                _used_ranges.append((base, base + count))
                return base
        if not _used_ranges:
            raise RuntimeError(f"no {count} free ports in {lo}-{hi}")
        # the recent ranges, placed at random, left no gap this wide (the doc examples'
        # 205 ports, after a dozen of them): the oldest may be handed out again
        _used_ranges.popleft()


@pytest.fixture
def port_base():
    """A free base port with four consecutive free ports (P..P+3)."""
    return free_port_base(4)


class Proc:
    """A child process whose stdout and stderr lines are collected by a thread."""

    def __init__(self, args: list[str], env: dict | None = None, cwd: Path = ROOT):
        self.args = args
        full_env = dict(os.environ)
        full_env["PYTHONUNBUFFERED"] = "1"
        if env:
            full_env.update(env)
        self.popen = subprocess.Popen(
            args, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.pid = self.popen.pid
        self._out = LinePump(self.popen.stdout)
        self._err = LinePump(self.popen.stderr, queued=False)
        self.stdout: list[str] = self._out.lines
        self.stderr: list[str] = self._err.lines

    def wait_line(self, contains: str, timeout_s: float = 15.0) -> str:
        """Block until a stdout line contains ``contains``; fail with the output tail."""
        try:
            line = self._out.wait_for(lambda text: contains in text, timeout_s)
        except TimeoutError:
            raise AssertionError(f"{self.args[:4]} printed no {contains!r} within {timeout_s} s\n"
                                 "stderr tail:\n" + "\n".join(self.stderr[-30:])) from None
        if line is None:
            self.popen.wait(5)
            raise AssertionError(
                f"{self.args[:4]} exited ({self.popen.returncode}) before printing "
                f"{contains!r}\nstderr tail:\n" + "\n".join(self.stderr[-30:]))
        return line

    def wait_stderr(self, contains: str, start: int = 0, timeout_s: float = 15.0) -> int:
        """Block until a stderr line at index ``start`` or later contains ``contains``
        (woken by each line the reader thread appends); its index. Fails with the tail
        if it does not come, or if the process exits first."""
        try:
            index = self._err.wait_index(lambda text: contains in text, start, timeout_s)
        except TimeoutError:
            raise AssertionError(f"{self.args[:6]}: no {contains!r} on stderr within "
                                 f"{timeout_s} s; tail:\n" + "\n".join(self.stderr[-20:])
                                 ) from None
        if index is None:
            self.popen.wait(5)
            raise AssertionError(f"{self.args[:6]} exited ({self.popen.returncode}) "
                                 f"without {contains!r} on stderr; tail:\n"
                                 + "\n".join(self.stderr[-20:]))
        return index

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def wait(self, timeout_s: float = 10.0) -> int:
        """The exit code, once every line the process wrote is in ``stdout`` and
        ``stderr`` (its reader threads reached the pipes' end: an exit alone does not
        mean they have read its last lines)."""
        code = self.popen.wait(timeout_s)
        self._joined(2.0)
        return code

    def _joined(self, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        for pump in (self._out, self._err):
            pump.thread.join(max(0.0, deadline - time.monotonic()))

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGCONT and SIGTERM (a stopped process cannot act on SIGTERM), wait up to
        ``grace_s``, then SIGKILL. Returns the exit code."""
        code = terminate(self.popen, grace_s, resume=True)
        self._joined(4.0)
        return code


class Procs:
    def __init__(self):
        self.started: list[Proc] = []

    def spawn(self, args: list[str], ready: str | None = None, timeout_s: float = 15.0,
              env: dict | None = None, cwd: Path = ROOT) -> Proc:
        proc = Proc(args, env=env, cwd=cwd)
        self.started.append(proc)
        if ready is not None:
            proc.wait_line(ready, timeout_s)
        return proc

    def python(self, *args: str, ready: str | None = None, timeout_s: float = 15.0,
               env: dict | None = None) -> Proc:
        return self.spawn([PYTHON, *args], ready=ready, timeout_s=timeout_s, env=env)

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            proc.stop()


@pytest.fixture
def procs():
    """Start real processes; every one is ended by PID at teardown."""
    p = Procs()
    try:
        yield p
    finally:
        p.stop_all()


def keeping_context():
    """A zmq Context that holds every socket it makes until ``destroy`` closes it: a
    test's helper object that goes out of scope earlier would otherwise leave its
    sockets to the garbage collector, unclosed (a ResourceWarning, an error under
    ``filterwarnings = error``)."""
    import zmq

    class KeepingContext(zmq.Context):
        def socket(self, *args, **kwargs):
            sock = super().socket(*args, **kwargs)
            self.__dict__.setdefault("_kept_sockets", []).append(sock)
            return sock

    return KeepingContext()


@pytest.fixture
def zctx():
    """A zmq Context whose sockets are all closed with linger 0 at teardown (and kept
    alive until then: ``keeping_context``)."""
    ctx = keeping_context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


# ------------------------------------------------------------------ benchmark smoke tests
BENCH_TIMEOUT_S = 180


def bench_record(results_dir, name: str) -> dict:
    """The record a benchmark saved under ``results_dir``, checked for the shape every
    record has (latest copy = stamped copy, host facts, targets, Markdown page)."""
    latest = results_dir / "latest" / f"{name}.json"
    assert latest.exists(), f"no {latest}"
    data = json.loads(latest.read_text())
    stamped = list(results_dir.glob(f"{name}-*.json"))
    assert len(stamped) == 1 and json.loads(stamped[0].read_text()) == data
    assert data["schema"] == 1 and data["benchmark"] == name
    # (a variant's record is named after its scenario: reshard-shrink is bench.reshard)
    assert data["command"].startswith(f"python -m bench.{name.split('-')[0]} ")
    host = data["host"]
    assert host["cores_logical"] >= 1 and len(host["loadavg_before"]) == 3
    assert len(host["loadavg_after"]) == 3 and host["pyzmq"] and host["libzmq"]
    assert data["duration_s"] > 0 and data["runs"] and data["targets"]
    for t in data["targets"]:
        assert set(t) >= {"name", "value", "target", "unit", "met"}
    md = (results_dir / "latest" / f"{name}.md").read_text()
    assert stamped[0].with_suffix(".md").read_text() == md
    assert md.startswith(f"# {name} ") and f"`{data['command']}`" in md
    assert f"## {name}: targets" in md and "| target | value | goal | unit | met |" in md
    return data


def run_bench(procs, results_dir, *args: str, timeout_s: float | None = None) -> list[str]:
    """``python -m ARGS --results-dir DIR`` to completion (exit 0); its stdout lines."""
    proc = procs.python("-m", *args, "--results-dir", str(results_dir))
    try:
        rc = proc.wait(timeout_s or BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # say how far it got, not only that it was late
        raise AssertionError("still running after the deadline; its last lines:\n"
                             + "\n".join(list(proc.stderr)[-15:] + proc.stdout[-10:])) from None
    if rc != 0:  # a failed scenario's traceback may lie far above the last lines
        err = list(proc.stderr)
        first = next((i for i, line in enumerate(err) if line.startswith("Traceback")), None)
        shown = (err[first:first + 40] + ["..."] if first is not None else []) + err[-30:]
        raise AssertionError(f"exit {rc}:\n" + "\n".join(shown + proc.stdout[-20:]))
    return proc.stdout


@pytest.fixture(scope="session")
def cluster_keys(tmp_path_factory) -> Path:
    """A keys directory made as ``supervisor keygen`` makes it (server and client pairs)."""
    from clonemap.shards.common.security import create_keys

    path = tmp_path_factory.mktemp("keys")
    create_keys(path)
    return path


def wait_until(predicate, what: str, timeout_s: float = 30.0, every_s: float = 0.05):
    """Poll ``predicate`` until it returns something true (returned), for a state that
    has no event to await; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"no {what} within {timeout_s} s")


FRAME_PATHS = ["pure"] + (["compiled"] if __import__("clonemap.shards.common.zio", fromlist=["zio"])
                          .COMPILED else [])
"""The frame paths this machine has (``clonemap.shards.common.zio``): the compiled one when the
extension is built here (it is wherever a C compiler is), and always the pure one."""


@pytest.fixture(params=FRAME_PATHS)
def frame_path(request, monkeypatch):
    """Run a test on each frame path of ``clonemap.shards.common.zio`` in this process (the module
    functions and ``AsyncSocket``'s drain are switched for the test's duration)."""
    from clonemap.shards.common import zio

    if request.param == "pure":
        monkeypatch.setattr(zio, "COMPILED", False)
        monkeypatch.setattr(zio, "recv_frames", zio._recv_frames_pure)
        monkeypatch.setattr(zio, "send_frames", zio._send_frames_pure)
        monkeypatch.setattr(zio, "send_frames5", zio._send_frames5_pure)
    return request.param


# ------------------------------------------------------------------ etcd (a real one)
class EtcdServer:
    """One single-member etcd (``bench.harness.etcd``), in a temporary directory, on free
    loopback ports (or on ``host``, run inside a network namespace by ``prefix``).
    ``port``: start again a member stopped earlier, on its ports (client P, peer P+1).
    A machine with no etcd skips the test, saying how to get one."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1", prefix: tuple = (),
                 port: int | None = None):
        from bench.harness import etcd

        if etcd.binary() is None:
            pytest.skip(etcd.MISSING)
        self.host = host
        self.port = free_port_base(2, "127.0.0.1") if port is None else port
        self.member = etcd.Etcd(data_dir, self.port, host, prefix)

    @property
    def url(self) -> str:
        return self.member.url

    def stop(self) -> None:
        self.member.stop()


@pytest.fixture
def hosts():
    """Hosts a, b, c and e as network namespaces joined by a bridge
    (``bench.harness.netns``), removed at teardown; skipped, saying why, where this
    process may not make them."""
    from bench.harness.netns import Hosts, available

    if available():
        pytest.skip(available())
    made = Hosts(["a", "b", "c", "e"])
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory):
    """A real etcd for the module's tests (each test uses its own lease names)."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()
