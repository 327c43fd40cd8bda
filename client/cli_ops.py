"""What each ``chp`` command does (``clonemap.client.cli`` parses its options): one coroutine per
command, run by ``clonemap.client.cli_target.run`` against a ``Target``; each returns its exit code."""
from __future__ import annotations

import asyncio
import json
import time

import click
import zmq

from clonemap.shards.common.errors import ClonemapError, Timeout
from clonemap.shards.common.proto import chp
from clonemap.shards.common.zio import AsyncSocket
from clonemap.client.write_checks import check_write
from clonemap.client.cli_target import (EXIT_OK, BadUsage, NotFound, Target, _out, check_key_text,
                               json_value, show_value, subtree_of)


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


async def do_whoami(target: Target, as_json: bool) -> int:
    """The presented identity and its rights, from the supervisor (``cluster.whoami``)."""
    from clonemap.client.router import fetch_rights

    if target.servers:
        raise BadUsage("whoami asks the supervisor: give --control or --config, not "
                       "--servers")
    cluster = None
    endpoint = target.control
    if target.config:
        ctx = zmq.Context()
        try:
            cluster = await target.cluster(ctx)
        finally:
            ctx.destroy(linger=0)
        endpoint = cluster.control
    else:
        target.check_listening()
    doc = await fetch_rights(endpoint, timeout_s=target.timeout_s / 2,
                             security=target.security(cluster))
    if as_json:
        _out(json.dumps(doc, sort_keys=True).encode("utf-8") + b"\n")
    else:
        role = f" (role {doc['role']})" if doc.get("role") else ""
        enforced = "" if doc.get("enforced") else " (rights not enforced by this cluster)"
        _out(f"{doc['identity']}{role}: {doc['rights']}{enforced}\n".encode("utf-8"))
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
        agent = clone.agents[0]
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
        if chp.kthxbai_info(msg.props).resumed is False:
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


