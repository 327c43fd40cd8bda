"""``python -m shards --port P [--host H] ...``: run one standalone 12/CHP shard server.

Prints ``READY shard host=H port=P pid=N`` on stdout once P, P+1 and P+2 are bound.
Exit codes: 0 after SIGINT/SIGTERM, 3 if a port is taken (one line on stderr naming the
endpoint), 2 on bad arguments (click).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys

import click
import uvloop

from shards.errors import PortInUse
from shards.proto import chp
from shards.server import (COLLECT_BATCH, COLLECT_RCVHWM, HEARTBEAT_S, MAX_ACTIVE_SNAPSHOTS,
                           PUB_SNDHWM, SNAPSHOT_CHUNK, SNAPSHOT_SNDHWM, SNAPSHOT_STALL_S,
                           ServerConfig, ShardServer)

log = logging.getLogger("shards")
_DEFAULT = chp.Limits()


def _parse_cpus(ctx, param, value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        cpus = sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of CPU numbers")
    if not cpus:
        raise click.BadParameter("no CPU given")
    return cpus


async def _serve(server: ShardServer) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1,
                            lambda: log.info("stats %s", json.dumps(server.stats())))
    server.start()
    cfg = server.config
    print(f"READY shard host={cfg.host} port={cfg.port} pid={os.getpid()}", flush=True)
    try:
        await stop.wait()
    finally:
        stats = server.stats()
        server.close()
        log.info("stopped; final stats %s", json.dumps(stats))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--port", "-p", type=click.IntRange(1, 65533), required=True,
              help="Port base P: snapshot ROUTER on P, PUB on P+1, collector SUB on P+2.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (an IPv4 address, or * for all).")
@click.option("--heartbeat-s", type=click.FloatRange(0.01, 3600), default=HEARTBEAT_S,
              show_default=True, help="HUGZ interval when idle.")
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
@click.option("--max-snapshots", type=click.IntRange(1), default=MAX_ACTIVE_SNAPSHOTS,
              show_default=True, help="Snapshots streamed at once; more requests wait.")
@click.option("--collect-batch", type=click.IntRange(1), default=COLLECT_BATCH,
              show_default=True, help="KVSETs handled per loop turn.")
@click.option("--pub-hwm", type=click.IntRange(0), default=PUB_SNDHWM, show_default=True)
@click.option("--collect-hwm", type=click.IntRange(0), default=COLLECT_RCVHWM,
              show_default=True)
@click.option("--snapshot-hwm", type=click.IntRange(1), default=SNAPSHOT_SNDHWM,
              show_default=True)
@click.option("--cpus", callback=_parse_cpus, default=None,
              help="Pin the process to these CPUs (e.g. 0,1) before any thread starts.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
def main(port, host, heartbeat_s, max_key_bytes, max_value_bytes, max_props_bytes,
         max_subtree_bytes, snapshot_chunk, snapshot_stall_s, max_snapshots, collect_batch,
         pub_hwm, collect_hwm, snapshot_hwm, cpus, log_level):
    """Run one standalone 12/CHP shard server."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    if cpus is not None:
        import psutil  # pin before the zmq context starts its I/O thread

        try:
            psutil.Process().cpu_affinity(cpus)
        except (ValueError, OSError) as exc:
            click.echo(f"shards: cannot pin to CPUs {cpus}: {exc}", err=True)
            sys.exit(2)
    config = ServerConfig(
        port=port, host=host, heartbeat_s=heartbeat_s,
        limits=chp.Limits(max_key=max_key_bytes, max_value=max_value_bytes,
                          max_props=max_props_bytes, max_subtree=max_subtree_bytes),
        snapshot_chunk=snapshot_chunk, snapshot_stall_s=snapshot_stall_s,
        max_active_snapshots=max_snapshots, collect_batch=collect_batch,
        pub_sndhwm=pub_hwm, collect_rcvhwm=collect_hwm, snapshot_sndhwm=snapshot_hwm)
    server = ShardServer(config)
    try:
        server.bind()
    except PortInUse as exc:
        click.echo(f"shards: cannot bind: {exc}", err=True)
        sys.exit(exc.exit_code)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(server))
    sys.exit(0)


if __name__ == "__main__":
    main()
