"""Learned relaxed Belady (LRB-style): a model of which sampled blocks are read again soon.

Song et al. (NSDI'20, "Learning Relaxed Belady for Content Distribution Network Caching") rank
eviction candidates by a model of each one's time to next access, trained online on the cache's
own past; any block whose next access lies past a *boundary* is as good a victim as Belady's
(the relaxation), so the model only has to say which candidates fall inside it. Here the model
answers exactly that: the probability that a block is accessed again in this tier (a hit, or its
return by a promotion) within ``window`` x the blocks resident, in this tier's events, from
features of the block at the time of the decision:

* its age (events since its last access here) and the last two gaps between its accesses;
* its hits (every tier's), depth, cached children, and whether it was the last block of the put
  that stored it and that put's length (a request's last block that never got a child is rarely
  read again);
* its prefix root's hits and age (how often the prefix it hangs from comes back);
* ``density``'s learned hit density for its class and age (eviction/density.py);
* optionally (``groups``), crosses of the age with hits, shape, last gap, depth and root hits.

How the model ranks (``objective``): ``tiebreak`` (the default) keeps ``density``'s order and
uses the model only among blocks that ``density`` scores the same (one class and age bucket:
most of a refill's sample); ``window`` ranks by the model alone, evict the least likely first,
which is LRB's rule and measured worse here (docs/eviction.md, "`lrb`").

The model is a logistic regression over binned features (one weight per bin, an additive model
in the log-odds) with a ridge, fitted by exact per-group Newton steps (bins of one group are
disjoint, so each group's Hessian is diagonal), warm-started, every ``refit_every`` events on
the samples of the ring (``max_samples``) whose window has passed. A training sample is a random
member of a refill's ranked sample (its features are computed already), watched until its
block's next access in this tier. Nothing is per token: features are computed once per refill,
for the whole sample, in numpy.

Everything else is ``density``'s: the bookkeeping, the ghosts and tables it learns from, the
victim queue and its runs, and on the last tier the held/offered leaves (only offered leaves are
ranked, so the store stays prefix-closed). Before the first fit the order is ``density``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eviction.density import NUM_BUCKETS, DensityConfig, DensityPolicy, age_buckets
from kvstore.errors import ConfigError


def _log_bins(x: np.ndarray, base: float, top: int | np.ndarray) -> np.ndarray:
    """0 for x <= 0, else ``1 + floor(log_base(x))``, clipped to ``top - 1`` (``top``: one per
    row of a 2-D ``x`` as a column, so that several features are binned in one pass)."""
    xf = np.maximum(x, 1).astype(np.float64)
    out = (np.log(xf) * (1.0 / np.log(base))).astype(np.int64) + 1
    out[x <= 0] = 0
    return np.minimum(out, top - 1)


_AGE, _AGE2, _GAP, _GAP2C, _HITS, _DEPTH, _DEPTH2, _SHAPE, _LEN, _ROOTH, _ROOTH2, _ROOTA, _DENS = (
    40, 24, 26, 13, 8, 16, 8, 6, 12, 16, 8, 24, 34)
GROUPS: tuple[tuple[str, int], ...] = (
    ("age", _AGE), ("gap1", _GAP), ("gap2", _GAP), ("hits", _HITS), ("depth", _DEPTH), ("shape", _SHAPE),
    ("put_len", _LEN), ("root_hits", _ROOTH), ("root_age", _ROOTA), ("density", _DENS),
    ("age x hits", _AGE2 * _HITS), ("age x shape", _AGE2 * _SHAPE), ("age x gap1", _AGE2 * _GAP2C),
    ("age x depth", _AGE2 * _DEPTH2), ("age x root_hits", _AGE2 * _ROOTH2),
)
"""The model's feature groups (name, bins); one weight per bin."""


_BASE2 = {"gap1": _GAP, "gap2": _GAP, "depth": _DEPTH, "put_len": _LEN, "root_age": _ROOTA}
"""The features, beside hits and root hits, binned by ``_log_bins(x, 2.0, bins)``, with their bins."""

OBJECTIVES = ("tiebreak", "window")
BASE_GROUPS = tuple(g for g, _ in GROUPS if " x " not in g)


@dataclass(frozen=True, slots=True)
class LRBConfig(DensityConfig):
    objective: str = "tiebreak"
    """``tiebreak``: ``density``'s order, its ties (blocks of one class and age bucket) broken
    by the model's probability of an access within ``window``; ``window``: that probability
    alone (LRB's relaxed Belady: evict the candidate least likely to be read within the
    boundary)."""
    window: float = 4.0
    """The relaxed-Belady boundary, in multiples of the blocks resident (the tier's events):
    a next access later than it is as good as none."""
    groups: tuple[str, ...] = BASE_GROUPS
    """The feature groups the model uses (names of ``GROUPS``; empty: all; the default leaves
    out the crosses with the age, which measured worse on the conversation trace)."""
    train_per_refill: int = 16
    """Training samples drawn from each refill's ranked sample."""
    refit_every: int = 4096
    """Events between fits of the model."""
    max_samples: int = 65536
    """Most recent resolved samples a fit uses."""
    min_samples: int = 1024
    """Resolved samples needed before the model ranks (until then ``density``'s order)."""
    ridge: float = 1.0
    sweeps: int = 3
    """Newton sweeps over the feature groups per fit (warm-started)."""

    def __post_init__(self) -> None:
        DensityConfig.__post_init__(self)
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        object.__setattr__(self, "groups", tuple(self.groups))
        unknown = set(self.groups) - {g for g, _ in GROUPS}
        if unknown:
            raise ConfigError(f"unknown feature group(s) {sorted(unknown)}; known: {', '.join(g for g, _ in GROUPS)}")
        if not self.window > 0:
            raise ConfigError(f"window must be > 0 (a multiple of the blocks resident), got {self.window}")
        if self.train_per_refill < 0:
            raise ConfigError(f"train_per_refill must be >= 0, got {self.train_per_refill}")
        if self.refit_every < 64:
            raise ConfigError(f"refit_every must be >= 64 events, got {self.refit_every}")
        if self.min_samples < 16 or self.max_samples < self.min_samples:
            raise ConfigError(f"need 16 <= min_samples <= max_samples, got {self.min_samples}, {self.max_samples}")
        if self.ridge <= 0 or self.sweeps < 1:
            raise ConfigError(f"ridge must be > 0 and sweeps >= 1, got {self.ridge}, {self.sweeps}")




def _sigmoid(logit: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # a very negative logit: exp overflows to inf, p is 0
        return 1.0 / (1.0 + np.exp(-logit))


@dataclass(slots=True)
class Model:
    """Additive log-odds over binned features: ``bias + sum_g w[g][bin_g]``."""

    bias: float
    weights: list[np.ndarray]

    @classmethod
    def zero(cls, sizes: list[int]) -> Model:
        return cls(0.0, [np.zeros(n) for n in sizes])

    def logit(self, bins: np.ndarray) -> np.ndarray:
        """``bins``: [groups, samples] of bin indices."""
        out = np.full(bins.shape[1], self.bias)
        for w, b in zip(self.weights, bins, strict=True):
            out += w.take(b)
        return out

    def fit(self, bins: np.ndarray, y: np.ndarray, ridge: float, sweeps: int) -> None:
        """Newton steps on the ridge-penalised log-likelihood, one group at a time (exact for
        a group: its bins are disjoint, so its Hessian is diagonal), warm-started."""
        logit = self.logit(bins)
        for _ in range(sweeps):
            p = _sigmoid(logit)
            step = float((y - p).sum() / max(float((p * (1 - p)).sum()), 1e-9))
            self.bias += step
            logit += step
            for g, (w, b) in enumerate(zip(self.weights, bins, strict=True)):
                p = _sigmoid(logit)
                n = w.size
                grad = np.bincount(b, y - p, n) - ridge * w
                hess = np.bincount(b, p * (1 - p), n) + ridge
                delta = grad / hess
                self.weights[g] = w + delta
                logit += delta.take(b)


class LRBPolicy(DensityPolicy):
    """LRB-style learned ranking over ``density``'s bookkeeping; see the module docstring."""

    name = "lrb"
    Config = LRBConfig
    walk_ahead = False  # its refill also draws training samples: one per refill, as before

    def __init__(self, config: LRBConfig | None = None) -> None:
        self.lrb = config or LRBConfig()
        self._gap1 = np.zeros(0, np.int64)
        super().__init__(self.lrb)
        self.model: Model | None = None
        self.fits = 0
        self._next_fit = self.lrb.refit_every
        # A ring of training samples: features, the tick sampled, the gap to the block's next
        # access here (-1: none yet; -2: the block left the store) and the block, watched
        # through ``_watch`` (bid -> its pending slot, -1 none) until its next access.
        r = self.lrb.max_samples
        names = self.lrb.groups or tuple(g for g, _ in GROUPS)
        self._use = [i for i, (g, _) in enumerate(GROUPS) if g in names]
        self._crosses = any(" x " in GROUPS[g][0] for g in self._use)
        self._base2 = [GROUPS[g][0] for g in self._use if GROUPS[g][0] in _BASE2]
        self._tops2 = np.array([_HITS, _ROOTH, *(_BASE2[n] for n in self._base2)])[:, None]  # (features' rows)
        self._s_bins = np.zeros((len(self._use), r), np.int64)
        self._s_tick = np.zeros(r, np.int64)
        self._s_gap = np.full(r, -2, np.int64)
        self._s_bid = np.full(r, -1, np.int64)
        self._s_next = 0
        self._draw = np.random.default_rng(self.lrb.seed + 1)

    # ---- per-block features kept beside density's columns --------------------------------------

    def _grow(self, need: int) -> None:
        super()._grow(need)
        old = self._gap1.size
        if self._cap <= old:
            return

        def grown(name: str, fill: int) -> np.ndarray:
            new = np.full(self._cap, fill, np.int64)
            if old:
                new[:old] = getattr(self, name)
            return new

        if not old:
            self._watch: list[int] = []
        self._watch += [-1] * (self._cap - old)
        self._gap1 = grown("_gap1", 0)
        self._gap2 = grown("_gap2", 0)
        self._root = grown("_root", -1)
        self._put_len = grown("_put_len", 1)
        self._tail = grown("_tail", 1)

    def _roots(self, ids: np.ndarray) -> None:
        """Each new block's prefix root, parents first (a put's chain arrives root first)."""
        view = self._view
        if view is None:
            self._root[ids] = ids
            return
        root, cap = self._root, self._cap
        order = ids[np.argsort(view.depth[ids], kind="stable")] if ids.size > 1 else ids
        for b, p in zip(order.tolist(), view.parent[order].tolist(), strict=True):
            if p < 0:
                root[b] = b
                continue
            r = root[p] if p < cap else -1
            if r < 0:  # a parent this tier never saw: walk up to a known root
                q, path = p, []
                while q >= 0 and (q >= cap or root[q] < 0):
                    path.append(q)
                    up = int(view.parent[q])
                    if up < 0:
                        break
                    q = up
                r = q if q >= cap or root[q] < 0 else int(root[q])
                for s in path:
                    if s < cap:
                        root[s] = r
            root[b] = r

    def _arrived(self, ids: np.ndarray, before: np.ndarray) -> None:
        """Blocks just inserted: a block the store had hit before keeps its history and gains
        the gap since its last access here; a new one starts afresh."""
        view = self._view
        seen = view.hits[ids] > 0 if view is not None else np.zeros(ids.size, bool)
        watch = self._watch
        for j, b in enumerate(ids.tolist()):
            s = watch[b]
            if s >= 0:  # a watched block is back (its next access) or its id was recycled
                watch[b] = -1
                self._s_gap[s] = self._tick - self._s_tick[s] if seen[j] else -2
        back = seen & (before > 0)
        if back.any():
            b = ids[back]
            self._gap2[b] = self._gap1[b]
            self._gap1[b] = self._last[b] - before[back]
        new = ids[~seen]
        if new.size:
            self._gap1[new] = 0
            self._gap2[new] = 0
            self._put_len[new] = 1
            self._tail[new] = 1
        rootless = ids[~seen | (self._root[ids] < 0)]  # (a block another tier demoted here)
        if rootless.size:
            self._roots(rootless)

    def insert(self, bid: int, size: int, now: float) -> None:
        if bid < self._cap and self._pos[bid] != -1:
            return
        before = int(self._last[bid]) if bid < self._cap else 0
        super().insert(bid, size, now)
        self._arrived(np.array([bid], np.int64), np.array([before], np.int64))

    def insert_many(self, ids: np.ndarray, sizes: np.ndarray, now: np.ndarray | float) -> None:
        ids = np.asarray(ids, np.int64)
        if not ids.size:
            return
        self._grow(int(ids.max()) + 1)
        pos = self._pos
        fresh = np.array([b for b in dict.fromkeys(ids.tolist()) if pos[b] == -1], np.int64)
        before = self._last[fresh]
        super().insert_many(ids, sizes, now)
        if not fresh.size:
            return
        self._arrived(fresh, before)
        view = self._view
        if view is not None:
            new = fresh[view.hits[fresh] == 0]
            if new.size > 1:  # one put's chain (or a restart's blocks): its last block and length
                depth = view.depth[new]
                self._put_len[new] = int(depth.max()) + 1
                self._tail[new] = 0
                self._tail[new[depth.argmax()]] = 1

    def touch(self, bid: int, now: float) -> None:
        if bid >= self._cap or self._pos[bid] == -1:
            return
        before = int(self._last[bid])
        super().touch(bid, now)
        g1 = self._gap1
        self._gap2[bid] = g1[bid]
        g1[bid] = self._tick - before  # (the touch set the block's last access to the tick)
        s = self._watch[bid]
        if s >= 0:
            self._watch[bid] = -1
            self._s_gap[s] = self._tick - self._s_tick[s]

    # ---- features, samples, the model -------------------------------------------------------

    def features(self, ids: np.ndarray) -> np.ndarray:
        """[groups used, len(ids)] bin indices of each block's features now (the used groups,
        in GROUPS' order)."""
        tick = self._tick
        last = self._last[ids]
        age = tick - last
        view = self._view
        if view is not None:
            hits = view.hits[ids].astype(np.int64)
            depth = view.depth[ids].astype(np.int64)
            kids = view.children[ids].astype(np.int64)
            root = self._root[ids]
            root = np.where(root >= 0, root, ids)
            root_hits = view.hits[root].astype(np.int64)
        else:
            hits = depth = kids = np.zeros(ids.size, np.int64)
            root = ids
            root_hits = hits
        # The base-2 features the model uses, binned in one pass (the same bins one by one).
        inputs = {
            "gap1": lambda: self._gap1[ids], "gap2": lambda: self._gap2[ids], "depth": lambda: depth,
            "put_len": lambda: self._put_len[ids], "root_age": lambda: tick - self._last[root],
        }
        binned = _log_bins(np.stack([hits, root_hits, *(inputs[name]() for name in self._base2)]), 2.0, self._tops2)
        h, rh = binned[0], binned[1]
        col = {name: binned[2 + i] for i, name in enumerate(self._base2)}
        shape = self._tail[ids] * 3 + np.minimum(kids, 2)
        if self._table is None:
            dens = np.zeros(ids.size, np.int64)
        else:
            d = self._table.ravel().take(self._cls[ids].astype(np.int64) * NUM_BUCKETS + age_buckets(age))
            dens = np.where(d > 0, np.clip(np.log2(np.maximum(d, 1e-300)).astype(np.int64) + _DENS, 1, _DENS - 1), 0)
        a2 = _log_bins(age, 2.0, _AGE2) if self._crosses else age
        make = {  # (only the groups the model uses are computed)
            "age": lambda: _log_bins(age, 1.5, _AGE),
            "gap1": lambda: col["gap1"],
            "gap2": lambda: col["gap2"],
            "hits": lambda: h,
            "depth": lambda: col["depth"],
            "shape": lambda: shape,
            "put_len": lambda: col["put_len"],
            "root_hits": lambda: rh,
            "root_age": lambda: col["root_age"],
            "density": lambda: dens,
            "age x hits": lambda: a2 * _HITS + h,
            "age x shape": lambda: a2 * _SHAPE + shape,
            "age x gap1": lambda: a2 * _GAP2C + _log_bins(self._gap1[ids], 4.0, _GAP2C),
            "age x depth": lambda: a2 * _DEPTH2 + _log_bins(depth, 4.0, _DEPTH2),
            "age x root_hits": lambda: a2 * _ROOTH2 + np.minimum(rh, _ROOTH2 - 1),
        }
        return np.stack([make[GROUPS[g][0]]() for g in self._use])

    def _record(self, ids: np.ndarray, bins: np.ndarray) -> None:
        """A few of a refill's ranked blocks become training samples (their features are
        computed already); each is watched until its next access."""
        k = self.lrb.train_per_refill
        if not k or not ids.size:
            return
        watch, r = self._watch, self._s_tick.size
        for j in self._draw.integers(0, ids.size, min(k, ids.size)).tolist():
            b = int(ids[j])
            if watch[b] >= 0:
                continue
            s = self._s_next % r
            self._s_next += 1
            old = int(self._s_bid[s])
            if old >= 0 and self._s_gap[s] == -1 and watch[old] == s:
                watch[old] = -1  # overwritten before its block came back
            self._s_bins[:, s] = bins[:, j]
            self._s_tick[s] = self._tick
            self._s_gap[s] = -1
            self._s_bid[s] = b
            watch[b] = s

    def _fit(self) -> None:
        """Refit on the samples whose window has passed (every one's outcome is known: a next
        access within the window, or none), warm-started."""
        cfg = self.lrb
        self._next_fit = self._tick + cfg.refit_every
        horizon = int(cfg.window * max(len(self), 64))
        n = min(self._s_next, self._s_tick.size)
        ok = np.flatnonzero((self._s_tick[:n] <= self._tick - horizon) & (self._s_bid[:n] >= 0))
        if ok.size < cfg.min_samples:
            return
        gap = self._s_gap[ok]
        gap = np.where((gap < 0) | (gap > horizon), horizon, np.maximum(gap, 1))
        bins = self._s_bins[:, ok]
        sizes = [GROUPS[g][1] for g in self._use]
        model = self.model or Model.zero(sizes)
        model.fit(bins, (gap < horizon).astype(np.float64), cfg.ridge, cfg.sweeps)
        self.model = model
        # The queue's scores are the model's from now on (a tie-break keeps density's).
        self.joins_queue = cfg.objective == "tiebreak"
        self.fits += 1

    def _refill(self, offered: set[int], _take: int | None = None) -> None:  # walk_ahead is off: no take
        if self._tick >= self._next_fit:
            self._fit()
        n = self._n
        if not n:
            return
        cfg = self.config
        ids = self._resident[:n]
        if offered:
            out = np.fromiter(offered, np.int64, len(offered))
            skip = np.zeros(max(int(ids.max()), int(out.max())) + 1, bool)
            skip[out] = True
            ids = ids[~skip[ids]]
            if not ids.size:
                return
        repeats = ids.size > cfg.sample
        if repeats:
            ids = ids[self._rng.integers(0, ids.size, cfg.sample)]
        bins = self.features(ids)
        self._record(ids, bins)
        if self.model is None:
            DensityPolicy._refill(self, offered)
            return
        self._repeats = repeats
        take = max(cfg.queue_min, int(ids.size * cfg.queue_fraction))
        last = self._last[ids]
        if self.lrb.objective == "tiebreak" and self._table is not None:
            # density's order, its ties (blocks of one class and age bucket) broken by the model
            flat = self._cls[ids].astype(np.int64) * NUM_BUCKETS + age_buckets(self._tick - last)
            score = self._table.ravel().take(flat)
            second = self.model.logit(bins)
            if take < ids.size:
                kth = score[score.argpartition(take - 1)[take - 1]]
                keep = np.flatnonzero(score <= kth)
                ids, last, score, second = ids[keep], last[keep], score[keep], second[keep]
            order = np.lexsort((second, score))[:take][::-1]
            self._queue = list(zip(ids[order].tolist(), last[order].tolist(), score[order].tolist(), strict=True))
            return
        score = self.model.logit(bins)
        if take < ids.size:
            kth = score[score.argpartition(take - 1)[take - 1]]
            keep = np.flatnonzero(score <= kth)
            ids, last, score = ids[keep], last[keep], score[keep]
        order = np.lexsort((last, score))[:take][::-1]  # ties: the older first; best victim last
        self._queue = list(zip(ids[order].tolist(), last[order].tolist(), score[order].tolist(), strict=True))
