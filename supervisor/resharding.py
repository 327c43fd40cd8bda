"""``cluster.reshard``: change the running cluster's routing under a new epoch.

This is the first step of resharding (issue 41): the routing epoch and the flip. What
it applies now is a change of the pins among the running shards that moves no key: a
prefix that holds no key yet pinned to another shard (the new tenant's prefix placed
before it writes), or a pin removed or moved while its prefix is empty. A change that
would move keys, or change the shard count, is answered with its plan (keys and bytes,
source -> target) and refused: segment moves with a bounded hold are not built yet.

How a change is applied (``Resharding.apply``):

1. every running server counts the keys it holds that the new routing places on another
   shard (``routing``/``count`` on its control service); one that does not answer, or
   any key that would move, refuses the change;
2. the new routing, with the next epoch, is written to the run directory (durable: a
   supervisor restarted from here on serves it);
3. it is installed on the servers of the shards that give up a prefix first, then on
   the rest: a server installs it on its reactor only if it still holds no key the
   routing places elsewhere, and writes it to its data directory first. Between the two
   waves a write to a moving prefix is dropped by its old shard (``not_owner``) and not
   yet owned by its new one: never two shards accept it;
4. if a server refuses (a key was written to the prefix after the count), the old
   routing is installed everywhere under the epoch after that, and the change is
   refused: epochs only grow;
5. servers that are not running get the routing on their next start (their command
   line); the cluster map (``cluster.map``) serves it at once. Clients learn the new
   epoch from the next HUGZ and follow (``clonemap.client.health``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Callable

from clonemap.shards.common.errors import ConfigError
from clonemap.shards.common.mdp.client import MdpClient
from clonemap.shards.common.placement import Plan, RoutingParams
from clonemap.shards.common.errors import ProtocolError
from clonemap.shards.common.proto.chp import check_subtree
from clonemap.shards.common.routing import (MOVE_COMMAND, ROUTING_COMMAND, ROUTING_COUNT,
                                            ROUTING_FORGET, ShardMap)
from clonemap.supervisor import routing_state
from clonemap.supervisor.process import RUNNING
from clonemap.supervisor.protocol import stats_service

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 5.0
"""How long one server may take to count or install (a count is one pass over its map)."""
HOLD_BOUND_S = 0.5
"""How long a moving prefix's writes may be held (the source holds them while the copy
catches up); past it the hold is released and the move tried again."""
HOLD_ATTEMPTS = 3
COPY_WAIT_S = 120.0
"""How long the copy may take to arrive and come within ``CATCH_UP`` of the source."""
CATCH_UP = 1000
"""Source updates the copy may trail by before the hold begins."""
POLL_S = 0.005


def _copy(stats: dict) -> dict:
    """The import's figures in a server's stats (empty figures while it has none)."""
    got = (stats.get("move") or {}).get("import")
    return got or {"copied": False, "source_seq": -1, "keys": 0}


class Refused(Exception):
    """A change this supervisor does not apply: ``status`` is the control reply's."""

    def __init__(self, status: bytes, text: str, plan: dict | None = None):
        super().__init__(text)
        self.status, self.text, self.plan = status, text, plan


def parse_change(body: list[bytes]) -> tuple[ShardMap, bool]:
    """A request's body: JSON {shards, pins: [[prefix, shard], ...], apply}."""
    try:
        doc = json.loads(body[0])
        pins: dict[int, list[str]] = {}
        for prefix, shard in doc.get("pins", []):
            pins.setdefault(shard, []).append(prefix)
        return ShardMap(doc["shards"], pins), bool(doc.get("apply"))
    except (IndexError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise Refused(b"400", f"not a routing change: {exc}") from None
    except ConfigError as exc:
        raise Refused(b"400", str(exc)) from None


def moved_prefixes(old: ShardMap, new: ShardMap) -> dict[str, tuple[int, int]]:
    """Each pinned prefix (of either map) whose owner changes: prefix -> (from, to)."""
    out = {}
    for prefix in sorted(set(old.pins) | set(new.pins)):
        was, now = old.owner(prefix), new.owner(prefix)
        if was != now:
            out[prefix] = (was, now)
    return out


class Resharding:
    """The cluster's routing as this supervisor serves it, and its changes."""

    def __init__(self, plan: Plan, runner, run_dir: Path, endpoint: str, ctx, security,
                 on_changed: Callable[[Plan], None]):
        self.plan = plan
        self.runner = runner
        self.run_dir = Path(run_dir)
        self.endpoint, self.ctx, self.security = endpoint, ctx, security
        self.on_changed = on_changed
        """Called with the plan under each new routing (the cluster map is rebuilt)."""
        self.hold_bound_s = HOLD_BOUND_S
        self._lock = asyncio.Lock()

    @property
    def routing(self) -> ShardMap:
        return self.plan.routing.shard_map()

    async def _ask(self, name: str, *body: bytes) -> dict:
        proc = self.runner.servers[name]
        client = MdpClient(self.endpoint, ctx=self.ctx, timeout_s=ASK_TIMEOUT_S, retries=0,
                           security=self.security)
        try:
            reply = await client.request(stats_service(proc.plan.shard, proc.plan.role),
                                         *body)
            return json.loads(reply[-1])
        finally:
            await client.close()

    def _running(self) -> list[str]:
        return [name for name, proc in self.runner.servers.items() if proc.state == RUNNING]

    async def count(self, new: ShardMap) -> dict:
        """The plan: for each source shard, the keys and bytes it would give each target
        (the largest count among its servers: a pair's two hold the same keys)."""
        doc = json.dumps(new.describe()).encode()
        names = self._running()
        answers = await asyncio.gather(*(self._ask(n, ROUTING_COMMAND, doc, ROUTING_COUNT)
                                         for n in names), return_exceptions=True)
        moves: dict[tuple[int, int], list[int]] = {}
        for name, got in zip(names, answers):
            leaving = got.get("routing_leaving") if isinstance(got, dict) else None
            if not isinstance(leaving, dict):
                raise Refused(b"503", f"server {name} did not count the keys it would give "
                                      f"up ({got!r}); nothing was changed")
            source = self.runner.servers[name].plan.index
            for target, (keys, size) in leaving.items():
                row = moves.setdefault((source, int(target)), [0, 0])
                row[0], row[1] = max(row[0], keys), max(row[1], size)
        return {"moves": [{"from": s, "to": t, "keys": k, "bytes": b}
                          for (s, t), (k, b) in sorted(moves.items())],
                "prefixes": {p: list(st) for p, st in
                             moved_prefixes(self.routing, new).items()},
                "servers_counted": names}

    async def change(self, new: ShardMap, apply: bool) -> dict:
        async with self._lock:
            old = self.routing
            if new.shards != old.shards:
                raise Refused(b"409", f"the routing has {old.shards} shards and the change "
                                      f"{new.shards}: growing or shrinking moves keys between "
                                      "shards, which this version does not do yet")
            if new == old:
                return {"epoch": old.epoch, "changed": False, "moves": [], "prefixes": {}}
            plan = await self.count(new)
            plan.update(epoch=old.epoch, next_epoch=old.epoch + 1, changed=False)
            if not apply:
                return plan
            moving = sum(m["keys"] for m in plan["moves"])
            if not moving:
                return await self._flip(old, new.with_epoch(old.epoch + 1), plan)
            return await self._move_all(old, new, plan)

    # ------------------------------------------------------------------ moves
    async def _move_all(self, old: ShardMap, new: ShardMap, plan: dict) -> dict:
        """Keys move: one pinned prefix at a time, each under its own epoch."""
        prefixes = moved_prefixes(old, new)
        for prefix in prefixes:
            try:
                check_subtree(prefix.encode("utf-8"))
            except ProtocolError:
                raise Refused(b"409", f"prefix {prefix!r} holds keys and is not a subtree "
                                      "(\"/a/\", \"/a/b/\"): only whole subtrees move",
                              plan) from None
        started = time.monotonic()
        steps = []
        for prefix, (source, target) in prefixes.items():
            current = self.routing
            pins = current.pins
            now_owner = new.pins.get(prefix)
            if now_owner is None:
                pins.pop(prefix, None)
            else:
                pins[prefix] = now_owner
            by_shard: dict[int, list[str]] = {}
            for p, i in pins.items():
                by_shard.setdefault(i, []).append(p)
            step = ShardMap(current.shards, by_shard, epoch=current.epoch + 1)
            steps.append(await self._move(current, step, prefix, source, target))
        plan.update(epoch=self.routing.epoch, changed=True, steps=steps,
                    servers=self._running(), at=time.time(),
                    took_s=round(time.monotonic() - started, 3))
        return plan

    def _of_shard(self, index: int) -> list[str]:
        return [n for n in self._running() if self.runner.servers[n].plan.index == index]

    async def _active_of(self, index: int) -> str:
        """The running server of shard ``index`` that says it is active."""
        for name in self._of_shard(index):
            stats = await self._ask(name)
            if stats.get("active") and self.runner.servers[name].plan.role in (
                    "primary", "backup"):
                return name
        raise Refused(b"503", f"shard {index} has no active server now; nothing was moved")

    async def _step(self, name: str, op: str, **args) -> dict:
        got = await self._ask(name, MOVE_COMMAND, json.dumps(dict(args, op=op)).encode())
        if got.get("move_refused"):
            raise Refused(b"409", f"{name} refused {op}: {got['move_refused']}")
        return got

    async def _until(self, name: str, done: Callable[[dict], bool], within_s: float,
                     what: str) -> dict:
        deadline = time.monotonic() + within_s
        while True:
            got = await self._ask(name)
            move = (got.get("move") or {}).get("import") or {}
            if move.get("error"):
                raise Refused(b"409", f"{name}: the copy failed: {move['error']}")
            if done(got):
                return got
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what} not within {within_s:g} s")
            await asyncio.sleep(POLL_S)

    async def _move(self, old: ShardMap, new: ShardMap, prefix: str, source: int,
                    target: int) -> dict:
        """Move ``prefix`` from shard ``source`` to ``target`` (module doc, *Moving a
        prefix*); returns what it took."""
        src, dst = await self._active_of(source), await self._active_of(target)
        src_plan = self.runner.servers[src].plan
        pair = self.plan.shards[target]
        collector = ",".join(s.endpoint("collector") for s in (pair.primary, pair.backup))
        began = time.monotonic()
        await self._step(dst, "import", source=f"tcp://{src_plan.address}:{src_plan.port}",
                         prefix=prefix)
        try:
            for attempt in range(1, HOLD_ATTEMPTS + 1):
                # copied, and its tail within CATCH_UP of the source
                src_seq = (await self._ask(src)).get("seq", 0)
                got = await self._until(dst, lambda g: _copy(g)["copied"] and
                                        _copy(g)["source_seq"] >= src_seq - CATCH_UP,
                                        COPY_WAIT_S, f"the copy of {prefix!r}")
                copied_s = time.monotonic() - began
                held = await self._step(src, "hold", prefix=prefix)
                hold_seq = held["move"]["hold"]["seq"]
                hold_began = time.monotonic()
                try:
                    got = await self._until(dst, lambda g: _copy(g)["source_seq"] >= hold_seq,
                                            self.hold_bound_s, "the copy's catch-up")
                    break
                except TimeoutError:
                    await self._step(src, "release")
                    log.warning("move of %r: the copy did not catch up within the hold "
                                "bound (%.3f s), attempt %d; released", prefix,
                                self.hold_bound_s, attempt)
            else:
                raise Refused(b"409", f"the copy of {prefix!r} did not catch up within the "
                                      f"hold bound ({self.hold_bound_s:g} s) in "
                                      f"{HOLD_ATTEMPTS} tries; the move was rolled back")
        except BaseException:
            await asyncio.gather(self._step(dst, "stop-import"), return_exceptions=True)
            raise
        keys = _copy(got)["keys"]
        # the flip: durable here first, then the target, then the source
        self._commit(new)
        try:
            await self._step(dst, "commit", routing=new.describe())
        except Refused:
            back = old.with_epoch(new.epoch + 1)
            self._commit(back)
            await self._step(src, "release")
            await self._install(back, self._running())
            raise
        await self._install(new, [n for n in self._of_shard(target) if n != dst])
        forgot = await self._install(new, [src], forget=True, forward=collector)
        await self._install(new, [n for n in self._of_shard(source) if n != src],
                            forget=True)
        await self._install(new, [n for n in self._running()
                                  if self.runner.servers[n].plan.index not in (source,
                                                                               target)])
        hold_s = time.monotonic() - hold_began
        log.info("moved %r: shard %d -> %d, %d keys, epoch %d, copy %.3f s, hold %.3f s%s",
                 prefix, source, target, keys, new.epoch, copied_s, hold_s,
                 f" (not on {forgot})" if any(forgot.values()) else "")
        return {"prefix": prefix, "from": source, "to": target, "keys": keys,
                "epoch": new.epoch, "copy_s": round(copied_s, 3),
                "hold_s": round(hold_s, 3), "attempts": attempt}

    async def _install(self, shard_map: ShardMap, names: list[str], forget: bool = False,
                       forward: str = "") -> dict[str, str]:
        """Install on ``names``; name -> why refused ("" installed). ``forget``: the keys
        it moves have moved (``forward``: where the held writes go)."""
        doc = json.dumps(shard_map.describe()).encode()
        extra = (ROUTING_FORGET, forward.encode()) if forget else ()
        answers = await asyncio.gather(*(self._ask(n, ROUTING_COMMAND, doc, *extra)
                                         for n in names), return_exceptions=True)
        out = {}
        for name, got in zip(names, answers):
            if isinstance(got, dict):
                out[name] = got.get("routing_refused") or ""
            else:
                out[name] = f"no answer ({type(got).__name__}: {got})"
        return out

    async def _flip(self, old: ShardMap, new: ShardMap, plan: dict) -> dict:
        self._commit(new)  # durable first: a restarted supervisor serves it
        giving = {src for src, _ in moved_prefixes(old, new).values()}
        names = self._running()
        first = [n for n in names if self.runner.servers[n].plan.index in giving]
        rest = [n for n in names if n not in first]
        refused = {}
        for wave in (first, rest):
            refused.update({n: why for n, why in (await self._install(new, wave)).items()
                            if why})
            if refused:
                break
        if refused:  # back to the old routing, under the epoch after
            back = old.with_epoch(new.epoch + 1)
            self._commit(back)
            again = {n: why for n, why in (await self._install(back, names)).items() if why}
            log.error("routing: epoch %d refused by %s; epoch %d restores the old routing%s",
                      new.epoch, refused, back.epoch,
                      f" (not yet on {', '.join(again)})" if again else "")
            raise Refused(b"409", "refused by " + "; ".join(
                f"{n}: {why}" for n, why in sorted(refused.items())) +
                f"; the old routing is back as epoch {back.epoch}", plan)
        log.info("routing: epoch %d installed on %d servers (%s)", new.epoch, len(names),
                 ", ".join(f"{p} {a}->{b}" for p, (a, b) in plan["prefixes"].items()))
        plan.update(epoch=new.epoch, changed=True, servers=names, at=time.time())
        return plan

    def _commit(self, shard_map: ShardMap) -> None:
        """``shard_map`` is the cluster's: the run directory, the servers' command lines
        for their next start, the cluster map."""
        routing_state.write(self.run_dir, self.plan.cluster, shard_map)
        by_shard = shard_map.pins_by_shard()
        prefixes = tuple(tuple(by_shard.get(i, ())) for i in range(shard_map.shards))
        self.plan = dataclasses.replace(
            self.plan,
            routing=RoutingParams(shard_map.shards, prefixes, epoch=shard_map.epoch),
            shards=tuple(dataclasses.replace(sh, prefixes=prefixes[sh.index])
                         for sh in self.plan.shards))
        self.runner.set_routing(self.plan.routing)
        self.on_changed(self.plan)

