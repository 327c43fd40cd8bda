"""``supervisor init DIR [--control-port N] [--port-base N] [--metrics-port N] [--force]``:
write a starter
config into DIR, for a user who installed the wheel and has no checkout.

``DIR/clonemap.yaml`` is the four-shard loopback cluster of the quick start (the
checkout's ``configs/4shard.yaml``, ports movable): ``supervisor start DIR/clonemap.yaml``
runs it as written. ``DIR/multi-host.example.yaml`` is a commented three-host cluster (the
checkout's ``configs/3host.yaml``), a model to edit, not to run as is. Existing files are
kept unless ``--force`` (exit 2 otherwise).
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import click

from clonemap.shards.common.errors import Exit

CONFIG_NAME = "clonemap.yaml"
EXAMPLE_NAME = "multi-host.example.yaml"
SHARDS = 4
SHARD_STRIDE = 20
"""Ports between one shard's primary and the next's; a server uses its port P and P+1..P+3,
the backup sits at P+10."""


def starter_config(control_port: int, port_base: int, metrics_port: int) -> str:
    """The four-shard loopback cluster, with comments that name its ports."""
    last = port_base + SHARD_STRIDE * (SHARDS - 1) + 13
    shards = "".join(
        f"  - name: s{i}\n"
        f"    primary: {{port: {port_base + SHARD_STRIDE * i}}}\n"
        f"    backup:  {{port: {port_base + SHARD_STRIDE * i + 10}}}\n" for i in range(SHARDS))
    return f"""\
# A clonemap cluster of four shards on this host's loopback, written by `supervisor init`.
#   supervisor start {CONFIG_NAME}            (Ctrl-C stops it; --detach runs it in the background)
#   supervisor status {CONFIG_NAME}
#   chp --config {CONFIG_NAME} set /hello world
#   supervisor stop {CONFIG_NAME}
# Control (the MDP broker) on port {control_port}; shard i: primary at {port_base} + {SHARD_STRIDE}*i,
# backup at {port_base + 10} + {SHARD_STRIDE}*i; each server uses its port P and P+1..P+3 (ports
# {port_base}-{last} in all). `cores: auto` gives each server one core, no backup on its
# primary's core. Data is durable by default, in ./run/<cluster>/data of the directory
# `supervisor start` runs in (--run-dir moves it). The reference for every field is
# clonemap's supervisor/README.md; {EXAMPLE_NAME} beside this file spreads a cluster
# over three hosts.
cluster: local
control: tcp://127.0.0.1:{control_port}
metrics: 127.0.0.1:{metrics_port}       # Prometheus: http://127.0.0.1:{metrics_port}/metrics ("off": none)
heartbeat_s: 1.0
silence_timeout_s: 3.0
defaults:
  host: 127.0.0.1
  cores: auto
shards:
{shards}"""


def multi_host_example() -> str:
    """The commented three-host cluster shipped with the package."""
    return (files("clonemap.configs") / "3host.yaml").read_text()


@click.command("init")
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.option("--control-port", type=click.IntRange(1024, 65535), default=5555,
              show_default=True, help="The control endpoint's port (the MDP broker).")
@click.option("--port-base", type=click.IntRange(1024, 65535 - SHARD_STRIDE * SHARDS),
              default=6000, show_default=True,
              help=f"The first shard server's port; the {2 * SHARDS} servers use the "
                   f"{SHARD_STRIDE * SHARDS} ports from here.")
@click.option("--metrics-port", type=click.IntRange(1024, 65535), default=9464,
              show_default=True, help="The supervisor's Prometheus endpoint's port.")
@click.option("--force", is_flag=True, help="Replace files that are already there.")
def command(directory: Path, control_port: int, port_base: int, metrics_port: int,
            force: bool) -> None:
    """Write a starter cluster config (4 shards on loopback) and a multi-host example
    into DIR."""
    for option, port in (("--control-port", control_port), ("--metrics-port", metrics_port)):
        if port_base <= port < port_base + SHARD_STRIDE * SHARDS:
            click.echo(f"error: {option} {port} is inside the servers' ports "
                       f"{port_base}-{port_base + SHARD_STRIDE * SHARDS - 1}", err=True)
            raise SystemExit(Exit.USAGE)
    if control_port == metrics_port:
        click.echo(f"error: --control-port and --metrics-port are both {control_port}",
                   err=True)
        raise SystemExit(Exit.USAGE)
    texts = {CONFIG_NAME: starter_config(control_port, port_base, metrics_port),
             EXAMPLE_NAME: multi_host_example()}
    there = [name for name in texts if (directory / name).exists()]
    if there and not force:
        click.echo(f"error: {directory}: {', '.join(there)} already there; --force "
                   "replaces", err=True)
        raise SystemExit(Exit.USAGE)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (directory / name).write_text(text)
        click.echo(f"wrote {directory / name}")
    config = directory / CONFIG_NAME
    click.echo(f"start it with: supervisor start {config}   (check it first: supervisor "
               f"validate {config})")
    raise SystemExit(Exit.OK)
