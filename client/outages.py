"""What a shard agent tells its application about outages: failovers and data losses.

* **Failover** (the machine's ``Failover`` effect): counted, logged, remembered per server
  left (``left_because``: a write that times out names why, ``unavailable``), and
  ``on_failover(FailoverInfo)`` is called; when the shard serves again (an install that
  ends the machine's ``Outage``) it is called once more with ``resumed=True`` and the
  gap from the old server's last message to the new snapshot. Moves before the client's
  first snapshot of the shard are not failovers (a passive primary sends a starting client
  to its backup): remembered, logged at INFO, nothing else.
* **Data loss** (at an install over an earlier map): a generation that changed, or a
  sequence that went backwards, means the server's map is not the one this client had:
  a ``ResetInfo`` (keys lost and changed), counted, a WARNING, ``on_reset``.

Application callbacks run on the client's loop thread; one that raises is logged, never
the agent's failure.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from clonemap.client import shard_machine as sm
from clonemap.client.events import FailoverInfo, ResetInfo

if TYPE_CHECKING:
    from clonemap.client.agent_view import AgentView

log = logging.getLogger("clonemap.client.agent")


def diff_counts(old: dict[bytes, bytes], new: dict[bytes, bytes]) -> tuple[int, int]:
    """(keys of ``old`` that ``new`` lacks, keys new or changed in ``new``)."""
    get = old.get
    return len(old.keys() - new.keys()), sum(1 for k, v in new.items() if get(k) != v)


class Outages:
    """One agent's outage reports (see the module doc)."""

    def __init__(self, agent: "AgentView", on_failover, on_reset):
        self.agent = agent
        self.on_failover = on_failover
        self.on_reset = on_reset
        self.failovers = 0
        self.last_failover: FailoverInfo | None = None
        self.left_because: dict[str, tuple[str, float]] = {}
        """Server -> why this client last moved away from it, and when."""
        self.passive_at: dict[str, float] = {}
        """When each server last said it does not serve (a passive): kept apart from
        ``left_because``, which a later move away from it for silence overwrites."""
        self.start_reported = False
        """A move before this client's first snapshot of the shard was not a passive
        server's answer (a server down or silent): its end is reported too."""
        self.resets = 0
        self.last_reset: ResetInfo | None = None
        """The last data loss; when the phase is ``KEPT``, the one this client keeps."""

    def _call_back(self, callback, info, name: str) -> None:
        if callback is not None:
            try:
                callback(info)
            except Exception:
                log.exception("shard %s: %s callback failed", self.agent.name, name)

    # ------------------------------------------------------------------ failovers
    def failed_over(self, eff: sm.Failover) -> None:
        """A move to another server. Before this client's first snapshot of the shard, a
        move because the server is passive is how the client finds the serving one (after
        any failover the primary is passive, the normal state): logged at INFO, not
        counted, no callback. Any other move (a server down or silent) is reported."""
        agent = self.agent
        info = FailoverInfo(agent.name, agent.servers[eff.old], agent.servers[eff.new],
                            eff.reason, eff.silent_s)
        self.left_because[info.old] = (f"{eff.reason} after {eff.silent_s:.1f} s",
                                       agent.clock())
        if eff.passive:
            self.passive_at[info.old] = agent.clock()
        if not agent.snapshots:
            if eff.passive:
                log.info("shard %s: %s; trying %s", agent.name, eff.reason, info.new)
                return
            self.start_reported = True
        self.failovers += 1
        self.last_failover = info
        log.warning("shard %s: %s after %.1f s; moving from %s to %s", agent.name,
                    eff.reason, eff.silent_s, info.old, info.new)
        self._call_back(self.on_failover, info, "on_failover")

    def resumed(self, outage: sm.Outage, old: dict[bytes, bytes],
                new: dict[bytes, bytes], first: bool) -> None:
        """Served again after an outage. ``first``: this install is the client's first
        of the shard; when every move before it was a passive server's answer, nothing
        was interrupted (it found its server): INFO only."""
        agent = self.agent
        first_server, heard_s, reason, silent_s = outage
        if first and not self.start_reported:
            log.info("shard %s: served by %s", agent.name, agent.server)
            return
        removed, changed = diff_counts(old, new)
        info = FailoverInfo(agent.name, agent.servers[first_server], agent.server, reason,
                            silent_s, resumed=True, gap_s=agent.clock() - heard_s,
                            removed=removed, changed=changed)
        self.last_failover = info
        log.warning("shard %s: resumed on %s %.2f s after the last message from %s "
                    "(%d keys removed, %d new or changed)", agent.name, info.new, info.gap_s,
                    info.old, removed, changed)
        self._call_back(self.on_failover, info, "on_failover")

    def unavailable(self, within_s: float) -> str:
        """Why no server of this shard served this client lately: each server it left
        within the last ``within_s`` seconds, and why ("" when it left none)."""
        since = self.agent.clock() - within_s
        recent = [(server, why) for server, (why, at) in self.left_because.items()
                  if at >= since]
        if not recent:
            return ""
        text = "; ".join(f"{server}: {why}" for server, why in recent)
        # a passive's answer within the window, even if this client left that server
        # later for silence (on a loaded host its answer can come after the timer): a
        # FAIL that named only "silent" hid the cut off from the active (seen in CI)
        if any(at >= since for at in self.passive_at.values()):
            text += (" (a passive server says its peer serves: this client may be cut off "
                     "from the active one)")
        return text

    # ------------------------------------------------------------------ data losses
    def data_loss(self, old: dict[bytes, bytes], new: dict[bytes, bytes],
                  eff: sm.InstallSnapshot) -> ResetInfo | None:
        """A snapshot about to replace an installed one: is it a different map? If so,
        counted and logged (reported by ``report_reset``)."""
        agent = self.agent
        old_gen, new_gen, seq = eff.old_generation, eff.generation, eff.seq
        if old_gen and new_gen and old_gen != new_gen:
            reason = "the server's map is a new generation"
        elif seq < agent.last_seq:
            reason = "the server's sequence went backwards"
        else:
            return None
        lost, changed = diff_counts(old, new)
        info = ResetInfo(agent.name, agent.server, reason, old_gen, new_gen, agent.last_seq,
                         seq, len(old), len(new), lost, changed, agent.reset_policy)
        self.resets += 1
        self.last_reset = info
        log.warning("%s", info.describe())
        return info

    def report_reset(self, info: ResetInfo) -> None:
        self._call_back(self.on_reset, info, "on_reset")

    def stats(self) -> dict:
        last = self.last_reset
        return {"failovers": self.failovers, "resets": self.resets,
                "last_reset": (last._asdict() | {"server": str(last.server)}
                               if last is not None else None)}
