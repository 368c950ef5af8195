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

import json
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.block import BlockMeta, payload_checksum
from kvstore.clock import Clock, system_clock
from kvstore.config import StoreConfig
from kvstore.errors import (
    LayoutMismatchError,
    MissingPrefixError,
    RetentionError,
    TierFullError,
    TierIOError,
    UnknownNamespaceError,
    UsageError,
)
from kvstore.events import StoreEvents
from kvstore.index import NO_PARENT, RadixIndex
from kvstore.keys import BlockHash, Namespace
from kvstore.registry import make_policies, make_tier
from kvstore.retention import PINS_FILE, PinBook, PinRecord
from kvstore.store._common import (
    NAMESPACES_FILE,
    Lease,
    LookupResult,
    StoreCounters,
    _atomic_write,
    _diff,
    _dst_views,
    _lowest_bit,
    _NsInfo,
    _Scratch,
    _src_views,
    read_namespaces,
)
from kvstore.store._durable import DurablePath
from kvstore.store._placement import Placement
from kvstore.store._read import ReadPath
from kvstore.store._restart import Restart

log = logging.getLogger("kvstore.store")


class KVStore(ReadPath, Placement, DurablePath, Restart):
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
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
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

    def pins(self) -> list[PinRecord]:
        """The pin records in force, in pinning order (what ``pins.json`` holds)."""
        with self._lock:
            return list(self._pins)

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
            updates, persisted = self._take_expiry()
        self._write_expiry(updates)  # tier I/O (maybe a remote one) without the store lock
        return {"expired": expired, "expiry_updates": persisted}

    def flush(self) -> None:
        """Persist refreshed expiry times and make every completed write durable. The tiers'
        I/O runs outside the store lock: lookups and hits go on during a slow flush."""
        with self._lock:
            if self._closed:
                return
            updates, _ = self._take_expiry()
        self._write_expiry(updates)
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

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
