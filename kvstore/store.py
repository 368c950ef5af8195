"""KVStore: the in-process store that composes the radix index, the tiers and a policy.

Who decides and who moves bytes: the store decides (placement, promotion, demotion, expiry,
eviction) under one lock and keeps the index and the per-tier policies in step; tiers only move
bytes (tiers/base.py). Block payloads are read outside the lock: a block being read is marked
*in use* and nothing moves or drops it until the read is over.

Tiers are ordered fastest first. A put lands in the first tier that admits it (placement); a hit
served from a slower tier is copied up into the first tier (promotion, from the caller's buffer
that was just filled, so it costs no extra read); a tier under pressure writes its victims back
to the next tier (demotion); only the last copy in the last tier is ever dropped, and only from a
block without cached children, so the store stays prefix-closed.

Expiry comes first: before evicting anything the store removes expired leaves (with a work cap).
A hit refreshes a block's expiry in memory; persistent tiers learn the new expiry in batches on
:meth:`KVStore.flush` / :meth:`KVStore.maintain`, never on the read path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.block import BlockMeta, payload_checksum
from kvstore.clock import Clock, system_clock
from kvstore.config import StoreConfig
from kvstore.errors import (
    BlockNotFound,
    BufferSizeError,
    CorruptBlockError,
    KVStoreError,
    LayoutMismatchError,
    MissingPrefixError,
    RetentionError,
    TierFullError,
    TierIOError,
    TierUnavailableError,
    UnknownNamespaceError,
    UsageError,
)
from kvstore.events import StoreEvents
from kvstore.index import NO_PARENT, RadixIndex
from kvstore.keys import BlockHash, Namespace
from kvstore.registry import make_policies, make_tier
from kvstore.retention import PINS_FILE, PinBook, PinRecord
from tiers.base import byte_view

log = logging.getLogger(__name__)

NAMESPACES_FILE = "namespaces.json"


def read_namespaces(root: Path) -> list[tuple[Namespace, float]]:
    """The registered namespaces and their TTLs saved under a store's ``root`` (none if absent)."""
    path = root / NAMESPACES_FILE
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise KVStoreError(f"cannot read {path}: {e}; restore it or remove it to re-register") from e
    return [(Namespace.from_dict(e["namespace"]), float(e["ttl_s"])) for e in entries]


@dataclass(slots=True)
class _NsInfo:
    nid: int
    digest: bytes
    namespace: Namespace | None  # None: seen on a persistent tier, not registered yet
    ttl_s: float


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How many leading blocks of a prompt are cached, and in which tier each one is."""

    num_blocks: int
    block_tokens: int
    tiers: tuple[str, ...]
    """Fastest tier holding each cached block."""
    unavailable: tuple[str, ...] = ()
    """Tiers that cannot be reached now (a remote store is down): blocks held only there are
    not counted, so the engine recomputes them instead of waiting on a timeout."""

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_tokens


@dataclass(slots=True, eq=False)
class Lease:
    """Leading cached blocks held in the shared-memory arena of the first tier for a reader
    that maps it (``tiers.dram.attach_arena(arena)``); see :meth:`KVStore.acquire`.

    Block ``i`` is at ``locations[i] = (offset, size)`` of the arena. While the lease is held the
    blocks are *in use*: they neither move nor leave, so their bytes stay put. Give it back with
    :meth:`KVStore.release` (a second release is a no-op).
    """

    arena: str
    locations: tuple[tuple[int, int], ...]
    _ids: np.ndarray = field(repr=False)
    _released: bool = field(default=False, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.locations)


@dataclass(slots=True)
class StoreCounters:
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    put_blocks: int = 0
    dedup_blocks: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    expirations: int = 0
    corrupt_blocks: int = 0
    tier_errors: int = 0
    orphans_dropped: int = 0
    recovered_blocks: int = 0
    discovered_blocks: int = 0
    """Blocks other nodes wrote to a shared tier, learned by probing past a lookup miss."""
    foreign_blocks: int = 0
    """Blocks of another schema version or layout found on a persistent tier: never served."""
    unavailable_reads: int = 0
    """Reads skipped or failed because a tier was unreachable (the copy is kept)."""
    per_tier_hits: Counter[str] = field(default_factory=Counter)


def _lowest_bit(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


class _Scratch:
    """A page-aligned, reusable buffer for tier-to-tier copies (O_DIRECT wants alignment)."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None

    def view(self, size: int) -> memoryview:
        if self._map is None or len(self._map) < size:
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(-1, max(size, 1 << 20))
        return memoryview(self._map)[:size]

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


class KVStore:
    """A tiered, prefix-closed KV-cache store; thread-safe.

    Typical use::

        store = KVStore(load_config())
        store.register_namespace(ns)
        hashes = hash_blocks(ns, tokens)
        n = store.get_into(ns, hashes, buffers)      # loads the leading n cached blocks
        store.put(ns, hashes, kv_blocks[n:], start=n)  # stores what was computed
    """

    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        clock: Clock = system_clock,
        tiers: Sequence[Any] | None = None,
    ) -> None:
        self.config = config or StoreConfig()
        self._clock = clock
        self._lock = threading.RLock()
        self._closed = False
        root = self.config.root
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TierIOError(
                f"cannot create the store directory {root}: {e.strerror}; "
                "choose a writable [store] root (or set KVSTORE_ROOT)"
            ) from e
        if tiers is None:
            tiers = [make_tier(s.kind, s.name, dict(s.options), root, clock) for s in self.config.tiers]
        self.tiers = list(tiers)
        self._tier_index = {t.name: k for k, t in enumerate(self.tiers)}
        self.index = RadixIndex()
        self._policies = make_policies(
            self.config.policy, dict(self.config.policy_options), self.index, self.tiers
        )
        self._persistent = [k for k, t in enumerate(self.tiers) if t.persistent]
        self._shared = [k for k, t in enumerate(self.tiers) if getattr(t, "shared", False)]
        self.counters = StoreCounters()
        self._ns_by_digest: dict[bytes, _NsInfo] = {}
        self._ns_list: list[_NsInfo] = []
        self._dirty_expiry: set[int] = set()
        # One scratch buffer per tier level: a demotion from tier k may cascade into one from
        # k+1 while tier k's buffer still holds the block in flight. The last is for durability.
        self._scratch = [_Scratch() for _ in range(len(self.tiers) + 1)]
        self.events = StoreEvents.open(self.config.events, root, clock, [t.name for t in self.tiers], self.config.policy)
        self._load_namespaces()
        self._pins = PinBook(root / PINS_FILE, _atomic_write)
        self._recover()

    # ---- namespaces ---------------------------------------------------------------------------

    def register_namespace(self, ns: Namespace, ttl_s: float | None = None) -> None:
        """Make ``ns`` usable; ``ttl_s`` (default: the store's) applies to its blocks.

        Re-registering with ``ttl_s`` updates the TTL; without, it keeps the one the namespace
        has (so an operator's ``kvctl ttl`` survives engines reconnecting). Blocks of ``ns``
        already on persistent tiers (from an earlier run) become visible at once.
        """
        if ttl_s is not None and not ttl_s > 0:
            raise UsageError(f"ttl_s must be positive (seconds), got {ttl_s!r}")
        with self._lock:
            info = self._ns_by_digest.get(ns.root)
            if ttl_s is None:
                known = info is not None and info.namespace is not None
                ttl_s = info.ttl_s if known else self.config.default_ttl_s  # type: ignore[union-attr]
            if info is None:
                info = self._new_ns(ns.root, ns, ttl_s)
            else:
                info.namespace, info.ttl_s = ns, float(ttl_s)
            for t in self.tiers:
                t.register_namespace(ns.root, ns.canonical_bytes())
            self._save_namespaces()
            self.events.namespace(ns, float(ttl_s))

    def namespaces(self) -> list[tuple[Namespace, float]]:
        with self._lock:
            return [(i.namespace, i.ttl_s) for i in self._ns_list if i.namespace is not None]

    def _new_ns(self, digest: bytes, ns: Namespace | None, ttl_s: float) -> _NsInfo:
        info = _NsInfo(len(self._ns_list), digest, ns, float(ttl_s))
        self._ns_list.append(info)
        self._ns_by_digest[digest] = info
        return info

    def _ns(self, ns: Namespace) -> _NsInfo:
        info = self._ns_by_digest.get(ns.root)
        if info is not None and info.namespace is not None:
            return info
        for other in self._ns_list:
            if other.namespace is not None and other.namespace.model_key() == ns.model_key():
                diffs = [
                    f"{k}: registered {a!r}, asked {b!r}"
                    for k, a, b in _diff(other.namespace.to_dict(), ns.to_dict())
                ]
                raise LayoutMismatchError(
                    f"namespace for model {ns.model_id!r} differs from the registered one "
                    f"({'; '.join(diffs)}); its blocks are not interchangeable. Register this "
                    "namespace explicitly if both layouts are meant to be cached."
                )
        raise UnknownNamespaceError(
            f"namespace {ns.root.hex()} (model {ns.model_id!r}) is not registered; "
            "call store.register_namespace(ns) first"
        )

    def _load_namespaces(self) -> None:
        for ns, ttl_s in read_namespaces(self.config.root):
            self._new_ns(ns.root, ns, ttl_s)

    def _save_namespaces(self) -> None:
        path = self.config.root / NAMESPACES_FILE
        entries = [
            {"namespace": i.namespace.to_dict(), "ttl_s": i.ttl_s}
            for i in self._ns_list
            if i.namespace is not None
        ]
        _atomic_write(path, json.dumps(entries, indent=1).encode())

    # ---- lookups and loads --------------------------------------------------------------------

    def lookup_nowait(self, ns: Namespace, hashes: Sequence[bytes]) -> LookupResult | None:
        """:meth:`lookup` if it can answer from memory at once, else None (the store lock is
        held by a put or a move, or a shared tier may need probing). For an event loop: a None
        means "run :meth:`lookup` on a worker thread"."""
        if self._shared or not self._lock.acquire(blocking=False):
            return None
        try:
            return self.lookup(ns, hashes)
        finally:
            self._lock.release()

    def lookup(self, ns: Namespace, hashes: Sequence[bytes]) -> LookupResult:
        """How many leading blocks of ``hashes`` are cached and where, counting only tiers that
        can be reached now. Changes nothing, except that blocks other nodes wrote to a shared
        tier may be learned (:meth:`_discover`)."""
        info = self._ns(ns)
        self._discover(info, hashes)
        avail = self._available_mask()
        with self._lock:
            m = self.index.match(hashes, self._clock())
            self.counters.lookups += 1
            self.counters.lookup_blocks += len(hashes)
            masks = [int(b) & avail for b in m.tiers.tolist()]
        n = masks.index(0) if 0 in masks else len(masks)
        names = tuple(self.tiers[_lowest_bit(b)].name for b in masks[:n])
        down = tuple(t.name for k, t in enumerate(self.tiers) if not avail >> k & 1)
        return LookupResult(n, info.namespace.block_tokens, names, down)  # type: ignore[union-attr]

    def get_into(
        self, ns: Namespace, hashes: Sequence[bytes], dst: Any | Sequence[Any]
    ) -> int:
        """Load the leading cached blocks of ``hashes`` into caller-owned buffers.

        ``dst`` is one writable buffer of ``k * block_bytes`` bytes or a sequence of ``k``
        writable buffers of ``block_bytes`` each; at most ``min(k, len(hashes))`` blocks load.
        Returns how many leading blocks were loaded; block ``i`` is in buffer ``i``. A block that
        fails its checksum on every tier ends the prefix there (a miss, never wrong bytes).
        """
        info = self._ns(ns)
        bb = info.namespace.block_bytes  # type: ignore[union-attr]
        bufs = _dst_views(dst, bb)
        trace = self.events.request(info.namespace, hashes)  # type: ignore[arg-type]
        hashes = hashes[: len(bufs)]
        self._discover(info, hashes)
        ids, masks, now = self._hold_prefix(hashes)
        trace.matched()
        if not ids.size:
            trace.done(())
            return 0
        served: list[int] = []
        corrupt: list[tuple[int, int, bool]] = []
        try:
            self._read_runs(hashes, masks, bufs, corrupt, served)
        finally:
            with self._lock:
                try:
                    self._after_load(ids, hashes, served, corrupt, bufs, info, now)
                finally:
                    self.index.add_in_use(ids, -1)
                    self._drop_hollow_leaves([int(ids[i]) for i, _, _ in corrupt])
        trace.done(served)
        return len(served)

    def _hold_prefix(self, hashes: Sequence[bytes]) -> tuple[np.ndarray, list[int], float]:
        """Match ``hashes``, count the lookup and mark the matched blocks in use (the caller
        takes them out of use). Returns their ids, tier masks and the time of the match."""
        with self._lock:
            now = self._clock()
            m = self.index.match(hashes, now)
            self.counters.lookups += 1
            self.counters.lookup_blocks += len(hashes)
            if m.ids.size:
                self.index.add_in_use(m.ids, 1)
            return m.ids, m.tiers.tolist(), now

    def _read_block(
        self, key: BlockHash, mask: int, buf: memoryview, bad: list[tuple[int, int, bool]], i: int
    ) -> int | None:
        """Read from the fastest reachable tier that has a good copy; returns that tier or None."""
        mask &= self._available_mask()
        while mask:
            k = _lowest_bit(mask)
            mask &= mask - 1
            try:
                self.tiers[k].read_into(key, buf)
                return k
            except (CorruptBlockError, BlockNotFound, TierIOError) as e:
                self._note_failure(key, k, e, bad, i)
        return None

    def _read_runs(
        self,
        hashes: Sequence[bytes],
        masks: list[int],
        bufs: list[memoryview],
        bad: list[tuple[int, int, bool]],
        served: list[int],
    ) -> None:
        """Read the leading blocks, each from its fastest reachable tier, appending the tier that
        served each to ``served`` up to the first block with no good copy.

        Consecutive blocks whose fastest reachable copy is on the same tier are read with one
        ``read_many`` (one concurrent batch of GETs on an object store, instead of a blocking
        request per block); a block that fails there falls back to its other copies alone.
        """
        avail = self._available_mask()
        i, n = 0, len(masks)
        while i < n:
            first = masks[i] & avail
            if not first:
                if masks[i]:
                    self._note_failure(BlockHash(hashes[i]), -1, None, bad, i)
                return
            k = _lowest_bit(first)
            j = i + 1
            while j < n and (m := masks[j] & avail) and _lowest_bit(m) == k:
                j += 1
            keys = [BlockHash(h) for h in hashes[i:j]]
            for b, r in enumerate(self.tiers[k].read_many(keys, bufs[i:j]), start=i):
                if isinstance(r, int):
                    served.append(k)
                    continue
                if isinstance(r, UsageError):
                    raise r
                self._note_failure(keys[b - i], k, r, bad, b)
                t = self._read_block(keys[b - i], masks[b] & avail & ~(1 << k), bufs[b], bad, b)
                if t is None:
                    return
                served.append(t)
            i = j

    def _note_failure(
        self, key: BlockHash, k: int, e: KVStoreError | None, bad: list[tuple[int, int, bool]], i: int
    ) -> None:
        """A failed read of block ``i`` from tier ``k``: a damaged or missing copy is dropped
        after the load (``bad``); an unreachable tier (``e`` None or TierUnavailableError) keeps
        its copy, the read is only counted."""
        if e is None or isinstance(e, TierUnavailableError):
            with self._lock:
                self.counters.unavailable_reads += 1
            return
        corrupt = isinstance(e, CorruptBlockError)
        what = "corrupt" if corrupt else "unreadable"
        log.warning("block %s %s on tier %s: %s", key.hex(), what, self.tiers[k].name, e)
        bad.append((i, k, corrupt))

    def _available_mask(self) -> int:
        """Tiers that can be asked now (not a remote tier behind an open circuit breaker)."""
        return sum(1 << k for k, t in enumerate(self.tiers) if t.available())

    def _discover(self, info: _NsInfo, hashes: Sequence[bytes]) -> None:
        """Learn blocks that other nodes wrote to a shared tier, past the end of this node's match.

        Such a block is in no local index until this node lists the tier again. A hash names a
        block and its whole prefix, so asking the tier for the next hashes is safe: the tier
        checks that each object is the block it is named after, :meth:`_adopt` that it extends
        the chain. Bounded by the tier (``discover_max_blocks``); the requests run without the
        lock.
        """
        if not self._shared or not hashes:
            return
        with self._lock:
            n = self.index.match(hashes, self._clock()).num_blocks
            if n == len(hashes) or hashes[n] in self.index:
                return  # a full hit, or a block the index knows (expired, or being written)
        keys = [BlockHash(h) for h in hashes[n:]]
        for k in self._shared:
            tier = self.tiers[k]
            if not tier.available():
                continue
            try:
                metas = tier.probe(keys)
            except KVStoreError as e:
                log.warning("probe of tier %s failed: %s", tier.name, e)
                continue
            if metas:
                with self._lock:
                    self._adopt(info, hashes, n, k, metas)
                return

    def _adopt(
        self, info: _NsInfo, hashes: Sequence[bytes], n: int, k: int, metas: list[BlockMeta]
    ) -> None:
        """Insert probed blocks ``n, n+1, ...`` of ``hashes`` (on tier ``k``) while each one
        continues the chain: same namespace, parent, depth and block size, not expired."""
        idx, now = self.index, self._clock()
        pid: int | None = NO_PARENT
        if n:
            pid = idx.id_of(hashes[n - 1])
            if pid is None or int(idx.depth[pid]) != n - 1:
                return  # the prefix changed while the tier was asked
        learned: list[tuple[int, BlockMeta]] = []
        for d, meta in enumerate(metas, start=n):
            parent = hashes[d - 1] if d else info.digest
            if (
                meta.ns != info.digest
                or meta.parent != parent
                or meta.depth != d
                or meta.size != info.namespace.block_bytes  # type: ignore[union-attr]
                or meta.expiry <= now
                or hashes[d] in idx
            ):
                break
            bid = int(idx.insert_chain([hashes[d]], pid, d, meta.size, info.nid, 1 << k, meta.created, meta.expiry)[0])
            learned.append((bid, meta))
            pid = bid
        for bid, meta in reversed(learned):  # leaves first in the policy, as on a restart
            self._policies[k].insert(bid, meta.size, meta.created)
        self.counters.discovered_blocks += len(learned)

    def _after_load(
        self,
        ids: np.ndarray,
        hashes: Sequence[bytes],
        served: list[int],
        bad: list[tuple[int, int, bool]],
        bufs: list[memoryview],
        info: _NsInfo,
        now: float,
    ) -> None:
        c = self.counters
        for i, k, corrupt in bad:
            # The copy is dropped either way: a later put or promotion writes a good one.
            if corrupt:
                c.corrupt_blocks += 1
            else:
                c.tier_errors += 1
            self.events.bad_copy(hashes[i], k, corrupt)
            self._drop_copy(int(ids[i]), k, hashes[i])
        n = len(served)
        c.hit_blocks += n
        c.loaded_blocks += n
        if not n:
            return
        hit = ids[:n]
        self.index.touch(hit, now, now + info.ttl_s)
        self._dirty_expiry.update(hit.tolist())
        # Deepest first so that parents end up more recent than their children (leaves go first).
        for i in range(n - 1, -1, -1):
            bid = int(hit[i])
            mask = int(self.index.tiers[bid])
            while mask:
                k = _lowest_bit(mask)
                mask &= mask - 1
                self._policies[k].touch(bid, now)
        for k in served:
            c.per_tier_hits[self.tiers[k].name] += 1
        if self.config.promote_on_hit:
            for i, k in enumerate(served):
                bid = int(hit[i])
                if k > 0 and not self.index.tiers[bid] & 1:
                    meta = self._meta_for(bid, hashes[i], info)
                    if self._place(bid, 0, bufs[i], meta, protect={int(x) for x in hit}):
                        c.promotions += 1

    def acquire(self, ns: Namespace, hashes: Sequence[bytes]) -> Lease:
        """Hold the leading cached blocks of ``hashes`` in the first tier's shared-memory arena.

        For a same-node reader that maps the arena: nothing is copied inside the store for a
        block the arena already holds. A block held only by slower tiers is read and promoted
        into the arena first (a prefix ends at a block that cannot be read or placed). Counts
        as a hit like :meth:`get_into`. The caller must :meth:`release` the lease; until then
        its blocks are in use and stay where they are.
        """
        info = self._ns(ns)
        arena = self.tiers[0]
        shm_name = getattr(arena, "shm_name", None)
        if shm_name is None or not hasattr(arena, "location"):
            raise UsageError(
                f"leases need a shared-memory tier first; tier {arena.name!r} is of kind "
                f"{arena.kind!r}: put a kind = 'dram' tier first in the config"
            )
        bb = info.namespace.block_bytes  # type: ignore[union-attr]
        trace = self.events.request(info.namespace, hashes, "acquire")  # type: ignore[arg-type]
        self._discover(info, hashes)
        ids, masks, now = self._hold_prefix(hashes)
        trace.matched()
        if not ids.size:
            trace.done(())
            return Lease(shm_name, (), ids)
        served: list[int] = []
        corrupt: list[tuple[int, int, bool]] = []
        bufs: list[memoryview] = []
        held = 0
        try:
            # Blocks the arena lacks are read outside the lock; being in use, nothing moves them.
            for i, mask in enumerate(masks):
                if mask & 1:
                    served.append(0)
                    bufs.append(memoryview(b""))
                    continue
                buf = memoryview(np.empty(bb, np.uint8))
                k = self._read_block(BlockHash(hashes[i]), mask, buf, corrupt, i)
                if k is None:
                    break
                served.append(k)
                bufs.append(buf)
            with self._lock:
                self._after_load(ids, hashes, served, corrupt, bufs, info, now)
                locations: list[tuple[int, int]] = []
                protect = {int(x) for x in ids}
                for i in range(len(served)):
                    bid = int(ids[i])
                    if not self.index.tiers[bid] & 1:  # promote_on_hit is off, or it failed
                        meta = self._meta_for(bid, hashes[i], info)
                        if not self._place(bid, 0, bufs[i], meta, protect):
                            break
                        self.counters.promotions += 1
                    loc = arena.location(BlockHash(hashes[i]))
                    if loc is None:
                        break
                    locations.append(loc)
                held = len(locations)
        finally:
            with self._lock:
                self.index.add_in_use(ids[held:], -1)
                self._drop_hollow_leaves([int(ids[i]) for i, _, _ in corrupt])
        trace.done(served[:held])
        return Lease(shm_name, tuple(locations), ids[:held].copy())

    def release(self, lease: Lease) -> None:
        """Give back a :meth:`acquire` lease: its blocks may move and leave again. Idempotent."""
        with self._lock:
            if lease._released:
                return
            lease._released = True
            if lease._ids.size:
                self.index.add_in_use(lease._ids, -1)

    # ---- puts ---------------------------------------------------------------------------------

    def put(
        self,
        ns: Namespace,
        hashes: Sequence[bytes],
        blocks: Any | Sequence[Any],
        *,
        start: int = 0,
        durable: bool = False,
    ) -> int:
        """Store blocks ``start..len(hashes)-1`` of a prefix chain; returns how many were new.

        ``hashes`` is the whole chain from the first block; ``blocks`` holds the payloads of
        ``hashes[start:]`` (one buffer per block, or one contiguous buffer). Blocks before
        ``start`` must be cached already. Blocks already cached are skipped (deduplicated).
        With ``durable=True`` the whole chain is on a persistent tier, synced, when this returns.
        """
        info = self._ns(ns)
        bb = info.namespace.block_bytes  # type: ignore[union-attr]
        n = len(hashes)
        if not 0 <= start <= n:
            raise UsageError(f"start={start} is outside the chain of {n} blocks")
        srcs = _src_views(blocks, bb, n - start)
        early = self._prewrite_durable(info, hashes, srcs, start) if durable else None
        with self._lock:
            now = self._clock()
            expiry = now + info.ttl_s
            present = self.index.match(hashes).num_blocks
            if present < start:
                raise MissingPrefixError(
                    f"block {present} of the chain is not cached, but the put starts at {start}: "
                    f"pass blocks from {present} on (start={present})"
                )
            # The chain is pinned while it is extended: its blocks may move down a tier to make
            # room, but none may leave the store before its child is in.
            idx = self.index
            held: list[int] = idx.match(hashes[:start]).ids.tolist()
            # Blocks the index has never seen form a suffix (a node's parent is always in the
            # index): insert and pin that suffix in one go, as hollow nodes the loop fills.
            fresh = start
            while fresh < n and hashes[fresh] in idx:
                fresh += 1
            if fresh < n:
                pid = int(idx.id_of(hashes[fresh - 1])) if fresh else NO_PARENT  # type: ignore[arg-type]
                ids = idx.insert_chain(hashes[fresh:], pid, fresh, bb, info.nid, 0, now, expiry).tolist()
            else:
                ids = []
            pinned = held + ids
            idx.add_pins(np.array(pinned, dtype=np.int64), 1)
            placed: list[tuple[int, int, int]] = []  # (tier, bid, size): enter the policies at the end
            new = 0
            try:
                for i in range(start, n):
                    key = BlockHash(hashes[i])
                    if i >= fresh:
                        bid = ids[i - fresh]
                    else:
                        bid = idx.id_of(key)  # type: ignore[assignment]
                        idx.add_pins(np.array([bid]), 1)
                        pinned.append(bid)
                        if idx.tiers[bid]:
                            self.counters.dedup_blocks += 1
                            held.append(bid)
                            continue
                    held.append(bid)
                    src = srcs[i - start]
                    parent = hashes[i - 1] if i else info.digest
                    meta = BlockMeta(info.digest, parent, i, bb, expiry, payload_checksum(src), now)
                    ok = self._place_new(bid, src, meta, {bid}, placed)
                    if ok is None:
                        break  # no tier admits it: the chain ends here (it stays prefix-closed)
                    if not ok:
                        raise TierFullError(
                            f"no tier could take block {i} ({bb} bytes): every tier is full "
                            "of pinned or in-use blocks; unpin prefixes or add capacity"
                        )
                    new += 1
                    self.counters.put_blocks += 1
                if durable:
                    if early is not None:
                        raise early  # as a failed durable write below would: the blocks are cached
                    self._make_durable(hashes, held, srcs, start, info)
            finally:
                # Leaves first, as after a restart: a last-tier policy that orders by arrival
                # then meets a chain's leaf before its parents, which cannot leave before it.
                for k, bid, size in reversed(placed):
                    if idx.tiers[bid] & (1 << k):
                        self._policies[k].insert(bid, size, now)
                idx.add_pins(np.array(pinned, dtype=np.int64), -1)
                self._drop_hollow_leaves(pinned)  # and the suffix a refusal left unfilled
            return new

    def _place_new(
        self,
        bid: int,
        src: memoryview,
        meta: BlockMeta,
        protect: set[int],
        placed: list[tuple[int, int, int]] | None = None,
    ) -> bool | None:
        """Placement: the first tier whose policy admits the block and that can make room.
        None when no policy admits it; False when some did but none could make room."""
        admitted = False
        for k, pol in enumerate(self._policies):
            if pol.admit(bid, meta.size, meta.created):
                admitted = True
                if self._place(bid, k, src, meta, protect, placed=placed):
                    return True
        return False if admitted else None

    def _make_durable(
        self, hashes: Sequence[bytes], ids: list[int], srcs: list[memoryview], start: int, info: _NsInfo
    ) -> None:
        if not self._persistent:
            raise UsageError("durable=True needs a persistent tier (nvme or object) in the config")
        p = self._persistent[0]
        persistent_mask = sum(1 << k for k in self._persistent)
        self._adopt_prewritten(hashes, ids, start, p, persistent_mask)
        self._write_durable_batch(hashes, ids, srcs, start, info, p, persistent_mask)
        for i, bid in enumerate(ids):
            mask = int(self.index.tiers[bid])
            key = BlockHash(hashes[i])
            if mask & persistent_mask:
                continue
            meta = self._meta_for(bid, key, info)
            if i >= start:
                src = srcs[i - start]
            else:
                src = self._scratch[-1].view(meta.size)
                self.tiers[_lowest_bit(mask)].read_into(key, src)
            if not self._place(bid, p, src, meta, {bid}, durable=True):
                raise TierFullError(
                    f"tier {self.tiers[p].name!r} has no room for a durable copy of block {i}; "
                    "add capacity or unpin prefixes"
                )
            del src
        self.tiers[p].flush()

    def _prewrite_durable(
        self, info: _NsInfo, hashes: Sequence[bytes], srcs: list[memoryview], start: int
    ) -> KVStoreError | None:
        """Write a durable put's new blocks to the first persistent tier *before* taking the
        store's lock, so that a slow disk or a hung object store holds up this put only: every
        other request (loads and lookups included) waits on that lock. Content addressing makes
        the early copy safe; :meth:`_adopt_prewritten` then records it under the lock. A tier
        without room for them all is left to the locked path, which makes room. Returns the
        error of a failed write: the put caches the blocks, then raises it."""
        if not self._persistent:
            return None
        p = self._persistent[0]
        tier, idx = self.tiers[p], self.index
        mask = sum(1 << k for k in self._persistent)
        with self._lock:
            if idx.match(hashes).num_blocks < start:
                return None  # the put refuses it (MissingPrefixError)
            now = self._clock()
            todo = [i for i in range(start, len(hashes))
                    if (bid := idx.id_of(hashes[i])) is None or not int(idx.tiers[bid]) & mask]
        bb = info.namespace.block_bytes  # type: ignore[union-attr]
        free = tier.usage()
        if not todo or free.capacity_bytes - free.used_bytes < len(todo) * bb:
            return None
        items = [
            (BlockHash(hashes[i]), srcs[i - start],
             BlockMeta(info.digest, hashes[i - 1] if i else info.digest, i, bb, now + info.ttl_s,
                       payload_checksum(srcs[i - start]), now))
            for i in todo
        ]
        failed = [e for e in tier.write_many(items, durable=True) if e is not None and not isinstance(e, TierFullError)]
        if failed:
            with self._lock:
                self.counters.tier_errors += len(failed)
            log.error("durable writes to tier %s failed: %s", tier.name, failed[0])
            return failed[0]
        return None

    def _adopt_prewritten(
        self, hashes: Sequence[bytes], ids: list[int], start: int, p: int, persistent_mask: int
    ) -> None:
        """Record the copies :meth:`_prewrite_durable` made (under the lock; no I/O)."""
        tier, idx = self.tiers[p], self.index
        for i in range(start, len(ids)):
            bid = ids[i]
            if not int(idx.tiers[bid]) & persistent_mask and tier.contains(BlockHash(hashes[i])):
                size = int(idx.size[bid])
                self.events.placed(idx.hash_of(bid), p, int(idx.tiers[bid]), size, int(idx.depth[bid]))
                idx.tiers[bid] |= 1 << p
                self._policies[p].insert(bid, size, self._clock())

    def _write_durable_batch(
        self,
        hashes: Sequence[bytes],
        ids: list[int],
        srcs: list[memoryview],
        start: int,
        info: _NsInfo,
        p: int,
        persistent_mask: int,
    ) -> None:
        """Write the caller's blocks that persistent tier ``p`` has room for with one
        ``write_many`` (one concurrent batch of PUTs on an object store, not a request per
        block in turn). :meth:`_make_durable` then writes the rest one by one, making room."""
        tier, idx = self.tiers[p], self.index
        todo = [(i, bid) for i, bid in enumerate(ids) if i >= start and not int(idx.tiers[bid]) & persistent_mask]
        free = tier.usage()
        if len(todo) < 2 or free.capacity_bytes - free.used_bytes < sum(int(idx.size[b]) for _, b in todo):
            return
        metas = [self._meta_for(bid, BlockHash(hashes[i]), info) for i, bid in todo]
        items = [(BlockHash(hashes[i]), srcs[i - start], m) for (i, _), m in zip(todo, metas, strict=True)]
        failed: list[KVStoreError] = []
        for (_, bid), meta, err in zip(todo, metas, tier.write_many(items, durable=True), strict=True):
            if err is None:
                self.events.placed(idx.hash_of(bid), p, int(idx.tiers[bid]), meta.size, int(idx.depth[bid]))
                idx.tiers[bid] |= 1 << p
                self._policies[p].insert(bid, meta.size, meta.created)
            elif not isinstance(err, TierFullError):  # a full tier: the loop makes room
                failed.append(err)
        if failed:
            self.counters.tier_errors += len(failed)
            log.error("durable writes to tier %s failed: %s", tier.name, failed[0])
            raise failed[0]

    def _place(
        self,
        bid: int,
        k: int,
        src: memoryview,
        meta: BlockMeta,
        protect: set[int],
        *,
        durable: bool = False,
        placed: list[tuple[int, int, int]] | None = None,
    ) -> bool:
        """Write ``bid`` into tier ``k`` (making room first); False if no room could be made.
        With ``placed``, a block written to the last tier (where it cannot leave while its
        chain is being put anyway) enters the policy later, from the caller."""
        tier = self.tiers[k]
        key = self.index.hash_of(bid)
        for _ in range(4):
            if not tier.fits(meta.size) and not self._make_room(k, meta.size, protect | {bid}):
                return False
            try:
                tier.write(key, src, meta, durable=durable)
            except TierFullError:
                continue  # a size class ran out; make more room and retry
            except TierUnavailableError as e:
                if durable:
                    raise
                # Unreachable (a remote store is down): like a full tier, the block goes
                # elsewhere or leaves; not a device error.
                log.info("write of %s to tier %s skipped: %s", key.hex(), tier.name, e)
                return False
            except TierIOError as e:
                self.counters.tier_errors += 1
                log.error("write of %s to tier %s failed: %s", key.hex(), tier.name, e)
                raise
            self.events.placed(key, k, int(self.index.tiers[bid]), meta.size, meta.depth)
            self.index.tiers[bid] |= 1 << k
            if placed is None or k != len(self.tiers) - 1:
                self._policies[k].insert(bid, meta.size, meta.created)
            else:
                placed.append((k, bid, meta.size))
            return True
        return False

    # ---- eviction, demotion, expiry -----------------------------------------------------------

    def _make_room(self, k: int, size: int, protect: set[int]) -> bool:
        """Free room in tier ``k`` for ``size`` bytes: expire first, then evict by policy."""
        tier = self.tiers[k]
        self._expire(self._clock(), self.config.expire_work_cap)
        if tier.fits(size):
            return True
        want = tier.size_class(size)
        stuck: set[int] = set()  # victims that could not move down (the tier below failed)
        for same_class in (True, False):
            for _ in range(8):
                victims = self._choose_victims(k, size, want if same_class else None, protect | stuck)
                if not victims:
                    break
                for bid, drop in victims:
                    if drop:
                        self._drop_block(bid)
                        self.counters.evictions += 1
                    elif not self._demote(bid, k, protect):
                        stuck.add(bid)
                if tier.fits(size):
                    return True
        return tier.fits(size)

    def _choose_victims(
        self, k: int, size: int, size_class: int | None, protect: set[int]
    ) -> list[tuple[int, bool]]:
        """Victims in policy order, as (bid, leaves-the-store); at most one round's worth."""
        idx, tier = self.index, self.tiers[k]
        last = k == len(self.tiers) - 1
        others = ((1 << len(self.tiers)) - 1) & ~(1 << k)
        pending: dict[int, int] = {}  # children chosen this round, per parent
        chosen: list[tuple[int, bool]] = []
        freed = 0
        for scanned, bid in enumerate(self._policies[k].candidates()):
            if scanned >= self.config.evict_work_cap:
                break
            if bid in protect or idx.in_use[bid]:
                continue
            bsize = int(idx.size[bid])
            if size_class is not None and tier.size_class(bsize) != size_class:
                continue
            has_copy = bool(int(idx.tiers[bid]) & others)
            if has_copy or not last:
                chosen.append((bid, False))
            else:
                if idx.pins[bid] or idx.children[bid] > pending.get(bid, 0):
                    continue
                chosen.append((bid, True))
                p = int(idx.parent[bid])
                if p != NO_PARENT:
                    pending[p] = pending.get(p, 0) + 1
            freed += bsize
            if freed >= size:
                break
        return chosen

    def _demote(self, bid: int, k: int, protect: set[int]) -> bool:
        """Move ``bid`` out of tier ``k``: write it back to a lower tier unless one holds it.

        If no lower tier can take it, the block leaves the store when it may (an unpinned
        leaf) and otherwise stays where it is (returns False: it is still in tier ``k``).
        """
        idx = self.index
        key = idx.hash_of(bid)
        lower = int(idx.tiers[bid]) >> (k + 1)
        if not lower and k + 1 < len(self.tiers):
            tier = self.tiers[k]
            idx.in_use[bid] += 1  # nothing below may expire or evict it while it moves
            try:
                meta = tier.meta(key) or self._meta_for(bid, key, self._ns_list[int(idx.ns[bid])])
                buf = self._scratch[k].view(meta.size)
                try:
                    tier.read_into(key, buf)
                    placed = self._place(bid, k + 1, buf, meta, protect | {bid})
                except (CorruptBlockError, BlockNotFound, TierIOError) as e:
                    log.warning("demotion of %s from %s failed: %s", key.hex(), tier.name, e)
                    placed = False
                finally:
                    del buf
            finally:
                idx.in_use[bid] -= 1
            if placed:
                self.counters.demotions += 1
            elif idx.evictable_leaf(bid):
                self._drop_block(bid)
                self.counters.evictions += 1
                return True
            else:
                return False
        self._drop_copy(bid, k, key)
        return True

    def _drop_copy(self, bid: int, k: int, key: bytes) -> None:
        """Remove tier ``k``'s copy; a block left with no copy stays in the index only as a
        hollow node (a lookup stops there) until its children are gone."""
        try:
            self.tiers[k].delete(BlockHash(key))
        except TierIOError as e:
            self.counters.tier_errors += 1
            log.error("delete of %s from tier %s failed: %s", key.hex(), self.tiers[k].name, e)
        self.index.tiers[bid] &= ~np.uint8(1 << k)
        self._policies[k].remove(bid)
        if not self.index.tiers[bid]:
            self._drop_hollow_leaves([bid])

    def _drop_block(self, bid: int, reason: str = "capacity") -> None:
        """Remove a leaf from every tier and from the index (``reason`` goes to the event log)."""
        idx = self.index
        key = idx.hash_of(bid)
        mask = int(idx.tiers[bid])
        self.events.dropped(key, mask, reason)
        while mask:
            k = _lowest_bit(mask)
            mask &= mask - 1
            try:
                self.tiers[k].delete(key)
            except TierIOError as e:
                self.counters.tier_errors += 1
                log.error("delete of %s from tier %s failed: %s", key.hex(), self.tiers[k].name, e)
            self._policies[k].remove(bid)
        idx.remove(bid)
        self._dirty_expiry.discard(bid)

    def _drop_hollow_leaves(self, bids: Sequence[int]) -> None:
        """Hollow leaves (no copy anywhere, no children, unused) leave the index, upwards."""
        idx = self.index
        for bid in sorted(set(bids), key=lambda b: -int(idx.depth[b])):
            while (
                bid != NO_PARENT
                and idx.hash_of_or_none(bid) is not None
                and not idx.tiers[bid]
                and idx.evictable_leaf(bid)
            ):
                parent = int(idx.parent[bid])
                idx.remove(bid)
                self._dirty_expiry.discard(bid)
                bid = parent

    def _expire(self, now: float, cap: int) -> int:
        for record in self._pins.due(now):  # a guarantee that has run out is released first
            self._release_pin(record)
        removed = 0
        while removed < cap:
            ids = self.index.expired_leaves(now, cap - removed)
            if not ids.size:
                break
            for bid in ids.tolist():
                self._drop_block(bid, "expired")
            removed += int(ids.size)
        self.counters.expirations += removed
        return removed

    def _meta_for(self, bid: int, key: bytes, info: _NsInfo) -> BlockMeta:
        """Metadata of a cached block, from the fastest tier that keeps it, else rebuilt."""
        idx = self.index
        mask = int(idx.tiers[bid])
        while mask:
            k = _lowest_bit(mask)
            mask &= mask - 1
            meta = self.tiers[k].meta(BlockHash(key))
            if meta is not None:
                return meta.with_expiry(float(idx.expiry[bid]))
        raise RuntimeError(f"block {key.hex()} has no tier that keeps its metadata")

    # ---- pins, deletes, maintenance -----------------------------------------------------------

    def pin(self, ns: Namespace, hashes: Sequence[bytes], *, until: float | None = None) -> int:
        """Protect the cached prefix of ``hashes`` from expiry and eviction; returns its length.

        Without ``until`` the pin holds until :meth:`unpin`; with ``until`` (wall-clock seconds)
        it is a retention guarantee that ends by itself then: the prefix is copied to the
        first persistent tier (synced), its expiry moved to ``until`` at least, and it stays
        on some tier under any pressure. A guarantee that cannot be given (pinned blocks would
        fill more than ``pin_limit_fraction`` of the last tier, or the persistent tier cannot
        take the prefix) raises RetentionError and pins nothing. Pins survive restarts.
        """
        info = self._ns(ns)
        with self._lock:
            now = self._clock()
            if until is not None and not until > now:
                raise UsageError(f"until={until} is not in the future (now {now}); pass a wall-clock time")
            m = self.index.match(hashes, now)
            if not m.num_blocks:
                return 0
            keys = tuple(bytes(h) for h in hashes[: m.num_blocks])
            if until is not None:
                self._guarantee(info, keys, m.ids, until)
            self.index.add_pins(m.ids, 1)
            self._pins.add(PinRecord(info.digest, keys, until))
            return m.num_blocks

    def _guarantee(self, info: _NsInfo, keys: tuple[bytes, ...], ids: np.ndarray, until: float) -> None:
        """Make a retention guarantee honourable before it is given (RetentionError if not)."""
        idx = self.index
        live = idx.live_ids()
        pinned = live[idx.pins[live] > 0]
        fresh = ids[idx.pins[ids] == 0]
        need = int(idx.size[pinned].sum()) + int(idx.size[fresh].sum())
        last = self.tiers[-1]
        limit = self.config.pin_limit_fraction * last.usage().capacity_bytes
        if need > limit:
            raise RetentionError(
                f"cannot guarantee {len(keys)} blocks until {until}: pinned blocks would take "
                f"{need} bytes, over {limit:.0f} (pin_limit_fraction={self.config.pin_limit_fraction} "
                f"of tier {last.name!r}); unpin prefixes, shorten them, or raise the limit"
            )
        if self._persistent:
            idx.add_pins(ids, 1)  # nothing may drop the prefix while it is copied down
            try:
                self._make_durable(keys, ids.tolist(), [], len(keys), info)
            except TierFullError as e:
                raise RetentionError(f"cannot guarantee {len(keys)} blocks until {until}: {e}") from e
            finally:
                idx.add_pins(ids, -1)
        idx.expiry[ids] = np.maximum(idx.expiry[ids], until)
        self._dirty_expiry.update(ids.tolist())

    def unpin(self, ns: Namespace, hashes: Sequence[bytes]) -> int:
        """Undo one :meth:`pin` of the same prefix (the longest pinned prefix of ``hashes``), or
        else take ``hashes`` out of the untimed pin that holds most of them; returns how many
        blocks were unpinned. A pin with a deadline is only undone whole."""
        info = self._ns(ns)
        keys = tuple(bytes(h) for h in hashes)
        with self._lock:
            record = self._pins.take(info.digest, keys) or self._pins.trim(info.digest, keys)
            return 0 if record is None else self._release_pin(record)

    def _release_pin(self, record: PinRecord) -> int:
        idx = self.index
        ids = [i for h in record.hashes if (i := idx.id_of(h)) is not None]
        held = np.array(ids, dtype=np.int64)
        held = held[idx.pins[held] > 0]
        idx.add_pins(held, -1)
        return int(held.size)

    def delete(self, ns: Namespace, hashes: Sequence[bytes]) -> int:
        """Delete the given blocks and every cached block that extends them; returns the count.

        Pinned or in-use blocks (and so their ancestors) are kept.
        """
        self._ns(ns)
        with self._lock:
            idx = self.index
            roots = [i for h in hashes if (i := idx.id_of(h)) is not None]
            if not roots:
                return 0
            sub = idx.subtree(np.array(roots, dtype=np.int64))
            removed = 0
            for bid in sub[np.argsort(-idx.depth[sub], kind="stable")].tolist():
                if idx.evictable_leaf(bid):
                    self._drop_block(bid, "deleted")
                    removed += 1
            return removed

    def maintain(self) -> dict[str, int]:
        """Periodic work: expire (with the work cap) and persist refreshed expiry times."""
        with self._lock:
            expired = self._expire(self._clock(), self.config.expire_work_cap)
            persisted = self._persist_expiry()
        return {"expired": expired, "expiry_updates": persisted}

    def _persist_expiry(self) -> int:
        if not self._dirty_expiry:
            return 0
        idx = self.index
        per_tier: dict[int, list[tuple[BlockHash, float]]] = {k: [] for k in self._persistent}
        for bid in self._dirty_expiry:
            mask = int(idx.tiers[bid])
            for k in self._persistent:
                if mask & (1 << k):
                    per_tier[k].append((idx.hash_of(bid), float(idx.expiry[bid])))
        for k, items in per_tier.items():
            if items:
                self.tiers[k].update_expiry(items)
        n = len(self._dirty_expiry)
        self._dirty_expiry.clear()
        return n

    def flush(self) -> None:
        """Persist refreshed expiry times and make every completed write durable."""
        with self._lock:
            self._persist_expiry()
            for t in self.tiers:
                t.flush()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                if self.config.persist_on_close:
                    self._persist_volatile()
                self.flush()
            finally:
                self._closed = True
                for t in self.tiers:
                    t.close()
                for sc in self._scratch:
                    sc.close()
                self.events.close()

    def _persist_volatile(self) -> int:
        """Write blocks held only by volatile tiers down to the first persistent tier, parents
        first, so that a clean restart (an upgrade, a reboot) keeps them. Stops at the first
        block the tier cannot take."""
        if not self._persistent:
            return 0
        p = self._persistent[0]
        persistent_mask = sum(1 << k for k in self._persistent)
        idx = self.index
        ids = idx.live_ids()
        ids = ids[(idx.tiers[ids] & persistent_mask) == 0]
        ids = ids[idx.tiers[ids] != 0]
        written = 0
        for bid in ids[np.argsort(idx.depth[ids], kind="stable")].tolist():
            key = idx.hash_of(bid)
            src_tier = self.tiers[_lowest_bit(int(idx.tiers[bid]))]
            meta = src_tier.meta(key)
            if meta is None:
                continue
            buf = self._scratch[-1].view(meta.size)
            try:
                src_tier.read_into(key, buf)
                if not self._place(bid, p, buf, meta.with_expiry(float(idx.expiry[bid])), {bid}):
                    break
            except (TierIOError, CorruptBlockError, BlockNotFound) as e:
                log.warning("could not persist %s on close: %s", key.hex(), e)
                break
            finally:
                del buf
            written += 1
        log.info("persisted %d volatile blocks on close", written)
        return written

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- restart ------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Rebuild the index from the persistent tiers' own metadata (warm restart)."""
        found: dict[bytes, tuple[BlockMeta, int]] = {}
        for k in self._persistent:
            for key, meta in self.tiers[k].scan():
                prev = found.get(key)
                mask = (prev[1] if prev else 0) | (1 << k)
                best = meta if prev is None or meta.expiry > prev[0].expiry else prev[0]
                found[key] = (best, mask)
        if not found:
            return
        foreign = self._learn_namespaces({meta.ns for meta, _ in found.values()})
        now = self._clock()
        idx = self.index
        order = sorted(found.items(), key=lambda kv: kv[1][0].depth)
        recovered: list[tuple[int, int, BlockMeta]] = []
        for key, (meta, mask) in order:
            info = self._ns_by_digest.get(meta.ns)
            if meta.ns in foreign or (
                info is not None
                and info.namespace is not None
                and meta.size != info.namespace.block_bytes
            ):
                # Another schema version or layout: never served, and left where it is for
                # the stores it belongs to.
                self.counters.foreign_blocks += 1
                continue
            if info is None:
                info = self._new_ns(meta.ns, None, self.config.default_ttl_s)
            if meta.depth == 0:
                pid = NO_PARENT if meta.parent == meta.ns else None
            else:
                pid = idx.id_of(meta.parent)
            if pid is None or (pid != NO_PARENT and idx.depth[pid] != meta.depth - 1):
                self._drop_orphan(key, mask)
                continue
            bid = int(idx.insert_chain([key], pid, meta.depth, meta.size, info.nid, 0, meta.created, meta.expiry)[0])
            idx.tiers[bid] = mask
            recovered.append((bid, mask, meta))
        # Policies learn the blocks deepest first, so leaves are the first candidates.
        for bid, mask, meta in reversed(recovered):
            m = mask
            while m:
                k = _lowest_bit(m)
                m &= m - 1
                self._policies[k].insert(bid, meta.size, meta.created)
        self.counters.recovered_blocks += len(recovered)
        for record in self._pins:  # before expiry: a pinned block must not expire at open
            if record.until is None or record.until > now:
                ids = [i for h in record.hashes if (i := idx.id_of(h)) is not None]
                idx.add_pins(np.array(ids, dtype=np.int64), 1)
        self._expire(now, self.config.expire_work_cap)
        log.info("recovered %d blocks", self.counters.recovered_blocks)

    def _drop_orphan(self, key: bytes, mask: int) -> None:
        # A block whose parent did not survive (it lived only in DRAM) can never be reached
        # by a prefix match; free its room. Not on a shared tier: there the parent may be in
        # another node's DRAM, to be written later (a probe then finds both).
        self.counters.orphans_dropped += 1
        while mask:
            k = _lowest_bit(mask)
            mask &= mask - 1
            if k in self._shared:
                continue
            try:
                self.tiers[k].delete(BlockHash(key))
            except TierIOError as e:
                log.warning("could not drop orphan %s from tier %s: %s", key.hex(), self.tiers[k].name, e)

    def _learn_namespaces(self, digests: set[bytes]) -> set[bytes]:
        """Register the namespaces of recovered blocks that namespaces.json lacks, from the
        descriptors the persistent tiers keep (object headers: blocks other stores wrote).
        Returns the digests that are *foreign*: another schema version, or a descriptor that
        does not hash to its digest. Their blocks are reported, never served."""
        unknown = {d for d in digests if d not in self._ns_by_digest}
        descriptors: dict[bytes, bytes] = {}
        for k in self._persistent:
            if unknown:
                for d, desc in self.tiers[k].namespaces().items():
                    if d in unknown:
                        descriptors.setdefault(d, desc)
        foreign: set[bytes] = set()
        for d, desc in descriptors.items():
            try:
                ns = Namespace.from_dict(json.loads(desc))
                if ns.root != d:
                    raise ValueError(f"the descriptor hashes to {ns.root.hex()}")
            except (ValueError, KeyError, TypeError) as e:  # UsageError is a ValueError
                log.warning("blocks of namespace %s are foreign, never served: %s", d.hex(), e)
                foreign.add(d)
                continue
            for other in self._ns_list:
                if other.namespace is not None and other.namespace.model_key() == ns.model_key():
                    log.warning(
                        "learned namespace %s of model %r has another layout than the "
                        "registered %s; their blocks are kept apart",
                        d.hex(), ns.model_id, other.digest.hex(),
                    )
            self._new_ns(d, ns, self.config.default_ttl_s)
            for t in self.tiers:
                t.register_namespace(d, desc)
            log.info("learned namespace %s (model %r) from a persistent tier", d.hex(), ns.model_id)
        if len(descriptors) > len(foreign):
            self._save_namespaces()
        return foreign

    # ---- stats --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = self.counters
            return {
                "blocks": len(self.index),
                "index_bytes": self.index.memory_bytes(),
                "namespaces": len(self._ns_list),
                "tiers": [{**t.describe(), **self.events.traffic(t.name)} for t in self.tiers],
                "lookups": c.lookups,
                "lookup_blocks": c.lookup_blocks,
                "hit_blocks": c.hit_blocks,
                "block_hit_rate": c.hit_blocks / c.lookup_blocks if c.lookup_blocks else 0.0,
                "hits_by_tier": dict(c.per_tier_hits),
                "put_blocks": c.put_blocks,
                "dedup_blocks": c.dedup_blocks,
                "promotions": c.promotions,
                "demotions": c.demotions,
                "evictions": c.evictions,
                "expirations": c.expirations,
                "corrupt_blocks": c.corrupt_blocks,
                "tier_errors": c.tier_errors,
                "recovered_blocks": c.recovered_blocks,
                "orphans_dropped": c.orphans_dropped,
                "discovered_blocks": c.discovered_blocks,
                "foreign_blocks": c.foreign_blocks,
                "unavailable_reads": c.unavailable_reads,
                "events": self.events.stats(),
            }

    def namespace_usage(self) -> dict[bytes, tuple[int, int]]:
        """``{namespace digest: (blocks, bytes)}`` cached now, for quotas; one vectorised pass."""
        with self._lock:
            ids = self.index.live_ids()
            nsi = self.index.ns[ids].astype(np.int64)
            n = len(self._ns_list)
            blocks = np.bincount(nsi, minlength=n)
            nbytes = np.bincount(nsi, weights=self.index.size[ids], minlength=n)
            return {
                info.digest: (int(blocks[i]), int(nbytes[i]))
                for i, info in enumerate(self._ns_list)
                if blocks[i]
            }

    def iter_blocks(self, keys: Iterable[bytes] | None = None) -> Iterator[dict[str, Any]]:
        """Every cached block's index entry, or those of ``keys`` that are cached (for
        inspection tools); a snapshot per block, taken under the lock and yielded outside it."""
        with self._lock:
            if keys is None:
                ids = self.index.live_ids().tolist()
            else:
                ids = [i for k in keys if (i := self.index.id_of(bytes(k))) is not None]
        for bid in ids:
            with self._lock:
                idx = self.index
                h = idx.hash_of_or_none(bid)
                if h is None:
                    continue
                p = int(idx.parent[bid])
                row = {
                    "hash": h.hex(),
                    "namespace": self._ns_list[int(idx.ns[bid])].digest.hex(),
                    "parent": idx.hash_of(p).hex() if p != NO_PARENT else None,
                    "depth": int(idx.depth[bid]),
                    "size": int(idx.size[bid]),
                    "tiers": [t.name for k, t in enumerate(self.tiers) if idx.tiers[bid] & (1 << k)],
                    "hits": int(idx.hits[bid]),
                    "last_access": float(idx.last_access[bid]),
                    "expiry": float(idx.expiry[bid]),
                    "pins": int(idx.pins[bid]),
                    "in_use": int(idx.in_use[bid]),
                    "children": int(idx.children[bid]),
                }
            yield row


# ---- helpers ------------------------------------------------------------------------------------


def _diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            yield from _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            yield f"{prefix}{k}", va, vb


def _as_view(buf: Any, writable: bool) -> memoryview:
    if type(buf).__module__.startswith("torch"):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise UsageError("torch buffers must be contiguous CPU tensors")
        buf = buf.view(-1).view(__import__("torch").uint8).numpy()
    try:
        return byte_view(buf, writable=writable)
    except TypeError:
        raise UsageError(
            f"expected a buffer (bytes, bytearray, numpy array, tensor), got {type(buf).__name__}"
        ) from None


def _split(buf: Any, bb: int, writable: bool, count: int | None) -> list[memoryview]:
    mv = _as_view(buf, writable)
    if count is None:
        if len(mv) % bb:
            raise BufferSizeError(
                f"buffer of {len(mv)} bytes is not a whole number of {bb}-byte blocks"
            )
        count = len(mv) // bb
    elif len(mv) != count * bb:
        raise BufferSizeError(f"expected {count} blocks of {bb} bytes ({count * bb} bytes), got {len(mv)}")
    return [mv[i * bb : (i + 1) * bb] for i in range(count)]


def _dst_views(dst: Any, bb: int) -> list[memoryview]:
    if isinstance(dst, list | tuple):
        views = [_as_view(d, True) for d in dst]
        for i, v in enumerate(views):
            if len(v) < bb:
                raise BufferSizeError(f"destination buffer {i} has {len(v)} bytes; a block needs {bb}")
        return views
    return _split(dst, bb, True, None)


def _src_views(blocks: Any, bb: int, count: int) -> list[memoryview]:
    if isinstance(blocks, list | tuple):
        if len(blocks) != count:
            raise UsageError(f"expected {count} block payloads, got {len(blocks)}")
        views = [_as_view(b, False) for b in blocks]
        for i, v in enumerate(views):
            if len(v) != bb:
                raise BufferSizeError(f"payload {i} has {len(v)} bytes; a block of this namespace has {bb}")
        return views
    return _split(blocks, bb, False, count)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise TierIOError(f"cannot write {path}: {e.strerror}; check the store directory") from e
