"""``supervisor keygen CONFIG [--force]``: create the cluster's CURVE key pairs in the
config's ``security.keys_dir`` (default ``keys/`` beside the config): ``server.key``,
``server.key_secret``, ``client.key``, ``client.key_secret`` (secret files mode 0600),
and a pair for each named client identity of ``security.clients`` that has none yet
(``clients/NAME.key``, ``clients/NAME.key_secret``).

Existing pairs are kept: the cluster's are replaced only with ``--force``, and an
identity's never (delete its two files to replace it; its holders then need the new
ones). A call that finds every pair already there writes nothing and exits 2.
"""
from __future__ import annotations

import click

from clonemap.shards.common.config import load_config
from clonemap.shards.common.errors import ConfigError, Exit
from clonemap.shards.common.security import (ROLES, create_identity_keys, create_keys,
                                             key_paths)


@click.command("keygen")
@click.argument("config", metavar="CONFIG")
@click.option("--force", is_flag=True, help="Replace the cluster's existing pairs (every "
                                              "server and client then needs the new ones).")
def command(config: str, force: bool) -> None:
    """Create the cluster's CURVE keys, and each named identity's, in CONFIG's
    security.keys_dir."""
    try:
        cluster = load_config(config)
        keys_dir = cluster.keys_dir
        present = all(p.exists() for role in ROLES for p in key_paths(keys_dir, role))
        identities = list(cluster.security.clients)
        written = [] if present and identities and not force else \
            create_keys(keys_dir, force=force)
        made = create_identity_keys(keys_dir, identities)
        if not written and not made:
            raise ConfigError(f"{config}: every key pair exists in {keys_dir}; nothing "
                              "written (keys are never overwritten without --force)",
                              field="security.keys_dir")
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(exc.exit_code) from None
    for path in written + made:
        click.echo(f"wrote {path}" + ("  (secret: mode 0600)" if path.name.endswith(
            "_secret") else ""))
    if written:
        click.echo("give clients client.key, client.key_secret and server.key; keep "
                   "server.key_secret on the cluster's hosts only")
    if made:
        click.echo("give each identity its own clients/NAME.key and NAME.key_secret, and "
                   "server.key")
    raise SystemExit(Exit.OK)
