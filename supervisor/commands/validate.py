"""``supervisor validate CONFIG``: check a config against this host (or a host-facts file)
and print the placement plan, starting nothing.

Exit 0 when the config fits; otherwise every problem goes to stderr, one line each
(``error: CONFIG: FIELD: given VALUE: PROBLEM; WHAT THE HOST HAS``), and the exit code is
ConfigError's (2).
"""
from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.config import load_config
from clonemap.shards.common.config_values import format_cores
from clonemap.shards.common.hostfacts import load_host_facts, local_host_facts
from clonemap.shards.common.placement import Plan, check_ports_free, plan
from clonemap.shards.common.security import check_keys_present
from clonemap.supervisor.running import running_cluster


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _render(the_plan: Plan, ports_note: str) -> None:
    console = Console(highlight=False)
    facts = the_plan.host
    servers = the_plan.servers
    for line in (
            f"cluster [bold]{the_plan.cluster}[/]: {_plural(len(the_plan.shards), 'shard')}, "
            f"{_plural(len(servers), 'server')}"
            + (f", {_plural(len(the_plan.relays), 'relay')}" if the_plan.relays else ""),
            f"control {the_plan.control}   heartbeat {the_plan.heartbeat_s:g} s   "
            f"silence timeout {the_plan.silence_timeout_s:g} s",
            f"host: {facts.source}" + (f" (host {the_plan.host_name} of "
                                       f"{', '.join(n for n, _ in the_plan.hosts)})"
                                       if the_plan.host_name else "")
            + f"; cores {facts.describe_cores()}",
            f"NICs: {facts.describe_nics()}",
            (f"security: CURVE on every socket; keys in {the_plan.keys_dir}"
             if the_plan.curve else "security: off (plain TCP; see `security: {curve: true}`)")):
        console.print(line, soft_wrap=True)
    with_prefixes = any(shard.prefixes for shard in the_plan.shards)
    with_io = any(s.io_threads > 1 for s in (*servers, *the_plan.relays))
    table = Table(show_edge=False, pad_edge=False)
    columns = ["shard", "role", "cores", "nic", "address", "ports"]
    for column in (columns + (["I/O threads"] if with_io else [])
                   + (["prefixes"] if with_prefixes else [])):
        table.add_column(column, no_wrap=column != "prefixes")
    for shard in the_plan.shards:
        relays = [r for r in the_plan.relays if r.shard == shard.name]
        for s in (*shard.servers, *relays):
            role = s.role if the_plan.is_local(s) else f"{s.role} (another host)"
            row = [s.shard, role, format_cores(s.cores) + (" (auto)" if s.cores_auto else ""),
                   s.nic, s.address, f"{s.port}-{s.ports[-1]}"]
            if with_io:
                row.append(str(s.io_threads))
            if with_prefixes:
                row.append(", ".join(shard.prefixes) if s.role == "primary" else "")
            table.add_row(*row)
    console.print(table)
    if the_plan.metrics is not None:
        console.print(f"metrics http://{the_plan.metrics[0]}:{the_plan.metrics[1]}/metrics",
                      soft_wrap=True)
    for name, who in the_plan.access.describe().items():
        console.print(f"identity {name} (role {who['role']}): {who['rights']}",
                      soft_wrap=True, markup=False)
    for note in the_plan.notes:
        console.print(f"note: {note}", soft_wrap=True)
    console.print(f"[green]valid[/]: {ports_note}", soft_wrap=True)


@click.command("validate")
@click.argument("config", metavar="CONFIG")
@click.option("--host-facts", "host_facts", metavar="FILE", default=None,
              help="Plan for the host described in FILE (YAML/JSON: cores, nics) instead "
                   "of this one; ports are then not probed.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--no-port-check", is_flag=True,
              help="Do not bind-test the ports (e.g. while the cluster is running).")
@click.option("--host", "host_name", metavar="NAME", default=None,
              help="A config over several hosts: check the part of this host.")
def command(config: str, host_facts: str | None, as_json: bool, no_port_check: bool,
            host_name: str | None) -> None:
    """Check CONFIG against this host and print the placement plan; start nothing."""
    try:
        cluster = load_config(config)
        facts = load_host_facts(host_facts) if host_facts else local_host_facts()
        the_plan = plan(cluster, facts, source=config, host=host_name)
        probed = facts.local and not no_port_check
        if the_plan.curve and facts.local:
            check_keys_present(the_plan.keys_dir, config, the_plan.access.identities)
        if probed:
            try:
                check_ports_free(the_plan, source=config)
            except ConfigError:
                running = running_cluster(the_plan.cluster, config, None, host=host_name)
                if running is None:
                    raise
                click.echo(f"error: {config}: {running.line()}: its ports are in use by "
                           "it; validate a running cluster with --no-port-check", err=True)
                raise SystemExit(ConfigError.exit_code) from None
    except ConfigError as exc:
        for line in str(exc).splitlines():
            click.echo(f"error: {line}", err=True)
        raise SystemExit(exc.exit_code) from None
    if probed:
        ports_note = "every port is free on this host"
    elif host_facts:
        ports_note = f"ports not probed (host facts from {host_facts})"
    else:
        ports_note = "ports not probed (--no-port-check)"
    if as_json:
        out = the_plan.to_dict()
        out.update(valid=True, ports_checked=probed)
        click.echo(json.dumps(out, indent=2))
    else:
        _render(the_plan, ports_note)
