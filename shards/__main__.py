"""``python -m clonemap.shards --port P [--host H] ...``: run one 12/CHP shard server.

    python -m clonemap.shards --port P                               standalone (active at once)
    python -m clonemap.shards --port P  --primary --peer HOST:P2     Binary Star primary
    python -m clonemap.shards --port P2 --backup  --peer HOST:P      Binary Star backup
    ... [--shard NAME] [--control tcp://HOST:PORT] [--parent-pid PID]
    ... [--routing JSON --shard-index I]                    drop keys shard I does not own

Prints ``READY shard host=H port=P pid=N role=primary|backup|standalone`` on stdout once
P..P+2 (and P+3 for a pair) are bound. ``--control`` embeds an MDP/0.2 worker for the
service ``shard.<NAME>.<ROLE>`` whose FINAL body is the stats as JSON. ``--parent-pid``:
exit (0) when that process is gone, checked every ``PARENT_POLL_S``. ``--routing`` (the
cluster map's ``routing`` document, ``ShardMap.describe()``, as JSON text or ``@FILE``)
with ``--shard-index``: KVSETs for keys this shard does not own are dropped and counted
``not_owner``; without it the server owns every key.
Exit codes: 0 after SIGINT/SIGTERM or when the parent is gone, 1 on a fatal Binary Star
error (dual active/passive/primary/backup: one line on stderr, logged "FATAL") or a
standalone server's unreadable data directory, 3 if a port is taken (one line on stderr
naming the endpoint), 2 on bad arguments (click), 7 (``Exit.DISK``) on a disk error
(``DISK_ERROR ...`` on stdout for the supervisor, one line on stderr).
"""
from __future__ import annotations

import errno
import faulthandler
import logging
import os
import shutil
import sys
import time

import click

from clonemap.shards.common.endpoints import MAX_IO_THREADS
from clonemap.shards.common.errors import ConfigError, Exit, os_error_text
from clonemap.shards.common.memory import return_large_frees
from clonemap.shards import coord, streams
from clonemap.shards.pair import BinaryStar
from clonemap.shards.pending import MAX_AGE_S, MAX_ENTRIES
from clonemap.shards.common.proto import chp
from clonemap.shards.byte_marks import SUBSCRIBER_HELD_BYTES, WRITER_HELD_BYTES
from clonemap.shards.history import MAX_BYTES as HISTORY_BYTES, MAX_UPDATES as HISTORY_UPDATES
from clonemap.shards.serve import (bind_and_serve, disk_exit, load_access, parse_cpus, peer_arg,
                                   routing_arg, shard_arg)
from clonemap.shards.common.timing import HEARTBEAT_S
from clonemap.shards.server import ShardServer
from clonemap.shards.server_config import (CLOCK_S, COLLECT_BATCH, COLLECT_RCVHWM, DEDUP_BYTES, DEDUP_S,
                                  MAX_ACTIVE_SNAPSHOTS, PUB_SNDHWM, SNAPSHOT_CHUNK,
                                  SNAPSHOT_HELD_BYTES, SNAPSHOT_SNDHWM, SNAPSHOT_STALL_S,
                                  ServerConfig)

log = logging.getLogger("clonemap.shards")
_DEFAULT = chp.Limits()
def _recover(server: ShardServer, shard: str, data_dir: str, fsync: str, settle: bool,
             compact_min_bytes: int, compact_ratio: float, min_free_bytes: int) -> None:
    """Load the persisted map before binding (the same map, sequence, TTL instants,
    generation and, for a pair server, Binary Star term), then log every update.

    A disk error (reading, truncating a torn tail, opening the new segment) exits with
    ``Exit.DISK`` like one while serving. A directory that cannot be read
    (``CorruptLog``): a standalone server exits 1 naming the file and offset (nothing
    else holds its map); a Binary Star server moves the files aside and starts empty,
    serving only after it has copied its peer's map (``persist.quarantine``), so one
    bad disk never keeps a shard down while its peer holds the map."""
    from clonemap.shards import persist
    from clonemap.shards.persist import recovery

    where = (shard, server.role.name, server.config.port)
    pair = server.role if isinstance(server.role, BinaryStar) else None
    try:
        try:
            got = persist.recover(data_dir)
        except persist.CorruptLog as exc:
            if pair is None:
                click.echo(f"shards: cannot recover the map from {data_dir}: {exc}",
                           err=True)
                sys.exit(Exit.FAILED)
            moved = recovery.quarantine(data_dir, str(exc))
            log.critical("recovery: %s cannot be read (%s); its files were moved to %s; "
                         "this server starts empty and serves only once it has copied "
                         "its peer's map", data_dir, exc, moved)
            print(f"UNREADABLE shard={shard} role={server.role.name} moved_to={moved} {exc}",
                  flush=True)
            got = persist.recover(data_dir)
        if got.incomplete and pair is not None:  # no copy to serve: its peer's first
            recovery.mark_needs_peer(data_dir, "an incomplete replica", got.incomplete)
        writer = persist.DataDir(data_dir, fsync, compact_min_bytes=compact_min_bytes,
                                 compact_ratio=compact_ratio)
        free = shutil.disk_usage(data_dir).free
        if free < min_free_bytes:  # it would stop again at its first writes
            raise OSError(errno.ENOSPC, f"{free} bytes free, fewer than the "
                                        f"{min_free_bytes} a server starts with")
    except OSError as exc:
        sys.exit(disk_exit(*where, f"{os_error_text(exc)} (recovering {data_dir})"))
    server.store = got.store
    server.applied.load(got.uuids)
    if got.generation:
        server.generation = got.generation
    if got.torn_bytes:
        _report_torn(got, data_dir)
    if got.incomplete:
        log.warning("recovery: %s held an incomplete replica (killed while it was "
                    "rewritten from the peer); its files are in %s; starting empty, "
                    "serving only once it has copied its peer's map", data_dir,
                    got.incomplete)
    if pair is not None:
        pair.map.recovered(got.term, got.history, needs_peer=recovery.needs_peer(data_dir))
    log.info("recovered %d keys at sequence %d from %s (snapshot %s, %d updates from %d "
             "segments; generation %s, term %d)", len(got.store), got.store.seq, data_dir,
             got.snapshot_seq, got.records, got.segments, server.generation, got.term)
    writer.torn_bytes = got.torn_bytes
    writer.torn_updates, writer.torn_first_seq = got.torn_updates, got.torn_first_seq
    try:
        writer.open(server.generation, got.store.seq)
    except OSError as exc:
        sys.exit(disk_exit(*where, f"{os_error_text(exc)} (opening a segment in "
                                   f"{data_dir})"))
    server.attach_persist(writer)
    if server.shard_map is not None and settle:
        _settle_routing(server, data_dir, where)


def _settle_routing(server: ShardServer, data_dir: str, where: tuple) -> None:
    """Follow the newer of ``--routing`` and the routing ``data_dir`` holds, durable there
    (``clonemap.shards.persist.routing``). A data directory of another cluster or shard
    exits ``Exit.USAGE`` naming both; an unreadable routing file is the map's case: a
    standalone server exits 1, a pair server moves it aside and takes ``--routing``."""
    from clonemap.shards.persist import CorruptLog
    from clonemap.shards.persist import routing as routing_file

    index = server.config.shard_index
    try:
        try:
            settled = routing_file.settle(data_dir, server.shard_map, index)
        except CorruptLog as exc:
            if not isinstance(server.role, BinaryStar):
                click.echo(f"shards: cannot read the routing in {data_dir}: {exc}", err=True)
                sys.exit(Exit.FAILED)
            aside = f"{exc.path}.unreadable-{int(time.time())}"
            os.rename(exc.path, aside)
            log.critical("routing: %s (moved to %s); following --routing", exc, aside)
            settled = routing_file.settle(data_dir, server.shard_map, index)
    except ConfigError as exc:
        click.echo(f"shards: {exc}", err=True)
        sys.exit(Exit.USAGE)
    except OSError as exc:
        sys.exit(disk_exit(*where, f"{os_error_text(exc)} (writing the routing in "
                                   f"{data_dir})"))
    if settled is not server.shard_map:
        server.set_routing(settled)
    server.forget_unowned()  # keys that moved away after the log recorded them
    log.info("routing: epoch %d, %d shards (digest %s), shard %d", settled.epoch,
             settled.shards, settled.digest(), index)


def _report_torn(got, data_dir: str) -> None:
    """A torn last record, in updates: a record is published only once written whole, so
    these were never acknowledged, unless the host itself went down (power, kernel) under
    ``fsync: everysec`` or ``no``, which acknowledge before the disk has the record."""
    if got.torn_updates:
        last = got.torn_first_seq + got.torn_updates - 1
        log.warning("recovery: a torn last record was truncated in %s: %d update(s), "
                    "sequence %d..%d (%d bytes); never acknowledged unless this host "
                    "crashed under fsync everysec/no", data_dir, got.torn_updates,
                    got.torn_first_seq, last, got.torn_bytes)
    else:
        log.warning("recovery: a torn last record was truncated in %s (%d bytes; too little "
                    "of it was written to say which updates)", data_dir, got.torn_bytes)


def coordination_arg(ctx, param, value: str | None) -> list[tuple[str, int]] | None:
    if value is None:
        return None
    try:
        return coord.parse_url(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--port", "-p", type=click.IntRange(1, 65533), required=True,
              help="Port base P: snapshot ROUTER on P, PUB on P+1, collector SUB on P+2.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (an IPv4 address, or * for all).")
@click.option("--heartbeat-s", type=click.FloatRange(0.01, 3600), default=HEARTBEAT_S,
              show_default=True, help="HUGZ interval when idle.")
@click.option("--clock-s", type=click.FloatRange(0, 3600), default=CLOCK_S,
              show_default=True,
              help="Interval of the HUGZ carrying the server clock (ts, seq), sent even "
                   "when busy; 0 disables it.")
@click.option("--max-key-bytes", type=click.IntRange(1), default=_DEFAULT.max_key,
              show_default=True)
@click.option("--max-value-bytes", type=click.IntRange(1), default=_DEFAULT.max_value,
              show_default=True)
@click.option("--max-props-bytes", type=click.IntRange(0), default=_DEFAULT.max_props,
              show_default=True)
@click.option("--max-subtree-bytes", type=click.IntRange(0), default=_DEFAULT.max_subtree,
              show_default=True)
@click.option("--snapshot-chunk", type=click.IntRange(1), default=SNAPSHOT_CHUNK,
              show_default=True, help="KVSYNCs per requester per loop turn.")
@click.option("--snapshot-stall-s", type=click.FloatRange(0.01), default=SNAPSHOT_STALL_S,
              show_default=True, help="Abandon a snapshot peer that accepts nothing this long.")
@click.option("--snapshot-yield-s", type=click.FloatRange(0.01), default=streams.YIELD_S,
              show_default=True,
              help="A requester that accepted nothing this long yields its slot to those "
                   "waiting (it stays open, and resumes when it reads).")
@click.option("--max-snapshots", type=click.IntRange(1), default=MAX_ACTIVE_SNAPSHOTS,
              show_default=True, help="Snapshots streamed at once; more requests wait.")
@click.option("--collect-batch", type=click.IntRange(1), default=COLLECT_BATCH,
              show_default=True, help="KVSETs handled per loop turn.")
@click.option("--pub-hwm", type=click.IntRange(0), default=PUB_SNDHWM, show_default=True,
              help="The publisher's largest mark in messages (0: no count limit).")
@click.option("--subscriber-held-bytes", type=click.IntRange(0),
              default=SUBSCRIBER_HELD_BYTES, show_default=True,
              help="Bytes one subscriber that reads nothing may pin in this server: the "
                   "publisher's mark is derived from it and the largest update so far "
                   "(0: only --pub-hwm).")
@click.option("--writer-held-bytes", type=click.IntRange(0),
              default=WRITER_HELD_BYTES, show_default=True,
              help="Bytes one writer's queued KVSETs may pin in the collector, the same "
                   "way (0: only --collect-hwm).")
@click.option("--history-updates", type=click.IntRange(0), default=HISTORY_UPDATES,
              show_default=True,
              help="Recent updates kept so that a client that was away briefly resumes "
                   "with what it missed instead of a full snapshot (0: none).")
@click.option("--history-bytes", type=click.IntRange(0), default=HISTORY_BYTES,
              show_default=True, help="... and at most this many bytes of them.")
@click.option("--dedup-bytes", type=click.IntRange(0), default=DEDUP_BYTES,
              show_default=True,
              help="Bytes of the table of applied UUIDs, so a write sent again is applied "
                   "once: a resend is recognised for at least half of this "
                   "(/ 128 bytes an entry) later writes ...")
@click.option("--dedup-s", type=click.FloatRange(min=0), default=DEDUP_S,
              show_default=True, help="... and at least half of this many seconds.")
@click.option("--collect-hwm", type=click.IntRange(0), default=COLLECT_RCVHWM,
              show_default=True)
@click.option("--snapshot-hwm", type=click.IntRange(1), default=SNAPSHOT_SNDHWM,
              show_default=True, help="At most this many messages queued per requester.")
@click.option("--snapshot-held-bytes", type=click.IntRange(0), default=SNAPSHOT_HELD_BYTES,
              show_default=True,
              help="Bytes all snapshot streams together may queue (an equal share each of "
                   "--max-snapshots); 0: only --snapshot-hwm.")
@click.option("--cpus", callback=parse_cpus, default=None,
              help="Pin the process to these CPUs (e.g. 0,1) before any thread starts.")
@click.option("--io-threads", type=click.IntRange(1, MAX_IO_THREADS), default=1, show_default=True,
              help="libzmq I/O threads: subscribers' connections are spread over them "
                   "(for a server that many subscribers read directly; give it the cores).")
@click.option("--primary", "pair_role", flag_value="primary", default=None,
              help="Binary Star primary (needs --peer).")
@click.option("--backup", "pair_role", flag_value="backup",
              help="Binary Star backup (needs --peer).")
@click.option("--peer", callback=peer_arg, default=None, metavar="HOST:PORT",
              help="The other server of the pair: its host and base port P.")
@click.option("--shard", default="0", show_default=True, callback=shard_arg,
              help="Shard name (logs, state messages, control service).")
@click.option("--control", default=None, metavar="ENDPOINT",
              help="MDP broker endpoint: serve stats as service shard.<NAME>.<ROLE>.")
@click.option("--parent-pid", type=click.IntRange(1), default=None,
              help="Exit cleanly when this process is gone.")
@click.option("--routing", "shard_map", callback=routing_arg, default=None,
              metavar="JSON|@FILE",
              help="The cluster's routing (ShardMap.describe(): {\"version\": 1, \"shards\": "
                   "N, \"pins\": [[prefix, shard], ...]}, or a cluster map holding it), as "
                   "JSON or @file. With --shard-index: KVSETs for keys this shard does not "
                   "own are dropped, counted 'not_owner'. Default: own every key.")
@click.option("--shard-index", type=click.IntRange(0), default=None,
              help="This server's shard index in --routing (required with it).")
@click.option("--provisional-routing", is_flag=True,
              help="A shard that a change of the routing adds (supervisor reshard): follow "
                   "--routing, but keep it in --data-dir only once the change commits it "
                   "(until then the cluster's routing is the one before).")
@click.option("--pending-max", type=click.IntRange(1), default=MAX_ENTRIES,
              show_default=True, help="Pending-table entries (passive server).")
@click.option("--pending-max-bytes", type=click.IntRange(1), default=None,
              help="Key, properties and value bytes the pending table holds (passive); "
                   "the oldest go first, counted evicted_bytes. [default: "
                   "--writer-held-bytes, at least 1 MiB, as under the supervisor]")
@click.option("--pending-age-s", type=click.FloatRange(0.001), default=MAX_AGE_S,
              show_default=True, help="Longest a pending update is kept.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Persist every applied update in this directory and recover from it "
                   "at start (default: memory only).")
@click.option("--fsync", type=click.Choice(["always", "everysec", "no"]),
              default="everysec", show_default=True,
              help="With --data-dir: fsync every batch before its KVPUBs go out (always: "
                   "an acknowledged write is on disk), at most once a second (everysec), "
                   "or leave it to the OS (no).")
@click.option("--compact-min-bytes", type=click.IntRange(0), default=None,
              help="With --data-dir: compact once the log since the last snapshot is "
                   "larger than this and than the snapshot (default 64 MiB).")
@click.option("--compact-ratio", type=click.FloatRange(0.01), default=None,
              help="With --data-dir: ... and larger than this times the snapshot "
                   "(default 1.0).")
@click.option("--min-free-bytes", type=click.IntRange(0), default=None,
              help="With --data-dir: start only with this much free on its filesystem, "
                   "else exit 7 (a disk error) and be restarted later (default 4 MiB).")
@click.option("--keys-dir", type=click.Path(file_okay=False), default=None,
              help="CURVE on every socket with the cluster's keys in this directory "
                   "(server.key_secret, and the public keys of the admitted peers; see "
                   "`supervisor keygen`). Default: plain TCP.")
@click.option("--rights", type=click.Path(dir_okay=False, exists=True), default=None,
              help="With --keys-dir: enforce the named identities' read and write rights "
                   "from this file (what `supervisor start` writes; see supervisor/README.md, "
                   "Access control). Default: every admitted peer holds every right.")
@click.option("--coordination", callback=coordination_arg, default=None,
              metavar="etcd://HOST:PORT[,HOST:PORT...]",
              help="A pair across hosts: the server may be ACTIVE only while it holds the "
                   "pair's lease in this etcd cluster (see shards/README.md, Pairs across "
                   "hosts). Default: none (Binary Star alone, for a pair on one host).")
@click.option("--lease-s", type=click.FloatRange(coord.MIN_LEASE_S, 3600),
              default=coord.LEASE_S, show_default=True,
              help="With --coordination: the lease's TTL; a dead active's shard waits this "
                   "long (plus 0.7 s at most) before its peer serves.")
@click.option("--lease-name", default=None, metavar="NAME",
              help="With --coordination: the lease's name in etcd (key "
                   "clonemap/NAME/active), the same on both servers of the pair and "
                   "unique in that etcd. Default: shard-SHARD.")
@click.option("--replication", type=click.Choice(["sync", "async"]), default="sync",
              show_default=True,
              help="With --coordination: sync acknowledges a write only once the passive "
                   "holds it too (an active that loses its passive goes on alone only after "
                   "recording that in etcd); async acknowledges on the active alone, as a "
                   "pair without --coordination does.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
def main(port, host, heartbeat_s, clock_s, max_key_bytes, max_value_bytes, max_props_bytes,
         max_subtree_bytes, snapshot_chunk, snapshot_stall_s, snapshot_yield_s, max_snapshots, collect_batch,
         pub_hwm, subscriber_held_bytes, writer_held_bytes, history_updates, history_bytes,
         dedup_bytes, dedup_s, collect_hwm, snapshot_hwm, snapshot_held_bytes, cpus, io_threads, pair_role, peer, shard, control,
         parent_pid, shard_map, shard_index, provisional_routing, pending_max, pending_max_bytes, pending_age_s, data_dir, fsync,
         compact_min_bytes, compact_ratio, min_free_bytes, keys_dir, rights, coordination, lease_s,
         lease_name, replication, log_level):
    """Run one 12/CHP shard server: standalone, or one server of a Binary Star pair."""
    if pair_role is not None and peer is None:
        raise click.UsageError(f"--{pair_role} needs --peer HOST:PORT (the other server)")
    if pair_role is None and peer is not None:
        raise click.UsageError("--peer needs --primary or --backup")
    if (shard_map is None) != (shard_index is None):
        raise click.UsageError("--routing and --shard-index go together")
    if shard_map is not None and shard_index >= shard_map.shards:
        raise click.BadParameter(f"{shard_index} is not a shard of --routing (0.."
                                 f"{shard_map.shards - 1})", param_hint="--shard-index")
    if coordination is not None and pair_role is None:
        raise click.UsageError("--coordination is for a pair: add --primary/--backup and "
                               "--peer")
    if port > 65532 and pair_role is not None:
        raise click.BadParameter("a pair server uses P..P+3: at most 65532", param_hint="--port")
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    # a fatal signal (a crash in libzmq or the compiled frame path) prints every thread's
    # Python stack on stderr, which the supervisor keeps in the server's log
    faulthandler.enable(file=sys.stderr, all_threads=True)
    return_large_frees()  # what a departed slow subscriber pinned goes back to the OS
    if cpus is not None:
        import psutil  # pin before the zmq context starts its I/O thread

        try:
            psutil.Process().cpu_affinity(cpus)
        except (ValueError, OSError) as exc:
            click.echo(f"shards: cannot pin to CPUs {cpus}: {exc}", err=True)
            sys.exit(2)
    config = ServerConfig(
        port=port, host=host, heartbeat_s=heartbeat_s, clock_s=clock_s,
        limits=chp.Limits(max_key=max_key_bytes, max_value=max_value_bytes,
                          max_props=max_props_bytes, max_subtree=max_subtree_bytes),
        snapshot_chunk=snapshot_chunk, snapshot_stall_s=snapshot_stall_s,
        snapshot_yield_s=snapshot_yield_s,
        max_active_snapshots=max_snapshots, collect_batch=collect_batch,
        pub_sndhwm=pub_hwm, subscriber_held_bytes=subscriber_held_bytes,
        writer_held_bytes=writer_held_bytes, history_updates=history_updates,
        history_bytes=history_bytes, dedup_bytes=dedup_bytes, dedup_s=dedup_s,
        collect_rcvhwm=collect_hwm, snapshot_sndhwm=snapshot_hwm,
        snapshot_held_bytes=snapshot_held_bytes, io_threads=io_threads,
        shard_map=shard_map, shard_index=shard_index or 0)
    if pair_role is None:
        server = ShardServer(config)
    else:
        server = ShardServer(config, BinaryStar(
            config, role=pair_role, peer=peer, shard=shard, pending_max=pending_max,
            pending_age_s=pending_age_s,
            pending_max_bytes=(pending_max_bytes if pending_max_bytes is not None
                               else max(1 << 20, writer_held_bytes)),
            coordination=coordination, lease_s=lease_s, lease_name=lease_name,
            replication=replication))
    load_access(server, keys_dir, rights, "shards")
    server.routing_provisional = provisional_routing
    if data_dir is not None:
        from clonemap.shards.persist import writer as persist_writer

        _recover(server, shard, data_dir, fsync, not provisional_routing,
                 persist_writer.COMPACT_MIN_BYTES
                 if compact_min_bytes is None else compact_min_bytes,
                 persist_writer.COMPACT_RATIO if compact_ratio is None else compact_ratio,
                 persist_writer.MIN_FREE_BYTES if min_free_bytes is None else min_free_bytes)
    bind_and_serve(server, shard, control, parent_pid, "shards")


if __name__ == "__main__":
    main()
