"""The control commands' side of the control plane: finding the supervisor
(``--control``, ``--config``, ``$CLONEMAP_CONTROL``), calling its MDP/0.2 services with a
deadline, and the click helpers every control command shares. The services themselves
are ``clonemap.supervisor.services``; what both sides agree on is ``clonemap.supervisor.protocol``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

from clonemap.shards.common.errors import ClonemapError, ConfigError, Exit, HandshakeRefused
from clonemap.shards.common.endpoints import DEFAULT_CONTROL, ensure_listening, parse_endpoint
from clonemap.shards.common.mdp.client import SyncMdpClient
from clonemap.shards.common.security import Security, client_keys
from clonemap.supervisor.protocol import check_target

CONTROL_TIMEOUT_S = 3.0
EXIT_NOT_FOUND = Exit.NOT_FOUND
EXIT_USAGE = Exit.USAGE


class Control(str):
    """A control endpoint, with the CURVE keys to reach it (``security``)."""

    security: Security

    def __new__(cls, endpoint: str, security: Security | None = None):
        out = super().__new__(cls, endpoint)
        out.security = security or Security.off()
        return out


def _load_config(path: str):
    """``load_config``, imported when a CONFIG is named: the config's models (pydantic)
    cost ~0.1 s of a command's start, which ``supervisor status``, ``kill`` or ``stop``
    with ``--control`` or none at all do not need."""
    from clonemap.shards.common.config import load_config

    return load_config(path)


def resolve_control(control: str | None, config: str | None, host: str | None = None,
                    identity: str | None = None) -> Control:
    """The control endpoint: ``--control``, else the CONFIG's ``control`` (for a config
    with ``hosts``: that of ``--host NAME``), else $CLONEMAP_CONTROL, else the default. A
    wildcard bind is reached on 127.0.0.1. CURVE keys: ``$CLONEMAP_KEYS`` (a keys
    directory), else the CONFIG's (with ``security.curve``), else none
    (``clonemap.shards.common.security.client_keys``); ``identity`` (else
    ``$CLONEMAP_IDENTITY``): present that named identity's pair."""
    cluster = _load_config(config) if config else None
    if control:
        endpoint = _checked(control, "--control")
    elif cluster is not None and cluster.hosts is not None:
        if host is None or host not in cluster.hosts:
            raise ConfigError(
                f"{config}: this cluster runs on hosts {', '.join(sorted(cluster.hosts))}: "
                + ("say which host's supervisor with --host NAME" if host is None
                   else f"{host!r} is not one of them"), field="--host")
        endpoint = cluster.hosts[host].control
    elif cluster is not None:
        endpoint = cluster.control
    else:
        endpoint = _checked(os.environ.get("CLONEMAP_CONTROL", DEFAULT_CONTROL),
                            "$CLONEMAP_CONTROL")
    security = client_keys(os.environ.get("CLONEMAP_KEYS") or None,
                           curve=cluster is not None and cluster.security.curve,
                           cluster_keys_dir=cluster.keys_dir if cluster is not None else None,
                           source=str(config), identity=identity)
    return Control(endpoint.replace("tcp://*:", "tcp://127.0.0.1:"), security)


def _checked(endpoint: str, where: str) -> str:
    try:
        return parse_endpoint(endpoint)
    except ValueError as exc:
        raise ConfigError(f"{where} {endpoint!r}: {exc}", field=where) from None


class ReplyError(ClonemapError):
    """A control service answered with a status other than 200."""

    def __init__(self, status: str, text: str):
        super().__init__(f"{status} {text}")
        self.status = status
        self.text = text
        self.exit_code = {"404": EXIT_NOT_FOUND, "400": EXIT_USAGE,
                          "403": Exit.FORBIDDEN}.get(status, Exit.FAILED)


def call(endpoint: str, service: str, *body: bytes, timeout_s: float = CONTROL_TIMEOUT_S,
         retries: int = 1, on_partial: Callable[[bytes], None] | None = None) -> bytes:
    """One control request; returns the FINAL payload after the 200 status. Raises
    ``clonemap.shards.common.errors.Timeout`` when no supervisor answers, ``ReplyError`` otherwise.
    Commands that act (kill, restart, stop) pass ``retries=0``: never sent twice."""
    ensure_listening(endpoint)
    with SyncMdpClient(endpoint, timeout_s=timeout_s, retries=retries,
                       security=getattr(endpoint, "security", None)) as client:
        with client.stream(service, *body) as stream:
            for partial in stream:
                if on_partial is not None:
                    on_partial(partial[-1])
        final = stream.final or [b""]
    status = final[0].decode("utf-8", "replace")
    payload = final[1] if len(final) > 1 else b""
    if status != "200":
        raise ReplyError(status, payload.decode("utf-8", "replace"))
    return payload


def ping(endpoint: str, service: str, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
    """Check that a supervisor answers and hosts ``service`` (MMI ``mmi.service``);
    ``Timeout`` if nobody answers, ``ReplyError`` 404 if it lacks the service."""
    ensure_listening(endpoint)
    with SyncMdpClient(endpoint, timeout_s=timeout_s, retries=1,
                       security=getattr(endpoint, "security", None)) as client:
        reply = client.request("mmi.service", service.encode())
    if reply[:1] != [b"200"]:
        raise ReplyError("404", f"the supervisor at {endpoint} has no service {service!r}")


def act(service: str, target: str, sel: "Selection",
        reply_timeout_s: float | None = None) -> dict:
    """A command that acts on one server (``cluster.kill``, ``cluster.restart``): check
    the target, check a supervisor answers, then send the request once (never retried:
    it must not act twice) and return its JSON reply."""
    name = checked_target(target)
    endpoint = sel.endpoint()
    ping(endpoint, service, sel.timeout_s)
    return json.loads(call(endpoint, service, name.encode(),
                           timeout_s=reply_timeout_s or sel.timeout_s, retries=0))


def status_rows(endpoint: str, timeout_s: float = CONTROL_TIMEOUT_S) -> tuple[list[dict], dict]:
    """``cluster.status``: (one dict per server, the summary)."""
    rows: list[dict] = []
    payload = call(endpoint, "cluster.status", timeout_s=timeout_s,
                   on_partial=lambda body: rows.append(json.loads(body)))
    return rows, json.loads(payload)


def run_command(fn: Callable[[], int | None]) -> None:
    """Run a control command's body; map errors to one line on stderr and an exit code
    (4 when no supervisor answers: ``clonemap.shards.common.errors.Timeout``)."""
    import click

    try:
        code = fn()
    except ReplyError as exc:
        click.echo(f"error: {exc.text} (status {exc.status})", err=True)
        raise SystemExit(exc.exit_code) from None
    except ConfigError as exc:
        for line in str(exc).splitlines():
            click.echo(f"error: {line}", err=True)
        raise SystemExit(exc.exit_code) from None
    except HandshakeRefused as exc:
        words = CONTROL_HANDSHAKE_WORDS[exc.cause].replace(
            "COMMAND", click.get_current_context().info_name or "COMMAND")
        click.echo(f"error: {exc.endpoint}: {words}", err=True)
        raise SystemExit(exc.exit_code) from None
    except ClonemapError as exc:
        hint = (" (is the supervisor running? start it with: supervisor start CONFIG)"
                if isinstance(exc, TimeoutError) else "")
        click.echo(f"error: {exc}{hint}", err=True)
        raise SystemExit(exc.exit_code) from None
    raise SystemExit(code or 0)


CONTROL_HANDSHAKE_WORDS = {
    "curve_required": "the cluster requires CURVE: give its CONFIG (supervisor COMMAND "
                      "CONFIG) or set $CLONEMAP_KEYS to its keys directory",
    "key_refused": "the supervisor refused this client's key: $CLONEMAP_KEYS must name "
                   "the cluster's keys directory (what `supervisor keygen` wrote)",
    "wrong_server_key": "the CURVE handshake failed: the keys given are not this "
                        "cluster's (its server.key differs)",
    "curve_off": "the cluster does not use CURVE: unset $CLONEMAP_KEYS",
}
"""``errors.HANDSHAKE_CAUSES`` in the control commands' words."""


@dataclass(frozen=True)
class Selection:
    """Which cluster a control command talks to, and how long it waits: from its own
    ``[CONFIG]``, ``--config``, ``--control`` and ``--timeout-s``, else the same options
    given before the command (``supervisor --control EP status``), else
    ``$CLONEMAP_CONTROL``, else the default endpoint."""

    control: str | None
    config: str | None
    timeout_s: float
    host: str | None = None
    identity: str | None = None

    def endpoint(self) -> Control:
        return resolve_control(self.control, self.config, self.host, self.identity)

    def hosts(self) -> list[str]:
        """The host names of a config over several hosts (none for one host or none)."""
        if self.control or not self.config:
            return []
        cluster = _load_config(self.config)
        return sorted(cluster.hosts) if cluster.hosts else []

    def on_host(self, host: str) -> "Selection":
        return Selection(self.control, self.config, self.timeout_s, host, self.identity)


def control_options(fn):
    """``[CONFIG]``, ``--control EP``, ``--config CONFIG`` and ``--timeout-s`` for a
    control command; the command receives them as one ``sel: Selection``."""
    import functools

    import click

    @functools.wraps(fn)
    def wrapper(*args, config_arg=None, control=None, config=None, timeout_s=None,
                host=None, identity=None, **kw):
        root = click.get_current_context().find_root().params
        if config_arg and config and config_arg != config:
            raise click.UsageError(f"two configs: {config_arg} and --config {config}")
        sel = Selection(control or root.get("control"),
                        config or config_arg or root.get("config"),
                        timeout_s or root.get("timeout_s") or CONTROL_TIMEOUT_S,
                        host or root.get("host"), identity or root.get("identity"))
        return fn(*args, sel=sel, **kw)

    for decorate in reversed(common_options(positional=True)):
        wrapper = decorate(wrapper)
    return wrapper


def common_options(positional: bool = False) -> list:
    """The cluster-selection options, for the group (before a command) and each command
    (after it); defaults are None so that either place can give them."""
    import click

    out = []
    if positional:
        out.append(click.argument("config_arg", metavar="[CONFIG]", required=False))
    out += [
        click.option("--control", metavar="ENDPOINT", default=None,
                     help="The supervisor's control endpoint [default: the CONFIG's, else "
                          f"$CLONEMAP_CONTROL, else {DEFAULT_CONTROL}]."),
        click.option("--config", "-c", "config", metavar="CONFIG", default=None,
                     help="Take the control endpoint (and CURVE keys) from this config."),
        click.option("--host", metavar="NAME", default=None,
                     help="A config over several hosts: talk to this host's supervisor "
                          "(status asks every host when none is named)."),
        click.option("--identity", metavar="NAME", default=None,
                     help="Present this named client identity's key pair (security.clients; "
                          "default $CLONEMAP_IDENTITY, else the shared client pair)."),
        click.option("--timeout-s", type=click.FloatRange(min=0.05), default=None,
                     help=f"How long to wait for the supervisor [default: "
                          f"{CONTROL_TIMEOUT_S:g}; per attempt, 2 attempts]."),
    ]
    return out


def target_argument(fn):
    """The SHARD/ROLE argument (checked by ``checked_target`` inside the command)."""
    import click

    return click.argument("target", metavar="SHARD/ROLE")(fn)


def checked_target(text: str) -> str:
    """``check_target`` for a command line: a malformed target exits 2 (usage)."""
    try:
        return check_target(text)
    except ValueError as exc:
        raise ReplyError("400", str(exc)) from None
