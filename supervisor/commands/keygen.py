"""``supervisor keygen CONFIG [--force]``: create the cluster's CURVE key pairs in the
config's ``security.keys_dir`` (default ``keys/`` beside the config): ``server.key``,
``server.key_secret``, ``client.key``, ``client.key_secret`` (secret files mode 0600).
Existing keys are never overwritten without ``--force`` (exit 2).
"""
from __future__ import annotations

import click

from clonemap.shards.common.config import load_config
from clonemap.shards.common.errors import ConfigError, Exit
from clonemap.shards.common.security import create_keys


@click.command("keygen")
@click.argument("config", metavar="CONFIG")
@click.option("--force", is_flag=True, help="Replace existing keys (every server and "
                                              "client then needs the new ones).")
def command(config: str, force: bool) -> None:
    """Create the cluster's CURVE keys in CONFIG's security.keys_dir."""
    try:
        keys_dir = load_config(config).keys_dir
        written = create_keys(keys_dir, force=force)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(exc.exit_code) from None
    for path in written:
        click.echo(f"wrote {path}" + ("  (secret: mode 0600)" if path.name.endswith(
            "_secret") else ""))
    click.echo("give clients client.key, client.key_secret and server.key; keep "
               "server.key_secret on the cluster's hosts only")
    raise SystemExit(Exit.OK)
