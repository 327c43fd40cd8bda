"""The tie-breaker of a pair across hosts: a lease in etcd that only the serving server holds.

Binary Star alone cannot tell "my peer is dead" from "my peer is behind a partition":
split over two hosts, both servers may serve (rfc.zeromq.org spec:12/CHP leaves failover
to the pattern; the guide says as much of Binary Star). With ``--coordination
etcd://HOST:PORT[,HOST:PORT...]`` a pair server may be ACTIVE only while it holds the
shard's lease in etcd, an existing consensus service; nothing here votes, counts a
quorum or orders writes: etcd does (the decision record is in shards/README.md).

How it is used (``clonemap.shards.pair`` drives it, ``clonemap.shards.bstar`` says when it is wanted):

* **Acquire**: grant a lease of ``lease_s``, then one transaction: if the key
  ``clonemap/<name>/active`` does not exist, put this server's name under the lease. It
  exists while the other server's lease lives: the acquire fails and is tried again every
  ``retry_s`` for as long as it is wanted.
* **Renew**: a keepalive every ``lease_s / 3``. Each success moves the fencing deadline to
  ``sent + ttl x (1 - drift) - margin``, where ``sent`` is when the keepalive left this
  host (etcd starts its new TTL later than that, never earlier).
* **Fencing**: past the deadline the lease may have passed to the peer, so the server
  must have stopped acknowledging by then. ``valid(now)`` says whether it may still;
  the pair checks it before every publish and arms a timer at the deadline.
* **Release**: a server that stops (or stops wanting to serve) revokes its lease, so the
  peer takes over at once instead of after ``lease_s``.

Clock drift: both deadlines run on this host's monotonic clock and on etcd's; a rate
difference up to ``drift`` (default 5%) between the two is covered; a process paused
past its deadline (SIGSTOP, a VM pause) is covered too because the check comes right
before the publish, against a clock that kept running.

The etcd calls use its documented JSON gateway (``/v3/...``, etcd 3.4+), from the standard
library: no gRPC dependency in the server. The calls run on a thread of their own, never
on the server's event loop; the loop learns of changes through ``on_change``.
"""
from __future__ import annotations

import base64
import json
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable
from urllib.parse import urlsplit

log = logging.getLogger("clonemap.shards.coord")

LEASE_S = 5.0
"""Default lease: the longest a dead active's shard waits for its passive (plus
``retry_s``), and the longest a partitioned active goes on acknowledging (less)."""
DRIFT = 0.05
"""Clock rate difference covered between a server and etcd."""
MIN_LEASE_S = 2.0
"""etcd refuses shorter TTLs than ~1.5 election timeouts (1 s by default)."""


class CoordinationError(Exception):
    """etcd could not be reached, or answered what it should not."""


def parse_url(text: str) -> list[tuple[str, int]]:
    """``etcd://HOST:PORT[,HOST:PORT...]`` -> [(host, port), ...]. Raises ValueError."""
    if not text.startswith("etcd://"):
        raise ValueError(f"coordination must be etcd://HOST:PORT[,HOST:PORT...], not {text!r}")
    out = []
    for part in text[len("etcd://"):].split(","):
        split = urlsplit("//" + part.strip())
        try:
            port = split.port
        except ValueError:
            port = None
        if not split.hostname or port is None:
            raise ValueError(f"coordination endpoint {part!r} is not HOST:PORT")
        out.append((split.hostname, port))
    return out


def lease_key(name: str) -> bytes:
    return f"clonemap/{name}/active".encode()


def alone_key(name: str) -> bytes:
    """Set (with no lease: it outlives its writer) by an active that went on without its
    passive: no other server may take the lease while it names someone else."""
    return f"clonemap/{name}/alone".encode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Etcd:
    """etcd's v3 JSON gateway over HTTP, trying each endpoint in turn (the first that
    answers is kept). Every call has ``timeout_s``."""

    def __init__(self, endpoints: list[tuple[str, int]], timeout_s: float = 1.0):
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._first = 0

    def call(self, path: str, body: dict) -> dict:
        import http.client  # (here: only a pair fenced by etcd pays for it at its start)

        data = json.dumps(body).encode()
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            index = (self._first + i) % n
            host, port = self.endpoints[index]
            conn = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
            try:
                conn.request("POST", path, data, {"Content-Type": "application/json"})
                reply = conn.getresponse()
                payload = reply.read()
            except (OSError, http.client.HTTPException) as exc:
                errors.append(f"{host}:{port}: {exc or type(exc).__name__}")
                continue
            finally:
                conn.close()
            if reply.status != 200:
                errors.append(f"{host}:{port}: HTTP {reply.status} {payload[:200]!r}")
                continue
            self._first = index
            try:
                return json.loads(payload)
            except ValueError as exc:
                raise CoordinationError(f"{host}:{port}: not JSON: {exc}") from None
        raise CoordinationError("; ".join(errors))

    def grant(self, ttl_s: float) -> tuple[int, float]:
        """A new lease of ``ttl_s`` rounded to whole seconds: its ID and the TTL etcd
        gave it (which may be shorter than asked: 2.4 s is 2 s; or longer: etcd's
        minimum)."""
        got = self.call("/v3/lease/grant", {"TTL": max(1, round(ttl_s))})
        return int(got["ID"]), float(got.get("TTL", 0))

    def keepalive(self, lease: int) -> float:
        """The lease's TTL after the renewal; 0 when it has already expired."""
        got = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return float(got.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self.call("/v3/lease/revoke", {"ID": str(lease)})

    def put_if_absent(self, key: bytes, value: bytes, lease: int) -> tuple[bool, bytes]:
        """(True, value) when ``key`` was created under ``lease``; else (False, holder)."""
        ok, holder, _ = self.put_unless(key, value, lease)
        return ok, holder

    def put_unless(self, key: bytes, value: bytes, lease: int, unless: bytes = b"",
                   require: bool = False) -> tuple[bool, bytes, bool]:
        """``put_if_absent``, where ``unless`` names a key that must not exist, or must
        hold ``value``, for the put (``require``: it must hold ``value``). The third
        value: the put was made and ``unless`` held ``value`` (one transaction compared
        both)."""
        compare = [{"key": _b64(key), "result": "EQUAL", "target": "CREATE",
                    "create_revision": "0"}]
        other = None
        if unless:
            other = self.get(unless)
            if other is not None and other != value:
                return False, b"(went on alone) " + other, False
            if require and other is None:
                return False, b"(no alone record of this server)", False
            compare.append({"key": _b64(unless), "result": "EQUAL", "target": "VALUE",
                            "value": _b64(value)} if other is not None else
                           {"key": _b64(unless), "result": "EQUAL", "target": "CREATE",
                            "create_revision": "0"})
        got = self.call("/v3/kv/txn", {
            "compare": compare,
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value),
                                         "lease": str(lease)}}],
            "failure": [{"request_range": {"key": _b64(key)}}]})
        if got.get("succeeded"):
            return True, value, other is not None
        for response in got.get("responses", []):
            for kv in response.get("response_range", {}).get("kvs", []):
                return False, base64.b64decode(kv.get("value", "")), False
        return False, b"", False  # deleted in between: the next try takes it

    def put_while_held(self, key: bytes, value: bytes, claim_key: bytes, lease: int) -> int:
        """Put ``value`` only while ``claim_key`` is held under ``lease`` (one
        transaction): the revision it was written at, or 0 when that lease lapsed or was
        revoked, and the claim is gone or another's."""
        got = self.call("/v3/kv/txn", {
            "compare": [{"key": _b64(claim_key), "result": "EQUAL", "target": "LEASE",
                         "lease": str(lease)}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}]})
        if not got.get("succeeded"):
            return 0
        return int(got.get("header", {}).get("revision", 0)) or 1

    def delete_if_revision(self, key: bytes, revision: int) -> bool:
        """Delete ``key`` if it was last changed at ``revision`` (it is still the value
        the caller wrote or read). False: it changed since, or is gone."""
        got = self.call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "MOD",
                         "mod_revision": str(revision)}],
            "success": [{"request_delete_range": {"key": _b64(key)}}]})
        return bool(got.get("succeeded"))

    def put(self, key: bytes, value: bytes) -> int:
        """The revision it was written at."""
        got = self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})
        return int(got.get("header", {}).get("revision", 0))

    def get(self, key: bytes) -> bytes | None:
        return self.get_revision(key)[0]

    def get_revision(self, key: bytes) -> tuple[bytes | None, int]:
        """``key``'s value and the revision that last changed it ((None, 0): none)."""
        got = self.call("/v3/kv/range", {"key": _b64(key)})
        for kv in got.get("kvs", []):
            return base64.b64decode(kv.get("value", "")), int(kv.get("mod_revision", 0))
        return None, 0

    def put_if_revision(self, key: bytes, value: bytes, revision: int) -> bool:
        """Put ``value`` if ``key`` was last changed at ``revision`` (0: if it does not
        exist): one compare-and-swap. False: someone else changed it first."""
        compare = ({"key": _b64(key), "result": "EQUAL", "target": "MOD",
                    "mod_revision": str(revision)} if revision else
                   {"key": _b64(key), "result": "EQUAL", "target": "CREATE",
                    "create_revision": "0"})
        got = self.call("/v3/kv/txn", {
            "compare": [compare],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}]})
        return bool(got.get("succeeded"))

    def delete(self, key: bytes) -> None:
        self.call("/v3/kv/deleterange", {"key": _b64(key)})


@dataclass(frozen=True, slots=True)
class LeaseView:
    """What the loop reads: whether the lease is held, until when (monotonic), by whom."""
    held: bool = False
    valid_until: float = 0.0
    holder: str = ""
    error: str = ""
    alone_mine: bool = False
    """When acquired: etcd's alone record named this server (its last run, or this one,
    went on alone): the server is alone from its first write until its passive holds
    everything again, and clears the record then."""
    generation: int = 0
    """How many times this server has acquired the lease: a new value is a new grant in
    etcd. The loop compares it with the one it took, so that a lease lost and acquired
    again before the loop looked is still a loss (``clonemap.shards.leased``)."""


class Lease:
    """One server's claim on its pair's lease, run on a thread of its own.

    ``want(True)`` makes the thread acquire (retrying every ``retry_s``) and then renew;
    ``want(False)`` revokes a held lease. ``on_change(view)`` is called from the thread
    whenever ``held``, ``holder`` or ``error`` change (the pair hands it to its loop with
    ``call_soon_threadsafe``); ``view`` is always the latest, readable from any thread.
    """

    def __init__(self, etcd: Etcd, name: str, me: str, *, lease_s: float = LEASE_S,
                 drift: float = DRIFT, on_change: Callable[[LeaseView], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if lease_s < MIN_LEASE_S:
            raise ValueError(f"lease_s must be at least {MIN_LEASE_S:g} s, got {lease_s:g}")
        self.etcd = etcd
        self.key = lease_key(name)
        self.alone_key = alone_key(name)
        self.me = me
        self.lease_s = lease_s
        self.drift = drift
        self.margin_s = min(0.5, lease_s / 10)
        self.renew_s = lease_s / 3
        self.retry_s = min(0.2, lease_s / 10)
        self.on_change = on_change
        self.clock = clock
        self.view = LeaseView()
        self.counters = dict.fromkeys(("acquired", "refused", "renewed", "lost", "released",
                                       "errors"), 0)
        self._lease = 0
        self._granted_at = 0.0
        """When the grant of ``_lease`` was asked for (this clock)."""
        self._granted_ttl = 0.0
        """The TTL etcd gave that grant (the deadline counts from it, not ``lease_s``)."""
        self._want = False
        self._only_if_alone = False
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"lease {name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def want(self, wanted: bool, only_if_alone: bool = False) -> None:
        """Acquire and keep the lease (``wanted``), or give it back. ``only_if_alone``:
        acquire only where the alone record names this server (Binary Star's L5)."""
        self._only_if_alone = only_if_alone
        if wanted != self._want:
            self._want = wanted
            self._wake.set()

    def valid(self, now: float) -> bool:
        view = self.view
        return view.held and now < view.valid_until

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread; a held lease is revoked (the peer need not wait it out)."""
        self._stop = True
        self._want = False
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------ the thread
    def _set(self, **changes) -> None:
        old = self.view
        self.view = new = replace(old, **changes)
        if (new.held, new.holder, new.error, new.generation) != \
                (old.held, old.holder, old.error, old.generation) \
                and self.on_change is not None:
            self.on_change(new)

    def _deadline(self, sent: float, ttl: float) -> float:
        return sent + ttl * (1 - self.drift) - self.margin_s

    def _run(self) -> None:
        while not self._stop:
            try:
                wait = self._turn()
            except CoordinationError as exc:
                self.counters["errors"] += 1
                if str(exc) != self.view.error:
                    log.warning("lease %s: etcd: %s", self.key.decode(), exc)
                self._set(error=str(exc))
                wait = self.retry_s
            except Exception:  # a bug must not kill the thread silently
                log.exception("lease %s: unexpected error", self.key.decode())
                wait = self.retry_s
            if self.view.held:  # never sleep past the point of renewing in time
                wait = min(wait, max(0.0, self.view.valid_until - self.clock()
                                     - self.margin_s))
            self._wake.wait(wait)
            self._wake.clear()
        if self._lease:
            self._release()

    def _turn(self) -> float:
        now = self.clock()
        if self.view.held and now >= self.view.valid_until:
            self._lost("not renewed before its deadline")
        if not self._want:
            if self._lease:
                self._release()
            return 3600.0
        if not self.view.held:
            return self._acquire()
        sent = self.clock()
        ttl = self.etcd.keepalive(self._lease)
        if ttl <= 0:
            self._lost("etcd says it expired")
            return 0.0
        self.counters["renewed"] += 1
        self._set(valid_until=max(self.view.valid_until, self._deadline(sent, ttl)),
                  error="")
        return self.renew_s

    def _acquire(self) -> float:
        if self._lease and self.clock() >= self._granted_at + self._granted_ttl:
            # a grant kept across a failed put (an etcd timeout) that outlived its TTL:
            # etcd let it go, and every put under it would fail ("lease not found"), so
            # the server could never acquire again
            self._lease = 0
        if not self._lease:
            # the lease's time runs from its grant, whatever happens after: a put that
            # failed (an etcd timeout) is tried again under the same grant, and the
            # deadline must not count from the retry (it came after etcd's expiry)
            self._granted_at = self.clock()
            self._lease, self._granted_ttl = self.etcd.grant(self.lease_s)
        only_if_alone = self._only_if_alone
        ok, holder, mine = self.etcd.put_unless(self.key, self.me.encode(), self._lease,
                                                unless=self.alone_key,
                                                require=only_if_alone)
        holder_text = holder.decode(errors="replace")
        if not ok:  # the peer holds it: this grant is not kept alive, give it back
            self.counters["refused"] += 1
            lease, self._lease = self._lease, 0
            self._set(holder=holder_text, error="")
            self._revoke_quietly(lease)
            return self.retry_s
        self.counters["acquired"] += 1
        log.info("lease %s: acquired by %s (%g s)%s", self.key.decode(), self.me,
                 self.lease_s, ": the alone record names it" if mine else "")
        self._set(held=True, valid_until=self._deadline(self._granted_at, self._granted_ttl),
                  holder=self.me, error="", alone_mine=mine,
                  generation=self.view.generation + 1)
        return self.renew_s

    def _lost(self, why: str) -> None:
        self.counters["lost"] += 1
        log.warning("lease %s: lost by %s: %s", self.key.decode(), self.me, why)
        lease, self._lease = self._lease, 0  # a new grant for the next acquire
        self._set(held=False, valid_until=0.0, holder="")
        self._revoke_quietly(lease)  # etcd may still count it: let the key go now

    def _revoke_quietly(self, lease: int) -> None:
        try:
            self.etcd.revoke(lease)
        except CoordinationError:
            pass  # unreachable or already gone: it expires by itself

    def _release(self) -> None:
        lease, self._lease = self._lease, 0
        was_held = self.view.held
        self._set(held=False, valid_until=0.0, holder="" if was_held else self.view.holder)
        try:
            self.etcd.revoke(lease)
            if was_held:
                self.counters["released"] += 1
                log.info("lease %s: released by %s", self.key.decode(), self.me)
        except CoordinationError as exc:  # it expires by itself
            log.warning("lease %s: revoke failed (it expires in %g s): %s",
                        self.key.decode(), self.lease_s, exc)

    # ------------------------------------------------------------ alone (blocking calls)
    def record_alone(self) -> None:
        """Say in etcd that this server acknowledges without its passive (before it
        does): the passive, whose copy may now fall behind, can no longer acquire the
        lease. Written only while this server holds the pair's key under its lease (one
        transaction): a server whose lease lapsed while it was about to write must not
        name itself after its peer took over (the record would bar the peer's next
        acquire, with nobody to clear it). Blocking: run it off the loop. Raises
        CoordinationError."""
        lease = self._lease
        if not lease or not self.view.held:
            raise CoordinationError("the pair's lease is not held here")
        if not self.etcd.put_while_held(self.alone_key, self.me.encode(), self.key, lease):
            raise CoordinationError("the pair's lease is no longer this server's")

    def clear_alone(self) -> None:
        """The passive holds everything again: it may take over once more."""
        self.etcd.call("/v3/kv/txn", {
            "compare": [{"key": _b64(self.alone_key), "result": "EQUAL", "target": "VALUE",
                         "value": _b64(self.me.encode())}],
            "success": [{"request_delete_range": {"key": _b64(self.alone_key)}}]})

    def stats(self) -> dict:
        view = self.view
        return {"key": self.key.decode(), "held": view.held, "holder": view.holder,
                "lease_id": self._lease, "generation": view.generation,
                "lease_s": self.lease_s, "error": view.error,
                "valid_for_s": round(max(0.0, view.valid_until - self.clock()), 3)
                if view.held else 0.0, **self.counters}
