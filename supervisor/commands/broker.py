"""``supervisor broker``: run an MDP/0.2 broker alone.

    python -m clonemap.supervisor broker --bind tcp://127.0.0.1:5555 [--heartbeat-s 2.5]
        [--liveness 3] [--request-expiry-s 10] [--max-queued 1000]

Prints ``READY broker bind=<endpoints>`` on stdout once bound (the real endpoints, so
``tcp://127.0.0.1:*`` shows the port chosen). Exit codes: 0 on SIGINT/SIGTERM, 3 when a
port is in use, 2 for an endpoint that cannot be bound, click's 2 for bad options.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys

import click

from clonemap.shards.common.errors import ConfigError, PortInUse
from clonemap.shards.common.mdp.broker import Broker
from clonemap.shards.common.mdp.broker_config import BrokerConfig
from clonemap.shards.common.timing import MDP_HEARTBEAT_S


async def _serve(binds: list[str], config: BrokerConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    broker = Broker(binds, config)
    try:
        await broker.start()
    except (PortInUse, ConfigError) as exc:
        click.echo(f"broker: {exc}", err=True)
        return exc.exit_code
    print(f"READY broker bind={','.join(broker.endpoints)}", flush=True)
    try:
        await stop.wait()
    finally:
        logging.getLogger("clonemap.shards.common.mdp.broker").info("stopping: %s", broker.stats()["counters"])
        await broker.stop()
    return 0


@click.command("broker")
@click.option("--bind", "binds", multiple=True, default=["tcp://127.0.0.1:5555"],
              show_default=True, help="ZeroMQ endpoint for the ROUTER (repeatable).")
@click.option("--heartbeat-s", type=click.FloatRange(min=0.001), default=MDP_HEARTBEAT_S,
              show_default=True, help="Heartbeat interval, seconds.")
@click.option("--liveness", type=click.IntRange(min=1, max=100), default=3, show_default=True,
              help="Heartbeat intervals of silence after which a worker is gone.")
@click.option("--request-expiry-s", type=click.FloatRange(min=0.001), default=10.0,
              show_default=True,
              help="A request for a service with no worker is dropped after this long.")
@click.option("--max-queued", type=click.IntRange(min=0), default=1000, show_default=True,
              help="Queued requests per service; more are dropped and counted.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]),
              default="INFO", show_default=True)
def command(binds: tuple[str, ...], heartbeat_s: float, liveness: int,
            request_expiry_s: float, max_queued: int, log_level: str) -> None:
    """Run an MDP/0.2 (Majordomo) broker: clients and workers on one ROUTER."""
    import uvloop

    logging.basicConfig(stream=sys.stderr, level=getattr(logging, log_level),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = BrokerConfig(heartbeat_s=heartbeat_s, liveness=liveness,
                          request_expiry_s=request_expiry_s, max_queued=max_queued)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        code = runner.run(_serve(list(binds), config))
    sys.exit(code)
