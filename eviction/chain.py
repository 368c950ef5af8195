"""Chain-aware LRU, the default: least recently used, with one exception on the last tier for
long chains that loop through a cache too small for them (taken only while an ongoing
comparison with LRU says it pays), and a segmented LRU on the upper tiers.

Agentic and chat sessions re-send their whole growing context: the next request of a session
re-reads its previous chain and adds a little. The store touches a hit prefix deepest first, so
under LRU a chain leaves from its tail, and the chain idle longest leaves first. When a few long
chains take turns through a cache that holds only some of them, the chain idle longest is the
one about to come back (its next request is due), and LRU evicts each chain's tail just before
it is read again: the loop that makes LRU lose to Belady on such traffic.

**The exception (last tier).** Each resident block remembers when its chain was last touched
and the chain's typical gap between requests (a running geometric mean of the gaps the chain has
shown; the median recent gap of all chains before it has shown one). When LRU's victim is
*young* (idle for less than ``patience`` times its typical gap, so its next request is probably
still to come soon) and belongs to a *long* chain (its depth is at least ``1/chains`` of the
blocks resident, so the tier holds only a few such chains), the alternative victim is the leaf
expected back last: the largest ``last touch + typical gap``, leaving out the chain being
served now. Its chain then leaves from its tail, as under LRU. Everywhere else the order is
LRU's, and a make-room takes the first offer as under LRU (no walk past protected blocks).

**Never below LRU, by comparison rather than by hope.** Whenever the two rules would pick
different victims, the pair is remembered (a block id while resident, its hash once evicted,
because the index recycles ids) and settled by which of the two blocks is read again first:
LRU's pick first means the exception was right, the alternative's first that LRU was. A decayed
score of these outcomes decides, at each eviction, whether the exception is taken; it starts at
zero, so the policy is plain LRU until the evidence says otherwise, and pairs are made whichever
rule runs, so it can switch either way. Where no chain is long (chat traffic whose conversations
are short beside the cache) no pair is ever made and the last tier is LRU exactly.

**Upper tiers: a segmented LRU.** Blocks read at least once (the hit prefix of a later request,
or promoted by a hit) keep up to ``protected`` of the tier in their own LRU list; blocks never
read, and read ones pushed out of that share, form the other list, which goes down first. A
conversation's shared prefixes and continued turns then stay in DRAM ahead of one-off requests,
in O(1) per event (``protected = 0``: plain LRU). Once ``settle`` blocks have left the tier (a
store with traffic to speak of), two kinds of block of a short chain join the unread ones at
their old end, so that they go down first: a block never read that enters with no cached child
(a put's tail, often a request's partial last block, rarely read again), and a block read just
once that the protected share pushes out (a conversation turn read by the next turn and not
since), the second only while such blocks come back to the tier less often than unread blocks
that have children. A block at depth ``1/short`` of the tier's blocks or deeper keeps the
segmented LRU's order: long chains (agent sessions) take turns through the cache, and the deep
end of one is read again with the rest of it. Before that (a small store, the scenario tests)
the order is the plain segmented LRU's. With ``tails`` the first rule holds from the start, at
every depth, and the second never.

Costs: one more dictionary entry and one more heap push per event than LRU on the last tier; a
pair is made at most once per change of the two candidates and resolved with one hash look-up
per insert while a pair waits for an evicted block.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from eviction.lru import LRUPolicy
from kvstore.errors import ConfigError

_COMPACT_SLACK = 1024
_RECENT_GAPS = 256
"""Gaps between requests remembered for the typical gap of a chain that has shown none."""
_ASIDE = 16
"""Leaves passed over at most when looking for the one expected back last."""
_U, _V = 0, 1
"""The sides of a comparison: LRU's victim and the alternative's."""


@dataclass(frozen=True, slots=True)
class ChainConfig:
    chains: float = 32.0
    """A chain is long when its depth is at least ``1/chains`` of the tier's resident blocks
    (the tier then holds about ``chains`` such chains or fewer)."""
    patience: float = 0.5
    """LRU's victim is young while idle for less than ``patience`` x its typical gap."""
    memory: float = 0.98
    """Weight the score keeps at each settled comparison."""
    pending: int = 256
    """Comparisons waiting to be settled, at most (the oldest is dropped)."""
    protected: float = 0.5
    """Upper tiers: the share of the tier that blocks read at least once may keep from blocks
    never read (a segmented LRU); 0: plain LRU."""
    tails: bool = False
    """Upper tiers: a block never read that enters with no cached child (the tail of a put:
    often a request's partial last block, rarely read again) joins the unread ones at their old
    end instead of their young end, from the start and at every depth (``settle`` is then not
    used)."""
    settle: int = 4096
    """Upper tiers: once this many blocks have left the tier, put tails (as ``tails``) and,
    while they come back less than unread inner blocks, blocks read once that the protected
    share pushes out join the unread ones at their old end, if shallower than ``short`` allows;
    0: from the start; negative: never."""
    short: float = 64.0
    """Upper tiers: the ``settle`` rules leave alone a block whose depth is at least
    ``1/short`` of the tier's resident blocks (a long chain's); 0: no block is left alone."""
    adapt: bool = True
    """False: take the exception wherever it applies, without the comparison (for analysis)."""

    def __post_init__(self) -> None:
        for ok, rule, value in (
            (self.chains > 0, "chains must be > 0", self.chains),
            (self.patience > 0, "patience must be > 0", self.patience),
            (0.0 < self.memory <= 1.0, "memory must be in (0, 1]", self.memory),
            (self.pending >= 1, "pending must be >= 1", self.pending),
            (self.short >= 0, "short must be >= 0", self.short),
        ):
            if not ok:
                raise ConfigError(f"{rule}, got {value}")


class ChainPolicy(LRUPolicy):
    """LRU with the long-chain loop exception; see the module docstring."""

    name = "chain"
    Config = ChainConfig

    def __init__(self, config: ChainConfig | None = None) -> None:
        super().__init__()
        self.config = config or ChainConfig()
        self._read: OrderedDict[int, None] = OrderedDict()  # upper tier: blocks read here, LRU first
        self._left = 0  # upper tier: blocks that have left it, counted up to ``settle``
        self._settled = self.config.settle == 0 and not self.config.tails
        self._tails = self.config.tails or self._settled
        # Blocks read once pushed out of the share, and unread inner blocks, lately moved down
        # (hash -> which); how many of each came back, decayed: the once rule holds while
        # the first come back less.
        self._gone: tuple[OrderedDict[bytes, None], OrderedDict[bytes, None]] = (OrderedDict(), OrderedDict())
        self._back_n = [0.0, 0.0]
        self._when: dict[int, tuple[float, float, int]] = {}  # last tier: (last touch, typical gap, depth)
        self._back: list[tuple[float, int, int]] = []  # (-(expected return), stamp, bid), lazily
        self._fresh: list[tuple[int, int]] = []  # (bid, stamp) offered at the latest time
        self._now = -math.inf  # the latest event time seen
        self._gap_at = math.nan  # the time of the touch that measured _gap (one per request)
        self._gap = -1.0
        self._gaps: list[float] = []
        self._typical = -1.0
        self._score = 0.0
        # Comparisons: pair id -> [LRU's block, the alternative's], each a block id (resident)
        # or a hash (evicted); where each side waits, by id and by hash.
        self._pairs: OrderedDict[int, list[int | bytes]] = OrderedDict()
        self._by_id: dict[int, tuple[int, int]] = {}
        self._by_hash: dict[bytes, tuple[int, int]] = {}
        self._next_pair = 0
        self._last_pair: tuple[int, int] | None = None
        self.deviations = 0
        """Evictions that took the alternative's victim (for analysis)."""

    # ---- events -----------------------------------------------------------------------------

    def _expected(self, bid: int) -> float:
        t, g, _ = self._when[bid]
        return t + (g if g > 0 else max(self._typical, 0.0))

    def _push_back(self, bid: int) -> None:
        """``bid`` (offered) joins the leaves ranked by expected return if its chain is long; a
        block touched at the latest time waits until time moves on (the chain being served is
        no alternative)."""
        if not self._long(bid):
            return
        if self._when[bid][0] >= self._now:
            self._fresh.append((bid, self._stamp[bid]))
        else:
            heapq.heappush(self._back, (-self._expected(bid), self._stamp[bid], bid))

    def _advance(self, now: float) -> None:
        if now <= self._now:
            return
        self._now = now
        fresh, stamp, held, back = self._fresh, self._stamp, self._held, self._back
        for bid, s in fresh:
            if stamp.get(bid) == s and bid not in held:
                heapq.heappush(back, (-self._expected(bid), s, bid))
        fresh.clear()

    def _learn_gap(self, gap: float) -> None:
        gaps = self._gaps
        gaps.append(gap)
        if len(gaps) >= 2 * _RECENT_GAPS:
            del gaps[:_RECENT_GAPS]
        if len(gaps) % 32 == 1:
            self._typical = float(np.median(gaps[-_RECENT_GAPS:]))

    def insert(self, bid: int, size: int, now: float) -> None:
        if not self._leaf_mode:
            self._enter(bid)
            return
        super().insert(bid, size, now)
        self._advance(now)
        depth = int(self._view.depth[bid]) if self._view is not None else 0
        self._when[bid] = (now, self._gap if now == self._gap_at else -1.0, depth)
        if self._by_hash:
            self._returned_hash(bid)
        if bid not in self._held:
            self._push_back(bid)

    def insert_many(self, ids: np.ndarray, sizes: np.ndarray, now: np.ndarray | float) -> None:
        if not self._leaf_mode:
            arr = np.asarray(ids, np.int64)
            view, order, read = self._view, self._order, self._read
            share = self.config.protected
            was_read = view.hits[arr].tolist() if view is not None and share > 0 else [0] * arr.size
            tails = self._tails and view is not None
            if self._settled:
                for bid in arr.tolist():
                    self._came_back(bid)
            young = (view.children[arr] != 0).tolist() if tails else [True] * arr.size  # type: ignore[union-attr]
            if tails and self._settled:  # a long chain's tail: the young end
                resident = len(order) + len(read) + arr.size
                young = [y or self._long_chain(d, resident) for y, d in zip(young, view.depth[arr].tolist(), strict=True)]  # type: ignore[union-attr]
            for bid, hit, y in zip(arr.tolist(), was_read, young, strict=True):
                if hit or bid in read:
                    order.pop(bid, None)
                    self._protect(bid)
                else:  # (as _enter: the young end of the unread ones, or a tail at the old end)
                    order[bid] = None
                    order.move_to_end(bid, last=y)
            return
        super().insert_many(ids, sizes, now)
        order = np.asarray(ids).tolist()
        nows = np.broadcast_to(np.asarray(now, np.float64), (len(order),)).tolist()
        if nows:
            self._advance(max(nows))
        when, held, by_hash = self._when, self._held, self._by_hash
        depths = self._view.depth[np.asarray(ids, np.int64)].tolist() if self._view is not None else [0] * len(order)
        for bid, t, depth in zip(order, nows, depths, strict=True):
            when[bid] = (t, self._gap if t == self._gap_at else -1.0, depth)
            if by_hash:
                self._returned_hash(bid)
            if bid not in held:
                self._push_back(bid)

    def touch(self, bid: int, now: float) -> None:
        self.touch_many([bid], now)

    def touch_many(self, bids: list[int], now: float) -> None:
        if not self._leaf_mode:
            # Every touched block to the young end of the read ones, then the read ones over
            # their share back to the unread, oldest first: the same lists as trimming after
            # each touch (a block trimmed and touched again later in the batch ends read, in
            # the same place), with no trim per block when a long prefix passes the share.
            order, read = self._order, self._read
            touched = False
            for bid in bids:
                if bid in read:
                    read.move_to_end(bid)
                elif bid in order:
                    del order[bid]
                    read[bid] = None
                else:
                    continue
                touched = True
            if touched:
                self._trim()
            return
        stamp, when = self._stamp, self._when
        live = [bid for bid in bids if bid in stamp]
        if not live:
            return
        if now != self._gap_at:
            # The first touch of a request is its deepest hit block: the chain's gap since
            # its last request, folded into the chain's typical gap (a geometric mean).
            t, g, _ = when[live[0]]
            gap = now - t
            if gap > 0:
                self._learn_gap(gap)
                self._gap = gap if g <= 0 else math.sqrt(gap * g)
            else:
                self._gap = g
            self._gap_at = now
        self._advance(now)
        gap = self._gap
        when.update({bid: (now, gap, when[bid][2]) for bid in live})
        if self._by_id:
            by_id = self._by_id
            for bid in live:
                if bid in by_id:
                    self._settle(*by_id.pop(bid))
        self._restamp(live)
        held = self._held
        for bid in live:
            if bid not in held:
                self._push_back(bid)
        if len(self._back) > 2 * len(stamp) + _COMPACT_SLACK:
            self._compact_back()

    def remove(self, bid: int) -> None:
        if not self._leaf_mode:
            if self._settled and bid in self._order and self._view is not None:
                view = self._view
                h = int(view.hits[bid])
                side = 0 if h == 1 else 1 if h == 0 and view.children[bid] else -1
                key = self._hash(bid) if side >= 0 else None
                if key is not None:
                    gone = self._gone[side]
                    gone[key] = None
                    if len(gone) > max(1, (len(self._order) + len(self._read)) // 10):
                        gone.popitem(last=False)
            resident = self._order.pop(bid, 0) is None or self._read.pop(bid, 0) is None
            if resident and not self._settled and not self.config.tails:
                self._left += 1
                if self._left == self.config.settle:
                    self._settled = self._tails = True
            return
        if bid in self._by_id:
            pid, side = self._by_id.pop(bid)
            key = self._hash(bid)
            if key is not None and pid in self._pairs:
                self._pairs[pid][side] = key
                self._by_hash[key] = (pid, side)
            else:
                self._drop_pair(pid)
        super().remove(bid)
        if self._leaf_mode:
            self._when.pop(bid, None)

    def offer(self, bid: int) -> None:
        was_held = self._leaf_mode and bid in self._held
        super().offer(bid)
        if was_held:
            self._push_back(bid)

    # ---- upper tiers: a segmented LRU ------------------------------------------------------------

    def _long_chain(self, depth: int, resident: int) -> bool:
        """Upper tiers: whether a block at ``depth`` belongs to a long chain, at ``1/short`` of
        the tier's ``resident`` blocks or deeper: the ``settle`` rules leave it alone (the last
        tier's own test is :meth:`_long`)."""
        short = self.config.short
        return short > 0 and depth * short >= resident

    def _came_back(self, bid: int) -> None:
        key = self._hash(bid)
        for side in (0, 1):
            if key is not None and self._gone[side].pop(key, 0) is None:
                n = self._back_n
                n[0] *= 0.999
                n[1] *= 0.999
                n[side] += 1.0

    def _enter(self, bid: int) -> None:
        """A block stored here: with the read ones if it was ever read (a promotion), else at
        the young end of the unread ones."""
        view = self._view
        if self._settled:
            self._came_back(bid)
        if bid in self._read or (view is not None and self.config.protected > 0 and view.hits[bid]):
            self._order.pop(bid, None)
            self._protect(bid)
        else:
            order = self._order
            order[bid] = None
            tail = self._tails and view is not None and not view.children[bid]
            if tail and self._settled:  # a long chain's tail: the young end
                tail = not self._long_chain(int(view.depth[bid]), len(order) + len(self._read))  # type: ignore[union-attr]
            order.move_to_end(bid, last=not tail)

    def _protect(self, bid: int) -> None:
        read = self._read
        read[bid] = None
        read.move_to_end(bid)
        self._trim()

    def _trim(self) -> None:
        read, order = self._read, self._order
        limit = self.config.protected * (len(read) + len(order))
        n, view = self._back_n, self._view
        once = self._settled and view is not None and n[0] < n[1]
        resident = len(read) + len(order)
        while len(read) > limit and read:
            old, _ = read.popitem(last=False)  # the least recently read joins the unread
            order[old] = None
            if once and view.hits[old] <= 1 and not self._long_chain(int(view.depth[old]), resident):  # type: ignore[union-attr]
                order.move_to_end(old, last=False)  # read once and not since: it goes first

    def _compact_back(self) -> None:
        stamp, held = self._stamp, self._held
        self._back = [e for e in self._back if stamp.get(e[2]) == e[1] and e[2] not in held]
        heapq.heapify(self._back)

    # ---- the comparison -----------------------------------------------------------------------

    def _returned_hash(self, bid: int) -> None:
        """``bid`` entered the tier: if it is an evicted side of a comparison, it came back."""
        key = self._hash(bid)
        hit = self._by_hash.pop(key, None) if key is not None else None
        if hit is not None:
            self._settle(*hit)

    def _hash(self, bid: int) -> bytes | None:
        try:
            return self._view.hash_of(bid) if self._view is not None else None
        except (KeyError, IndexError):  # not live in the index: nothing to follow
            return None

    def _settle(self, pid: int, side: int) -> None:
        """Side ``side`` of comparison ``pid`` was read first."""
        if pid not in self._pairs:
            return
        self._drop_pair(pid)
        # LRU's pick read first: evicting it was the worse choice, the exception was right.
        self._score = self._score * self.config.memory + (1.0 if side == _U else -1.0)

    def _drop_pair(self, pid: int) -> None:
        sides = self._pairs.pop(pid, None)
        if sides is None:
            return
        for where in sides:
            if isinstance(where, bytes):
                self._by_hash.pop(where, None)
            else:
                self._by_id.pop(where, None)

    def _compare(self, u: int, v: int) -> None:
        if self._last_pair == (u, v) or u in self._by_id or v in self._by_id:
            return
        self._last_pair = (u, v)
        if len(self._pairs) >= self.config.pending:
            self._drop_pair(next(iter(self._pairs)))
        pid = self._next_pair
        self._next_pair += 1
        self._pairs[pid] = [u, v]
        self._by_id[u] = (pid, _U)
        self._by_id[v] = (pid, _V)

    # ---- choosing ---------------------------------------------------------------------------------

    def _long(self, bid: int) -> bool:
        return (self._when[bid][2] + 1) * self.config.chains >= len(self._stamp)

    def _alternative(self, u: int) -> int | None:
        """The leaf expected back last, where the exception applies to LRU's victim ``u``."""
        t, g, _ = self._when[u]
        g = g if g > 0 else self._typical
        if g <= 0 or self._now - t >= self.config.patience * g or not self._long(u):
            return None
        heap, stamp, held, when, now = self._back, self._stamp, self._held, self._when, self._now
        aside: list[tuple[float, int, int]] = []
        v = None
        while heap:
            _, s, bid = heap[0]
            if stamp.get(bid) != s or bid in held:
                heapq.heappop(heap)  # stale
            elif when[bid][0] >= now or not self._long(bid):
                # A short chain (or one touched now): the next leaf expected back last.
                aside.append(heapq.heappop(heap))
                if len(aside) >= _ASIDE:
                    break
            else:
                v = bid
                break
        for e in aside:
            heapq.heappush(heap, e)
        return None if v == u else v

    def first(self) -> int | None:
        if not self._leaf_mode:
            return next(iter(self._order), None) if self._order else next(iter(self._read), None)
        u = super().first()
        if u is None:
            return u
        v = self._alternative(u)
        if v is None:
            return u
        self._compare(u, v)
        if self.config.adapt and self._score <= 0:
            return u
        self.deviations += 1
        return v

    def candidates(self) -> Iterator[int]:
        if not self._leaf_mode:
            return itertools.chain(iter(self._order), iter(self._read))
        return self._chain_candidates()

    def __len__(self) -> int:
        return len(self._stamp) if self._leaf_mode else len(self._order) + len(self._read)

    def _chain_candidates(self) -> Iterator[int]:
        top = self.first()
        if top is None:
            return
        yield top
        for bid in self._leaves():
            if bid != top:
                yield bid

    @property
    def score(self) -> float:
        """The comparison's decayed score: above zero, the exception is taken."""
        return self._score
