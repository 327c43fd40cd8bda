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

from clonemap.supervisor.control import Selection, control_options, run_command, status_rows
from clonemap.supervisor.health import shards_without_active


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
        hosts = sel.hosts() if sel.host is None else []
        if hosts:
            return _across_hosts(sel, hosts, as_json)
        endpoint = sel.endpoint()
        rows, summary = status_rows(endpoint, sel.timeout_s)
        if as_json:
            click.echo(json.dumps({"summary": summary, "servers": rows}, indent=2,
                                  sort_keys=True))
        else:
            from rich.console import Console

            from clonemap.supervisor.status_view import status_notes, status_table, summary_line

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


def _across_hosts(sel: Selection, hosts: list[str], as_json: bool) -> int:
    """A cluster over several hosts: every host's supervisor is asked; its servers'
    rows say which host they run on, and a host that does not answer is named."""
    from clonemap.shards.common.errors import ClonemapError

    rows: list[dict] = []
    unreachable: dict[str, str] = {}
    summaries: dict[str, dict] = {}
    for host in hosts:
        endpoint = sel.on_host(host).endpoint()
        try:
            host_rows, summary = status_rows(endpoint, sel.timeout_s)
        except ClonemapError as exc:
            unreachable[host] = f"{endpoint}: {exc}"
            continue
        summaries[host] = summary
        rows += [{**row, "host": host, "role": f"{row.get('role')}@{host}"}
                 for row in host_rows]
    without = shards_without_active(rows)  # served: some host's server of it is ACTIVE
    if as_json:
        click.echo(json.dumps({"hosts": summaries, "unreachable": unreachable,
                               "servers": rows, "without_active": without},
                              indent=2, sort_keys=True))
    else:
        from rich.console import Console

        from clonemap.supervisor.status_view import status_table, summary_line

        console = Console(highlight=False)
        if not console.is_terminal:
            console = Console(highlight=False, width=200)
        title = (f"cluster {next(iter(summaries.values()), {}).get('cluster', '?')}  "
                 f"hosts {', '.join(hosts)}  {summary_line(rows)}")
        console.print(status_table(rows, title=title))
        for host, why in unreachable.items():
            console.print(f"host {host} unreachable: {why}")
        for shard in without:
            console.print(f"{shard}: no ACTIVE server on any host that answered")
    healthy = (not unreachable and not without
               and all(row.get("state") == "RUNNING" for row in rows))
    return 0 if healthy else 1
