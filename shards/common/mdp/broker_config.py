"""An MDP/0.2 broker's settings (``BrokerConfig``): heartbeat and liveness, expiry, and
the bounds on what it holds, in counts and in bytes."""
from __future__ import annotations

from dataclasses import dataclass, field

from clonemap.shards.common.mdp import codec as mdp
from clonemap.shards.common.timing import MDP_HEARTBEAT_S, MDP_LIVENESS


def budget_config(message_bytes: int, held_bytes: int, client_held_bytes: int,
                  **kw) -> "BrokerConfig":
    """A ``BrokerConfig`` whose frames, messages and held requests are bounded in bytes
    (``limits.control_*`` in a cluster config)."""
    return BrokerConfig(max_held_bytes=held_bytes, max_held_bytes_per_client=client_held_bytes,
                        limits=mdp.Limits(max_body_bytes=message_bytes), **kw)


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    heartbeat_s: float = MDP_HEARTBEAT_S
    liveness: int = MDP_LIVENESS
    request_expiry_s: float = 10.0
    max_queued: int = 1000
    """Queued requests per service."""
    max_services: int = 1000
    max_workers: int = 10000
    max_held_bytes: int = 64 << 20
    """Bytes of request bodies queued for all services together; beyond: dropped
    ``held_bytes``."""
    max_held_bytes_per_client: int = 8 << 20
    """... for one client; beyond: dropped ``client_held_bytes``."""
    server_only: tuple[bytes, ...] = (b"shard.",)
    """Service prefixes only a peer authenticated as ``server`` may register (with CURVE
    on: the User-Id the ZAP handler gave its connection; frames carry it as
    ``frames.user_id``, see ``clonemap.shards.common.zio.Frames``)."""
    limits: mdp.Limits = field(default_factory=mdp.Limits)

    def __post_init__(self):
        if self.heartbeat_s <= 0 or self.request_expiry_s <= 0:
            raise ValueError("heartbeat_s and request_expiry_s must be > 0")
        if self.liveness < 1 or self.max_queued < 0:
            raise ValueError("liveness must be >= 1 and max_queued >= 0")
        if self.max_held_bytes < 0 or self.max_held_bytes_per_client < 0:
            raise ValueError("byte budgets must be >= 0")

    @property
    def worker_expiry_s(self) -> float:
        return self.heartbeat_s * self.liveness
