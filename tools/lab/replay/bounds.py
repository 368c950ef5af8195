"""Bounds for online policies: the best hit rate of any policy that decides by a block's class
and age (:func:`class_bound`), its window and instant variants, and priority orders over
classes. The yardsticks every policy is compared with (an unlimited cache, Belady) are the
product replay's: :mod:`tools.replay.yardsticks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tools.replay.trace import Trace


@dataclass(frozen=True, slots=True)
class ClassSegments:
    """Reuse gaps per block class (see :func:`class_bound`), and the trace's length in block
    accesses."""

    gaps: list[np.ndarray]
    accesses: int
    starts: list[np.ndarray] | None = None
    """Per class, aligned with ``gaps``: the access (tick) at which each segment began."""


EXTRA_FEATURES = ("length", "prefix", "turn", "position", "gap")
"""Request features :func:`class_segments` can add to a block's class (log-bucketed): the
request's chain length, its cached prefix length, the hits of its deepest cached block (the
conversation's turn), the block's quarter of the chain, and the time since the last request."""


def class_segments(trace: Trace, block_tokens: int = 512, extra: tuple[str, ...] = ()) -> ClassSegments:
    """The statistics of a bound on the block hits of any policy that decides from a block's
    *class* and *age* alone, with perfect knowledge of each class's reuse statistics: an upper
    bound for learned policies such as eviction/density.py, which must learn them.

    Each access starts a *segment* that ends at the block's next access (a reuse after ``g``
    block accesses) or never. A policy of this family keeps a block of class ``c`` until age
    ``T_c`` and pays ``min(g, T_c)`` of space-time for it; the best ``T_c`` under an average of
    ``capacity`` blocks resident is a knapsack, solved here as its LP relaxation (the upper
    concave hull of each class's hits-versus-space curve, filled greedily by slope), which a
    randomised policy attains. Classes: hits so far (0, 1, 2, 3-4, 5-8, 9+), whether the block
    is a request's partial tail, its last reuse gap (inherited from the request's deepest hit
    for a new block), and its depth, each log-bucketed. Block-level and without the prefix
    constraint, so it is optimistic for longest-prefix hits. ``extra`` adds request features
    (:data:`EXTRA_FEATURES`) to the class: finer classes raise the bound, partly because the
    statistics of a small class are memorised rather than learnable.
    """
    unknown = set(extra) - set(EXTRA_FEATURES)
    if unknown:
        raise ValueError(f"unknown class features {sorted(unknown)}; choose from {', '.join(EXTRA_FEATURES)}")

    def log_bucket(x: int, cap: int) -> int:
        return min(int(np.log2(x + 1)), cap)

    offsets, ids = trace.offsets.tolist(), trace.block_ids.tolist()
    partial = (trace.input_tokens % block_tokens != 0).tolist()
    stamps = trace.timestamps_ms.tolist()
    last: dict[int, int] = {}
    hits: dict[int, int] = {}
    gap: dict[int, int] = {}
    cls_of: dict[int, tuple[int, ...]] = {}
    segments: dict[tuple[int, ...], list[tuple[float, int]]] = {}  # (gap, start)
    tick = 0
    for r in range(trace.num_requests):
        chain = ids[offsets[r] : offsets[r + 1]]
        k = 0
        while k < len(chain) and chain[k] in last:
            k += 1
        for b in chain:
            tick += 1
            if b in last:
                segments.setdefault(cls_of[b], []).append((tick - last[b], last[b]))
                gap[b], hits[b] = tick - last[b], hits[b] + 1
            else:
                gap[b], hits[b] = -1, 0
            last[b] = tick
        inherited = gap[chain[k - 1]] if k > 1 else -1
        request = {
            "length": log_bucket(len(chain), 8),
            "prefix": log_bucket(k, 6),
            "turn": min(hits[chain[k - 1]] if k else 0, 6),
            "gap": log_bucket(int(stamps[r] - stamps[r - 1]) if r else 0, 12),
        }
        for d, b in enumerate(chain):
            g = gap[b] if hits[b] else inherited
            h = hits[b]
            cls_of[b] = (
                h if h < 3 else (3 if h < 5 else (4 if h < 9 else 5)),
                int(d == len(chain) - 1 and partial[r]),
                -1 if g < 0 else log_bucket(g, 20),
                int(hits[b] == 0),
                log_bucket(d, 6),
                *(4 * d // len(chain) if f == "position" else request[f] for f in extra),
            )
    for b in last:
        segments.setdefault(cls_of[b], []).append((np.inf, last[b]))
    pairs = [np.array(sorted(v)) for v in segments.values()]
    return ClassSegments([p[:, 0] for p in pairs], tick, [p[:, 1].astype(np.int64) for p in pairs])


def policy_class_segments(trace: Trace) -> ClassSegments:
    """:class:`ClassSegments` in the classes eviction/density.py learns in: hits so far (0, 1,
    2, 3-4, 5-8, 9+) x whether a cached block ever had a child (a request's chain went past
    it), as the policy sees them at each access. With :func:`class_bound` it bounds the policy
    itself; with :func:`window_bound`, the policy plus any prefetch rule over the same classes."""
    offsets, ids = trace.offsets.tolist(), trace.block_ids.tolist()
    last: dict[int, int] = {}
    hits: dict[int, int] = {}
    extended: set[int] = set()
    cls_of: dict[int, tuple[int, bool]] = {}
    segments: dict[tuple[int, bool], list[tuple[float, int]]] = {}  # (gap, start)
    tick = 0
    for r in range(trace.num_requests):
        chain = ids[offsets[r] : offsets[r + 1]]
        for d, b in enumerate(chain):
            tick += 1
            if d:
                extended.add(chain[d - 1])
            if b in last:
                segments.setdefault(cls_of[b], []).append((float(tick - last[b]), last[b]))
                hits[b] += 1
            else:
                hits[b] = 0
            last[b] = tick
        for b in chain:
            h = hits[b]
            cls_of[b] = (h if h < 3 else (3 if h < 5 else (4 if h < 9 else 5)), b in extended)
    for b in last:
        segments.setdefault(cls_of[b], []).append((np.inf, last[b]))
    pairs = [np.array(sorted(v)) for v in segments.values()]
    return ClassSegments([p[:, 0] for p in pairs], tick, [p[:, 1].astype(np.int64) for p in pairs])


def class_bound(segments: ClassSegments, capacity: int) -> float:
    """The most block hits of :func:`class_segments`' policy family with ``capacity`` blocks."""
    return _keep_until(segments, capacity)[0]


def keep_until_occupancy(segments: ClassSegments, capacity: int) -> np.ndarray:
    """The blocks :func:`class_bound`'s solution holds after each access, when it is run on
    the trace without a capacity (each class kept until the age the LP gives it; the class on
    the budget's edge to the end of its step): the bound meets ``capacity`` on *average* only,
    and this shows how far the occupancy strays from it (a bursty trace needs many times the
    room at its peaks, which a real tier does not have, so its policies fall short of the
    bound). Needs the segments' start ticks."""
    assert segments.starts is not None, "segments without start ticks"
    ages = _keep_until(segments, capacity)[1]
    n = segments.accesses
    delta = np.zeros(n + 2)
    for g, start, age in zip(segments.gaps, segments.starts, ages, strict=True):
        if age <= 0:
            continue
        end = np.minimum(start + np.minimum(g, age), n + 1).astype(np.int64)
        np.add.at(delta, start, 1.0)
        np.add.at(delta, end, -1.0)
    return np.cumsum(delta)[1 : n + 1]


def _keep_until(segments: ClassSegments, capacity: int) -> tuple[float, list[float]]:
    """:func:`class_bound`'s LP: its hits, and each class's keep-until age (the horizon of the
    last hull step it takes; a step taken in part counts whole)."""
    tick = segments.accesses
    horizons = age_grid(tick)
    base_space = base_hits = 0.0
    steps: list[tuple[float, float, float, int, float]] = []  # (hits per space, space, hits, class, age)
    ages = [0.0] * len(segments.gaps)
    for c, g in enumerate(segments.gaps):
        reused, space = _keep_curve(g, horizons)
        hull = _upper_hull(space, reused)
        base_space, base_hits = base_space + hull[0][0], base_hits + hull[0][1]
        ages[c] = _age_at(hull[0][0], space, horizons) if hull[0][1] > 0 else 0.0
        steps += [((y2 - y1) / (x2 - x1), x2 - x1, y2 - y1, c, _age_at(x2, space, horizons))
                  for (x1, y1), (x2, y2) in zip(hull, hull[1:], strict=False)]
    budget, total = capacity * tick - base_space, base_hits
    for _, dx, dy, c, age in sorted(steps, reverse=True):
        if budget <= 0:
            break
        take = min(1.0, budget / dx)
        total, budget = total + take * dy, budget - take * dx
        ages[c] = max(ages[c], age)
    return total, ages


def _age_at(spent: float, space: np.ndarray, horizons: np.ndarray) -> float:
    """The horizon at which a class's space-time curve reaches ``spent``."""
    return float(horizons[min(int(np.searchsorted(space, spent)), horizons.size - 1)])


def age_grid(accesses: int, ratio: float | None = None) -> np.ndarray:
    """The ages at which a rule of the bounds may change its decision about a block: 600
    geometric steps up to ``accesses`` (the default, as fine as the trace allows), or, with
    ``ratio``, the geometric buckets ``[0, 1), [1, ratio), [ratio, ratio**2), ...`` of a rule
    that knows a block's age only to that resolution (eviction/density.py's tables: its
    ``RATIO``)."""
    if ratio is None:
        return np.unique(np.concatenate([[0.0], np.geomspace(1, max(accesses, 1), 600)]))
    if ratio <= 1.0:
        raise ValueError(f"ratio must be > 1, got {ratio}")
    n = int(np.log(max(accesses, 1)) / np.log(ratio)) + 2
    return np.unique(np.concatenate([[0.0], np.minimum(ratio ** np.arange(n), max(accesses, 1))]))


def _window_cells(gaps: list[np.ndarray], horizons: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per (class, age cell between two horizons), the reuses that fall in it and the
    space-time of holding the blocks still waiting through it, flattened class by class."""
    values, costs = [], []
    for g in gaps:
        reused, space = _keep_curve(g, horizons)
        values.append(np.diff(reused))
        costs.append(np.diff(space))
    return np.concatenate(values), np.concatenate(costs)


def window_bound(segments: ClassSegments, capacity: int, ratio: float | None = None) -> float:
    """The most block hits of a policy that decides, per block class, at which *ages* a block is
    held, with every class's reuse statistics known in advance: :func:`class_bound`'s family
    (hold from age 0 until ``T_c``) widened to any set of age windows per class. With a tier
    below to fetch from, that is what demotion plus *prefetch* (promotion before the request,
    learned from the class's reuse-gap distribution) can do; a reuse at gap ``g`` hits when age
    ``g`` lies in a held window, and each window costs the space-time of the blocks still
    waiting at its ages. Every age window of every class is priced independently (hits per
    unit of space-time, filled greedily: the LP relaxation), so the bound is at least
    :func:`class_bound` and covers any schedule of demotions and prefetches driven by class and
    age. Block-level, average occupancy, free prefetch: optimistic, so an upper bound.

    The windows are cells of :func:`age_grid`: by default 600 per class, fine enough to pick
    out the ages where a handful of reuses happened to fall (memorised, not learnable: see
    :func:`holdout_window_hits`); with ``ratio`` the bound is for rules that know a block's
    age to that resolution only, such as a prefetch decided from eviction/density.py's own
    age buckets. A coarser grid is a smaller class of rules, so its bound is lower. Each cell
    gets one decision for the whole trace: a rule that changes its decisions as the workload
    drifts is not covered (nor by :func:`class_bound`)."""
    v, c = _window_cells(segments.gaps, age_grid(segments.accesses, ratio))
    free = c <= 0
    total, budget = float(v[free].sum()), float(capacity * segments.accesses)
    v, c = v[~free], c[~free]
    order = np.argsort(-v / c, kind="stable")
    cum = np.cumsum(c[order])
    k = int(np.searchsorted(cum, budget, side="right"))
    total += float(v[order[:k]].sum())
    if k < order.size:
        j = order[k]
        total += float(v[j]) * (budget - (float(cum[k - 1]) if k else 0.0)) / float(c[j])
    return total


def holdout_window_hits(segments: ClassSegments, capacity: int, ratio: float | None = None) -> tuple[float, int]:
    """:func:`window_bound`'s rule *fitted on the first half* of the trace (by access count)
    and applied to the second: each (class, age cell) ranked by its first-half hits per unit of
    space-time, and held in that order while the second half's space-time fits ``capacity``
    blocks. Returns the second half's hits and its reuses (segments that start there and are
    reused): what the cells are worth when they must be learned rather than known. Not a
    bound; it shows which grids generalise (fine cells memorise)."""
    assert segments.starts is not None, "segments without start ticks"
    mid = segments.accesses // 2
    horizons = age_grid(segments.accesses, ratio)
    early = [g[s <= mid] for g, s in zip(segments.gaps, segments.starts, strict=True)]
    late = [g[s > mid] for g, s in zip(segments.gaps, segments.starts, strict=True)]
    v1, c1 = _window_cells(early, horizons)
    v2, c2 = _window_cells(late, horizons)
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(c1 > 0, v1 / np.maximum(c1, 1e-12), np.where(v1 > 0, np.inf, 0.0))
    order = np.argsort(-score, kind="stable")
    cum = np.cumsum(c2[order])
    k = int(np.searchsorted(cum, capacity * (segments.accesses - mid), side="right"))
    reuses = sum(int(np.isfinite(g).sum()) for g in late)
    return float(v2[order[:k]].sum()), reuses


def holdout_class_hits(segments: ClassSegments, capacity: int) -> float:
    """Block hits in the second half of the trace (by access count) of :func:`class_segments`'
    policy family when each class's keep-age is *fitted on the first half*: what the class
    statistics are worth when they must be learned rather than known. The budget trade-off
    (one threshold on hits per unit of space-time across classes) is set to fill ``capacity``
    blocks in the second half, as a policy adapts to its occupancy; a class never seen in the
    first half keeps nothing. Segments are assigned to the half they start in."""
    assert segments.starts is not None, "segments without start ticks"
    mid = segments.accesses // 2
    horizons = np.unique(np.concatenate([[0.0], np.geomspace(1, segments.accesses, 300)]))

    tables = []
    for g, start in zip(segments.gaps, segments.starts, strict=True):
        late = g[start > mid]
        if late.size:
            tables.append((*_keep_curve(g[start <= mid], horizons), *_keep_curve(late, horizons)))
    budget = capacity * (segments.accesses - mid)
    lo, hi, best = 1e-12, 1.0, 0.0
    for _ in range(60):  # bisect the threshold on log scale
        lam = (lo * hi) ** 0.5
        hits = space = 0.0
        for h1, s1, h2, s2 in tables:
            j = int(np.argmax(h1 - lam * s1))
            hits, space = hits + h2[j], space + s2[j]
        if space > budget:
            lo = lam
        else:
            hi, best = lam, hits
    return best


def _keep_curve(gaps: np.ndarray, horizons: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For keeping a class's blocks until each age in ``horizons``: the reuses caught and the
    space-time paid, given the class's sorted reuse gaps (``inf``: never reused)."""
    finite = gaps[np.isfinite(gaps)]
    cum = np.concatenate([[0.0], np.cumsum(finite)])
    reused = np.searchsorted(finite, horizons, side="right")
    return reused.astype(np.float64), cum[reused] + (gaps.size - reused) * horizons


def _upper_hull(xs: np.ndarray, ys: np.ndarray) -> list[tuple[float, float]]:
    """The increasing part of the upper concave hull of the points (x, y)."""
    hull: list[tuple[float, float]] = []
    for p in sorted(zip(xs.tolist(), ys.tolist(), strict=True)):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (p[0] - x1) <= (p[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append(p)
    out = [hull[0]]
    for p in hull[1:]:
        if p[1] > out[-1][1]:
            out.append(p)
    return out


@dataclass(frozen=True, slots=True)
class InstantBound:
    """:func:`instant_window_bound`'s answer, in block hits."""

    bound: float
    """The dual value at the multipliers found: an upper bound on the LP optimum whatever the
    multipliers (weak duality), so it holds however far the optimiser got."""
    feasible: float
    """The hits of a fractional rule that the solver found and that meets every constraint of
    the relaxation: the LP optimum lies in ``[feasible, bound]``."""
    cells: int
    """Decision cells with at least one reuse (class x age cell, x epoch)."""
    rows: int
    """Capacity constraints (one per ``step`` accesses)."""


def _cell_occupancy(segments: ClassSegments, horizons: np.ndarray, step: int,
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (class, age cell) with a reuse: the reuses per access tick at which they happen
    (``hits``: cells x ticks, sparse as (cell, tick) pairs) and the blocks the cell holds,
    summed over each ``step`` accesses (``load``: cells x rows). A segment that starts at
    tick ``s`` is in cell ``(h_j, h_{j+1}]`` at the ticks ``t`` with ``t - s`` in the cell and
    ``t - s <= g``: the reused block is held at the instant of its reuse."""
    n = segments.accesses
    rows = -(-n // step)
    assert segments.starts is not None, "segments without start ticks"
    floors = np.floor(horizons).astype(np.int64)
    loads, hit_cells, hit_ticks = [], [], []
    cell = 0
    for g, s in zip(segments.gaps, segments.starts, strict=True):
        gap = np.where(np.isfinite(g), g, n + 1).astype(np.int64)
        reused = np.isfinite(g)
        which = np.searchsorted(floors, gap, side="left") - 1  # floor(h_j) < g <= floor(h_j+1)
        for j in range(horizons.size - 1):
            got = reused & (which == j)
            if not got.any():
                continue
            lo = s + floors[j] + 1
            hi = np.minimum(s + np.minimum(floors[j + 1], gap), n)
            keep = lo <= hi
            delta = np.zeros(n + 2)
            np.add.at(delta, lo[keep], 1.0)
            np.add.at(delta, hi[keep] + 1, -1.0)
            held = np.cumsum(delta)[1 : n + 1]
            held = np.concatenate([held, np.zeros(rows * step - n)])
            loads.append(held.reshape(rows, step).sum(axis=1))
            hit_cells.append(np.full(int(got.sum()), cell))
            hit_ticks.append((s[got] + gap[got]).astype(np.int64))
            cell += 1
    if not loads:
        return np.zeros((0, rows)), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.array(loads), np.concatenate(hit_cells), np.concatenate(hit_ticks)


def _packing_dual(v: np.ndarray, a: np.ndarray, iterations: int) -> tuple[float, float]:
    """Bounds on ``max v.x`` subject to ``a.T @ x <= 1`` and ``0 <= x <= 1`` (``a``: cells x
    rows, non-negative): the dual ``sum(mu) + sum(max(0, v - a @ mu))`` at the best
    multipliers found (an upper bound for *any* ``mu >= 0``: weak duality), and the value of
    the best feasible ``x`` found (scaled down until it fits). The solver is a diagonally
    preconditioned primal-dual hybrid gradient (Chambolle-Pock; PDLP's core) restarted at its
    running averages; a primal weight of 0.02 suits these LPs (checked against HiGHS on the
    shared traces: docs/eviction.md)."""
    if v.size == 0:
        return 0.0, 0.0
    if a.shape[1] == 0:
        return float(v.sum()), float(v.sum())

    def dual(mu: np.ndarray) -> float:
        return float(mu.sum() + np.maximum(v - a @ mu, 0.0).sum())

    def fitted(x: np.ndarray) -> float:
        return float(v @ x) / max(float((a.T @ x).max()), 1.0)

    weight, period = 0.02, 500
    tau = weight / np.maximum(a.sum(axis=1), 1e-12)
    sigma = 1.0 / weight / np.maximum(a.sum(axis=0), 1e-12)
    x, mu = np.zeros(v.size), np.zeros(a.shape[1])
    x_sum, mu_sum, n = np.zeros_like(x), np.zeros_like(mu), 0
    best_dual, best_fit = dual(mu), 0.0
    for i in range(iterations):
        x_next = np.clip(x + tau * (v - a @ mu), 0.0, 1.0)
        mu = np.maximum(mu + sigma * (a.T @ (2.0 * x_next - x) - 1.0), 0.0)
        x = x_next
        x_sum, mu_sum, n = x_sum + x, mu_sum + mu, n + 1
        if i % 50 == 49 or i == iterations - 1:
            best_dual = min(best_dual, dual(mu), dual(mu_sum / n))
            best_fit = max(best_fit, fitted(x), fitted(x_sum / n))
        if i % period == period - 1:
            if dual(mu_sum / n) < dual(mu):  # restart at the average when it is the better point
                x, mu = x_sum / n, mu_sum / n
            x_sum, mu_sum, n = np.zeros_like(x), np.zeros_like(mu), 0
    return best_dual, best_fit


def instant_window_bound(segments: ClassSegments, capacity: int, ratio: float | None = None,
                         epochs: int = 1, step: int = 16, iterations: int = 6000) -> InstantBound:
    """:func:`window_bound`'s family held to ``capacity`` at every instant instead of on
    average: the most block hits of a rule that holds a block, at each access tick, with a
    probability that depends only on its class, its age cell (:func:`age_grid` at ``ratio``)
    and, with ``epochs`` above 1, on which of that many equal runs of the trace the tick falls
    in (a table rebuilt that often, each chosen in hindsight), and that never holds more than
    ``capacity`` blocks. Prefetch is free (a block may be held at any set of its ages), admission is
    free, reuses count block by block without the prefix constraint, and each class's
    statistics (each epoch's, with ``epochs``) are known exactly: optimistic in all of these,
    so an upper bound for that family. A deterministic rule of the family is the case of
    probabilities 0 and 1; keep-until rules are the case of a window that starts at age 0.

    The family does *not* contain rules whose decision for a cell moves with the tier's load
    within an epoch (a priority order that evicts the lowest-ranked block when
    the tier is full, as eviction/density.py does): the rule is a table, not an order. Nor
    does it contain the rules of :func:`class_bound` and :func:`window_bound`, which hold
    their capacity on average only (a real tier cannot), so it is lower than both.

    The LP (one variable per cell with a reuse, one capacity row per ``step`` accesses: the
    blocks held summed over the step, at most ``capacity * step``; merging rows relaxes the
    per-tick rows, so the bound stays a bound) is solved through its dual, and ``bound`` is the
    dual's value at the multipliers found, a true upper bound however far the solver got;
    ``feasible`` is a rule of the relaxation it found, so the gap shows how tight it is.
    Epochs are independent LPs (a row involves only its epoch's cells), summed."""
    if step < 1 or epochs < 1:
        raise ValueError(f"step and epochs must be >= 1, got step={step}, epochs={epochs}")
    load, hit_cell, hit_tick = _cell_occupancy(segments, age_grid(segments.accesses, ratio), step)
    rows = load.shape[1]
    per = max(-(-rows // epochs), 1)
    bound = feasible = 0.0
    cells = 0
    for first in range(0, rows, per):
        last = min(first + per, rows)
        inside = (hit_tick > first * step) & (hit_tick <= last * step)
        v = np.bincount(hit_cell[inside], minlength=load.shape[0]).astype(np.float64)
        used = v > 0
        b, f = _packing_dual(v[used], load[used, first:last] / (capacity * step), iterations)
        bound, feasible, cells = bound + b, feasible + f, cells + int(used.sum())
    return InstantBound(bound, feasible, cells, rows)


def priority_order_hits(segments: ClassSegments, capacity: int, ratio: float | None = None) -> float:
    """The block hits of one rule that :func:`instant_window_bound`'s family leaves out: a
    *priority order* over the same (class, age cell)s, ranked by each cell's whole-trace reuses
    per unit of space-time (exact statistics known in advance, as for the bounds), that holds
    at every access tick the ``capacity`` blocks of the best-ranked cells (prefetch free and
    instant, as for the bounds; the cell on the edge is held in part, a random share of its
    blocks, so this is an expected count, with no tie broken by the future). Its cut moves
    with the tier's load, which no table does. Not a bound: one rule's hits, so a lower bound
    on the best priority order's."""
    load, hit_cell, hit_tick = _cell_occupancy(segments, age_grid(segments.accesses, ratio), 1)
    if not load.size:
        return 0.0
    reuses = np.bincount(hit_cell, minlength=load.shape[0]).astype(np.float64)
    order = np.argsort(-reuses / np.maximum(load.sum(axis=1), 1.0), kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    tick = hit_tick - 1
    above = np.zeros(tick.size)
    for first in range(0, load.shape[1], 65_536):  # the running total over ranks, a slice of ticks at a time
        inside = (tick >= first) & (tick < first + 65_536)
        held = np.cumsum(load[order, first : first + 65_536], axis=0)
        r, t = rank[hit_cell[inside]], tick[inside] - first
        above[inside] = np.where(r > 0, held[np.maximum(r - 1, 0), t], 0.0)
    share = (capacity - above) / np.maximum(load[hit_cell, tick], 1.0)
    return float(np.clip(share, 0.0, 1.0).sum())
