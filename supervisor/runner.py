"""The process manager: one ``ServerProcess`` per planned server and the ``Runner`` that
starts, watches, restarts and stops them. What to do after an exit is decided by the pure
``supervisor.policy.decide``; this module only performs it.

A server is a child ``python -m shards`` process::

    python -m shards --port P --host ADDRESS --cpus 0,1 --heartbeat-s H
        --shard NAME --primary|--backup --peer PEER_ADDRESS:PEER_P
        --control CONTROL_ENDPOINT --parent-pid SUPERVISOR_PID
        --routing ROUTING_JSON --shard-index I

* Ownership: every server gets the plan's routing (``ShardMap.describe()`` of the shard
  count and pinned prefixes, the same document the cluster map serves) and its shard
  index, so it drops and counts (``not_owner``) KVSETs for keys another shard owns.

* Pinning: the child pins itself (``--cpus``) before its ZeroMQ context exists, so the
  context's I/O threads inherit the core set. As a second guard the child is already
  pinned between fork and exec (``sched_setaffinity`` in ``preexec_fn``): every thread it
  will ever start inherits the planned cores.
* No orphans: between fork and exec the child asks the kernel for SIGTERM when the
  supervisor dies (``prctl(PR_SET_PDEATHSIG)``, and exits at once if the supervisor is
  already gone); ``--parent-pid`` makes the server itself exit when that pid disappears.
  ``stop_all`` sends SIGTERM, then SIGKILL after a deadline, and reaps every child.
* Own process group: a terminal's Ctrl-C goes to the supervisor alone, which then stops
  the servers in order (and records those exits as requested stops).
* Exits are events: each child's pidfd is watched by the event loop (no polling).
* Output: stdout is a pipe read by the supervisor (the ``READY`` line marks the server
  RUNNING; every line is copied to the log); stderr goes straight to
  ``RUN_DIR/logs/<shard>-<role>.log``. The supervisor adds its own ``--- supervisor:``
  lines there (starts, exits, restarts).
* Log rotation (copy-truncate, as the server holds its log open): every
  ``LOG_CHECK_S`` and before each start, a log over ``log_max_bytes`` is copied to
  ``<log>.1`` (older copies shift up to ``.<log_keep>``, the oldest is dropped) and
  truncated in place; the server's O_APPEND writes continue at the new end. Lines
  written between the copy and the truncation (microseconds) are lost.

States: STARTING (spawned, no READY yet), RUNNING, BACKOFF (waiting to restart), FAILED
(the policy gave up), STOPPING, STOPPED.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from shards.common.children import die_with_parent
from shards.common.config import format_cores
from shards.common.routing import ShardMap
from shards.common.placement import Plan, RoutingParams, ServerPlan
from supervisor.policy import (DEFAULT_POLICY, GiveUp, Leave, PolicyConfig, Restart, Run,
                               decide, describe_exit)

log = logging.getLogger(__name__)

STOP_DEADLINE_S = 5.0
"""SIGTERM, then SIGKILL after this long."""
READY_TIMEOUT_S = 20.0
LOG_MAX_BYTES = 16 * 1024 * 1024
"""A server log this big is rotated (``supervisor start --log-max-mb``)."""
LOG_KEEP = 3
"""Rotated copies kept per server log (``<log>.1`` newest .. ``<log>.3``)."""
LOG_CHECK_S = 10.0
"""How often the logs' sizes are checked."""

STARTING, RUNNING, BACKOFF, FAILED, STOPPING, STOPPED = (
    "STARTING", "RUNNING", "BACKOFF", "FAILED", "STOPPING", "STOPPED")


@dataclass
class ServerArgs:
    """What a server's command line is built from (besides its plan)."""

    control: str
    heartbeat_s: float
    parent_pid: int
    python: str = sys.executable
    extra: tuple[str, ...] = ()


def server_argv(server: ServerPlan, peer: ServerPlan, args: ServerArgs) -> list[str]:
    return [args.python, "-m", "shards",
            "--port", str(server.port), "--host", server.address,
            "--cpus", ",".join(map(str, server.cores)),
            "--heartbeat-s", f"{args.heartbeat_s:g}",
            "--shard", server.shard, f"--{server.role}",
            "--peer", f"{peer.address}:{peer.port}",
            "--control", args.control, "--parent-pid", str(args.parent_pid),
            *args.extra]


def routing_argv(routing: RoutingParams, shard_index: int) -> list[str]:
    """``--routing JSON --shard-index I``: what a server needs to drop keys it does not own."""
    pins = {i: list(ps) for i, ps in enumerate(routing.prefixes) if ps}
    doc = ShardMap(routing.shard_count, pins).describe()
    return ["--routing", json.dumps(doc, separators=(",", ":")),
            "--shard-index", str(shard_index)]


class ServerProcess:
    """One planned server and its successive runs."""

    def __init__(self, plan: ServerPlan, argv: list[str], log_path: Path):
        self.plan = plan
        self.argv = argv
        self.log_path = log_path
        self.name = plan.name
        self.state = STOPPED
        self.reason = "not started"
        self.history: list[Run] = []
        self.popen: subprocess.Popen | None = None
        self.pid: int | None = None
        self.ready: asyncio.Event = asyncio.Event()
        self.exited: asyncio.Event = asyncio.Event()
        self.exited.set()
        self.stop_requested = False
        self.restart_at: float | None = None
        self.stats: dict = {}
        self.stats_at: float | None = None
        self.updates_per_s: float | None = None
        self._restart_handle: asyncio.TimerHandle | None = None
        self.lock = asyncio.Lock()  # one operator command at a time per server
        self._pidfd: int | None = None
        self._out_fd: int | None = None
        self._out_buf = b""
        self._log = None

    @property
    def restarts(self) -> int:
        return max(0, len(self.history) - 1)

    @property
    def last_exit(self) -> str | None:
        for run in reversed(self.history):
            if run.exited_at is not None:
                return describe_exit(run)
        return None

    def note(self, text: str) -> None:
        """A ``--- supervisor:`` line in this server's log."""
        if self._log is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self._log.write(f"{stamp} --- supervisor: {text}\n".encode())
            self._log.flush()

    def rotate_log(self, max_bytes: int, keep: int) -> bool:
        """Copy-truncate this server's log if it is ``max_bytes`` or more (see the module
        doc). Returns whether it rotated."""
        if self._log is None or keep < 1:
            return False
        fd = self._log.fileno()
        if os.fstat(fd).st_size < max_bytes:
            return False
        path = self.log_path
        for i in range(keep - 1, 0, -1):
            older = path.with_name(f"{path.name}.{i}")
            if older.exists():
                os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
        shutil.copyfile(path, path.with_name(f"{path.name}.1"))
        os.ftruncate(fd, 0)
        self.note(f"log rotated; the previous lines are in {path.name}.1")
        return True

    def describe(self, now: float) -> dict:
        """This server as JSON-able data (the status row; stats come from its service)."""
        p = self.plan
        stats = self.stats
        out = {"shard": p.shard, "role": p.role, "name": self.name, "state": self.state,
               "reason": self.reason, "pid": self.pid, "cores": list(p.cores),
               "cores_text": format_cores(p.cores), "nic": p.nic, "address": p.address,
               "port": p.port, "restarts": self.restarts, "last_exit": self.last_exit,
               "log": str(self.log_path),
               "restart_in_s": (round(max(0.0, self.restart_at - now), 3)
                                if self.restart_at is not None else None),
               "bstar": _bstar_state(stats), "seq": stats.get("seq"),
               "keys": stats.get("keys"), "updates_per_s": self.updates_per_s,
               "stats_age_s": (round(now - self.stats_at, 3)
                               if self.stats_at is not None else None)}
        if stats:
            out["stats"] = stats
        return out

    def set_stats(self, stats: dict, now: float) -> None:
        """Fresh figures from the server's own stats service; updates/s from the change
        of its ``updates`` (or ``seq``) counter since the previous figures."""
        if stats.get("pid") not in (None, self.pid):
            return  # an answer from the previous run
        counter = stats.get("updates", stats.get("seq"))
        old = self.stats.get("updates", self.stats.get("seq"))
        if (self.stats_at is not None and counter is not None and old is not None
                and now > self.stats_at and counter >= old):
            self.updates_per_s = round((counter - old) / (now - self.stats_at), 1)
        self.stats, self.stats_at = stats, now


def _bstar_state(stats: dict) -> str | None:
    for key in ("bstar", "bstar_state", "state"):
        value = stats.get(key)
        if isinstance(value, dict):
            value = value.get("state")
        if isinstance(value, str):
            return value.upper()
    if "active" in stats and stats.get("role") == "standalone":
        return "ACTIVE" if stats["active"] else "INACTIVE"
    return None


class Runner:
    """Starts, watches, restarts and stops every server of a plan. Lives on one asyncio
    loop; every method is called from that loop."""

    def __init__(self, plan: Plan, run_dir: Path, args: ServerArgs, *,
                 policy: PolicyConfig = DEFAULT_POLICY,
                 clock: Callable[[], float] = time.monotonic,
                 on_event: Callable[[str], None] | None = None,
                 stop_deadline_s: float = STOP_DEADLINE_S,
                 log_max_bytes: int = LOG_MAX_BYTES, log_keep: int = LOG_KEEP):
        self.plan = plan
        self.log_max_bytes = log_max_bytes
        self.log_keep = log_keep
        self._log_task: asyncio.Task | None = None
        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / "logs"
        self.args = args
        self.policy = policy
        self.clock = clock
        self.on_event = on_event or (lambda text: None)
        self.stop_deadline_s = stop_deadline_s
        self.stopping = False
        self.servers: dict[str, ServerProcess] = {}
        self._changed = asyncio.Event()
        for shard in plan.shards:
            for server, peer in ((shard.primary, shard.backup), (shard.backup, shard.primary)):
                path = self.log_dir / f"{server.shard}-{server.role}.log"
                argv = server_argv(server, peer, args) + routing_argv(plan.routing,
                                                                      server.index)
                self.servers[server.name] = ServerProcess(server, argv, path)

    # ----------------------------------------------------------------- events
    def _event(self, proc: ServerProcess, text: str) -> None:
        proc.note(text)
        log.info("%s: %s", proc.name, text)
        self.on_event(f"{proc.name} {text}")

    # ----------------------------------------------------------------- start
    async def start_all(self, timeout_s: float = READY_TIMEOUT_S) -> list[str]:
        """Spawn every server; wait until each is RUNNING or FAILED (or the deadline).
        Returns the names of those not RUNNING then."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for proc in self.servers.values():
            self._spawn(proc, manual=True)
        if self._log_task is None:
            self._log_task = asyncio.get_running_loop().create_task(self._watch_logs())
        await self.wait_for(lambda: all(p.state in (RUNNING, FAILED)
                                        for p in self.servers.values()), timeout_s)
        return [p.name for p in self.servers.values() if p.state != RUNNING]

    def _rotate_log(self, proc: ServerProcess) -> bool:
        try:
            return proc.rotate_log(self.log_max_bytes, self.log_keep)
        except OSError as exc:  # a full disk must not stop the supervisor
            log.warning("%s: cannot rotate %s: %s", proc.name, proc.log_path, exc)
            return False

    def rotate_logs(self) -> list[str]:
        """Rotate every server log over the limit now; returns the servers rotated."""
        return [proc.name for proc in self.servers.values() if self._rotate_log(proc)]

    async def _watch_logs(self) -> None:
        while True:
            await asyncio.sleep(LOG_CHECK_S)
            for name in self.rotate_logs():
                log.info("%s: log rotated (over %d bytes)", name, self.log_max_bytes)

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``predicate()`` holds, re-checked at every state change."""
        deadline = self.clock() + timeout_s
        while not predicate():
            remaining = deadline - self.clock()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                return predicate()
        return True

    def _set_state(self, proc: ServerProcess, state: str, reason: str) -> None:
        proc.state, proc.reason = state, reason
        self._changed.set()
        self._changed = asyncio.Event()

    def _spawn(self, proc: ServerProcess, manual: bool = False) -> None:
        loop = asyncio.get_running_loop()
        proc.restart_at = None
        proc._restart_handle = None
        proc.stop_requested = False
        proc.ready.clear()
        proc.exited.clear()
        proc.stats, proc.stats_at, proc.updates_per_s = {}, None, None
        if proc._log is None:
            proc.log_path.parent.mkdir(parents=True, exist_ok=True)
            proc._log = open(proc.log_path, "ab")
        self._rotate_log(proc)
        now = self.clock()
        try:
            popen = subprocess.Popen(
                proc.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=proc._log.fileno(), close_fds=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                process_group=0,  # a terminal's Ctrl-C reaches the supervisor only
                preexec_fn=die_with_parent(os.getpid(), proc.plan.cores))
        except OSError as exc:
            proc.history.append(Run(started_at=now, exited_at=now, exit_code=127,
                                    manual=manual))
            self._event(proc, f"cannot start: {exc}")
            proc.exited.set()
            self._after_exit(proc)
            return
        proc.popen, proc.pid = popen, popen.pid
        proc.history.append(Run(started_at=now, manual=manual))
        self._set_state(proc, STARTING, "waiting for READY")
        self._event(proc, f"started pid {popen.pid} on cores {format_cores(proc.plan.cores)}"
                          f" at {proc.plan.address}:{proc.plan.port}"
                    + (f" (restart {proc.restarts})" if proc.restarts else ""))
        fd = popen.stdout.fileno()
        os.set_blocking(fd, False)
        proc._out_fd, proc._out_buf = fd, b""
        loop.add_reader(fd, self._on_stdout, proc, popen)
        proc._pidfd = os.pidfd_open(popen.pid)
        loop.add_reader(proc._pidfd, self._on_exit, proc, popen)

    def _on_stdout(self, proc: ServerProcess, popen: subprocess.Popen) -> None:
        if popen.stdout is None or popen.stdout.closed:
            return
        try:
            data = os.read(popen.stdout.fileno(), 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_stdout(proc, popen)
            return
        buf = proc._out_buf + data
        *lines, proc._out_buf = buf.split(b"\n")
        if proc._log is not None and lines:
            proc._log.write(b"".join(line + b"\n" for line in lines))
            proc._log.flush()
        for line in lines:
            text = line.decode("utf-8", "replace")
            if text.startswith("READY ") and proc.popen is popen and proc.state == STARTING:
                self._set_state(proc, RUNNING, "ready")
                proc.ready.set()
                self.on_event(f"{proc.name} ready (pid {popen.pid})")

    def _close_stdout(self, proc: ServerProcess, popen: subprocess.Popen) -> None:
        if popen.stdout is not None and not popen.stdout.closed:
            try:
                asyncio.get_running_loop().remove_reader(popen.stdout.fileno())
            except (ValueError, RuntimeError):
                pass
            popen.stdout.close()

    # ----------------------------------------------------------------- exits
    def _on_exit(self, proc: ServerProcess, popen: subprocess.Popen) -> None:
        loop = asyncio.get_running_loop()
        pidfd = proc._pidfd
        if pidfd is not None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            proc._pidfd = None
        code = popen.wait()  # the pidfd is readable: the child has exited
        self._on_stdout(proc, popen)  # whatever it printed last
        self._close_stdout(proc, popen)
        now = self.clock()
        run = proc.history[-1]
        proc.history[-1] = replace(run, exited_at=now, exit_code=code,
                                   stop_requested=proc.stop_requested or self.stopping)
        proc.popen, proc.pid = None, None
        proc.stats, proc.stats_at, proc.updates_per_s = {}, None, None
        self._event(proc, f"pid {popen.pid} {describe_exit(proc.history[-1])}")
        proc.exited.set()
        self._after_exit(proc)

    def _after_exit(self, proc: ServerProcess) -> None:
        now = self.clock()
        action = decide(proc.history, now, self.policy)
        match action:
            case Restart(delay_s=delay_s, reason=reason) if not self.stopping:
                self._set_state(proc, BACKOFF, reason)
                proc.restart_at = now + delay_s
                proc._restart_handle = asyncio.get_running_loop().call_later(
                    delay_s, self._spawn, proc)
                self._event(proc, f"restart in {delay_s:.2f} s ({reason})")
            case GiveUp(reason=reason):
                self._set_state(proc, FAILED, reason)
                self._event(proc, f"FAILED: {reason}")
            case Leave(reason=reason):
                self._set_state(proc, STOPPED, reason)
            case Restart():  # a restart was due, but the supervisor is stopping
                self._set_state(proc, STOPPED, "stopped")
            case _:
                raise TypeError(f"not an action after an exit: {action!r}")

    # ----------------------------------------------------------------- commands
    def get(self, name: str) -> ServerProcess:
        """``"s0/primary"`` -> its process (KeyError names the known servers)."""
        try:
            return self.servers[name]
        except KeyError:
            raise KeyError(f"no server {name!r}; servers: {', '.join(self.servers)}") from None

    def kill(self, name: str) -> int | None:
        """SIGKILL (a failure drill: the policy restarts it). Returns the pid killed."""
        proc = self.get(name)
        if proc.popen is None or proc.pid is None:
            return None
        pid = proc.pid
        self._event(proc, f"SIGKILL pid {pid} on request")
        proc.popen.send_signal(signal.SIGKILL)
        return pid

    async def restart(self, name: str) -> None:
        """Stop (SIGTERM, then SIGKILL after the deadline) and start again at once; a
        fresh count for the restart policy (a FAILED server gets another chance)."""
        proc = self.get(name)
        async with proc.lock:
            if self.stopping:
                raise RuntimeError("the supervisor is stopping")
            self._cancel_backoff(proc)
            if proc.popen is not None:
                self._event(proc, "restart on request")
                await self._stop_one(proc)
            if not self.stopping:
                self._spawn(proc, manual=True)

    async def _stop_one(self, proc: ServerProcess) -> None:
        popen = proc.popen
        if popen is None:
            return
        proc.stop_requested = True
        self._set_state(proc, STOPPING, "SIGTERM sent")
        try:
            popen.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            await asyncio.wait_for(proc.exited.wait(), self.stop_deadline_s)
        except asyncio.TimeoutError:
            self._event(proc, f"no exit {self.stop_deadline_s:g} s after SIGTERM: SIGKILL")
            popen.send_signal(signal.SIGKILL)
            try:
                await asyncio.wait_for(proc.exited.wait(), self.stop_deadline_s)
            except asyncio.TimeoutError:  # never expected: reap it here, blocking
                popen.wait()

    def _cancel_backoff(self, proc: ServerProcess) -> None:
        if proc._restart_handle is not None:
            proc._restart_handle.cancel()
            proc._restart_handle = None
            proc.restart_at = None

    async def stop_all(self) -> None:
        """Stop every server (no restarts from now on); returns once all are reaped."""
        self.stopping = True
        if self._log_task is not None:
            self._log_task.cancel()
            self._log_task = None
        for proc in self.servers.values():
            self._cancel_backoff(proc)
            if proc.state == BACKOFF:
                self._set_state(proc, STOPPED, "stopped before its restart")
        await asyncio.gather(*(self._stop_one(p) for p in self.servers.values()))
        for proc in self.servers.values():
            if proc._log is not None:
                proc.note("stopped with the supervisor")
                proc._log.close()
                proc._log = None

    def kill_all_now(self) -> None:
        """Last resort (the loop is gone): SIGKILL every child and reap it."""
        for proc in self.servers.values():
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait()

    # ----------------------------------------------------------------- status
    def describe(self) -> list[dict]:
        now = self.clock()
        return [p.describe(now) for p in self.servers.values()]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.servers.values():
            out[p.state] = out.get(p.state, 0) + 1
        return out
