"""The routing helper: which node holds the longest cached prefix of a prompt, on which tier.

A :class:`Router` subscribes to the KV event streams of several daemons (vLLM's format, see
:mod:`kvstore.wire.kvevents`), keeps one :class:`~kvstore.route.index.PrefixIndex` for all of them
and answers :meth:`Router.route` from memory::

    r = Router()
    r.add_node("a", "http://10.0.0.1:7070")        # asks the daemon where its events are
    r.add_node("b", "http://10.0.0.2:7070", token=...)
    r.start()                                       # a thread follows the streams
    best = r.route(ns, token_ids)                   # Route(node="b", blocks=812, tiers={"dram": 800, "nvme": 12}, ...)

Longest prefix: a store is prefix-closed (a block is cached only under its cached parent), so a
node's cached prefix is its run of leading blocks present in the index; the router takes the
longest, breaks ties by the faster tiers, then by the consistent hash. A prompt no node holds
(a cold prefix), or whose longest cached prefix is under ``min_match`` of its blocks (say only
the system prompt every conversation shares), goes to the node the consistent hash picks
(rendezvous, on the hash of the first block no node holds): conversations spread over the
nodes, and the next turn of each finds its prefix where the first one left it. A node whose stream has been silent
past ``down_after_s`` (the publisher sends an empty batch every second) is left out of both.

Tenants: a router routes one tenant's requests on that tenant's stream (``tenant=`` and its
token); with an admin token it may follow every tenant's stream and route any tenant
(``route(..., tenant=name)``): the hashes there carry the tenant's mask (kvstore.server.kvevents).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash
import zmq

from kvstore.client.control import ControlClient
from kvstore.keys import Namespace, hash_blocks
from kvstore.route.feed import Feed
from kvstore.route.index import BITS, MAX_NODES, PrefixIndex, hash_keys
from kvstore.wire.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, tenant_mask

MEDIA_RANK = {"hbm": 0, "gpu": 0, "dram": 1, "cpu": 1, "nvme": 2, "disk": 2, "object": 3, "s3": 3}
"""Speed order of the tier names kvstore and vLLM use (lower is faster); others rank last."""
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Route:
    node: str
    blocks: int
    """Leading blocks of the prompt that ``node`` holds (0: a cold prefix)."""
    tiers: dict[str, int]
    """Those blocks by the fastest tier holding each on ``node``."""
    reason: str
    """``prefix``: the longest cached prefix; ``hash``: none cached, the consistent hash."""
    matched: dict[str, int] = field(default_factory=dict)
    """The cached prefix of every node that is up."""


@dataclass(slots=True)
class _Node:
    name: str
    slot: int
    feed: Feed | None
    spec: dict[str, Any]
    heard: float = 0.0


class Router:
    """Thread-safe: :meth:`route` from any thread while one thread follows the streams."""

    def __init__(self, *, tenant: str = "", min_match: float = 0.25, down_after_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, capacity: int = 1 << 16) -> None:
        """``tenant``: the tenant whose requests this router routes by default ("" anonymous).
        ``min_match``: a cached prefix shorter than this share of the prompt's blocks does not
        decide (see :meth:`route_hashes`)."""
        if not 0.0 <= min_match <= 1.0:
            raise ValueError(f"min_match={min_match} must be a share of the prompt in [0, 1]")
        self.tenant = tenant
        self.min_match = min_match
        self.down_after_s = down_after_s
        self._clock = clock
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._lock = threading.Lock()
        self._index = PrefixIndex(capacity)
        self._nodes: list[_Node] = []
        self._media: dict[str, int] = {}  # medium -> bit
        self._fastest = np.zeros(16, dtype=np.int64)  # 4-bit tier mask -> fastest bit
        self._rank_of_bit = [9, 9, 9, 9]
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pending: list[_Node] = []  # added, feed not made yet (made by the polling thread)

    # ---- nodes --------------------------------------------------------------------------------

    def add_node(self, name: str, url: str | None = None, *, publish: str | None = None,
                 replay: str | None = None, token: str | None = None, tenant: str | None = None,
                 all_tenants: bool = False) -> None:
        """Follow a daemon: at ``url`` (its control plane says where its events are), or at the
        ``publish`` / ``replay`` endpoints directly. ``tenant`` / ``token``: whose stream
        (default: the router's tenant); ``all_tenants``: every tenant's (an admin's token)."""
        with self._lock:
            if any(n.name == name for n in self._nodes):
                raise ValueError(f"node {name!r} is already followed")
            if len(self._nodes) >= MAX_NODES:
                raise ValueError(f"a router follows at most {MAX_NODES} nodes")
        tenant = self.tenant if tenant is None else tenant
        auth: tuple[str | None, str | None] = (None, None)
        if publish is None:
            if url is None:
                raise ValueError("add_node needs the daemon's url or its publish endpoint")
            with ControlClient(url, token=token, timeout=5.0) as daemon:
                ep = daemon.events(all_tenants)
            publish, replay = ep["publish"], ep["replay"]
            if ep.get("auth") == "plain":
                auth = (ep["username"], token)
            mask = 0 if (ep.get("tenant") is None) else tenant_mask(ep["tenant"])
        else:
            mask = 0 if all_tenants else tenant_mask(tenant)
            if token is not None:
                auth = (tenant, token)
        if replay is None:
            host, _, port = publish.rpartition(":")
            replay = f"{host}:{int(port) + 1}"
        spec = {"publish": publish, "replay": replay, "mask": mask, "username": auth[0], "password": auth[1]}
        with self._lock:
            node = _Node(name, len(self._nodes), None, spec, self._clock())
            self._nodes.append(node)
            self._pending.append(node)
        if self._thread is None:
            self._make_feeds()

    def add_events_node(self, name: str) -> Callable[[list[Any]], None]:
        """A node whose events the caller delivers (another transport, a benchmark): returns
        the function to call with each batch's events (:mod:`kvstore.wire.kvevents` structs)."""
        with self._lock:
            if any(n.name == name for n in self._nodes):
                raise ValueError(f"node {name!r} is already followed")
            if len(self._nodes) >= MAX_NODES:
                raise ValueError(f"a router follows at most {MAX_NODES} nodes")
            node = _Node(name, len(self._nodes), None, {}, self._clock())
            self._nodes.append(node)
        return self._sink(node, 0)

    def _make_feeds(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for node in pending:
            s = node.spec
            node.feed = Feed(node.name, s["publish"], s["replay"], self._sink(node, s["mask"]),
                             self._reset(node), self._ctx, s["username"], s["password"])
            node.feed.start()
            node.heard = self._clock()

    def nodes(self) -> list[str]:
        return [n.name for n in self._nodes]

    # ---- following the streams -------------------------------------------------------------------

    def _bit(self, medium: str | None) -> int:
        name = (medium or "").lower()
        bit = self._media.get(name)
        if bit is None:
            bit = len(self._media) if len(self._media) < BITS else BITS - 1
            self._media[name] = bit
            self._rank_of_bit[bit] = min(self._rank_of_bit[bit], MEDIA_RANK.get(name, 8))
            for m in range(1, 16):  # fastest tier bit of each 4-bit mask
                bits = [b for b in range(BITS) if m & (1 << b)]
                self._fastest[m] = min(bits, key=lambda b: (self._rank_of_bit[b], b))
        return bit

    def _sink(self, node: _Node, mask: int) -> Callable[[list[Any]], None]:
        def apply(events: list[Any]) -> None:
            node.heard = self._clock()
            with self._lock:
                for ev in events:
                    if isinstance(ev, BlockStored | BlockRemoved):
                        keys = _keys(ev.block_hashes, mask)
                        self._index.update(keys, node.slot, 1 << self._bit(ev.medium), isinstance(ev, BlockStored))
                    elif isinstance(ev, AllBlocksCleared):
                        self._index.clear_node(node.slot)
        return apply

    def _reset(self, node: _Node) -> Callable[[], None]:
        def reset() -> None:
            with self._lock:
                self._index.clear_node(node.slot)
        return reset

    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply what the streams sent (waiting up to ``timeout_s`` for the first message);
        returns the messages handled. The thread of :meth:`start` calls it in a loop."""
        self._make_feeds()
        feeds = [n.feed for n in self._nodes if n.feed is not None]
        poller = zmq.Poller()
        for f in feeds:
            poller.register(f.sub, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout_s * 1000)))
        n = 0
        for f in feeds:
            if f.sub in ready:
                n += f.handle()
        return n

    def refresh(self) -> None:
        """Catch up with every stream now: a replay from each feed's next sequence number, which
        the publisher answers after publishing every hook that ran before the request. A
        barrier: what the nodes' stores did before this call is in the index after it."""
        self._make_feeds()
        self.poll(0)
        for node in self._nodes:
            if node.feed is not None and node.feed.catch_up(node.feed.last_seq + 1):
                node.heard = self._clock()

    def start(self) -> Router:
        """Follow the streams on a background thread (until :meth:`close`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstore-router", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll(0.1)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for n in self._nodes:
            if n.feed is not None:
                n.feed.close()
        self._ctx.destroy(linger=0)

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- answering ------------------------------------------------------------------------------

    def route(self, ns: Namespace, tokens: Any, *, tenant: str | None = None) -> Route:
        """The node for a prompt of ``tokens`` under the client namespace ``ns``."""
        return self.route_hashes(hash_blocks(ns, tokens), tenant=tenant)

    def route_hashes(self, hashes: Sequence[bytes], *, tenant: str | None = None, exact: bool = False) -> Route:
        """The node for a prompt whose full blocks hash to ``hashes`` (``hash_blocks``).

        A store is prefix-closed, so whether a node holds block ``i`` is true up to its cached
        prefix and false after: the router finds each node's prefix by a 32-way search (three
        or four batched probes of at most 32 keys per node for 8K blocks, not 8K lookups), and
        the blocks per tier the same way, since faster tiers hold a prefix of the chain (a hit
        promotes its whole prefix, eviction takes leaves first). Where events were lost the
        answer is *a* prefix end, not always the first one; ``exact=True`` looks up every block.
        """
        tenant = self.tenant if tenant is None else tenant
        mask = tenant_mask(tenant)
        now = self._clock()
        with self._lock:
            up = [n for n in self._nodes if now - n.heard <= self.down_after_s]
        if not up:
            raise LookupError("no node is up: the router hears no stream (check the daemons' [events] publish)")
        n = len(hashes)
        if exact:
            with self._lock:
                vals = self._index.get(_keys(list(hashes), mask)) if n else np.zeros(0, dtype=np.uint64)
            slots = np.array([u.slot for u in up], dtype=np.uint64)
            nib = (vals[:, None] >> (slots * np.uint64(BITS))) & np.uint64(0xF)  # (blocks, nodes)
            held = nib != 0
            lengths = [int(x) for x in (np.where(held.all(axis=0), n, held.argmin(axis=0)) if n else np.zeros(len(up)))]

            def tiers(j: int, length: int) -> dict[str, int]:
                counts = np.bincount(self._fastest[nib[:length, j].astype(np.int64)], minlength=BITS)
                return self._named({b: int(c) for b, c in enumerate(counts) if c})
        else:
            lengths = self._first_false(hashes, mask, [_holds(u.slot) for u in up], [n] * len(up))

            def tiers(j: int, length: int) -> dict[str, int]:
                return self._tiers_by_search(hashes, mask, up[j].slot, length)

        best = max(lengths) if lengths else 0
        matched = {u.name: length for u, length in zip(up, lengths, strict=True)}
        if best == 0 or best < self.min_match * n:
            # Cold, or only a short shared prefix (a system prompt every node has): the hash of
            # the first block no node holds picks, which spreads conversations over the nodes
            # while the turns of one conversation (one chain) still meet on one node.
            key = hashes[best] if best < n else (hashes[-1] if hashes else b"")
            j = max(range(len(up)), key=lambda i: _rendezvous(up[i].name, key))
            got = lengths[j]
            return Route(up[j].name, got, tiers(j, got) if got else {}, "hash", matched)
        cands = [i for i, length in enumerate(lengths) if length == best]
        by = {j: tiers(j, best) for j in cands}
        rank = {m: self._rank_of_bit[b] for m, b in self._media.items()}
        first = hashes[0]
        pick = min(cands, key=lambda j: (sum(rank.get(m, 9) * c for m, c in by[j].items()),
                                         -_rendezvous(up[j].name, first)))
        return Route(up[pick].name, best, by[pick], "prefix", matched)

    def _named(self, counts: dict[int, int]) -> dict[str, int]:
        names = {b: m for m, b in self._media.items()}
        return {names.get(b, f"tier{b}"): c for b, c in counts.items()}

    def _first_false(self, hashes: Sequence[bytes], mask: int, tests: list[Callable[[int], bool]],
                     ends: list[int]) -> list[int]:
        """For each monotone ``test`` (true, then false along the chain, over ``[0, end)``):
        the first position where it is false (``end`` if none). The opening probe tests both ends
        (a whole hit or a whole miss ends there), then 32-way rounds; all tests share one batch
        of keys per round. Small batches: plain Python beats numpy's per-call cost here."""
        lo = [0] * len(tests)
        hi = list(ends)
        first = True
        while True:
            live = [t for t in range(len(tests)) if lo[t] < hi[t]]
            if not live:
                return lo
            want: set[int] = set()
            for t in live:
                a, b = lo[t], hi[t]
                if first:
                    want.update((a, b - 1))
                else:
                    k = min(32, b - a)
                    want.update(a + (i * (b - a)) // k for i in range(k))
            first = False
            pos = sorted(want)
            with self._lock:
                vals = self._index.get(_keys([hashes[p] for p in pos], mask)).tolist()
            for t in live:
                test, a, b = tests[t], lo[t], hi[t]
                for p, v in zip(pos, vals, strict=True):
                    if a <= p < b:
                        if test(v):
                            a = max(a, p + 1)
                        else:
                            b = min(b, p)
                lo[t], hi[t] = a, max(a, b)

    def _tiers_by_search(self, hashes: Sequence[bytes], mask: int, slot: int, length: int) -> dict[str, int]:
        """Blocks of the prefix ``[0, length)`` by the fastest tier holding each on ``slot``."""
        order = sorted(set(self._media.values()), key=lambda b: (self._rank_of_bit[b], b))
        place = {b: k for k, b in enumerate(order)}
        shift = BITS * slot
        # 4-bit tier mask -> the place of its fastest tier in speed order (99: not held)
        places = [99] + [place.get(int(self._fastest[m]), 99) for m in range(1, 16)]

        def upto(k: int) -> Callable[[int], bool]:
            return lambda v: places[(v >> shift) & 0xF] <= k

        ends = self._first_false(hashes, mask, [upto(k) for k in range(len(order))], [length] * len(order))
        counts, prev = {}, 0
        for b, e in zip(order, ends, strict=True):
            if e > prev:
                counts[b] = e - prev
            prev = max(prev, e)
        return self._named(counts)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = {"blocks": len(self._index), "index_bytes": self._index.nbytes, "media": dict(self._media)}
        out["nodes"] = {n.name: ({"last_seq": n.feed.last_seq, "synced": n.feed.synced,
                                  **{k: getattr(n.feed.stats, k) for k in n.feed.stats.__slots__}}
                                 if n.feed is not None else {}) for n in self._nodes}
        return out


def _holds(slot: int) -> Callable[[int], bool]:
    shift = BITS * slot
    return lambda v: (v >> shift) & 0xF != 0


def _keys(hashes: list[Any], mask: int) -> np.ndarray:
    if hashes and isinstance(hashes[0], int):  # vLLM's 64-bit integer hashes
        return np.array([h & _U64 for h in hashes], dtype=np.uint64) ^ np.uint64(mask)
    return hash_keys(hashes, mask)


def _rendezvous(node: str, key: bytes) -> int:
    return xxhash.xxh64_intdigest(node.encode() + b"\0" + bytes(key))
