"""Hit density learned online (LHD, Beckmann et al., NSDI'18) over prefix chains, on the last tier.

A block's *hit density* is the hits it can still expect per unit of space-time it will still
occupy, given what it is (its class) and how long it has been idle (its age). LHD learns both
from the trace itself: per class, a coarse histogram of the ages at which blocks were hit and
one of the ages at which they left; every ``period`` block events the two give, for each age
bin, the chance of a later hit over the expected remaining lifetime, and old counts decay. The
victim is the offered leaf of lowest density.

**Prefix chains.** The store touches a request's hit prefix at one time and inserts its new
blocks at that time too, so every block a request read or wrote shares one age: a chain ages
as one. A block's state is a shared *stamp* ``(last touch, class)`` (one tuple per request,
not per block), and the offered leaves (the last tier orders leaves only, see
``eviction/base.py``) sit in numpy columns so that a decision ranks all of them at once (or a
sample, past ``sample`` leaves). Once a leaf is chosen its chain leaves from the tail: the
parent that it leaves childless has the same stamp, so :meth:`LHDPolicy.victims` answers the
run in one call, and a make-room never walks protected blocks one at a time.

**Classes** (``classes``): what the store knows when it touches a block: whether the block's
chain has been read again (a put that nobody has read back is a class of its own, split by
whether the block is a tail the chain was never extended past: a request's partial last block
rarely returns), and for a chain read again, the log2 bucket of the idle time it showed before
this read (a session's last gap between requests, as LHD's classes by last reuse distance).

**Never below LRU, by a switch.** A ghost LRU ordering runs beside (the same leaves, ordered
by last touch): each eviction where the two would choose different chains is remembered as a
pair and settled by which of the two is read again first (as in ``eviction/chain.py``); a
decayed score of these outcomes decides whether the learned order or LRU's is taken
(``guard``). Before the first tables, and while a class has too few counts, the order is LRU's.

Upper tiers are LRU (``eviction/lru.py``): the gain sought here is which chains the last tier
keeps.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from eviction.lru import LRUPolicy
from kvstore.errors import ConfigError

_NEW, _NEW_TAIL = 0, 1
"""Classes of blocks not yet read since their put (inner, and a tail with no child)."""
_GAP0 = 2
"""The first class of re-read chains; ``_GAP0 + k`` for the k-th log2 bucket of the last gap."""


@dataclass(frozen=True, slots=True)
class LHDConfig:
    bins_per_octave: int = 2
    """Age bins per doubling of the age (log-spaced)."""
    age0: float = 0.25
    """Ages below this (seconds of the store's clock) share the first bin."""
    bins: int = 64
    """Age bins (the last one is open-ended)."""
    gap_classes: int = 8
    """Log2 buckets (doubling from ``gap0``) of a re-read chain's last idle time."""
    monotone: bool = True
    """Within a class, an older block never ranks above a younger one (densities made
    non-increasing in age): the learned order departs from LRU's only across classes."""
    hit_buckets: int = 5
    """Classes by a block's reads so far: 0, 1, 2-3, 4-7, 8+ (1: one class)."""
    gap0: float = 4.0
    """The first gap bucket's upper edge, seconds."""
    period: int = 1 << 16
    """Block events (hits, inserts, evictions) between two recomputations of the densities."""
    decay: float = 0.9
    """Weight the histograms keep at each recomputation."""
    min_events: float = 64.0
    """A class with fewer (decayed) counts than this is ranked by the pooled histograms."""
    sample: int = 4096
    """Offered leaves ranked at most per decision (a seeded sample past this many)."""
    guard: bool = True
    """Compare each decision with LRU's and take LRU's while the comparison favours it."""
    memory: float = 0.98
    """Weight the guard's score keeps at each settled comparison."""
    threshold: float = 0.0
    """The learned order is taken while the guard's score is above this (LRU's at or below)."""
    pending: int = 256
    """Comparisons waiting to be settled, at most (the oldest is dropped)."""

    def __post_init__(self) -> None:
        for ok, rule, value in (
            (self.bins_per_octave >= 1, "bins_per_octave must be >= 1", self.bins_per_octave),
            (self.age0 > 0, "age0 must be > 0", self.age0),
            (self.bins >= 4, "bins must be >= 4", self.bins),
            (self.gap_classes >= 1, "gap_classes must be >= 1", self.gap_classes),
            (self.hit_buckets >= 1, "hit_buckets must be >= 1", self.hit_buckets),
            (self.gap0 > 0, "gap0 must be > 0", self.gap0),
            (self.period >= 1, "period must be >= 1", self.period),
            (0.0 < self.decay <= 1.0, "decay must be in (0, 1]", self.decay),
            (self.min_events >= 0, "min_events must be >= 0", self.min_events),
            (self.sample >= 1, "sample must be >= 1", self.sample),
            (0.0 < self.memory <= 1.0, "memory must be in (0, 1]", self.memory),
            (self.pending >= 1, "pending must be >= 1", self.pending),
        ):
            if not ok:
                raise ConfigError(f"{rule}, got {value}")


Stamp = tuple[float, int, int]
"""A request's mark on the blocks it touched: (time, class, sequence number)."""


class LHDPolicy(LRUPolicy):
    """Learned hit density over prefix chains on the last tier; LRU above. See the module
    docstring."""

    name = "lhd"
    Config = LHDConfig
    runs = True  # victims(): a chain's tail run, in the order first() would offer it

    def __init__(self, config: LHDConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or LHDConfig()
        self._hb = c.hit_buckets
        self._classes = (_GAP0 + c.gap_classes) * self._hb
        self._hits = np.zeros((self._classes, c.bins))
        self._ends = np.zeros((self._classes, c.bins))
        self._density: np.ndarray | None = None  # (classes, bins), None: LRU order
        self._events = 0
        self._now = -math.inf
        self._seq = 0
        self._mark: dict[int, Stamp] = {}  # last tier: every resident block's stamp
        self._leaf_held: set[int] = set()
        # Offered leaves in columns: slot -> bid, time, class, sequence.
        n = 1024
        self._slot: dict[int, int] = {}
        self._bid = np.zeros(n, np.int64)
        self._time = np.zeros(n, np.float64)
        self._cls = np.zeros(n, np.int64)
        self._order_seq = np.zeros(n, np.int64)
        self._n = 0
        self._rng = np.random.default_rng(0)
        self._scale = c.bins_per_octave / math.log(2.0)
        self._log_age0 = math.log(c.age0)
        self._fresh_last = True
        self._touch_stamp: Stamp | None = None  # the latest touch's stamp (its put joins it)
        # The guard: pairs of (learned pick, LRU pick) by block id, then by hash once evicted.
        self._score = 0.0
        self._pairs: OrderedDict[int, list[int | bytes]] = OrderedDict()
        self._by_id: dict[int, tuple[int, int]] = {}
        self._by_hash: dict[bytes, tuple[int, int]] = {}
        self._next_pair = 0
        self._last_pair: tuple[int, int] | None = None
        self.deviations = 0
        """Decisions that took the learned victim over LRU's (for analysis)."""

    # ---- ages and classes ---------------------------------------------------------------------

    def _bin(self, age: float) -> int:
        if age < self.config.age0:
            return 0
        b = int((math.log(age) - self._log_age0) * self._scale) + 1
        return b if b < self.config.bins else self.config.bins - 1

    def _bins(self, ages: np.ndarray) -> np.ndarray:
        c = self.config
        with np.errstate(divide="ignore", invalid="ignore"):
            b = np.floor((np.log(np.maximum(ages, c.age0)) - self._log_age0) * self._scale) + 1
        b[ages < c.age0] = 0
        return np.clip(b, 0, c.bins - 1).astype(np.int64)

    def _gap_class(self, gap: float) -> int:
        c = self.config
        if gap <= c.gap0:
            return _GAP0
        k = int(math.log2(gap / c.gap0)) + 1
        return _GAP0 + (k if k < c.gap_classes else c.gap_classes - 1)

    def _hit_buckets(self, hits: np.ndarray) -> np.ndarray:
        """log2 buckets of a block's reads: 0, 1, 2-3, 4-7, ... (the last open-ended)."""
        h = np.maximum(hits, 0)
        with np.errstate(divide="ignore"):
            b = np.where(h > 0, np.floor(np.log2(np.maximum(h, 1))) + 1, 0)
        return np.minimum(b, self._hb - 1).astype(np.int64)

    def _full_class(self, bid: int, st: Stamp) -> int:
        """``bid``'s class: its stamp's class and the bucket of its reads so far."""
        if self._hb == 1 or self._view is None:
            return st[1]
        h = int(self._view.hits[bid])
        return st[1] * self._hb + min(h.bit_length(), self._hb - 1)

    def _new_stamp(self, now: float, cls: int) -> Stamp:
        self._seq += 1
        return (now, cls, self._seq)

    # ---- the offered leaves' columns --------------------------------------------------------

    def _add_leaf(self, bid: int, st: Stamp) -> None:
        i = self._slot.get(bid)
        if i is None:
            i = self._n
            if i == self._bid.size:
                grow = 2 * i
                for name in ("_bid", "_time", "_cls", "_order_seq"):
                    old = getattr(self, name)
                    new = np.zeros(grow, old.dtype)
                    new[:i] = old
                    setattr(self, name, new)
            self._n = i + 1
            self._slot[bid] = i
            self._bid[i] = bid
        self._time[i] = st[0]
        self._cls[i] = self._full_class(bid, st)
        self._order_seq[i] = st[2]

    def _drop_leaf(self, bid: int) -> None:
        i = self._slot.pop(bid, None)
        if i is None:
            return
        last = self._n - 1
        if i != last:
            moved = int(self._bid[last])
            self._bid[i] = moved
            self._time[i] = self._time[last]
            self._cls[i] = self._cls[last]
            self._order_seq[i] = self._order_seq[last]
            self._slot[moved] = i
        self._n = last

    # ---- events -------------------------------------------------------------------------------

    def _tick(self, events: int) -> None:
        self._events += events
        if self._events >= self.config.period:
            self._events = 0
            self._recompute()

    def insert(self, bid: int, size: int, now: float) -> None:
        if not self._leaf_mode:
            super().insert(bid, size, now)
            return
        self.insert_many(np.array([bid], np.int64), np.array([size], np.int64), now)

    def insert_many(self, ids: np.ndarray, sizes: np.ndarray, now: np.ndarray | float) -> None:
        if not self._leaf_mode:
            super().insert_many(ids, sizes, now)
            return
        order = np.asarray(ids, np.int64).tolist()
        if not order:
            return
        nows = np.broadcast_to(np.asarray(now, np.float64), (len(order),)).tolist()
        kids = self._view.children[np.asarray(ids, np.int64)].tolist() if self._view is not None else [0] * len(order)
        mark, held = self._mark, self._leaf_held
        ts = self._touch_stamp
        by_hash = self._by_hash
        for bid, t, k in zip(order, nows, kids, strict=True):
            if t > self._now:
                self._now = t
            if bid in mark:
                self._forget(bid)
            # A put read by nobody yet: its own class (a tail apart); it joins the request's
            # touch when the request read a prefix at this time.
            if ts is not None and ts[0] == t and k:
                st = ts
            else:
                st = self._new_stamp(t, _NEW if k else _NEW_TAIL)
            mark[bid] = st
            if k:
                held.add(bid)
            else:
                held.discard(bid)
                self._add_leaf(bid, st)
            if by_hash:
                self._returned_hash(bid)
        self._tick(len(order))

    def touch(self, bid: int, now: float) -> None:
        self.touch_many([bid], now)

    def touch_many(self, bids: list[int], now: float) -> None:
        if not self._leaf_mode:
            super().touch_many(bids, now)
            return
        mark = self._mark
        live = [bid for bid in bids if bid in mark]
        if not live:
            return
        if now > self._now:
            self._now = now
        # The class: the idle time the deepest block showed (the chain's last gap).
        first = mark[live[0]]
        st = self._new_stamp(now, self._gap_class(now - first[0]))
        self._touch_stamp = st
        olds = [mark[bid] for bid in live]
        # Each block was hit at its age, in the class it had (its reads before this one).
        old_t = np.fromiter((o[0] for o in olds), np.float64, len(olds))
        old_c = np.fromiter((o[1] for o in olds), np.int64, len(olds))
        if self._view is not None and self._hb > 1:
            old_c = old_c * self._hb + self._hit_buckets(self._view.hits[np.asarray(live, np.int64)].astype(np.int64) - 1)
        else:
            old_c = old_c * self._hb
        np.add.at(self._hits, (old_c, self._bins(now - old_t)), 1.0)
        held, slot = self._leaf_held, self._slot
        by_id = self._by_id
        for bid in live:
            mark[bid] = st
            if bid in slot and bid not in held:
                self._add_leaf(bid, st)
            if by_id and bid in by_id:
                self._settle(*by_id.pop(bid))
        self._tick(len(live))

    def _forget(self, bid: int) -> None:
        """``bid`` leaves the tier: its lifetime ends at its age now."""
        st = self._mark.pop(bid)
        i = self._slot.get(bid)
        cls = int(self._cls[i]) if i is not None else self._full_class(bid, st)
        self._ends[cls, self._bin(self._now - st[0])] += 1
        self._leaf_held.discard(bid)
        self._drop_leaf(bid)

    def remove(self, bid: int) -> None:
        if not self._leaf_mode:
            super().remove(bid)
            return
        if bid not in self._mark:
            return
        if bid in self._by_id:
            pid, side = self._by_id.pop(bid)
            key = self._hash(bid)
            if key is not None and pid in self._pairs:
                self._pairs[pid][side] = key
                self._by_hash[key] = (pid, side)
            else:
                self._drop_pair(pid)
        self._forget(bid)
        self._tick(1)

    def hold(self, bid: int) -> None:
        if not self._leaf_mode:
            return
        if bid in self._mark:
            self._leaf_held.add(bid)
            self._drop_leaf(bid)

    def offer(self, bid: int) -> None:
        if not self._leaf_mode:
            return
        if bid in self._leaf_held:
            self._leaf_held.discard(bid)
            self._add_leaf(bid, self._mark[bid])

    # ---- learning -----------------------------------------------------------------------------

    def _recompute(self) -> None:
        """Densities per (class, age bin) from the decayed histograms (LHD's reconfiguration)."""
        c = self.config
        edges = c.age0 * np.exp2(np.arange(c.bins) / c.bins_per_octave)  # lower edge of bins 1..
        lo = np.concatenate(([0.0], edges[:-1]))
        width = np.diff(np.concatenate((lo, [lo[-1] * 2.0])))
        hits, ends = self._hits, self._ends
        pooled_h, pooled_e = hits.sum(axis=0), ends.sum(axis=0)
        dens = np.empty_like(hits)
        for k in range(self._classes):
            h, e = hits[k], ends[k]
            if h.sum() + e.sum() < c.min_events:
                h, e = pooled_h, pooled_e
            dens[k] = _density(h, e, width)
            if c.monotone:
                dens[k] = np.minimum.accumulate(dens[k])
        self._density = dens
        hits *= c.decay
        ends *= c.decay

    # ---- choosing -----------------------------------------------------------------------------

    def _keys(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The offered leaves' ranks, lowest first: (density, sequence) in the learned order,
        (sequence) in LRU's; None while LRU's order is taken. A leaf touched at the latest time
        (the request being served) ranks after every other in the learned order."""
        n = self._n
        dens = self._density
        if dens is None or (self.config.guard and self._score <= self.config.threshold):
            return None
        ages = self._now - self._time[:n]
        d = dens[self._cls[:n], self._bins(ages)]
        if self._fresh_last:
            d[ages <= 0] = math.inf
        return d, self._order_seq[:n]

    def _leaf_key(self, bid: int) -> tuple[float, int]:
        st = self._mark[bid]
        age = self._now - st[0]
        if self._density is None or (self.config.guard and self._score <= self.config.threshold):
            return (0.0, st[2])
        d = math.inf if age <= 0 and self._fresh_last else float(self._density[self._full_class(bid, st), self._bin(age)])
        return (d, st[2])

    def _guard_pair(self) -> None:
        """Remember where the learned order and LRU's would choose differently."""
        n = self._n
        if not self.config.guard or self._density is None or n == 0:
            return
        seq = self._order_seq[:n]
        lru = int(np.argmin(seq))
        ages = self._now - self._time[:n]
        d = self._density[self._cls[:n], self._bins(ages)]
        if self._fresh_last:
            d[ages <= 0] = math.inf
        low = np.flatnonzero(d == d.min())
        learned = int(low[np.argmin(seq[low])])
        if learned != lru:
            self._compare(int(self._bid[learned]), int(self._bid[lru]))

    def first(self) -> int | None:
        if not self._leaf_mode:
            return super().first()
        out = self.victims(1)
        return out[0] if out else None

    def victims(self, n: int) -> list[int]:
        if not self._leaf_mode:
            return super().victims(n)
        if self._n == 0 or n <= 0:
            return []
        self._guard_pair()
        keys = self._keys()
        m = self._n
        seq = self._order_seq[:m]
        if keys is None:
            k = min(n, m)
            top = np.argpartition(seq, k - 1)[:k] if k < m else np.arange(m)
            order = top[np.argsort(seq[top], kind="stable")]
            key_of: list[tuple[float, int]] = [(0.0, int(s)) for s in seq[order].tolist()]
        else:
            d, _ = keys
            k = min(n, m)
            if k < m:
                # The k lowest by (density, sequence): all below the k-th density, and ties.
                kth = np.partition(d, k - 1)[k - 1]
                top = np.flatnonzero(d <= kth)
            else:
                top = np.arange(m)
            order = top[np.lexsort((seq[top], d[top]))][:k]
            key_of = list(zip(d[order].tolist(), seq[order].tolist(), strict=True))
        if keys is not None and self._density is not None:
            self.deviations += 1
        bids = self._bid[order].tolist()
        view = self._view
        if view is None:
            return bids[:n]
        # Merge the ranked leaves with the parents the run leaves childless (each offered at
        # its own rank, as first() would see it after each removal).
        out: list[int] = []
        side: list[tuple[float, int, int]] = []
        left: dict[int, int] = {}
        mark, held = self._mark, self._leaf_held
        i = 0
        while len(out) < n:
            if side and (i >= len(bids) or (side[0][0], side[0][1]) < key_of[i]):
                bid = heapq.heappop(side)[2]
            elif i < len(bids):
                bid = bids[i]
                i += 1
            else:
                break
            out.append(bid)
            p = int(view.parent[bid])
            if p >= 0 and p in mark:
                kids = left.get(p, int(view.children[p])) - 1
                left[p] = kids
                if kids == 0 and p in held:
                    dk, sk = self._leaf_key(p)
                    heapq.heappush(side, (dk, sk, p))
        return out

    def candidates(self) -> Iterator[int]:
        if not self._leaf_mode:
            return super().candidates()
        return self._ranked()

    def _ranked(self) -> Iterator[int]:
        n = self._n
        if n == 0:
            return
        self._guard_pair()
        keys = self._keys()
        bids = self._bid[:n].copy()
        seq = self._order_seq[:n]
        order = np.argsort(seq, kind="stable") if keys is None else np.lexsort((seq, keys[0]))
        for i in order.tolist():
            bid = int(bids[i])
            if bid in self._slot:
                yield bid

    def __len__(self) -> int:
        return len(self._mark) if self._leaf_mode else super().__len__()

    # ---- the guard ----------------------------------------------------------------------------

    def _hash(self, bid: int) -> bytes | None:
        try:
            return self._view.hash_of(bid) if self._view is not None else None
        except (KeyError, IndexError):
            return None

    def _returned_hash(self, bid: int) -> None:
        key = self._hash(bid)
        hit = self._by_hash.pop(key, None) if key is not None else None
        if hit is not None:
            self._settle(*hit)

    def _settle(self, pid: int, side: int) -> None:
        """Side ``side`` (0: the learned pick, 1: LRU's) of comparison ``pid`` was read first."""
        if pid not in self._pairs:
            return
        self._drop_pair(pid)
        # The learned pick read first: evicting it was the worse choice.
        self._score = self._score * self.config.memory + (-1.0 if side == 0 else 1.0)

    def _drop_pair(self, pid: int) -> None:
        sides = self._pairs.pop(pid, None)
        if sides is None:
            return
        for where in sides:
            if isinstance(where, bytes):
                self._by_hash.pop(where, None)
            else:
                self._by_id.pop(where, None)

    def _compare(self, learned: int, lru: int) -> None:
        if self._last_pair == (learned, lru) or learned in self._by_id or lru in self._by_id:
            return
        self._last_pair = (learned, lru)
        if len(self._pairs) >= self.config.pending:
            self._drop_pair(next(iter(self._pairs)))
        pid = self._next_pair
        self._next_pair += 1
        self._pairs[pid] = [learned, lru]
        self._by_id[learned] = (pid, 0)
        self._by_id[lru] = (pid, 1)

    @property
    def score(self) -> float:
        """The guard's decayed score: at or above zero, the learned order is taken."""
        return self._score


def _density(hits: np.ndarray, ends: np.ndarray, width: np.ndarray) -> np.ndarray:
    """Hit density per age bin: expected hits after reaching the bin over the expected
    remaining lifetime (LHD), from per-bin counts of hits and of other ends of lifetime. A
    block that reaches an age no block has reached is worth nothing."""
    events = hits + ends
    hits_above = np.cumsum(hits[::-1])[::-1]
    alive = np.cumsum(events[::-1])[::-1]  # blocks that reach each bin
    # Within a bin, a block that ends there lived half of it; one that passes, all of it.
    passing = np.concatenate((alive[1:], [0.0]))
    life = (passing + 0.5 * events) * width
    life_above = np.cumsum(life[::-1])[::-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        dens = np.where(life_above > 0, hits_above / life_above, 0.0)
    return dens
