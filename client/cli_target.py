"""The ``chp`` command line's plumbing: where the cluster is (``Target``), running a
command on a loop with its deadline and exit code, and the pure helpers its commands
share (values as text, error lines, hints). The commands are ``clonemap.client.cli``; what each
does, ``clonemap.client.cli_ops``."""
from __future__ import annotations

import asyncio
import os
import signal
import sys

import click
import uvloop
import zmq

from clonemap.shards.common.endpoints import DEFAULT_CONTROL
from clonemap.shards.common.endpoints import NOT_LISTENING, ensure_listening
from clonemap.shards.common.errors import (ClonemapError, ConfigError, Exit, HandshakeRefused,
                                  SlowConsumer)
from clonemap.shards.common.proto import chp
from clonemap.client.api import AsyncClone, Conflict
from clonemap.client.router import Cluster, fetch_cluster
from clonemap.shards.common.security import Security, client_keys

DEFAULT_TIMEOUT_S = 5.0

EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE, EXIT_FAILED, EXIT_TIMEOUT, EXIT_SLOW = (
    Exit.OK, Exit.NOT_FOUND, Exit.USAGE, Exit.FAILED, Exit.TIMEOUT, Exit.SLOW)
EXIT_INTERRUPTED = Exit.INTERRUPTED
EXIT_CONFLICT = Exit.CONFLICT


class NotFound(ClonemapError):
    """The key is not in the map."""


# ------------------------------------------------------------------ helpers (pure)

def subtree_of(prefix: str) -> str:
    """The deepest 12/CHP subtree ("" or "/a/.../") that holds every key under
    ``prefix``: "/users/42/name" -> "/users/42/", "/users" -> "", "plain" -> ""."""
    if not prefix.startswith("/"):
        return ""
    cut = prefix.rfind("/")
    sub = prefix[:cut + 1] if cut > 0 else ""
    try:
        chp.check_subtree(sub.encode("utf-8"))
    except ValueError:
        return ""
    return sub


def show_value(value: bytes, hex_all: bool = False) -> str:
    """Text if the value is printable UTF-8 (no control characters), else 0x<hex>."""
    if not hex_all:
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            pass
        else:
            if text.isprintable():
                return text
    return "0x" + value.hex()


def json_value(value: bytes):
    """A JSON string for UTF-8 text, ``{"hex": ...}`` for anything else."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": value.hex()}


def error_line(exc: BaseException, target: "Target") -> str:
    """The one line ``chp: error: ...`` says for ``exc`` (the command line's words, not
    the library's: ``--keys``, not ``keys=``)."""
    if isinstance(exc, HandshakeRefused):
        return f"{exc.endpoint}: " + CLI_HANDSHAKE_WORDS[exc.cause]
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, TimeoutError) and not isinstance(exc, NotFound):
        message += hint_for(exc, target)
    return message


CLI_HANDSHAKE_WORDS = {
    "curve_required": "the cluster requires CURVE: pass --keys DIR or --config CONFIG",
    "key_refused": "the server refused this client's key: --keys must name the cluster's "
                   "keys directory (what `supervisor keygen` wrote)",
    "wrong_server_key": "the CURVE handshake failed: the keys given are not this "
                        "cluster's (its server.key differs)",
    "curve_off": "the cluster does not use CURVE: drop --keys (and $CLONEMAP_KEYS)",
}
"""``errors.HANDSHAKE_CAUSES`` in the command line's words."""


def _exit_code(exc: BaseException) -> int:
    if getattr(exc, "exit_code", None) == Exit.FORBIDDEN:  # a right the identity lacks
        return Exit.FORBIDDEN
    if isinstance(exc, NotFound):
        return EXIT_NOT_FOUND
    if isinstance(exc, Conflict):
        return EXIT_CONFLICT
    if isinstance(exc, (ConfigError, click.UsageError, BadUsage)):
        return EXIT_USAGE
    if isinstance(exc, TimeoutError):
        return EXIT_TIMEOUT
    if isinstance(exc, SlowConsumer):
        return EXIT_SLOW
    if isinstance(exc, (ValueError, TypeError)):
        return EXIT_USAGE  # a bad key, subtree or value
    return EXIT_FAILED


def checked_endpoint(text: str, where: str) -> str:
    """``tcp://IPV4:PORT`` or a usage error naming the option (exit 2, one line)."""
    from clonemap.shards.common.endpoints import parse_endpoint

    try:
        return parse_endpoint(text).replace("tcp://*:", "tcp://127.0.0.1:")
    except ValueError as exc:
        raise BadUsage(f"{where} {text!r}: {exc}") from None


class BadUsage(ClonemapError):
    """A malformed option: one line, exit 2."""

    exit_code = Exit.USAGE


# ------------------------------------------------------------------ running a command

class Target:
    """Where the cluster is, as the global options said."""

    def __init__(self, control: str | None, config: str | None, servers: tuple[str, ...],
                 timeout_s: float, keys: str | None = None, via: str = "servers",
                 identity: str | None = None):
        given = [n for n, v in (("--control", control), ("--config", config),
                                ("--servers", servers)) if v]
        if len(given) > 1:
            raise click.UsageError(f"give one of --control, --config, --servers "
                                   f"(got {' and '.join(given)})")
        self.control = control if (control or config or servers) else \
            os.environ.get("CLONEMAP_CONTROL", DEFAULT_CONTROL)
        if self.control:
            self.control = checked_endpoint(
                self.control, "--control" if control else "$CLONEMAP_CONTROL")
        for entry in servers:
            for address in entry.split(","):
                if address.strip():
                    checked_endpoint(address.strip(), "--servers")
        self.config = config
        self.servers = servers
        self.timeout_s = timeout_s
        self.via = via
        """``relays``: read each shard through its relays (its servers if it has none)."""
        self.identity = identity or None
        """A named client identity to present (``--identity``; else $CLONEMAP_IDENTITY)."""
        self.keys = keys or os.environ.get("CLONEMAP_KEYS") or None
        """CURVE: the cluster's keys directory (a config with ``security.curve`` gives
        its own)."""

    def security(self, cluster: Cluster | None = None) -> Security:
        """The keys to present: ``--keys``, else the cluster's (config), else none."""
        if cluster is None:
            return client_keys(self.keys, identity=self.identity)
        return client_keys(self.keys, curve=cluster.curve, cluster_keys_dir=cluster.keys_dir,
                           source=cluster.source, identity=self.identity)

    def describe(self) -> str:
        if self.config:
            return f"config {self.config}"
        if self.servers:
            return "servers " + " ".join(self.servers)
        return f"control {self.control}"

    def _pairs(self) -> list[list[str]]:
        return [[s for s in entry.split(",") if s.strip()] for entry in self.servers]

    def clone(self, subtree: str = "", only_key: str | None = None) -> AsyncClone:
        self.check_listening()
        kw = dict(subtree=subtree, timeout_s=self.timeout_s, keys=self.keys,
                  only_key=only_key, via=self.via, identity=self.identity)
        if self.config:
            return AsyncClone(config=self.config, **kw)
        if self.servers:
            return AsyncClone(shards=self._pairs(), **kw)
        return AsyncClone(control=self.control, control_timeout_s=self.timeout_s / 2, **kw)

    def check_listening(self) -> None:
        """With ``--control``: a down cluster fails now (exit 4), not after two MDP tries;
        called once a command's own checks passed, just before it connects."""
        if self.control and not self.config and not self.servers:
            ensure_listening(self.control)

    async def cluster(self, ctx: zmq.Context) -> Cluster:
        self.check_listening()
        if self.config:
            return Cluster.from_config(self.config)
        if self.servers:
            return Cluster.from_pairs(self._pairs())
        return await fetch_cluster(self.control, ctx=ctx, timeout_s=self.timeout_s / 2,
                                   security=self.security())


def run(target: Target, coro_fn, *args) -> None:
    """Run ``coro_fn(target, *args)`` on uvloop; map its outcome to an exit code."""
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            code = runner.run(_with_signals(coro_fn(target, *args)))
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    except click.UsageError:
        raise
    except (ClonemapError, ValueError, TypeError, OSError, zmq.ZMQError) as exc:
        click.echo(f"chp: error: {error_line(exc, target)}", err=True)
        raise SystemExit(_exit_code(exc)) from None
    raise SystemExit(code or EXIT_OK)


def hint_for(exc: TimeoutError, target: Target) -> str:
    """The likely cause of a timeout, in words, from what the client saw."""
    what = getattr(exc, "what", "")
    text = str(exc)
    if what == "echo":
        return (" (the shard took the write but did not publish it: it has no ACTIVE "
                "server now, or it dropped the write; `supervisor status` shows both, and "
                "a dropped write is counted in its server's drops)")
    if what == "snapshot":
        if "authentication" in text or "handshake" in text:
            return ""  # the link's own words say it
        if "refused" in text or "PASSIVE" in text or "vote" in text:
            return (" (a server refused to serve: the pair has no ACTIVE server now; see "
                    "`supervisor status`)")
        return f" (no snapshot from the servers: is the cluster up? tried {target.describe()})"
    if what.startswith("mdp service") or what == NOT_LISTENING:
        return f" (no cluster map: is the supervisor up? tried {target.describe()})"
    return f" (is the cluster up? tried {target.describe()})"


async def _with_signals(coro):
    """Ctrl-C (SIGINT) ends a long command (watch, trace) with 130, SIGTERM with 0; both
    close the sockets first. (Installed explicitly: a shell's background job starts with
    SIGINT ignored, and Python then would not raise KeyboardInterrupt.)"""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    got: list[int] = []

    def stop(signum: int) -> None:
        got.append(signum)
        task.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop, signum)
    try:
        return await task
    except asyncio.CancelledError:
        if got:
            return EXIT_INTERRUPTED if got[0] == signal.SIGINT else EXIT_OK
        raise
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def check_key_text(key: str) -> None:
    chp.check_key(key.encode("utf-8"))


def _out(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


