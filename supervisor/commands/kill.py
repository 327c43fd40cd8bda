"""``supervisor kill SHARD/ROLE [CONFIG]``: SIGKILL one server now, for failure drills (MDP
``cluster.kill``). The restart policy then restarts it with back-off; a killed primary
comes back as passive while its backup serves. Exit 6 for an unknown server, 2 for a
malformed SHARD/ROLE, 1 if it has no process now, 4 when no supervisor answers.
"""
from __future__ import annotations

import click

from clonemap.supervisor.control import Selection, act, control_options, run_command, target_argument


@click.command("kill")
@target_argument
@control_options
def command(target: str, sel: Selection) -> None:
    """SIGKILL one server (a failure drill), e.g. s0/primary."""

    def body() -> int:
        reply = act("cluster.kill", target, sel)
        click.echo(f"killed {reply['server']}: pid {reply['pid']} (SIGKILL)")
        return 0

    run_command(body)
