"""KVStore: the public facade over the store's parts.

Who decides and who moves bytes: the store decides (placement, promotion, demotion, expiry,
eviction) under one lock; tiers only move bytes (tiers/base.py). The parts, each built here with
all the state it touches:

* :class:`~kvstore.store.ledger.Ledger`: the only code that records which tier holds which copy
  (index, per-tier policies, event hooks, counters); no I/O;
* :class:`~kvstore.store.placer.Placer`: where a block lands and how a tier makes room
  (choose, then apply), demotion, expiry, and the one routine that writes a copy;
* :class:`~kvstore.store.loads.Loader`: load plans (``prepare_load`` under the lock, the reads
  outside it, completion under it), shared by :meth:`KVStore.get_into` and
  :meth:`KVStore.acquire`;
* :class:`~kvstore.store.puts.Storer`: store plans (validate and pin, fill, complete) and
  durable copies;
* :class:`~kvstore.store.namespaces.NamespaceTable`; :mod:`kvstore.store.restart` (warm restart
  and close, plain functions over the same parts).

Expiry comes first: before evicting anything the store removes expired leaves (with a work cap).
A hit refreshes a block's expiry in memory; persistent tiers learn the new expiry in batches on
:meth:`KVStore.flush` / :meth:`KVStore.maintain`, never on the read path.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from kvstore.api import ArenaPeek, Lease, LookupResult
from kvstore.buffers import dst_views, src_views
from kvstore.clock import Clock, system_clock
from kvstore.config import StoreConfig
from kvstore.errors import KVStoreError, RetentionError, TierFullError, TierIOError, UsageError
from kvstore.events import StoreEvents, put_tokens_of
from kvstore.index import NO_PARENT, RadixIndex
from kvstore.keys import Namespace
from kvstore.registry import make_policies, make_tier
from kvstore.retention import PINS_FILE, PinBook, PinRecord
from kvstore.store import restart
from kvstore.store._common import atomic_write
from kvstore.store.ledger import Ledger, StoreCounters, lowest_bit
from kvstore.store.loads import Loader
from kvstore.store.namespaces import NamespaceTable, NsInfo
from kvstore.store.placer import Placer
from kvstore.store.puts import Storer
from kvstore.store.reservation import Reservation
from kvstore.store.validate import check_store_config
from tiers.base import Arena, Tier

log = logging.getLogger("kvstore.store")


_NO_BYTES = memoryview(b"")
"""The buffer of a block served in place in the arena (a lease reads nothing)."""


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
        self.config = config = config or StoreConfig()
        self._clock = clock
        self._lock = threading.RLock()
        self._closed = False
        self._orphaned: deque[Callable[[int], int]] = deque()
        """The finishes of reservations dropped without a commit or an abort (appended by their
        finalizers, at whatever point the collector runs: nothing else is done there), aborted
        by the next ``reserve``, ``put``, ``stats`` or ``close`` (:meth:`_abort_orphans`)."""
        root = config.root
        if tiers is None:
            check_store_config(config)  # names, options, capacities: before anything is allocated
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise TierIOError(
                f"cannot create the store directory {root}: {e.strerror}; "
                "choose a writable [store] root (or set KVSTORE_ROOT)"
            ) from e
        if tiers is None:
            tiers = [make_tier(s.kind, s.name, dict(s.options), root, clock) for s in config.tiers]
        self.tiers = list(tiers)
        self.index = RadixIndex()
        self.counters = StoreCounters()
        self.events = StoreEvents.open(config.events, root, clock, [t.name for t in self.tiers], config.policy)
        policies = make_policies(config.policy, dict(config.policy_options), self.index, self.tiers)
        self._namespaces = NamespaceTable(root, config.max_namespaces, atomic_write)
        self._namespaces.load()
        self._pins = PinBook(root / PINS_FILE, atomic_write)
        self._ledger = Ledger(self.index, policies, self.events, self.counters)
        self._placer = Placer(self.tiers, self._ledger, self._namespaces, self._pins, config, clock)
        self._loader = Loader(self.tiers, self._ledger, self._placer, self._lock, clock)
        self._storer = Storer(self._ledger, self._placer)
        self._persistent = [k for k, t in enumerate(self.tiers) if t.persistent]
        # Leases live in the first tier that exposes a shared-memory arena (not necessarily tier 0).
        self._arena: int | None = None
        self._arena_of: Arena | None = None
        for k, t in enumerate(self.tiers):
            if (found := t.arena()) is not None:
                self._arena, self._arena_of = k, found
                break
        restart.recover(self.tiers, self._ledger, self._placer, self._namespaces, self._pins, config, clock)
        self._namespaces.save(self._namespaces.snapshot())

    @property
    def arena(self) -> str | None:
        """Name of the shared-memory arena leases point into (None: the store has none)."""
        return None if self._arena_of is None else self._arena_of.shm_name

    @property
    def arena_tier(self) -> Tier | None:
        """The tier leases live in: the first tier whose :meth:`~tiers.base.Tier.arena` is not
        None, wherever it is (None: none). Its arena is the one the daemon maps and hands to
        same-node clients."""
        return None if self._arena is None else self.tiers[self._arena]

    # ---- namespaces ---------------------------------------------------------------------------

    def register_namespace(self, ns: Namespace, ttl_s: float | None = None) -> None:
        """Make ``ns`` usable; ``ttl_s`` (default: the store's) applies to its blocks.

        Re-registering with ``ttl_s`` updates the TTL; without, it keeps the one the namespace
        has (so an operator's ``kvctl ttl`` survives engines reconnecting). Blocks of ``ns``
        already on persistent tiers (from an earlier run) become visible at once. Past
        ``max_namespaces`` a new namespace is refused (QuotaExceededError). ``namespaces.json``
        is rewritten outside the store lock, and only when something changed.
        """
        if ttl_s is not None and not ttl_s > 0:
            raise UsageError(f"ttl_s must be positive (seconds), got {ttl_s!r}")
        with self._lock:
            info, _ = self._namespaces.register(ns, ttl_s, self.config.default_ttl_s)
            for t in self.tiers:  # cheap, and a tier learns descriptors only in this process
                t.register_namespace(ns.root, ns.canonical_bytes())
            snap = self._namespaces.snapshot()
            self.events.namespace(ns, info.ttl_s)
            conflicts = self._namespaces.note_conflicts(ns, self._holds_blocks)
        self._namespaces.save(snap)
        for w in conflicts:  # allowed (both layouts stay usable), never silent
            log.warning("layout conflict on registration: %s", w["message"])

    def layout_conflicts(self, ns: Namespace) -> list[Namespace]:
        """Registered namespaces of ``ns``'s model deployment (model id, revision, rank, LoRA,
        salt) with another layout (block size, dtype, layers, ...): blocks of one never hit the
        other. :meth:`register_namespace` logs and counts them (``layout_conflicts`` in
        :meth:`stats`, the recent ones in ``layout_conflict_warnings``)."""
        with self._lock:
            return self._namespaces.conflicts(ns, self._holds_blocks)

    def _holds_blocks(self, nid: int) -> bool:
        """Under the lock: whether namespace ``nid`` has a cached block (a pass over the index,
        made only for a namespace that would otherwise be reported as a layout conflict)."""
        ids = self.index.live_ids()
        return bool(np.any(self.index.ns[ids] == nid))

    def namespaces(self) -> list[tuple[Namespace, float]]:
        with self._lock:
            return self._namespaces.registered()

    def _ns(self, ns: Namespace) -> NsInfo:
        return self._namespaces.get(ns)

    # ---- lookups and loads --------------------------------------------------------------------

    def lookup_nowait(self, ns: Namespace, hashes: Sequence[bytes]) -> LookupResult | None:
        """:meth:`lookup` if it can answer from memory at once, else None (the store lock is
        held by a put or a move, or a shared tier may need probing). For an event loop: a None
        means "run :meth:`lookup` on a worker thread"."""
        if self._loader.shared or not self._lock.acquire(blocking=False):
            return None
        try:
            return self.lookup(ns, hashes)
        finally:
            self._lock.release()

    def lookup(self, ns: Namespace, hashes: Sequence[bytes]) -> LookupResult:
        """How many leading blocks of ``hashes`` are cached and where, counting only tiers that
        can be reached now. Changes nothing, except that blocks other nodes wrote to a shared
        tier may be learned. Counted apart from loads (``lookup_blocks`` / ``lookup_hit_blocks``)."""
        return self._lookup(ns, hashes, True)

    def peek(self, ns: Namespace, hashes: Sequence[bytes]) -> LookupResult:
        """:meth:`lookup`, not counted: for the daemon's own checks (a pin's quota, a get's
        fallback), so that the lookup counters hold only what engines asked."""
        return self._lookup(ns, hashes, False)

    def _lookup(self, ns: Namespace, hashes: Sequence[bytes], count: bool) -> LookupResult:
        info = self._ns(ns)
        self._loader.discover(info, hashes)
        avail = self._placer.available_mask()
        with self._lock:
            _, tiers = self._loader.match(info, hashes, self._clock())
            masks = [int(b) & avail for b in tiers.tolist()]
            n = masks.index(0) if 0 in masks else len(masks)
            if count:
                c = self.counters
                c.lookups += 1
                c.lookup_blocks += len(hashes)
                c.lookup_hit_blocks += n
                info.lookup_blocks += len(hashes)
                info.lookup_hit_blocks += n
        names = tuple(self.tiers[lowest_bit(b)].name for b in masks[:n])
        down = tuple(t.name for k, t in enumerate(self.tiers) if not avail >> k & 1)
        if count:
            self.events.lookup(info.namespace, hashes, names)  # type: ignore[arg-type]  # _ns(): registered, not None
        return LookupResult(n, info.namespace.block_tokens, names, down)  # type: ignore[union-attr]  # as above

    def get_into(self, ns: Namespace, hashes: Sequence[bytes], dst: Any | Sequence[Any]) -> int:
        """Load the leading cached blocks of ``hashes`` into caller-owned buffers.

        ``dst`` is one writable buffer of ``k * block_bytes`` bytes or a sequence of ``k``
        writable buffers of ``block_bytes`` each; at most ``min(k, len(hashes))`` blocks load.
        Returns how many leading blocks were loaded; block ``i`` is in buffer ``i``. A block that
        fails its checksum on every tier ends the prefix there (a miss, never wrong bytes).
        Blocks served from a slower tier are promoted into the first tier (``promote_on_hit``).
        """
        info = self._ns(ns)
        bufs = dst_views(dst, info.block_bytes)
        trace = self.events.request(info.namespace, hashes)  # type: ignore[arg-type]  # _ns(): registered, not None
        hashes = hashes[: len(bufs)]
        self._loader.discover(info, hashes)
        plan = self._loader.prepare_load(info, hashes)
        trace.matched()
        try:
            if plan.ids.size:
                self._loader.read(plan, bufs)
        finally:
            with self._lock, self.events.batch():
                n = self._loader.complete_load(plan, 0 if self.config.promote_on_hit else None)
        trace.done(plan.served[:n])
        return n

    def acquire_nowait(self, ns: Namespace, hashes: Sequence[bytes]) -> Lease | None:
        """:meth:`acquire` if it can be served at once from the arena, else None: the store lock
        is held by a put or a move, a shared tier may need probing, or a leading cached block
        lies only on a slower tier (a read). For an event loop: a None means "run
        :meth:`acquire` on a worker thread"."""
        if self._arena is None or self._loader.shared or not self._lock.acquire(blocking=False):
            return None
        try:  # (the lock is re-entrant: acquire takes it again, with nothing between)
            _, masks = self._loader.match(self._ns(ns), hashes, self._clock())
            if masks.size and not np.all(masks & (1 << self._arena)):
                return None
            return self.acquire(ns, hashes)
        finally:
            self._lock.release()

    def acquire(self, ns: Namespace, hashes: Sequence[bytes]) -> Lease:
        """Hold the leading cached blocks of ``hashes`` in the store's shared-memory arena.

        For a same-node reader that maps the arena: nothing is copied for a block the arena
        holds. With ``promote_on_hit`` a block held only by slower tiers is read and promoted
        into the arena first; without, the lease ends at the first block the arena lacks. Counts
        as a hit like :meth:`get_into`. The caller must :meth:`release` the lease; until then
        its blocks are in use and stay where they are.
        """
        info = self._ns(ns)
        if self._arena is None:
            kinds = ", ".join(f"{t.name!r} ({t.kind})" for t in self.tiers)
            raise UsageError(
                f"leases need a shared-memory tier; this store has {kinds}: "
                "add a kind = 'dram' tier first in the config"
            )
        a = self._arena
        arena = self._arena_of
        assert arena is not None
        bb = info.block_bytes
        trace = self.events.request(info.namespace, hashes, "acquire")  # type: ignore[arg-type]  # _ns(): registered, not None
        self._loader.discover(info, hashes)
        plan = self._loader.prepare_load(info, hashes)
        trace.matched()
        promote = self.config.promote_on_hit
        held = 0
        locations: list[tuple[int, int]] = []
        lead = 0  # leading blocks the arena holds at the match
        try:
            if plan.ids.size:
                bit = 1 << a
                lead = next((i for i, m in enumerate(plan.masks) if not m & bit), len(plan.masks))
                if not promote:  # only what the arena holds already
                    plan.masks = plan.masks[:lead]
                if lead == len(plan.masks):
                    # All in the arena (a hit's usual case): served in place, with no per-block
                    # read or buffer (a 2,048-block lease spent milliseconds on them).
                    plan.served.extend([a] * lead)
                    plan.bufs.extend([_NO_BYTES] * lead)
                else:
                    # Blocks the arena lacks are read outside the lock; being in use, nothing moves them.
                    bufs = [_NO_BYTES if m & bit else np.empty(bb, np.uint8).data for m in plan.masks]
                    self._loader.read(plan, bufs, in_place=bit)
        finally:
            with self._lock, self.events.batch():
                try:
                    self._loader.settle(plan)
                    n = len(plan.served)
                    if promote and n > lead:  # some block came from a slower tier
                        n = self._placer.promote(plan.ids[:n], plan.served, plan.bufs, a)
                    for loc in arena.locations(hashes[:n]):  # one lock and one pass for the lot
                        if loc is None:
                            break
                        locations.append(loc)
                    held = len(locations)
                    self._loader.count_hits(plan, held)
                finally:
                    self._loader.finish(plan, held)
                    if held:
                        self._ledger.lease(plan.ids[:held])
        trace.done(plan.served[:held])
        return Lease(arena.shm_name, tuple(locations), plan.ids[:held].copy())

    def peek_arena(self, ns: Namespace, hashes: Sequence[bytes]) -> ArenaPeek:
        """Where the shared-memory arena holds the leading blocks of ``hashes`` now, holding
        nothing: an optimistic read for a reader that wants its first copy queued before it takes
        the lease (the GPU restore's head). Counts, touches and checks nothing else (no expiry, no
        tenant's hit): a block may leave right after, so bytes copied from these locations are
        kept only for the leading blocks :meth:`confirm_peek` confirms against a lease taken
        afterwards; the rest are read again from the lease."""
        self._ns(ns)
        arena = self._arena_of
        if arena is None:
            raise UsageError("peek_arena needs a shared-memory tier: add a kind = 'dram' tier first in the config")
        locations, stamp = arena.peek(hashes)
        return ArenaPeek(arena.shm_name, tuple(locations), stamp)

    def confirm_peek(self, peek: ArenaPeek, lease: Lease) -> int:
        """How many leading blocks of ``peek`` a reader that copied them may keep, now that it
        holds ``lease`` (taken after the peek, for the same prompt): those the lease holds at the
        same locations, provided no slot of them was freed since the peek (then they held those
        very blocks throughout, and the lease keeps them there). 0 when any was freed: read them
        again from the lease."""
        if self._arena_of is None or peek.arena != lease.arena:
            return 0
        k = 0
        for a, b in zip(peek.locations, lease.locations, strict=False):
            if a != b:
                break
            k += 1
        if k and self._arena_of.freed_since([off for off, _ in peek.locations[:k]], peek.stamp):
            return 0
        return k

    def release(self, lease: Lease) -> None:
        """Give back a :meth:`acquire` lease: its blocks may move and leave again. Idempotent."""
        with self._lock:
            self._end_lease(lease)

    def release_nowait(self, lease: Lease) -> bool:
        """:meth:`release` if the store lock is free now (True), else nothing (False: call
        :meth:`release` on a worker thread)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._end_lease(lease)
            return True
        finally:
            self._lock.release()

    def _end_lease(self, lease: Lease) -> None:
        if lease._released:
            return
        lease._released = True
        if lease._ids.size:
            self._ledger.end_lease(lease._ids)

    # ---- puts ---------------------------------------------------------------------------------

    def put(
        self,
        ns: Namespace,
        hashes: Sequence[bytes],
        blocks: Any | Sequence[Any],
        *,
        start: int = 0,
        durable: bool = False,
        tokens: Any | None = None,
    ) -> int:
        """Store blocks ``start..len(hashes)-1`` of a prefix chain; returns how many were new.

        ``hashes`` is the whole chain from the first block; ``blocks`` holds the payloads of
        ``hashes[start:]`` (one buffer per block, or one contiguous buffer). Blocks before
        ``start`` must be cached already. Blocks already cached are skipped (deduplicated). A
        chain longer than the room that can be made stores its leading blocks that fit (the
        return value counts them); a put never fails for room while some block may leave.
        With ``durable=True`` each new block is written once, synced, to the first persistent
        tier, and the chain's earlier blocks are copied there; TierFullError if that tier
        cannot take them. ``tokens``: the token ids of the blocks put (``block_tokens`` for
        each of ``hashes[start:]``), for the block event sinks only (a router that hashes
        tokens itself reads them in the daemon's KV events); the store keeps none.
        """
        info = self._ns(ns)
        n = len(hashes)
        if not 0 <= start <= n:
            raise UsageError(f"start={start} is outside the chain of {n} blocks")
        self._abort_orphans()
        bt = info.namespace.block_tokens  # type: ignore[union-attr]  # _ns(): registered, not None
        put_tokens = None if tokens is None else put_tokens_of(hashes[start:], tokens, bt)
        srcs = src_views(blocks, info.block_bytes, n - start)
        storer = self._storer
        early: KVStoreError | None = None
        todo: list[int] = []
        if durable and self._persistent:
            with self._lock:
                todo = storer.prewrite_todo(info, hashes, start)
                now = self._clock()
            if todo:
                early = storer.prewrite(info, hashes, srcs, start, todo, now)
                if early is not None:
                    with self._lock:
                        self.counters.tier_errors += 1
        with self._lock, self.events.batch():  # (making room: copies moved down or dropped)
            plan = storer.prepare_store(info, hashes, start, srcs, self._clock())
            try:
                if todo:
                    storer.adopt_prewritten(plan, todo)
                if not durable:
                    storer.stage(plan)  # room in the first tier, made now; the bytes move below
            except BaseException:
                storer.complete_store(plan)
                raise
        try:
            if plan.staged:
                storer.write_staged(plan)  # the payload copies, without the store lock
        except BaseException:
            with self._lock:
                storer.complete_store(plan)
            raise
        with self._lock, self.events.batch(put_tokens, info.namespace, hashes):  # (the new copies)
            try:
                storer.fill(plan, durable)
                if durable:
                    if early is not None:
                        raise early  # as a failed durable write below would: the blocks are cached
                    storer.make_durable(plan)
            finally:
                storer.complete_store(plan)
            return plan.new

    def reservable(self) -> str | None:
        """None when :meth:`reserve` can serve this store, else why not (its first tier is no
        shared-memory DRAM arena, or that tier's policy may refuse blocks)."""
        return self._storer.reservable()

    def reserve(
        self, ns: Namespace, hashes: Sequence[bytes], *, start: int = 0, tokens: Any | None = None
    ) -> Reservation:
        """The first half of a put whose caller writes the payloads itself, into the arena.

        Validates and pins the chain as :meth:`put` does (blocks before ``start`` must be
        cached; cached blocks are skipped; room is made now, and a chain longer than the room
        that can be made gets slots for its leading blocks) and returns a
        :class:`~kvstore.store.reservation.Reservation`: arena slots for the new blocks, which
        no lookup or load sees until :meth:`Reservation.commit` publishes the leading ones
        written. Only on a store whose first tier is a shared-memory DRAM arena whose policy
        admits every block (UsageError otherwise: use :meth:`put`). Not durable (a durable
        put writes its blocks synced to a persistent tier: :meth:`put` with ``durable=True``).
        In process only, not on :class:`~kvstore.api.KVCacheAPI`: a daemon's clients map its
        arena read-only. ``tokens``: as in :meth:`put`, for the event sinks at the commit.
        """
        info = self._ns(ns)
        n = len(hashes)
        if not 0 <= start <= n:
            raise UsageError(f"start={start} is outside the chain of {n} blocks")
        self._abort_orphans()
        storer = self._storer
        why = storer.reservable()
        if why is not None:
            raise UsageError(f"reserve needs a store whose first tier is a shared-memory DRAM arena; {why}: use put")
        bt = info.namespace.block_tokens  # type: ignore[union-attr]  # _ns(): registered, not None
        put_tokens = None if tokens is None else put_tokens_of(hashes[start:], tokens, bt)
        with self._lock, self.events.batch():  # (making room: copies moved down or dropped)
            plan = storer.prepare_store(info, hashes, start, [], self._clock())
            try:
                first, slots = storer.reserve(plan)
            except BaseException:
                storer.complete_store(plan)
                raise
        arena = self.tiers[0].arena()
        assert arena is not None  # (reservable)
        tier: Arena = arena
        bb = info.block_bytes
        ahead: list[Any] = []  # what the commit publishes (Storer.slot_entries), when prepared before it

        def prepare() -> None:
            if not ahead:
                ahead.append(storer.slot_entries(plan, first, slots))

        def finish(count: int, free: bool = True) -> int:
            with self._lock, self.events.batch(put_tokens, info.namespace, hashes):  # (the new copies)
                storer.commit(plan, first, slots, count, ahead[0] if ahead else None, free=free)
            return plan.new

        def set_aside() -> Callable[[], None]:
            finish(0, free=False)
            held = list(slots)

            def release() -> None:
                with self._lock:
                    tier.free_slots(held)
                    held.clear()

            return release

        return Reservation(tier.shm_name, first, plan.stored_to, tuple((off, bb) for off in slots),
                           lambda: [tier.slot_view(off, bb) for off in slots], finish, prepare,
                           orphaned=self._orphaned.append, set_aside=set_aside)

    def _abort_orphans(self) -> None:
        """Abort the reservations dropped without a commit or an abort since the last call: their
        chains are unpinned and their slots given back (``abandoned_reservations``)."""
        while self._orphaned:
            finish = self._orphaned.popleft()
            with self._lock:
                self.counters.abandoned_reservations += 1
            try:
                finish(0)
            except Exception:  # noqa: BLE001 - a bug, but not the caller's (a put, a stats call): logged
                log.exception("aborting an abandoned reservation failed; its chain may stay pinned")

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
            ids, _ = self._loader.match(info, hashes, now)
            if not ids.size:
                return 0
            keys = tuple(bytes(h) for h in hashes[: ids.size])
            if until is not None:
                self._guarantee(keys, ids, until)
            self._ledger.pin(ids)
            self._pins.add(PinRecord(info.digest, keys, until))
            return int(ids.size)

    def _guarantee(self, keys: tuple[bytes, ...], ids: np.ndarray, until: float) -> None:
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
            self._ledger.pin(ids)  # nothing may drop the prefix while it is copied down
            try:
                self._storer.copy_durable(ids.tolist(), keys)
            except TierFullError as e:
                raise RetentionError(f"cannot guarantee {len(keys)} blocks until {until}: {e}") from e
            finally:
                self._ledger.unpin(ids)
        self._ledger.extend_expiry(ids, until)

    def unpin(self, ns: Namespace, hashes: Sequence[bytes]) -> int:
        """Undo one :meth:`pin` of the same prefix (the longest pinned prefix of ``hashes``), or
        else take ``hashes`` out of the untimed pin that holds most of them; returns how many
        blocks were unpinned. A pin with a deadline is only undone whole."""
        info = self._ns(ns)
        keys = tuple(bytes(h) for h in hashes)
        with self._lock:
            record = self._pins.take(info.digest, keys) or self._pins.trim(info.digest, keys)
            return 0 if record is None else self._ledger.release_pin(record)

    def unpin_own(self, ns: Namespace, hashes: Sequence[bytes], until: float | None) -> int:
        """Undo exactly the pin of ``hashes`` with deadline ``until`` (None: untimed), the one the
        caller made (a handoff), never another pin of the same blocks; returns how many blocks
        were unpinned (0: no such pin)."""
        info = self._ns(ns)
        keys = tuple(bytes(h) for h in hashes)
        with self._lock:
            record = self._pins.take_exact(info.digest, keys, until)
            return 0 if record is None else self._ledger.release_pin(record)

    def pins(self) -> list[PinRecord]:
        """The pin records in force, in pinning order (what ``pins.json`` holds)."""
        with self._lock:
            return list(self._pins)

    def delete(self, ns: Namespace, hashes: Sequence[bytes]) -> int:
        """Delete the given blocks and every cached block that extends them; returns the count.

        Pinned or in-use blocks (and so their ancestors) are kept.
        """
        self._ns(ns)
        with self._lock, self.events.batch():
            idx = self.index
            roots = [i for h in hashes if (i := idx.id_of(h)) is not None]
            if not roots:
                return 0
            sub = idx.subtree(np.array(roots, dtype=np.int64))
            removed = 0
            for bid in sub[np.argsort(-idx.depth[sub], kind="stable")].tolist():
                if idx.evictable_leaf(bid):
                    self._placer.drop_block(bid, "deleted")
                    removed += 1
            return removed

    def maintain(self) -> dict[str, int]:
        """Periodic work: expire (with the work cap) and persist refreshed expiry times."""
        with self._lock, self.events.batch():
            expired = self._placer.expire(self._clock(), self.config.expire_work_cap)
            updates, persisted = restart.take_expiry(self._ledger, self._persistent)
        restart.write_expiry(self.tiers, updates)  # tier I/O (maybe a remote one) without the store lock
        return {"expired": expired, "expiry_updates": persisted}

    def flush(self) -> None:
        """Persist refreshed expiry times and make every completed write durable. The tiers'
        I/O runs outside the store lock: lookups and hits go on during a slow flush."""
        with self._lock:
            if self._closed:
                return
            updates, _ = restart.take_expiry(self._ledger, self._persistent)
        restart.write_expiry(self.tiers, updates)
        for t in self.tiers:
            t.flush()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._abort_orphans()
                if self.config.persist_on_close:
                    restart.persist_volatile(self._placer)
                self.flush()
            finally:
                self._closed = True
                for t in self.tiers:
                    t.close()
                for sc in self._placer.scratch:
                    sc.close()
                self.events.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- stats --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        self._abort_orphans()
        with self._lock:
            c = self.counters
            traffic = [i.traffic() for i in self._namespaces if i.lookup_blocks or i.load_blocks]
            tokens = {k: sum(t[k] * t["block_tokens"] for t in traffic)
                      for k in ("lookup_blocks", "lookup_hit_blocks", "load_blocks", "hit_blocks")}
            by_tier: Counter[str] = Counter()
            for t in traffic:
                by_tier.update(t["hit_tokens_by_tier"])
            return {
                "blocks": len(self.index),
                "index_bytes": self.index.memory_bytes(),
                "namespaces": len(self._namespaces),
                "namespaces_quarantined": self._namespaces.quarantined,
                "tiers": [{**t.describe(), **self.events.traffic(t.name)} for t in self.tiers],
                "lookups": c.lookups,
                "lookup_blocks": c.lookup_blocks,
                "lookup_hit_blocks": c.lookup_hit_blocks,
                "lookup_hit_rate": c.lookup_hit_blocks / c.lookup_blocks if c.lookup_blocks else 0.0,
                "loads": c.loads,
                "load_blocks": c.load_blocks,
                "loaded_blocks": c.loaded_blocks,
                "hit_blocks": c.hit_blocks,
                "block_hit_rate": c.hit_blocks / c.load_blocks if c.load_blocks else 0.0,
                "hits_by_tier": dict(c.per_tier_hits),
                # Tokens, as LMCache reports them: asked for and found by lookups, requested
                # and served by loads, and the served ones by the tier that served them.
                "lookup_tokens": tokens["lookup_blocks"],
                "lookup_hit_tokens": tokens["lookup_hit_blocks"],
                "requested_tokens": tokens["load_blocks"],
                "hit_tokens": tokens["hit_blocks"],
                "token_hit_rate": tokens["hit_blocks"] / tokens["load_blocks"] if tokens["load_blocks"] else 0.0,
                "hit_tokens_by_tier": dict(by_tier),
                "namespace_traffic": traffic,
                "layout_conflicts": self._namespaces.layout_conflicts,
                "layout_conflict_warnings": list(self._namespaces.recent_conflicts),
                "put_blocks": c.put_blocks,
                "dedup_blocks": c.dedup_blocks,
                "truncated_puts": c.truncated_puts,
                "abandoned_reservations": c.abandoned_reservations,
                "promotions": c.promotions,
                "demotions": c.demotions,
                "evictions": c.evictions,
                "expirations": c.expirations,
                "failed_room": c.failed_room,
                "tier_writes": c.tier_writes,
                "skipped_writes": c.skipped_writes,
                "skipped_bytes": c.skipped_bytes,
                "admission": self._placer.admission.describe(),
                "corrupt_blocks": c.corrupt_blocks,
                "tier_errors": c.tier_errors,
                "recovered_blocks": c.recovered_blocks,
                "orphans_dropped": c.orphans_dropped,
                "dropped_on_close": c.dropped_on_close,
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
            table = self._namespaces.by_id
            blocks = np.bincount(nsi, minlength=len(table))
            nbytes = np.bincount(nsi, weights=self.index.size[ids], minlength=len(table))
            return {info.digest: (int(blocks[i]), int(nbytes[i])) for i, info in enumerate(table) if blocks[i]}

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
                    "namespace": self._namespaces.by_id[int(idx.ns[bid])].digest.hex(),
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
