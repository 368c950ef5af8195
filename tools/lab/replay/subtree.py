"""What refusing a block with its subtree costs, counted exactly: the last tier's admission
frontier for rules that refuse by class (issue 18).

The store's ``inner`` admission refuses a block leaving the next-to-last tier together with its
whole cached subtree (eviction/admission.py). What that loses is every hit the trace would have
had on the block *and on each of its cached descendants* before they are put again, and what it
saves is the block's write plus those of its descendants that were not written yet. Both follow
from the trace and from the decisions a store-all run records (economics.ClassRecorder: when,
which block, in which class, and whether its subtree was free to go), replayed here against the
trace's prefix tree:

* a block is *absent* from its refusal (its own or an ancestor's) until the trace reads it
  again; that read is a lost hit (a store storing everything keeps every block of these traces:
  the object tier holds them all, the TTL outlives the trace), and the request puts it back;
* a decision about an absent block is no write (the block is not in the store); a block put
  back after its store-all decision had passed costs one write more (it will leave the
  next-to-last tier again: counted as written, the pessimistic side for a write count);
* only a decision whose subtree was free in the store-all run (no descendant above the
  demoting tier or in use) may refuse, as in the store.

This is exact for the loss of every refusal against the store-all run's decision stream; it
keeps that stream's timing (a block put back leaves the upper tiers at another time than it
did there). The rules of a class set skip a subset of classes; the subset is chosen greedily,
by each class's exact standalone cost (hits lost per write saved, refusing that class alone),
and every candidate subset is then replayed exactly, with the interactions between classes. So
each frontier point is what a rule of those classes *attains* with perfect statistics; the
greedy choice is the knapsack's ratio heuristic, not a proof that no subset does better.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eviction.admission import LEARNED_CROSSES, LEARNED_EDGES
from eviction.online_model import ModelConfig, OnlineModel
from tools.replay.sim import EPOCH
from tools.replay.trace import Trace


@dataclass(frozen=True, slots=True)
class TraceTree:
    """The trace's prefix tree in preorder (a block's subtree is ``order[tin[b]:tout[b]]``),
    with when each block is first and next read."""

    parent: np.ndarray
    order: np.ndarray
    tin: np.ndarray
    tout: np.ndarray
    first_req: np.ndarray
    """Per block id, the request that first reads it."""
    new_after: np.ndarray
    """Per request, how many distinct blocks the trace has read up to and including it."""
    access_keys: np.ndarray
    """Sorted ``block * (requests + 1) + request`` of every access: next reads by search."""

    @classmethod
    def of(cls, trace: Trace, parent: np.ndarray) -> TraceTree:
        n, reqs = parent.size, trace.num_requests
        kids = np.argsort(parent, kind="stable")
        kids = kids[parent[kids] >= 0]
        starts = np.searchsorted(parent[kids], np.arange(n + 1))
        order = np.empty(n, np.int64)
        tout = np.empty(n, np.int64)
        pos = 0
        roots = np.flatnonzero(parent < 0)[::-1].tolist()
        stack: list[int] = roots  # a block, or ~block: its subtree closes here
        lo, hi, ks = starts.tolist(), starts[1:].tolist(), kids.tolist()
        while stack:
            b = stack.pop()
            if b < 0:
                tout[~b] = pos
                continue
            order[pos] = b
            pos += 1
            stack.append(~b)
            stack.extend(reversed(ks[lo[b] : hi[b]]))
        tin = np.empty(n, np.int64)
        tin[order] = np.arange(n)
        req = np.repeat(np.arange(reqs, dtype=np.int64), np.diff(trace.offsets))
        ids = trace.block_ids.astype(np.int64)
        first = np.full(n, reqs, np.int64)
        np.minimum.at(first, ids, req)
        new = np.cumsum(np.bincount(first[first < reqs], minlength=reqs))
        keys = np.sort(ids * (reqs + 1) + req)
        return cls(parent, order, tin, tout, first, new, keys)

    def request_at(self, live_blocks: int) -> int:
        """The request during (or right after) which a store that keeps every block holds
        ``live_blocks``: its decisions are taken after that request's reads."""
        return int(np.searchsorted(self.new_after, live_blocks, side="left"))

    def seen_subtree(self, b: int, r: int) -> np.ndarray:
        """``b`` and its descendants read by request ``r`` (a store-all run holds them all)."""
        rng = self.order[self.tin[b] : self.tout[b]]
        return rng[self.first_req[rng] <= r]

    def next_read(self, blocks: np.ndarray, r: int, reqs: int) -> np.ndarray:
        """Per block, the first request after ``r`` that reads it, or ``reqs``."""
        keys = self.access_keys
        want = blocks * (reqs + 1) + r
        j = np.searchsorted(keys, want, side="right")
        j = np.minimum(j, keys.size - 1)
        hit = keys[j] // (reqs + 1) == blocks
        hit &= keys[j] > want
        return np.where(hit, keys[j] % (reqs + 1), reqs)

    def last_read(self, blocks: np.ndarray, r: np.ndarray | int, reqs: int) -> np.ndarray:
        """Per block, the last request at or before ``r`` that reads it, or -1."""
        keys = self.access_keys
        j = np.searchsorted(keys, blocks * (reqs + 1) + r, side="right") - 1
        k = keys[np.maximum(j, 0)]
        return np.where((j >= 0) & (k // (reqs + 1) == blocks), k % (reqs + 1), -1)


@dataclass(frozen=True, slots=True)
class Decisions:
    """A store-all run's decisions at the last tier, in order."""

    req: np.ndarray
    """The request after whose reads each was taken (:meth:`TraceTree.request_at`)."""
    block: np.ndarray
    free: np.ndarray
    """Whether the block's cached subtree could have left with it (the store's check)."""

    def first_decision(self, n: int, reqs: int) -> np.ndarray:
        """Per block id, the request of its first decision, or ``reqs`` (never decided)."""
        out = np.full(n, reqs, np.int64)
        np.minimum.at(out, self.block, self.req)
        return out


@dataclass(frozen=True, slots=True)
class Outcome:
    writes: int
    """Last-tier writes: decisions written, and blocks put back after their decision passed."""
    lost: int
    """Hits lost: reads of blocks absent since a refusal."""
    refused: int
    cut: int
    """Descendants that left with a refused block."""
    rewrites: int
    """Of ``writes``, the blocks put back after their store-all decision had passed."""


def replay_refusals(trace: Trace, tree: TraceTree, dec: Decisions, skip: np.ndarray) -> Outcome:
    """The exact writes and lost hits of refusing the decisions marked in ``skip`` (only free
    ones refuse), each refusal taking the block's cached subtree (module docstring)."""
    reqs = trace.num_requests
    n = tree.parent.size
    decided = dec.first_decision(n, reqs)
    absent = np.zeros(n, bool)
    n_absent = writes = lost = rewrites = refused = cut = 0
    offsets = trace.offsets
    ids = trace.block_ids.astype(np.int64)
    order, tin, tout, first = tree.order, tree.tin, tree.tout, tree.first_req
    d_req, d_blk = dec.req.tolist(), dec.block.tolist()
    refuse = (skip & dec.free).tolist()
    i, total = 0, len(d_req)
    for r in range(reqs):
        if n_absent:
            chain = ids[offsets[r] : offsets[r + 1]]
            back = chain[absent[chain]]
            if back.size:
                lost += back.size
                rewrites += int((decided[back] < r).sum())
                absent[back] = False
                n_absent -= back.size
        while i < total and d_req[i] <= r:
            b = d_blk[i]
            if absent[b]:
                pass  # gone with an earlier refusal: not in the store, nothing to write
            elif refuse[i]:
                rng = order[tin[b] : tout[b]]
                sel = rng[(first[rng] <= r) & ~absent[rng]]
                absent[sel] = True
                n_absent += sel.size
                refused += 1
                cut += sel.size - 1
            else:
                writes += 1
            i += 1
    return Outcome(writes + rewrites, lost, refused, cut, rewrites)


def standalone_costs(trace: Trace, tree: TraceTree, dec: Decisions) -> tuple[np.ndarray, np.ndarray]:
    """Per decision, refusing it alone (if free): the hits it loses (the block and every
    cached descendant read again) and the writes it saves (the block's and its descendants'
    still to come and not preceded by a read, less one for each block read again after its
    decision passed)."""
    reqs = trace.num_requests
    decided = dec.first_decision(tree.parent.size, reqs)
    lost = np.zeros(dec.req.size)
    saved = np.zeros(dec.req.size)
    for i in np.flatnonzero(dec.free).tolist():
        r, b = int(dec.req[i]), int(dec.block[i])
        seen = tree.seen_subtree(b, r)
        nxt = tree.next_read(seen, r, reqs)
        back = nxt < reqs
        d = decided[seen]
        lost[i] = back.sum()
        saved[i] = ((d >= r) & (nxt > d)).sum() - (back & (d < nxt)).sum()
    return lost, saved


@dataclass(frozen=True, slots=True)
class FrontierPoint:
    budget: float
    classes_skipped: int
    outcome: Outcome
    share_of_next: float = 0.0
    """The share of the next class in the ranking refused too."""


def class_frontier(trace: Trace, tree: TraceTree, dec: Decisions, classes: np.ndarray, hits: int,
                   budgets: tuple[float, ...] = (0.0025, 0.005, 0.01, 0.02, 0.05),
                   costs: tuple[np.ndarray, np.ndarray] | None = None,
                   order: np.ndarray | None = None) -> list[FrontierPoint]:
    """Per hit-loss budget (a share of ``hits``, the store-all run's), the fewest writes found
    for a rule that skips whole ``classes`` (one per decision) with subtree refusals: classes
    ranked by their standalone hits lost per write saved (``order`` overrides the ranking: class
    ids, first skipped first), each prefix of the ranking replayed exactly, the longest one
    within the budget kept (and its neighbours checked, the loss not being monotone)."""
    uniq, inv = np.unique(classes, return_inverse=True)
    if order is None:
        lost, saved = costs if costs is not None else standalone_costs(trace, tree, dec)
        lc = np.bincount(inv, weights=lost, minlength=uniq.size)
        sc = np.bincount(inv, weights=saved, minlength=uniq.size)
        useful = np.flatnonzero(sc > 0)
        ranked = useful[np.argsort(lc[useful] / sc[useful], kind="stable")]
    else:
        ranked = np.searchsorted(uniq, order)
    cache: dict[int, Outcome] = {}
    # A fixed pseudo-random share of each decision (the golden-ratio sequence): a rule may
    # refuse a share p of a class, the decisions with share < p.
    share = (np.arange(classes.size) * 0.6180339887498949) % 1.0

    def mask_of(k: int, p: float = 0.0) -> np.ndarray:
        mask = np.zeros(uniq.size, bool)
        mask[ranked[:k]] = True
        skip = mask[inv]
        if p > 0 and k < ranked.size:
            skip |= (inv == ranked[k]) & (share < p)
        return skip

    def at(k: int) -> Outcome:
        if k not in cache:
            cache[k] = replay_refusals(trace, tree, dec, mask_of(k))
        return cache[k]

    out = []
    for budget in budgets:
        allowed = budget * hits
        lo, hi = 0, int(ranked.size)  # at(lo) within the budget (lo = 0 refuses nothing)
        if at(hi).lost <= allowed:
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if at(mid).lost <= allowed:
                lo = mid
            else:
                hi = mid
        best = lo
        for k in range(max(lo - 3, 0), min(lo + 4, int(ranked.size)) + 1):
            if at(k).lost <= allowed and at(k).writes < at(best).writes:
                best = k
        # Then the next class in part: the largest share of it within the budget.
        result, p_lo, p_hi = at(best), 0.0, 1.0
        for _ in range(6 if best < ranked.size else 0):
            p = (p_lo + p_hi) / 2
            o = replay_refusals(trace, tree, dec, mask_of(best, p))
            if o.lost <= allowed:
                p_lo = p
                if o.writes < result.writes:
                    result = o
            else:
                p_hi = p
        out.append(FrontierPoint(budget, best, result, p_lo))
    return out


@dataclass(frozen=True, slots=True)
class Holdout:
    writes_per_hit: float
    hit_loss: float
    """Both of the second half: its decisions' writes and its lost hits, per store-all hit of
    its requests."""


def holdout(trace: Trace, tree: TraceTree, dec: Decisions, classes: np.ndarray, hits_per_request: np.ndarray,
            budget: float, costs: tuple[np.ndarray, np.ndarray]) -> Holdout:
    """What the class statistics are worth *learned* rather than known: the classes are ranked
    and the skip set chosen (the longest prefix of the ranking within ``budget`` of the first
    half's hits) on the decisions of the first half of the requests only, then applied to the
    second half's decisions (the first half's are all written)."""
    mid = trace.num_requests // 2
    first = dec.req < mid
    h1, h2 = float(hits_per_request[:mid].sum()), float(hits_per_request[mid:].sum())
    uniq, inv = np.unique(classes, return_inverse=True)
    lc = np.bincount(inv[first], weights=costs[0][first], minlength=uniq.size)
    sc = np.bincount(inv[first], weights=costs[1][first], minlength=uniq.size)
    useful = np.flatnonzero(sc > 0)
    ranked = useful[np.argsort(lc[useful] / sc[useful], kind="stable")]

    def run(k: int, which: np.ndarray) -> Outcome:
        mask = np.zeros(uniq.size, bool)
        mask[ranked[:k]] = True
        return replay_refusals(trace, tree, dec, mask[inv] & which)

    lo, hi = 0, int(ranked.size) + 1
    while hi - lo > 1:
        k = (lo + hi) // 2
        if run(k, first).lost <= budget * h1:
            lo = k
        else:
            hi = k
    o = run(lo, ~first)
    return Holdout(round((o.writes - int(first.sum())) / max(h2, 1.0), 6), round(o.lost / max(h2, 1.0), 6))


def learned_scores(trace: Trace, tree: TraceTree, dec: Decisions, times: np.ndarray, features: np.ndarray,
                   horizon_s: float = 1200.0, config: ModelConfig | None = None, batch: int = 512) -> np.ndarray:
    """Per decision, the probability that its block is read again within ``horizon_s``, as
    the ``learned`` admission rule's model (eviction/online_model.py over
    eviction/admission.py's ``LEARNED_FEATURES``) predicts it *online*: fitted only on the
    decisions whose horizon had passed (their labels from the trace), refitted as the rule
    refits, in batches of ``batch`` decisions; 1.0 before the first fit (nothing skipped)."""
    cfg = config or ModelConfig(window=1 << 15, refit_every=4096, min_samples=2048)
    model = OnlineModel(LEARNED_EDGES, LEARNED_CROSSES, cfg)
    reqs = trace.num_requests
    n = dec.block.size
    out = np.ones(n)
    if not n:
        return out
    nxt = tree.next_read(dec.block, dec.req, reqs)
    stamps = EPOCH + trace.timestamps_ms / 1000.0
    again = np.where(nxt < reqs, stamps[np.minimum(nxt, reqs - 1)], np.inf) - times <= horizon_s
    cols = model.encode_many(features)
    known = times + horizon_s  # when each label is final (decisions are in time order)
    seen = 0
    for lo in range(0, n, batch):
        final = int(np.searchsorted(known, times[lo], side="right"))
        if final > seen:
            model.observe_many(cols[seen:final], again[seen:final])
            seen = final
        if model.ready:
            out[lo : lo + batch] = model.predict_many(cols[lo : lo + batch])
    return out


def score_frontier(trace: Trace, tree: TraceTree, dec: Decisions, score: np.ndarray, hits: int,
                   budgets: tuple[float, ...] = (0.01,), steps: int = 8) -> list[FrontierPoint]:
    """Per budget, the fewest writes of refusing the decisions scored lowest (the largest share
    of the scored decisions, ``score < 1``, whose refusal stays within the budget: a binary
    search of ``steps`` exact replays). The share is chosen knowing the whole trace, so this is
    what the scores' *ranking* is worth, with the threshold set in hindsight
    (``FrontierPoint.share_of_next`` holds the share)."""
    scored = np.flatnonzero(score < 1.0)
    order = scored[np.argsort(score[scored], kind="stable")]

    def run(share: float) -> Outcome:
        skip = np.zeros(score.size, bool)
        skip[order[: int(share * order.size)]] = True
        return replay_refusals(trace, tree, dec, skip)

    out = []
    for budget in budgets:
        allowed = budget * hits
        lo, hi, best = 0.0, 1.0, run(0.0)
        top = run(1.0)
        if top.lost <= allowed:
            out.append(FrontierPoint(budget, 0, top, 1.0))
            continue
        for _ in range(steps):
            mid = (lo + hi) / 2
            o = run(mid)
            if o.lost <= allowed:
                lo, best = mid, o
            else:
                hi = mid
        out.append(FrontierPoint(budget, 0, best, lo))
    return out
