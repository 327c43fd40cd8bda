"""``supervisor logs SHARD/ROLE [CONFIG] [-n N]``: the last N lines (default 50) of one server's
log, RUN_DIR/logs/SHARD-ROLE.log, served by the supervisor (MDP ``cluster.logs``).
Exit 6 for an unknown server, 2 for a malformed SHARD/ROLE, 4 when no supervisor
answers.
"""
from __future__ import annotations

import click

from clonemap.supervisor.control import (Selection, call, checked_target, control_options,
                                run_command, target_argument)
from clonemap.supervisor.protocol import DEFAULT_LOG_LINES, MAX_LOG_LINES


@click.command("logs")
@target_argument
@click.option("-n", "--lines", type=click.IntRange(1, MAX_LOG_LINES),
              default=DEFAULT_LOG_LINES, show_default=True, help="How many lines.")
@control_options
def command(target: str, lines: int, sel: Selection) -> None:
    """Print the end of one server's log, e.g. s0/backup."""

    def body() -> int:
        name = checked_target(target)
        text = call(sel.endpoint(), "cluster.logs", name.encode(),
                    str(lines).encode(), timeout_s=sel.timeout_s)
        click.echo(text.decode("utf-8", "replace"), nl=False)
        return 0

    run_command(body)
