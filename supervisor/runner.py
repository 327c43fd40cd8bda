"""The runner: starts, watches, restarts and stops every server of a plan. What to do
after an exit is decided by the pure ``clonemap.supervisor.policy.decide``; each server's process
I/O (spawn, output, exit, log, signals) is ``clonemap.supervisor.process.ServerProcess``; this
module keeps the states and performs the policy's decisions.

A server is a child ``python -m clonemap.shards`` process::

    python -m clonemap.shards --port P --host ADDRESS --cpus 0,1 --heartbeat-s H
        --shard NAME --primary|--backup --peer PEER_ADDRESS:PEER_P
        --control CONTROL_ENDPOINT --parent-pid SUPERVISOR_PID
        --routing ROUTING_JSON --shard-index I

* Ownership: every server gets the plan's routing (``ShardMap.describe()`` of the shard
  count and pinned prefixes, the same document the cluster map serves) and its shard
  index, so it drops and counts (``not_owner``) KVSETs for keys another shard owns.
* Pinning: the child pins itself (``--cpus``) before its ZeroMQ context exists, so the
  context's I/O threads inherit the core set (and ``ServerProcess`` pins it between fork
  and exec as a second guard).
* No orphans: ``--parent-pid`` makes the server exit when the supervisor disappears (and
  the kernel sends it SIGTERM: see ``clonemap.supervisor.process``); ``stop_all`` sends SIGTERM,
  then SIGKILL after a deadline, and reaps every child.
* A ``READY`` line on the child's stdout marks it RUNNING. Logs are rotated every
  ``LOG_CHECK_S`` and before each start (``ServerProcess.rotate_log``).

States: STARTING (spawned, no READY yet), RUNNING, BACKOFF (waiting to restart), FAILED
(the policy gave up), STOPPING, STOPPED.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import psutil

from clonemap.shards.common.config_values import format_cores
from clonemap.shards.common.placement import Plan, RoutingParams, ServerPlan
from clonemap.supervisor.policy import (DEFAULT_POLICY, GiveUp, Leave, PolicyConfig, Restart, Run,
                               decide, describe_exit)
from clonemap.supervisor.process import (BACKOFF, FAILED, RUNNING, STARTING, STOPPED, STOPPING,
                                ServerProcess)

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



@dataclass
class ServerArgs:
    """What a server's command line is built from (besides its plan)."""

    control: str
    heartbeat_s: float
    parent_pid: int
    python: str = sys.executable
    extra: tuple[str, ...] = ()


def _after_fields(text: str) -> str:
    """``WORD key=value key=value free text`` -> ``free text``."""
    words = text.split(" ")[1:]
    while words and "=" in words[0] and not words[0].endswith(":"):
        words.pop(0)
    return " ".join(words)


def progress(procs) -> tuple[float, bool]:
    """How far the running ``procs`` got: the CPU time they used so far together (to the
    nanosecond where Linux's ``/proc/PID/schedstat`` says it: user and system time are
    counted in 10 ms ticks, and a process at background priority on a saturated host may
    run less than a tick between two looks), and whether any of them is runnable now
    (it waits for a core: starved, not stuck). Their main threads' time: the threads
    they start later (libzmq's) are not counted, so the sum never falls when one ends."""
    total, runnable = 0.0, False
    for proc in procs:
        if proc.pid is None:
            continue
        try:
            handle = psutil.Process(proc.pid)
            runnable = runnable or handle.status() == psutil.STATUS_RUNNING
            total += _ran_s(handle)
        except psutil.Error:
            continue
    return total, runnable


class Progress:
    """Whether ``procs`` got further since the last ``look`` (or since it was made):
    their CPU time grew (``progress``), or one of them waits for a core now. What a wait
    on servers that may be starved, not stuck, goes on while."""

    def __init__(self, procs):
        self.procs = list(procs)
        self.ran, _ = progress(self.procs)
        """Their CPU time at the last look, in seconds."""

    def look(self) -> tuple[bool, bool]:
        """(their CPU time grew since the last look, one of them is runnable now)."""
        ran, runnable = progress(self.procs)
        grew, self.ran = ran > self.ran, ran
        return grew, runnable


def _ran_s(handle: psutil.Process) -> float:
    """The time ``handle``'s main thread ran (where its interpreter starts), in seconds."""
    try:
        return int(Path(f"/proc/{handle.pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):  # (not Linux)
        times = handle.cpu_times()
        return times.user + times.system


def server_argv(server: ServerPlan, peer: ServerPlan, args: ServerArgs) -> list[str]:
    return [args.python, "-m", "clonemap.shards",
            "--port", str(server.port), "--host", server.address,
            "--cpus", ",".join(map(str, server.cores)),
            "--heartbeat-s", f"{args.heartbeat_s:g}",
            "--shard", server.shard, f"--{server.role}",
            "--peer", f"{peer.address}:{peer.port}",
            "--control", args.control, "--parent-pid", str(args.parent_pid),
            *io_threads_argv(server), *args.extra]


def io_threads_argv(server: ServerPlan) -> list[str]:
    """``--io-threads N`` where the config gives more than libzmq's one."""
    return ["--io-threads", str(server.io_threads)] if server.io_threads > 1 else []


def relay_argv(relay: ServerPlan, primary: ServerPlan, backup: ServerPlan,
               args: ServerArgs) -> list[str]:
    """``python -m clonemap.shards.relay``: one relay of a shard (``clonemap.shards.relay``)."""
    extra = [a for a in args.extra]  # --keys-dir DIR (CURVE) applies to relays too
    return [args.python, "-m", "clonemap.shards.relay",
            "--port", str(relay.port), "--host", relay.address,
            "--cpus", ",".join(map(str, relay.cores)),
            "--upstream", f"{primary.address}:{primary.port},{backup.address}:{backup.port}",
            "--heartbeat-s", f"{args.heartbeat_s:g}",
            "--shard", relay.shard, "--name", relay.role,
            "--control", args.control, "--parent-pid", str(args.parent_pid),
            *io_threads_argv(relay), *extra]


def routing_argv(routing: RoutingParams, shard_index: int) -> list[str]:
    """``--routing JSON --shard-index I``: what a server needs to drop keys it does not own."""
    doc = routing.shard_map().describe()
    return ["--routing", json.dumps(doc, separators=(",", ":")),
            "--shard-index", str(shard_index)]


def coordination_argv(plan: Plan, shard_index: int) -> list[str]:
    """A pair whose servers are on two hosts: its lease in etcd (``clonemap.shards.coord``),
    named after the cluster and the shard; nothing for a pair on one host."""
    if plan.coordination is None or shard_index not in plan.across:
        return []
    url, lease_s, replication = plan.coordination
    return ["--coordination", url, "--lease-s", f"{lease_s:g}", "--replication", replication,
            "--lease-name", f"{plan.cluster}-{plan.shards[shard_index].name}"]


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
            self.servers.update(self._pair_of(shard, plan))
        for relay in plan.relays:
            if plan.is_local(relay):
                self.servers[relay.name] = self._relay_of(relay, plan)

    def _relay_of(self, relay: ServerPlan, plan: Plan) -> ServerProcess:
        shard = plan.shards[relay.index]
        path = self.log_dir / f"{relay.shard}-{relay.role}.log"
        argv = relay_argv(relay, shard.primary, shard.backup, self.args) + routing_argv(
            plan.routing, relay.index)
        return ServerProcess(relay, argv, path)

    def add_relays(self, plan: Plan, indices: list[int]) -> list[str]:
        """Start the relays that ``plan`` (the cluster's, once a change flipped) gives
        the shards ``indices`` that the change added; their names. Each becomes ready
        once it holds its shard's map, as at ``start``."""
        started = []
        for relay in plan.relays:
            if (relay.index in indices and plan.is_local(relay)
                    and relay.name not in self.servers):
                proc = self.servers[relay.name] = self._relay_of(relay, plan)
                self._spawn(proc, manual=True)
                started.append(relay.name)
        return started

    def _pair_of(self, shard, plan: Plan, provisional: bool = False
                 ) -> dict[str, ServerProcess]:
        """The processes of ``shard``'s pair that this host runs (not yet started);
        ``provisional``: a shard a change adds, on a routing not yet committed."""
        out = {}
        for server, peer in ((shard.primary, shard.backup), (shard.backup, shard.primary)):
            if not plan.is_local(server):
                continue  # another host's supervisor runs it
            path = self.log_dir / f"{server.shard}-{server.role}.log"
            argv = server_argv(server, peer, self.args) + routing_argv(plan.routing,
                                                                       server.index)
            argv += ["--subscriber-held-bytes", str(plan.subscriber_held_bytes),
                     "--writer-held-bytes", str(plan.writer_held_bytes),
                     # (the pending table's bound follows --writer-held-bytes: the server's rule)
                     "--dedup-bytes", str(plan.applied_uuids[0]),
                     "--dedup-s", str(plan.applied_uuids[1])]
            data = self.data_dir(server)
            if data is not None:
                argv += ["--data-dir", str(data), "--fsync", plan.fsync]
            argv += coordination_argv(plan, shard.index)
            if provisional:
                argv.append("--provisional-routing")
            out[server.name] = ServerProcess(server, argv, path)
        return out

    async def add_shard(self, shard, plan: Plan, timeout_s: float = READY_TIMEOUT_S,
                        background: bool = False) -> list[str]:
        """Start the pair of ``shard`` (a shard that ``plan``, the cluster's next plan,
        adds; its routing is ``plan``'s): resharding grows the cluster. Returns the names
        of its servers not RUNNING by ``timeout_s``. An added shard starts empty: it holds
        only what the change copies to it (applied as it comes), so a data directory left
        at its place (a shard removed earlier, or a change that stopped before its flip)
        is moved aside first, to ``<name>.before-epoch-<E>``, never deleted.
        ``background``: its servers start at background CPU priority (``die_with_parent``),
        unless the pair is leased across hosts (its lease's renewals have deadlines); a
        restart of either starts at normal priority."""
        background = background and not coordination_argv(plan, shard.index)
        procs = self._pair_of(shard, plan, provisional=True)
        for proc in procs.values():
            self._move_aside(proc.plan, plan.routing.epoch)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.servers.update(procs)
        for proc in procs.values():
            self._spawn(proc, manual=True, background=background)
        up = lambda: all(p.state in (RUNNING, FAILED) for p in procs.values())  # noqa: E731
        # (``timeout_s`` from the last progress: a server started in the background on a
        # busy host gets only what the others leave, and its interpreter's start, ~1.5 s
        # of CPU, took longer than 30 s once beside the suite's three workers. Progress:
        # its CPU time grew, or one of them waits for a core now)
        started = Progress(procs.values())
        while not await self.wait_for(up, timeout_s):
            grew, runnable = started.look()
            if not (grew or runnable):
                break
            log.info("%s: still starting (%.2f s of CPU so far%s)", shard.name, started.ran,
                     ", waiting for a core" if runnable else "")
        return [p.name for p in procs.values() if p.state != RUNNING]

    def _move_aside(self, server: ServerPlan, epoch: int) -> None:
        data = self.data_dir(server)
        if data is None or not data.is_dir() or not any(data.iterdir()):
            return
        aside = data.with_name(f"{data.name}.before-epoch-{epoch}")
        n = 1
        while aside.exists():
            n += 1
            aside = data.with_name(f"{data.name}.before-epoch-{epoch}.{n}")
        data.rename(aside)
        log.warning("%s: the data directory left from before was moved aside to %s: an "
                    "added shard starts empty", server.name, aside)

    async def remove_shard(self, index: int) -> list[str]:
        """Stop every process of shard ``index`` (resharding shrinks the cluster, or a
        growth is rolled back) and forget them; their data directories stay. Names."""
        procs = [p for p in self.servers.values() if p.plan.index == index]
        for proc in procs:
            self._cancel_backoff(proc)
        await asyncio.gather(*(self._stop_one(p) for p in procs))
        for proc in procs:
            proc.close_log("its shard was removed from the cluster")
            del self.servers[proc.name]
        self._changed.set()
        self._changed = asyncio.Event()
        return [p.name for p in procs]

    def set_plan(self, plan: Plan) -> None:
        """The cluster's plan after a change of its routing (resharding)."""
        self.plan = plan
        self.set_routing(plan.routing)

    def set_routing(self, routing: RoutingParams) -> None:
        """Start every server and relay from now on with ``routing`` (a new epoch,
        committed): the ``--routing`` of their command lines."""
        doc = json.dumps(routing.shard_map().describe(), separators=(",", ":"))
        for proc in self.servers.values():
            at = proc.argv.index("--routing")
            proc.argv[at + 1] = doc
            if "--provisional-routing" in proc.argv:
                proc.argv.remove("--provisional-routing")

    def data_dir(self, server: ServerPlan) -> Path | None:
        """``<run-dir>/<data_dir>/<shard>-<role>``, or None for a memory-only cluster."""
        if self.plan.data_dir is None:
            return None
        return self.run_dir / self.plan.data_dir / f"{server.shard}-{server.role}"

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

    def _spawn(self, proc: ServerProcess, manual: bool = False,
               background: bool = False) -> None:
        proc.cancel_restart()
        proc.stop_requested = False
        proc.ready.clear()
        proc.exited.clear()
        proc.clear_stats()
        proc.open_log()
        self._rotate_log(proc)
        now = self.clock()
        try:
            proc.spawn(self._on_line, self._on_exit, background)
        except OSError as exc:
            proc.history.append(Run(started_at=now, exited_at=now, exit_code=127,
                                    manual=manual))
            self._event(proc, f"cannot start: {exc}")
            proc.exited.set()
            self._after_exit(proc)
            return
        proc.history.append(Run(started_at=now, manual=manual))
        self._set_state(proc, STARTING, "waiting for READY")
        self._event(proc, f"started pid {proc.pid} on cores {format_cores(proc.plan.cores)}"
                          f" at {proc.plan.address}:{proc.plan.port}"
                    + (f" (restart {proc.restarts})" if proc.restarts else "")
                    + (" at background CPU priority" if background else ""))

    def _on_line(self, proc: ServerProcess, text: str) -> None:
        """A line the current run printed: ``READY`` makes it RUNNING; ``DISK_ERROR``
        (the server stopped on a disk error) and ``UNREADABLE`` (its data directory was
        moved aside) are kept for status and metrics and said as events."""
        if text.startswith("READY ") and proc.state == STARTING:
            proc.disk_error = ""
            self._set_state(proc, RUNNING, "ready")
            proc.ready.set()
            self.on_event(f"{proc.name} ready (pid {proc.pid})")
        elif text.startswith("DISK_ERROR "):
            proc.disk_error = _after_fields(text)
            proc.disk_errors += 1
            # it stopped serving: the figures it gave before (ACTIVE, say) no longer hold,
            # even in the moment before its exit is seen
            proc.clear_stats()
            self.on_event(f"{proc.name} DISK ERROR: {proc.disk_error}; it stopped so that "
                          "its peer serves")
        elif text.startswith("UNREADABLE "):
            proc.unreadable = _after_fields(text)
            self.on_event(f"{proc.name} could not read its data directory: "
                          f"{proc.unreadable}; it copies its peer's map")

    # ----------------------------------------------------------------- exits
    def _on_exit(self, proc: ServerProcess, popen: subprocess.Popen, code: int) -> None:
        now = self.clock()
        run = proc.history[-1]
        proc.history[-1] = replace(run, exited_at=now, exit_code=code,
                                   stop_requested=proc.stop_requested or self.stopping)
        proc.clear_stats()
        self._event(proc, f"pid {popen.pid} {describe_exit(proc.history[-1])}")
        proc.exited.set()
        self._after_exit(proc)

    def _after_exit(self, proc: ServerProcess) -> None:
        now = self.clock()
        action = decide(proc.history, now, self.policy)
        match action:
            case Restart(delay_s=delay_s, reason=reason) if not self.stopping:
                self._set_state(proc, BACKOFF, reason)
                proc.schedule_restart(delay_s, now, lambda: self._spawn(proc))
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
        proc.send(signal.SIGKILL)
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
        proc.send(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.exited.wait(), self.stop_deadline_s)
        except asyncio.TimeoutError:
            self._event(proc, f"no exit {self.stop_deadline_s:g} s after SIGTERM: SIGKILL")
            proc.send(signal.SIGKILL)
            try:
                await asyncio.wait_for(proc.exited.wait(), self.stop_deadline_s)
            except asyncio.TimeoutError:  # never expected: reap it here, blocking
                popen.wait()

    def _cancel_backoff(self, proc: ServerProcess) -> None:
        proc.cancel_restart()

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
            proc.close_log("stopped with the supervisor")

    def kill_all_now(self) -> None:
        """Last resort (the loop is gone): SIGKILL every child and reap it."""
        for proc in self.servers.values():
            proc.kill_now()

    # ----------------------------------------------------------------- status
    def describe(self) -> list[dict]:
        now = self.clock()
        return [p.describe(now) for p in self.servers.values()]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.servers.values():
            out[p.state] = out.get(p.state, 0) + 1
        return out
