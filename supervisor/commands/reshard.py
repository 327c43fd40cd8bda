"""``supervisor reshard CONFIG --to NEW_CONFIG``: change the running cluster's routing
(MDP ``cluster.reshard``, which needs ``admin``; ``clonemap.supervisor.resharding``).

The command reads NEW_CONFIG's routing (its shard count and each shard's pinned
prefixes), asks the supervisor for the plan (every server counts the keys it would give
up, by target shard), prints it, and applies it with ``--yes`` (or after a yes on a
terminal). It prints the new epoch once every running server follows it. This version
applies routing changes that move no key (pins of prefixes that hold no key yet, among
the running shards); any other is printed and refused. Exit 0 applied (or nothing to
change, or ``--dry-run``), 1 refused, 2 a NEW_CONFIG that does not validate, 9 without
``admin``, 4 when no supervisor answers.
"""
from __future__ import annotations

import json
import sys

import click

from clonemap.shards.common.errors import ConfigError
from clonemap.supervisor.control import (ReplyError, Selection, call, control_options, ping,
                                         run_command)



def routing_change(path: str) -> dict:
    """NEW_CONFIG's routing as ``cluster.reshard``'s body (``ConfigError`` if invalid)."""
    from clonemap.shards.common.config import load_config

    config = load_config(path)
    return {"shards": len(config.shards),
            "pins": [[prefix, i] for i, shard in enumerate(config.shards)
                     for prefix in shard.prefixes]}


def plan_lines(plan: dict) -> list[str]:
    lines = [f"routing epoch {plan['epoch']} -> {plan.get('next_epoch', plan['epoch'])}"]
    for prefix, (was, now) in sorted(plan.get("prefixes", {}).items()):
        lines.append(f"  prefix {prefix!r}: shard {was} -> shard {now}")
    moves = plan.get("moves", [])
    for m in moves:
        lines.append(f"  shard {m['from']} -> shard {m['to']}: {m['keys']} keys, "
                     f"{m['bytes']} bytes")
    if not moves:
        lines.append("  no key moves")
    return lines


@click.command("reshard")
@click.option("--to", "new_config", required=True, type=click.Path(dir_okay=False),
              help="The config whose routing (shard count and pins) the cluster takes.")
@click.option("--yes", is_flag=True, help="Apply without asking.")
@click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
@control_options
def command(sel: Selection, new_config: str, yes: bool, dry_run: bool) -> None:
    """Change the running cluster's routing to NEW_CONFIG's (a new routing epoch)."""

    def body() -> int:
        try:
            change = routing_change(new_config)
        except ConfigError as exc:
            raise ConfigError(f"{new_config}: {exc}", field=exc.field) from None
        endpoint = sel.endpoint()
        ping(endpoint, "cluster.reshard", sel.timeout_s)
        plan = json.loads(call(endpoint, "cluster.reshard",
                               json.dumps(dict(change, apply=False)).encode(),
                               timeout_s=sel.timeout_s, retries=0))
        if plan.get("prefixes") is not None and not plan.get("next_epoch"):
            click.echo(f"nothing to change: the cluster routes as {new_config} "
                       f"(epoch {plan['epoch']})")
            return 0
        for line in plan_lines(plan):
            click.echo(line)
        if dry_run:
            return 0
        if not yes:
            if not sys.stdin.isatty():
                click.echo("error: not applied: add --yes (no terminal to ask on)", err=True)
                return 1
            if not click.confirm("apply?", default=False):
                return 1
        try:
            done = json.loads(call(endpoint, "cluster.reshard",
                                   json.dumps(dict(change, apply=True)).encode(),
                                   timeout_s=sel.timeout_s, retries=0))
        except ReplyError as exc:
            if exc.status == "409":
                click.echo(f"error: not applied: {exc.text}", err=True)
                return 1
            raise
        click.echo(f"routing epoch {done['epoch']}: followed by {len(done['servers'])} "
                   "servers and relays")
        return 0

    run_command(body)
