"""The prefix-hash radix index: one node per cached block.

Nodes live in columns (a struct of arrays) indexed by a small integer *block id*; a dict maps
the 16-byte block hash to its id. A node holds no bytes of KV: only where the block lives (a
bitmask of tiers), its place in the tree, and the counters that eviction and expiry read. The
columnar layout keeps a node at ~150 bytes (see ``python -m tools.bench index``) where an object
per node costs several hundred, and lets expiry scan a million nodes with a few numpy operations.

Because a block hash covers its whole prefix, the tree's edges are implied by the hashes; the
index keeps ``parent`` and a child *count* only, which is all that prefix-closure needs:
a block with cached children never leaves the store (:meth:`evictable_leaf`).

Not thread-safe: the store holds its lock around every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from kvstore.keys import BlockHash

NO_PARENT = -1
_LIVE = np.uint8(1)


@dataclass(frozen=True, slots=True)
class Match:
    """Result of a longest-prefix match.

    ``ids[i]`` is the block id of the i-th leading cached block and ``tiers[i]`` the bitmask of
    tiers that hold it (bit ``k`` = the store's k-th tier).
    """

    ids: np.ndarray
    tiers: np.ndarray

    @property
    def num_blocks(self) -> int:
        return int(self.ids.size)


class RadixIndex:
    _COLUMNS: dict[str, np.dtype] = {
        "parent": np.dtype(np.int32),
        "depth": np.dtype(np.int32),
        "size": np.dtype(np.uint32),
        "ns": np.dtype(np.uint16),
        "flags": np.dtype(np.uint8),
        "tiers": np.dtype(np.uint8),
        "children": np.dtype(np.int32),
        "pins": np.dtype(np.int32),
        "in_use": np.dtype(np.int32),
        "hits": np.dtype(np.uint32),
        "last_access": np.dtype(np.float64),
        "expiry": np.dtype(np.float64),
    }
    # The columns (_COLUMNS), set by _grow.
    parent: np.ndarray
    depth: np.ndarray
    size: np.ndarray
    ns: np.ndarray
    flags: np.ndarray
    tiers: np.ndarray
    children: np.ndarray
    pins: np.ndarray
    in_use: np.ndarray
    hits: np.ndarray
    last_access: np.ndarray
    expiry: np.ndarray

    def __init__(self, capacity: int = 1024) -> None:
        self._ids: dict[bytes, int] = {}
        self._hashes: list[bytes | None] = []
        self._free: list[int] = []
        self._cap = 0
        self.parent = self.depth = self.size = self.ns = self.flags = self.tiers = None  # type: ignore[assignment]  # until _grow
        self.children = self.pins = self.in_use = self.hits = None  # type: ignore[assignment]  # until _grow
        self.last_access = self.expiry = None  # type: ignore[assignment]  # until _grow
        # No live block expires before this time (a lower bound), so expired_leaves can answer
        # without a scan until then: the store asks before every eviction.
        self._expiry_floor = float("inf")
        self._grow(max(16, capacity))

    # ---- storage ------------------------------------------------------------------------------

    def _grow(self, cap: int) -> None:
        for name, dt in self._COLUMNS.items():
            new = np.zeros(cap, dtype=dt)
            old = getattr(self, name)
            if old is not None:
                new[: self._cap] = old
            setattr(self, name, new)
        self._cap = cap

    def _alloc_ids(self, n: int) -> np.ndarray:
        take = min(n, len(self._free))
        reused = [self._free.pop() for _ in range(take)]
        fresh_start = len(self._hashes)
        fresh = n - take
        if fresh_start + fresh > self._cap:
            cap = self._cap
            while fresh_start + fresh > cap:
                cap *= 2
            self._grow(cap)
        self._hashes.extend([None] * fresh)
        return np.array(reused + list(range(fresh_start, fresh_start + fresh)), dtype=np.int64)

    # ---- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, key: bytes) -> bool:
        return key in self._ids

    def id_of(self, key: bytes) -> int | None:
        return self._ids.get(key)

    def hash_of(self, bid: int) -> BlockHash:
        h = self._hashes[bid]
        if h is None:
            raise KeyError(f"block id {bid} is not live")
        return BlockHash(h)

    def hash_of_or_none(self, bid: int) -> BlockHash | None:
        h = self._hashes[bid] if 0 <= bid < len(self._hashes) else None
        return None if h is None else BlockHash(h)

    def subtree(self, roots: np.ndarray) -> np.ndarray:
        """``roots`` and every live node below them (a few vectorised passes per level)."""
        n = len(self._hashes)
        live = self.flags[:n] == _LIVE
        inside = np.zeros(n, dtype=bool)
        inside[roots] = True
        frontier = inside.copy()
        while frontier.any():
            parent = self.parent[:n]
            child = live & ~inside & (parent >= 0) & frontier[np.clip(parent, 0, None)]
            inside |= child
            frontier = child
        return np.flatnonzero(inside)

    def match(self, hashes: Sequence[bytes], now: float | None = None) -> Match:
        """Longest cached prefix of ``hashes``: stops at the first miss, at a hollow block (in
        no tier) and, when ``now`` is given, at the first expired block that is not pinned.

        Never writes (a lookup changes nothing; the store touches what it then reads).
        """
        ids = np.array(self.known_prefix(hashes), dtype=np.int64)
        if ids.size:
            dead = self.tiers[ids] == 0
            if now is not None:
                dead |= (self.expiry[ids] <= now) & (self.pins[ids] == 0)
            if np.count_nonzero(dead):  # (no Python wrapper, unlike ndarray.any)
                ids = ids[: int(np.argmax(dead))]
        return Match(ids, self.tiers[ids])

    def known_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Ids of the leading ``hashes`` the index knows, hollow or expired ones included."""
        get = self._ids.get
        found: list[int] = []
        append = found.append
        for h in hashes:
            i = get(h)
            if i is None:
                break
            append(i)
        return found

    def evictable_leaf(self, bid: int) -> bool:
        """May ``bid`` leave the store entirely? (no cached children, not pinned, not in use)."""
        return bool(self.children[bid] == 0 and self.pins[bid] == 0 and self.in_use[bid] == 0)

    def movable(self, bid: int) -> bool:
        """May ``bid`` be moved between tiers? (no reader or writer holds it)."""
        return bool(self.in_use[bid] == 0)

    def expired_leaves(self, now: float, limit: int) -> np.ndarray:
        """Up to ``limit`` expired, evictable leaves, deepest first (children before parents).

        Scans only when ``now`` has reached the expiry floor; the scan sets the next floor.
        """
        if now < self._expiry_floor:
            return np.empty(0, dtype=np.int64)
        n = len(self._hashes)
        live = self.flags[:n] == _LIVE
        expired = live & (self.expiry[:n] <= now)
        mask = expired & (self.children[:n] == 0) & (self.pins[:n] == 0) & (self.in_use[:n] == 0)
        ids = np.flatnonzero(mask)
        if ids.size > limit:
            ids = ids[np.argsort(-self.depth[ids], kind="stable")[:limit]]
            return ids  # more to remove: the floor stays where it is
        future = self.expiry[:n][live & ~expired]
        floor = float(future.min()) if future.size else float("inf")
        if (expired & ~mask).any():
            # Expired but held (pinned, in use, with children): released through the methods
            # below, which lower the floor; a direct column write is caught within a second.
            floor = min(floor, now + 1.0)
        self._expiry_floor = floor
        return ids

    def _lower_floor(self, ids: np.ndarray | int) -> None:
        """Blocks that may have become expired, evictable leaves: rescan from their expiry."""
        if isinstance(ids, int):
            e = float(self.expiry[ids])
        elif ids.size:
            e = min(self.expiry[ids].tolist())  # (a chain's few ids: cheaper than ndarray.min)
        else:
            return
        if e < self._expiry_floor:
            self._expiry_floor = e

    def live_ids(self) -> np.ndarray:
        n = len(self._hashes)
        return np.flatnonzero(self.flags[:n] == _LIVE)

    # ---- mutation -----------------------------------------------------------------------------

    def insert_chain(
        self,
        hashes: Sequence[bytes],
        parent: int,
        depth0: int,
        size: int,
        ns: int,
        tier_bit: int,
        now: float,
        expiry: float,
    ) -> np.ndarray:
        """Insert a chain: ``hashes[k]``'s parent is ``hashes[k-1]``; ``hashes[0]``'s is ``parent``.

        None of ``hashes`` may be present (the store inserts only the uncached suffix).
        Returns the new ids.
        """
        ids = self._register(hashes)
        if ids.size:
            parents = np.empty(ids.size, dtype=np.int64)
            parents[0], parents[1:] = parent, ids[:-1]
            self._write(ids, parents, np.arange(depth0, depth0 + ids.size), size, ns, tier_bit, now, expiry, True)
        return ids

    def insert_blocks(
        self,
        hashes: Sequence[bytes],
        parents: np.ndarray,
        depths: np.ndarray,
        sizes: np.ndarray,
        ns: np.ndarray,
        tiers: np.ndarray,
        created: np.ndarray,
        expiry: np.ndarray,
        *,
        local_parents: bool = False,
    ) -> np.ndarray:
        """Insert blocks whose parents are already present (or ``NO_PARENT``), one column
        write each. Returns the new ids, in the order of ``hashes``. ``local_parents``:
        ``parents[i]`` is instead the position in ``hashes`` of block ``i``'s parent (or
        ``NO_PARENT``), so that a whole forest goes in one call (a warm restart)."""
        ids = self._register(hashes)
        if local_parents and ids.size:
            linked = parents != NO_PARENT
            parents = np.where(linked, ids[np.where(linked, parents, 0)], NO_PARENT)
        self._write(ids, parents, depths, sizes, ns, tiers, created, expiry)
        return ids

    def _register(self, hashes: Sequence[bytes]) -> np.ndarray:
        """New ids for ``hashes``, none of which may be present nor repeated. Checked before
        anything changes: a refused insert leaves the index as it was."""
        known = self._ids
        if len(set(hashes)) != len(hashes) or not known.keys().isdisjoint(hashes):
            dup = next((h for h in hashes if h in known), None) or next(
                h for i, h in enumerate(hashes) if h in hashes[:i])
            raise RuntimeError(f"block {bytes(dup).hex()} inserted twice")
        ids = self._alloc_ids(len(hashes))
        listed = ids.tolist()
        known.update(zip(hashes, listed, strict=True))
        names = self._hashes
        for h, i in zip(hashes, listed, strict=True):
            names[i] = h
        return ids

    def _write(
        self,
        ids: np.ndarray,
        parents: np.ndarray,
        depths: np.ndarray,
        sizes: np.ndarray | int,
        ns: np.ndarray | int,
        tiers: np.ndarray | int,
        last_access: np.ndarray | float,
        expiry: np.ndarray | float,
        distinct_parents: bool = False,
    ) -> None:
        """The columns of new blocks ``ids``; each parent gains a child (a parent may be among
        ``ids`` itself, as in a chain; ``distinct_parents``: no parent is repeated, as in a
        chain, so that one fancy add counts them)."""
        if not ids.size:
            return
        self.parent[ids] = parents
        self.depth[ids] = depths
        self.size[ids] = sizes
        self.ns[ids] = ns
        self.flags[ids] = _LIVE
        self.tiers[ids] = tiers
        self.children[ids] = 0
        linked = parents[parents != NO_PARENT]
        if linked.size == 1 or (linked.size and distinct_parents):
            self.children[linked] += 1
        elif linked.size:
            np.add.at(self.children, linked, 1)
        self.pins[ids] = 0
        self.in_use[ids] = 0
        self.hits[ids] = 0
        self.last_access[ids] = last_access
        self.expiry[ids] = expiry
        low = expiry if isinstance(expiry, float) else float(np.min(expiry))
        if low < self._expiry_floor:
            self._expiry_floor = low

    def remove(self, bid: int) -> BlockHash:
        """Drop a leaf. Raises if it still has cached children (the store stays prefix-closed)."""
        children = self.children
        if children[bid]:
            raise RuntimeError(f"block id {bid} has {children[bid]} cached children")
        h = self._hashes[bid]
        if h is None:
            raise KeyError(f"block id {bid} is not live")
        p = int(self.parent[bid])
        if p != NO_PARENT:
            left = int(children[p]) - 1
            children[p] = left
            if not left:
                e = float(self.expiry[p])
                if e < self._expiry_floor:
                    self._expiry_floor = e
        del self._ids[h]
        self._hashes[bid] = None
        self.flags[bid] = 0
        self.tiers[bid] = 0
        self._free.append(bid)
        return BlockHash(h)

    def remove_many(self, bids: list[int]) -> list[BlockHash]:
        """:meth:`remove` of each of ``bids`` in order, in one call (a batched eviction): a
        block may be the parent of one before it. Checked before anything changes: raises,
        leaving the index as it was, if a block is not live, is repeated, or keeps a cached
        child that is not among those removed before it."""
        if not bids:
            return []
        hashes = self._hashes
        keys = [hashes[b] for b in bids]
        if None in keys or len(set(bids)) != len(bids):
            bad = next((b for b, h in zip(bids, keys, strict=True) if h is None), None)
            raise KeyError(f"block id {bad} is not live" if bad is not None else f"block ids repeat in {bids}")
        ids = np.array(bids, np.int64)
        children = self.children
        # Per parent, the children the batch removes; each block's own children must all be
        # removed before it (its entry is taken out when it comes, so what is left are the
        # parents outside the batch: usually one, the stem of the chain a batch cut back).
        gone: dict[int, int] = {}
        for b, p, kids in zip(bids, self.parent[ids].tolist(), children[ids].tolist(), strict=True):
            if gone.pop(b, 0) != kids:
                raise RuntimeError(f"block id {b} has {kids} cached children")
            if p != NO_PARENT:
                gone[p] = gone.get(p, 0) + 1
        known = self._ids
        for h in cast("list[BlockHash]", keys):  # None in keys raised above
            del known[h]
        for b in bids:
            hashes[b] = None
        self.flags[ids] = 0
        self.tiers[ids] = 0
        children[ids] = 0  # (their children left before them)
        self._free.extend(bids)
        expiry = self.expiry
        for p, c in gone.items():
            left = int(children[p]) - c
            children[p] = left
            if not left:  # a parent left with no child may expire now
                e = float(expiry[p])
                if e < self._expiry_floor:
                    self._expiry_floor = e
        return cast("list[BlockHash]", keys)

    def touch(self, ids: np.ndarray, now: float, expiry: np.ndarray | float) -> None:
        """Record a hit on ``ids`` (distinct ids): last access, hit count, refreshed expiry."""
        self.last_access[ids] = now
        self.hits[ids] += 1
        self.expiry[ids] = np.maximum(self.expiry[ids], expiry)

    def extend_expiry(self, ids: np.ndarray, until: float) -> None:
        """Move the expiry of ``ids`` to ``until`` at least (a later expiry never lowers the
        floor, so none is needed)."""
        self.expiry[ids] = np.maximum(self.expiry[ids], until)

    def add_in_use(self, ids: np.ndarray, delta: int) -> None:
        self.in_use[ids] += delta
        if delta < 0:
            self._lower_floor(ids)

    def add_pins(self, ids: np.ndarray, delta: int) -> None:
        if delta < 0 and np.count_nonzero(self.pins[ids] < -delta):
            raise RuntimeError("unpin of a block that is not pinned")
        self.pins[ids] += delta
        if delta < 0:
            self._lower_floor(ids)

    def memory_bytes(self) -> int:
        """Approximate bytes held by the index (columns + maps), for stats."""
        cols = sum(getattr(self, name).nbytes for name in self._COLUMNS)
        # dict entry (~2x 8-byte slot + 24-byte entry at 2/3 load), 49-byte bytes key,
        # 28-byte int value, 8-byte list slot.
        return cols + len(self._ids) * (40 + 49 + 28 + 8)
