"""Processes under test: start one, wait for its READY line, end it by PID.

A ``Target`` is a server process a benchmark measures (the real shard server, or the bare
forwarding loop). It runs in its own session (so a terminal's Ctrl-C reaches only the
benchmark, which then ends it), its stdout is drained by a thread, its stderr goes to a
temporary file whose tail is shown if it fails. ``stop`` sends SIGTERM and, after a grace
period, SIGKILL - always to the PID it started, never by name. A ``Daemon`` is another
project's server (etcd, Redis, NATS): the same, but ready on a line of its own log that
holds a given text anywhere, and its stdout and stderr read together.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clonemap.shards.common import ports
from clonemap.shards.common.children import LinePump, terminate

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 30.0


def server_argv(port: int, host: str = "127.0.0.1", extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "clonemap.shards", "--port", str(port), "--host", host, *extra]


def forwarder_argv(port: int, host: str = "127.0.0.1", extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "bench.harness.forwarder", "--port", str(port), "--host", host, *extra]


PORT_RANGE = (10000, 19990)
"""Where benchmarks take their ports: below the tests' range (20000-45000) and below
Linux's ephemeral range (32768-60999), from which any process's outgoing connection may
take a port between our check and our bind."""


PORTS_ENV = "CLONEMAP_BENCH_PORTS"
"""``LO-HI``: a part of ``PORT_RANGE`` this benchmark takes its ports from (the test suite
gives each of its workers its own, so that two benchmarks run at once never pick the same
ports between one's check and its bind: with four workers, a supervisor's port was taken
so once)."""


def port_range() -> tuple[int, int]:
    """``PORT_RANGE``, or the part of it ``PORTS_ENV`` names."""
    said = os.environ.get(PORTS_ENV)
    if not said:
        return PORT_RANGE
    try:
        lo, hi = (int(x) for x in said.split("-"))
    except ValueError:
        raise SystemExit(f"${PORTS_ENV}: expected LO-HI, got {said!r}") from None
    if not PORT_RANGE[0] <= lo < hi <= PORT_RANGE[1]:
        raise SystemExit(f"${PORTS_ENV}: {said!r} is not inside {PORT_RANGE[0]}-"
                         f"{PORT_RANGE[1]}")
    return lo, hi


def free_port_base(count: int = 4, host: str = "127.0.0.1") -> int:
    """A base P in ``port_range()`` such that P..P+count-1 can be bound on ``host`` now."""
    lo, hi = port_range()
    return ports.free_port_base(lo, hi, count, host)


PORTS_PER_SHARD = 20
"""A cluster config's ports per shard: primary P..P+3, backup P+10..P+13."""


def relocated_config(config: Path, tmp: Path, data_dir: Path | None = None
                     ) -> tuple[Path, str, dict]:
    """A copy of the cluster ``config`` in ``tmp`` that meets no running cluster: a free
    control endpoint, free server ports, no metrics endpoint (9464 may be another
    cluster's) and, given ``data_dir``, its data there; (path, control endpoint, the
    config as written)."""
    import yaml

    data = yaml.safe_load(config.read_text())
    if isinstance(data["shards"], int):  # `shards: N`: N shards of defaults, as the loader
        data["shards"] = [{} for _ in range(data["shards"])]
    span = PORTS_PER_SHARD * len(data["shards"])
    control_port = free_port_base(1)
    while True:
        base = free_port_base(span)
        if not base <= control_port < base + span:
            break
    data["control"] = f"tcp://127.0.0.1:{control_port}"
    data["metrics"] = "off"
    if data_dir is not None:
        data["data_dir"] = str(data_dir)
    data.pop("port_base", None)
    for i, shard in enumerate(data["shards"]):
        shard.setdefault("primary", {})["port"] = base + PORTS_PER_SHARD * i
        shard.setdefault("backup", {})["port"] = base + PORTS_PER_SHARD * i + 10
    path = tmp / config.name
    path.write_text(yaml.safe_dump(data))
    return path, data["control"], data


class Target:
    def __init__(self, name: str, argv: list[str], ready: str = "READY",
                 timeout_s: float = READY_TIMEOUT_S, stdin: bool = False):
        """``stdin``: the process reads commands there (``send``)."""
        self.name = name
        self.argv = argv
        self._stderr = tempfile.TemporaryFile()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen(argv, cwd=ROOT, env=env,
                                      stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=self._stderr,
                                      start_new_session=True)
        self.pid = self.popen.pid
        self.ready_line = ""
        self._stdout = LinePump(self.popen.stdout)
        try:
            self.ready_line = self._wait_line(ready, timeout_s)
        except BaseException:
            self.stop()
            raise

    def send(self, text: str) -> None:
        """A line of commands to a process started with ``stdin``."""
        self.popen.stdin.write(text.encode())
        self.popen.stdin.flush()

    def wait_line(self, prefix: str, timeout_s: float) -> str:
        """The next line of its output that starts with ``prefix``."""
        return self._wait_line(prefix, timeout_s)

    def _wait_line(self, prefix: str, timeout_s: float) -> str:
        try:
            line = self._stdout.wait_for(lambda text: text.startswith(prefix), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self.name} printed no {prefix!r} line within {timeout_s} s: "
                               f"{self.stderr_tail()}") from None
        if line is None:
            self.popen.wait(5)
            raise RuntimeError(f"{self.name} exited ({self.popen.returncode}) before "
                               f"{prefix!r}: {self.stderr_tail()}")
        return line

    def stderr_tail(self, lines: int = 15) -> str:
        if self._stderr.closed:
            return ""
        self._stderr.seek(0)
        return "\n".join(self._stderr.read().decode("utf-8", "replace").splitlines()[-lines:])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace_s: float = 5.0) -> int | None:
        code = terminate(self.popen, grace_s)
        self._stderr.close()
        return code

    def __enter__(self) -> "Target":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Daemon:
    """A foreign server: started in its own session, awaited on the first line of its
    output (stdout and stderr together) that holds ``ready``, stopped by PID. ``popen``,
    ``pid`` and ``out`` (its ``LinePump``: every line so far) are public."""

    def __init__(self, name: str, argv: list[str], ready: str, timeout_s: float = 30.0):
        self.name = name
        self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.popen.pid
        self.out = LinePump(self.popen.stdout)
        try:
            line = self.out.wait_for(lambda text: ready in text, timeout_s)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"{name} not ready within {timeout_s} s: "
                               + "\n".join(self.out.lines[-10:])) from None
        if line is None:
            self.stop()
            raise RuntimeError(f"{name} exited before it was ready: "
                               + "\n".join(self.out.lines[-10:]))

    def stop(self) -> None:
        terminate(self.popen, 5.0)
        self.out.thread.join(2)


def start_on_free_ports(name: str, argv_for, count: int = 4,
                        attempts: int = 3) -> tuple["Target", int]:
    """Start ``Target(name, argv_for(base))`` on a free port base; if another process
    takes one of its ports between the check and the bind, try another base."""
    for attempt in range(attempts):
        base = free_port_base(count)
        try:
            return Target(name, argv_for(base)), base
        except RuntimeError as exc:
            if "in use" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def cpu_seconds(pids: list[int]) -> dict:
    """CPU seconds so far per pid, per thread of the first pid, and of the whole host."""
    import psutil

    out: dict = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.Error:
            out[pid] = 0.0
    try:
        out["threads"] = {t.id: t.user_time + t.system_time
                          for t in psutil.Process(pids[0]).threads()}
    except psutil.Error:
        out["threads"] = {}
    host = psutil.cpu_times()
    # guest time is already inside user time; iowait is idle time
    out["host_busy"] = sum(host) - host.idle - sum(
        getattr(host, name, 0.0) for name in ("iowait", "guest", "guest_nice"))
    return out


def own_cpu_seconds() -> float:
    """This process's CPU seconds so far, every thread: what ``cpu_seconds`` reads from
    outside, but to the nanosecond (``CLOCK_PROCESS_CPUTIME_ID``) rather than in 10 ms
    clock ticks. A measured process that exits right after printing its result sends
    this with it: read from outside after the line, a process already gone reads as 0 s.
    Against a start read from outside (rounded down to a tick) the difference is never
    below what the window used, and above 0 once it used any CPU: a subscriber that used
    under one tick in a short window no longer reads 0 %."""
    return time.process_time()


def wait_for_quiet(max_busy_pct: float, timeout_s: float, sample_s: float = 1.0) -> dict:
    """Before a measurement on a shared host: sample the host's busy CPU (percent of one
    core, all processes) over ``sample_s`` until it is at most ``max_busy_pct`` or
    ``timeout_s`` has passed. Returns the last sample, the time waited, and whether the
    host was quiet; ``timeout_s <= 0`` samples once and never waits."""
    import psutil

    cores = psutil.cpu_count() or 1
    t0 = time.monotonic()
    while True:
        busy = psutil.cpu_percent(interval=sample_s) * cores
        waited = time.monotonic() - t0
        if busy <= max_busy_pct or waited >= timeout_s:
            return {"host_busy_pct": round(busy, 1), "waited_s": round(waited, 1),
                    "quiet": busy <= max_busy_pct}


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so every ``finally`` ends its processes by PID."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def bench_main(name: str, parse_args, run, report, argv: list[str] | None = None):
    """The shared body of every benchmark's ``main``: parse, run (processes are ended by
    PID even on SIGTERM), print the tables, save the record."""
    from bench.harness import record as rec

    args = parse_args(argv)
    exit_on_sigterm()
    record = run(args)
    report(record)
    path = record.save(Path(args.results_dir))
    rec.log(f"{name}: saved {path}")
    return record


def cpu_pct_each(pids: list[int], before: dict, after: dict, seconds: float) -> list[float]:
    """Percent of one core for each pid between two ``cpu_seconds`` samples."""
    return [round(100 * (after.get(p, 0.0) - before.get(p, 0.0)) / (seconds or 1e-9), 1)
            for p in pids]


def cpu_pct_by_group(groups: dict[str, list[int]], before: dict, after: dict,
                     seconds: float) -> dict:
    """Percent of one core per group of pids between two ``cpu_seconds`` samples, plus
    ``ours`` (all groups), ``host`` (the host's busy time) and ``others`` (host - ours)."""
    pct = lambda a, b: round(100 * (b - a) / (seconds or 1e-9), 1)  # noqa: E731
    out = {group: pct(sum(before.get(p, 0.0) for p in pids), sum(after.get(p, 0.0) for p in pids))
           for group, pids in groups.items()}
    out["ours"] = round(sum(out[g] for g in groups), 1)
    out["host"] = pct(before["host_busy"], after["host_busy"])
    out["others"] = round(max(0.0, out["host"] - out["ours"]), 1)
    # the threads of the first pid sampled (a scenario's first target), busiest first
    out["first_pid_threads"] = sorted(
        (pct(before.get("threads", {}).get(tid, 0.0), t1)
         for tid, t1 in after.get("threads", {}).items()), reverse=True)
    return out
