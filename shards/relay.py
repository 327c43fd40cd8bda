"""A relay: a last-value cache that fans one shard out to many clients.

To the shard, a relay is one more subscriber. It follows the pair's active server the
way a passive server does (``shards.replica.Follower``: the TTL table, a snapshot, then
the live stream with the shard's own sequences). To its clients it is a standalone 12/CHP
server on its own port base, P..P+2:

* P+1: every update it applies is published again, with the shard's sequence, UUID and
  properties;
* P: ``ICANHAZ?`` is answered from its copy, with the same point-in-time cursors, flow
  control and fair slots as a server's, and resumes from its own history;
* P+2: KVSETs are checked and forwarded to the collectors of both servers of the pair.

Its HUGZ name the shard's generation and routing. It says ``serving=0`` until its first
copy is installed, so clients that list two relays ask the other one meanwhile.

**Upstream failover.** The relay follows one server of the pair. It moves to the other
when the followed server says ``serving=0`` (it is passive), or after ``silence_timeout_s``
without a word. On the new server it first asks for a *resume* from its own sequence and
generation. If the new active covers it, the relay publishes the missed updates in order,
so its clients see the sequence continue: no snapshot, no herd. Otherwise it takes a full
copy. Its clients then see a gap in the sequence and take a snapshot from the relay,
never from the shard. If the shard's map was lost (a new generation), its clients see
one reset event.

The relay runs no TTL timer of its own: the shard publishes its expiries as deletes.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys

import click
import zmq

from shards import replica_machine as rm
from shards.common import zio
from shards.common.errors import ProtocolError
from shards.common.proto import chp
from shards.pending import PendingTable
from shards.replica import Follower, expires_of
from shards.server import ServerConfig, ShardServer
from shards.store import Store
from shards.serve import bind_and_serve, parse_cpus, routing_arg
from shards.common.memory import return_large_frees
from shards.common import timing
from shards.common.errors import ConfigError, Exit
from shards.common.security import Security
from shards.common.timing import HEARTBEAT_S
from shards.history import MAX_BYTES as HISTORY_BYTES, MAX_UPDATES as HISTORY_UPDATES

log = logging.getLogger("shards.relay")

SYNC_TIMEOUT_S = 5.0
TICK_S = 0.1


class RelayFollower(Follower):
    """A ``Follower`` that can also resume (ask only for the updates after the relay's
    sequence) and that tells the relay when its server says it does not serve."""

    def __init__(self, relay: "RelayServer", host: str, port: int, *, sync_timeout_s: float):
        super().__init__(relay, host, port, sync_timeout_s=sync_timeout_s)
        self._resume: dict | None = None
        self.counters.update(resumes=0, resume_updates=0, resumes_refused=0)

    # ---------------------------------------------------------------- the stream
    def on_update(self, frames: list[bytes]) -> None:
        if (len(frames) == 5 and frames[0] == chp.HUGZ and frames[3]
                and b"serving=0" in frames[3]):
            self.counters["hugz_not_serving"] += 1
            self.owner.upstream_not_serving(self)
            return
        resume = self._resume
        if resume is None:
            super().on_update(frames)
            return
        try:
            msg = chp.decode_update(frames, self.owner.config.limits)
        except ProtocolError as err:
            self.owner.drops.drop("peer_" + err.reason, f"from {self.updates_endpoint}: {err}")
            return
        self.last_heard = self.owner.loop.time()
        if isinstance(msg, chp.Kvpub):
            resume["live"].append(msg)

    # ---------------------------------------------------------------- resume
    def resume(self, since: int, generation: str, now: float) -> None:
        """Ask for the updates after ``since`` (of ``generation``); live updates are
        buffered meanwhile. A refusal or a timeout falls back to a full sync."""
        sock = self.owner.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self.owner.security.connect_side(sock)
        sock.connect(self.snapshot_endpoint)
        dealer = zio.AsyncSocket(sock, self._on_resume_reply, batch=1024,
                                 loop=self.owner.loop, name="upstream resume")
        self._resume = {"dealer": dealer, "since": since, "items": [], "live": [],
                        "at": now}
        dealer.send(chp.icanhaz(b"", since, generation))
        log.info("shard %s: relay resumes after %d from %s", self.owner.shard, since,
                 self.snapshot_endpoint)

    def _on_resume_reply(self, frames: list[bytes]) -> None:
        resume = self._resume
        if resume is None:
            return
        resume["at"] = self.owner.loop.time()
        try:
            msg = chp.decode_snapshot(frames, self.owner.config.limits, strict=False)
        except ProtocolError as err:
            self.owner.drops.drop("peer_" + err.reason, f"resume: {err}")
            self._give_up_resume("a malformed reply")
            return
        if isinstance(msg, chp.Kvsync):
            resume["items"].append(chp.Kvpub(msg.key, msg.seq, msg.uuid, msg.props,
                                             msg.value))
            return
        if msg.props != chp.RESUMED:
            self.counters["resumes_refused"] += 1
            self._give_up_resume("the server does not hold every update after "
                                 f"{resume['since']}")
            return
        self._end_resume()
        store = self.owner.store
        for m in resume["items"] + resume["live"]:
            verdict = rm.check_seq(store.seq, m.seq)
            if verdict == rm.DUPLICATE:
                continue
            if verdict == rm.GAP:
                log.warning("shard %s: relay resume: gap %d..%d", self.owner.shard,
                            store.seq, m.seq)
                self.start_sync(self.owner.loop.time())
                return
            self.owner.apply_upstream(m)
        self.counters["resumes"] += 1
        self.counters["resume_updates"] += len(resume["items"])
        self.state = dataclasses.replace(self.state, phase=rm.LIVE, step="", seq=store.seq)
        log.info("shard %s: relay resumed with %d updates, at %d", self.owner.shard,
                 len(resume["items"]), store.seq)

    def _end_resume(self) -> None:
        resume, self._resume = self._resume, None
        if resume is not None:
            resume["dealer"].close(linger=0)

    def _give_up_resume(self, why: str) -> None:
        log.info("shard %s: relay resume not possible (%s): full sync", self.owner.shard, why)
        self._end_resume()
        self.start_sync(self.owner.loop.time())

    def on_tick(self, now: float) -> None:
        resume = self._resume
        if resume is not None and now - resume["at"] > self.sync_timeout_s:
            self._give_up_resume(f"no reply for {self.sync_timeout_s:g} s")
            return
        super().on_tick(now)

    def close(self) -> None:
        self._end_resume()
        super().close()

    def stats(self) -> dict:
        return {**super().stats(), "resuming": self._resume is not None}


class RelayServer(ShardServer):
    """The relay (see the module doc): a ``ShardServer`` whose map follows a shard."""

    DECIDES_WRITES = False
    """It forwards KVSETs; the shard's active decides (and answers) conditional writes,
    so a relay does not say ``cas=1``."""

    def __init__(self, config: ServerConfig, *, upstream: list[tuple[str, int]],
                 shard: str = "0", name: str = "relay", silence_timeout_s: float = 3.0,
                 sync_timeout_s: float = SYNC_TIMEOUT_S):
        if not upstream:
            raise ValueError("a relay needs the shard's servers (--upstream)")
        super().__init__(config, role=name)
        self.shard = shard
        self.upstream = list(upstream)
        self.silence_timeout_s = silence_timeout_s
        self.sync_timeout_s = sync_timeout_s
        self.pending = PendingTable()  # the Follower confirms into it; unused here
        self.follower: RelayFollower | None = None
        self.following = 0
        self._followed_at = 0.0
        self._tick_handle: asyncio.TimerHandle | None = None
        self._forward: list[zmq.Socket] = []
        self.first_copy = asyncio.Event()
        """Set once the first copy of the shard's map is installed (READY then)."""
        self.relay_counters = {"upstream_switches": 0, "full_syncs": 0, "forwarded": 0,
                               "forward_dropped": 0}

    # ---------------------------------------------------------------- life
    def start(self) -> None:
        super().start()  # role "relay": not active until the first copy is installed
        for host, port in self.upstream:
            sock = self._socket(zmq.PUB)
            sock.setsockopt(zmq.SNDHWM, self.config.collect_rcvhwm)
            self.security.connect_side(sock)
            sock.connect(f"tcp://{host}:{port + 2}")
            self._forward.append(sock)
        self._follow(0)
        self._tick_handle = self.loop.call_later(TICK_S, self._tick)

    def close(self) -> None:
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        if self.follower is not None:
            self.follower.close()
            self.follower = None
        for sock in self._forward:
            sock.close(linger=0)
        self._forward = []
        super().close()

    def _follow(self, index: int) -> None:
        if self.follower is not None:
            self.follower.close()
        self.following = index
        host, port = self.upstream[index]
        self.follower = RelayFollower(self, host, port, sync_timeout_s=self.sync_timeout_s)
        self.follower.open()
        now = self.loop.time()
        self._followed_at = now
        if self.active and self.generation:
            self.follower.resume(self.store.seq, self.generation, now)
        else:
            self.follower.start_sync(now)

    def _switch(self, why: str) -> None:
        if len(self.upstream) < 2:
            return
        new = (self.following + 1) % len(self.upstream)
        self.relay_counters["upstream_switches"] += 1
        log.warning("shard %s: relay moves upstream from %s:%d to %s:%d (%s)", self.shard,
                    *self.upstream[self.following], *self.upstream[new], why)
        self._follow(new)

    def upstream_not_serving(self, follower: RelayFollower) -> None:
        if follower is self.follower:
            self.loop.call_soon(self._switch_if, follower, "it says it does not serve")

    def _switch_if(self, follower: RelayFollower, why: str) -> None:
        if follower is self.follower:
            self._switch(why)

    def _tick(self) -> None:
        self._tick_handle = self.loop.call_later(TICK_S, self._tick)
        follower = self.follower
        if follower is None:
            return
        now = self.loop.time()
        follower.on_tick(now)
        heard = max(follower.last_heard, self._followed_at)
        if now - heard > self.silence_timeout_s:
            self._switch(f"silent for {now - heard:.1f} s")

    # ---------------------------------------------------------------- serving
    def _arm_ttl(self) -> None:
        """No TTL timer: the shard publishes its expiries as deletes."""

    def on_ttl_tick(self) -> None:
        self._ttl_handle = None

    def on_collect(self, frames: list[bytes]) -> None:
        """A client's KVSET: checked, then forwarded to both servers of the pair."""
        try:
            chp.decode_kvset(frames, self._limits)
        except ProtocolError as err:
            self.drops.drop(err.reason, str(err))
            return
        for sock in self._forward:
            try:
                zio.send_frames(sock, frames)
                self.relay_counters["forwarded"] += 1
            except zmq.Again:
                self.relay_counters["forward_dropped"] += 1
                self.drops.drop("forward_hwm", "upstream collector at the high-water mark")

    # ---------------------------------------------------------------- the Follower's owner
    def reset_pending(self) -> None:
        self.pending.drain()

    def log_applied(self, seq: int, key: bytes, value: bytes, expiry_s: float | None) -> None:
        """A relay keeps no files."""

    def replicated(self, msg: chp.Kvpub) -> None:
        """An update of the shard, applied with its sequence: published to our clients."""
        size = len(msg.key) + len(msg.props) + len(msg.value)
        if size > self._fast_limit:
            self._lower_mark(self.marks.published(size))
        if self._remember is not None:
            self._remember(msg.seq, msg.key, msg.uuid, msg.props, msg.value)
        zio.send_frames5(self._pub, msg.key, chp.pack_seq(msg.seq), msg.uuid, msg.props,
                         msg.value)

    def apply_upstream(self, msg: chp.Kvpub) -> None:
        """A resumed update: applied and published like a live one."""
        expiry_s = expires_of(msg.props) if msg.value else None
        self.store.apply(msg.key, msg.value, expiry_s)
        self.replicated(msg)

    def replace_store(self, store: Store, generation: str = "",
                      history: tuple[tuple[int, int], ...] = (), uuids: list = ()) -> None:
        """A full copy from upstream. The first one makes the relay serve; a later one
        (a resume was not possible, or a gap) replaces the map: our clients see the
        sequence jump and take a snapshot from us (or a reset, for a new generation)."""
        old_seq = self.store.seq
        self.store = store
        self.recent.reset(store.seq)
        self.relay_counters["full_syncs"] += 1
        if generation and generation != self.generation:
            self.generation = generation
        if not self.active:
            self.set_active(True)
            self.first_copy.set()
        elif store.seq != old_seq:
            log.info("shard %s: relay map replaced at %d (was %d)", self.shard, store.seq,
                     old_seq)

    def stats(self) -> dict:
        out = super().stats()
        out.update({
            "shard": self.shard,
            "upstream": "%s:%d" % self.upstream[self.following],
            "replica": self.follower.stats() if self.follower is not None else None,
            **self.relay_counters,
        })
        return out


# ==================================================================== command line

def _upstream_arg(ctx, param, value: str) -> list[tuple[str, int]]:
    out = []
    for part in value.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65532:
            raise click.BadParameter(f"{part!r}: expected HOST:PORT (a server's base port P)")
        out.append((host, int(port)))
    if not 1 <= len(out) <= 2:
        raise click.BadParameter("one server, or the pair as PRIMARY,BACKUP")
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--port", type=click.IntRange(1, 65533), required=True,
              help="The relay's base port P (it binds P..P+2, as a server).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--upstream", required=True, callback=_upstream_arg,
              metavar="HOST:P[,HOST:P2]", help="The shard's servers: primary,backup.")
@click.option("--shard", default="0", show_default=True, help="The shard's name.")
@click.option("--name", default="relay", show_default=True,
              help="This relay's name (its control service is shard.<SHARD>.<NAME>).")
@click.option("--routing", "shard_map", default=None, callback=routing_arg,
              help="The cluster's routing (JSON, as for a server): HUGZ name it.")
@click.option("--shard-index", type=click.IntRange(0), default=None)
@click.option("--heartbeat-s", type=click.FloatRange(0.01, 3600), default=HEARTBEAT_S,
              show_default=True)
@click.option("--silence-timeout-s", type=click.FloatRange(0.05), default=None,
              help="Move to the other server after this long without a word "
                   "[default: 3 x heartbeat].")
@click.option("--history-updates", type=click.IntRange(0), default=HISTORY_UPDATES,
              show_default=True, help="Recent updates kept for our clients' resumes.")
@click.option("--history-bytes", type=click.IntRange(0), default=HISTORY_BYTES,
              show_default=True,
              help="... and at most this many bytes of them (0: no history).")
@click.option("--cpus", callback=parse_cpus, default=None)
@click.option("--control", default=None, help="Register stats at this MDP broker.")
@click.option("--parent-pid", type=int, default=None)
@click.option("--keys-dir", type=click.Path(file_okay=False), default=None,
              help="CURVE on every socket, with the cluster's server keys.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
def main(port, host, upstream, shard, name, shard_map, shard_index, heartbeat_s,
         silence_timeout_s, history_updates, history_bytes, cpus, control, parent_pid,
         keys_dir, log_level) -> None:
    """Run a relay: a CHP server whose map follows one shard (see shards.relay)."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    if (shard_map is None) != (shard_index is None):
        raise click.UsageError("--routing and --shard-index go together")
    return_large_frees()
    if cpus is not None:
        import psutil  # pin before the zmq context starts its I/O thread

        psutil.Process().cpu_affinity(cpus)
    config = ServerConfig(port=port, host=host, heartbeat_s=heartbeat_s,
                          history_updates=history_updates, history_bytes=history_bytes,
                          shard_map=shard_map,
                          shard_index=shard_index or 0)
    relay = RelayServer(config, upstream=upstream, shard=shard, name=name,
                        silence_timeout_s=silence_timeout_s or timing.silence_timeout_s(
                            heartbeat_s))
    if keys_dir is not None:
        try:
            relay.security = Security.load(keys_dir, "server")
        except ConfigError as exc:
            click.echo(f"relay: {exc}", err=True)
            sys.exit(Exit.USAGE)
    bind_and_serve(relay, shard, control, parent_pid, "relay")


if __name__ == "__main__":
    main()
