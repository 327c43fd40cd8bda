"""A relay: a last-value cache that fans one shard out to many clients.

To the shard, a relay is one more subscriber. It follows the pair's active server the
way a passive server does (``clonemap.shards.replica.Follower``: the TTL table, a snapshot, then
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

from clonemap.shards import replica_machine as rm
from clonemap.shards.common import zio
from clonemap.shards.common.endpoints import MAX_IO_THREADS
from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.proto import chp
from clonemap.shards.replica import Follower, expires_of
from clonemap.shards.server import ShardServer
from clonemap.shards.server_config import ServerConfig
from clonemap.shards.store import Store
from clonemap.shards.serve import bind_and_serve, load_access, parse_cpus, routing_arg
from clonemap.shards.common.memory import return_large_frees
from clonemap.shards.common import timing
from clonemap.shards.common.timing import HEARTBEAT_S
from clonemap.shards.history import MAX_BYTES as HISTORY_BYTES, MAX_UPDATES as HISTORY_UPDATES

log = logging.getLogger("clonemap.shards.relay")

SYNC_TIMEOUT_S = 5.0
TICK_S = 0.1


class RelayFollower(Follower):
    """A ``Follower`` that can also resume (ask only for the updates after the relay's
    sequence) and that tells its relay when its server does not serve
    (``Relay.upstream_not_serving``) and in which term a resume continued the map
    (``Relay.resumed_in``)."""

    def __init__(self, relay: "Relay", host: str, port: int, *, sync_timeout_s: float):
        super().__init__(relay, relay.server, host, port, shard=relay.shard,
                         sync_timeout_s=sync_timeout_s)
        self.relay = relay
        """The relay (also this follower's sink)."""
        self._resume: dict | None = None
        self.counters.update(resumes=0, resume_updates=0, resumes_refused=0)

    # ---------------------------------------------------------------- the stream
    def on_update(self, frames: list[bytes]) -> None:
        if (len(frames) == 5 and frames[0] == chp.HUGZ and frames[3]
                and b"serving=0" in frames[3]):
            self.counters["hugz_not_serving"] += 1
            self.relay.upstream_not_serving(self)
            return
        resume = self._resume
        if resume is None:
            super().on_update(frames)
            return
        try:  # (a staged update under its prefix: ``Follower.on_update``)
            msg = chp.decode_update(chp.unstaged(frames), self.reactor.config.limits)
        except ProtocolError as err:
            self.reactor.drops.drop("peer_" + err.reason,
                                    f"from {self.updates_endpoint}: {err}")
            return
        self.last_heard = self.reactor.loop.time()
        if isinstance(msg, chp.Kvpub):
            resume["live"].append(msg)

    # ---------------------------------------------------------------- resume
    def resume(self, since: int, generation: str, now: float) -> None:
        """Ask for the updates after ``since`` (of ``generation``); live updates are
        buffered meanwhile. A refusal or a timeout falls back to a full sync."""
        sock = self.reactor.sockets.connect(zmq.DEALER, self.snapshot_endpoint)
        dealer = zio.AsyncSocket(sock, self._on_resume_reply, batch=1024,
                                 loop=self.reactor.loop, name="upstream resume")
        self._resume = {"dealer": dealer, "since": since, "items": [], "live": [],
                        "at": now}
        dealer.send(chp.icanhaz(b"", since, generation, term=self.relay.upstream_term))
        log.info("shard %s: relay resumes after %d from %s", self.shard, since,
                 self.snapshot_endpoint)

    def _on_resume_reply(self, frames: list[bytes]) -> None:
        resume = self._resume
        if resume is None:
            return
        resume["at"] = self.reactor.loop.time()
        try:
            msg = chp.decode_snapshot(frames, self.reactor.config.limits, strict=False)
        except ProtocolError as err:
            self.reactor.drops.drop("peer_" + err.reason, f"resume: {err}")
            self._give_up_resume("a malformed reply")
            return
        if isinstance(msg, chp.Kvsync):
            resume["items"].append(chp.Kvpub(msg.key, msg.seq, msg.uuid, msg.props,
                                             msg.value))
            return
        reply = chp.kthxbai_info(msg.props)
        if reply.resumed is not True:
            self.counters["resumes_refused"] += 1
            self._give_up_resume("the server does not hold every update after "
                                 f"{resume['since']}")
            return
        self._end_resume()
        self.relay.resumed_in(reply.term or 0)
        sink = self.sink
        for m in resume["items"] + resume["live"]:
            verdict = rm.check_seq(sink.seq, m.seq)
            if verdict == rm.DUPLICATE:
                continue
            if verdict == rm.GAP:
                log.warning("shard %s: relay resume: gap %d..%d", self.shard, sink.seq,
                            m.seq)
                self.start_sync(self.reactor.loop.time())
                return
            sink.apply(m, expires_of(m.props) if m.value else None)
        self.counters["resumes"] += 1
        self.counters["resume_updates"] += len(resume["items"])
        self.state = dataclasses.replace(self.state, phase=rm.LIVE, step="", seq=sink.seq)
        log.info("shard %s: relay resumed with %d updates, at %d", self.shard,
                 len(resume["items"]), sink.seq)

    def _end_resume(self) -> None:
        resume, self._resume = self._resume, None
        if resume is not None:
            resume["dealer"].close(linger=0)

    def _give_up_resume(self, why: str) -> None:
        log.info("shard %s: relay resume not possible (%s): full sync", self.shard, why)
        self._end_resume()
        self.start_sync(self.reactor.loop.time())

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


def relay_server(config: ServerConfig, **options) -> ShardServer:
    """A relay: the reactor with a ``Relay`` role."""
    return ShardServer(config, Relay(**options))


class Relay:
    """The relay's role (see the module doc): a reactor whose map follows a shard. Its
    clients' KVSETs go to the shard; its updates come from an upstream follower, into
    this role as its ``ReplicaSink``."""

    decides_writes = False
    """It forwards KVSETs; the shard's active decides (and answers) conditional writes,
    so a relay does not say ``cas=1``."""
    expires_keys = False
    """No TTL timer: the shard publishes its expiries as deletes."""
    gates_publish = False

    def __init__(self, *, upstream: list[tuple[str, int]], shard: str = "0",
                 name: str = "relay", silence_timeout_s: float = 3.0,
                 sync_timeout_s: float = SYNC_TIMEOUT_S):
        if not upstream:
            raise ValueError("a relay needs the shard's servers (--upstream)")
        self.name = name
        self.shard = shard
        self.upstream = list(upstream)
        self.silence_timeout_s = silence_timeout_s
        self.sync_timeout_s = sync_timeout_s
        self.server: ShardServer | None = None
        self.follower: RelayFollower | None = None
        self.following = 0
        self._followed_at = 0.0
        self._tick_handle: asyncio.TimerHandle | None = None
        self._forward: list[zmq.Socket] = []
        self.first_copy = asyncio.Event()
        """Set once the first copy of the shard's map is installed (READY then)."""
        self.relay_counters = {"upstream_switches": 0, "full_syncs": 0, "forwarded": 0,
                               "forward_dropped": 0}
        self.upstream_term = 0
        """The Binary Star term of the upstream active whose stream the map follows."""
        self.terms: set[int] = {0}
        """Every upstream term since the last full copy: the map holds only updates of
        those terms' maps, so a client of any of them may resume here."""

    # ---------------------------------------------------------------- the reactor's parts
    def attach(self, server: ShardServer) -> None:
        self.server = server
        self.on_snapshot_request = server.on_snapshot_request  # served as a server's

    def bind(self) -> None:
        """Nothing beyond P..P+2 (the upstream sockets connect in ``start``)."""

    def link_options(self, sock: zmq.Socket) -> None:
        """Plain sockets (no ZMTP heartbeats: a relay runs beside its shard)."""

    def admit_snapshot_request(self) -> bool:
        return self.server.active  # from its first copy on

    def serving(self) -> bool:
        return self.server.active

    def term(self) -> int:
        return self.upstream_term

    def resumable(self, term: int, since: int) -> bool:
        """Since its last full copy the relay's map is one upstream stream, resumed
        across terms only where the upstream active held all of it (its ``resume=1``):
        a client of any of those terms holds nothing the map lacks."""
        return term in self.terms

    def resumed_in(self, term: int) -> None:
        """The upstream active (of ``term``) resumed the relay: its map continues."""
        self.upstream_term = term
        self.terms.add(term)

    # ---------------------------------------------------------------- life
    def start(self) -> None:
        """After the reactor started: not active until the first copy is installed."""
        server = self.server
        for host, port in self.upstream:
            sock = server.sockets.connect(zmq.PUB, f"tcp://{host}:{port + 2}",
                                          ((zmq.SNDHWM, server.config.collect_rcvhwm),))
            self._forward.append(sock)
        self._follow(0)
        self._tick_handle = server.loop.call_later(TICK_S, self._tick)

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

    def _follow(self, index: int) -> None:
        if self.follower is not None:
            self.follower.close()
        self.following = index
        host, port = self.upstream[index]
        self.follower = RelayFollower(self, host, port, sync_timeout_s=self.sync_timeout_s)
        self.follower.open()
        server = self.server
        now = server.loop.time()
        self._followed_at = now
        if server.active and server.generation:
            self.follower.resume(server.store.seq, server.generation, now)
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
            self.server.loop.call_soon(self._switch_if, follower, "it says it does not serve")

    def _switch_if(self, follower: RelayFollower, why: str) -> None:
        if follower is self.follower:
            self._switch(why)

    def _tick(self) -> None:
        loop = self.server.loop
        self._tick_handle = loop.call_later(TICK_S, self._tick)
        follower = self.follower
        if follower is None:
            return
        now = loop.time()
        follower.on_tick(now)
        heard = max(follower.last_heard, self._followed_at)
        if now - heard > self.silence_timeout_s:
            self._switch(f"silent for {now - heard:.1f} s")

    # ---------------------------------------------------------------- its clients' writes
    def on_collect(self, frames: list[bytes]) -> None:
        """A client's KVSET: checked, then forwarded to both servers of the pair."""
        try:
            chp.decode_kvset(frames, self.server.config.limits)
        except ProtocolError as err:
            self.server.drops.drop(err.reason, str(err))
            return
        for sock in self._forward:
            try:
                zio.send_frames(sock, frames)
                self.relay_counters["forwarded"] += 1
            except zmq.Again:
                self.relay_counters["forward_dropped"] += 1
                self.server.drops.drop("forward_hwm", "upstream collector at the high-water "
                                                      "mark")

    # ---------------------------------------------------------------- the copy (its sink)
    @property
    def seq(self) -> int:
        return self.server.store.seq

    def apply(self, msg: chp.Kvpub, expiry_s: float | None) -> None:
        """An update of the shard, applied with its sequence: published to our clients."""
        server = self.server
        server.store.apply(msg.key, msg.value, expiry_s)
        staged = bool(msg.props) and chp.STAGED in msg.props
        if staged:  # a key a move stages on the shard: not to our clients either
            server.note_staged(msg.key, msg.value)
        server.publish(msg.seq, msg.key, msg.uuid, msg.props, msg.value, staged=staged)

    def staged_ranges(self, frames: list[bytes]) -> None:
        """The shard's HUGZ that names staged sequences: on to our clients, after them."""
        self.server.publish_raw(frames)

    def install(self, store: Store, generation: str = "",
                history: tuple[tuple[int, int], ...] = (), uuids: list = ()) -> None:
        """A full copy from upstream. The first one makes the relay serve; a later one
        (a resume was not possible, or a gap) replaces the map: our clients see the
        sequence jump and take a snapshot from us (or a reset, for a new generation)."""
        server = self.server
        old_seq = server.store.seq
        server.store = store
        server.recent.reset(store.seq)
        self.relay_counters["full_syncs"] += 1
        self.upstream_term = history[-1][0] if history else 0
        self.terms = {self.upstream_term}
        if generation and generation != server.generation:
            server.generation = generation
        if not server.active:
            server.set_active(True)
            self.first_copy.set()
        elif store.seq != old_seq:
            log.info("shard %s: relay map replaced at %d (was %d)", self.shard, store.seq,
                     old_seq)

    def stats(self) -> dict:
        return {
            "shard": self.shard,
            "upstream": "%s:%d" % self.upstream[self.following],
            "replica": self.follower.stats() if self.follower is not None else None,
            "upstream_term": self.upstream_term, "terms": sorted(self.terms),
            **self.relay_counters,
        }


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
@click.option("--io-threads", type=click.IntRange(1, MAX_IO_THREADS), default=1, show_default=True,
              help="libzmq I/O threads: the relay's clients' connections are spread over them.")
@click.option("--control", default=None, help="Register stats at this MDP broker.")
@click.option("--parent-pid", type=int, default=None)
@click.option("--keys-dir", type=click.Path(file_okay=False), default=None,
              help="CURVE on every socket, with the cluster's server keys.")
@click.option("--rights", type=click.Path(dir_okay=False, exists=True), default=None,
              help="With --keys-dir: enforce the named identities' read and write rights "
                   "from this file (what `supervisor start` writes; see supervisor/README.md, "
                   "Access control). Default: every admitted peer holds every right.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
def main(port, host, upstream, shard, name, shard_map, shard_index, heartbeat_s,
         silence_timeout_s, history_updates, history_bytes, cpus, io_threads, control,
         parent_pid, keys_dir, rights, log_level) -> None:
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
                          shard_map=shard_map, io_threads=io_threads,
                          shard_index=shard_index or 0)
    relay = relay_server(config, upstream=upstream, shard=shard, name=name,
                         silence_timeout_s=silence_timeout_s or timing.silence_timeout_s(
                             heartbeat_s))
    load_access(relay, keys_dir, rights, "relay")
    bind_and_serve(relay, shard, control, parent_pid, "relay")


if __name__ == "__main__":
    main()
