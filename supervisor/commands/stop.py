"""``supervisor stop [CONFIG] [--control EP | --config CONFIG]``: ask the running supervisor to stop
every server and exit (MDP ``cluster.stop``). With ``--wait`` (the default) it returns
once the supervisor no longer answers. A cluster that is not running (nothing listens on its
control port) is not an error: "not running", exit 0. Exit 4 when something listens but
no supervisor answers.
"""
from __future__ import annotations

import time

import click

from clonemap.shards.common.endpoints import NOT_LISTENING
from clonemap.shards.common.errors import HandshakeRefused, Timeout
from clonemap.supervisor.control import Selection, call, control_options, ping, run_command

STOP_WAIT_S = 30.0


@click.command("stop")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the supervisor has stopped.")
@control_options
def command(wait: bool, sel: Selection) -> None:
    """Stop every server and the supervisor."""

    def body() -> int:
        endpoint = sel.endpoint()
        try:
            ping(endpoint, "cluster.stop", sel.timeout_s)
        except Timeout as exc:
            if exc.what != NOT_LISTENING:
                raise
            click.echo(f"not running (nothing listens on {endpoint})")
            return 0
        call(endpoint, "cluster.stop", timeout_s=sel.timeout_s, retries=0)
        if wait:
            deadline = time.monotonic() + STOP_WAIT_S
            while time.monotonic() < deadline:
                try:  # answers while it stops its servers; silence once it is gone
                    ping(endpoint, "cluster.stop", timeout_s=0.5)
                except (Timeout, HandshakeRefused):  # gone, or its broker closing
                    break
                time.sleep(0.2)
            else:
                click.echo(f"error: the supervisor still answers {STOP_WAIT_S:g} s later",
                           err=True)
                return 1
        click.echo(f"stopped ({endpoint})")
        return 0

    run_command(body)
