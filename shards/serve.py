"""Running one server process: the option parsers ``python -m clonemap.shards`` and ``python -m
shards.relay`` share, the serve loop (signals, the control-plane worker, the parent
watch, READY), and how it ends (``bind_and_serve``: the exit codes of
``clonemap.shards.common.errors.Exit``, a ``DISK_ERROR`` line on a disk error). It was part of
``clonemap.shards.__main__``, from which the relay imported private helpers.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import re
import signal
import sys

import click
import uvloop

from clonemap.shards.common.errors import (SERVER_MODULES, ConfigError, Exit, PortInUse,
                                          ProtocolError,
                                          require_extra)

require_extra("a shard server", "server", SERVER_MODULES)

from clonemap.shards.common.memory import freeze_startup_objects
from clonemap.shards.common.proto.bstar import PEER_DOWN
from clonemap.shards.common.routing import (MOVE_COMMAND, ROUTING_COMMAND, ROUTING_COUNT,
                                            ROUTING_FORGET, ShardMap)
from clonemap.shards.pair import BinaryStar, parse_peer
from clonemap.shards.server import COUNT_BEAT_S, ShardServer

log = logging.getLogger("clonemap.shards")

PARENT_POLL_S = 0.5
FATAL_EXIT = 1
COMPACT_COMMAND = b"compact"
"""A control request's first frame: start a compaction now (``compact_refused``)."""
MIN_BEAT_S = 0.05
"""The shortest beat a count's request may ask for (``_leaving``)."""


def parse_cpus(ctx, param, value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        cpus = sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of CPU numbers")
    if not cpus:
        raise click.BadParameter("no CPU given")
    return cpus


def peer_arg(ctx, param, value: str | None) -> tuple[str, int] | None:
    if value is None:
        return None
    try:
        return parse_peer(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc))


_SHARD_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")


def shard_arg(ctx, param, value: str) -> str:
    if not _SHARD_RE.match(value):
        raise click.BadParameter(f"{value!r}: 1..64 characters from A-Z a-z 0-9 _ . -")
    return value


def routing_arg(ctx, param, value: str | None) -> ShardMap | None:
    if value is None:
        return None
    text = value
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise click.BadParameter(f"cannot read {value[1:]!r}: {exc.strerror}")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}")
    if not isinstance(doc, dict):
        raise click.BadParameter("must be a JSON object (ShardMap.describe())")
    if isinstance(doc.get("routing"), dict):  # a whole cluster map: take its routing
        doc = doc["routing"]
    try:
        return ShardMap.from_description(doc)
    except ConfigError as exc:
        raise click.BadParameter(str(exc))


def load_access(server: ShardServer, keys_dir: str | None, rights: str | None,
                prog: str) -> None:
    """``--keys-dir`` (the server's CURVE keys) and ``--rights`` (the identities' rights,
    ``clonemap.shards.gate``) into ``server``, before it binds; a file that cannot be
    used ends the process with one line and ``Exit.USAGE``."""
    from clonemap.shards.common.security import Security
    from clonemap.shards.gate import Gate

    try:
        if keys_dir is not None:
            server.security = Security.load(keys_dir, "server")
        if rights is not None:
            server.gate = Gate.load(rights)
    except ConfigError as exc:
        click.echo(f"{prog}: {exc}", err=True)
        sys.exit(Exit.USAGE)


def control_stats(server: ShardServer, shard: str) -> dict:
    """What the control service answers: the server's stats plus who it is."""
    stats = server.stats()
    if not isinstance(server.role, BinaryStar):
        stats.update(shard=shard, role=server.role.name, bstar_state=None, peer=None,
                     pid=os.getpid())
    return stats


def _routing_of(body: list[bytes]) -> ShardMap | str:
    """The routing in a control request's first frame (``ShardMap.describe()`` as JSON),
    or why it is not one."""
    try:
        return ShardMap.from_description(json.loads(body[0]))
    except (IndexError, ValueError, TypeError, AttributeError, ConfigError) as exc:
        return f"not a routing: {exc}"


def _install(server: ShardServer, body: list[bytes]) -> str:
    """A control request's routing installed (``ShardServer.install_routing``); "" once
    followed, else why not. A third frame ``forget`` (the keys it moves have moved):
    those keys are forgotten, and the writes held for the move, and later ones for keys
    that moved, go on to their shards' collectors named in a fourth frame (JSON
    {shard index: [collector endpoints]}: ``clonemap.shards.migrate.Forwarder``)."""
    shard_map = _routing_of(body)
    if isinstance(shard_map, str):
        return shard_map
    forget = body[1:2] == [ROUTING_FORGET]
    try:
        forward = {int(i): list(c) for i, c in json.loads(body[2]).items()} if (
            len(body) > 2 and body[2]) else {}
    except (ValueError, TypeError, AttributeError) as exc:
        return f"not a forwarding map: {exc}"
    return server.install_routing(shard_map, forget=forget, forward_to=forward)


def _move(server: ShardServer, body: list[bytes]) -> str:
    """One step of a move (``clonemap.supervisor.resharding``), JSON {op, epoch, ...}: ""
    done, else why not. ``epoch``: the routing epoch of the change the step belongs to;
    a step of an earlier change than one this server took part in is refused
    (``ShardServer.take_step_of``). ``export`` {routing}: the copies asked of this
    server (``ICANHAZ`` with ``move=``) hold only what ``routing`` gives their shard;
    ``import`` {source, prefix, routing}: start copying what ``routing`` moves here
    from ``source``;
    ``stop-import``; ``hold`` {routing, peer, forward}: keep the writes of the keys it
    moves away (and connect to the collectors in ``forward`` now, so that the flip sends
    them on at once); ``seal``: the flip may begin (the hold no longer ends by itself);
    ``release``: apply what was held here; ``commit`` {routing}: the flip on the
    target (``ShardServer.commit_import``); ``background`` {on}: this server's threads
    at background CPU priority, or back (``ShardServer.background``: a shard the change
    adds, while it copies)."""
    try:
        doc = json.loads(body[0])
        op = doc["op"]
        epoch = doc.get("epoch")  # (the change's; a supervisor before it sent none)
        log.info("move: %s asked%s", op, f" (the change to epoch {epoch})"
                 if epoch is not None else "")
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            late = server.take_step_of(epoch)
            if late:
                log.warning("move: %s refused: %s", op, late)
                return late
        if op == "import":
            rate, timeout_s = doc.get("rate"), doc.get("timeout_s")
            return server.start_import(doc["source"], doc["prefix"].encode("utf-8"),
                                       ShardMap.from_description(doc["routing"]),
                                       rate=float(rate) if rate else None,
                                       timeout_s=float(timeout_s) if timeout_s else None)
        if op == "stop-import":  # (the move rolled back: what was staged goes too)
            server.abort_import()
            return ""
        if op == "hold":
            forward = {int(i): list(c) for i, c in doc.get("forward", {}).items()}
            return server.begin_hold(ShardMap.from_description(doc["routing"]),
                                     peer=bool(doc.get("peer")), forward_to=forward)
        if op == "export":
            return server.export(ShardMap.from_description(doc["routing"]))
        if op == "seal":
            return server.seal_hold()
        if op == "release":
            server.release_hold()
            return ""
        if op == "commit":
            return server.commit_import(ShardMap.from_description(doc["routing"]))
        if op == "background":
            return server.background(bool(doc["on"]))
        return f"no move step {op!r}"
    except (IndexError, ValueError, TypeError, KeyError, AttributeError, ConfigError,
            ProtocolError) as exc:
        return f"not a move step: {type(exc).__name__}: {exc}"


async def _leaving(server: ShardServer, request) -> dict | str:
    """What a control request's routing (``[ROUTING_COMMAND, routing, ROUTING_COUNT,
    beat]``) would take off this shard: {"shard index": [keys, bytes]}, or why it is
    not a routing. Counted a chunk per loop turn (``ShardServer.count_leaving``): the
    server serves meanwhile, and says every ``beat`` seconds (the optional fourth frame,
    ``COUNT_BEAT_S`` without it) how far it got, in a PARTIAL ``{"counting": keys looked
    at, "of": keys}``: a count lasts as long as the map is large, and the asker waits
    for the next word, not for the whole count."""
    shard_map = _routing_of(request.body[1:2])
    if isinstance(shard_map, str):
        return shard_map
    beat_s = COUNT_BEAT_S
    if len(request.body) > 3:
        try:
            beat_s = min(max(float(request.body[3]), MIN_BEAT_S), COUNT_BEAT_S * 10)
        except ValueError:
            return f"not a beat in seconds: {request.body[3][:32]!r}"

    async def beat(looked_at: int, of: int) -> None:
        await request.partial(json.dumps({"counting": looked_at, "of": of}).encode())

    leaving = await server.count_leaving(shard_map, beat, beat_s)
    return {str(i): list(row) for i, row in leaving.items()}


def _parent_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, owned by someone else
        return False
    return False


async def _serve(server: ShardServer, shard: str, control: str | None,
                 parent_pid: int | None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1,
                            lambda: log.info("stats %s", json.dumps(server.stats())))
    if server.gate.source:  # started with --rights: SIGHUP applies the file again
        loop.add_signal_handler(signal.SIGHUP, server.reload_rights)
    _arm_fault_injection(server)
    server.start()
    worker = None
    if control:
        from clonemap.shards.common.mdp.worker import MdpWorker

        service = f"shard.{shard}.{server.role.name}"
        def answer(request) -> str:
            """Stats, after what the body asks: ``peer-down`` says the peer cannot serve
            by itself; ``routing`` JSON installs a newer routing (``routing_refused``
            says why not), or with ``count`` says what it would take off this shard
            (``routing_leaving``); ``move`` JSON is one step of a move
            (``move_refused``); ``compact`` starts a compaction of the data directory now
            (``compact_refused`` says why not: one is running, no data directory)."""
            said: dict = {}
            command = request.body[:1]
            if command == [ROUTING_COMMAND] and request.body[2:3] == [ROUTING_COUNT]:
                return counted(request)
            if command == [PEER_DOWN] and isinstance(server.role, BinaryStar):
                server.role.peer_reported_down("the supervisor says so")
            elif command == [COMPACT_COMMAND]:
                said["compact_refused"] = (server.persist.compact_now()
                                           if server.persist is not None else
                                           "this server keeps no data directory")
            elif command == [MOVE_COMMAND]:
                said["move_refused"] = _move(server, request.body[1:])
            elif command == [ROUTING_COMMAND]:
                said["routing_refused"] = _install(server, request.body[1:])
            stats = control_stats(server, shard)  # (after the step: what it left)
            stats.update(said)
            return json.dumps(stats)

        async def counted(request) -> str:
            leaving = await _leaving(server, request)
            stats = control_stats(server, shard)
            stats["routing_leaving"] = leaving
            return json.dumps(stats)

        worker = MdpWorker(control, service, answer, ctx=server.ctx,
                           security=server.security)
        await worker.start()
        log.info("control: MDP worker for %r at %s", service, control)
    parent_handle = None
    if parent_pid is not None:
        def check_parent() -> None:
            nonlocal parent_handle
            if _parent_gone(parent_pid):
                log.info("parent process %d is gone: exiting", parent_pid)
                stop.set()
                return
            parent_handle = loop.call_later(PARENT_POLL_S, check_parent)
        check_parent()
    cfg = server.config
    first_copy = getattr(server.role, "first_copy", None)
    if first_copy is not None:  # a relay is ready once it holds the shard's map
        copied = asyncio.ensure_future(first_copy.wait())
        await asyncio.wait([copied, asyncio.ensure_future(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
    frozen = freeze_startup_objects()  # out of the hot path's collections
    log.debug("%d start-up objects frozen out of the garbage collector's walks", frozen)
    print(f"READY shard host={cfg.host} port={cfg.port} pid={os.getpid()} role={server.role.name}",
          flush=True)
    waits = [asyncio.ensure_future(stop.wait()),
             asyncio.ensure_future(server.disk_failed.wait())]
    if isinstance(server.role, BinaryStar):
        waits.append(asyncio.ensure_future(server.role.done.wait()))
    code = 0
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if server.disk_error:
            code = disk_exit(shard, server.role.name, cfg.port, server.disk_error)
        elif isinstance(server.role, BinaryStar) and server.role.fatal:
            click.echo(f"shards: fatal Binary Star error on shard {shard} ({server.role.name}, "
                       f"port {cfg.port}): {server.role.fatal}", err=True)
            code = FATAL_EXIT
    finally:
        for fut in waits:
            fut.cancel()
        if parent_handle is not None:
            parent_handle.cancel()
        if worker is not None:
            await worker.stop()
        stats = server.stats()
        server.close()
        log.info("stopped: %s", stats_summary(stats))
        log.debug("final stats %s", json.dumps(stats))
    return code


def stats_summary(stats: dict) -> str:
    """One short line of a server's counters for its log (the whole JSON is logged at
    DEBUG, and served by its control service while it runs)."""
    drops = stats.get("drops") or {}
    return (f"seq {stats['seq']}, {stats['keys']} keys, {stats['updates']} updates, "
            f"{stats.get('snapshots_served', 0)} snapshots served, "
            f"{stats.get('drops_total', 0)} dropped"
            + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(drops.items())) + ")"
               if drops else "")
            + f", up {stats['uptime_s']:.1f} s")


def disk_exit(shard: str, role: str, port: int, why: str) -> int:
    """Say why on stdout (``DISK_ERROR ...``, for the supervisor) and stderr; the code."""
    print(f"DISK_ERROR shard={shard} role={role} port={port} {why}", flush=True)
    click.echo(f"shards: disk error on shard {shard} ({role}, port {port}): {why}; "
               "stopped so that its peer serves (restart it once the disk works)", err=True)
    return Exit.DISK


def _arm_fault_injection(server: ShardServer) -> None:
    """Tests only: ``$CLONEMAP_INJECT_DISK_FAULT`` (``write:EIO`` or ``fsync:EIO``) makes
    SIGUSR2 arm that fault for the log's next write or fsync (``DataDir.inject_fault``):
    EIO and a failed fsync cannot be made on a real filesystem here."""
    spec = os.environ.get("CLONEMAP_INJECT_DISK_FAULT")
    if not spec or server.persist is None:
        return
    kind, _, name = spec.partition(":")
    code = getattr(errno, name or "EIO")
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGUSR2, lambda: server.persist is not None
        and server.persist.inject_fault(kind, code))
    log.warning("fault injection armed: SIGUSR2 fails the log's next %s with %s", kind,
                name or "EIO")


def bind_and_serve(server: ShardServer, shard: str, control: str | None,
                   parent_pid: int | None, program: str) -> None:
    """Bind (a taken port exits 3, naming it), serve until a signal, exit with the code
    (a server's and a relay's common end)."""
    try:
        server.bind()
    except PortInUse as exc:
        click.echo(f"{program}: cannot bind: {exc}", err=True)
        sys.exit(exc.exit_code)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        code = runner.run(_serve(server, shard, control, parent_pid))
    sys.exit(code)
