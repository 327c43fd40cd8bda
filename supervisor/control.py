"""The control plane: MDP/0.2 services the supervisor's broker hosts, the poller that
collects each server's stats, and the helpers the control commands use.

Services (one handler each; the request body and the reply are in each docstring). Every
FINAL starts with a status frame in the MMI style: ``200`` OK, ``400`` bad request,
``404`` no such server, ``409`` not possible now, ``500`` the handler failed (the MDP
library's own reply). Server names are ``SHARD/ROLE`` (``s0/primary``).

    service          request body                 replies
    cluster.map      (none)                       FINAL 200, JSON map (see cluster_map)
    cluster.status   (none)                       PARTIAL JSON per server, FINAL 200, JSON summary
    cluster.stop     (none)                       FINAL 200, "stopping"; then everything stops
    cluster.restart  SHARD/ROLE                   FINAL 200, JSON {server, pid} once restarted
    cluster.kill     SHARD/ROLE                   FINAL 200, JSON {server, pid}: SIGKILL sent
    cluster.logs     SHARD/ROLE [, LINES]         FINAL 200, the log's last LINES (default 50)

Each server answers its own stats as MDP service ``shard.<SHARD>.<ROLE>`` (a JSON
object); ``StatsPoller`` asks every running server once per interval through the same
broker, so ``cluster.status`` answers from fresh figures without waiting on any server.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from typing import Callable

import zmq

from shards.common.errors import ClonemapError, ConfigError, Exit
from shards.common.mdp import Request
from shards.common.mdp.client import MdpClient, SyncMdpClient
from shards.common.config import DEFAULT_CONTROL, load_config
from shards.common.cluster import cluster_map
from shards.common.placement import Plan
from supervisor.runner import RUNNING, Runner

log = logging.getLogger(__name__)

OK, BAD_REQUEST, NOT_FOUND, CONFLICT = b"200", b"400", b"404", b"409"
DEFAULT_LOG_LINES = 50
MAX_LOG_LINES = 10000
STATS_INTERVAL_S = 1.0
CONTROL_TIMEOUT_S = 3.0
TARGET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}/(primary|backup)$")
EXIT_NOT_FOUND = Exit.NOT_FOUND
EXIT_USAGE = Exit.USAGE


def stats_service(shard: str, role: str) -> str:
    return f"shard.{shard}.{role}"


def check_target(text: str) -> str:
    """``"s0/primary"`` as given, or ValueError saying what a target looks like."""
    text = text.strip()
    if not TARGET_RE.fullmatch(text):
        raise ValueError(f"{text!r} is not SHARD/ROLE; expected a shard name, a slash "
                         "and primary or backup, such as s0/primary")
    return text


def tail_lines(path: str | os.PathLike, lines: int) -> bytes:
    """The last ``lines`` lines of a file (reading backwards in blocks)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = pos = f.tell()
        data = b""
        while pos > 0 and data.count(b"\n") <= lines:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
        if end and data.endswith(b"\n"):
            data = data[:-1]
    return b"\n".join(data.split(b"\n")[-lines:]) + (b"\n" if data else b"")


# ===================================================================== services

class ControlServices:
    """The handlers, over one Runner. ``stop_requested`` is set by ``cluster.stop``."""

    def __init__(self, plan: Plan, runner: Runner, stop_requested: asyncio.Event):
        self.plan = plan
        self.runner = runner
        self.stop_requested = stop_requested
        self.map_body = json.dumps(cluster_map(plan), sort_keys=True).encode()

    def handlers(self) -> dict[str, Callable]:
        return {"cluster.map": self.on_map, "cluster.status": self.on_status,
                "cluster.stop": self.on_stop, "cluster.restart": self.on_restart,
                "cluster.kill": self.on_kill, "cluster.logs": self.on_logs}

    def register(self, broker) -> None:
        for service, handler in self.handlers().items():
            broker.register(service, handler)

    def _target(self, request: Request) -> tuple[str | None, list[bytes] | None]:
        """The server named in the first body frame, or an error reply."""
        text = request.body[0].decode("utf-8", "replace") if request.body else ""
        try:
            name = check_target(text)
        except ValueError as exc:
            return None, [BAD_REQUEST, str(exc).encode()]
        if name not in self.runner.servers:
            return None, [NOT_FOUND, f"no server {name!r}; servers: "
                                     f"{', '.join(self.runner.servers)}".encode()]
        return name, None

    def on_map(self, request: Request) -> list[bytes]:
        """cluster.map: no body -> FINAL 200, JSON {cluster, control, heartbeat_s,
        silence_timeout_s, routing: ShardMap.describe(), shards: [{index, name, prefixes,
        primary: {address, port, nic, ports, endpoints, cores}, backup: {...}}]}."""
        return [OK, self.map_body]

    async def on_status(self, request: Request) -> list[bytes]:
        """cluster.status: no body -> one PARTIAL per server (JSON: shard, role, state,
        pid, cores, address, port, bstar, seq, keys, updates_per_s, restarts, last_exit,
        reason, stats...), then FINAL 200, JSON {cluster, control, pid, servers, states}."""
        for row in self.runner.describe():
            await request.partial(json.dumps(row, sort_keys=True).encode())
        summary = {"cluster": self.plan.cluster, "control": self.plan.control,
                   "pid": os.getpid(), "servers": len(self.runner.servers),
                   "states": self.runner.counts(), "run_dir": str(self.runner.run_dir),
                   "stopping": self.runner.stopping}
        return [OK, json.dumps(summary, sort_keys=True).encode()]

    def on_stop(self, request: Request) -> list[bytes]:
        """cluster.stop: no body -> FINAL 200 "stopping"; the supervisor then stops every
        server (SIGTERM, SIGKILL after the deadline) and exits."""
        self.stop_requested.set()
        return [OK, b"stopping"]

    async def on_restart(self, request: Request) -> list[bytes]:
        """cluster.restart: SHARD/ROLE -> FINAL 200, JSON {server, pid} once the new run
        is spawned (a FAILED server gets a fresh restart count); 404/400/409."""
        name, error = self._target(request)
        if error:
            return error
        if self.runner.stopping:
            return [CONFLICT, b"the supervisor is stopping"]
        await self.runner.restart(name)
        proc = self.runner.get(name)
        return [OK, json.dumps({"server": name, "pid": proc.pid,
                                "state": proc.state}).encode()]

    def on_kill(self, request: Request) -> list[bytes]:
        """cluster.kill: SHARD/ROLE -> SIGKILL now (a failure drill; the restart policy
        restarts it) and FINAL 200, JSON {server, pid}; 409 if it has no process."""
        name, error = self._target(request)
        if error:
            return error
        pid = self.runner.kill(name)
        if pid is None:
            return [CONFLICT, f"{name} has no process now ({self.runner.get(name).state})"
                    .encode()]
        return [OK, json.dumps({"server": name, "pid": pid}).encode()]

    def on_logs(self, request: Request) -> list[bytes]:
        """cluster.logs: SHARD/ROLE [, LINES] -> FINAL 200, the last LINES lines (default
        50, at most 10000) of RUN_DIR/logs/SHARD-ROLE.log."""
        name, error = self._target(request)
        if error:
            return error
        lines = DEFAULT_LOG_LINES
        if len(request.body) > 1:
            try:
                lines = int(request.body[1])
                if not 1 <= lines <= MAX_LOG_LINES:
                    raise ValueError
            except ValueError:
                return [BAD_REQUEST, f"lines must be 1..{MAX_LOG_LINES}".encode()]
        path = self.runner.get(name).log_path
        try:
            return [OK, tail_lines(path, lines)]
        except FileNotFoundError:
            return [OK, b""]


# ===================================================================== stats poller

class StatsPoller:
    """Asks every RUNNING server for its stats (MDP ``shard.<SHARD>.<ROLE>``) once per
    interval, concurrently, one MDP client per server; answers land in the Runner."""

    def __init__(self, runner: Runner, endpoint: str, ctx: zmq.Context,
                 interval_s: float = STATS_INTERVAL_S):
        self.runner = runner
        self.endpoint = endpoint
        self.interval_s = interval_s
        self.clients = {name: MdpClient(endpoint, ctx=ctx, timeout_s=interval_s * 0.9,
                                        retries=0)
                        for name in runner.servers}
        self.errors = 0

    async def run(self) -> None:
        while True:
            await asyncio.gather(*(self._ask(name) for name, proc in self.runner.servers.items()
                                   if proc.state == RUNNING))
            await asyncio.sleep(self.interval_s)

    async def _ask(self, name: str) -> None:
        proc = self.runner.servers[name]
        service = stats_service(proc.plan.shard, proc.plan.role)
        try:
            body = await self.clients[name].request(service)
            stats = json.loads(body[-1])
            if not isinstance(stats, dict):
                raise ValueError("not a JSON object")
        except (ClonemapError, ValueError) as exc:
            self.errors += 1
            log.debug("stats of %s: %s", name, exc)
            return
        proc.set_stats(stats, self.runner.clock())

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()


# ===================================================================== client side

def resolve_control(control: str | None, config: str | None) -> str:
    """The control endpoint: ``--control``, else the CONFIG's ``control``, else
    $CLONEMAP_CONTROL, else the default. A wildcard bind is reached on 127.0.0.1."""
    if control:
        endpoint = control
    elif config:
        endpoint = load_config(config).control
    else:
        endpoint = os.environ.get("CLONEMAP_CONTROL", DEFAULT_CONTROL)
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:")


class ReplyError(ClonemapError):
    """A control service answered with a status other than 200."""

    def __init__(self, status: str, text: str):
        super().__init__(f"{status} {text}")
        self.status = status
        self.text = text
        self.exit_code = {"404": EXIT_NOT_FOUND, "400": EXIT_USAGE}.get(status, Exit.FAILED)


def call(endpoint: str, service: str, *body: bytes, timeout_s: float = CONTROL_TIMEOUT_S,
         retries: int = 1, on_partial: Callable[[bytes], None] | None = None) -> bytes:
    """One control request; returns the FINAL payload after the 200 status. Raises
    ``shards.common.errors.Timeout`` when no supervisor answers, ``ReplyError`` otherwise.
    Commands that act (kill, restart, stop) pass ``retries=0``: never sent twice."""
    with SyncMdpClient(endpoint, timeout_s=timeout_s, retries=retries) as client:
        with client.stream(service, *body) as stream:
            for partial in stream:
                if on_partial is not None:
                    on_partial(partial[-1])
        final = stream.final or [b""]
    status = final[0].decode("utf-8", "replace")
    payload = final[1] if len(final) > 1 else b""
    if status != "200":
        raise ReplyError(status, payload.decode("utf-8", "replace"))
    return payload


def ping(endpoint: str, service: str, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
    """Check that a supervisor answers and hosts ``service`` (MMI ``mmi.service``);
    ``Timeout`` if nobody answers, ``ReplyError`` 404 if it lacks the service."""
    with SyncMdpClient(endpoint, timeout_s=timeout_s, retries=1) as client:
        reply = client.request("mmi.service", service.encode())
    if reply[:1] != [b"200"]:
        raise ReplyError("404", f"the supervisor at {endpoint} has no service {service!r}")


def act(service: str, target: str, control: str | None, config: str | None,
        timeout_s: float, reply_timeout_s: float | None = None) -> dict:
    """A command that acts on one server (``cluster.kill``, ``cluster.restart``): check
    the target, check a supervisor answers, then send the request once (never retried:
    it must not act twice) and return its JSON reply."""
    name = checked_target(target)
    endpoint = resolve_control(control, config)
    ping(endpoint, service, timeout_s)
    return json.loads(call(endpoint, service, name.encode(),
                           timeout_s=reply_timeout_s or timeout_s, retries=0))


def status_rows(endpoint: str, timeout_s: float = CONTROL_TIMEOUT_S) -> tuple[list[dict], dict]:
    """``cluster.status``: (one dict per server, the summary)."""
    rows: list[dict] = []
    payload = call(endpoint, "cluster.status", timeout_s=timeout_s,
                   on_partial=lambda body: rows.append(json.loads(body)))
    return rows, json.loads(payload)


def run_command(fn: Callable[[], int | None]) -> None:
    """Run a control command's body; map errors to one line on stderr and an exit code
    (4 when no supervisor answers: ``shards.common.errors.Timeout``)."""
    import click

    try:
        code = fn()
    except ReplyError as exc:
        click.echo(f"error: {exc.text} (status {exc.status})", err=True)
        raise SystemExit(exc.exit_code) from None
    except ConfigError as exc:
        for line in str(exc).splitlines():
            click.echo(f"error: {line}", err=True)
        raise SystemExit(exc.exit_code) from None
    except ClonemapError as exc:
        hint = (" (is the supervisor running? start it with: supervisor start CONFIG)"
                if isinstance(exc, TimeoutError) else "")
        click.echo(f"error: {exc}{hint}", err=True)
        raise SystemExit(exc.exit_code) from None
    raise SystemExit(code or 0)


def control_options(fn):
    """``--control EP``, ``--config CONFIG`` and ``--timeout-s`` for a control command."""
    import click

    fn = click.option("--timeout-s", type=click.FloatRange(min=0.05),
                      default=CONTROL_TIMEOUT_S, show_default=True,
                      help="How long to wait for the supervisor (per attempt, 2 attempts).")(fn)
    fn = click.option("--config", "-c", "config", metavar="CONFIG", default=None,
                      help="Take the control endpoint from this config.")(fn)
    fn = click.option("--control", metavar="ENDPOINT", default=None,
                      help="The supervisor's control endpoint [default: $CLONEMAP_CONTROL "
                           f"or {DEFAULT_CONTROL}].")(fn)
    return fn


def target_argument(fn):
    """The SHARD/ROLE argument (checked by ``checked_target`` inside the command)."""
    import click

    return click.argument("target", metavar="SHARD/ROLE")(fn)


def checked_target(text: str) -> str:
    """``check_target`` for a command line: a malformed target exits 2 (usage)."""
    try:
        return check_target(text)
    except ValueError as exc:
        raise ReplyError("400", str(exc)) from None
