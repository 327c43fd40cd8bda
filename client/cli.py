"""``chp``: the clonemap map from a shell (get, set, del, dump, watch, trace, whoami).

::

    chp [--control EP | --config FILE | --servers tcp://H:P[,tcp://H:P2] ...] COMMAND

    chp [-v] get KEY [--hex | --raw]     the value (text + newline, hex, or exact bytes)
    chp set KEY VALUE [--ttl S]          VALUE as text; --hex VALUE, or --file PATH (- stdin)
        [--wait/--no-wait]               wait (default) until the owning shard published it
    chp del KEY                          delete (exit 6 if the key is not there)
    chp del --prefix P [--yes]           delete every key under P (without --yes: the count)
    chp dump [SUBTREE] [--json] [--hex]  every key under SUBTREE, sorted
    chp keys [PREFIX]                    the keys under PREFIX only, sorted, one a line
    chp which KEY [--json]               the shard that owns KEY, its servers, its active
    chp watch [SUBTREE] [--json]         the items, a "synced" line, then live changes
    chp trace SHARD                      every command on the shard's publisher (P+1)
    chp whoami [--json]                  the identity presented, its rights (cluster.whoami)

Where the cluster is: ``--control`` (the supervisor's MDP ``cluster.map``), ``--config``
(a supervisor config, planned here), or ``--servers`` once per shard (a server or a
comma-separated Binary Star pair; N given = N hashed shards). None given:
``$CLONEMAP_CONTROL``, else tcp://127.0.0.1:5555.

A command follows only the shards it needs: ``get /users/42/name`` asks for the subtree
"/users/42/" (one shard); ``dump`` and ``watch`` of "" ask every shard.

Exit codes (``clonemap.shards.common.errors.Exit``, mapped here in ``_exit_code``): 0 ok; 1 other
failure (a server refused this client's CURVE handshake: the line says why); 2 usage or
a bad config; 4 timeout (no cluster reachable, no echo); 5 a watch that fell behind (slow
consumer); 6 key not found (get, del); 130 interrupted (Ctrl-C). Errors: one line on
stderr.

Quiet by default: a one-shot command (get, set, del, dump) prints nothing on stderr
unless it fails (a failover it rode through is not a failure); ``watch`` and ``trace``
also print warnings (a failover, a reset) as ``chp: ...`` lines; ``-v``/``--verbose``
prints the client's whole log (failovers, resumes, reconnections) for any command.
"""
from __future__ import annotations

import binascii
import logging
import sys

import click

from clonemap.shards.common.endpoints import DEFAULT_CONTROL
from clonemap.client.cli_ops import (do_del_prefix, do_dump, do_get, do_keys, do_set, do_trace,
                            do_watch, do_watch_from, do_which, do_whoami)
from clonemap.client.cli_target import DEFAULT_TIMEOUT_S, EXIT_USAGE, BadUsage, Target, run
from clonemap.shards.common.version_option import version_option


# ------------------------------------------------------------------ the command line

LONG_RUNNING = frozenset({"watch", "trace"})
"""Commands that run until stopped: their warnings (a failover, a reset) are shown."""


def quiet_logging(verbose: bool, long_running: bool) -> None:
    """stderr gets ``chp: <message>`` lines: every INFO and above with ``--verbose``,
    warnings and errors for a long-running command, nothing for a one-shot command (its
    failure is the one ``chp: error:`` line)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("chp: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else
                  logging.WARNING if long_running else logging.CRITICAL + 1)


def _value_of(value: str | None, hex_value: bool, path: str | None) -> bytes:
    if path is not None:
        if value is not None:
            raise click.UsageError("give VALUE or --file, not both")
        if path == "-":
            return sys.stdin.buffer.read()
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise click.UsageError(f"--file {path}: {exc.strerror}") from None
    if value is None:
        raise click.UsageError("missing VALUE (or --file PATH)")
    if hex_value:
        try:
            return binascii.unhexlify(value.removeprefix("0x"))
        except (binascii.Error, ValueError):
            raise click.UsageError(f"--hex: {value!r} is not an even number of hex digits") \
                from None
    return value.encode("utf-8")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@version_option("chp")
@click.option("--control", metavar="ENDPOINT", default=None,
              help="The supervisor's control endpoint (MDP cluster.map) [default: "
                   f"$CLONEMAP_CONTROL or {DEFAULT_CONTROL}].")
@click.option("--config", "-c", "config", metavar="FILE", default=None,
              help="A supervisor config: route with its plan, no supervisor needed.")
@click.option("--servers", "-s", multiple=True, metavar="tcp://H:P[,tcp://H:P2]",
              help="One shard per use: a server, or a comma-separated pair (primary,backup).")
@click.option("--timeout-s", type=click.FloatRange(min=0.05), default=DEFAULT_TIMEOUT_S,
              show_default=True, help="How long to wait for the cluster (and for an echo).")
@click.option("--keys", metavar="DIR", default=None,
              help="CURVE: the cluster's keys directory (client.key, client.key_secret, "
                   "server.key) [default: $CLONEMAP_KEYS, or the config's].")
@click.option("--identity", metavar="NAME", default=None,
              help="CURVE: present this named client identity's key pair (the config's "
                   "security.clients) [default: $CLONEMAP_IDENTITY, else the shared "
                   "client pair].")
@click.option("--via", type=click.Choice(["servers", "relays"]), default="servers",
              show_default=True,
              help="Read each shard through its relays (a shard without any: its servers).")
@click.option("--verbose", "-v", is_flag=True,
              help="Print the client's log on stderr (failovers, resumes, reconnections).")
@click.pass_context
def main(ctx: click.Context, control, config, servers, timeout_s, keys, identity, via,
         verbose) -> None:
    """Read, write, dump, watch and trace a clonemap cluster."""
    quiet_logging(verbose, ctx.invoked_subcommand in LONG_RUNNING)
    try:
        ctx.obj = Target(control, config, servers, timeout_s, keys, via, identity)
    except BadUsage as exc:
        click.echo(f"chp: error: {exc}", err=True)
        ctx.exit(EXIT_USAGE)


@main.command("get")
@click.argument("key")
@click.option("--hex", "mode", flag_value="hex", help="Print the value as hex digits.")
@click.option("--raw", "mode", flag_value="raw", help="Print exactly the value's bytes.")
@click.option("--json", "mode", flag_value="json",
              help="One JSON object: the value and its metadata (seq: the sequence that "
                   "last changed it, for --if-seq; expires; props; shard).")
@click.option("--output", "-o", "output", type=click.Choice(["text", "hex", "raw", "json"]),
              default=None, help="The same as --hex, --raw, --json (etcdctl's -w).")
@click.pass_obj
def get_command(target: Target, key: str, mode: str | None, output: str | None) -> None:
    """Print KEY's value (exit 6 if it is not there)."""
    run(target, do_get, key, output or mode or "text")


@main.command("set")
@click.argument("key")
@click.argument("value", required=False)
@click.option("--ttl", type=click.FloatRange(min=0), default=None,
              metavar="S", help="Expire after S seconds.")
@click.option("--hex", "hex_value", is_flag=True, help="VALUE is hex digits (binary values).")
@click.option("--file", "path", metavar="PATH", default=None,
              help="Take the value from a file ('-': stdin).")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the owning shard has published the update back.")
@click.option("--if-seq", "if_seq", type=click.IntRange(min=0), default=None, metavar="S",
              help="Only if KEY was last changed at sequence S (`chp get -o json` says "
                   "it); prints the new sequence; exit 8 on a conflict.")
@click.option("--create", is_flag=True,
              help="Only if KEY is absent; prints the new sequence; exit 8 if it exists.")
@click.pass_obj
def set_command(target: Target, key: str, value, ttl, hex_value, path, wait, if_seq,
                create) -> None:
    """Set KEY to VALUE."""
    run(target, do_set, key, _value_of(value, hex_value, path), ttl, wait, if_seq, create)


@main.command("del")
@click.argument("key")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the owning shard has published the delete back.")
@click.option("--prefix", "prefix", is_flag=True,
              help="KEY is a prefix: delete every key under it (needs --yes).")
@click.option("--yes", is_flag=True, help="With --prefix: really delete them.")
@click.option("--if-seq", "if_seq", type=click.IntRange(min=1), default=None, metavar="S",
              help="Only if KEY was last changed at sequence S; exit 8 on a conflict.")
@click.pass_obj
def del_command(target: Target, key: str, wait: bool, prefix: bool, yes: bool,
                if_seq: int | None) -> None:
    """Delete KEY (exit 6 if it is not there), or with --prefix every key under it."""
    if prefix:
        if if_seq is not None:
            raise click.UsageError("--if-seq goes with one KEY, not --prefix")
        run(target, do_del_prefix, key, yes)
    elif yes:
        raise click.UsageError("--yes goes with --prefix")
    else:
        run(target, do_set, key, None, None, wait, if_seq)


@main.command("dump")
@click.argument("subtree", default="")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (binary as {hex}).")
@click.option("--hex", "hex_all", is_flag=True, help="Every value as hex.")
@click.pass_obj
def dump_command(target: Target, subtree: str, as_json: bool, hex_all: bool) -> None:
    """Print every key under SUBTREE (a key prefix; default all), sorted."""
    run(target, do_dump, subtree, as_json, hex_all)


@main.command("keys")
@click.argument("prefix", default="")
@click.pass_obj
def keys_command(target: Target, prefix: str) -> None:
    """Print the keys under PREFIX (default all), sorted, one a line; no values."""
    run(target, do_keys, prefix)


@main.command("which")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.pass_obj
def which_command(target: Target, key: str, as_json: bool) -> None:
    """Print the shard that owns KEY, its servers (primary, backup) and which serves."""
    run(target, do_which, key, as_json)


@main.command("whoami")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.pass_obj
def whoami_command(target: Target, as_json: bool) -> None:
    """Print the identity this command presents and its rights, as the cluster sees
    them (the supervisor's cluster.whoami)."""
    run(target, do_whoami, as_json)


@main.command("watch")
@click.argument("subtree", default="")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="Stop after this many live changes (default: until Ctrl-C).")
@click.option("--from-seq", "since", type=click.IntRange(min=0), default=None, metavar="S",
              help="Print the changes after sequence S of the shard owning SUBTREE (from "
                   "its history), then live; instead of the items.")
@click.pass_obj
def watch_command(target: Target, subtree: str, as_json: bool, count, since) -> None:
    """Print the items under SUBTREE, "synced", then every change, live."""
    if since is not None:
        run(target, do_watch_from, subtree, as_json, count, since)
    else:
        run(target, do_watch, subtree, as_json, count)


@main.command("trace")
@click.argument("shard")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="Stop after this many messages (default: until Ctrl-C).")
@click.pass_obj
def trace_command(target: Target, shard: str, count) -> None:
    """Print every message on SHARD's publishers (name or index), decoded."""
    run(target, do_trace, shard, count)


if __name__ == "__main__":
    main()
