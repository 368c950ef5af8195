"""ARC: a probation list for blocks seen once, a protected list for blocks hit again, and ghosts
of both that steer the split between them (Megiddo and Modha, FAST'03).

A new block enters ``T1`` (probation). A hit moves it to ``T2`` (protected). An evicted block
leaves its hash in ghost list ``B1`` or ``B2``; when it comes back, the list it left from grows:
a return through ``B1`` means probation was too short, through ``B2`` that the protected set was
too small. Blocks seen once therefore compete only with each other for the probation share, and
a flood of one-hit blocks (most of a trace) cannot flush blocks that were hit.

Prefix-aware: on the last tier only leaves may leave, so candidates are offered leaves first
(a parent is skipped without moving it); ghosts are keyed by block hash because the index
recycles block ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from eviction.base import BlockView, EvictionPolicy, TierContext


@dataclass(frozen=True, slots=True)
class ARCConfig:
    pass


class ARCPolicy(EvictionPolicy):
    name = "arc"
    Config = ARCConfig

    def __init__(self, config: ARCConfig | None = None) -> None:
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        # Last tier: resident blocks with cached children, out of T1/T2 until offered again;
        # the value says whether the block returns to T2 (hit since it came) or to T1.
        self._held: dict[int, bool] = {}
        self._p = 0.0  # target size of T1, in blocks
        self._view: BlockView | None = None
        self._tier = TierContext()

    def bind(self, view: BlockView, tier: TierContext) -> None:
        self._view = view
        self._tier = tier

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._held)

    def insert(self, bid: int, size: int, now: float) -> None:
        if bid in self._t1 or bid in self._t2 or bid in self._held:
            return
        key = self._view.hash_of(bid) if self._view is not None else None
        if key is not None and key in self._b1:
            self._p = min(len(self) + 1.0, self._p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            self._t2[bid] = None
        elif key is not None and key in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
            self._t2[bid] = None
        else:
            self._t1[bid] = None
        if self._tier.last and self._view is not None and self._view.children[bid]:
            self.hold(bid)

    def insert_many(self, ids: np.ndarray, sizes: np.ndarray, now: np.ndarray | float) -> None:
        order = np.asarray(ids).tolist()
        t1, t2, held, view = self._t1, self._t2, self._held, self._view
        if not (self._b1 or self._b2 or self._tier.last):
            # No ghosts: every new id joins probation in order of its first occurrence; ids
            # already resident (and repeats) are no-ops.
            new = dict.fromkeys(order)
            for bid in (new.keys() & t1.keys()) | (new.keys() & t2.keys()):
                del new[bid]
            t1.update(new)
            return
        # ``insert`` of each in order, in one loop (a returning ghost moves p, so the order
        # matters); a block with cached children on the last tier goes straight to the held
        # set, where ``insert`` then ``hold`` would put it.
        b1, b2 = self._b1, self._b2
        kids = view.children[np.asarray(ids, np.int64)].tolist() if view is not None and self._tier.last else None
        hash_of = view.hash_of if view is not None else None
        for j, bid in enumerate(order):
            if bid in t1 or bid in t2 or bid in held:
                continue
            frequent = False
            if hash_of is not None and (b1 or b2):
                key = hash_of(bid)
                if key in b1:
                    size = len(t1) + len(t2) + len(held)
                    self._p = min(size + 1.0, self._p + max(1.0, len(b2) / len(b1)))
                    del b1[key]
                    frequent = True
                elif key in b2:
                    self._p = max(0.0, self._p - max(1.0, len(b1) / len(b2)))
                    del b2[key]
                    frequent = True
            if kids is not None and kids[j]:
                held[bid] = frequent
            elif frequent:
                t2[bid] = None
            else:
                t1[bid] = None

    def touch(self, bid: int, now: float) -> None:
        if bid in self._held:
            self._held[bid] = True
        elif bid in self._t1:
            del self._t1[bid]
            self._t2[bid] = None
        elif bid in self._t2:
            self._t2.move_to_end(bid)

    def hold(self, bid: int) -> None:
        if bid in self._t1:
            del self._t1[bid]
            self._held[bid] = False
        elif bid in self._t2:
            del self._t2[bid]
            self._held[bid] = True

    def offer(self, bid: int) -> None:
        frequent = self._held.pop(bid, None)
        if frequent is not None:
            # At the old end: a parent is offered when its last child left, and a leaf leaves
            # from the old end, so the parent is about as old (its own recency is not kept).
            order = self._t2 if frequent else self._t1
            order[bid] = None
            order.move_to_end(bid, last=False)

    def remove(self, bid: int) -> None:
        if bid in self._held:
            ghosts = self._b2 if self._held.pop(bid) else self._b1
        elif bid in self._t1:
            del self._t1[bid]
            ghosts = self._b1
        elif bid in self._t2:
            del self._t2[bid]
            ghosts = self._b2
        else:
            return
        if self._view is None:
            return
        ghosts[self._view.hash_of(bid)] = None
        limit = max(len(self._t1) + len(self._t2) + len(self._held), 1)
        while len(ghosts) > limit:
            ghosts.popitem(last=False)

    def first(self) -> int | None:
        # candidates()'s first step without its generator.
        t1, t2 = self._t1, self._t2
        if len(t1) > max(self._p, 1.0) or not t2:
            return next(iter(t1), None) if t1 else next(iter(t2), None)
        return next(iter(t2))

    def candidates(self) -> Iterator[int]:
        first, second = (self._t1, self._t2) if len(self._t1) > max(self._p, 1.0) or not self._t2 else (self._t2, self._t1)
        for order in (first, second):  # iterated lazily: the store does not mutate us meanwhile
            yield from order
