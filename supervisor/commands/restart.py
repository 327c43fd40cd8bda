"""``supervisor restart SHARD/ROLE [CONFIG]``: stop one server (SIGTERM, then SIGKILL after the
deadline) and start it again at once, with a fresh restart count (a FAILED server gets
another chance). MDP ``cluster.restart``. Exit 6 for an unknown server, 2 for a
malformed SHARD/ROLE, 4 when no supervisor answers.
"""
from __future__ import annotations

import click

from clonemap.supervisor.control import Selection, act, control_options, run_command, target_argument
from clonemap.supervisor.runner import STOP_DEADLINE_S


@click.command("restart")
@target_argument
@control_options
def command(target: str, sel: Selection) -> None:
    """Restart one server, e.g. s0/primary."""

    def body() -> int:
        # the reply comes once the old run has exited: allow for the stop deadline
        reply = act("cluster.restart", target, sel,
                    reply_timeout_s=sel.timeout_s + 2 * STOP_DEADLINE_S)
        click.echo(f"restarted {reply['server']}: pid {reply['pid']}")
        return 0

    run_command(body)
