"""A request-granular simulator of a prefix-closed single-tier cache, for trying eviction orders.

Every resident block belongs to the request that touched it last (its *group*); a request reads
its hit prefix (the blocks become its group's), then puts the rest. Room is made by taking
blocks from the tail of the group that ``score`` ranks worst (evicted first), a group whose
tail block still has a resident child (an older branch) being skipped until that branch is
gone. Within a group blocks leave deepest first, as in the store's prefix-closed orders.

``score(state, now)`` is called once per make-room with every group (request id) holding
blocks; higher = evicted first. This is a lab tool: it replays the trace, not the store, and
its LRU is within a fraction of a point of the store's.

    python -m tools.lab.evict.groupsim TRACE --capacity 5% --order lru --order oracle
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tools.replay.trace import Trace, load_trace
from tools.replay.yardsticks import next_use


@dataclass
class State:
    trace: Trace
    lens: np.ndarray
    ts: np.ndarray
    pred: np.ndarray  # request whose chain a request extends (deepest hit block's last reader), -1
    hit: np.ndarray   # hit prefix length against an unlimited cache
    full: np.ndarray  # request extends all (or all but the last block) of pred
    nxt_req: np.ndarray  # true next request that re-reads a request's last block (oracle only)
    chain_gap: dict[int, float] = field(default_factory=dict)  # request -> typical gap of its lineage
    chain_n: dict[int, int] = field(default_factory=dict)  # request -> requests in its lineage
    superseded: set[int] = field(default_factory=set)  # requests whose tail a later request left


def structure(t: Trace) -> State:
    off = t.offsets.tolist()
    ids = t.block_ids.tolist()
    n = t.num_requests
    lens = np.diff(t.offsets)
    last: dict[int, int] = {}
    pred = np.full(n, -1)
    hit = np.zeros(n, int)
    for r in range(n):
        b = ids[off[r] : off[r + 1]]
        k = 0
        for x in b:
            if x in last:
                k += 1
            else:
                break
        hit[r] = k
        if k:
            pred[r] = last[b[k - 1]]
        for x in b:
            last[x] = r
    full = np.array([pred[r] >= 0 and hit[r] >= lens[pred[r]] - 1 for r in range(n)])
    nu = next_use(t)
    nxt_req = np.array([nu[off[r + 1] - 1] for r in range(n)])
    return State(t, lens, t.timestamps_ms / 1000.0, pred, hit, full, nxt_req)


Score = Callable[[State, list[int], float], np.ndarray]


def simulate(st: State, capacity: int, score: Score, observe: Callable[[State, int], None] | None = None) -> float:
    t = st.trace
    off = t.offsets.tolist()
    ids = t.block_ids.tolist()
    parent: dict[int, int] = {}
    owner: dict[int, int] = {}
    kids: collections.Counter[int] = collections.Counter()
    groups: dict[int, list[int]] = {}  # request -> its blocks in depth order (lazy: owner check)
    hits = 0
    size = 0

    def take(g: int, room: int) -> tuple[int, bool]:
        """Evict up to ``room`` blocks from group ``g``'s tail, deepest first: how many, and
        whether it stopped at a block with a resident child (a branch elsewhere)."""
        bl = groups[g]
        taken = 0
        while bl and taken < room:
            x = bl[-1]
            if owner.get(x) != g:
                bl.pop()
                continue
            if kids[x]:
                return taken, True
            bl.pop()
            del owner[x]
            p = parent.pop(x, -1)
            if p >= 0:
                kids[p] -= 1
            taken += 1
        return taken, False

    for r in range(t.num_requests):
        now = float(st.ts[r])
        b = ids[off[r] : off[r + 1]]
        k = 0
        for x in b:
            if x in owner:
                k += 1
            else:
                break
        hits += k
        if observe is not None:
            observe(st, r)
        for x in b[:k]:
            owner[x] = r
        groups[r] = list(b)
        new = len(b) - k
        # make room
        need = size + new - capacity
        if need > 0:
            live = [g for g, bl in groups.items() if g != r and _has(bl, owner, g)]
            sc = score(st, live, now)
            order = [live[i] for i in np.argsort(-sc, kind="stable")]
            freed = 0
            blocked: list[int] = []
            for g in order:
                got, stuck = take(g, need - freed)
                freed += got
                if stuck:
                    blocked.append(g)
                if freed >= need:
                    break
            # a blocked group (its tail has a child elsewhere) is retried once its branches went
            for g in blocked:
                freed += take(g, need - freed)[0]
            size -= freed
            if size + new > capacity:  # could not make room: put only what fits (rare)
                new = max(capacity - size, 0)
        prev = b[k - 1] if k else -1
        for x in b[k : k + new]:
            owner[x] = r
            if prev >= 0:
                parent[x] = prev
                kids[prev] += 1
            prev = x
        size += new
        groups[r] = b[: k + new]
        for g in [g for g, bl in groups.items() if not _has(bl, owner, g)]:
            del groups[g]
    return hits / t.num_blocks


def _has(bl: list[int], owner: dict[int, int], g: int) -> bool:
    while bl and owner.get(bl[-1]) != g:
        bl.pop()
    return bool(bl)


# ---- orders -------------------------------------------------------------------------------------


def lru(st: State, live: list[int], now: float) -> np.ndarray:
    return -st.ts[live]


def oracle(st: State, live: list[int], now: float) -> np.ndarray:
    return st.nxt_req[live].astype(float)


ORDERS: dict[str, Score] = {"lru": lru, "oracle": oracle}


def main(argv: list[str] | None = None) -> int:
    from tools.lab.evict.orders import _blocks
    from tools.lab.replay import tool

    p = tool.parser("python -m tools.lab.evict.groupsim", __doc__)
    p.add_argument("--capacity", action="append", default=None, help="a share of unique blocks or a number of blocks (default 5%%)")
    p.add_argument("--order", action="append", default=None, choices=sorted(ORDERS), help="default lru")

    def run(a: argparse.Namespace) -> int:
        t = load_trace(a.trace)
        st = structure(t)
        for cap in a.capacity or ["5%"]:
            c = _blocks(cap, t.unique_blocks)
            for name in a.order or ["lru"]:
                print(f"{cap}\t{name}\t{simulate(st, c, ORDERS[name]):.4f}", flush=True)
        return 0

    return tool.run(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
