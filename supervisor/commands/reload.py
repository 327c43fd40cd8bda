"""``supervisor reload [CONFIG]``: apply the config's identities and roles to the running
cluster without a restart (MDP ``cluster.reload``, which needs ``admin``).

The supervisor reads the config it was started from again, rewrites the rights file of
its servers and relays, admits exactly the identities it names (a deleted key or a name
left out is refused from the next handshake), and signals each server, which applies the
file and closes the publisher connections of every identity whose rights changed (they
reconnect and subscribe again under the new rights). The command then waits until every
signalled server reports the new version and prints how long that took: the time a
revocation takes to reach every server. Only ``security.clients`` and ``security.roles``
are applied; any other change needs a restart. Exit 2 for a config that does not
validate, 1 when the cluster checks no rights (started without identities) or a server
did not apply the new version in time, 9 without ``admin``, 4 when no supervisor answers.
"""
from __future__ import annotations

import json
import time

import click

from clonemap.supervisor.control import (Selection, call, control_options, ping, run_command,
                                         status_rows)

APPLY_WAIT_S = 10.0
"""How long the command waits for every server to report the new rights."""


def _applied(rows: list[dict], names: list[str], version: int) -> dict[str, float] | None:
    """Each signalled server's time of applying ``version`` (epoch s), or None while one
    has not applied it yet."""
    by_name = {row["name"]: row for row in rows}
    out = {}
    for name in names:
        access = ((by_name.get(name) or {}).get("stats") or {}).get("access") or {}
        if access.get("version", 0) < version:
            return None
        out[name] = access.get("loaded_at", 0.0)
    return out


@click.command("reload")
@control_options
def command(sel: Selection) -> None:
    """Apply the config's identities and roles to the running cluster."""

    def body() -> int:
        endpoint = sel.endpoint()
        ping(endpoint, "cluster.reload", sel.timeout_s)
        reply = json.loads(call(endpoint, "cluster.reload", timeout_s=sel.timeout_s,
                                retries=0))
        version, servers = reply["version"], reply["servers"]
        click.echo(f"rights version {version}: {len(reply['identities'])} identities; "
                   f"changed: {', '.join(reply['changed']) or 'none'}")
        deadline = time.monotonic() + APPLY_WAIT_S
        while (applied := _applied(status_rows(endpoint, sel.timeout_s)[0], servers,
                                   version)) is None:
            if time.monotonic() >= deadline:
                click.echo(f"error: not every server applied rights version {version} "
                           f"within {APPLY_WAIT_S:g} s (see supervisor status)", err=True)
                return 1
            time.sleep(0.1)
        took = max(applied.values(), default=reply["at"]) - reply["at"]
        click.echo(f"applied by all {len(servers)} servers and relays within "
                   f"{max(took, 0.0) * 1000:.0f} ms of the reload")
        return 0

    run_command(body)
