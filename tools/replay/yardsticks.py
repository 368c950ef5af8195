"""The yardsticks every policy is compared with: an unlimited cache and Belady's optimum.

Both use the replay's semantics: a request looks up its blocks first (a block hits only if every
earlier block of the request hit), then inserts them. They are simulations over the trace, not
store runs: Belady needs the future, which no store has.

Belady (OPT) evicts the block whose next use lies furthest ahead; a block never used again goes
first, so it is never kept at the expense of one that will be. Blocks used next by the same
request tie; ``ties="deep"`` evicts the deeper one first, which keeps the cache prefix-closed (a
block's next use is never later than its child's) and is the true optimum for longest-prefix
hits. ``ties="shallow"`` evicts the shallower one and reproduces the published figures in
traces/README.md exactly (0.243 against 0.246 at 1% of the conversation trace).
"""

from __future__ import annotations

import heapq

import numpy as np

from tools.replay.trace import Trace

NEVER = np.iinfo(np.int64).max


def prefix_hits(cached: np.ndarray) -> int:
    """Leading blocks of one request that are set in ``cached`` (a bool per block id)."""
    miss = np.flatnonzero(~cached)
    return int(miss[0]) if miss.size else int(cached.size)


def unlimited(trace: Trace) -> np.ndarray:
    """Per request, the blocks an unlimited cache hits."""
    seen = np.zeros(trace.unique_blocks, dtype=bool)
    hits = np.zeros(trace.num_requests, dtype=np.int64)
    for r in range(trace.num_requests):
        ids = trace.blocks(r)
        hits[r] = prefix_hits(seen[ids])
        seen[ids] = True
    return hits


def next_use(trace: Trace) -> np.ndarray:
    """For every block access (aligned with ``trace.block_ids``), the index of the next request
    that uses the block, or :data:`NEVER`."""
    req = np.repeat(np.arange(trace.num_requests), np.diff(trace.offsets))
    ids = trace.block_ids
    order = np.lexsort((np.arange(ids.size), ids))  # by block, then by time
    nxt = np.full(ids.size, NEVER, dtype=np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = req[order[1:][same]]
    return nxt


def belady(trace: Trace, capacity: int, ties: str = "deep") -> np.ndarray:
    """Per request, the blocks Belady's offline policy hits with room for ``capacity`` blocks."""
    if ties not in ("deep", "shallow"):
        raise ValueError(f"ties must be 'deep' or 'shallow', got {ties!r}")
    sign = -1 if ties == "deep" else 1
    nxt = next_use(trace).tolist()
    offsets = trace.offsets.tolist()
    all_ids = trace.block_ids.tolist()
    cached: dict[int, int] = {}  # block -> its next use, as pushed on the heap
    heap: list[tuple[int, int, int]] = []  # (-next use, tie, block); stale entries skipped
    hits = np.zeros(trace.num_requests, dtype=np.int64)
    push, pop = heapq.heappush, heapq.heappop
    for r in range(trace.num_requests):
        lo, hi = offsets[r], offsets[r + 1]
        k = 0
        for i in range(lo, hi):
            if all_ids[i] not in cached:
                break
            k += 1
        hits[r] = k
        for d, i in enumerate(range(lo, hi)):
            b, n = all_ids[i], nxt[i]
            cached[b] = n
            push(heap, (-n, sign * d, b))
        while len(cached) > capacity:
            n, _, b = pop(heap)
            if cached.get(b) == -n:
                del cached[b]
    return hits
