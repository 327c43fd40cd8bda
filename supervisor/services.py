"""The control plane's supervisor side: the MDP/0.2 services its broker hosts and the
poller that collects each server's stats (the commands' side is ``clonemap.supervisor.control``).

Services (one handler each; the request body and the reply are in each docstring). Every
FINAL starts with a status frame in the MMI style: ``200`` OK, ``400`` bad request,
``403`` the caller's identity lacks ``admin`` (stop, restart, kill and logs need it;
``clonemap.shards.common.rights``), ``404`` no such server, ``409`` not possible now,
``500`` the handler failed (the MDP library's own reply). Server names are
``SHARD/ROLE`` (``s0/primary``).

    service          request body                 replies
    cluster.map      (none)                       FINAL 200, JSON map (see cluster_map)
    cluster.status   (none)                       PARTIAL JSON per server, FINAL 200, JSON summary
    cluster.stop     (none)                       FINAL 200, "stopping"; then everything stops
    cluster.restart  SHARD/ROLE                   FINAL 200, JSON {server, pid} once restarted
    cluster.kill     SHARD/ROLE                   FINAL 200, JSON {server, pid}: SIGKILL sent
    cluster.logs     SHARD/ROLE [, LINES]         FINAL 200, the log's last LINES (default 50)
    cluster.whoami   (none)                       FINAL 200, JSON: the caller's identity and rights
    cluster.reload   (none)                       FINAL 200, JSON {version, ...}: rights applied
    cluster.reshard  JSON {config, apply}         FINAL 200, JSON plan (and epoch once applied);
                                                  409 with the plan when it is not applied
                     {"abort": true}              FINAL 200 the change under way rolls back,
                                                  409 none runs or it is past its flip

``cluster.reload`` and ``cluster.reshard`` need ``admin`` too
(``clonemap.supervisor.resharding``). A request to a server's own service (``shard.*``)
with a body (``peer-down``, ``routing``) needs ``admin``; a bare stats request does not.

Each server answers its own stats as MDP service ``shard.<SHARD>.<ROLE>`` (a JSON
object); ``StatsPoller`` asks every running server once per interval through the same
broker, so ``cluster.status`` answers from fresh figures without waiting on any server.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from typing import Callable

import zmq

from clonemap.shards.common.errors import ClonemapError
from clonemap.shards.common.mdp import Request
from clonemap.shards.common.mdp.client import MdpClient
from clonemap.shards.common.cluster import cluster_map
from clonemap.shards.common.config import load_config
from clonemap.shards.common.placement import Plan
from clonemap.shards.common.rights import RESERVED, Rights
from clonemap.shards.common.security import check_keys_present
from clonemap.shards.gate import write_rights
from clonemap.supervisor.protocol import (BAD_REQUEST, CONFLICT, DEFAULT_LOG_LINES, FORBIDDEN,
                                          MAX_LOG_LINES, NOT_FOUND, OK, check_target,
                                          stats_service)
from clonemap.supervisor.health import ClusterHealth, shards_without_active
from clonemap.shards.common.proto.bstar import PEER_DOWN
from clonemap.supervisor.runner import FAILED, RUNNING, Runner

log = logging.getLogger(__name__)

NO_RIGHTS = Rights()

STATS_INTERVAL_S = 1.0
REFRESH_S = 0.5
"""The longest a status answer waits for its fresh stats round."""


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


ABORT_BODY = b'{"abort": true}'
"""``cluster.reshard``'s body that stops the change under way (``supervisor reshard
--abort``)."""


class ControlServices:
    """The handlers, over one Runner. ``stop_requested`` is set by ``cluster.stop``."""

    def __init__(self, plan: Plan, runner: Runner, stop_requested: asyncio.Event,
                 poller: "StatsPoller | None" = None, health: ClusterHealth | None = None,
                 config_path: str | None = None, rights_path: str | None = None,
                 broker=None, resharding=None):
        """``config_path``: the config the supervisor was started from (``cluster.reload``
        reads it again); ``rights_path``: the rights file its servers load (None: they
        check no rights); ``broker``: whose ZAP handler a reload updates."""
        self.plan = plan
        self.access = plan.access
        """Every identity's rights now (``cluster.reload`` replaces them)."""
        self.config_path = config_path
        self.rights_path = rights_path
        self.rights_version = 1
        self.broker = broker
        self.runner = runner
        self.stop_requested = stop_requested
        self.poller = poller
        """Asked for one fresh round before a status answer (None: the last figures)."""
        self.health = health
        self.map_body = json.dumps(cluster_map(plan), sort_keys=True).encode()
        self.resharding = resharding
        """``clonemap.supervisor.resharding.Resharding``: the routing and its changes."""
        if resharding is not None:
            resharding.on_changed = self._routing_changed
        self.forbidden: dict[str, int] = {}
        """Control commands refused for want of ``admin``, by identity."""

    def handlers(self) -> dict[str, Callable]:
        admin = self._admin_only
        return {"cluster.map": self.on_map, "cluster.status": self.on_status,
                "cluster.whoami": self.on_whoami,
                "cluster.stop": admin(self.on_stop), "cluster.restart": admin(self.on_restart),
                "cluster.kill": admin(self.on_kill), "cluster.logs": admin(self.on_logs),
                "cluster.reload": admin(self.on_reload),
                "cluster.reshard": admin(self.on_reshard)}

    def _routing_changed(self, plan: Plan) -> None:
        self.plan = plan
        self.map_body = json.dumps(cluster_map(plan), sort_keys=True).encode()

    async def on_reshard(self, request: Request) -> list[bytes]:
        """cluster.reshard (admin): JSON {config: the new config's path on this host,
        apply} -> FINAL 200, JSON {epoch, next_epoch, changed, shards: [old, new], moves:
        [{from, to, keys, bytes}], prefixes: {prefix: [from, to]}, ...}: the plan, and
        once applied the new epoch and what the move took; 400 a config that does not
        hold, 409 (with the plan as a second frame when there is one) a change that
        could not be applied (rolled back), 503 a server that could not count or no
        active server (``clonemap.supervisor.resharding``). An apply that counts its
        plan says it first in a PARTIAL, JSON {plan, phase: "planned"}. JSON {abort:
        true}: the change under way stops and rolls back (200, what happens; 409 why
        not: none runs, or it is past its flip)."""
        from clonemap.supervisor.resharding import Refused, parse_change

        if self.resharding is None or self.runner.stopping:
            return [CONFLICT, b"the supervisor is stopping"]
        if request.body[:1] == [ABORT_BODY]:  # (not behind the change's lock)
            asked, why = self.resharding.abort()
            return [OK if asked else CONFLICT, why.encode()]
        try:
            part = _part_of(request.body)
            if part is not None:  # another host's supervisor runs a change (its added shards)
                return [OK, json.dumps(await self.resharding.part(part)).encode()]
            config, apply, copy_rate, priority = parse_change(request.body)
            plan = await self.resharding.change(config, apply, request.partial, copy_rate,
                                                priority)
        except Refused as exc:
            reply = [exc.status, exc.text.encode()]
            if exc.plan is not None:
                reply.append(json.dumps(exc.plan, sort_keys=True).encode())
            return reply
        return [OK, json.dumps(plan, sort_keys=True).encode()]

    def _refusal(self, service: bytes, user_id: str | None) -> list[bytes]:
        who = user_id or "?"
        self.forbidden[who] = self.forbidden.get(who, 0) + 1
        name = service.decode("utf-8", "replace")
        log.warning("refused %s from identity %r: it does not hold admin", name, who)
        return [FORBIDDEN, f"identity {who!r} may not use {name}: its role does not hold "
                           "admin".encode()]

    def _admin_only(self, handler: Callable) -> Callable:
        """``handler`` for a caller whose identity holds ``admin``; 403 for any other
        (counted ``forbidden`` by identity, logged)."""

        def checked(request: Request):
            if self.access.may_admin(request.user_id):
                return handler(request)
            return self._refusal(request.service, request.user_id)

        return checked

    def guard(self, service: bytes, body: list[bytes], user_id: str | None):
        """The broker asks before it queues a client's request for a worker: a server's
        own service with a body (``peer-down``: it changes the pair) needs ``admin``."""
        if any(body) and service.startswith(b"shard.") and not self.access.may_admin(user_id):
            return self._refusal(service, user_id)
        return None

    def register(self, broker) -> None:
        for service, handler in self.handlers().items():
            broker.register(service, handler)
        broker.core.guard = self.guard

    def on_whoami(self, request: Request) -> list[bytes]:
        """cluster.whoami: no body -> FINAL 200, JSON {identity, role, read, write, deny,
        admin, rights, enforced}: the caller's rights as the cluster sees them (the
        shared client pair, and a cluster without CURVE: every right)."""
        user = request.user_id
        rights = self.access.rights_of(user)
        named = user is not None and user not in RESERVED
        doc = {"identity": user or "(none: no CURVE)",
               "role": self.access.roles.get(user, "") if named else "",
               "enforced": self.rights_path is not None, "known": rights is not None}
        rights = rights if rights is not None else NO_RIGHTS
        doc.update(read=list(rights.read), write=list(rights.write), deny=list(rights.deny),
                   admin=rights.admin, rights=rights.describe())
        return [OK, json.dumps(doc, sort_keys=True).encode()]

    def on_reload(self, request: Request) -> list[bytes]:
        """cluster.reload (admin): no body -> the config the supervisor was started from
        is read again and its identities and roles applied: the rights file rewritten
        (version + 1), the broker's ZAP handler updated, SIGHUP to every running server
        and relay this supervisor started (they apply the file: ``ShardServer.
        reload_rights``). FINAL 200, JSON {version, at (epoch s), servers: [names
        signalled], changed: [identities], identities}; 400 for a config that does not
        validate or lacks a key; 409 when the servers check no rights (started without
        identities: restart them) or the supervisor is stopping."""
        if self.runner.stopping:
            return [CONFLICT, b"the supervisor is stopping"]
        if self.rights_path is None or self.config_path is None:
            return [CONFLICT, b"this cluster was started without named identities: its "
                              b"servers check no rights; add security.clients and restart "
                              b"the supervisor (supervisor stop, then start)"]
        try:
            config = load_config(self.config_path)
            access = config.security.access()
            check_keys_present(self.plan.keys_dir, self.config_path, access.identities)
        except ClonemapError as exc:
            return [BAD_REQUEST, str(exc).encode()]
        old, self.access = self.access, access
        changed = sorted(old.changed(access))
        self.rights_version += 1
        write_rights(self.rights_path, access, self.rights_version)
        if self.broker is not None:
            self.broker.admit_identities(frozenset(access.identities))
        at = time.time()
        signalled = []
        for name, proc in self.runner.servers.items():
            if proc.pid is not None and proc.state == RUNNING:
                proc.send(signal.SIGHUP)  # (through its Popen: never a reaped pid)
                signalled.append(name)
        log.info("rights version %d: %d identities, changed: %s; signalled %d servers",
                 self.rights_version, len(access.identities), ", ".join(changed) or "none",
                 len(signalled))
        return [OK, json.dumps({"version": self.rights_version, "at": at,
                                "servers": signalled, "changed": changed,
                                "identities": access.describe()}, sort_keys=True).encode()]

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
        reason, stats...), then FINAL 200, JSON {cluster, control, pid, servers, states,
        without_active: [shard...], forbidden: {identity: control commands refused},
        failovers: {shard: n}, events: [{at, text}]}. The
        figures are fresh: one stats round is asked first (at most ``REFRESH_S``)."""
        if self.poller is not None:
            try:
                await asyncio.wait_for(self.poller.poll_round(), REFRESH_S)
            except asyncio.TimeoutError:
                pass  # a server that does not answer keeps its last figures
        rows = self.runner.describe()
        for row in rows:
            await request.partial(json.dumps(row, sort_keys=True).encode())
        summary = {"cluster": self.plan.cluster, "control": self.plan.control,
                   "pid": os.getpid(), "servers": len(self.runner.servers),
                   "states": self.runner.counts(), "run_dir": str(self.runner.run_dir),
                   "stopping": self.runner.stopping,
                   "without_active": shards_without_active(
                       rows, [self.plan.shards[i].name for i in self.plan.across]),
                   "host": self.plan.host_name, "forbidden": dict(self.forbidden),
                   **(self.health.summary() if self.health is not None else {})}
        if self.resharding is not None:  # the routing's epoch, and a change under way
            summary["routing"] = self.resharding.state()
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
    interval, concurrently, one MDP client per server; answers land in the Runner, and
    the health tracker sees every round. ``poll_round()`` joins the round in progress or
    starts one (a status answer asks for fresh figures that way)."""

    def __init__(self, runner: Runner, endpoint: str, ctx: zmq.Context,
                 interval_s: float = STATS_INTERVAL_S, security=None,
                 health: ClusterHealth | None = None):
        self.runner = runner
        self.health = health
        self._round: asyncio.Task | None = None
        self.endpoint = endpoint
        self.interval_s = interval_s
        self.ctx, self.security = ctx, security
        self.clients = {name: self._client() for name in runner.servers}
        self.errors = 0
        self.closed = False

    def _client(self) -> MdpClient:
        return MdpClient(self.endpoint, ctx=self.ctx, timeout_s=self.interval_s * 0.9,
                         retries=0, security=self.security)

    async def run(self) -> None:
        while True:
            await self.poll_round()
            await asyncio.sleep(self.interval_s)

    async def poll_round(self) -> None:
        if self._round is None or self._round.done():
            self._round = asyncio.get_running_loop().create_task(self._one_round())
        await asyncio.shield(self._round)

    async def _one_round(self) -> None:
        await asyncio.gather(*(self._ask(name) for name, proc in self.runner.servers.items()
                               if proc.state == RUNNING))
        if self.health is not None:
            self.health.observe(self.runner.describe())

    async def _ask(self, name: str) -> None:
        proc = self.runner.servers[name]
        service = stats_service(proc.plan.shard, proc.plan.role)
        try:
            client = self.clients.get(name)
            if client is None:  # closed, or a server a change of the routing added
                if self.closed:
                    return
                client = self.clients[name] = self._client()
            body = await client.request(service, *self._notice(proc))
            stats = json.loads(body[-1])
            if not isinstance(stats, dict):
                raise ValueError("not a JSON object")
        except (ClonemapError, ValueError) as exc:
            self.errors += 1
            log.debug("stats of %s: %s", name, exc)
            return
        proc.set_stats(stats, self.runner.clock())

    def _notice(self, proc) -> tuple[bytes, ...]:
        """``peer-down`` when the server's peer is not running and will not come back by
        itself: it stopped on a disk error, or it is FAILED (``bstar`` rule 9)."""
        for other in self.runner.servers.values():
            if other is proc or other.plan.shard != proc.plan.shard:
                continue
            if other.state == FAILED or (other.state != RUNNING and other.disk_error):
                return (PEER_DOWN,)
        return ()

    async def close(self) -> None:
        """Idempotent."""
        if self._round is not None:
            self._round.cancel()
            await asyncio.gather(self._round, return_exceptions=True)
        self.closed = True
        clients, self.clients = self.clients, {}
        for client in clients.values():
            await client.close()


def _part_of(body: list[bytes]) -> dict | None:
    """``cluster.reshard``'s body from another host's supervisor (JSON with ``part``:
    ``clonemap.supervisor.resharding.Resharding.part``), else None."""
    try:
        doc = json.loads(body[0])
    except (IndexError, ValueError):
        return None
    return doc if isinstance(doc, dict) and "part" in doc else None
