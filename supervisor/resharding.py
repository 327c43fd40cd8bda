"""``cluster.reshard``: change the running cluster's routing under a new epoch, moving
the keys it moves while they are written (issue 41).

A change is given as a config (``supervisor reshard CONFIG --to NEW_CONFIG``): its shard
count and pins are the new routing. The running shards keep their names and servers;
shards it adds are started, shards it removes are stopped once their keys moved (their
data directories stay). Only the highest shards can be removed: jump consistent hashing
removes buckets from the top.

**The plan.** Every running server counts the keys it holds that the new routing places
on another shard, by target (``routing``/``count`` on its control service); the largest
count of a shard's servers is the shard's. ``--dry-run`` stops here.

**A change that moves no key** (a pin of a prefix that holds no key yet): the new routing,
with the next epoch, is written to the run directory (``routing.json``, fsynced), then
installed on the servers of the shards that give up a prefix, then on the rest. A
server installs it only if it still holds no key that it moves (checked on its reactor),
so a write that came in after the count makes it refuse; the old routing is then
installed everywhere under the epoch after, and the change is refused.

**A change that moves keys** (``Resharding._move``), each phase bounded:

1. *start*: the shards the change adds are started, already following the new routing
   (no client knows them yet);
2. *copy*: each target's active copies, from each source's active, the keys the new
   routing gives it (``clonemap.shards.migrate.Import``: the TTL table and applied UUIDs,
   a snapshot of the moving prefix or of the source's map, then its tail), invisibly;
   the phase ends when every copy is within ``CATCH_UP`` updates of its source;
3. *hold*: every source's peer is told to hold should it take over (a passive keeps
   nothing: one that does not answer fails the move before any write waits); then
   every source's active holds the writes of the keys that move
   (``clonemap.shards.migrate.Hold``) and says its sequence then; the phase ends when
   every copy holds its source's updates up to it, and every hold is *sealed* (from
   then on it ends only with the flip or an explicit release). The actives' answers,
   the catch-up (each look at the copies too), the record and the seals share
   ``hold_bound_s`` less what is kept for the flip after them (``flip_reserve``; a
   test's pause not counted): past it the holds are released (the sources apply the
   writes) and the move tries again, ``HOLD_ATTEMPTS`` times in all. No write waits
   longer than the bound unless the flip takes longer than was kept for it. A hold its
   supervisor neither sealed nor released (the supervisor died) ends by itself after
   ``clonemap.shards.migrate.HOLD_SAFETY_S``;
4. *flip*: each target's active follows the new routing and epoch (durable in its data
   directory) and applies its copies as its own updates, fsynced before it answers
   (published once: clients re-home each key as it arrives, without an event); then
   the run directory takes the new routing; then the targets' other servers,
   the sources' active (which forgets the moved keys without publishing deletes and
   forwards the held writes, and any later write for a moved key, to the new owner's
   collectors), the sources' other servers (which forget too), and every other server;
5. *stop*: shards the change removes are stopped, ``REMOVE_AFTER_HEARTBEATS`` heartbeats
   later (their forwarding covers clients that have not followed yet).

A failure before the flip (a copy that fails, a server that refuses, a hold past its
bound too often, a new shard that does not start) rolls the move back: the holds are
released, the copies dropped, added shards stopped; the routing is unchanged. If a
target refuses at the flip, the old routing comes back under the epoch after.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import time
from collections import deque
from pathlib import Path
from typing import Callable

from clonemap.shards.common.cpu_priority import COPY_PRIORITIES, is_background
from clonemap.shards.common.errors import ClonemapError, ConfigError, ProtocolError
from clonemap.shards.common.mdp.client import MdpClient
from clonemap.shards.common.placement import Plan, RoutingParams
from clonemap.shards.common.proto.chp import check_subtree
from clonemap.shards.common.routing import (MOVE_COMMAND, ROUTING_COMMAND, ROUTING_COUNT,
                                            ROUTING_FORGET, ShardMap)
from clonemap.shards.migrate import COPY_TIMEOUT_S
from clonemap.supervisor import routing_state
from clonemap.supervisor.process import BACKOFF, RUNNING, STARTING
from clonemap.supervisor.protocol import stats_service
from clonemap.supervisor.runner import Progress

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = float(os.environ.get("CLONEMAP_RESHARD_ASK_S") or 5.0)
"""How long one server may take to count or install (a count is one pass over its map).
An added shard's server in the background is waited on past it while it runs or waits
for a core (``_patience``). Tests only: ``CLONEMAP_RESHARD_ASK_S`` sets it, so that a
frozen server's request outlasts any bound the test checks by far."""
COUNT_BEATS = 4
"""A count is asked to say how far it got this many times per ``ASK_TIMEOUT_S`` (``count``)."""
HOLD_BOUND_S = 0.5
"""How long the moving keys' writes may be held (the sources hold them while the copies
catch up); past it the holds are released and the move tried again."""
HOLD_ATTEMPTS = 3
FLIP_RESERVE_S = 0.15
"""The part of the hold's bound kept for the flip that follows the seals (the targets'
commits, the run directory's record, the sources' install: 60-150 ms in ``bench
reshard`` on this 2-core host): the holds' answers, the catch-up, the record in etcd and
the seals share the rest, so that a held write is answered within the bound. A
supervisor keeps more once it measured a longer flip (``flip_reserve``)."""
SEAL_MIN_S = 0.02
"""The least time the seals are given when the catch-up used the hold's bound up to it
(their round trips; past it the holds are released and the move tried again)."""
COPY_WAIT_S = 120.0
"""How long the copies may take to arrive and come within ``CATCH_UP`` of their sources
(more for copies that ``copy_rate`` makes longer: ``copy_timeout_s``), counted from the
last look at which a snapshot had come further: a copy slower than its rate goes on."""
COPY_RATE_PER_CORE = 2 * 2**20
COPY_RATE_LEAST = 4 * 2**20
COPY_RATE_MOST = 32 * 2**20
"""Bytes per second each target of a move copies at most, unless the change says
otherwise (``supervisor reshard --copy-rate``): ``default_copy_rate``."""


def flip_reserve(bound_s: float, last_flip_s: float) -> float:
    """What of a hold's ``bound_s`` is kept for the flip: ``FLIP_RESERVE_S``, or half as
    much again as the last flip this supervisor measured (``last_flip_s``) when that is
    more; half the bound at most, so that the catch-up always has the other half."""
    return min(max(FLIP_RESERVE_S, 1.5 * last_flip_s), bound_s / 2)


def default_copy_rate(cores: int | None = None) -> float:
    """The copy rate a change takes when none is named: 2 MiB/s for each core this
    supervisor may run on (``cores``, else its CPU affinity), 4 MiB/s at least and
    32 MiB/s at most. The copy is paced so that a busy host keeps serving while it
    runs (Elasticsearch's recovery defaults to 40 MB/s, CockroachDB's rebalancing
    snapshots to 32 MiB/s, the cap here). A copy costs the target ~30 us of CPU a key
    (~130 bytes): it never reaches 32 MiB/s in one process, and on the 2-core host of
    ``bench reshard``, whose writes keep it ~70% busy, the old flat default of 32 MiB/s
    let the sources send faster than the added shard took in: the change took 44 s and
    a write waited 688 ms, where 4 MiB/s (this rule's figure for 2 cores) took 19-37 s
    with no write over 281 ms."""
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    return float(min(COPY_RATE_MOST, max(COPY_RATE_LEAST, COPY_RATE_PER_CORE * cores)))


COPY_PRIORITY = "idle"
"""The CPU priority of the servers of a shard the change adds, from their start until
their copies' snapshots are in (``supervisor reshard --copy-priority``): ``idle``, in
the background (``ShardServer.background``, ``clonemap.shards.common.cpu_priority``:
their threads under ``SCHED_IDLE`` where they can come back from it, root or
``CAP_SYS_NICE``, and each server's own autogroup at nice 19, which needs no privilege;
they take only the CPU that the serving shards and their clients leave; the tails, the
hold and the flip run at normal priority); ``normal``: as any server. A shard that
serves already (a shrink's or a pin's target), and a pair fenced by an etcd lease
(across hosts: its renewals have deadlines), are never put in the background. In
``bench reshard`` (2 cores) the writes to staying keys waited 0.66 ms at the median and
20-21 ms at p99 through the change with ``idle``, against 2.1-4.2 and 72-112 ms with
``normal``."""
PLAN_KEPT_S = 60.0
"""A change applied within this of its plan (``supervisor reshard`` prints the plan, then
applies it) uses the counts of that plan instead of counting every server's map again:
on a map of a million keys that pass kept the servers busy for seconds, for figures that
only size the copy's deadlines and its progress. (Whether a key moves is decided by each
server at the move, not by the counts.)"""
CATCH_UP = 200
"""Source updates a copy may trail by before the hold begins."""
CATCH_UP_POLL_S = 0.5
"""How long one look for a caught-up copy lasts before the sources are asked again."""
NO_ANSWER = "no answer"
"""How an install a server did not answer is said (``_install``)."""
START_WAIT_S = 30.0
"""How long an added shard's pair may take to elect an active once its servers run, and
to run, counted from the last progress of their start (the CPU their processes used
grew: one started in the background on a busy host gets only what the others leave)."""
START_PROGRESS_S = float(os.environ.get("CLONEMAP_RESHARD_START_S") or START_WAIT_S)
"""Tests only (``CLONEMAP_RESHARD_START_S``): the servers' start's wait without progress,
shorter than a start takes, so that a test sees it extended."""
REMOVE_AFTER_HEARTBEATS = 3
POLL_S = 0.01
"""How often the copies are looked at while writes are held (the catch-up's bound is
0.5 s)."""
COPY_POLL_S = 0.1
"""How often they are looked at while they copy: each look is a stats request that each
target's loop answers (1-3 ms at a million keys), which a shard that serves takes from
its writes. At ``POLL_S`` it was a tenth of a serving target's loop during a shrink's
copy (py-spy)."""
PROGRESS_S = 0.5
"""A change under way says how far it got at least this often (the caller's reply
timeout is per message: the command notices a supervisor gone within its own)."""
STOP_AT_ENV = "CLONEMAP_RESHARD_STOP_AT"
"""Tests only: a phase name (``PHASES``) at which a move stops for good, after printing
``RESHARD_STOPPED phase=P``: the deterministic way to kill a supervisor or a server in
the middle of a move."""
PHASES = ("started", "copied", "held", "sealed", "committing", "committed", "flipped")
"""``committing``: one target committed and others have not yet (a change with several)."""
CLAIM_TTL_S = 5.0
"""Across hosts, the lease under which the supervisor that runs a change holds the
cluster's one change at a time in etcd (renewed while it runs; one that dies frees it
within this)."""
SETTLE_ASK_S = 1.0
"""How long a supervisor that settles a dead supervisor's change waits for a target's
server to say its epoch (one on the dead host does not answer)."""
PAUSE_AT_ENV = "CLONEMAP_RESHARD_PAUSE_AT"
"""Tests only: a phase at which a move waits, after printing ``RESHARD_PAUSED phase=P``,
until the file ``CONTINUE_FILE`` appears in the run directory (a test kills a server
there, deterministically, then lets the move go on)."""
CONTINUE_FILE = "reshard.continue"


def _read_outcome(done: asyncio.Future) -> None:
    """A done-callback for a future nobody awaits any more: its exception is read (so
    asyncio does not report it as never retrieved)."""
    if not done.cancelled():
        done.exception()


class Refused(Exception):
    """A change this supervisor does not apply: ``status`` is the control reply's."""

    def __init__(self, status: bytes, text: str, plan: dict | None = None):
        super().__init__(text)
        self.status, self.text, self.plan = status, text, plan


def parse_change(body: list[bytes]) -> tuple[str, bool, float | None, str]:
    """A request's body: JSON {config: the new config's path, apply, copy_rate: bytes
    per second that each target copies at most (absent: ``default_copy_rate``; 0:
    unpaced), copy_priority: one of ``cpu_priority.COPY_PRIORITIES`` (absent:
    ``COPY_PRIORITY``)}."""
    try:
        doc = json.loads(body[0])
        rate = doc["copy_rate"] if "copy_rate" in doc else default_copy_rate()
        if rate is not None and (isinstance(rate, bool) or float(rate) < 0):
            raise ValueError(f"copy_rate must be bytes per second >= 0, got {rate!r}")
        rate = float(rate) if rate else None  # (0 or null: unpaced)
        priority = doc.get("copy_priority", COPY_PRIORITY)
        if priority not in COPY_PRIORITIES:
            raise ValueError(f"copy_priority must be one of {', '.join(COPY_PRIORITIES)}, "
                             f"got {priority!r}")
        return str(doc["config"]), bool(doc.get("apply")), rate, priority
    except (IndexError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise Refused(b"400", f"not a routing change: {exc}") from None


def copy_timeout_s(size: int, rate: float | None, floor_s: float) -> float:
    """How long a copy of ``size`` bytes at ``rate`` bytes/s may take: twice what the
    rate makes it, plus 10 s, and never less than ``floor_s``."""
    return floor_s if not rate else max(floor_s, 2 * size / rate + 10.0)


def snapshots_moved(was: dict, imports: list[tuple[str, dict]]) -> tuple[bool, dict]:
    """Whether any of ``imports`` (each target's copies' stats at one look: (target, an
    import's stats)) read more of its snapshot since the look that gave ``was``, or has
    it whole now while it had not then; and what this look gives the next."""
    now = {(name, imp.get("source"), imp.get("prefix")): (
        imp.get("received", 0), imp.get("snapshot_seq", -1) >= 0) for name, imp in imports}
    return any(now[k] != was.get(k) and not was.get(k, (0, False))[1] for k in now), now


def moved_prefixes(old: ShardMap, new: ShardMap) -> dict[str, tuple[int, int]]:
    """Each pinned prefix (of either map) whose owner changes: prefix -> (from, to)."""
    out = {}
    for prefix in sorted(set(old.pins) | set(new.pins)):
        was, now = old.owner(prefix), new.owner(prefix)
        if was != now:
            out[prefix] = (was, now)
    return out


def _collectors(plan: Plan, indices=None) -> dict[int, list[str]]:
    """Where a server forwards the writes for keys that moved (``ROUTING_FORGET``): the
    collectors of both servers of each shard in ``indices`` (every shard of ``plan``
    when None)."""
    return {i: [sv.endpoint("collector") for sv in plan.shards[i].servers]
            for i in (range(len(plan.shards)) if indices is None else indices)}


def _imports(stats: dict) -> list[dict]:
    return (stats.get("move") or {}).get("imports") or []


class Resharding:
    """The cluster's routing as this supervisor serves it, and its changes."""

    def __init__(self, plan: Plan, runner, run_dir: Path, endpoint: str, ctx, security,
                 on_changed: Callable[[Plan], None], load_plan: Callable[[str], Plan]):
        self.plan = plan
        self.runner = runner
        self.run_dir = Path(run_dir)
        self.endpoint, self.ctx, self.security = endpoint, ctx, security
        self.on_changed = on_changed
        """Called with the plan under each new routing (the cluster map is rebuilt)."""
        self.load_plan = load_plan
        """A config's path -> its plan on this host (``ConfigError`` if it does not hold)."""
        self.hold_bound_s = HOLD_BOUND_S
        self.last_flip_s = 0.0
        """How long the last flip this supervisor made took, from its seals to the
        sources' new routing (a test's pauses not counted): ``flip_reserve``."""
        self._paused_s = 0.0
        """Time spent paused at a phase for a test (``PAUSE_AT_ENV``), in all."""
        self._change_id = ""
        """The change under way's mark on its record in etcd."""
        self._ended: deque[str] = deque(maxlen=64)
        """The marks of this supervisor's changes that ended with no record left on
        purpose (all but one that stopped past its seal): a record of one of them found
        in etcd later is a put that etcd took after it was given up on (``_settle_orphan``)."""
        self._lock = asyncio.Lock()
        self._changed_at = 0.0
        """When the last change ended: on one host, only stats taken since then say that
        a server lags behind it (``follow``)."""
        self._before = plan
        """The plan before the change under way (what a roll-back goes back to)."""
        self._adding: Plan | None = None
        """The plan of the change under way while its move runs (its added shards'
        servers; its routing epoch names each move step, ``_step``)."""
        self.phase = ""
        """The phase of the move under way, or the last one reached."""
        self._aborting = False
        """An operator asked the change under way to stop (``abort``)."""
        self._past_flip = False
        """The change under way sealed its holds: it completes (``abort`` is refused)."""
        self._clients: dict[str, tuple[MdpClient, asyncio.Lock]] = {}
        self._state: dict = {"phase": "", "keys": 0, "bytes": 0, "changes": 0}
        self.progress: Callable[[bytes], object] | None = None
        self.copy_rate: float | None = None
        """The change under way's ``copy_rate``."""
        self.copy_priority = COPY_PRIORITY
        """The change under way's ``copy_priority``."""
        self.copy_paused_s = 0.0
        """How long its copies paused for ``copy_rate`` (all targets together), as of
        their last poll."""
        """Where the change under way says how far it got (``change``)."""
        self._said_at = 0.0
        self.shared = routing_state.SharedRouting.of(plan)
        """Across hosts: the routing in etcd, the cluster's source of truth (else None)."""
        self.config_path = ""
        """The config whose routing the cluster follows, once a change set it (etcd
        tells the other hosts' supervisors which config to plan)."""
        self._claim = 0
        """The etcd lease under which this supervisor holds the change under way."""
        self._record_at = 0
        """The etcd revision of the change's record, once written (``_record_move``)."""
        self._claim_lapsed = ""
        """Why that claim is known to be gone ("" while held): before its flip the
        change rolls back (``_check_abort``); the move's record is written only under it."""
        self._new_config = ""
        """The config of the change under way (the path every host plans)."""
        self._snapshot_looks: dict = {}
        self._moved_at = 0.0
        """When a copy's snapshot last came further (``_copies``, ``snapshots_moved``)."""
        self._counted: tuple | None = None
        """The last plan counted: ((config, epoch, routing), when, the plan as JSON)."""
        self._parts: Plan | None = None
        """The plan of another host's change whose added shards this host started."""
        self._part_shards: set[int] = set()
        """Those shards, until the routing has them (or they are dropped)."""

    @property
    def routing(self) -> ShardMap:
        return self.plan.routing.shard_map()

    # ------------------------------------------------------------------ servers
    def _server(self, name: str):
        """Server ``name``'s plan (``shard/role``), on any host: the running routing's
        shards, else those the change under way adds."""
        proc = self.runner.servers.get(name)
        if proc is not None:
            return proc.plan
        for plan in (self.plan, self._adding):
            if plan is not None:
                try:
                    return plan.server(name)
                except KeyError:
                    pass
        raise KeyError(name)

    def _endpoint_of(self, server) -> str:
        """Where to ask ``server``: this supervisor's broker, or (across hosts) the
        broker of the supervisor that runs it."""
        plan = self._adding if self._adding is not None and server.index >= len(
            self.plan.shards) else self.plan
        if plan.is_local(server):
            return self.endpoint
        return plan.control_of(server)

    async def _ask(self, name: str, *body: bytes, beats=None) -> dict:
        """One control request to server ``name`` (its own MDP client, kept for the
        change: a move asks the same servers many times), through the broker of the
        supervisor that runs it. Each reply message may take ``ASK_TIMEOUT_S``.
        ``beats(body)``: the request's PARTIALs go there (a count says how far it got),
        each restarting that wait."""
        server = self._server(name)
        entry = self._clients.get(name)
        if entry is None:
            entry = self._clients[name] = (
                MdpClient(self._endpoint_of(server), ctx=self.ctx, timeout_s=ASK_TIMEOUT_S,
                          retries=0, security=self.security), asyncio.Lock())
        client, lock = entry
        service = stats_service(server.shard, server.role)
        async with lock:
            try:
                if beats is None:
                    reply = await client.request(service, *body,
                                                 patient=self._patience(name))
                else:
                    async with client.stream(service, *body) as replies:
                        async for partial in replies:
                            beats(partial)
                    reply = replies.final
            except BaseException:
                self._clients.pop(name, None)
                await client.close()
                raise
        return json.loads(reply[-1])

    def _patience(self, name: str):
        """For a server of this host at background CPU priority (``COPY_PRIORITY``):
        ``patient()``, whether a request that got no reply in ``ASK_TIMEOUT_S`` may wait
        as long again, because the server ran meanwhile or waits for a core now. On a
        saturated host such a server runs a few milliseconds a second (4 ms every
        1.5-2 s beside four busy loops): a step asked of it took longer than 5 s beside
        four test workers on two cores, and the growth was rolled back. A server that is
        stopped, or sleeps without answering, is not waited for; None for the others.
        An operator's ``--abort`` (or a lapsed claim) ends the wait at the next look."""
        proc = self.runner.servers.get(name)
        if proc is None or proc.pid is None:
            return None
        ran = Progress([proc])

        def patient() -> bool:
            self._check_abort()  # (raises: the change rolls back)
            try:
                if not is_background(proc.pid):
                    return False
            except OSError:  # (gone)
                return False
            grew, runnable = ran.look()
            if grew or runnable:
                log.info("reshard: %s at background priority has not answered yet (%s); "
                         "waiting on", name, "waiting for a core" if runnable else
                         "it ran meanwhile")
            return grew or runnable

        return patient

    async def _close_clients(self) -> None:
        clients, self._clients = self._clients, {}
        for client, _ in clients.values():
            await client.close()

    def _running(self) -> list[str]:
        """The servers of the cluster that run: this host's that its runner says run,
        and (across hosts) every pair server another host's supervisor runs (asked
        through its broker; one that does not answer fails the request it is asked)."""
        here = [name for name, proc in self.runner.servers.items() if proc.state == RUNNING]
        there = []
        for plan in (self.plan, self._adding):
            for server in plan.servers if plan is not None else ():
                if (not plan.is_local(server) and server.name not in there
                        and server.name not in self.runner.servers):
                    there.append(server.name)
        return here + there

    def _local(self, name: str) -> bool:
        return name in self.runner.servers

    def _of_shard(self, index: int) -> list[str]:
        return [n for n in self._running() if self._server(n).index == index]

    async def _active_of(self, index: int) -> str:
        """The running server of shard ``index`` that says it is active (one that does
        not answer is not)."""
        return (await self._active_stats(index))[0]

    async def _active_stats(self, index: int) -> tuple[str, dict]:
        """``_active_of``, with the stats in which it said so."""
        why = "no server answered"
        for name in self._of_shard(index):
            if self._server(name).role not in ("primary", "backup"):
                continue
            try:
                stats = await self._ask(name)
                if stats.get("active"):
                    return name, stats
                why = f"{name} is not active"
            except ClonemapError as exc:
                why = f"{name}: {exc}"
        raise Refused(b"503", f"shard {index} has no active server now ({why})")

    async def _sources_sealed(self, sources: list[int]) -> None:
        """Before any target commits: each source's active now holds the moving keys'
        writes, sealed. One that does not (a server that went on alone, was killed past
        the seal and came back through its alone record, Binary Star's L5, holding
        nothing: the hold lived in the killed process) has applied writes that no
        target's copy holds; the flip would forget them. ``Refused``: the change goes
        back to the old routing."""
        actives = await asyncio.gather(*(self._active_stats(s) for s in sources))
        for s, (name, stats) in zip(sources, actives):  # (one look each: writes are held)
            hold = (stats.get("move") or {}).get("hold") or {}
            if not hold.get("sealed"):
                raise Refused(b"409", f"shard {s}'s active {name} does not hold the moving "
                                      f"keys' writes (it took over without the move's "
                                      f"hold): the flip would lose what it applied")

    async def _step(self, name: str, op: str, **args) -> dict:
        """One move step on server ``name``, named by the routing epoch of the change
        whose move runs (``_adding``'s: a server refuses a step of an earlier change,
        one delivered late, after a partition healed)."""
        if self._adding is not None:
            args["epoch"] = self._adding.routing.epoch
        got = await self._ask(name, MOVE_COMMAND, json.dumps(dict(args, op=op)).encode())
        if got.get("move_refused"):
            raise Refused(b"409", f"{name} refused {op}: {got['move_refused']}")
        return got

    async def _priority(self, names: list[str], on: bool) -> list[str]:
        """Servers ``names`` at background CPU priority (``on``) or back (the step
        ``background``, ``COPY_PRIORITY``): those that took it. One that does not (it
        cannot come back from it, or does not answer) is logged and goes on as it is: a
        server comes back to normal priority by itself when it follows a routing."""
        took = []
        for name, got in zip(names, await asyncio.gather(
                *(self._step(n, "background", on=on) for n in names), return_exceptions=True)):
            if isinstance(got, Exception):
                log.warning("reshard: %s not %s: %s", name,
                            "in the background" if on else "back to normal priority", got)
            else:
                took.append(name)
        if took:
            log.info("reshard: %s at %s CPU priority", ", ".join(took),
                     "background" if on else "normal")
        return took

    async def _install_late(self, new: ShardMap, installed: set[str], sources: list[int],
                            forward: dict[int, list[str]],
                            again: set[str] = frozenset()) -> None:
        """The servers coming back at the flip's installs (restarted during the change,
        on the routing of its start: a start after the flip has the new one) take the new
        routing once they run, a source's with its forget and forwards; for at most
        ``START_WAIT_S``. ``again``: running servers whose install was not answered,
        asked again while they run: one restarted just before the flip may not serve
        its control service yet, or the broker may still hand its requests to its dead
        predecessor's worker (until that worker expires). Left at the old routing, it
        stayed there after the change (seen in a test where a source's killed active
        came back at the flip)."""
        deadline = time.monotonic() + START_WAIT_S
        late = {n for n, proc in self.runner.servers.items()
                if n not in installed and proc.state in (STARTING, BACKOFF)} | set(again)
        while late and time.monotonic() < deadline:
            running = self._running()
            for name in [n for n in late if n in running]:
                giving = self._server(name).index in sources
                got = await self._install(new, [name], forget=giving,
                                          forward=forward if giving else None)
                if got[name].startswith(NO_ANSWER) and time.monotonic() < deadline:
                    log.info("reshard: %s did not answer epoch %d: asked again while it "
                             "runs", name, new.epoch)
                    continue
                late.discard(name)
                log.info("reshard: %s, running again, takes epoch %d%s", name, new.epoch,
                         f" (refused: {got[name]})" if got[name] else "")
            late -= {n for n in again if n not in running}  # (gone: its restart has it)
            if late:
                await asyncio.sleep(POLL_S * 10)

    async def _install(self, shard_map: ShardMap, names: list[str], forget: bool = False,
                       forward: dict[int, list[str]] | None = None) -> dict[str, str]:
        """Install on ``names``; name -> why refused ("" installed). ``forget``: the keys
        it moves have moved (``forward``: where writes for them go now)."""
        doc = json.dumps(shard_map.describe()).encode()
        extra = (ROUTING_FORGET, json.dumps(forward or {}).encode()) if forget else ()
        answers = await asyncio.gather(*(self._ask(n, ROUTING_COMMAND, doc, *extra)
                                         for n in names), return_exceptions=True)
        out = {}
        for name, got in zip(names, answers):
            if isinstance(got, dict):
                out[name] = got.get("routing_refused") or ""
            else:
                out[name] = f"{NO_ANSWER} ({type(got).__name__}: {got})"
        return out

    # ------------------------------------------------------------------ the plan
    def _check_plan(self, new_plan: Plan) -> None:
        """The new config keeps the cluster, its control endpoint and every running
        shard's name and servers (only the pins and the shard count change)."""
        old = self.plan
        if new_plan.cluster != old.cluster or new_plan.control != old.control:
            raise Refused(b"409", f"the new config is another cluster ({new_plan.cluster} "
                                  f"at {new_plan.control}, not {old.cluster} at "
                                  f"{old.control})")
        for a, b in zip(old.shards, new_plan.shards):
            if (a.name, a.primary.endpoint(), a.backup.endpoint()) != (
                    b.name, b.primary.endpoint(), b.backup.endpoint()):
                raise Refused(b"409", f"shard {a.index} is {a.name} at "
                                      f"{a.primary.endpoint()} and {a.backup.endpoint()} in "
                                      f"the running cluster, but {b.name} at "
                                      f"{b.primary.endpoint()} and {b.backup.endpoint()} in "
                                      "the new config: resharding keeps the running shards")

    async def _counting(self) -> list[str]:
        """The servers that count a plan: each shard's active, or every server of a
        shard that has none active now. A pair's two hold the same keys, and counting on
        both was a second pass over every key, beside the writes, on a host that runs
        both (``bench reshard``: the four servers took 1.4 cores for 3 s)."""
        shards = self.routing.shards  # (not a shard being added: it holds no key yet)
        indices = sorted({i for i in (self._server(n).index for n in self._running())
                          if i < shards})
        actives = await asyncio.gather(*(self._active_of(i) for i in indices),
                                       return_exceptions=True)  # (the shards asked at once)
        names: list[str] = []
        for index, active in zip(indices, actives):
            if isinstance(active, Refused):
                names += [n for n in self._of_shard(index)
                          if self._server(n).role in ("primary", "backup")]
            elif isinstance(active, BaseException):
                raise active
            else:
                names.append(active)
        return names

    async def count(self, new: ShardMap) -> dict:
        """The plan: for each source shard, the keys and bytes it would give each target
        (``_counting``; the largest count where both servers of a pair counted)."""
        doc = json.dumps(new.describe()).encode()
        names = await self._counting()
        # (a count lasts as long as its server's map is large: each says every beat how
        # far it got, and is given ``ASK_TIMEOUT_S`` for each word, not for the whole)
        beat = b"%g" % max(ASK_TIMEOUT_S / COUNT_BEATS, 0.05)
        looked_at: dict[str, tuple[int, int]] = {}

        def beats(name: str):
            def heard(body: list[bytes]) -> None:
                try:
                    got = json.loads(body[-1])
                    looked_at[name] = (int(got["counting"]), int(got["of"]))
                except (ValueError, KeyError, TypeError, IndexError):
                    return  # (a word of another kind: it still said the server counts)
                if self._state.get("running"):
                    self._state["counted"] = [sum(a for a, _ in looked_at.values()),
                                              sum(b for _, b in looked_at.values())]
            return heard

        answers = await asyncio.gather(*(self._ask(n, ROUTING_COMMAND, doc, ROUTING_COUNT,
                                                   beat, beats=beats(n))
                                         for n in names), return_exceptions=True)
        moves: dict[tuple[int, int], list[int]] = {}
        for name, got in zip(names, answers):
            leaving = got.get("routing_leaving") if isinstance(got, dict) else None
            if not isinstance(leaving, dict):
                raise Refused(b"503", f"server {name} did not count the keys it would give "
                                      f"up ({got!r}); nothing was changed")
            source = self._server(name).index
            for target, (keys, size) in leaving.items():
                row = moves.setdefault((source, int(target)), [0, 0])
                row[0], row[1] = max(row[0], keys), max(row[1], size)
        old = self.routing
        return {"moves": [{"from": s, "to": t, "keys": k, "bytes": b}
                          for (s, t), (k, b) in sorted(moves.items())],
                "prefixes": {p: list(st) for p, st in moved_prefixes(old, new).items()},
                "shards": [old.shards, new.shards], "epoch": old.epoch,
                "next_epoch": old.epoch + 1, "changed": False, "servers_counted": names}

    async def change(self, config: str, apply: bool,
                     progress: Callable[[bytes], object] | None = None,
                     copy_rate: float | None = None,
                     copy_priority: str = COPY_PRIORITY) -> dict:
        """Plan, or apply, the change to ``config``'s routing (module doc); ``progress``:
        where it says how far it got (a PARTIAL to its caller); ``copy_rate``: bytes per
        second each target copies at most (None: unpaced); ``copy_priority``: the added
        shards' CPU priority while they copy (``COPY_PRIORITY``). One change at a time."""
        async with self._lock:
            self.progress = progress
            self.copy_rate = copy_rate
            self.copy_priority = copy_priority
            self.copy_paused_s = 0.0
            self._aborting = self._past_flip = False
            self._claim_lapsed, self._record_at = "", 0
            self._snapshot_looks, self._moved_at = {}, 0.0
            # (the beats before the first phase say this one's, never the last change's)
            self.phase = "planning"
            if apply:
                self._state = {"phase": "planning", "keys": 0, "bytes": 0,
                               "changes": self._state["changes"] + 1, "running": True,
                               "to": config}
            if apply:
                await self._take_claim(config)
            beat = asyncio.ensure_future(self._keep_saying())
            self._change_id = os.urandom(8).hex()
            applied = False
            try:
                done = await self._change(config, apply)
                applied = True
                return done
            finally:
                if applied or not self._past_flip:  # (else its record waits to be settled)
                    self._ended.append(self._change_id)
                beat.cancel()
                self._changed_at = time.monotonic()
                self._state["running"] = False
                self.progress = None
                self._adding = None
                await self._close_clients()
                await self._give_claim()

    async def _take_claim(self, config: str) -> None:
        """Across hosts: one change at a time in the whole cluster (an etcd key under a
        lease this supervisor keeps while the change runs: ``CLAIM_TTL_S``)."""
        if self.plan.hosts and self.shared is None:
            raise Refused(b"409", "a cluster over several hosts keeps its routing epoch in "
                                  "etcd: add coordination: {etcd: [HOST:PORT, ...]} to its "
                                  "config to reshard it")
        if self.shared is None:
            return
        from clonemap.shards.coord import CoordinationError

        who = f"host {self.plan.host_name}: {config}"
        try:
            self._claim, holder = await asyncio.to_thread(self.shared.claim, who,
                                                          CLAIM_TTL_S)
        except CoordinationError as exc:
            raise Refused(b"503", f"etcd {self.shared.url} did not answer ({exc}): a "
                                  "change of a cluster over several hosts needs it") from None
        if not self._claim:
            raise Refused(b"409", f"another change of the routing is under way ({holder})")

    async def _give_claim(self) -> None:
        claim, self._claim = self._claim, 0
        if claim and self.shared is not None:
            try:
                await asyncio.to_thread(self.shared.release, claim)
            except Exception as exc:  # noqa: BLE001 - it expires by itself
                log.warning("reshard: the claim on etcd was not given back (%s); it "
                            "expires in %g s", exc, CLAIM_TTL_S)

    def abort(self) -> tuple[bool, str]:
        """Stop the change under way and roll it back (``supervisor reshard --abort``):
        (True, what happens) once asked, (False, why not): no change runs, or it sealed
        its holds, past which it always completes (the flip)."""
        if not self._state.get("running"):
            return False, "no change of the routing is running"
        if self._past_flip:
            return False, (f"the change is past its flip (phase {self.phase}): it "
                           "completes")
        self._aborting = True
        log.warning("reshard: abort asked in phase %s: the change rolls back at its next "
                    "step", self.phase or "planning")
        return True, (f"the change (phase {self.phase or 'planning'}) stops at its next "
                      "step and rolls back")

    def _check_abort(self) -> None:
        if self._past_flip:
            return
        if self._aborting:
            raise Refused(b"409", "aborted by the operator (supervisor reshard --abort)")
        if self._claim_lapsed:
            raise Refused(b"409", self._lapsed_text())

    def _lapsed_text(self) -> str:
        return (f"this supervisor's claim on the change in etcd lapsed "
                f"({self._claim_lapsed}): another change may have begun; rolled back "
                "before the flip")

    async def _keep_saying(self) -> None:
        """A word to the caller at least every ``PROGRESS_S`` whatever the phase is
        waiting on (a server busy copying answers its control service late); across
        hosts, the claim kept alive."""
        kept = tried = time.monotonic()
        while True:
            await asyncio.sleep(PROGRESS_S)
            if time.monotonic() - self._said_at >= PROGRESS_S:
                await self._say(waiting=True)
            if self._claim and not self._claim_lapsed and \
                    time.monotonic() - tried >= CLAIM_TTL_S / 4:
                tried = time.monotonic()
                try:
                    if await asyncio.to_thread(self.shared.keep, self._claim):
                        kept = tried
                    else:
                        self._claim_lapsed = "etcd says its lease is gone"
                except Exception as exc:  # noqa: BLE001 - tried again at the next beat
                    log.warning("reshard: the claim on etcd was not renewed (%s)", exc)
                    if time.monotonic() - kept >= CLAIM_TTL_S:
                        self._claim_lapsed = f"not renewed for {CLAIM_TTL_S:g} s: {exc}"
                if self._claim_lapsed:
                    log.error("reshard: the claim on the change lapsed (%s)%s",
                              self._claim_lapsed, "" if self._past_flip else
                              ": the change rolls back at its next step")

    async def _change(self, config: str, apply: bool) -> dict:
        try:
            new_plan = self.load_plan(config)
        except ConfigError as exc:
            raise Refused(b"400", f"{config}: {exc}") from None
        self._check_plan(new_plan)
        self._before = self.plan
        old = self.routing
        new = new_plan.routing.shard_map()
        if new == old:
            return {"epoch": old.epoch, "changed": False, "moves": [], "prefixes": {},
                    "shards": [old.shards, old.shards]}
        counted = self._counted
        kept = (json.loads(counted[2]) if apply and counted is not None
                and counted[0] == (config, old.epoch, new)
                and time.monotonic() - counted[1] <= PLAN_KEPT_S else None)
        # (a plan that moved no key is counted again: a key written since makes the
        # change a move, not a change of the routing alone)
        counting = None
        if kept is not None and (new.shards != old.shards
                                 or any(m["keys"] for m in kept["moves"])):
            plan = kept  # what the command just printed, counted once
            log.info("reshard: the plan counted %.1f s ago is applied", time.monotonic() -
                     counted[1])
        elif apply and new.shards > old.shards:
            # applied as asked (``--yes``): the added shards' servers start while the
            # servers count (``_move``), where they would start after it
            counting = asyncio.ensure_future(self.count(new))
            plan = {"moves": []}
            log.info("reshard: the plan is counted while the added shards start")
        else:
            plan = await self.count(new)
            self._counted = ((config, old.epoch, new), time.monotonic(), json.dumps(plan))
            if not apply:
                return plan
            await self._say_plan(plan)
        new = new.with_epoch(old.epoch + 1)
        new_plan = dataclasses.replace(new_plan, routing=dataclasses.replace(
            new_plan.routing, epoch=new.epoch))
        self._new_config = config
        if counting is None and new.shards == old.shards and not any(
                m["keys"] for m in plan["moves"]):
            return await self._flip(old, new, new_plan, plan)
        return await self._move(old, new, new_plan, plan, counting)

    async def _say_plan(self, plan: dict) -> None:
        """The plan counted for an apply, to its caller (a PARTIAL ``{"plan": ...}``):
        ``supervisor reshard --yes`` prints it from there."""
        if self.progress is not None:
            try:
                await self.progress(json.dumps({"plan": plan, "phase": "planned"}).encode())
            except Exception as exc:  # noqa: BLE001 - the caller left: the change goes on
                log.debug("reshard plan not sent: %s", exc)

    # ------------------------------------------------------------------ no key moves
    async def _flip(self, old: ShardMap, new: ShardMap, new_plan: Plan, plan: dict) -> dict:
        await self._commit(new_plan)  # durable first: a restarted supervisor serves it
        giving = {src for src, _ in moved_prefixes(old, new).values()}
        names = self._running()
        first = [n for n in names if self._server(n).index in giving]
        rest = [n for n in names if n not in first]
        refused = {}
        for wave in (first, rest):
            refused.update({n: why for n, why in (await self._install(new, wave)).items()
                            if why})
            if refused:
                break
        if refused:  # back to the old routing, under the epoch after
            back = await self._back(old, new)
            again = {n: why for n, why in (await self._install(back, names)).items() if why}
            log.error("routing: epoch %d refused by %s; epoch %d restores the old routing%s",
                      new.epoch, refused, back.epoch,
                      f" (not yet on {', '.join(again)})" if again else "")
            raise Refused(b"409", "refused by " + "; ".join(
                f"{n}: {why}" for n, why in sorted(refused.items())) +
                f"; the old routing is back as epoch {back.epoch}", plan)
        log.info("routing: epoch %d installed on %d servers (%s)", new.epoch, len(names),
                 ", ".join(f"{p} {a}->{b}" for p, (a, b) in plan["prefixes"].items()))
        await self._install_late(new, set(names), [], {})  # (a server starting meanwhile)
        plan.update(epoch=new.epoch, changed=True, servers=names, at=time.time())
        return plan

    async def _back(self, old: ShardMap, new: ShardMap) -> ShardMap:
        """The old routing again, as the epoch after ``new`` (epochs only grow)."""
        back = old.with_epoch(new.epoch + 1)
        self._new_config = self.config_path
        await self._commit(dataclasses.replace(self._before, routing=dataclasses.replace(
            self._before.routing, epoch=back.epoch)))
        return back

    # ------------------------------------------------------------------ moves
    def _subtree(self, old: ShardMap, new: ShardMap, source: int, target: int) -> str:
        """What a target asks its source for: the one moved pinned prefix between them
        when that is all that moves between them, else the source's whole map."""
        if old.shards != new.shards:
            return ""
        pins = [p for p, st in moved_prefixes(old, new).items() if st == (source, target)]
        if len(pins) == 1:
            try:
                check_subtree(pins[0].encode("utf-8"))
                return pins[0]
            except ProtocolError:
                pass
        return ""

    async def _move(self, old: ShardMap, new: ShardMap, new_plan: Plan, plan: dict,
                    counting: asyncio.Future | None = None) -> dict:
        """``counting``: the plan still being counted (``count``), awaited once the added
        shards started (their start is then not a wait of its own)."""
        def moves_of(plan: dict) -> tuple[list[tuple[int, int]], list[int], list[int]]:
            # every pair of shards the routing can move keys between, whatever the
            # counts said (a key written since the count is copied too): the counted
            # moves; a growth's added shards from every old one; a shrink's removed
            # shards to every one that stays; each moved pin's old owner to its new one;
            # and the sources and the targets of those pairs
            pairs = sorted({(m["from"], m["to"]) for m in plan["moves"] if m["keys"]}
                           | {(s, t) for s in range(old.shards)
                              for t in range(old.shards, new.shards)}
                           | {(s, t) for s in range(new.shards, old.shards)
                              for t in range(new.shards)}
                           | set(moved_prefixes(old, new).values()))
            return pairs, sorted({s for s, _ in pairs}), sorted({t for _, t in pairs})

        pairs, sources, targets = moves_of(plan)
        self._adding = new_plan
        added = list(range(old.shards, new.shards))
        removed = list(range(new.shards, old.shards))
        began = time.monotonic()
        phases: dict[str, float] = {}
        # where the sources send the writes for moved keys on (the targets' collectors),
        # connected from the hold on
        forward = _collectors(new_plan, targets)
        try:
            for index in added:  # 1. start, on the new routing
                not_up = await self.runner.add_shard(
                    new_plan.shards[index], new_plan, START_PROGRESS_S,
                    background=self.copy_priority == "idle")
                not_up += await self._on_hosts(new_plan, index, "start")
                if not_up:
                    raise Refused(b"409", f"the added shard's servers {not_up} did not start")
                await self._wait(lambda i=index: self._active_of(i), START_WAIT_S,
                                 f"an active server of the added shard {index}")
            if counting is not None:  # (a server that could not count: rolled back below)
                phases["added_s"] = time.monotonic() - began
                plan = await counting
                await self._say_plan(plan)
                pairs, sources, targets = moves_of(plan)
                forward = _collectors(new_plan, targets)
            phases["start_s"] = time.monotonic() - began  # (and, with ``counting``, counted)
            # the added shards serve no client yet: their copy takes the CPU the rest
            # leave, up to its snapshots (then the tails, the hold and the flip at normal)
            background = (await self._priority([n for i in added for n in self._of_shard(i)],
                                               True) if self.copy_priority == "idle" else [])
            await self._reached("started")
            src = {s: await self._active_of(s) for s in sources}
            dst = {t: await self._active_of(t) for t in targets}
            await asyncio.gather(*(self._step(src[s], "export", routing=new.describe())
                                   for s in sources))
            # 2. copy: each target at copy_rate at most, shared by the sources it copies
            # (first, whatever copy an earlier change left on a target goes: one that
            # failed would fail this change at its first look at the copies)
            await asyncio.gather(*(self._step(dst[t], "stop-import") for t in targets),
                                 return_exceptions=True)
            sizes = {(m["from"], m["to"]): m["bytes"] for m in plan["moves"]}
            into = {t: sum(1 for _, u in pairs if u == t) for t in targets}
            rate = self.copy_rate
            for s, t in pairs:
                plan_s = self._server(src[s])
                each = rate / into[t] if rate else None
                await self._step(dst[t], "import", source=f"tcp://{plan_s.address}:"
                                 f"{plan_s.port}", prefix=self._subtree(old, new, s, t),
                                 routing=new.describe(), rate=each,
                                 timeout_s=copy_timeout_s(sizes.get((s, t), 0), each,
                                                          COPY_TIMEOUT_S))
            copy_wait_s = copy_timeout_s(max((sum(b for (_, u), b in sizes.items() if u == t)
                                              for t in targets), default=0), rate,
                                         COPY_WAIT_S)
            if background:
                try:
                    await self._copies(dst, lambda imp: imp["copied"], copy_wait_s,
                                       "the copies' snapshots", src, poll_s=COPY_POLL_S,
                                       while_moving=True)
                except TimeoutError as exc:
                    raise Refused(b"409", str(exc)) from None
                await self._priority(background, False)
            for attempt in range(1, HOLD_ATTEMPTS + 1):
                # copied, and each copy within CATCH_UP of its source's sequence now
                deadline = time.monotonic() + copy_wait_s
                while True:
                    at = {s: await self._source_seq(src[s]) for s in sources}
                    try:
                        await self._copies(dst, lambda imp, at=at: imp["copied"] and
                                           imp["source_seq"] >= at[self._source_of(
                                               imp, src)] - CATCH_UP, CATCH_UP_POLL_S,
                                           "the copies", src, poll_s=COPY_POLL_S)
                        break
                    except TimeoutError:  # (a snapshot still coming: more time)
                        if time.monotonic() > max(deadline, self._moved_at + copy_wait_s):
                            raise Refused(b"409", f"the copies did not come within "
                                                  f"{CATCH_UP} updates of their sources "
                                                  f"in {copy_wait_s:g} s") from None
                phases.setdefault("copy_s", time.monotonic() - began - phases["start_s"])
                await self._reached("copied")
                # 3. hold: first the sources' peers (should one take over), whose hold
                # keeps no write while they are passive: one that does not answer (a
                # frozen server) fails the move before any write waits. Then the
                # actives: from their hold on, the writes of the moving keys wait, and
                # their answers and the catch-up share the hold's bound.
                peers = self._peers_of(sources, src)
                log.info("reshard: the sources' peers hold first (%s)", ", ".join(peers))
                await asyncio.gather(*(self._step(n, "hold", routing=new.describe(),
                                                  peer=True, forward=forward)
                                       for n in peers))
                hold_began = time.monotonic()
                # (the flip after the seals holds the writes too: its part of the bound
                # is kept for it)
                reserve = flip_reserve(self.hold_bound_s, self.last_flip_s)
                bound_s = self.hold_bound_s - reserve
                try:
                    got = await self._within_bound(asyncio.gather(*(
                        self._step(src[s], "hold", routing=new.describe(), forward=forward)
                        for s in sources)), bound_s, "their holds",
                        [src[s] for s in sources])
                    held = {s: g["move"]["hold"]["seq"] for s, g in zip(sources, got)}
                    spent_s = time.monotonic() - hold_began
                    await self._reached("held")  # (a test's pause here is not counted)
                    resumed = time.monotonic()
                    # (each look bounded too: a target that does not answer, frozen or
                    # given no core, held the writes for its request's whole 5 s)
                    left = max(bound_s - spent_s, 0.0)
                    await self._within_bound(self._copies(
                        dst, lambda imp: imp["source_seq"] >= held[self._source_of(imp, src)],
                        left, "the copies' catch-up", src), left, "the copies' catch-up",
                        list(dst.values()))
                    spent_s += time.monotonic() - resumed
                    # the flip may begin: no hold ends by itself now, and no abort
                    self._check_abort()
                    self._past_flip = True
                    recording = time.monotonic()
                    await self._record_move(old, new, new_plan, targets,
                                            max(bound_s - spent_s, SEAL_MIN_S))
                    spent_s += time.monotonic() - recording
                    sealing = [*(src[s] for s in sources), *self._peers_of(sources, src)]
                    await self._within_bound(asyncio.gather(*(
                        self._step(n, "seal") for n in sealing)),
                        max(bound_s - spent_s, SEAL_MIN_S), "their seals", sealing)
                    phases["catch_up_s"] = time.monotonic() - hold_began
                    phases["flip_reserve_s"] = reserve
                    break
                except TimeoutError as exc:  # the catch-up, or answers, past the bound
                    self._past_flip = False
                    log.warning("reshard: %s, attempt %d: the writes are released", exc,
                                attempt)
                    await asyncio.gather(*(self._step(name, "release") for name in [
                        *(src[s] for s in sources), *peers]))
                    await self._clear_record()
            else:
                raise Refused(b"409", f"the copies did not catch up within the hold bound "
                                      f"({self.hold_bound_s:g} s) in {HOLD_ATTEMPTS} tries")
        except BaseException as exc:
            if counting is not None:  # (stopped if the start failed first; else its
                counting.cancel()  # outcome is read: the roll-back says why)
                counting.add_done_callback(_read_outcome)
            await self._roll_back(sources, targets, added, exc)
            if isinstance(exc, Exception) and not isinstance(exc, Refused):
                raise Refused(b"409", f"rolled back before the flip: {type(exc).__name__}: "
                                      f"{exc}") from exc
            raise
        await self._reached("sealed")
        # 4. the flip: the targets (durable there first), the run directory, the sources
        keys = self._state.get("keys", 0)  # (the copies' last poll: a target may be gone)
        sealed_at = time.monotonic()
        paused_before = self._paused_s
        # recorded before any target commits: a supervisor that stops between two
        # targets' commits leaves the next start to bring the old routing back
        routing_state.write_move(self.run_dir, old, new, {
            t: [f"{s.shard}-{s.role}" for s in (new_plan.shards[t].primary,
                                                  new_plan.shards[t].backup)]
            for t in targets})
        try:
            await self._sources_sealed(sources)
            for i, t in enumerate(targets):  # one by one: a torn flip is one state
                await self._step(dst[t], "commit", routing=new.describe())
                if i == 0 and len(targets) > 1:
                    await self._reached("committing")
        except Exception as exc:  # (a target gone: no answer) the old routing, later epoch
            back = await self._back(old, new)
            # the holds released, and the targets' copies dropped (a copy left behind,
            # failed, made the next change roll back at its first look at the copies)
            await asyncio.gather(*(self._step(name, "release") for name in [
                *(src[s] for s in sources), *self._peers_of(sources, src)]),
                *(self._step(name, "stop-import") for t in targets
                  for name in self._of_shard(t)),
                return_exceptions=True)  # at once: a server cut off costs one timeout
            # a target that committed before another refused forgets what it took
            # (and the added shards stop: other hosts' parts asked at the same time)
            await asyncio.gather(self._install(back, self._running(), forget=True),
                                 *(self._on_hosts(new_plan, index, "drop")
                                   for index in added))
            for index in added:
                await self.runner.remove_shard(index)
            routing_state.clear_move(self.run_dir)
            await self._clear_record()
            raise Refused(b"409", f"not flipped ({type(exc).__name__}: {exc}); the old "
                                  f"routing is back as epoch {back.epoch}") from exc
        await self._reached("committed")
        await self._commit(new_plan)  # after the copies are durable on the targets
        routing_state.clear_move(self.run_dir)
        await self._clear_record()  # etcd took the flip: the record is done with
        await self._reached("flipped")
        phases["commit_s"] = time.monotonic() - sealed_at
        phases["copy_paused_s"] = self.copy_paused_s
        # the sources first, every server of each at once: that ends the hold (what they
        # held goes on), also where a source's active changed since the copy (its peer
        # is active now, and a dead one's silence must not keep it waiting)
        giving = [n for s in sources for n in self._of_shard(s)]
        answers = [await self._install(new, giving, forget=True, forward=forward)]
        phases["hold_s"] = time.monotonic() - hold_began
        # (from the seals to the sources' new routing: what the next change keeps for it)
        self.last_flip_s = phases["flip_s"] = max(
            0.0, time.monotonic() - sealed_at - (self._paused_s - paused_before))
        rest = [n for t in targets for n in self._of_shard(t) if n != dst[t]]
        others = [n for n in self._running()
                  if self._server(n).index not in (*sources, *targets)]
        answers += await asyncio.gather(self._install(new, rest), self._install(new, others))
        unanswered = {n for got in answers for n, why in got.items()
                      if why.startswith(NO_ANSWER)}
        await self._install_late(new, {*giving, *rest, *others, *dst.values()} - unanswered,
                                 sources, forward, again=unanswered)
        if added:  # their relays, on the routing now committed
            relays = self.runner.add_relays(self.plan, added)
            if relays:
                log.info("reshard: relays of the added shards started: %s", ", ".join(relays))
        if removed:  # 5. stop, once clients had heartbeats to follow
            asyncio.get_running_loop().create_task(self._remove_later(removed))
        took = time.monotonic() - began
        log.info("reshard: epoch %d, %d -> %d shards, %d keys moved in %.3f s (hold %.3f s, "
                 "attempt %d)", new.epoch, old.shards, new.shards, keys, took,
                 phases["hold_s"], attempt)
        plan.update(copy_rate=self.copy_rate, copy_priority=self.copy_priority)
        plan.update(epoch=new.epoch, changed=True, servers=self._running(), at=time.time(),
                    moved_keys=keys, took_s=round(took, 3), attempts=attempt,
                    phases={k: round(v, 3) for k, v in phases.items()}, removed=removed,
                    background=background)
        return plan

    def state(self) -> dict:
        """Where the cluster's routing stands, for status and metrics: its epoch, and the
        change under way (or the last one): phase, keys and bytes copied so far."""
        return dict(self._state, epoch=self.routing.epoch)

    async def _say(self, **fields) -> None:
        """Progress to the caller (a PARTIAL of ``cluster.reshard``), at most every
        ``PROGRESS_S`` unless it is a new phase; kept for ``state``."""
        self._state.update({k: v for k, v in fields.items() if k in ("keys", "bytes")})
        self._state["phase"] = self.phase
        now = time.monotonic()
        if self.progress is None or ("phase" not in fields and
                                     now - self._said_at < PROGRESS_S):
            return
        self._said_at = now
        try:
            await self.progress(json.dumps(dict(fields, phase=self.phase)).encode())
        except Exception as exc:  # noqa: BLE001 - the caller left: the move goes on
            log.debug("reshard progress not sent: %s", exc)

    async def _reached(self, phase: str) -> None:
        """The move reached ``phase`` (logged; where ``STOP_AT_ENV`` says, it stops)."""
        self._check_abort()
        self.phase = phase
        log.info("reshard: phase %s", phase)
        await self._say(phase=phase)
        if os.environ.get(STOP_AT_ENV) == phase:
            print(f"RESHARD_STOPPED phase={phase}", flush=True)
            await asyncio.Event().wait()
        if os.environ.get(PAUSE_AT_ENV) == phase:
            go_on = self.run_dir / CONTINUE_FILE
            print(f"RESHARD_PAUSED phase={phase}", flush=True)
            paused = time.monotonic()
            while not go_on.exists():
                self._check_abort()
                await asyncio.sleep(0.02)
            go_on.unlink()
            self._paused_s += time.monotonic() - paused

    async def _source_seq(self, name: str) -> int:
        """The sequence of ``name``, a source's active when its copies began; ``Refused``
        once it is not active (it failed over: its copies end with it, and would be
        waited for until the copy's whole timeout)."""
        stats = await self._ask(name)
        if not stats.get("active"):
            raise Refused(b"409", f"{name}, the source's active its copies come from, is "
                                  "no longer active")
        return stats.get("seq", 0)

    async def _within_bound(self, steps, within_s: float, what: str, names: list[str]):
        """``steps`` (the holds', the catch-up's looks, the seals' requests) done within
        ``within_s``, what is left of the hold's bound; else ``TimeoutError``: the writes
        held meanwhile are released at once, rather than after a frozen or restarting
        server's whole request timeout, and the move tries again (one that does not
        answer its release rolls the move back). What the steps raise themselves (the
        catch-up's copies behind at its deadline) is raised as it is."""
        task = asyncio.ensure_future(steps)
        try:
            done, _ = await asyncio.wait({task}, timeout=within_s)
        except asyncio.CancelledError:  # (the change itself is stopped: the steps too)
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        reserve = flip_reserve(self.hold_bound_s, self.last_flip_s)
        raise TimeoutError(f"{', '.join(names)} did not answer {what} within the hold "
                           f"bound ({within_s:.3f} s left of {self.hold_bound_s:g} s, "
                           f"{reserve:.3f} s of it kept for the flip)")

    def _peers_of(self, sources: list[int], src: dict[int, str]) -> list[str]:
        """The running pair servers of the sources other than their actives."""
        return [n for s in sources for n in self._of_shard(s) if n != src[s]
                and self._server(n).role in ("primary", "backup")]

    def _source_of(self, imp: dict, src: dict[int, str]) -> int:
        for s, name in src.items():
            plan = self._server(name)
            if imp["source"] == f"tcp://{plan.address}:{plan.port}":
                return s
        raise Refused(b"409", f"a copy from an unknown source {imp['source']}")

    async def _copies(self, dst: dict[int, str], done: Callable[[dict], bool],
                      within_s: float, what: str, src: dict[int, str],
                      poll_s: float = POLL_S, while_moving: bool = False) -> None:
        """Until every import on every target is ``done`` (a failed copy, or a target
        that no longer holds one: ``Refused``; ``within_s`` passed: ``TimeoutError``),
        looking every ``poll_s``. ``while_moving``: ``within_s`` counts from the last
        look at which a snapshot had come further (``snapshots_moved``), not from the
        start: a copy slower than its rate (idle priority on a busy host) goes on."""
        deadline = time.monotonic() + within_s
        while True:
            self._check_abort()
            gone = [n for n in src.values()
                    if self._local(n) and self.runner.servers[n].state != RUNNING]
            if gone:  # (its peer, once active, serves no copy that began on it)
                raise Refused(b"409", f"{', '.join(gone)}, the active of a source, stopped")
            finished = True
            keys = size = 0
            paused = 0.0
            stats_seen: list[tuple[str, dict]] = []
            for name in dst.values():
                try:
                    stats = await self._ask(name)
                except ClonemapError as exc:  # busy copying: asked again, to the deadline
                    if self._local(name) and self.runner.servers[name].state != RUNNING:
                        raise Refused(b"409", f"{name}, a target's active, stopped: its "
                                              "copy is lost") from None
                    log.debug("reshard: %s did not answer: %s", name, exc)
                    finished = False
                    continue
                if not stats.get("active") or not _imports(stats):
                    raise Refused(b"409", f"{name} no longer holds its copy (it restarted, "
                                          "or its peer took over: it says active "
                                          f"{stats.get('active')}, {stats.get('bstar_state')},"
                                          f" {len(_imports(stats))} copies, up "
                                          f"{stats.get('uptime_s')} s)")
                for imp in _imports(stats):
                    if imp.get("error"):
                        raise Refused(b"409", f"{name}: a copy failed: {imp['error']}")
                    finished = finished and done(imp)
                    stats_seen.append((name, imp))
                    keys += imp["keys"]
                    size += imp["bytes"]
                    paused += imp.get("paused_s", 0.0)
            self.copy_paused_s = paused
            await self._say(keys=keys, bytes=size)
            if finished:
                return
            moved, self._snapshot_looks = snapshots_moved(self._snapshot_looks, stats_seen)
            if moved:
                self._moved_at = time.monotonic()
                if while_moving:
                    deadline = self._moved_at + within_s
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what} not within {within_s:g} s")
            await asyncio.sleep(poll_s)

    async def _wait(self, check, within_s: float, what: str) -> None:
        deadline = time.monotonic() + within_s
        while True:
            try:
                await check()
                return
            except Exception as exc:  # noqa: BLE001 - a server not up or not answering yet
                if time.monotonic() >= deadline:
                    raise Refused(b"409", f"no {what} within {within_s:g} s ({exc})") from None
            await asyncio.sleep(0.1)

    async def _roll_back(self, sources: list[int], targets: list[int],
                         added: list[int], why: BaseException) -> None:
        """Before the flip, because of ``why``: release the holds, drop the copies, stop
        the added shards (every server asked at once: servers cut off cost one timeout,
        not one each)."""
        adding = self._adding
        await asyncio.gather(*(self._step(name, "release") for index in sources
                               for name in self._of_shard(index)),
                             *(self._step(name, "stop-import") for index in targets
                               for name in self._of_shard(index)),
                             *(self._on_hosts(adding, index, "drop") for index in added
                               if adding is not None),
                             return_exceptions=True)
        for index in added:  # they never served: their data directories go too
            await self.runner.remove_shard(index)
            if adding is not None:
                await self._drop_data(adding, index)
        await self._clear_record()
        log.warning("reshard: rolled back before the flip (%s); the routing is unchanged",
                    why.text if isinstance(why, Refused) else f"{type(why).__name__}: {why}")

    # ------------------------------------------------------------------ across hosts
    async def _on_hosts(self, plan: Plan, index: int, op: str) -> list[str]:
        """Ask every other host's supervisor that runs a server of shard ``index`` (a
        shard the change adds) to ``start`` it or ``drop`` it (``part``); the names of
        the servers that did not start."""
        hosts = dict(plan.placed)
        others = sorted({hosts[s.name] for s in plan.shards[index].servers
                         if not plan.is_local(s) and s.name in hosts})
        failed: list[str] = []
        for host in others:
            endpoint = dict(plan.hosts)[host]
            body = json.dumps({"part": op, "config": self._new_config, "shards": [index],
                               "epoch": plan.routing.epoch}).encode()
            client = MdpClient(endpoint, ctx=self.ctx, retries=0, security=self.security,
                               timeout_s=START_WAIT_S + ASK_TIMEOUT_S if op == "start"
                               else ASK_TIMEOUT_S)
            try:
                got = json.loads((await client.request(b"cluster.reshard", body))[-1])
                failed += got.get("not_up", [])
            except Exception as exc:  # noqa: BLE001 - named: the change rolls back
                log.warning("reshard: host %s did not %s shard %d: %s", host, op, index, exc)
                failed += [s.name for s in plan.shards[index].servers
                           if hosts.get(s.name) == host]
            finally:
                await client.close()
        return failed

    async def part(self, doc: dict) -> dict:
        """Another host's supervisor runs a change that adds shards with servers on this
        host: ``start`` them (from ``doc["config"]``, planned for this host, at the
        change's epoch), or ``drop`` them (the change rolled back: stopped, their data
        directories removed, since they never served)."""
        op, indices = doc.get("part"), [int(i) for i in doc.get("shards", [])]
        if op == "start":
            try:
                new_plan = self.load_plan(str(doc.get("config", "")))
            except ConfigError as exc:
                raise Refused(b"400", f"{doc.get('config')}: {exc}") from None
            new_plan = dataclasses.replace(new_plan, routing=dataclasses.replace(
                new_plan.routing, epoch=int(doc.get("epoch", self.routing.epoch + 1))))
            self._parts = new_plan
            not_up: list[str] = []
            for index in indices:
                if index >= len(new_plan.shards):
                    raise Refused(b"400", f"{doc.get('config')} has no shard {index}")
                if any(p.plan.index == index for p in self.runner.servers.values()):
                    await self.runner.remove_shard(index)  # left from an earlier attempt
                    await self._drop_data(new_plan, index)
                self._part_shards.add(index)
                not_up += await self.runner.add_shard(new_plan.shards[index], new_plan,
                                                      START_WAIT_S)
            log.info("reshard: shard%s %s started here for a change run by another host",
                     "" if len(indices) == 1 else "s", ", ".join(map(str, indices)))
            return {"started": indices, "not_up": not_up}
        if op == "drop":
            for index in indices:
                await self._drop_part(index)
                self._part_shards.discard(index)
            return {"dropped": indices}
        raise Refused(b"400", f"part {op!r}: not start or drop")

    async def _record_move(self, old: ShardMap, new: ShardMap, new_plan: Plan,
                           targets: list[int], within_s: float) -> None:
        """Across hosts, before the holds are sealed: the change's record in etcd (the
        routings, their configs, and where each target's servers are asked), so that
        another host's supervisor settles it should this one die past the seal, when the
        sealed holds of its own host's servers would otherwise never end. Not recorded:
        the change rolls back. The writes wait meanwhile, so etcd has what is left of
        the hold's bound (``within_s``): past it, ``TimeoutError`` (the holds are
        released and the move tried again). A put that etcd still takes later writes
        this same change's record (it holds only while the change's claim does), and
        this supervisor removes it once the change ended without leaving its record on
        purpose (``_settle_orphan``)."""
        if self.shared is None:
            return
        doc = {"from": old.describe(), "to": new.describe(), "host": self.plan.host_name,
               "change": self._change_id,
               "from_config": self.config_path, "config": self._new_config,
               "targets": {str(t): {sv.name: new_plan.control_of(sv)
                                    for sv in new_plan.shards[t].servers}
                           for t in targets}}
        writing = asyncio.ensure_future(asyncio.to_thread(self.shared.write_move, doc,
                                                          self._claim))
        try:
            self._record_at = await asyncio.wait_for(asyncio.shield(writing), within_s)
        except TimeoutError:
            writing.add_done_callback(_read_outcome)
            raise TimeoutError(f"etcd did not take the move's record within {within_s:.3f} "
                               "s (what the hold's bound left)") from None
        if not self._record_at:
            self._claim_lapsed = self._claim_lapsed or "the record found it gone"
            raise Refused(b"409", self._lapsed_text())

    async def _clear_record(self) -> None:
        """This change's record goes, if it wrote one and it is still there (never
        another change's, begun since by a supervisor that found this one's claim
        lapsed)."""
        at, self._record_at = self._record_at, 0
        if self.shared is None or not at:
            return
        try:
            if not await asyncio.to_thread(self.shared.clear_move, at):
                log.warning("reshard: the move's record in etcd is no longer this "
                            "change's (written at revision %d): left as it is", at)
        except Exception as exc:  # noqa: BLE001 - settled later: the epoch says it is done
            log.warning("reshard: the move's record in etcd was not removed (%s)", exc)

    async def _epoch_at(self, endpoint: str, name: str) -> int | None:
        """The routing epoch server ``name`` follows and committed (0: it runs on a
        routing it did not commit), asked through the broker at ``endpoint``; None when
        it does not answer."""
        shard, _, role = name.partition("/")
        client = MdpClient(endpoint, ctx=self.ctx, timeout_s=SETTLE_ASK_S, retries=0,
                           security=self.security)
        try:
            stats = json.loads((await client.request(stats_service(shard, role)))[-1])
            routing = stats.get("routing") or {}
            # (a shard the change adds runs on its routing before it commits)
            return 0 if routing.get("provisional") else int(routing.get("epoch") or 0)
        except Exception:  # noqa: BLE001 - gone with its host, or cut off
            return None
        finally:
            await client.close()

    async def _settle_orphan(self) -> bool:
        """A change whose supervisor died past its seal (its record in etcd, and nobody
        holds the claim): this supervisor takes the claim and decides, as a start does
        on one host. Every target (a server of each answering) took the new routing:
        etcd takes it. Else the routing before comes back as the epoch after. Then the
        record goes, and every host's supervisor follows etcd's routing as after any
        change: the sealed holds end (forwarded, or applied where the keys stayed), and
        what a target took is forgotten when the routing came back. A target none of
        whose servers answers (all on the dead host) leaves it to that host's restart.
        True while there was a record (the caller looks again next turn)."""
        record, at = await asyncio.to_thread(self.shared.read_move_at)
        if record is None:
            return False
        if isinstance(record, dict) and record.get("change") in self._ended:
            # the record of a change this supervisor ran, which ended without leaving one
            # (it rolled back, or flipped): a put that etcd took after its attempt gave up
            # on it (read from its socket once etcd ran again, while the claim held)
            await asyncio.to_thread(self.shared.clear_move, at)
            log.warning("reshard: a record of this supervisor's change to epoch %s in "
                        "etcd, written after its attempt gave up on it: removed",
                        record.get("to", {}).get("epoch"))
            return True
        try:
            before = ShardMap.from_description(record["from"])
            after = ShardMap.from_description(record["to"])
            targets = {int(t): dict(servers) for t, servers in record["targets"].items()}
        except (ConfigError, KeyError, TypeError, ValueError, AttributeError) as exc:
            log.error("reshard: the move's record in etcd does not parse (%s): removed", exc)
            await asyncio.to_thread(self.shared.clear_move, at)
            return True
        held, _, _ = await asyncio.to_thread(self.shared.read)
        if held is not None and held.epoch >= after.epoch:
            await asyncio.to_thread(self.shared.clear_move, at)  # it was settled
            return True
        lease, _ = await asyncio.to_thread(
            self.shared.claim, f"host {self.plan.host_name}: settling the change to epoch "
                               f"{after.epoch} of host {record.get('host')}", CLAIM_TTL_S)
        if not lease:
            return True  # its own supervisor still runs it, or another settles it
        try:
            took = {}
            for t, servers in targets.items():
                epochs = [e for e in await asyncio.gather(*(
                    self._epoch_at(endpoint, name) for name, endpoint in servers.items()))
                    if e is not None]
                if not epochs:
                    log.warning("reshard: the change to epoch %d of host %s stopped past "
                                "its seal; no server of its target shard %d answers: left "
                                "to that host's next start", after.epoch,
                                record.get("host"), t)
                    return True
                took[t] = max(epochs) >= after.epoch
            if all(took.values()):
                now = after
                config = str(record.get("config") or "")
            else:
                now = before.with_epoch(after.epoch + 1)
                config = str(record.get("from_config") or "")
            await asyncio.to_thread(self.shared.advance, now, config)
            await asyncio.to_thread(self.shared.clear_move, at)
            log.warning("reshard: the change to epoch %d of host %s stopped past its seal "
                        "(its supervisor is gone); settled here: %s", after.epoch,
                        record.get("host"), "every target took its keys, the change goes "
                        "forward" if now is after else f"the routing before it is back "
                        f"as epoch {now.epoch}")
            return True
        finally:
            await asyncio.to_thread(self.shared.release, lease)

    async def _drop_part(self, index: int) -> None:
        names = await self.runner.remove_shard(index)
        if self._parts is not None:
            await self._drop_data(self._parts, index)
        log.info("reshard: shard %d dropped here (%s): the change that added it rolled "
                 "back", index, ", ".join(names) or "none ran")

    async def _drop_data(self, plan: Plan, index: int) -> None:
        """The data directories of this host's servers of added shard ``index`` (it
        never served)."""
        for server in plan.shards[index].servers if index < len(plan.shards) else ():
            data = self.runner.data_dir(server)
            if data is not None and plan.is_local(server):
                shutil.rmtree(data, ignore_errors=True)

    async def _orphans(self, held: ShardMap) -> None:
        """Shards this host started for another host's change (``part``) that neither
        came (etcd's routing, ``held``, has fewer shards) nor is still under way (no
        claim in etcd, no change's record waiting to be settled): that change rolled
        back and its ``drop`` did not reach this host (a partition, its supervisor
        died): dropped here."""
        self._part_shards = {i for i in self._part_shards
                             if i >= self.routing.shards and i >= held.shards}
        extra = sorted(self._part_shards)
        if not extra or self.shared is None or await asyncio.to_thread(self.shared.claimed):
            return
        if await asyncio.to_thread(self.shared.read_move) is not None:
            return  # settled first (``_settle_orphan``)
        log.warning("reshard: the change that added shard%s %s here is no longer under "
                    "way and did not flip: dropping %s", "" if len(extra) == 1 else "s",
                    ", ".join(map(str, extra)), "it" if len(extra) == 1 else "them")
        for index in extra:
            await self._drop_part(index)
        self._part_shards.clear()

    async def follow(self) -> None:
        """Across hosts: every heartbeat, the routing in etcd; a later epoch than this
        supervisor's (a change another host's supervisor ran) becomes this one's: its
        plan (the config that set it, planned for this host), run directory, cluster map
        and the servers it runs; a shard the change removed stops here too. In between:
        a change whose supervisor died past its seal is settled (``_settle_orphan``), a
        shard started here for a change that rolled back unseen is dropped
        (``_orphans``), and a server here on an older epoch is given etcd's
        (``_laggards``). On one host, every heartbeat between changes: a server on an
        older epoch than this supervisor's is given it (``_laggards``)."""
        from clonemap.shards.coord import CoordinationError

        said = ""
        while True:
            await asyncio.sleep(self.plan.heartbeat_s)
            if self._lock.locked():
                continue
            if self.shared is None:  # one host: the routing is this supervisor's
                try:
                    async with self._lock:
                        await self._laggards(since=self._changed_at)
                except Exception as exc:  # noqa: BLE001 - a server gone: tried again
                    log.warning("reshard: checking the servers against the routing: %s",
                                exc)
                continue
            try:
                held, config, _ = await asyncio.to_thread(self.shared.read)
            except (CoordinationError, ConfigError) as exc:
                if str(exc) != said:
                    said = str(exc)
                    log.warning("routing: etcd %s: %s (this host keeps epoch %d)",
                                self.shared.url, exc, self.routing.epoch)
                continue
            if held is None or held.epoch <= self.routing.epoch or self._lock.locked():
                try:  # (each on etcd as read now: a settle changes it, seen next turn)
                    if held is not None and not await self._settle_orphan():
                        await self._orphans(held)
                        if held.epoch == self.routing.epoch:
                            await self._laggards()
                except Exception as exc:  # noqa: BLE001 - etcd gone: tried again
                    log.warning("reshard: checking this host's servers against the "
                                "routing: %s", exc)
                continue
            try:
                await self._follow(held, config)
                said = ""
            except (ConfigError, Refused) as exc:
                if str(exc) != said:
                    said = str(exc)
                    log.error("routing: epoch %d in etcd not followed: %s", held.epoch, exc)

    async def _laggards(self, since: float = 0.0) -> None:
        """This host's running servers that say (in their last stats, taken after
        ``since``) they follow an older routing than the committed one (etcd's across
        hosts, this supervisor's on one): cut off from the change's supervisor at its
        flip, restarted on the routing of an earlier start, or (on one host, seen under
        load in `test_routing_epoch.py`) a source's active killed while the move waited
        at its seal, back as passive, that no install of the flip reached. Each takes it
        now with ``forget`` (a key it holds that the routing places elsewhere has moved:
        a routing is committed only once every target committed) and forwards to every
        shard's collectors (the writes it held or still gets for moved keys)."""
        now = self.routing
        late = [name for name, proc in self.runner.servers.items()
                if proc.state == RUNNING and proc.plan.role in ("primary", "backup")
                and (proc.stats_at or 0.0) > since
                and 0 < ((proc.stats.get("routing") or {}).get("epoch") or 0) < now.epoch]
        if not late:
            return
        got = await self._install(now, late, forget=True, forward=_collectors(self.plan))
        for name, why in got.items():
            log.info("routing: %s, on an older routing, takes epoch %d%s", name, now.epoch,
                     f" (refused: {why})" if why else "")
        for name in late:  # their next stats say where they are
            self.runner.servers[name].clear_stats()

    async def _follow(self, held: ShardMap, config: str) -> None:
        old = self.routing
        if held.shards == old.shards:
            new_plan = self.plan
        else:
            try:
                new_plan = self.load_plan(config)
            except ConfigError as exc:
                raise ConfigError(f"it has {held.shards} shards, set by {config or '?'}, "
                                  f"which does not plan here: {exc}") from None
            if new_plan.routing.shard_map() != held:
                raise ConfigError(f"{config} routes otherwise than epoch {held.epoch}")
        prefixes = held.pins_by_shard()
        new_plan = dataclasses.replace(new_plan, routing=RoutingParams(
            held.shards, tuple(tuple(prefixes.get(i, ())) for i in range(held.shards)),
            epoch=held.epoch))
        self.config_path = config or self.config_path
        log.info("routing: epoch %d from etcd (set by %s): %d -> %d shards", held.epoch,
                 config or "a reshard", old.shards, held.shards)
        self._take(new_plan)
        for index in range(old.shards, held.shards):  # this host away at the change
            shard = new_plan.shards[index]
            if any(new_plan.is_local(s) and s.name not in self.runner.servers
                   for s in shard.servers):
                await self.runner.add_shard(shard, new_plan, START_WAIT_S)
        # this host's servers, as the flip does (``_laggards``: etcd's routing is committed)
        mine = [n for n in self._running() if self._local(n)]
        refused = {n: why for n, why in (await self._install(
            held, mine, forget=True, forward=_collectors(new_plan))).items() if why}
        if refused:
            log.info("routing: epoch %d not installed on %s", held.epoch, refused)
        await self._close_clients()
        removed = list(range(held.shards, old.shards))
        if removed:
            asyncio.get_running_loop().create_task(self._remove_later(removed))

    async def _remove_later(self, removed: list[int]) -> None:
        await asyncio.sleep(REMOVE_AFTER_HEARTBEATS * self.plan.heartbeat_s)
        for index in removed:
            names = await self.runner.remove_shard(index)
            log.info("reshard: shard %d removed (%s stopped; data directories kept)", index,
                     ", ".join(names))

    async def _commit(self, new_plan: Plan) -> None:
        """``new_plan`` (its routing and shards) is the cluster's: etcd (across hosts),
        the run directory, the servers' command lines for their next start, the cluster
        map. Across hosts etcd must take it first: if it does not answer, or holds a
        later routing (another host's supervisor settled this change, having found no
        claim on it), ``Refused``, and nothing here changes. The change's record in etcd
        lets the first supervisor that reaches etcd settle it (``_settle_orphan``)."""
        from clonemap.shards.coord import CoordinationError

        shard_map = new_plan.routing.shard_map()
        config = self._new_config or self.config_path
        if self.shared is not None:
            try:
                held = await asyncio.to_thread(self.shared.advance, shard_map, config)
            except (CoordinationError, ConfigError) as exc:
                raise Refused(b"503", f"etcd {self.shared.url} did not take epoch "
                                      f"{shard_map.epoch} ({exc}); the change is settled "
                                      "by the first supervisor that reaches etcd") from None
            if held.epoch != shard_map.epoch or held != shard_map:
                raise Refused(b"409", f"etcd holds epoch {held.epoch}, not this change's "
                                      f"{shard_map.epoch}: another supervisor settled it; "
                                      "this one follows etcd")
        self.config_path = config
        self._take(new_plan)

    def _take(self, new_plan: Plan) -> None:
        """This supervisor serves ``new_plan``'s routing (run directory, command lines,
        cluster map)."""
        shard_map = new_plan.routing.shard_map()
        routing_state.write(self.run_dir, new_plan.cluster, shard_map)
        # the pins as the routing has them (a shard's prefixes in the map follow them)
        by_shard = shard_map.pins_by_shard()
        prefixes = tuple(tuple(by_shard.get(i, ())) for i in range(shard_map.shards))
        self.plan = dataclasses.replace(
            new_plan,
            routing=RoutingParams(shard_map.shards, prefixes, epoch=shard_map.epoch),
            shards=tuple(dataclasses.replace(sh, prefixes=prefixes[sh.index])
                         for sh in new_plan.shards))
        self.runner.set_plan(self.plan)
        self.on_changed(self.plan)
