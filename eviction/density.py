"""Hit density: evict the block expected to earn the fewest hits per unit of space and time.

Most blocks are never reused and a few are reused thousands of times; which is which shows in a
block's *class* (how often it was hit, whether its chain was ever extended past it) and its *age*
(events since its last access). This policy learns, per class, the distribution of the time to
the next reuse, and ranks a block by the best hit density it can still earn::

    density(class, age) = max over T > age of  P(reuse in (age, T]) / E[space-time held until
                                                 the reuse or T, given no reuse by age]

(the hit density of Beckmann et al., LHD, NSDI'18, with the best stopping time T instead of the
policy's own eviction ages, which would teach it only what it already does). The ranking is the
whole policy: no per-trace tuning, no thresholds.

What it learns from, per class (counted in the policy's own event clock, one tick per
insert/touch, so it is scale-free across traces and request rates):

* a hit at age ``a``: a reuse at ``a``;
* a block that was evicted and comes back (its hash is in the *ghost* ring, which keeps the last
  ``ghost_factor`` x resident evicted hashes with their class and last access): a reuse at its
  true gap, although the cache had dropped it. Without ghosts the policy would only see reuses
  shorter than its own eviction age, and would shorten that age further (the feedback that makes
  plain LHD lose to LRU here);
* a ghost that falls off the ring, and every block still resident or in the ring when the tables
  are rebuilt: censored at its age (not reused *yet*), a Kaplan-Meier estimate.

A block's hits are the store's (the index's count, which every tier's hits raise), so a block
that comes back after its ghost left the ring keeps its class; its reuse is learned only through
the ring.

Counts decay by ``decay`` at every rebuild (every ``period`` events), so the tables follow a
changing workload. Before the first rebuild the order is least-recently-used.

Eviction takes the lowest-ranked ``queue_fraction`` of up to ``sample`` resident blocks (on the last
tier only the offered leaves are ranked: blocks with cached children are held, see
``eviction/base.py``) into a victim queue, which later calls
consume: a full ranking costs one vectorised pass per ~1% of the tier evicted.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from eviction.base import BlockView, EvictionPolicy, TierContext
from kvstore.errors import ConfigError

NUM_BUCKETS = 64
RATIO = 1.35
"""Age buckets are geometric: bucket ``k >= 1`` holds ages in ``[RATIO**(k-1), RATIO**k)``."""
_LOG_RATIO = 1.0 / math.log(RATIO)
_UP = RATIO ** np.arange(NUM_BUCKETS, dtype=np.float64)
_LOW = np.concatenate([[0.0], _UP[:-1]])
_MID = (_LOW + _UP) / 2
_HELD = -2
"""``_pos`` of a resident block held out of the ranking (last tier, it has cached children)."""
_KEY_SHIFT = 40
_KEY_TICKS = 1 << _KEY_SHIFT
"""A refill orders blocks by one integer, ``rank << _KEY_SHIFT | last``, while ticks fit."""
_HIT_CLASSES = 6  # hits 0, 1, 2, 3-4, 5-8, 9+
NUM_CLASSES = _HIT_CLASSES * 2  # x (chain extended past the block or not)


def age_bucket(age: float) -> int:
    if age < 1:
        return 0
    return min(int(math.log(age) * _LOG_RATIO) + 1, NUM_BUCKETS - 1)


def _age_buckets_by_log(ages: np.ndarray) -> np.ndarray:
    out = np.floor(np.log(np.maximum(ages, 1)) * _LOG_RATIO).astype(np.int64) + 1
    out[ages < 1] = 0
    return np.minimum(out, NUM_BUCKETS - 1)


def _first_ages() -> np.ndarray:
    """The least whole age of each bucket from 1 on, found with the log formula itself, so that
    a search over them gives exactly its buckets (it is monotonic in the age)."""
    out = np.ones(NUM_BUCKETS - 1, np.int64)
    for k in range(2, NUM_BUCKETS):
        guess = int(RATIO ** (k - 1))
        near = np.arange(max(guess - 4, 1), guess + 6, dtype=np.int64)
        out[k - 1] = near[np.argmax(_age_buckets_by_log(near) >= k)]
    return out


_FIRST_AGES = _first_ages()


_LUT_AGES = 1 << 20
"""Whole ages below this find their bucket in a table (1 MiB of bytes, built at first use)."""
_lut: list[np.ndarray] = []


def _age_lut() -> np.ndarray:
    if not _lut:
        _lut.append(np.searchsorted(_FIRST_AGES, np.arange(_LUT_AGES), side="right").astype(np.uint8))
    return _lut[0]


def age_buckets(ages: np.ndarray) -> np.ndarray:
    """``age_bucket`` of each age: whole ages (event counts, the usual case) from a table when
    all are below ``_LUT_AGES`` (a sorted search of thousands of ages costs several times
    more), else by one sorted search; the log formula for others."""
    if ages.dtype.kind in "iu":
        if ages.size and np.maximum.reduce(ages) < _LUT_AGES:  # (the ufunc: no Python wrapper)
            return _age_lut().take(ages, mode="clip")  # (a negative age clips to bucket 0)
        return np.searchsorted(_FIRST_AGES, ages, side="right")
    return _age_buckets_by_log(ages)


def _hit_class(hits: int) -> int:
    if hits < 3:
        return hits
    return 3 if hits < 5 else (4 if hits < 9 else 5)


def density_table(reuses: np.ndarray, exposure: np.ndarray) -> np.ndarray:
    """Best hit density per (class, age bucket) from Kaplan-Meier counts.

    ``reuses[c, k]``: reuses that happened at an age in bucket ``k``; ``exposure[c, k]``:
    lifetimes (reused or censored) that reached bucket ``k``. Returns ``[classes, buckets]``.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        hazard = np.where(exposure > 0, reuses / exposure, 0.0)
    hazard = np.clip(hazard, 0.0, 1.0)
    ones = np.ones((reuses.shape[0], 1))
    survival = np.cumprod(np.concatenate([ones, 1.0 - hazard[:, :-1]], axis=1), axis=1)
    mass = survival * hazard  # P(reuse in bucket k)
    # Every current age bucket a at once, over stopping buckets j >= a (axis 2): the sums
    # run from j = a as in one bucket at a time (the entries before a are exact zeros, and a
    # cumulative sum adds in order), and those entries are left out of the maximum.
    later = _LATER  # [a, j]: j >= a
    m = np.where(later, mass[:, None, :], 0.0)
    hits = np.cumsum(m, axis=2)
    held = np.cumsum(m * _STAY, axis=2)
    held += (survival[:, :, None] - hits) * _REST
    with np.errstate(invalid="ignore", divide="ignore"):
        d = np.where(held > 0, hits / held, 0.0)
    return np.where(later, d, -np.inf).max(axis=2)


_LATER = np.arange(NUM_BUCKETS)[None, :] >= np.arange(NUM_BUCKETS)[:, None]
_STAY = np.maximum(_MID[None, :] - _LOW[:, None], 0.5)
"""[a, j]: the time held, from an age at the start of bucket a, by a reuse in bucket j."""
_REST = _UP[None, :] - _LOW[:, None]
"""[a, j]: the time held, from an age at the start of bucket a, to the end of bucket j."""


@dataclass(frozen=True, slots=True)
class DensityConfig:
    period: int = 8192
    """Events between rebuilds of the density tables."""
    decay: float = 0.9
    """Weight kept by past counts at each rebuild (0.9: a half-life of ~6.6 periods)."""
    ghost_factor: float = 8.0
    """Evicted hashes remembered, as a multiple of the blocks resident."""
    queue_fraction: float = 0.01
    """Share of the ranked sample taken into the victim queue at once."""
    queue_min: int = 8
    sample: int = 4096
    """Most blocks ranked per refill of the victim queue."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.period < 64:
            raise ConfigError(f"period must be >= 64 events, got {self.period}")
        if not 0.0 < self.decay <= 1.0:
            raise ConfigError(f"decay must be in (0, 1], got {self.decay}")
        if self.ghost_factor < 0:
            raise ConfigError(f"ghost_factor must be >= 0, got {self.ghost_factor}")
        if not 0.0 < self.queue_fraction <= 1.0:
            raise ConfigError(f"queue_fraction must be in (0, 1], got {self.queue_fraction}")
        if self.sample < 64:
            raise ConfigError(f"sample must be >= 64, got {self.sample}")


class _Ghosts:
    """A ring of evicted blocks: hash -> (class, last access tick, hits), oldest dropped first."""

    def __init__(self) -> None:
        self.cap = 1024
        self.cls = np.zeros(self.cap, np.int16)
        self.t0 = np.zeros(self.cap, np.int64)
        self.hits = np.zeros(self.cap, np.int32)
        self.keys: list[bytes | None] = [None] * self.cap
        self.head = self.tail = 0
        self.where: dict[bytes, int] = {}

    def __len__(self) -> int:
        return self.tail - self.head

    def push(self, key: bytes, cls: int, t0: int, hits: int) -> None:
        if len(self) >= self.cap:
            self._grow()
        i = self.tail % self.cap
        self.tail += 1
        old = self.where.pop(key, None)
        if old is not None:
            self.keys[old] = None
        self.cls[i], self.t0[i], self.hits[i], self.keys[i] = cls, t0, hits, key
        self.where[key] = i

    def take(self, key: bytes) -> tuple[int, int, int] | None:
        i = self.where.pop(key, None)
        if i is None:
            return None
        self.keys[i] = None
        return int(self.cls[i]), int(self.t0[i]), int(self.hits[i])

    def pop_oldest(self) -> tuple[int, int] | None:
        """Drop the oldest entry; its (class, t0) when it was still live."""
        i = self.head % self.cap
        self.head += 1
        key = self.keys[i]
        if key is None:
            return None
        self.keys[i] = None
        del self.where[key]
        return int(self.cls[i]), int(self.t0[i])

    def live(self) -> np.ndarray:
        """Slots of the entries still live (not taken back by a return)."""
        return np.fromiter(self.where.values(), np.int64, len(self.where))

    def _grow(self) -> None:
        idx = np.arange(self.head, self.tail) % self.cap
        cap = self.cap * 2
        self.cls = np.concatenate([self.cls[idx], np.zeros(cap - idx.size, np.int16)])
        self.t0 = np.concatenate([self.t0[idx], np.zeros(cap - idx.size, np.int64)])
        self.hits = np.concatenate([self.hits[idx], np.zeros(cap - idx.size, np.int32)])
        keys = [self.keys[i] for i in idx.tolist()]
        self.keys = keys + [None] * (cap - len(keys))
        self.where = {k: i for i, k in enumerate(keys) if k is not None}
        self.head, self.tail, self.cap = 0, len(keys), cap


class DensityPolicy(EvictionPolicy):
    """Learned hit density per (class, age); see the module docstring."""

    name = "density"
    Config = DensityConfig
    weighted = False  # whether weights() says more than "all equal"
    joins_queue = True
    """Whether a new block whose table score is no better than the next victim's joins the victim
    queue at once (a subclass that ranks by other scores turns it off)."""
    runs = True  # victims(): a parent offered waits for the next refill, so a run is exact
    walk_ahead = True
    """Whether a walk of :meth:`candidates` ranks several refills ahead at once
    (:meth:`_walk_refill`); off for a subclass whose refill does more than rank."""

    def __init__(self, config: DensityConfig | None = None) -> None:
        self.config = config or DensityConfig()
        self._rng = np.random.default_rng(self.config.seed)
        self._view: BlockView | None = None
        self._tier = TierContext()
        self._tick = 0
        self._since_rebuild = 0
        # Lifetimes that ended (reused or censored) in each age bucket, and the reused ones;
        # the exposure of bucket k is the number that ended at k or later.
        # Flat lists (index class * NUM_BUCKETS + bucket), not arrays: one increment per event
        # costs a list item several times less than a numpy scalar, with the same float sums.
        self._ended_flat = [0.0] * (NUM_CLASSES * NUM_BUCKETS)
        self._reuses_flat = [0.0] * (NUM_CLASSES * NUM_BUCKETS)
        self._table: np.ndarray | None = None
        # Per table value, its rank among them (ties equal) << _KEY_SHIFT: a refill's keys.
        self._rank = np.zeros(NUM_CLASSES * NUM_BUCKETS, np.int64)
        self._ghosts = _Ghosts()
        # Blocks removed since the ghost ring last learned of them (hash, id, the ring's limit
        # at the removal): a batched eviction's ghosts enter the ring in one pass
        # (:meth:`_flush_gone`), before anything reads the ring or moves the event clock.
        self._gone_keys: list[bytes] = []
        self._gone_ids: list[int] = []
        self._gone_limits: list[float] = []
        self._queue: list[tuple[int, int, float]] = []  # (bid, last access, score), best last
        self._answered = 0  # queue entries (at its end) that victims() answered last
        self._repeats = False  # the last refill sampled with replacement: a bid may repeat
        self._n = 0  # ranked blocks: _resident[:_n]
        self._held: set[int] = set()  # resident blocks held out of the ranking (last tier)
        self._cap = 0
        self._grow(1024)

    # ---- per-block state, in columns indexed by block id ----------------------------------------

    def _grow(self, need: int) -> None:
        old = self._cap
        if need <= old:
            return
        cap = max(need, 2 * old)

        def grown(name: str, dtype: type, fill: int = 0) -> np.ndarray:
            new: np.ndarray = np.full(cap, fill, dtype)
            if old:
                new[:old] = getattr(self, name)
            return new

        # Columns the ranking reads in bulk are arrays; the rest are lists (a list item is
        # several times cheaper to read and write than a numpy scalar, per event).
        self._last = grown("_last", np.int64)
        self._cls = grown("_cls", np.int16)
        self._resident = grown("_resident", np.int64)
        if not old:
            self._hits: list[int] = []
            self._extended: list[bool] = []
            self._pos: list[int] = []  # index into _resident, -1: not resident, _HELD: held
        self._hits += [0] * (cap - old)
        self._extended += [False] * (cap - old)
        self._pos += [-1] * (cap - old)
        self._cap = cap

    def bind(self, view: BlockView, tier: TierContext) -> None:
        self._view = view
        self._tier = tier

    def __len__(self) -> int:
        return self._n + len(self._held)

    def _class_of(self, bid: int) -> int:
        return _hit_class(self._hits[bid]) * 2 + self._extended[bid]

    def _advance(self) -> None:
        if self._gone_keys:
            self._flush_gone()
        self._tick += 1
        self._since_rebuild += 1
        if self._since_rebuild >= self.config.period:
            self._rebuild()

    @property
    def _ended(self) -> np.ndarray:
        if self._gone_keys:
            self._flush_gone()
        return np.array(self._ended_flat).reshape(NUM_CLASSES, NUM_BUCKETS)

    @property
    def _reuses(self) -> np.ndarray:
        return np.array(self._reuses_flat).reshape(NUM_CLASSES, NUM_BUCKETS)

    def _resolve(self, cls: int, age: int, reused: bool) -> None:
        i = cls * NUM_BUCKETS + (0 if age < 1 else min(int(math.log(age) * _LOG_RATIO) + 1, NUM_BUCKETS - 1))
        self._ended_flat[i] += 1.0
        if reused:
            self._reuses_flat[i] += 1.0

    # ---- protocol ---------------------------------------------------------------------------

    def insert(self, bid: int, size: int, now: float) -> None:
        if bid < self._cap and self._pos[bid] != -1:
            return
        self._advance()
        self._grow(bid + 1)
        self._pos[bid] = self._n
        self._resident[self._n] = bid
        self._n += 1
        self._last[bid] = self._tick
        self._extended[bid] = self._view is not None and bool(self._view.children[bid])
        self._hits[bid] = 0
        view = self._view
        if view is not None:
            back = self._ghosts.take(view.hash_of(bid))
            if back is not None:  # a reuse the cache missed: learn its true gap
                cls, t0, hits = back
                self._resolve(cls, self._tick - t0, True)
                self._hits[bid] = hits + 1
            # The class counts every hit the store saw (the index's count), so a block that
            # returns after its ghost left the ring is not taken for a new one.
            self._hits[bid] = max(self._hits[bid], int(view.hits[bid]))
            parent = int(view.parent[bid])
            if 0 <= parent < self._cap and self._pos[parent] != -1 and not self._extended[parent]:
                self._extended[parent] = True
                self._cls[parent] = self._class_of(parent)
        self._cls[bid] = cls = self._class_of(bid)
        if self._tier.last and view is not None and view.children[bid]:
            self.hold(bid)  # it has cached children: it may not leave before them
            return
        queue = self._queue
        if queue and self._table is not None and self.joins_queue:
            # A block worth no more than the next victim goes next, without waiting for a
            # refill: most new blocks are never reused, and they arrive between refills.
            score = float(self._table[cls, 0])
            if self.weighted:
                score *= float(self.weights(np.array([bid]))[0])  # type: ignore[index]  # weighted: not None
            if score <= queue[-1][2]:
                queue.append((bid, self._tick, score))

    def insert_many(self, ids: np.ndarray, sizes: np.ndarray, now: np.ndarray | float) -> None:
        """``insert`` of each block in order, vectorised between rebuilds (a warm restart
        learns every block at once). Neither ``sizes`` nor ``now`` is read, as in ``insert``."""
        ids = np.asarray(ids, np.int64)
        if not ids.size:
            return
        if self._gone_keys:
            self._flush_gone()
        self._grow(int(np.maximum.reduce(ids)) + 1)  # (the ufunc: no Python wrapper)
        pos = self._pos
        # Repeats and blocks already resident are no-ops (neither advances the clock).
        fresh = [b for b in dict.fromkeys(ids.tolist()) if pos[b] == -1]
        i = 0
        while i < len(fresh):
            free = self.config.period - 1 - self._since_rebuild
            if free <= 0:
                self.insert(fresh[i], 0, 0.0)  # the event that rebuilds the tables
                i += 1
                continue
            self._insert_run(fresh[i : i + free])
            i += free

    def _insert_run(self, run: list[int]) -> None:
        """``insert`` of new, distinct blocks while no rebuild is due, in one pass: the same
        outcome, event by event, as ``insert`` of each in order. The events run over Python
        lists (a chain is short: a numpy scalar per event would cost more than the whole
        event); the columns the ranking reads are written once at the end."""
        m = len(run)
        ids = np.array(run, np.int64)
        t0 = self._tick
        self._tick += m
        self._since_rebuild += m
        view = self._view
        kids = view.children[ids].tolist() if view is not None else [0] * m
        seen = view.hits[ids].tolist() if view is not None else [0] * m  # the index's hit counts
        parents = view.parent[ids].tolist() if view is not None else [-1] * m
        pos, hits, extended, cap = self._pos, self._hits, self._extended, self._cap
        last_tier = self._tier.last
        ghosts = self._ghosts
        take = ghosts.take if view is not None and ghosts.where else None
        hash_of = view.hash_of if view is not None else None
        queue = self._queue
        joining = bool(queue) and self._table is not None and self.joins_queue
        if joining:
            table0 = self._table[:, 0].tolist()  # type: ignore[index]  # joining: _table is not None
            weights = self.weights(ids).tolist() if self.weighted else None  # type: ignore[union-attr]  # weighted: not None
            tail = queue[-1][2]
        held_set, resident_new = self._held, []
        classes: dict[int, int] = {}  # the run's classes, written to the column at the end
        n = self._n
        for j, b in enumerate(run):
            tick = t0 + 1 + j
            ext = kids[j] != 0
            extended[b] = ext
            h = 0
            if take is not None:
                back = take(hash_of(b))  # type: ignore[misc]  # take is set only with a view
                if back is not None:  # a reuse the cache missed: learn its true gap
                    self._resolve(back[0], tick - back[1], True)
                    h = back[2] + 1
            hits[b] = h = max(h, seen[j])
            p = parents[j]
            if 0 <= p < cap and pos[p] != -1 and not extended[p]:
                extended[p] = True
                c = _hit_class(hits[p]) * 2 + 1
                if p in classes:
                    classes[p] = c
                else:
                    self._cls[p] = c
            c = classes[b] = _hit_class(h) * 2 + ext
            if last_tier and ext:  # it has cached children: it may not leave before them
                pos[b] = _HELD
                held_set.add(b)
                continue
            pos[b] = n
            n += 1
            resident_new.append(b)
            if joining:
                # A block worth no more than the next victim goes next, without waiting for a
                # refill: most new blocks are never reused, and they arrive between refills.
                score = table0[c]
                if weights is not None:
                    score *= weights[j]
                if score <= tail:
                    queue.append((b, tick, score))
                    tail = score
        self._last[ids] = np.arange(t0 + 1, t0 + m + 1)
        self._cls[np.fromiter(classes, np.int64, len(classes))] = list(classes.values())
        self._resident[self._n : n] = resident_new
        self._n = n

    def touch(self, bid: int, now: float) -> None:
        if bid >= self._cap or self._pos[bid] == -1:
            return
        self._advance()
        self._resolve(int(self._cls[bid]), self._tick - int(self._last[bid]), True)
        self._hits[bid] += 1
        self._last[bid] = self._tick
        self._cls[bid] = self._class_of(bid)

    def hold(self, bid: int) -> None:
        if bid < self._cap and self._pos[bid] >= 0:
            self._unrank(bid)
            self._pos[bid] = _HELD
            self._held.add(bid)

    def offer(self, bid: int) -> None:
        if bid < self._cap and self._pos[bid] == _HELD:
            self._held.discard(bid)
            self._pos[bid] = self._n
            self._resident[self._n] = bid
            self._n += 1

    def _unrank(self, bid: int) -> None:
        """Take ``bid`` out of the ranked set (``_resident[:_n]``); its statistics stay."""
        i = self._pos[bid]
        self._n -= 1
        moved = int(self._resident[self._n])
        if moved != bid:
            self._resident[i] = moved
            self._pos[moved] = i
        self._pos[bid] = -1

    def remove(self, bid: int) -> None:
        if bid >= self._cap:
            return
        i = self._pos[bid]
        if i == -1:
            return
        factor = self.config.ghost_factor
        if self._view is not None and factor > 0:
            # Its ghost enters the ring at the next flush (the same entries, ages and limit as
            # at once: nothing reads the ring or moves the clock before then).
            self._gone_keys.append(self._view.hash_of(bid))
            self._gone_ids.append(bid)
            self._gone_limits.append(factor * max(self._n + len(self._held), 64))  # resident: ranked and held
        pos = self._pos
        if i == _HELD:
            pos[bid] = -1
            self._held.discard(bid)
            return
        # _unrank, inlined (once per victim)
        n = self._n = self._n - 1
        moved = int(self._resident[n])
        if moved != bid:
            self._resident[i] = moved
            pos[moved] = i
        pos[bid] = -1

    def _flush_gone(self) -> None:
        """The ghosts of the blocks removed since the last flush enter the ring, and the ring
        drops its oldest entries down to the limit of the last removal: the outcome of
        pushing each and trimming after each, in one pass. (The limits of a run of removals
        never grow, so trimming once to the last one drops the same oldest entries; the clock
        did not move, so each dropped ghost is censored at the same age.)"""
        keys, ids, limits = self._gone_keys, self._gone_ids, self._gone_limits
        self._gone_keys, self._gone_ids, self._gone_limits = [], [], []
        g = self._ghosts
        where = g.where
        if not where.keys().isdisjoint(keys):  # a key already in the ring (never seen): in order
            self._push_ghosts_in_order(keys, ids, limits)
            return
        m, size0 = len(keys), len(g)
        drop = max(size0 + m - math.floor(limits[-1]), 0)
        ended = self._ended_flat
        from_ring = min(drop, size0)
        if from_ring:
            cap, gkeys = g.cap, g.keys
            live = []
            a = g.head % cap
            if a + from_ring <= cap:  # the usual case: one slice of the ring
                for s, key in enumerate(gkeys[a : a + from_ring], a):
                    if key is not None:
                        del where[key]
                        live.append(s)
                gkeys[a : a + from_ring] = [None] * from_ring
            else:
                for j in range(g.head, g.head + from_ring):
                    s = j % cap
                    key = gkeys[s]
                    if key is not None:
                        gkeys[s] = None
                        del where[key]
                        live.append(s)
            g.head += from_ring
            if live:
                slots: slice | np.ndarray = np.array(live, np.int64)
                flat = g.cls[slots].astype(np.int64) * NUM_BUCKETS + age_buckets(self._tick - g.t0[slots])
                for f in flat.tolist():
                    ended[f] += 1.0
        arr = np.array(ids, np.int64)
        cls, t0 = self._cls[arr], self._last[arr]
        gone = drop - from_ring  # the first removals' ghosts fall off the ring at once
        if gone:
            flat = cls[:gone].astype(np.int64) * NUM_BUCKETS + age_buckets(self._tick - t0[:gone])
            for f in flat.tolist():
                ended[f] += 1.0
        k = m - gone
        if not k:
            return
        while len(g) + k > g.cap:
            g._grow()
        s0 = g.tail % g.cap
        slots = slice(s0, s0 + k) if s0 + k <= g.cap else (g.tail + np.arange(k)) % g.cap
        g.cls[slots], g.t0[slots] = cls[gone:], t0[gone:]
        hits = self._hits
        g.hits[slots] = [hits[b] for b in ids[gone:]]
        gkeys, where = g.keys, g.where  # (new ones if the ring grew)
        if isinstance(slots, slice):  # the usual case: one slice of the ring
            gkeys[slots] = keys[gone:]
            where.update(zip(keys[gone:], range(s0, s0 + k), strict=True))
        else:
            for s, key in zip(slots.tolist(), keys[gone:], strict=True):
                gkeys[s] = key
                where[key] = s
        g.tail += k

    def _push_ghosts_in_order(self, keys: list[bytes], ids: list[int], limits: list[float]) -> None:
        """:meth:`_flush_gone` one ghost at a time (a key the ring already holds moves)."""
        g = self._ghosts
        for key, bid, limit in zip(keys, ids, limits, strict=True):
            g.push(key, int(self._cls[bid]), int(self._last[bid]), self._hits[bid])
            while g.tail - g.head > limit:
                gone = g.pop_oldest()
                if gone is not None:
                    self._resolve(gone[0], self._tick - gone[1], False)

    def first(self) -> int | None:
        # candidates()'s first step without its generator: the entry is taken off the queue.
        self._answered = 0
        pos, last_of = self._pos, self._last
        while True:
            if not self._queue:
                self._refill(set())
                if not self._queue:
                    return None
            bid, last, _ = self._queue.pop()
            if pos[bid] >= 0 and last_of[bid] == last:
                return bid

    def victims(self, n: int) -> list[int]:
        """The queue's next valid entries, up to ``n`` (a refill first if it holds none): what
        :meth:`first` answers one after the other while the store takes each, because a
        parent offered meanwhile is ranked at the next refill only. They stay on the queue
        (stale entries between them are dropped, as :meth:`first` drops them on its way) until
        :meth:`remove_leaves` takes them off."""
        q, pos, last_of = self._queue, self._pos, self._last
        self._answered = 0
        while True:
            if not q:
                self._refill(set())
                q = self._queue  # (a new list)
                if not q:
                    return []
            bid, last, _ = q[-1]
            if pos[bid] >= 0 and last_of[bid] == last:
                break
            q.pop()
        out: list[int] = []
        i, clean, low = len(q) - 1, True, len(q)
        seen: set[int] | None = set() if self._repeats else None
        while i >= 0 and len(out) < n:
            bid, last, _ = q[i]
            if last_of[bid] != last or pos[bid] == -1:
                clean = False  # stale for good: removed, or accessed since
            elif pos[bid] == _HELD or (seen is not None and bid in seen):
                # Held: an offer in the run may make it valid again; a sample drawn twice is
                # stale once the first is taken. Either way first() decides there.
                break
            else:
                if seen is not None:
                    seen.add(bid)
                out.append(bid)
                low = i
            i -= 1
        if not clean:  # (those below the last one answered stay, as first() leaves them)
            tail = [e for e in q[low:] if pos[e[0]] >= 0 and last_of[e[0]] == e[1]]
            del q[low:]
            q.extend(tail)
        self._answered = len(out)
        return out

    def remove_leaves(self, bids: list[int], parents: list[int]) -> None:
        """``remove`` then ``offer`` of each pair in one loop; the entries :meth:`victims`
        answered leave the queue as :meth:`first` would have taken them."""
        q, pos, resident, held, cap = self._queue, self._pos, self._resident, self._held, self._cap
        factor = self.config.ghost_factor
        view = self._view
        ghosts = view is not None and factor > 0
        hash_of = view.hash_of if view is not None else None
        gone_keys, gone_ids, gone_limits = self._gone_keys, self._gone_ids, self._gone_limits
        answered = self._answered
        n = self._n
        total = n + len(held)  # resident, ranked and held: each removal lowers it, an offer does not
        for bid, p in zip(bids, parents, strict=True):
            if answered and q and q[-1][0] == bid:
                q.pop()
                answered -= 1
            if bid < cap and (i := pos[bid]) != -1:
                if ghosts:
                    gone_keys.append(hash_of(bid))  # type: ignore[misc]  # ghosts are kept only with a view
                    gone_ids.append(bid)
                    gone_limits.append(factor * max(total, 64))
                total -= 1
                if i == _HELD:
                    held.discard(bid)
                else:
                    n -= 1
                    moved = int(resident[n])
                    if moved != bid:
                        resident[i] = moved
                        pos[moved] = i
                pos[bid] = -1
            if 0 <= p < cap and pos[p] == _HELD:
                held.discard(p)
                pos[p] = n
                resident[n] = p
                n += 1
        self._n = n
        self._answered = answered

    def candidates(self) -> Iterator[int]:
        offered: set[int] = set()  # the store skipped these (pinned, in use): rank the rest
        # Queues ranked ahead by this walk (next one last) while the policy stays as it was:
        # the refills the walk would make, one ranking for many (see _walk_refill).
        ahead: list[list[tuple[int, int, float]]] = []
        state: tuple[int, int, int] | None = None
        chunks = 4
        while True:
            if not self._queue:
                if ahead and state == (self._tick, self._n, len(self._held)):
                    self._queue = ahead.pop()
                elif self.walk_ahead:
                    ahead = self._walk_refill(offered, chunks)
                    state, chunks = (self._tick, self._n, len(self._held)), chunks * 4
                else:
                    self._refill(offered)
                if not self._queue:
                    return
            bid, last, _ = self._queue.pop()
            if self._pos[bid] >= 0 and self._last[bid] == last and bid not in offered:
                offered.add(bid)
                yield bid

    def _walk_refill(self, offered: set[int], chunks: int) -> list[list[tuple[int, int, float]]]:
        """:meth:`_refill` for a walk of :meth:`candidates`, ranking up to ``chunks`` refills'
        worth at once: the queue gets the first, the answer holds the next ones (next last),
        each the queue that a refill would make once the walk has passed the one before.

        Exact because within a walk the store changes nothing (``choose_room`` only reads):
        the next refill would rank the same blocks less the ones offered, which are this
        queue's, in the same total order (keys are distinct: the last access is). Only the
        plain key ranking qualifies (no sampling, no weights); anything else refills as before.
        A walk past many blocks the store must skip (a long load's own blocks, protected
        while it is promoted into a smaller DRAM) took one full ranking per ``queue_min``
        blocks passed; four times more chunks ranked ahead at each refill take a logarithmic
        number (the chunks a walk does not reach are dropped with it: the queue it leaves is
        the one it left before)."""
        cfg = self.config
        if self._table is None or self.weighted or self._tick >= _KEY_TICKS:
            self._refill(offered)
            return []
        pos = self._pos
        n = self._n - sum(1 for bid in offered if pos[bid] >= 0)  # the blocks _refill ranks
        if n > cfg.sample:
            self._refill(offered)
            return []
        if n <= 0:
            return []  # nothing left to rank: the walk ends, as an empty refill ends it
        sizes: list[int] = []
        left = n
        while left > 0 and len(sizes) < chunks:
            take = min(max(cfg.queue_min, int(left * cfg.queue_fraction)), left)
            sizes.append(take)
            left -= take
        self._refill(offered, sum(sizes))
        entries, out = self._queue, []
        for take in sizes:  # best victim last: each chunk is the tail of what is left
            out.append(entries[len(entries) - take:])
            del entries[len(entries) - take:]
        self._queue = out[0]
        return out[:0:-1]

    # ---- learning and ranking ---------------------------------------------------------------

    def _rebuild(self) -> None:
        """Rebuild the density tables; blocks resident or in the ghost ring count as censored
        at their current age (not reused yet), then past counts decay."""
        self._since_rebuild = 0
        ids = self._resident[: self._n]
        if self._held:  # held blocks are resident too: censored like the ranked ones
            ids = np.concatenate([ids, np.fromiter(self._held, np.int64, len(self._held))])
        g = self._ghosts
        live = g.live()
        flat = np.concatenate([
            self._cls[ids].astype(np.int64) * NUM_BUCKETS + age_buckets(self._tick - self._last[ids]),
            g.cls[live].astype(np.int64) * NUM_BUCKETS + age_buckets(self._tick - g.t0[live]),
        ])
        # Counts (whole numbers, exact in floats): the same as adding one at a time.
        pending = np.bincount(flat, minlength=NUM_CLASSES * NUM_BUCKETS).reshape(NUM_CLASSES, NUM_BUCKETS)
        ended = self._ended + pending
        reached = np.cumsum(ended[:, ::-1], axis=1)[:, ::-1]
        self._table = density_table(self._reuses, reached)
        self._rank = np.unique(self._table.ravel(), return_inverse=True)[1].astype(np.int64) << _KEY_SHIFT
        decay = self.config.decay
        self._reuses_flat = [x * decay for x in self._reuses_flat]
        self._ended_flat = [x * decay for x in self._ended_flat]

    def weights(self, ids: np.ndarray) -> np.ndarray | None:
        """Value of a hit on each block relative to the others (None: all equal). The cost-aware
        policy overrides it."""
        return None

    def _refill(self, offered: set[int], take: int | None = None) -> None:
        """A new victim queue: the lowest-ranked share of a sample of the ranked blocks less
        ``offered``; ``take`` (:meth:`_walk_refill`) sets how many, for an unsampled ranking."""
        n = self._n
        if not n:
            return
        cfg = self.config
        ids = self._resident[:n]
        if offered:
            out = np.fromiter(offered, np.int64, len(offered))
            skip = np.zeros(max(int(ids.max()), int(out.max())) + 1, bool) if ids.size else np.zeros(1, bool)
            skip[out] = True  # a mask, not np.isin (which sorts both)
            ids = ids[~skip[ids]]
            if not ids.size:
                return
        self._repeats = ids.size > cfg.sample
        if self._repeats:  # with replacement: O(sample), and a repeat is harmless
            ids = ids[self._rng.integers(0, ids.size, cfg.sample)]
        if take is None or self._repeats:
            take = max(cfg.queue_min, int(ids.size * cfg.queue_fraction))
        last = self._last[ids]
        if self._table is None:
            score = last.astype(np.float64)  # no statistics yet: least recently used first
        else:
            ages = self._tick - last
            # A sorted search of ~400 ages in 63 first ages (in cache) costs less here than
            # the 1 MiB bucket table, whose lines the rest of a put has evicted by now.
            buckets = _FIRST_AGES.searchsorted(ages, side="right")
            flat = self._cls[ids] * NUM_BUCKETS + buckets
            if not (self.weighted or self._repeats) and self._tick < _KEY_TICKS:
                # One integer per block orders as (score, last access) do: the score's rank
                # among the table's values, then the last access (distinct: one event each).
                key = self._rank.take(flat) | last
                if take < ids.size:
                    sel = key.argpartition(take - 1)[:take]  # (the method: no Python wrapper)
                    sel = sel[key[sel].argsort()[::-1]]
                else:
                    sel = key.argsort()[::-1]  # best victim last
                self._queue = list(zip(
                    ids[sel].tolist(), last[sel].tolist(), self._table.ravel().take(flat[sel]).tolist(), strict=True))
                return
            score = self._table.ravel().take(flat)
            w = self.weights(ids)
            if w is not None:
                score = score * w
        if take < ids.size:
            # Every block tied with the take-th score stays in the running, so that the older
            # wins a tie whatever the order of the resident array (scores take few values).
            kth = score[score.argpartition(take - 1)[take - 1]]
            keep = np.flatnonzero(score <= kth)
            ids, last, score = ids[keep], last[keep], score[keep]
        order = np.lexsort((last, score))[:take][::-1]  # ties: the older first; best victim last
        self._queue = list(zip(ids[order].tolist(), last[order].tolist(), score[order].tolist(), strict=True))
