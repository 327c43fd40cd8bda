"""Which shard owns a key: the one routing function shared by clients, servers and tools.

The rule, version ``ROUTING_VERSION`` = 1::

    1. pinned prefixes: the longest pinned prefix that starts the key wins;
    2. otherwise   jump_consistent_hash(blake2b-64(routing segment), shard count)

    routing segment of a key
      "/users/42/name"  -> "users"   (starts with "/": text between the first "/" and the next)
      "/users"          -> "users"   (... or the end)
      "/"               -> ""
      "config/a"        -> "config"  (no leading "/": text up to the first "/")
      "plain"           -> "plain"   (... or the whole key)
      ""                -> ""

    blake2b-64(s) = int.from_bytes(blake2b(s as UTF-8, digest_size=8), "big")
    jump_consistent_hash: Lamping & Veach 2014, 64-bit LCG 2862933555777941757 * k + 1

Everything works on the key's UTF-8 bytes; ``owner`` accepts ``str`` or ``bytes`` keys and
gives the same answer for both spellings of one key (a ``bytes`` key that is not valid
UTF-8 still has an owner: its raw bytes are hashed).

Subtree fan-out (``owners_of_subtree``): the shards that can own *some* key starting with
the subtree (a subtree here is any prefix; 12/CHP's are "" or "/seg/.../")::

    a pinned prefix p is a prefix of the subtree   -> the longest such p's shard owns every
                                                      key under it, except keys under
                                                      longer pins (next line)
    a pinned prefix q starts with the subtree      -> q's shard
    no pin is a prefix of the subtree, and the
      routing segment is complete in the subtree   -> that segment's hashed shard
      ("/users/x" -> "users"; "cfg/" -> "cfg")
    ... the segment is still open ("", "/", "/us",
      "abc")                                       -> every shard (open segments hash anywhere)

So "/users/" fans out to one shard (plus pins under or above it), "" to all of them. Keys
that do not start with "/" lie only under subtrees that do not start with "/" (in 12/CHP
terms: only under the empty subtree).

``describe()`` is the routing function's parameters as plain data, served in the cluster
map over MDP; ``ShardMap.from_description`` rebuilds the map on the client side and
refuses a version it does not know.

The routing epoch (``ShardMap.epoch``, ``FIRST_EPOCH`` at a cluster's birth) names one
routing of a running cluster: every change of the shard count or the pins gets a larger
one, so that of two maps the newer is the one with the larger epoch. It is not part of
the routing function: equal maps route every key alike whatever their epochs, and
``digest()`` does not include it. ``newer_than`` compares two maps of one cluster. The fixed vectors in tests/unit/test_routing.py pin the
function: changing it silently would split keys between old and new clients.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

from clonemap.shards.common.errors import ConfigError

ROUTING_VERSION = 1
ROUTING_COMMAND = b"routing"
"""A server's control service: a request ``[ROUTING_COMMAND, describe() as JSON]`` installs
a newer routing (needs ``admin``; ``ShardServer.install_routing``); with a third frame
``ROUTING_COUNT`` it installs nothing and counts the keys it would take off the shard."""
ROUTING_COUNT = b"count"
ROUTING_FORGET = b"forget"
"""Third frame of a routing install: the keys it moves have moved (forget them here)."""
MOVE_COMMAND = b"move"
"""A server's control service: ``[MOVE_COMMAND, JSON {op, ...}]``, one step of a move
(``clonemap.shards.migrate``; needs ``admin``)."""
FIRST_EPOCH = 1
"""A cluster's first routing's epoch (a description without one is read as this)."""
_MASK64 = (1 << 64) - 1
_JUMP_MULTIPLIER = 2862933555777941757


def routing_segment(key: str) -> str:
    """The part of ``key`` that is hashed (see the module docstring's examples)."""
    if key.startswith("/"):
        end = key.find("/", 1)
        return key[1:] if end < 0 else key[1:end]
    end = key.find("/")
    return key if end < 0 else key[:end]


def _segment_bytes(key: bytes) -> bytes:
    if key[:1] == b"/":
        end = key.find(b"/", 1)
        return key[1:] if end < 0 else key[1:end]
    end = key.find(b"/")
    return key if end < 0 else key[:end]


def jump_consistent_hash(key: int, buckets: int) -> int:
    """Lamping & Veach's jump consistent hash of a 64-bit ``key`` into ``range(buckets)``.

    Growing ``buckets`` from n to n+1 moves a key only into the new bucket n, and moves
    about 1/(n+1) of the keys.
    """
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    key &= _MASK64
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * _JUMP_MULTIPLIER + 1) & _MASK64
        # same double-precision arithmetic as the paper's C++ code
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def segment_hash(segment: str | bytes) -> int:
    """blake2b-64 of the segment's UTF-8 bytes, as a big-endian unsigned integer."""
    data = segment.encode("utf-8") if isinstance(segment, str) else segment
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


HASHED_MEMO = 1 << 16
"""Segments whose owner ``_hashed_owner`` keeps per shard count: between this and
twice this, the last asked."""
_memo: dict[int, list[dict[bytes, int]]] = {}


def _hashed_owner(segment: bytes, shards: int) -> int:
    """The owner of a routing segment under ``shards`` shards, remembered (~6 us to
    hash). Per shard count, two dicts of ``bytes -> int``: a hit in the older moves to
    the newer, and once the newer holds ``HASHED_MEMO`` the older is dropped whole. Such
    a dict holds no container, so the garbage collector does not track it: an
    ``lru_cache`` of as many segments kept linked entries that every full collection
    walked, ~2-4 ms of a server's or a client's pause at 65,536 segments."""
    halves = _memo.get(shards)
    if halves is None:
        if len(_memo) >= 8:  # (shard counts seen in one process: a test's, or a tool's)
            _memo.clear()
        halves = _memo[shards] = [{}, {}]
    newer = halves[0]
    owner = newer.get(segment)
    if owner is None:
        owner = halves[1].get(segment)
        if owner is None:
            owner = jump_consistent_hash(segment_hash(segment), shards)
        if len(newer) >= HASHED_MEMO:
            halves[1] = newer
            newer = halves[0] = {}
        newer[segment] = owner
    return owner


def _as_bytes(key: str | bytes) -> bytes:
    return key.encode("utf-8") if isinstance(key, str) else bytes(key)


class ShardMap:
    """A shard count plus optional pinned prefixes per shard; answers "who owns this key".

    ``pins`` maps a shard index to the prefixes pinned to it. Raises ``ConfigError``
    (``field`` names the offending entry) for a bad count, an out-of-range shard index,
    an empty or non-text prefix, or a prefix pinned to two shards.
    """

    __slots__ = ("shards", "epoch", "_pins", "_pin_lengths")

    def __init__(self, shards: int, pins: Mapping[int, Iterable[str]] | None = None, *,
                 epoch: int = FIRST_EPOCH):
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ConfigError(f"shard count must be an integer >= 1, got {shards!r}",
                              field="shards")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < FIRST_EPOCH:
            raise ConfigError(f"routing epoch must be an integer >= {FIRST_EPOCH}, got "
                              f"{epoch!r}", field="routing.epoch")
        self.shards = shards
        self.epoch = epoch
        """This routing's epoch in its cluster (module doc): larger is newer."""
        owner_of: dict[bytes, int] = {}
        for shard, prefixes in (pins or {}).items():
            if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < shards:
                raise ConfigError(f"pinned shard index {shard!r} is not in 0..{shards - 1}",
                                  field=f"pins.{shard}")
            if isinstance(prefixes, (str, bytes)):
                raise ConfigError(f"pins of shard {shard} must be a list of prefixes, got "
                                  f"{prefixes!r}", field=f"pins.{shard}")
            for prefix in prefixes:
                if not isinstance(prefix, str) or not prefix:
                    raise ConfigError(f"a pinned prefix must be non-empty text, got {prefix!r}",
                                      field=f"pins.{shard}")
                raw = prefix.encode("utf-8")
                other = owner_of.setdefault(raw, shard)
                if other != shard:
                    raise ConfigError(f"prefix {prefix!r} is pinned to shards {other} and "
                                      f"{shard}", field=f"pins.{shard}")
        self._pins = owner_of
        self._pin_lengths = sorted({len(p) for p in owner_of}, reverse=True)

    @property
    def pins(self) -> dict[str, int]:
        """Pinned prefix -> shard index."""
        return {p.decode("utf-8"): s for p, s in sorted(self._pins.items())}

    def _pinned(self, key: bytes) -> int | None:
        for length in self._pin_lengths:
            if len(key) >= length:
                shard = self._pins.get(key[:length])
                if shard is not None:
                    return shard
        return None

    def owner(self, key: str | bytes) -> int:
        """The index of the one shard that owns ``key``."""
        raw = _as_bytes(key)
        if self._pin_lengths:
            shard = self._pinned(raw)
            if shard is not None:
                return shard
        return _hashed_owner(_segment_bytes(raw), self.shards)

    def owners_of_subtree(self, subtree: str | bytes) -> list[int]:
        """Sorted indexes of every shard that can own a key starting with ``subtree``."""
        sub = _as_bytes(subtree)
        owners = {s for p, s in self._pins.items() if p.startswith(sub)}
        above = self._pinned(sub)
        if above is not None:
            owners.add(above)  # every key under sub starts with that pin
            return sorted(owners)
        if sub[:1] == b"/":
            end = sub.find(b"/", 1)
            segment = None if end < 0 else sub[1:end]
        else:
            end = sub.find(b"/")
            segment = None if end < 0 else sub[:end]
        if segment is None:
            return list(range(self.shards))
        owners.add(_hashed_owner(segment, self.shards))
        return sorted(owners)

    def describe(self) -> dict:
        """The routing function and its parameters as plain data (for the cluster map)."""
        return {
            "version": ROUTING_VERSION,
            "function": "pinned-prefix-then-jump-consistent-hash",
            "segment": "first path segment",
            "hash": "blake2b-64-big-endian",
            "shards": self.shards,
            "pins": [[prefix, shard] for prefix, shard in self.pins.items()],
            "epoch": self.epoch,
        }

    def digest(self) -> str:
        """8 hex digits naming this routing (version, shard count, pins, sorted): equal
        maps, equal digests. Servers announce it with their shard index in HUGZ
        (``route=I/N/DIGEST``) so a client planned from another config is told at once."""
        pins = sorted(self.pins.items())
        text = f"{ROUTING_VERSION}|{self.shards}|" + "|".join(f"{p}={s}" for p, s in pins)
        return hashlib.blake2b(text.encode("utf-8"), digest_size=4).hexdigest()

    def route_of(self, index: int) -> str:
        """``I/N/DIGEST``: what shard ``index``'s servers say in their HUGZ."""
        return f"{index}/{self.shards}/{self.digest()}"

    def with_epoch(self, epoch: int) -> "ShardMap":
        """The same routing under another epoch."""
        return ShardMap(self.shards, self.pins_by_shard(), epoch=epoch)

    def pins_by_shard(self) -> dict[int, list[str]]:
        """Shard index -> its pinned prefixes (sorted); shards without pins left out."""
        pins: dict[int, list[str]] = {}
        for prefix, shard in self.pins.items():
            pins.setdefault(shard, []).append(prefix)
        return pins

    def may_take_from(self, old: "ShardMap", index: int) -> tuple[bytes, ...] | None:
        """Where this routing can place elsewhere a key that ``old`` gives shard
        ``index``, decided from the two routings alone: ``()`` nowhere (no key of that
        shard moves); a tuple of prefixes: only keys under one of them can move; None:
        any key may (each must be asked). A key's owner is its longest matching pin's
        shard, else the jump hash of its segment over the shard count, so:

        * the same count: only keys under a pin that was added, removed or moved;
        * the same pins and fewer shards: only the removed shards' keys (jump
          consistent hashing moves no other key when buckets go from the top);
        * otherwise (more shards, or fewer with other pins): any key.

        It saves the pass over a shard's whole map that a target made inside the hold
        of a shrink or a pin move, and that every staying server made to count a
        change or to take its routing."""
        before, after = old.pins, self.pins
        if old.shards == self.shards:
            return tuple(sorted(p.encode("utf-8") for p in before.keys() | after.keys()
                                if before.get(p) != after.get(p)))
        if before == after and self.shards < old.shards:
            return () if index < self.shards else None
        return None

    def newer_than(self, other: "ShardMap") -> bool:
        """This map is a later routing of the cluster than ``other`` (a larger epoch)."""
        return self.epoch > other.epoch

    @classmethod
    def from_description(cls, description: Mapping) -> "ShardMap":
        """Rebuild a map from ``describe()`` output; refuses an unknown routing version."""
        version = description.get("version")
        if version != ROUTING_VERSION:
            raise ConfigError(f"routing version {version!r} is not supported (this client "
                              f"knows version {ROUTING_VERSION})", field="routing.version")
        pins: dict[int, list[str]] = {}
        try:
            for prefix, shard in description.get("pins", []):
                pins.setdefault(shard, []).append(prefix)
        except (TypeError, ValueError):
            raise ConfigError(f"routing pins must be [prefix, shard] pairs, got "
                              f"{description.get('pins')!r}", field="routing.pins") from None
        epoch = description.get("epoch", FIRST_EPOCH)
        return cls(description.get("shards"), pins, epoch=epoch)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ShardMap) and self.shards == other.shards
                and self.pins == other.pins)

    def __hash__(self) -> int:
        return hash((self.shards, frozenset(self._pins.items())))

    def __repr__(self) -> str:
        return f"ShardMap(shards={self.shards}, pins={self.pins!r}, epoch={self.epoch})"


# ------------------------------------------------------------- server-side owner cache

OWNER_CACHE_MAX = 1 << 18
"""Routing slots remembered by ``OwnerCache`` (cleared when full)."""
_UNKNOWN = object()


class OwnerCache:
    """Whether this shard owns a key, remembered per routing slot (the server's owner
    check: see ``clonemap.shards.server``'s module doc, *Ownership*).

    ``slots`` maps a slot to True (owned), False (not owned) or None (a pinned prefix
    longer than the slot decides per key: ``owns`` asks the map every time). The hot path
    reads ``slots`` directly and calls ``owns`` only when the slot is not known True.
    """

    __slots__ = ("shard_map", "index", "slots", "max_slots", "_deep_pins", "known")

    def __init__(self, shard_map: ShardMap, index: int, max_slots: int = OWNER_CACHE_MAX,
                 known: dict[bytes, int] | None = None):
        self.shard_map = shard_map
        self.index = index
        self.slots: dict[bytes, bool | None] = {}
        self.max_slots = max_slots
        self._deep_pins = [p.encode("utf-8") for p in shard_map.pins]
        self.known = known or {}
        """The owner of whole slots (no pin under them) someone already asked of this
        same routing: a slot found there is not hashed again (a move's export, after
        the plan's count walked the same keys: ``LeavingTally.slot_owners``)."""

    @staticmethod
    def slot(key: bytes) -> bytes:
        end = key.find(b"/", 1)  # a key not starting with "/" has no "/" at 0 either
        return key if end < 0 else key[:end + 1]

    def owns(self, key: bytes) -> bool:
        slot = self.slot(key)
        known = self.slots.get(slot, _UNKNOWN)
        if known is None:
            return self.shard_map.owner(key) == self.index
        if known is not _UNKNOWN:
            return known
        if slot[-1:] != b"/":  # the slot is the whole key: no other key shares it
            owned = self.shard_map.owner(key) == self.index
        elif any(p.startswith(slot) and len(p) > len(slot) for p in self._deep_pins):
            owned = None  # "/users/vip/" pinned elsewhere than "/users/x"
        else:  # every key under the slot matches the same pins as the slot itself
            told = self.known.get(slot)
            owned = (self.shard_map.owner(slot) if told is None else told) == self.index
        if len(self.slots) >= self.max_slots:
            self.slots.clear()
        self.slots[slot] = owned
        return self.shard_map.owner(key) == self.index if owned is None else owned

    def owned(self, keys) -> list[bytes]:
        """The keys of ``keys`` this shard owns: ``owns`` of each, with the slot's
        lookup inlined (a client's adoption looks at every key it holds: at 1M keys
        that lookup was most of its work, 0.6 s of its loop)."""
        slots, owns, unknown = self.slots, self.owns, _UNKNOWN
        out = []
        for key in keys:
            end = key.find(b"/", 1)
            known = slots.get(key if end < 0 else key[:end + 1], unknown)
            if known is True or (known is not False and owns(key)):
                out.append(key)
        return out
