"""``chp``: the clonemap map from a shell (get, set, del, dump, watch, trace).

::

    chp [--control EP | --config FILE | --servers tcp://H:P[,tcp://H:P2] ...] COMMAND

    chp [-v] get KEY [--hex | --raw]     the value (text + newline, hex, or exact bytes)
    chp set KEY VALUE [--ttl S]          VALUE as text; --hex VALUE, or --file PATH (- stdin)
        [--wait/--no-wait]               wait (default) until the owning shard published it
    chp del KEY                          delete (exit 6 if the key is not there)
    chp del --prefix P [--yes]           delete every key under P (without --yes: the count)
    chp dump [SUBTREE] [--json] [--hex]  every key under SUBTREE, sorted
    chp keys [PREFIX]                    the keys under PREFIX only, sorted, one a line
    chp which KEY [--json]               the shard that owns KEY, its servers, its active
    chp watch [SUBTREE] [--json]         the items, a "synced" line, then live changes
    chp trace SHARD                      every command on the shard's publisher (P+1)

Where the cluster is: ``--control`` (the supervisor's MDP ``cluster.map``), ``--config``
(a supervisor config, planned here), or ``--servers`` once per shard (a server or a
comma-separated Binary Star pair; N given = N hashed shards). None given:
``$CLONEMAP_CONTROL``, else tcp://127.0.0.1:5555.

A command follows only the shards it needs: ``get /users/42/name`` asks for the subtree
"/users/42/" (one shard); ``dump`` and ``watch`` of "" ask every shard.

Exit codes (``shards.common.errors.Exit``, mapped here in ``_exit_code``): 0 ok; 1 other
failure (a server refused this client's CURVE handshake: the line says why); 2 usage or
a bad config; 4 timeout (no cluster reachable, no echo); 5 a watch that fell behind (slow
consumer); 6 key not found (get, del); 130 interrupted (Ctrl-C). Errors: one line on
stderr.

Quiet by default: a one-shot command (get, set, del, dump) prints nothing on stderr
unless it fails (a failover it rode through is not a failure); ``watch`` and ``trace``
also print warnings (a failover, a reset) as ``chp: ...`` lines; ``-v``/``--verbose``
prints the client's whole log (failovers, resumes, reconnections) for any command.
"""
from __future__ import annotations

import asyncio
import binascii
import json
import logging
import os
import signal
import sys
import time

import click
import uvloop
import zmq

from shards.common.endpoints import DEFAULT_CONTROL
from shards.common.endpoints import NOT_LISTENING, ensure_listening
from shards.common.errors import (ClonemapError, ConfigError, Exit, HandshakeRefused,
                                  SlowConsumer, Timeout)
from shards.common.proto import chp
from shards.common.zio import AsyncSocket
from client.api import AsyncClone, Conflict
from client.clone import check_write
from client.router import Cluster, fetch_cluster
from shards.common.security import Security, client_keys

DEFAULT_TIMEOUT_S = 5.0

EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE, EXIT_FAILED, EXIT_TIMEOUT, EXIT_SLOW = (
    Exit.OK, Exit.NOT_FOUND, Exit.USAGE, Exit.FAILED, Exit.TIMEOUT, Exit.SLOW)
EXIT_INTERRUPTED = Exit.INTERRUPTED
EXIT_CONFLICT = Exit.CONFLICT


class NotFound(ClonemapError):
    """The key is not in the map."""


# ------------------------------------------------------------------ helpers (pure)

def subtree_of(prefix: str) -> str:
    """The deepest 12/CHP subtree ("" or "/a/.../") that holds every key under
    ``prefix``: "/users/42/name" -> "/users/42/", "/users" -> "", "plain" -> ""."""
    if not prefix.startswith("/"):
        return ""
    cut = prefix.rfind("/")
    sub = prefix[:cut + 1] if cut > 0 else ""
    try:
        chp.check_subtree(sub.encode("utf-8"))
    except ValueError:
        return ""
    return sub


def show_value(value: bytes, hex_all: bool = False) -> str:
    """Text if the value is printable UTF-8 (no control characters), else 0x<hex>."""
    if not hex_all:
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            pass
        else:
            if text.isprintable():
                return text
    return "0x" + value.hex()


def json_value(value: bytes):
    """A JSON string for UTF-8 text, ``{"hex": ...}`` for anything else."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": value.hex()}


def error_line(exc: BaseException, target: "Target") -> str:
    """The one line ``chp: error: ...`` says for ``exc`` (the command line's words, not
    the library's: ``--keys``, not ``keys=``)."""
    if isinstance(exc, HandshakeRefused):
        return f"{exc.endpoint}: " + CLI_HANDSHAKE_WORDS[exc.cause]
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, TimeoutError) and not isinstance(exc, NotFound):
        message += hint_for(exc, target)
    return message


CLI_HANDSHAKE_WORDS = {
    "curve_required": "the cluster requires CURVE: pass --keys DIR or --config CONFIG",
    "key_refused": "the server refused this client's key: --keys must name the cluster's "
                   "keys directory (what `supervisor keygen` wrote)",
    "wrong_server_key": "the CURVE handshake failed: the keys given are not this "
                        "cluster's (its server.key differs)",
    "curve_off": "the cluster does not use CURVE: drop --keys (and $CLONEMAP_KEYS)",
}
"""``errors.HANDSHAKE_CAUSES`` in the command line's words."""


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, NotFound):
        return EXIT_NOT_FOUND
    if isinstance(exc, Conflict):
        return EXIT_CONFLICT
    if isinstance(exc, (ConfigError, click.UsageError, BadUsage)):
        return EXIT_USAGE
    if isinstance(exc, TimeoutError):
        return EXIT_TIMEOUT
    if isinstance(exc, SlowConsumer):
        return EXIT_SLOW
    if isinstance(exc, (ValueError, TypeError)):
        return EXIT_USAGE  # a bad key, subtree or value
    return EXIT_FAILED


def checked_endpoint(text: str, where: str) -> str:
    """``tcp://IPV4:PORT`` or a usage error naming the option (exit 2, one line)."""
    from shards.common.config import parse_endpoint

    try:
        return parse_endpoint(text).replace("tcp://*:", "tcp://127.0.0.1:")
    except ValueError as exc:
        raise BadUsage(f"{where} {text!r}: {exc}") from None


class BadUsage(ClonemapError):
    """A malformed option: one line, exit 2."""

    exit_code = Exit.USAGE


# ------------------------------------------------------------------ running a command

class Target:
    """Where the cluster is, as the global options said."""

    def __init__(self, control: str | None, config: str | None, servers: tuple[str, ...],
                 timeout_s: float, keys: str | None = None, via: str = "servers"):
        given = [n for n, v in (("--control", control), ("--config", config),
                                ("--servers", servers)) if v]
        if len(given) > 1:
            raise click.UsageError(f"give one of --control, --config, --servers "
                                   f"(got {' and '.join(given)})")
        self.control = control if (control or config or servers) else \
            os.environ.get("CLONEMAP_CONTROL", DEFAULT_CONTROL)
        if self.control:
            self.control = checked_endpoint(
                self.control, "--control" if control else "$CLONEMAP_CONTROL")
        for entry in servers:
            for address in entry.split(","):
                if address.strip():
                    checked_endpoint(address.strip(), "--servers")
        self.config = config
        self.servers = servers
        self.timeout_s = timeout_s
        self.via = via
        """``relays``: read each shard through its relays (its servers if it has none)."""
        self.keys = keys or os.environ.get("CLONEMAP_KEYS") or None
        """CURVE: the cluster's keys directory (a config with ``security.curve`` gives
        its own)."""

    def security(self, cluster: Cluster | None = None) -> Security:
        """The keys to present: ``--keys``, else the cluster's (config), else none."""
        if cluster is None:
            return client_keys(self.keys)
        return client_keys(self.keys, curve=cluster.curve, cluster_keys_dir=cluster.keys_dir,
                           source=cluster.source)

    def describe(self) -> str:
        if self.config:
            return f"config {self.config}"
        if self.servers:
            return "servers " + " ".join(self.servers)
        return f"control {self.control}"

    def _pairs(self) -> list[list[str]]:
        return [[s for s in entry.split(",") if s.strip()] for entry in self.servers]

    def clone(self, subtree: str = "", only_key: str | None = None) -> AsyncClone:
        self.check_listening()
        kw = dict(subtree=subtree, timeout_s=self.timeout_s, keys=self.keys,
                  only_key=only_key, via=self.via)
        if self.config:
            return AsyncClone(config=self.config, **kw)
        if self.servers:
            return AsyncClone(shards=self._pairs(), **kw)
        return AsyncClone(control=self.control, control_timeout_s=self.timeout_s / 2, **kw)

    def check_listening(self) -> None:
        """With ``--control``: a down cluster fails now (exit 4), not after two MDP tries;
        called once a command's own checks passed, just before it connects."""
        if self.control and not self.config and not self.servers:
            ensure_listening(self.control)

    async def cluster(self, ctx: zmq.Context) -> Cluster:
        self.check_listening()
        if self.config:
            return Cluster.from_config(self.config)
        if self.servers:
            return Cluster.from_pairs(self._pairs())
        return await fetch_cluster(self.control, ctx=ctx, timeout_s=self.timeout_s / 2,
                                   security=self.security())


def run(target: Target, coro_fn, *args) -> None:
    """Run ``coro_fn(target, *args)`` on uvloop; map its outcome to an exit code."""
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            code = runner.run(_with_signals(coro_fn(target, *args)))
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    except click.UsageError:
        raise
    except (ClonemapError, ValueError, TypeError, OSError, zmq.ZMQError) as exc:
        click.echo(f"chp: error: {error_line(exc, target)}", err=True)
        raise SystemExit(_exit_code(exc)) from None
    raise SystemExit(code or EXIT_OK)


def hint_for(exc: TimeoutError, target: Target) -> str:
    """The likely cause of a timeout, in words, from what the client saw."""
    what = getattr(exc, "what", "")
    text = str(exc)
    if what == "echo":
        return (" (the shard took the write but did not publish it: it has no ACTIVE "
                "server now, or it dropped the write; `supervisor status` shows both, and "
                "a dropped write is counted in its server's drops)")
    if what == "snapshot":
        if "authentication" in text or "handshake" in text:
            return ""  # the link's own words say it
        if "refused" in text or "PASSIVE" in text or "vote" in text:
            return (" (a server refused to serve: the pair has no ACTIVE server now; see "
                    "`supervisor status`)")
        return f" (no snapshot from the servers: is the cluster up? tried {target.describe()})"
    if what.startswith("mdp service") or what == NOT_LISTENING:
        return f" (no cluster map: is the supervisor up? tried {target.describe()})"
    return f" (is the cluster up? tried {target.describe()})"


async def _with_signals(coro):
    """Ctrl-C (SIGINT) ends a long command (watch, trace) with 130, SIGTERM with 0; both
    close the sockets first. (Installed explicitly: a shell's background job starts with
    SIGINT ignored, and Python then would not raise KeyboardInterrupt.)"""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    got: list[int] = []

    def stop(signum: int) -> None:
        got.append(signum)
        task.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop, signum)
    try:
        return await task
    except asyncio.CancelledError:
        if got:
            return EXIT_INTERRUPTED if got[0] == signal.SIGINT else EXIT_OK
        raise
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def check_key_text(key: str) -> None:
    chp.check_key(key.encode("utf-8"))


def _out(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


# ------------------------------------------------------------------ commands

async def do_get(target: Target, key: str, mode: str) -> int:
    check_key_text(key)
    async with target.clone(subtree_of(key), only_key=key) as clone:
        value = clone.get(key)
        meta = clone.meta(key)
    if value is None:
        raise NotFound(f"key not found: {key}")
    if mode == "json":
        _out(json.dumps({"key": key, "value": json_value(value), "seq": meta.seq,
                         "expires": meta.expires, "props": meta.props,
                         "shard": meta.shard}, ensure_ascii=False).encode() + b"\n")
    elif mode == "hex":
        _out(value.hex().encode() + b"\n")
    elif mode == "raw":
        _out(value)
    else:
        _out(value + b"\n")
    return EXIT_OK


async def do_set(target: Target, key: str, value: bytes | None, ttl: float | None,
                 wait: bool, if_seq: int | None = None, create: bool = False) -> int:
    check_write(key, value or b"", ttl)  # what a server would drop: refused before connecting
    if value == b"":
        raise BadUsage("an empty value means delete in 12/CHP: use `chp del KEY`")
    conditional = create or if_seq is not None
    if create and if_seq is not None:
        raise BadUsage("--create is --if-seq 0: give one or the other")
    if conditional and not wait:
        raise BadUsage("--if-seq/--create wait for the outcome: drop --no-wait")
    async with target.clone(subtree_of(key), only_key=key) as clone:
        if value is None:
            if key not in clone and if_seq is None:
                raise NotFound(f"key not found: {key}")
            seq = await clone.delete(key, wait=wait, if_seq=if_seq)
        else:
            seq = await clone.set(key, value, ttl, wait=wait, if_seq=if_seq, create=create)
        if conditional:
            _out(b"%d\n" % seq)  # the write's sequence: the next --if-seq
        if not wait:
            await clone.flush()
            await clone.close(linger_s=1.0)
    return EXIT_OK


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


async def do_del_prefix(target: Target, prefix: str, yes: bool) -> int:
    """Delete every key under ``prefix``: the deletes of each shard go out in a row and
    the last of each is awaited (a shard publishes in order, so the others are in by
    then). Without ``yes`` it only says how many it would delete (exit 2)."""
    if not prefix:
        raise BadUsage("--prefix needs a non-empty prefix (delete everything by naming "
                       "each top-level prefix)")
    async with target.clone(subtree_of(prefix)) as clone:
        keys = sorted(clone.keys(prefix))
        if not yes:
            raise BadUsage(f"would delete {_count(len(keys), 'key')} under {prefix!r}: "
                           "add --yes")
        last_of: dict[str, str] = {}
        for key in keys:
            agent = clone.agent_of(key)
            last_of[agent.name if agent is not None else ""] = key
        tails = set(last_of.values())
        for key in keys:
            if key not in tails:
                await clone.delete(key)
        await asyncio.gather(*(clone.delete(k, wait=True) for k in tails))
    _out(f"deleted {_count(len(keys), 'key')} under {prefix}\n".encode("utf-8"))
    return EXIT_OK


async def do_dump(target: Target, subtree: str, as_json: bool, hex_all: bool) -> int:
    async with target.clone(subtree_of(subtree)) as clone:
        items = sorted(clone.items(subtree))
    if as_json:
        doc = {k: ({"hex": v.hex()} if hex_all else json_value(v)) for k, v in items}
        _out(json.dumps(doc, indent=1, ensure_ascii=False).encode("utf-8") + b"\n")
    else:
        _out(b"".join(f"{k}\t{show_value(v, hex_all)}\n".encode("utf-8") for k, v in items))
    return EXIT_OK


async def do_keys(target: Target, prefix: str) -> int:
    async with target.clone(subtree_of(prefix)) as clone:
        keys = sorted(clone.keys(prefix))
    _out(b"".join(f"{k}\n".encode("utf-8") for k in keys))
    return EXIT_OK


async def do_which(target: Target, key: str, as_json: bool) -> int:
    """The owning shard by the routing function, its servers in failover order, and the
    one that serves now (the one its snapshot came from)."""
    check_key_text(key)
    async with target.clone(subtree_of(key), only_key=key) as clone:
        cluster = clone.cluster
        spec = cluster.shards[cluster.shard_map.owner(key)]
        agent = clone.agent_of(key)
        active = agent.server.snapshot if agent is not None else None
    doc = {"key": key, "shard": spec.name, "index": spec.index,
           "servers": [s.snapshot for s in spec.servers],
           "relays": [r.snapshot for r in spec.relays], "active": active}
    if as_json:
        _out(json.dumps(doc).encode("utf-8") + b"\n")
    else:
        servers = ", ".join(f"{s} (active)" if s == active else s for s in doc["servers"])
        _out(f"{key}: shard {spec.name} (index {spec.index}): {servers}\n".encode("utf-8"))
    return EXIT_OK


def change_line(kind: str, key: str, value: bytes | None, seq: int, shard: str,
                as_json: bool) -> str:
    """One line of ``watch``: ``put KEY VALUE``, ``delete KEY``, ``synced SUBTREE``, or
    the same as one JSON object."""
    if as_json:
        doc = {"kind": kind, "key": key, "seq": seq, "shard": shard}
        if value is not None:
            doc["value"] = json_value(value)
        return json.dumps(doc, ensure_ascii=False)
    if kind == "put":
        return f"put {key} {show_value(value)}"
    if kind == "delete":
        return f"delete {key}"
    return f"synced {key}".rstrip()


async def do_watch(target: Target, subtree: str, as_json: bool, count: int | None) -> int:
    seen = 0
    async with target.clone(subtree_of(subtree)) as clone:
        async with clone.watch(subtree) as watch:
            async for change in watch:
                line = change_line(change.kind, change.key, change.value, change.seq,
                                   change.shard, as_json)
                _out(line.encode("utf-8") + b"\n")
                if change.kind != "synced" and watch.synced:
                    seen += 1  # a live change (the snapshot's items do not count)
                    if count is not None and seen >= count:
                        break
    return EXIT_OK


async def do_watch_from(target: Target, subtree: str, as_json: bool, count: int | None,
                        since: int) -> int:
    """``watch --from-seq S``: the changes after sequence S of the one shard that owns
    SUBTREE, from its active server's history (our resume extension of ICANHAZ), then
    live. Sequences are per shard, so SUBTREE must belong to one. The live SUB is
    subscribed before the resume is asked, and its updates are printed only past the
    resume's end: nothing is missed, nothing printed twice. A history that no longer
    holds S is an error, said in words (the server answers with a full snapshot)."""
    sub_b = subtree_of(subtree).encode("utf-8")
    async with target.clone(subtree_of(subtree)) as clone:
        if len(clone.shard_names) != 1:
            raise BadUsage(f"sequences are per shard, and {subtree!r} spans shards "
                           f"{', '.join(clone.shard_names)}: give a subtree one shard owns")
        agent = clone._agents[0]
        server, name = agent.server, agent.name
    ctx = zmq.Context()
    security = target.security(clone.cluster)
    live: list = []
    seen = [0]
    done = asyncio.get_running_loop().create_future()

    def emit(kind: str, key: bytes, value: bytes | None, seq: int) -> bool:
        """Print one change; True once ``count`` live changes were printed."""
        line = change_line(kind, key.decode("utf-8", "replace"), value, seq, name, as_json)
        _out(line.encode("utf-8") + b"\n")
        if kind != "synced" and end[0] is not None:  # a live change (not a resumed one)
            seen[0] += 1
        return count is not None and seen[0] >= count

    def emit_update(msg) -> bool:
        """A KVPUB or a resumed KVSYNC: an empty value is a delete."""
        return emit("put" if msg.value else "delete", msg.key, msg.value or None, msg.seq)

    end: list = [None]
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.subscribe(sub_b)
    if sub_b:
        sub.subscribe(chp.HUGZ)  # the welcome: the subscription is live
    security.connect_side(sub)
    sub.connect(server.publisher)
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    security.connect_side(dealer)
    dealer.connect(server.snapshot)
    subscribed = asyncio.get_running_loop().create_future()
    replies: asyncio.Queue = asyncio.Queue()

    def on_update(frames):
        if not subscribed.done():
            subscribed.set_result(None)
        try:
            msg = chp.decode_update(frames)
        except ValueError:
            return
        if not isinstance(msg, chp.Kvpub) or not msg.key.startswith(sub_b):
            return
        if end[0] is None:
            live.append(msg)
        elif msg.seq > end[0] and not done.done():
            if emit_update(msg):
                done.set_result(None)
            end[0] = msg.seq

    reader = AsyncSocket(sub, on_update, name=f"watch {server.publisher}")
    answers = AsyncSocket(dealer, replies.put_nowait, name=f"resume {server.snapshot}")
    try:
        async with asyncio.timeout(target.timeout_s):
            await subscribed  # the server's welcome HUGZ: nothing published is missed
            dealer.send_multipart(chp.icanhaz(sub_b, since=since))
            while True:
                msg = chp.decode_snapshot_liberal(await replies.get())
                if isinstance(msg, chp.Kthxbai):
                    break
                if msg.seq > since:
                    emit_update(msg)
        if msg.props == chp.FULL_AFTER_RESUME:
            raise NotCovered(f"shard {name}'s history no longer holds sequence {since} "
                             f"(it answered with a full snapshot at {msg.seq}): watch "
                             "without --from-seq")
        emit("synced", sub_b, None, msg.seq)
        end[0] = msg.seq
        for m in live:
            if m.seq > end[0] and not done.done():
                if emit_update(m):
                    return EXIT_OK
                end[0] = m.seq
        if count is not None and seen[0] >= count:
            return EXIT_OK
        await done
    except TimeoutError:
        raise Timeout(f"no resume from {server.snapshot} within {target.timeout_s} s",
                      what="snapshot") from None
    finally:
        reader.close()
        answers.close()
        ctx.destroy(linger=0)
    return EXIT_OK


class NotCovered(ClonemapError):
    """A resume asked for a sequence the server's history no longer holds."""


def trace_line(server: str, frames: list[bytes]) -> str:
    """One decoded line per message on a publisher (KVPUB, HUGZ, or what is wrong)."""
    stamp = time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
    try:
        msg = chp.decode_update(frames)
    except ValueError as exc:
        return f"{stamp} {server} BAD {exc}"
    if isinstance(msg, chp.Hugz):
        clock = chp.hugz_clock(msg)
        if clock is None:
            return f"{stamp} {server} HUGZ"
        return f"{stamp} {server} HUGZ ts={clock[0]:.6f} seq={clock[1]}"
    props = chp.parse_props(msg.props) if msg.props else {}
    what = "KVPUB" if msg.value else "KVPUB(delete)"
    return (f"{stamp} {server} {what} seq={msg.seq} key={msg.key.decode('utf-8', 'replace')}"
            f" uuid={msg.uuid.hex() or '-'} props={json.dumps(props, sort_keys=True)}"
            f" value={show_value(msg.value)}")


async def do_trace(target: Target, shard: str, count: int | None) -> int:
    ctx = zmq.Context()
    socks: list[AsyncSocket] = []
    try:
        cluster = await target.cluster(ctx)
        security = target.security(cluster)
        try:
            spec = cluster.shard(shard)
        except KeyError:
            names = ", ".join(s.name for s in cluster.shards)
            raise click.UsageError(f"no shard {shard!r} (the cluster has {names})") from None
        done = asyncio.get_running_loop().create_future()
        seen = [0]
        for server in spec.servers:
            sock = ctx.socket(zmq.SUB)
            sock.linger = 0
            sock.subscribe(b"")
            security.connect_side(sock)
            sock.connect(server.publisher)

            def on_message(frames, server=server):
                if done.done():
                    return
                _out(trace_line(server.publisher, frames).encode("utf-8") + b"\n")
                seen[0] += 1
                if count is not None and seen[0] >= count:
                    done.set_result(None)

            socks.append(AsyncSocket(sock, on_message, name=f"trace {server.publisher}"))
        click.echo(f"tracing shard {spec.name}: "
                   + ", ".join(s.publisher for s in spec.servers), err=True)
        await done
    finally:
        for s in socks:
            s.close()
        ctx.destroy(linger=0)
    return EXIT_OK


# ------------------------------------------------------------------ the command line

LONG_RUNNING = frozenset({"watch", "trace"})
"""Commands that run until stopped: their warnings (a failover, a reset) are shown."""


def quiet_logging(verbose: bool, long_running: bool) -> None:
    """stderr gets ``chp: <message>`` lines: every INFO and above with ``--verbose``,
    warnings and errors for a long-running command, nothing for a one-shot command (its
    failure is the one ``chp: error:`` line)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("chp: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else
                  logging.WARNING if long_running else logging.CRITICAL + 1)


def _value_of(value: str | None, hex_value: bool, path: str | None) -> bytes:
    if path is not None:
        if value is not None:
            raise click.UsageError("give VALUE or --file, not both")
        if path == "-":
            return sys.stdin.buffer.read()
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise click.UsageError(f"--file {path}: {exc.strerror}") from None
    if value is None:
        raise click.UsageError("missing VALUE (or --file PATH)")
    if hex_value:
        try:
            return binascii.unhexlify(value.removeprefix("0x"))
        except (binascii.Error, ValueError):
            raise click.UsageError(f"--hex: {value!r} is not an even number of hex digits") \
                from None
    return value.encode("utf-8")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--control", metavar="ENDPOINT", default=None,
              help="The supervisor's control endpoint (MDP cluster.map) [default: "
                   f"$CLONEMAP_CONTROL or {DEFAULT_CONTROL}].")
@click.option("--config", "-c", "config", metavar="FILE", default=None,
              help="A supervisor config: route with its plan, no supervisor needed.")
@click.option("--servers", "-s", multiple=True, metavar="tcp://H:P[,tcp://H:P2]",
              help="One shard per use: a server, or a comma-separated pair (primary,backup).")
@click.option("--timeout-s", type=click.FloatRange(min=0.05), default=DEFAULT_TIMEOUT_S,
              show_default=True, help="How long to wait for the cluster (and for an echo).")
@click.option("--keys", metavar="DIR", default=None,
              help="CURVE: the cluster's keys directory (client.key, client.key_secret, "
                   "server.key) [default: $CLONEMAP_KEYS, or the config's].")
@click.option("--via", type=click.Choice(["servers", "relays"]), default="servers",
              show_default=True,
              help="Read each shard through its relays (a shard without any: its servers).")
@click.option("--verbose", "-v", is_flag=True,
              help="Print the client's log on stderr (failovers, resumes, reconnections).")
@click.pass_context
def main(ctx: click.Context, control, config, servers, timeout_s, keys, via,
         verbose) -> None:
    """Read, write, dump, watch and trace a clonemap cluster."""
    quiet_logging(verbose, ctx.invoked_subcommand in LONG_RUNNING)
    try:
        ctx.obj = Target(control, config, servers, timeout_s, keys, via)
    except BadUsage as exc:
        click.echo(f"chp: error: {exc}", err=True)
        ctx.exit(EXIT_USAGE)


@main.command("get")
@click.argument("key")
@click.option("--hex", "mode", flag_value="hex", help="Print the value as hex digits.")
@click.option("--raw", "mode", flag_value="raw", help="Print exactly the value's bytes.")
@click.option("--json", "mode", flag_value="json",
              help="One JSON object: the value and its metadata (seq: the sequence that "
                   "last changed it, for --if-seq; expires; props; shard).")
@click.option("--output", "-o", "output", type=click.Choice(["text", "hex", "raw", "json"]),
              default=None, help="The same as --hex, --raw, --json (etcdctl's -w).")
@click.pass_obj
def get_command(target: Target, key: str, mode: str | None, output: str | None) -> None:
    """Print KEY's value (exit 6 if it is not there)."""
    run(target, do_get, key, output or mode or "text")


@main.command("set")
@click.argument("key")
@click.argument("value", required=False)
@click.option("--ttl", type=click.FloatRange(min=0), default=None,
              metavar="S", help="Expire after S seconds.")
@click.option("--hex", "hex_value", is_flag=True, help="VALUE is hex digits (binary values).")
@click.option("--file", "path", metavar="PATH", default=None,
              help="Take the value from a file ('-': stdin).")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the owning shard has published the update back.")
@click.option("--if-seq", "if_seq", type=click.IntRange(min=0), default=None, metavar="S",
              help="Only if KEY was last changed at sequence S (`chp get -o json` says "
                   "it); prints the new sequence; exit 8 on a conflict.")
@click.option("--create", is_flag=True,
              help="Only if KEY is absent; prints the new sequence; exit 8 if it exists.")
@click.pass_obj
def set_command(target: Target, key: str, value, ttl, hex_value, path, wait, if_seq,
                create) -> None:
    """Set KEY to VALUE."""
    run(target, do_set, key, _value_of(value, hex_value, path), ttl, wait, if_seq, create)


@main.command("del")
@click.argument("key")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the owning shard has published the delete back.")
@click.option("--prefix", "prefix", is_flag=True,
              help="KEY is a prefix: delete every key under it (needs --yes).")
@click.option("--yes", is_flag=True, help="With --prefix: really delete them.")
@click.option("--if-seq", "if_seq", type=click.IntRange(min=1), default=None, metavar="S",
              help="Only if KEY was last changed at sequence S; exit 8 on a conflict.")
@click.pass_obj
def del_command(target: Target, key: str, wait: bool, prefix: bool, yes: bool,
                if_seq: int | None) -> None:
    """Delete KEY (exit 6 if it is not there), or with --prefix every key under it."""
    if prefix:
        if if_seq is not None:
            raise click.UsageError("--if-seq goes with one KEY, not --prefix")
        run(target, do_del_prefix, key, yes)
    elif yes:
        raise click.UsageError("--yes goes with --prefix")
    else:
        run(target, do_set, key, None, None, wait, if_seq)


@main.command("dump")
@click.argument("subtree", default="")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (binary as {hex}).")
@click.option("--hex", "hex_all", is_flag=True, help="Every value as hex.")
@click.pass_obj
def dump_command(target: Target, subtree: str, as_json: bool, hex_all: bool) -> None:
    """Print every key under SUBTREE (a key prefix; default all), sorted."""
    run(target, do_dump, subtree, as_json, hex_all)


@main.command("keys")
@click.argument("prefix", default="")
@click.pass_obj
def keys_command(target: Target, prefix: str) -> None:
    """Print the keys under PREFIX (default all), sorted, one a line; no values."""
    run(target, do_keys, prefix)


@main.command("which")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.pass_obj
def which_command(target: Target, key: str, as_json: bool) -> None:
    """Print the shard that owns KEY, its servers (primary, backup) and which serves."""
    run(target, do_which, key, as_json)


@main.command("watch")
@click.argument("subtree", default="")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="Stop after this many live changes (default: until Ctrl-C).")
@click.option("--from-seq", "since", type=click.IntRange(min=0), default=None, metavar="S",
              help="Print the changes after sequence S of the shard owning SUBTREE (from "
                   "its history), then live; instead of the items.")
@click.pass_obj
def watch_command(target: Target, subtree: str, as_json: bool, count, since) -> None:
    """Print the items under SUBTREE, "synced", then every change, live."""
    if since is not None:
        run(target, do_watch_from, subtree, as_json, count, since)
    else:
        run(target, do_watch, subtree, as_json, count)


@main.command("trace")
@click.argument("shard")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="Stop after this many messages (default: until Ctrl-C).")
@click.pass_obj
def trace_command(target: Target, shard: str, count) -> None:
    """Print every message on SHARD's publishers (name or index), decoded."""
    run(target, do_trace, shard, count)


if __name__ == "__main__":
    main()
