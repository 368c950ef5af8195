"""What predicts that an agent session's chain is read again soon, and what orders of chains
built on it would get (issue 32), on the request-granular simulator of ``groupsim``.

    python -m tools.lab.evict.orders TRACE [--capacity 5%] [--order NAME ...] [--features]

``--features`` prints, per bucket of a feature known when a request arrives (its growth over
the request it extends, the gap before it, its place in its lineage, its length), the share of
requests that no later request extends (dead) and the gap to the one that does. The orders
(``--order``, default all) rank the groups of resident blocks (one per request that touched them
last; highest first out):

* ``lru``: idle time (the store's LRU, exactly).
* ``oracle``: the true next request that re-reads the group's last block (request-level
  Belady; an upper bound for any order of whole chains).
* ``oracle_dead``: LRU, with the groups of lineages that never continue first (what perfect
  knowledge of finished sessions alone is worth).
* ``superseded``: LRU, with a group first once a later request has branched off it (shares a
  prefix with it but does not extend it): an online signal of a finished or restarted chain.
* ``ratio``: hit density by idle time in units of the lineage's own typical gap (a running
  mean of its log gaps), learned online from the gaps seen so far (and lineages idle over an
  hour as never returning), divided by the gap; superseded groups first.
* ``ratio_plain``: ``ratio`` without the superseded signal.
* ``ratio_dead``: ``ratio`` with the groups of lineages that never continue first (an oracle:
  what rhythm and perfect knowledge of finished sessions get together).

``--dead-after S`` makes ``oracle_dead`` learn that a lineage has ended only once it has been idle
``S`` seconds (how late a sign of a finished session may come and still pay).

The simulator knows which request a request extends even when that chain was evicted (the
store would need a ghost of it), so ``ratio`` is an optimistic estimate of a store policy.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys

import numpy as np

from kvstore.errors import ConfigError
from tools.lab.evict.groupsim import State, simulate, structure
from tools.lab.replay import tool
from tools.replay.trace import load_trace

_GRID = np.concatenate(([0.0], np.geomspace(0.01, 1e6, 300)))


def lineage(st: State) -> tuple[np.ndarray, np.ndarray]:
    """Per request: the next request of its lineage (-1: none) and the lineage's id."""
    n = st.trace.num_requests
    nxt = np.full(n, -1)
    lin = np.full(n, -1)
    count = 0
    for r in range(n):
        p = st.pred[r]
        if st.full[r] and nxt[p] < 0:
            nxt[p] = r
            lin[r] = lin[p]
        else:
            lin[r] = count
            count += 1
    return nxt, lin


def typical_gap(st: State, prior: float = 15.0) -> np.ndarray:
    """Per request, exp of the mean log gap of its lineage so far (``prior`` for a first one)."""
    n = st.trace.num_requests
    lg = np.zeros(n)
    k = np.zeros(n, int)
    for r in range(n):
        p = st.pred[r]
        if st.full[r]:
            g = max(st.ts[r] - st.ts[p], 0.5)
            lg[r] = (lg[p] * k[p] + math.log(g)) / (k[p] + 1) if k[p] else math.log(g)
            k[r] = k[p] + 1
        else:
            lg[r] = math.log(prior)
    return np.exp(lg)


def superseded_at(st: State) -> np.ndarray:
    """Per request, when a later request first branched off it (inf: never)."""
    out = np.full(st.trace.num_requests, np.inf)
    for r in range(st.trace.num_requests):
        p = st.pred[r]
        if p >= 0 and not st.full[r]:
            out[p] = min(out[p], st.ts[r])
    return out


def features(st: State) -> None:
    nxt, lin = lineage(st)
    n = st.trace.num_requests
    gap = np.array([st.ts[nxt[r]] - st.ts[r] if nxt[r] >= 0 else np.inf for r in range(n)])
    growth = np.array([st.lens[r] - st.lens[st.pred[r]] if st.full[r] else st.lens[r] for r in range(n)])
    prev = np.array([st.ts[r] - st.ts[st.pred[r]] if st.full[r] else -1.0 for r in range(n)])
    seen: collections.Counter[int] = collections.Counter()
    place = np.zeros(n, int)
    for r in range(n):
        seen[lin[r]] += 1
        place[r] = seen[lin[r]]
    print(f"requests {n}, lineages {lin.max() + 1}, dead (no later request extends it) {np.mean(np.isinf(gap)):.3f}")
    print(f"gap to the next request of the lineage, p10/50/90/99: {np.percentile(gap[np.isfinite(gap)], [10, 50, 90, 99]).round(1).tolist()}")
    for name, x, edges in (
        ("growth (blocks)", growth, [5, 10, 20, 50, 100, 300]),
        ("gap before (s)", prev, [0, 10, 15, 30, 60, 120, 600]),
        ("place in lineage", place, [2, 3, 5, 10, 20, 50]),
        ("length (blocks)", st.lens, [300, 600, 1000, 2000, 4000]),
    ):
        b = np.digitize(x, edges)
        for k in range(len(edges) + 1):
            m = b == k
            if not m.any():
                continue
            g = gap[m]
            fin = g[np.isfinite(g)]
            hi = edges[k] if k < len(edges) else "inf"
            q = np.percentile(fin, [50, 90]).round(0).tolist() if fin.size else [-1, -1]
            print(f"  {name} < {hi}: n={int(m.sum())} dead={np.mean(np.isinf(g)):.2f} gap p50/p90={q}")


class RatioOrder:
    """Hit density by idle time over the lineage's typical gap, learned online."""

    def __init__(self, st: State, superseded: bool, horizon: float = 4.0, never_after: float = 3600.0) -> None:
        self.st = st
        self.g = typical_gap(st)
        self.sup = superseded_at(st) if superseded else None
        self.horizon = horizon
        self.never_after = never_after
        self.samples: list[float] = []
        self.open: dict[int, float] = {}
        self.table: np.ndarray | None = None
        self.last = -1

    def observe(self, st: State, r: int) -> None:
        p = st.pred[r]
        if st.full[r]:
            self.samples.append((st.ts[r] - st.ts[p]) / self.g[p])
            self.open.pop(p, None)
        self.open[r] = float(st.ts[r])
        if r - self.last >= 50 and len(self.samples) > 20:
            self.last = r
            now = float(st.ts[r])
            never = [1e9 for t in self.open.values() if now - t > self.never_after]
            self.table = _table(np.sort(np.array(self.samples + never)), self.horizon)

    def score(self, st: State, live: list[int], now: float) -> np.ndarray:
        ids = np.asarray(live, dtype=np.int64)
        idle = now - st.ts[ids]
        if self.table is None:
            return idle
        d = -np.interp(idle / self.g[ids], _GRID, self.table) / self.g[ids]
        if self.sup is not None:
            d = d + 1e9 * (self.sup[ids] <= now)
        return d


def _blocks(cap: str, unique: int) -> int:
    """A capacity, ``5%`` of the unique blocks or a number of blocks."""
    try:
        n = int(float(cap[:-1]) / 100 * unique) if cap.endswith("%") else int(cap)
    except ValueError:
        raise ConfigError(f"capacity {cap!r}: write a share ('5%') or a number of blocks") from None
    if n <= 0:
        raise ConfigError(f"capacity {cap!r} holds no block (of {unique} unique)")
    return n


def _table(s: np.ndarray, horizon: float) -> np.ndarray:
    out = np.zeros(_GRID.size)
    for j, a in enumerate(_GRID):
        tail = s[np.searchsorted(s, a, side="right") :]
        if tail.size:
            out[j] = np.mean(tail <= a + horizon) / max(float(np.mean(np.minimum(tail, a + horizon) - a)), 1e-3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = tool.parser("python -m tools.lab.evict.orders", __doc__)
    p.add_argument("--capacity", action="append", default=None, help="a share of unique blocks (default 5%% and 10%%)")
    p.add_argument("--order", action="append", default=None, choices=ORDERS, help="an order to replay (default all)")
    p.add_argument("--features", action="store_true", help="print what predicts a chain's next read")
    p.add_argument("--horizon", type=float, default=4.0, metavar="G",
                   help="the ratio orders: hits counted within G typical gaps (default 4)")
    p.add_argument("--dead-after", type=float, default=0.0, metavar="S",
                   help="oracle_dead: a finished lineage is known as such once idle S seconds (default 0: at once)")
    return tool.run(_run, p.parse_args(argv))


ORDERS = ("lru", "oracle", "oracle_dead", "superseded", "ratio", "ratio_plain", "ratio_dead")


def _run(a: argparse.Namespace) -> int:
    t = load_trace(a.trace)
    st = structure(t)
    if a.features:
        features(st)
    nxt, _ = lineage(st)
    dead = nxt < 0
    sup = superseded_at(st)
    simple = {
        "lru": lambda s, live, now: now - s.ts[live],
        "oracle": lambda s, live, now: s.nxt_req[live].astype(float),
        "oracle_dead": lambda s, live, now: now - s.ts[live] + 1e9 * (dead[live] & (now - s.ts[live] > a.dead_after)),
        "superseded": lambda s, live, now: now - s.ts[live] + 1e9 * (sup[live] <= now),
    }
    names = a.order or list(ORDERS)
    for cap in a.capacity or ["5%", "10%"]:
        c = _blocks(cap, t.unique_blocks)
        for name in names:
            if name in simple:
                rate = simulate(st, c, simple[name])
            else:
                o = RatioOrder(st, superseded=name != "ratio_plain", horizon=a.horizon)
                score = o.score
                if name == "ratio_dead":
                    score = lambda s, live, now, f=o.score: f(s, live, now) + 1e10 * dead[live]  # noqa: E731
                rate = simulate(st, c, score, o.observe)
            print(f"{cap}\t{name}\t{rate:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
