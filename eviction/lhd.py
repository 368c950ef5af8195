"""Hit density learned online (LHD, Beckmann et al., NSDI'18) over prefix chains, on the last tier.

A block's *hit density* is the hits it can still expect per unit of space-time it will still
occupy, given what it is (its class) and how long it has been idle (its age). LHD learns both
from the trace itself: per class, a coarse histogram of the ages at which blocks were hit and
one of the ages at which they left; every ``period`` block events the two give, for each
(class, age bin), the chance of a later hit over the expected remaining lifetime, and old
counts decay. The victim is the offered leaf of lowest density.

**Prefix chains.** The store touches a request's hit prefix at one time and inserts its new
blocks at that time too, so every block a request read or wrote shares one age: a chain ages
as one. A block's state is a shared *stamp* (one tuple per request and class, not per block),
and the offered leaves (the last tier orders leaves only, see ``eviction/base.py``) sit in
numpy columns. After a touch or a put they are ranked again in one vectorised pass (the lowest
``_RANKED`` sorted, the rest when those are taken), and the order is kept while the store takes
victims: a removal leaves a stale entry behind, a parent it leaves childless joins a heap at
its own rank, so :meth:`first` is O(log n) amortised and a make-room never walks protected
blocks one at a time. A victim's parent often has the victim's rank and comes next, so the
store takes one victim at a time (the default :meth:`victims`).

Processor time: one ranking per touch or put (numpy over the offered leaves), a few dictionary
operations per event, and for the guard below a hash look-up per eviction and per put block;
1.25-1.4x LRU's replay time on the agentic development set, up to ~1.8x on traces of short
requests, where the per-request ranking dominates (docs/eviction.md).

**Classes** (what the store knows when it touches a block): a put nobody has read back yet,
split by whether the block is a tail the chain was never extended past (a request's partial
last block rarely returns); and for a chain read again, the log2 bucket of its *typical gap*
(a running mean of the log idle times it showed before its reads), as LHD's classes by last
reuse distance. Within a class the densities are made non-increasing in age, so the order
departs from LRU's only across classes.

**Never below LRU, by a shadow.** LRU's hits on the same requests are counted beside the
policy's own: LRU holds the ``capacity`` blocks accessed most recently, so a block read again
is an LRU hit when fewer than ``capacity`` other blocks were accessed since its last access (a
Fenwick tree over the stamps' sequence numbers counts them, per stamp, not per block). A block
that this policy evicted and that comes back is recognised by its hash (a ghost) with its last
access. While the policy's decayed hits fall short of LRU's by more than ``margin`` of the
accesses, it orders by LRU (a deficit then decays, so the learned order is tried again).

Upper tiers are LRU (``eviction/lru.py``): the gain sought here is which chains the last tier
keeps.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from eviction.lru import LRUPolicy
from kvstore.errors import ConfigError

_NEW, _NEW_TAIL = 0, 1
"""Classes of blocks not yet read since their put (inner, and a tail with no child)."""
_RANKED = 64
"""Offered leaves sorted at a time (the lowest; the others wait until these are taken)."""
_GAP0 = 2
"""The first class of re-read chains; ``_GAP0 + k`` for the k-th log2 bucket of the gap."""


@dataclass(frozen=True, slots=True)
class LHDConfig:
    bins_per_octave: int = 2
    """Age bins per doubling of the age (log-spaced)."""
    age0: float = 0.25
    """Ages below this (seconds of the store's clock) share the first bin."""
    bins: int = 64
    """Age bins (the last one is open-ended)."""
    gap_classes: int = 8
    """Log2 buckets (doubling from ``gap0``) of a re-read chain's typical gap."""
    gap0: float = 4.0
    """The first gap bucket's upper edge, seconds."""
    gap_memory: float = 0.5
    """The typical gap: a running mean of log idle times, each new one weighted
    ``1 - gap_memory`` (0: the last idle time alone)."""
    tails: bool = True
    """Unread blocks with no child (a put's tail) form a class apart from the other unread."""
    monotone: bool = True
    """Within a class, an older block never ranks above a younger one (densities made
    non-increasing in age): the learned order departs from LRU's only across classes."""
    period: int = 1 << 16
    """Block events (hits, inserts, evictions) between two recomputations of the densities."""
    decay: float = 0.9
    """Weight the histograms keep at each recomputation."""
    min_events: float = 64.0
    """A class with fewer (decayed) counts than this is ranked by the pooled histograms."""
    guard: bool = True
    """Count LRU's hits beside the policy's and order by LRU while the policy trails."""
    margin: float = 0.0005
    """The shortfall of the policy's hits behind LRU's, as a share of the accesses, past which
    the guard orders by LRU."""
    window: float = 256.0
    """The guard's memory: its sums decay by ``1/e`` every ``window`` x resident block
    accesses."""
    retry: float = 32.0
    """While the guard orders by LRU, the shortfall that switched it fades by ``1/e`` every
    ``retry`` x resident block accesses (0: only at ``window``'s pace)."""
    ghost_factor: float = 2.0
    """Evicted blocks remembered by hash for the guard, up to this many times the resident
    ones."""

    def __post_init__(self) -> None:
        for ok, rule, value in (
            (self.bins_per_octave >= 1, "bins_per_octave must be >= 1", self.bins_per_octave),
            (self.age0 > 0, "age0 must be > 0", self.age0),
            (self.bins >= 4, "bins must be >= 4", self.bins),
            (self.gap_classes >= 1, "gap_classes must be >= 1", self.gap_classes),
            (self.gap0 > 0, "gap0 must be > 0", self.gap0),
            (0.0 <= self.gap_memory < 1.0, "gap_memory must be in [0, 1)", self.gap_memory),
            (self.period >= 1, "period must be >= 1", self.period),
            (0.0 < self.decay <= 1.0, "decay must be in (0, 1]", self.decay),
            (self.min_events >= 0, "min_events must be >= 0", self.min_events),
            (self.margin >= 0, "margin must be >= 0", self.margin),
            (self.window > 0, "window must be > 0", self.window),
            (self.retry >= 0, "retry must be >= 0", self.retry),
            (self.ghost_factor >= 0, "ghost_factor must be >= 0", self.ghost_factor),
        ):
            if not ok:
                raise ConfigError(f"{rule}, got {value}")


Stamp = tuple[float, int, int, float]
"""A request's mark on the blocks it touched or put: (time, class, sequence number, the
chain's mean log idle time between reads, NaN before its first read)."""


class LRUShadow:
    """How many of a group of blocks LRU would still hold when they are accessed again.

    Counts the blocks whose last access carries each stamp sequence number (a Fenwick tree over
    sequence numbers, counts kept per stamp, not per block); LRU with room for ``capacity``
    blocks holds the ``capacity`` most recently accessed, so of ``n`` blocks last accessed at
    stamp ``s`` it holds those among the first ``capacity`` counted from the newest. Sequence
    numbers too old to matter are dropped when the tree is rebuilt.
    """

    def __init__(self, size: int = 1 << 12) -> None:
        self._base = 0
        self._tree = [0] * (size + 1)
        self._counts: dict[int, int] = {}
        self.total = 0

    def _add(self, seq: int, n: int) -> None:
        i = seq - self._base + 1
        tree = self._tree
        size = len(tree) - 1
        while i <= size:
            tree[i] += n
            i += i & -i

    def _prefix(self, seq: int) -> int:
        """Blocks at sequence numbers ``<= seq``."""
        i = seq - self._base + 1
        tree, s = self._tree, 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    def _room(self, seq: int, capacity: int) -> None:
        size = len(self._tree) - 1
        if seq - self._base < size:
            return
        counts = self._counts
        if len(counts) * 4 < size:
            # Mostly old, empty numbers: drop those whose blocks are beyond any capacity.
            keep = sorted(counts)
            above = 0
            base = keep[0] if keep else seq
            for s in reversed(keep):
                above += counts[s]
                if above > 4 * capacity:
                    base = s
                    break
            for s in keep:
                if s >= base:
                    break
                self.total -= counts.pop(s)
            self._base = base
        while seq - self._base >= size:
            size *= 2
        self._tree = [0] * (size + 1)
        for s, n in counts.items():
            self._add(s, n)

    def access(self, old: int, new: int, n: int, capacity: int) -> int:
        """``n`` blocks last accessed at stamp ``old`` (-1: never, or forgotten) are accessed at
        stamp ``new``; returns how many of them LRU would have held."""
        self._room(new, capacity)
        held = 0
        counts = self._counts
        if old >= self._base and counts.get(old, 0) > 0:
            n_old = counts[old]
            above = self.total - self._prefix(old)
            # The old stamp's blocks: the most recent of them were accessed last in the stamp.
            held = max(0, min(n, n_old, capacity - above))
            moved = min(n, n_old)
            counts[old] = n_old - moved
            if not counts[old]:
                del counts[old]
            self._add(old, -moved)
            self.total -= moved
        counts[new] = counts.get(new, 0) + n
        self._add(new, n)
        self.total += n
        return held


class LHDPolicy(LRUPolicy):
    """Learned hit density over prefix chains on the last tier; LRU above. See the module
    docstring."""

    name = "lhd"
    Config = LHDConfig
    # runs = False (the default victims()): a victim's parent often comes next, so the store
    # takes first() per victim, from a kept order (O(log n) each).

    def __init__(self, config: LHDConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or LHDConfig()
        self._classes = _GAP0 + c.gap_classes
        self._hits = np.zeros((self._classes, c.bins))
        self._ends = np.zeros((self._classes, c.bins))
        self._density: np.ndarray | None = None  # (classes, bins); None: LRU order
        self._events = 0
        self._now = -math.inf
        self._stamps = 0
        self._mark: dict[int, Stamp] = {}  # last tier: every resident block's stamp
        self._leaf_held: set[int] = set()
        # The offered leaves in columns (slot -> bid, time, class, sequence), swap-removed.
        n = 1024
        self._slot: dict[int, int] = {}
        self._bid = np.zeros(n, np.int64)
        self._time = np.zeros(n, np.float64)
        self._cls = np.zeros(n, np.int64)
        self._seqs = np.zeros(n, np.int64)
        self._seq_l: list[int] = []  # the sequence column as a list (read per victim)
        self._n = 0
        # Age bins: bin 0 below age0, then bins_per_octave per doubling; the last open-ended.
        self._edges = c.age0 * np.exp2(np.arange(c.bins - 1) / c.bins_per_octave)
        self._edges_l: list[float] = self._edges.tolist()
        self._touch_stamp: Stamp | None = None  # the latest touch's stamp (its put joins it)
        # The kept order of the offered leaves (see _rank), and the rank of the latest stamp.
        self._ranked_ok = False
        self._key_seq = -1
        self._key_last: tuple[float, int] = (0.0, -1)
        # Ends of lifetimes not yet counted: a run of evictions of one stamp, counted at once.
        self._end_stamp: Stamp | None = None
        self._end_count = 0
        self._ghost_cap = 64
        self._order_bids: list[int] = []
        self._order_d: list[float] = []  # the kept order's densities ...
        self._order_seq: list[int] = []  # ... and sequence numbers
        self._order_at = 0
        self._order_all = True
        self._side: list[tuple[float, int, int]] = []
        # The guard.
        self._shadow = LRUShadow()
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()  # hash -> last access's sequence
        self._ghosting = c.guard and c.ghost_factor > 0
        self._capacity = 0  # the most blocks resident so far: LRU's room in the shadow
        self._own = 0.0  # decayed hits of this policy
        self._lru = 0.0  # decayed hits LRU would have had
        self._seen = 0.0  # decayed accesses
        self.lru_mode = False
        """Whether the guard orders by LRU now (for analysis)."""
        self.switches = 0
        """Times the guard changed the order (for analysis)."""

    # ---- ages and classes ---------------------------------------------------------------------

    def _bin(self, age: float) -> int:
        return bisect.bisect_right(self._edges_l, age)

    def _bins(self, ages: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._edges, ages, side="right")

    def _gap_class(self, gap: float) -> int:
        c = self.config
        if gap <= c.gap0:
            return _GAP0
        k = int(math.log2(gap / c.gap0)) + 1
        return _GAP0 + (k if k < c.gap_classes else c.gap_classes - 1)

    def _new_stamp(self, now: float, cls: int, log_gap: float = math.nan) -> Stamp:
        self._stamps += 1
        return (now, cls, self._stamps, log_gap)

    # ---- the offered leaves' columns --------------------------------------------------------

    def _add_leaf(self, bid: int, st: Stamp) -> None:
        i = self._slot.get(bid)
        if i is None:
            i = self._n
            if i == self._bid.size:
                for name in ("_bid", "_time", "_cls", "_seqs"):
                    old = getattr(self, name)
                    new = np.zeros(2 * i, old.dtype)
                    new[:i] = old
                    setattr(self, name, new)
            self._n = i + 1
            self._slot[bid] = i
            self._bid[i] = bid
            self._seq_l.append(st[2])
        else:
            self._seq_l[i] = st[2]
        self._time[i] = st[0]
        self._cls[i] = st[1]
        self._seqs[i] = st[2]

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
            self._seqs[i] = self._seqs[last]
            self._seq_l[i] = self._seq_l[last]
            self._slot[moved] = i
        self._seq_l.pop()
        self._n = last

    # ---- events -------------------------------------------------------------------------------

    def _tick(self, events: int) -> None:
        self._events += events
        if self._events >= self.config.period:
            self._events = 0
            self._recompute()

    def _account(self, own: int, lru: int, seen: int) -> None:
        """The guard's sums after ``seen`` accesses, ``own`` of them hits here and ``lru`` hits
        under LRU."""
        w = math.exp(-seen / (self.config.window * max(self._capacity, 1)))
        self._own = self._own * w + own
        self._lru = self._lru * w + lru
        self._seen = self._seen * w + seen
        if self.lru_mode and self.config.retry > 0:
            # Ordered by LRU, both counts grow alike and tell nothing new: the shortfall that
            # switched fades faster, so the learned order is tried again.
            fade = math.exp(-seen / (self.config.retry * max(self._capacity, 1)))
            self._own = self._lru + (self._own - self._lru) * fade
        trails = self._own < self._lru - self.config.margin * self._seen
        if trails != self.lru_mode:
            self.lru_mode = trails
            self.switches += 1
            self._invalidate()

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
        self._flush_ends()
        nows = np.broadcast_to(np.asarray(now, np.float64), (len(order),)).tolist()
        view = self._view
        kids = view.children[np.asarray(ids, np.int64)].tolist() if view is not None else [0] * len(order)
        mark, held = self._mark, self._leaf_held
        ts = self._touch_stamp
        ghosts = self._ghosts if self.config.guard else None
        shadow = self._shadow
        lru_hits = 0
        self._moved()
        stamps: dict[tuple[float, int], Stamp] = {}  # one stamp per time and class of this put
        moves: list[tuple[int, int]] = []  # (last access's stamp or -1, this one's) per block
        for bid, t, k in zip(order, nows, kids, strict=True):
            if t > self._now:
                self._now = t
                self._key_seq = -1
            if bid in mark:
                self._forget(bid, count=False)
            if ts is not None and ts[0] == t and k:
                st = ts  # the put of the request that read a prefix at this time joins its touch
            else:
                cls = _NEW if k or not self.config.tails else _NEW_TAIL
                st = stamps.get((t, cls)) or stamps.setdefault((t, cls), self._new_stamp(t, cls))
            mark[bid] = st
            if k:
                held.add(bid)
            else:
                held.discard(bid)
                self._offered(bid)
            if ghosts is not None:
                old = -1
                if ghosts:
                    key = self._hash(bid)
                    old = ghosts.pop(key, -1) if key is not None else -1
                moves.append((old, st[2]))
        if len(mark) > self._capacity:
            self._capacity = len(mark)
            self._ghost_cap = int(self.config.ghost_factor * self._capacity) + 64
        if ghosts is not None:
            for (old, new), group in itertools.groupby(moves):
                lru_hits += shadow.access(old, new, sum(1 for _ in group), self._capacity)
            self._account(0, lru_hits, len(order))
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
        self._flush_ends()
        if now > self._now:
            self._now = now
        # The chain's class: its typical gap, with the idle time its deepest block showed.
        first = mark[live[0]]
        lg = math.log(max(now - first[0], self.config.age0))
        if not math.isnan(first[3]):
            w = self.config.gap_memory
            lg = w * first[3] + (1.0 - w) * lg
        st = self._new_stamp(now, self._gap_class(math.exp(lg)), lg)
        self._touch_stamp = st
        self._moved()
        olds = [mark[bid] for bid in live]
        # Each stamp's blocks were hit at its age, in its class; LRU held some of them.
        hits, guard, shadow, cap = self._hits, self.config.guard, self._shadow, self._capacity
        lru_hits = 0
        for old, group in itertools.groupby(olds):
            n = sum(1 for _ in group)
            hits[old[1], self._bin(now - old[0])] += n
            if guard:
                lru_hits += shadow.access(old[2], st[2], n, cap)
        mark.update(dict.fromkeys(live, st))
        held = self._leaf_held
        for bid in self._slot.keys() & set(live):
            if bid not in held:
                self._offered(bid)
        if guard:
            self._account(len(live), lru_hits, len(live))
        self._tick(len(live))

    def _forget(self, bid: int, count: bool = True) -> None:
        """``bid`` leaves the tier: its lifetime ends at its age now (``count``: learned)."""
        st = self._mark.pop(bid)
        if count:
            self._ends[st[1], self._bin(self._now - st[0])] += 1
        self._leaf_held.discard(bid)
        self._drop_leaf(bid)
        self._ghost(bid, st)

    def remove(self, bid: int) -> None:
        if not self._leaf_mode:
            super().remove(bid)
            return
        st = self._mark.pop(bid, None)
        if st is None:
            return
        self._leave(bid, st)
        self._tick(1)

    def _leave(self, bid: int, st: Stamp) -> None:
        """Block ``bid`` of stamp ``st`` leaves: out of the held set and the ranked order, its
        age counted among the ends, remembered as a ghost."""
        self._leaf_held.discard(bid)
        if bid in self._slot:
            self._drop_leaf(bid)
        if st is not self._end_stamp:
            self._flush_ends()
            self._end_stamp = st
        self._end_count += 1
        self._ghost(bid, st)

    def remove_leaves(self, bids: list[int], parents: list[int]) -> None:
        if not self._leaf_mode:
            super().remove_leaves(bids, parents)
            return
        mark, held = self._mark, self._leaf_held
        going = set(bids) if len(bids) > 1 else ()
        gone = 0
        for bid, p in zip(bids, parents, strict=True):
            st = mark.pop(bid, None)
            if st is not None:
                gone += 1
                self._leave(bid, st)
            if p >= 0 and p in held:
                held.discard(p)
                if p not in going:  # (a parent that leaves in this batch too is never offered)
                    self._offered(p)
        self._tick(gone)

    def _flush_ends(self) -> None:
        """Count the pending ends of lifetimes (all of one stamp, at the same time)."""
        st = self._end_stamp
        if st is not None and self._end_count:
            self._ends[st[1], self._bin(self._now - st[0])] += self._end_count
        self._end_stamp, self._end_count = None, 0

    def _ghost(self, bid: int, st: Stamp) -> None:
        """The guard's ghost of evicted ``bid``: its hash and last access."""
        if not self._ghosting or self._view is None:
            return
        try:
            key = self._view.hash_of(bid)
        except (KeyError, IndexError):  # not live in the index: nothing to follow
            return
        ghosts = self._ghosts
        ghosts[key] = st[2]
        if len(ghosts) > self._ghost_cap:
            ghosts.popitem(last=False)

    def hold(self, bid: int) -> None:
        if self._leaf_mode and bid in self._mark:
            self._leaf_held.add(bid)
            self._drop_leaf(bid)

    def offer(self, bid: int) -> None:
        if self._leaf_mode and bid in self._leaf_held:
            self._leaf_held.discard(bid)
            self._offered(bid)

    def _offered(self, bid: int) -> None:
        """``bid`` joins the offered leaves (and the kept order's heap, if one is kept)."""
        st = self._mark[bid]
        self._add_leaf(bid, st)
        if self._ranked_ok:
            if st[2] != self._key_seq:
                self._key_seq, self._key_last = st[2], self._key(bid)
            heapq.heappush(self._side, (*self._key_last, bid))

    def _hash(self, bid: int) -> bytes | None:
        try:
            return self._view.hash_of(bid) if self._view is not None else None
        except (KeyError, IndexError):  # not live in the index: nothing to follow
            return None

    # ---- learning -----------------------------------------------------------------------------

    def _recompute(self) -> None:
        """Densities per (class, age bin) from the decayed histograms (LHD's reconfiguration)."""
        self._flush_ends()
        c = self.config
        lo = np.concatenate(([0.0], self._edges))
        width = np.diff(np.concatenate((lo, [lo[-1] * 2.0])))
        hits, ends = self._hits, self._ends
        pooled_h, pooled_e = hits.sum(axis=0), ends.sum(axis=0)
        dens = np.empty_like(hits)
        for k in range(self._classes):
            h, e = hits[k], ends[k]
            if h.sum() + e.sum() < c.min_events:
                h, e = pooled_h, pooled_e
            dens[k] = density(h, e, width)
            if c.monotone:
                dens[k] = np.minimum.accumulate(dens[k])
        self._density = dens
        self._invalidate()
        hits *= c.decay
        ends *= c.decay

    # ---- choosing -----------------------------------------------------------------------------

    def _learned(self) -> bool:
        return self._density is not None and not (self.config.guard and self.lru_mode)

    def _ranks(self) -> np.ndarray | None:
        """The offered leaves' densities in the learned order (None: LRU's order); a leaf
        touched at the latest time (the request being served) ranks after every other."""
        if not self._learned():
            return None
        n = self._n
        ages = self._now - self._time[:n]
        assert self._density is not None
        d = self._density[self._cls[:n], self._bins(ages)]
        d[ages <= 0] = math.inf
        return d

    def _key(self, bid: int) -> tuple[float, int]:
        st = self._mark[bid]
        if not self._learned():
            return (0.0, st[2])
        age = self._now - st[0]
        assert self._density is not None
        return (math.inf if age <= 0 else float(self._density[st[1], self._bin(age)]), st[2])

    def _moved(self) -> None:
        """A touch or a put: time moved (every age with it) and some leaves changed."""
        self._invalidate()

    def _invalidate(self) -> None:
        """The kept order and ranks no longer hold (a touch, a put, new tables, a new mode)."""
        self._ranked_ok = False
        self._key_seq = -1

    def _rank(self) -> None:
        """The offered leaves in order, lowest (density, sequence) first, kept until the next
        touch, put or change of the tables: removals only leave stale entries behind, and a
        leaf offered meanwhile joins a heap beside the order. Only the lowest ``_RANKED`` (and
        their ties) are sorted; the rest is ranked when the store has taken those."""
        m = self._n
        d = self._ranks()
        seq = self._seqs[:m]
        k = _RANKED
        if d is None:
            order = np.argpartition(seq, k)[:k] if m > k else np.arange(m)
            order = order[np.argsort(seq[order], kind="stable")]
            self._order_d = [0.0] * len(order)
        else:
            order = np.flatnonzero(d <= np.partition(d, k)[k]) if m > k else np.arange(m)
            order = order[np.lexsort((seq[order], d[order]))]
            self._order_d = d[order].tolist()
        self._order_seq = seq[order].tolist()
        self._order_bids = self._bid[order].tolist()
        self._order_at = 0
        self._order_all = len(order) == m
        self._side = []
        self._ranked_ok = True

    def _top(self) -> tuple[tuple[float, int], int] | None:
        """The first victim's (key, id) in the kept order, stale entries dropped."""
        if not self._ranked_ok:
            self._rank()
        slot, seq_l = self._slot, self._seq_l
        while True:
            bids, ds, seqs, side = self._order_bids, self._order_d, self._order_seq, self._side
            i, n = self._order_at, len(bids)
            while i < n:  # (an entry stands while its leaf is offered with the stamp it had)
                j = slot.get(bids[i])
                if j is not None and seq_l[j] == seqs[i]:
                    break
                i += 1
            self._order_at = i
            if i >= n and not self._order_all:
                self._rank()  # the sorted part is used up: rank the rest
                continue
            while side:
                top = side[0]
                j = slot.get(top[2])
                if j is not None and seq_l[j] == top[1]:
                    if i >= n or (top[0], top[1]) < (ds[i], seqs[i]):
                        return (top[0], top[1]), top[2]
                    break
                heapq.heappop(side)
            return ((ds[i], seqs[i]), bids[i]) if i < n else None

    def first(self) -> int | None:
        if not self._leaf_mode:
            return super().first()
        top = self._top()
        return None if top is None else top[1]

    def candidates(self) -> Iterator[int]:
        if not self._leaf_mode:
            return super().candidates()
        return self._ranked()

    def _ranked(self) -> Iterator[int]:
        n = self._n
        if n == 0:
            return
        d = self._ranks()
        bids = self._bid[:n].copy()
        seq = self._seqs[:n]
        order = np.argsort(seq, kind="stable") if d is None else np.lexsort((seq, d))
        slot = self._slot
        for bid in bids[order].tolist():
            if bid in slot:
                yield bid

    def __len__(self) -> int:
        return len(self._mark) if self._leaf_mode else super().__len__()


def density(hits: np.ndarray, ends: np.ndarray, width: np.ndarray) -> np.ndarray:
    """Hit density per age bin (LHD): the hits expected after reaching the bin over the
    space-time expected to be spent from there, from per-bin counts of hits and of other ends
    of a lifetime and the bins' widths. Where no block has reached a bin, 0."""
    events = hits + ends
    hits_above = np.cumsum(hits[::-1])[::-1]
    alive = np.cumsum(events[::-1])[::-1]  # blocks that reach each bin
    # Within a bin, a block whose lifetime ends there spends half of it; one that passes, all.
    passing = np.concatenate((alive[1:], [0.0]))
    life = (passing + 0.5 * events) * width
    life_above = np.cumsum(life[::-1])[::-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(life_above > 0, hits_above / np.where(life_above > 0, life_above, 1.0), 0.0)
