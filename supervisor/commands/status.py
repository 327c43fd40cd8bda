"""``supervisor status [CONFIG] [--json] [--control EP]``: the running cluster's status,
from the supervisor's ``cluster.status`` service (one row per server).

Exit codes: 0 when every server is RUNNING and every shard has an ACTIVE server; 1 when
some server is not RUNNING (BACKOFF, FAILED...) or a shard has no ACTIVE server (the
table says which, in words); 4 when no supervisor answers in time. Recent takeovers are
printed as event lines under the table ("s0: backup took over from primary").
"""
from __future__ import annotations

import json

import click

from supervisor.control import Selection, control_options, run_command, status_rows
from supervisor.health import shards_without_active


def without_active(rows: list[dict], summary: dict) -> list[str]:
    """The shards with no ACTIVE server: the supervisor's word, else from the rows."""
    given = summary.get("without_active")
    return list(given) if isinstance(given, list) else shards_without_active(rows)


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@control_options
def command(as_json: bool, sel: Selection) -> None:
    """Show every server of the running cluster."""

    def body() -> int:
        endpoint = sel.endpoint()
        rows, summary = status_rows(endpoint, sel.timeout_s)
        if as_json:
            click.echo(json.dumps({"summary": summary, "servers": rows}, indent=2,
                                  sort_keys=True))
        else:
            from rich.console import Console

            from supervisor.status_view import status_notes, status_table, summary_line

            title = (f"cluster {summary.get('cluster')}  control {endpoint}  "
                     f"supervisor pid {summary.get('pid')}  {summary_line(rows)}")
            console = Console(highlight=False)
            if not console.is_terminal:
                console = Console(highlight=False, width=200)
            console.print(status_table(rows, title=title))
            for line in status_notes(rows, summary):
                console.print(line)
        healthy = (all(row.get("state") == "RUNNING" for row in rows)
                   and not without_active(rows, summary))
        return 0 if healthy else 1

    run_command(body)
