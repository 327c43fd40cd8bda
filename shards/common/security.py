"""CURVE authentication and encryption for every socket, set up in one place.

A cluster has two key pairs, ZeroMQ certificate files in ``keys_dir`` (the format
``zmq.auth.create_certificates`` writes; secret files mode 0600):

    server.key, server.key_secret    servers, the supervisor's broker and its services
    client.key, client.key_secret    clients, ``chp``, the supervisor's control commands

Every socket that binds (a server's snapshot ROUTER, publisher, collector and Binary
Star state PUB; the MDP broker's ROUTER) is a CURVE server with the server key pair and
the ZAP domain ``clonemap``. Every socket that connects is a CURVE client that knows the
server's public key and presents a key pair of its own: the server pair for servers
(the peer of a pair, MDP workers), the client pair otherwise. The ZAP handler
(``Authenticator``: pyzmq's ``zmq.auth`` thread) admits a peer only if its public key is
one of the ``*.key`` files in ``keys_dir``, and names it by role: the User-Id of its
messages is ``server`` or ``client`` (the broker lets only ``server`` register
``shard.*`` services).

Named client identities (``security.clients`` in a config; ``clonemap.shards.common.rights``)
each have a pair of their own in ``keys_dir/clients/NAME.key`` and ``NAME.key_secret``
(``supervisor keygen`` makes the missing ones). The ZAP handler admits those keys too and
names each by its identity: its User-Id is ``NAME``. A process presents an identity's
pair when it is given one (``identity=``, ``--identity``, ``$CLONEMAP_IDENTITY``).

``Security`` is what the owners of sockets get; ``Security.off()`` (the default) leaves
sockets as plain TCP.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from clonemap.shards.common.errors import ConfigError

ZAP_DOMAIN = "clonemap"
ROLES = ("server", "client")
SERVER, CLIENT = ROLES
IDENTITIES_DIR = "clients"
"""The folder of ``keys_dir`` that holds the named client identities' pairs."""
IDENTITY_ENV = "CLONEMAP_IDENTITY"
"""The identity a client presents when none is given in code or on the command line."""


def key_paths(keys_dir: Path, role: str) -> tuple[Path, Path]:
    return keys_dir / f"{role}.key", keys_dir / f"{role}.key_secret"


def identity_key_paths(keys_dir: Path, name: str) -> tuple[Path, Path]:
    """The public and secret key files of the named client identity ``name``."""
    return key_paths(keys_dir / IDENTITIES_DIR, name)


def create_identity_keys(keys_dir: str | os.PathLike, names) -> list[Path]:
    """A key pair for each named identity that has none yet (an existing pair is never
    touched: its holders keep working). Returns the files written."""
    import zmq.auth

    path = Path(keys_dir) / IDENTITIES_DIR
    written = []
    for name in names:
        public, secret = identity_key_paths(Path(keys_dir), name)
        if public.exists() and secret.exists():
            continue
        path.mkdir(parents=True, exist_ok=True)
        made_public, made_secret = zmq.auth.create_certificates(str(path), name)
        os.chmod(made_secret, stat.S_IRUSR | stat.S_IWUSR)
        written += [Path(made_public), Path(made_secret)]
    return written


def _load_identities(keys_dir: Path) -> dict[bytes, str]:
    """Every named identity's public key (Z85) in ``keys_dir/clients``, with its name."""
    import zmq.auth

    out: dict[bytes, str] = {}
    folder = keys_dir / IDENTITIES_DIR
    if not folder.is_dir():
        return out
    for public_path in sorted(folder.glob("*.key")):
        if public_path.name[:-len(".key")] in ROLES:
            continue  # never an identity: that User-Id would pass for the cluster's own
        try:
            public, _ = zmq.auth.load_certificate(str(public_path))
        except (ValueError, OSError) as exc:
            raise ConfigError(f"{public_path}: not a ZeroMQ certificate ({exc})",
                              field="security.keys_dir") from None
        out[public] = public_path.name[:-len(".key")]
    return out


def _z85(public_key: bytes) -> bytes:
    """A public key as the Z85 text its file holds (a ZAP request carries 32 raw bytes)."""
    if len(public_key) == 32:
        from zmq.utils import z85

        return z85.encode(public_key)
    return public_key


def check_keys_present(keys_dir: str | os.PathLike, config: str,
                       identities=()) -> None:
    """``ConfigError`` (exit 2), one line naming the keygen command for ``config``, when
    any of the four key files a CURVE cluster needs is missing from ``keys_dir``, or the
    public key of a named identity (the servers admit it by that key)."""
    path = Path(keys_dir)
    missing = [p.name for role in ROLES for p in key_paths(path, role) if not p.exists()]
    missing += [f"{IDENTITIES_DIR}/{p.name}" for name in identities
                if not (p := identity_key_paths(path, name)[0]).exists()]
    if missing:
        import shlex

        raise ConfigError(f"{config}: security.keys_dir: the cluster's CURVE keys are "
                          f"missing ({', '.join(missing)} in {path}): create them with: "
                          f"supervisor keygen {shlex.quote(config)}",
                          field="security.keys_dir")


def create_keys(keys_dir: str | os.PathLike, *, force: bool = False) -> list[Path]:
    """Create the server and client key pairs in ``keys_dir``; refuse to overwrite an
    existing key unless ``force``. Returns the files written."""
    import zmq.auth

    path = Path(keys_dir)
    existing = [p for role in ROLES for p in key_paths(path, role) if p.exists()]
    if existing and not force:
        raise ConfigError(f"{existing[0]} exists; keys are never overwritten without "
                          "--force", field="security.keys_dir")
    path.mkdir(parents=True, exist_ok=True)
    written = []
    for role in ROLES:
        public, secret = zmq.auth.create_certificates(str(path), role)
        os.chmod(secret, stat.S_IRUSR | stat.S_IWUSR)
        os.chmod(public, stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
        written += [Path(public), Path(secret)]
    return written


def _load(keys_dir: Path, role: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    public_path, secret_path = key_paths(keys_dir, role)
    path = secret_path if need_secret else public_path
    if not path.exists():
        raise ConfigError(f"{path} is missing: create the cluster's keys with "
                          "`supervisor keygen CONFIG`", field="security.keys_dir")
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{path}: not a ZeroMQ certificate ({exc})",
                          field="security.keys_dir") from None
    return public, secret


@dataclass(frozen=True)
class Security:
    """What a process needs to set CURVE on its sockets (or nothing: ``off``)."""

    curve: bool = False
    keys_dir: Path | None = None
    role: str = CLIENT
    """Which pair this process presents when it connects: ``server`` or ``client``."""
    server_public: bytes = b""
    server_secret: bytes | None = None
    public: bytes = b""
    secret: bytes | None = None
    allowed: frozenset[bytes] = field(default_factory=frozenset)
    identities: dict[bytes, str] = field(default_factory=dict, compare=False)
    """Named client identities' public keys (Z85) and names: admitted, named by name."""
    identity: str | None = None
    """The named identity whose pair this process presents (None: the role's pair)."""

    @classmethod
    def off(cls) -> "Security":
        return cls()

    @classmethod
    def load(cls, keys_dir: str | os.PathLike, role: str,
             identity: str | None = None) -> "Security":
        """The keys a ``role`` process needs: servers bind and so need the server's
        secret; clients need the server's public key and their own pair, the named
        ``identity``'s when one is given."""
        if role not in ROLES:
            raise ValueError(f"role is one of {ROLES}, not {role!r}")
        path = Path(keys_dir)
        server_public, server_secret = _load(path, SERVER, need_secret=role == SERVER)
        if role == SERVER:
            public, secret = server_public, server_secret
        elif identity:
            public, secret = _load_identity(path, identity)
        else:
            public, secret = _load(path, CLIENT, need_secret=True)
        allowed = frozenset(_load(path, r, need_secret=False)[0] for r in ROLES)
        identities = _load_identities(path) if role == SERVER else {}
        return cls(True, path, role, server_public, server_secret, public, secret, allowed,
                   identities, identity or None)

    def bind_side(self, sock: zmq.Socket) -> None:
        """A socket that binds: a CURVE server (needs the server's secret key)."""
        if not self.curve:
            return
        if self.server_secret is None:
            raise ConfigError("only a server holds the server's secret key",
                              field="security.keys_dir")
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()

    def connect_side(self, sock: zmq.Socket) -> None:
        """A socket that connects: a CURVE client presenting this process's pair."""
        if not self.curve:
            return
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret

    def role_of(self, public_key: bytes) -> str | None:
        """``server`` or ``client`` for an admitted public key (Z85, or the 32 raw bytes
        a ZAP request carries), else None."""
        public_key = _z85(public_key)
        if public_key == self.server_public:
            return SERVER
        if public_key in self.allowed:
            return CLIENT
        return self.identities.get(public_key)


def _load_identity(keys_dir: Path, name: str) -> tuple[bytes, bytes | None]:
    import zmq.auth

    public_path, secret_path = identity_key_paths(keys_dir, name)
    if not secret_path.exists():
        raise ConfigError(f"identity {name!r}: {secret_path} is missing (`supervisor keygen "
                          "CONFIG` makes a pair for each identity the config names)",
                          field="identity")
    try:
        return zmq.auth.load_certificate(str(secret_path))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{secret_path}: not a ZeroMQ certificate ({exc})",
                          field="identity") from None


def client_keys(keys_dir: str | os.PathLike | None = None, *, curve: bool = False,
                cluster_keys_dir: str | os.PathLike | None = None,
                source: str = "cluster", identity: str | None = None) -> Security:
    """The key pair a client presents (the client, ``chp``, the control commands):
    ``keys_dir`` when given, else the cluster's keys directory when the cluster uses
    CURVE, else none (plain TCP). A CURVE cluster whose keys directory is unknown is a
    ``ConfigError`` naming what to give. ``identity`` (default ``$CLONEMAP_IDENTITY``):
    present that named identity's pair instead of the shared client pair."""
    identity = identity or os.environ.get(IDENTITY_ENV) or None
    if keys_dir is not None:
        return Security.load(keys_dir, CLIENT, identity)
    if not curve:
        if identity:
            raise ConfigError(f"{source}: identity {identity!r} given, but the cluster "
                              "does not use CURVE (identities are CURVE key pairs)",
                              field="identity")
        return Security.off()
    if cluster_keys_dir is None:
        raise ConfigError(f"{source}: the cluster uses CURVE; give the keys directory "
                          "(keys=DIR, --keys DIR or $CLONEMAP_KEYS: what `supervisor "
                          "keygen` wrote)", field="keys")
    return Security.load(cluster_keys_dir, CLIENT, identity)


class Authenticator:
    """The ZAP handler of one process (one per context that binds): pyzmq's
    ``ThreadAuthenticator`` admitting the public keys of ``keys_dir``, with the User-Id
    set to the key's role. A no-op when CURVE is off."""

    def __init__(self, ctx: zmq.Context, security: Security,
                 names: frozenset[str] | None = None):
        """``names``: admit only these named identities (those the rights name); None:
        every identity key in ``keys_dir/clients``."""
        self.security = security
        self._auth = None
        self.hosts: dict[str, set[str]] = {}
        """The addresses each named identity connected from (ZAP's ``address``: the peer's
        IP), for closing its connections when its rights change (``reset_connections``)."""
        if not security.curve:
            return
        from zmq.auth.thread import ThreadAuthenticator

        hosts = self.hosts

        class _Auth(ThreadAuthenticator):
            def curve_user_id(self, client_public_key: bytes) -> str:
                return security.role_of(client_public_key) or "unknown"

            async def handle_zap_message(self, msg: list[bytes]) -> None:
                if len(msg) >= 7 and msg[5] == b"CURVE":
                    name = security.identities.get(_z85(msg[6]))
                    if name is not None:
                        hosts.setdefault(name, set()).add(msg[3].decode("utf-8", "replace"))
                await super().handle_zap_message(msg)

        self._auth = _Auth(ctx, log=None)
        self._auth.start()
        self._auth.configure_curve(domain=ZAP_DOMAIN, location=str(security.keys_dir))
        # the named identities' keys are admitted too (``role_of`` names them)
        self.admit_identities(names)

    def admit_identities(self, names: frozenset[str] | None = None) -> set[str]:
        """Read ``keys_dir/clients`` again and admit exactly its identities (only those in
        ``names`` when given): a key deleted there, or a name left out, is refused from
        the next handshake on (live connections are the caller's: ``reset_connections``).
        Returns the names no longer admitted."""
        if self._auth is None:
            return set()
        security = self.security
        found = _load_identities(security.keys_dir)
        if names is not None:
            found = {key: name for key, name in found.items() if name in names}
        certs = self._auth.certs.setdefault(ZAP_DOMAIN, {})
        known = security.identities
        removed = [key for key in known if key not in found]
        gone = {known[key] for key in removed}
        # added first, removed one by one: the ZAP thread, reading these dicts meanwhile,
        # never sees a key that stays admitted missing
        certs.update(dict.fromkeys(found, True))
        known.update(found)
        for key in removed:
            certs.pop(key, None)
            known.pop(key, None)
        return gone

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
