"""Tier economics of a replay: which tier serves the hits, and what is written for them.

With several tiers (``--capacity dram=5%,nvme=25%,object=inf``) a 72-hour cache keeps close to
the unlimited cache's hit rate; what placement decides is how many hits the fast tier serves
(latency), and what admission decides is how many blocks are written into the paid last tier for
each hit (cost). Per (policy, capacity) the replay reports:

* hits by tier: the share of hit blocks (and bytes: every block is one KV block of the model's
  layout, so the byte shares equal the block shares) served from each tier;
* writes per tier, in blocks, and the last tier's writes per hit block (= bytes per hit byte);
* with an admission rule other than ``all``: the hits it lost against the same policy storing
  everything, and the writes it saved (``skipped_writes``);
* offline references: Belady on the first tier (deepest-first ties, as bounds.belady) for the
  share of hits the fast tier could serve, an admission oracle (:class:`OracleAdmission`)
  that writes into the last tier only blocks read again, which loses no hit, and the class
  bound of admission (:func:`admission_class_bound`): the fewest last-tier writes per hit of any
  rule that decides by the classes the online ``reuse`` rule learns (hits so far x depth x idle
  time x shape), given every class's exact share of blocks read again, at a hit loss within 1%,
  and its variant for rules that refuse a block with its subtree (:func:`subtree_class_bound`,
  which counts one lost hit per refusal: optimistic), and that variant with the loss counted
  exactly, per class set, learned and known (:func:`exact_subtree_bounds`,
  tools/lab/replay/subtree.py).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from eviction.admission import Admission, block_class, learned_features
from eviction.density import RATIO
from kvstore.registry import register_admission
from tools.lab.replay.bounds import (
    class_bound,
    class_segments,
    holdout_window_hits,
    instant_window_bound,
    keep_until_occupancy,
    policy_class_segments,
    priority_order_hits,
    window_bound,
)
from tools.lab.replay.subtree import (
    Decisions,
    TraceTree,
    class_frontier,
    holdout,
    learned_scores,
    score_frontier,
    standalone_costs,
)
from tools.replay.sim import EPOCH, StoreRun, TierCapacity
from tools.replay.trace import Trace
from tools.replay.yardsticks import next_use, unlimited


def recorder_options(key: str, tiers: list[TierCapacity]) -> dict[str, Any]:
    """``admission_options`` of a :class:`ClassRecorder` run over ``tiers`` for the trace
    registered as ``key``: its decisions' subtrees are free to go only with no copy in the tiers
    above the one their blocks leave (the next-to-last)."""
    return {"future": key, "upper": (1 << max(len(tiers) - 2, 0)) - 1}


# ---- the admission oracle ---------------------------------------------------------------------------

_FUTURES: dict[str, np.ndarray] = {}
"""Per registered trace, the last access time (store clock, seconds) of every block id."""


_TREES: dict[str, tuple[Trace, TraceTree]] = {}
"""Per registered trace, its prefix tree, for :class:`ClassRecorder`'s subtree columns."""


def register_future(name: str, last_access_s: np.ndarray, trace: Trace | None = None) -> None:
    """Make ``last_access_s`` (per block id) known to :class:`OracleAdmission` as ``name``;
    with ``trace``, also its prefix tree (:class:`ClassRecorder` records subtrees)."""
    _FUTURES[name] = last_access_s
    if trace is not None:
        _TREES[name] = (trace, TraceTree.of(trace, block_parents(trace)))
    register_admission("oracle", "tools.lab.replay.economics:OracleAdmission")
    register_admission("record", "tools.lab.replay.economics:ClassRecorder")


class OracleAdmission(Admission):
    """Knows the future: admits a block into the last tier only if the trace reads it again.
    Keys are the replay's (a block id, little-endian, as tools/replay/sim.py makes them)."""

    name = "oracle"
    inner = True  # a block never read again has no descendant read again either: lossless

    @dataclass(frozen=True, slots=True)
    class Config:
        future: str = ""
        inner: bool = True
        """False: asked about leaves only, like the store's online rules (a bound for them)."""
        upper: int = 1
        """The tiers above the one a decision's block leaves, as a bit mask (the first tier of
        three): :class:`ClassRecorder`'s subtree is free to go only with no copy there."""

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.inner = bool(getattr(config, "inner", True))
        try:
            self.last = _FUTURES[config.future]
        except (KeyError, AttributeError):
            raise ValueError(f"no future registered as {getattr(config, 'future', None)!r}; call register_future") from None

    def admit(self, bid: int, now: float) -> bool:
        b = int.from_bytes(self.view.hash_of(bid), "little")
        return bool(self.last[b] >= now)


_RECORDS: dict[str, ClassRecorder] = {}


class ClassRecorder(OracleAdmission):
    """Admits everything (the store-all run) and records, per decision, the class the ``reuse``
    rule would learn it in and whether the trace reads the block again; with the trace
    registered (:func:`register_future`), also what tools/lab/replay/subtree.py replays refusals
    from: the request it followed, whether its cached subtree was free to leave with it (no copy
    above the demoting tier, none in use or pinned: the store's check), and the columns of the
    richer classes (:func:`decision_classes`)."""

    name = "record"
    inner = True
    COLUMNS = ("hits", "depth", "idle", "parent_hits", "age", "span", "subtree", "req", "free")

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.inner = True
        self.upper = int(getattr(config, "upper", 1))
        self.classes: list[int] = []
        self.reused: list[bool] = []
        self.leaf: list[bool] = []
        self.blocks: list[int] = []
        self.columns: dict[str, list[float]] = {c: [] for c in self.COLUMNS}
        self.learned: list[list[float]] = []
        """Per decision, what the ``learned`` rule sees (eviction/admission.py, ``learned_features``)."""
        self.times: list[float] = []
        self.tree = _TREES.get(config.future)
        if self.tree is not None:
            trace, tree = self.tree
            self._first_s = EPOCH + trace.timestamps_ms[np.minimum(tree.first_req, trace.num_requests - 1)] / 1000.0
            self._hits_after = np.cumsum(unlimited(trace))
            self._bid = np.full(tree.parent.size, -1, np.int64)  # trace id -> index id (a store-all run keeps them)
        _RECORDS[config.future] = self

    def decisions(self) -> Decisions:
        """The recorded decisions, as tools/lab/replay/subtree.py replays them (a run with the
        trace's tree registered)."""
        col = self.columns
        return Decisions(np.asarray(col["req"], np.int64), np.asarray(self.blocks, np.int64), np.asarray(col["free"], bool))

    def refuses(self, bid: int, now: float) -> bool:
        return False

    def admit(self, bid: int, now: float) -> bool:
        v = self.view
        leaf = not int(v.children[bid])
        hits, depth, idle = int(v.hits[bid]), int(v.depth[bid]), now - float(v.last_access[bid])
        self.classes.append(block_class(hits, depth, idle, 0 if leaf else 2))
        self.reused.append(super().admit(bid, now))
        self.leaf.append(leaf)
        b = int.from_bytes(v.hash_of(bid), "little")
        self.blocks.append(b)
        if self.tree is not None:
            self._record(bid, b, leaf, hits, depth, idle, now)
            self.learned.append(learned_features(v, bid, now))
            self.times.append(now)
        return True

    def _record(self, bid: int, b: int, leaf: bool, hits: int, depth: int, idle: float, now: float) -> None:
        v, (_, tree), col = self.view, self.tree, self.columns  # type: ignore[misc]
        r = max(tree.request_at(len(v)), int(np.searchsorted(self._hits_after, self.hits(), side="left")))  # type: ignore[arg-type]
        below = tree.seen_subtree(b, r)[1:]  # preorder: the block itself first
        free = True
        if not leaf and below.size:
            ids = self._bid[below]
            for j in np.flatnonzero(ids < 0).tolist():
                found = v.id_of(int(below[j]).to_bytes(16, "little"))
                ids[j] = self._bid[below[j]] = -1 if found is None else found
            ids = ids[ids >= 0]
            free = not (((v.tiers[ids] & self.upper) != 0).any() or v.in_use[ids].any() or v.pins[ids].any())
        parent = int(v.parent[bid])
        first = float(self._first_s[b])
        for name, x in (("hits", hits), ("depth", depth), ("idle", idle),
                        ("parent_hits", int(v.hits[parent]) if parent >= 0 else -1), ("age", now - first),
                        ("span", float(v.last_access[bid]) - first), ("subtree", below.size), ("req", r), ("free", free)):
            col[name].append(x)


CLASS_SETS: dict[str, tuple[str, ...]] = {
    "rule": (),
    "parent": ("parent_hits",),
    "span_age_parent": ("span", "age", "parent_hits"),
    "subtree": ("subtree",),
    "subtree_span": ("subtree", "span"),
    "subtree_span_parent": ("subtree", "span", "parent_hits"),
    "all": ("span", "age", "parent_hits", "subtree"),
}
"""Class sets of the subtree frontier: the ``reuse`` rule's classes (hits x depth x idle x
leaf or inner), and the same with the docs' richer features added (the parent's hits, the span
from first to last access, the age since the first access) and the size of the cached subtree
a refusal takes."""


def decision_classes(rule: np.ndarray, columns: dict[str, np.ndarray], extra: tuple[str, ...]) -> np.ndarray:
    """Per decision, a class id: the rule's class crossed with log2 buckets of ``extra``."""
    keys = [rule.astype(np.int64)]
    for name in extra:
        x = np.asarray(columns[name], np.float64)
        bucket = np.minimum(np.floor(np.log2(np.maximum(x, 0.0) + 1.0)), 16).astype(np.int64)
        keys.append(np.where(x < 0, -1, bucket))
    return np.unique(np.stack(keys, axis=1), axis=0, return_inverse=True)[1].ravel()


def admission_class_bound(classes: np.ndarray, reused: np.ndarray, lost_allowed: float, may_skip: np.ndarray | None = None) -> int:
    """The fewest writes of a rule that skips whole classes (by their exact share of blocks read
    again, least read first) while the skipped blocks read again stay within ``lost_allowed``;
    ``may_skip`` limits which decisions it may skip (leaves only). Each skipped block read again
    counts as one lost hit (a hollow inner block can cost more: optimistic, so a bound)."""
    if may_skip is not None:
        forced = int((~may_skip).sum())
        classes, reused = classes[may_skip], reused[may_skip]
    else:
        forced = 0
    if not classes.size:
        return forced
    _, inv = np.unique(classes, return_inverse=True)
    n = np.bincount(inv)
    r = np.bincount(inv, weights=reused.astype(np.float64))
    order = np.argsort(r / n, kind="stable")  # least read again first: skipped first
    lost, skipped = np.cumsum(r[order]), np.cumsum(n[order])
    k = int(np.searchsorted(lost, lost_allowed, side="right"))  # classes skipped within the budget
    return forced + int(n.sum() - (skipped[k - 1] if k else 0))


def subtree_class_bound(classes: np.ndarray, reused: np.ndarray, lost_allowed: float, blocks: np.ndarray,
                        parent: np.ndarray) -> int:
    """:func:`admission_class_bound` for rules that refuse a block with its cached subtree (the
    store's ``inner`` admission): the same least-read-first skipping of whole classes within
    ``lost_allowed`` (one lost hit per skipped block read again: optimistic), where a decision
    about a block that an earlier skipped decision cut off (a descendant of it, ``parent`` per
    block id of the trace) is no write either, whatever its class. ``blocks``: the block id of
    each decision, in decision order. The skipped classes are those of the greedy order, so this
    bounds the ``reuse`` rule's own family (classes skipped least-read first, exact statistics
    known in advance), not every subset of classes."""
    if not classes.size:
        return 0
    _, inv = np.unique(classes, return_inverse=True)
    n = np.bincount(inv)
    r = np.bincount(inv, weights=reused.astype(np.float64))
    order = np.argsort(r / n, kind="stable")
    k = int(np.searchsorted(np.cumsum(r[order]), lost_allowed, side="right"))
    skipped = np.zeros(n.size, bool)
    skipped[order[:k]] = True
    cut = np.zeros(parent.size, bool)
    up = parent.tolist()
    writes = 0
    for b, c in zip(blocks.tolist(), inv.tolist(), strict=True):
        a = up[b]
        while a >= 0 and not cut[a]:
            a = up[a]
        if a >= 0:
            continue  # under a block refused earlier: gone with it
        if skipped[c]:
            cut[b] = True
        else:
            writes += 1
    return writes


def block_parents(trace: Trace) -> np.ndarray:
    """Per block id of the trace, its parent's id (-1 for a first block): a block id's parent is
    the same in every request (hash ids are prefix hashes)."""
    out = np.full(trace.unique_blocks, -1, np.int64)
    ids = trace.block_ids.astype(np.int64)
    inner = np.ones(ids.size, bool)
    inner[trace.offsets[:-1][np.diff(trace.offsets) > 0]] = False  # a request's first block
    out[ids[1:][inner[1:]]] = ids[:-1][inner[1:]]
    return out


def last_access_s(trace: Trace, epoch: float) -> np.ndarray:
    """Per block id, the store-clock time of its last access in the trace."""
    req = np.repeat(np.arange(trace.num_requests), np.diff(trace.offsets))
    out = np.full(trace.unique_blocks, -np.inf)
    np.maximum.at(out, trace.block_ids, epoch + trace.timestamps_ms[req] / 1000.0)
    return out


def exact_subtree_bounds(trace: Trace, rec: ClassRecorder, hits: int, budgets: tuple[float, ...]) -> dict[str, Any]:
    """The subtree-refusal frontier counted exactly (tools/lab/replay/subtree.py), per class set of
    :data:`CLASS_SETS`, at each hit-loss budget: writes per hit and the loss of the best rule
    found; ``rule_order`` ranks the rule's classes as the ``reuse`` rule does (least read again
    first) instead of by their standalone cost."""
    assert rec.tree is not None, "the recorder ran without the trace's tree"
    _, tree = rec.tree
    cols = {k: np.asarray(v) for k, v in rec.columns.items()}
    dec = rec.decisions()
    rule = np.asarray(rec.classes, np.int64)
    costs = standalone_costs(trace, tree, dec)
    per_hit = max(hits, 1)
    sets: dict[str, tuple[np.ndarray, np.ndarray | None]] = {
        name: (decision_classes(rule, cols, extra), None) for name, extra in CLASS_SETS.items()}
    if rule.size:
        uniq, inv = np.unique(rule, return_inverse=True)
        rate = np.bincount(inv, weights=np.asarray(rec.reused, np.float64)) / np.bincount(inv)
        sets["rule_order"] = (rule, uniq[np.argsort(rate, kind="stable")])
    out: dict[str, Any] = {}
    served = unlimited(trace)  # a store-all run's hits per request (it keeps every block)
    for name in CLASS_SETS if rule.size else ():
        h = holdout(trace, tree, dec, sets[name][0], served, 0.01, costs)
        out[f"holdout_subtree_{name}"] = {"budget": 0.01, "writes_per_hit": h.writes_per_hit, "hit_loss": h.hit_loss}
    if rule.size:
        scores = learned_scores(trace, tree, dec, np.asarray(rec.times), np.asarray(rec.learned, np.float64))
        out["learned_subtree"] = [
            {"budget": p.budget, "writes_per_hit": round(p.outcome.writes / per_hit, 6),
             "hit_loss": round(p.outcome.lost / per_hit, 6), "skipped_share": round(p.share_of_next, 4),
             "refused": p.outcome.refused, "cut": p.outcome.cut, "rewrites": p.outcome.rewrites}
            for p in score_frontier(trace, tree, dec, scores, hits, budgets)]
    for name, (classes, order) in sets.items():
        points = class_frontier(trace, tree, dec, classes, hits, budgets, costs, order) if rule.size else []
        out[f"exact_subtree_{name}"] = [
            {"budget": p.budget, "writes_per_hit": round(p.outcome.writes / per_hit, 6),
             "hit_loss": round(p.outcome.lost / per_hit, 6), "classes_skipped": p.classes_skipped,
             "share_of_next": round(p.share_of_next, 3),
             "refused": p.outcome.refused, "cut": p.outcome.cut, "rewrites": p.outcome.rewrites} for p in points]
    return out


# ---- Belady on the fast tier --------------------------------------------------------------------------


def belady_tier_hits(trace: Trace, capacity: int, served: np.ndarray) -> np.ndarray:
    """Per request, how many of its first ``served[r]`` blocks (the hits of the whole store) a
    first tier of ``capacity`` blocks under Belady (deepest-first ties) holds at lookup; every
    block of a request enters the tier after the lookup, as a promotion or a put does."""
    nxt = next_use(trace).tolist()
    offsets, ids = trace.offsets.tolist(), trace.block_ids.tolist()
    cached: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []
    out = np.zeros(trace.num_requests, dtype=np.int64)
    push, pop = heapq.heappush, heapq.heappop
    for r in range(trace.num_requests):
        lo, hi = offsets[r], offsets[r + 1]
        out[r] = sum(1 for i in range(lo, lo + int(served[r])) if ids[i] in cached)
        for d, i in enumerate(range(lo, hi)):
            cached[ids[i]] = nxt[i]
            push(heap, (-nxt[i], -d, ids[i]))
        while len(cached) > capacity:
            n, _, b = pop(heap)
            if cached.get(b) == -n:
                del cached[b]
    return out


WINDOW_RATIOS = (RATIO, 1.15, 1.05)
"""Age resolutions of the window bounds printed beside the 600-step one: eviction/density.py's
own age buckets (``RATIO``), and two finer grids."""


def first_tier_bounds(trace: Trace, capacity: int, served: float) -> dict[str, Any]:
    """Bounds on the share of the store's ``served`` hit blocks that a first tier of
    ``capacity`` blocks can serve, for online rules of stated classes (tools/lab/replay/bounds.py),
    each with the exact reuse statistics of its classes known in advance: keep a block until
    an age learned per class (``class_bound``: eviction/density.py's own classes, and the
    richer classes of ``class_segments``), or hold it at any set of ages per class, i.e. evict
    and prefetch back (``window_bound``, both class sets; for `density`'s classes also at the
    age resolutions of :data:`WINDOW_RATIOS`, with what each grid is worth when fitted on the
    first half and applied to the second: ``holdout_window_hits``). Those hold the tier's
    capacity on average only; ``instant_window_bound`` holds it at every instant, for rules
    that hold by a table over `density`'s cells (static, or rebuilt once halfway with each
    half's statistics), beside the hits of one priority order over the same cells that its
    family leaves out (``priority_order_hits``: not a bound)."""
    own, rich = policy_class_segments(trace), class_segments(trace)
    share = lambda hits: round(min(hits / max(served, 1.0), 1.0), 6)  # noqa: E731
    held = lambda got: round(got[0] / max(got[1], 1), 6)  # noqa: E731
    occupancy = keep_until_occupancy(own, capacity)
    instant = instant_window_bound(own, capacity, RATIO)
    return {
        # The keep-until bound holds `capacity` blocks on average: how far its occupancy strays.
        "keep_until_occupancy_first_tier_blocks": {
            q: float(np.quantile(occupancy, x)) if occupancy.size else 0.0
            for q, x in (("q10", 0.1), ("q50", 0.5), ("q90", 0.9), ("max", 1.0))},
        "keep_until_over_capacity_share": round(float((occupancy > capacity).mean()) if occupancy.size else 0.0, 6),
        "class_bound_first_tier_hit_share": share(class_bound(own, capacity)),
        "window_bound_first_tier_hit_share": share(window_bound(own, capacity)),
        "rich_class_bound_first_tier_hit_share": share(class_bound(rich, capacity)),
        "rich_window_bound_first_tier_hit_share": share(window_bound(rich, capacity)),
        "window_bound_by_age_ratio_first_tier_hit_share": {
            f"{r:g}": share(window_bound(own, capacity, r)) for r in WINDOW_RATIOS},
        "holdout_window_by_age_ratio_first_tier_hit_share": {
            **{f"{r:g}": held(holdout_window_hits(own, capacity, r)) for r in WINDOW_RATIOS},
            "fine": held(holdout_window_hits(own, capacity))},
        # Held to the capacity at every instant (tables over density's cells; LP, certified dual).
        "instant_window_bound_first_tier_hit_share": share(instant.bound),
        "instant_window_feasible_first_tier_hit_share": share(instant.feasible),
        "instant_window_bound_halves_first_tier_hit_share": share(
            instant_window_bound(own, capacity, RATIO, epochs=2).bound),
        "priority_order_first_tier_hit_share": share(priority_order_hits(own, capacity, RATIO)),
    }


# ---- the report ---------------------------------------------------------------------------------------


def tier_figures(tiers: list[TierCapacity], run: StoreRun, block_bytes: int) -> dict[str, Any]:
    """Hits and writes by tier of one store run."""
    by_tier = run.stats.get("hits_by_tier", {})
    hits = int(run.hits.sum())
    writes = run.stats.get("writes_by_tier", {})
    last = tiers[-1].name
    return {
        "hit_blocks": hits,
        "hit_share_by_tier": {t.name: round(by_tier.get(t.name, 0) / max(hits, 1), 6) for t in tiers},
        "hit_bytes_by_tier": {t.name: by_tier.get(t.name, 0) * block_bytes for t in tiers},
        "writes_by_tier": {t.name: int(writes.get(t.name, 0)) for t in tiers},
        "last_tier_writes_per_hit": round(writes.get(last, 0) / max(hits, 1), 6),
        "skipped_writes": int(run.stats.get("skipped_writes", 0)),
    }


def report(
    trace: Trace,
    spec: str,
    tiers: list[TierCapacity],
    runs: dict[str, StoreRun],
    replay: Callable[..., StoreRun],
    admission: str,
    block_bytes: int,
    as_json: bool,
    frontier: tuple[float, ...] = (0.01,),
) -> list[dict[str, Any]]:
    """The economics rows of one capacity: one per policy run, then the offline references.
    ``replay(policy, admission=..., admission_options=...)`` runs the store again when a comparison
    needs it (the same policy storing everything; the oracle)."""
    first = next(iter(runs))
    key = f"{trace.name}@{spec}"
    register_future(key, last_access_s(trace, EPOCH), trace)
    # The first policy storing everything, recording each last-tier decision for the class bound.
    recorded = tier_figures(tiers, replay(first, admission="record", admission_options=recorder_options(key, tiers)),
                            block_bytes)
    rec = _RECORDS.pop(key)
    rows = []
    for name, run in runs.items():
        row = {"trace": trace.name, "capacity": spec, "policy": name, "admission": admission,
               **tier_figures(tiers, run, block_bytes)}
        if admission != "all":
            b = recorded if name == first else tier_figures(tiers, replay(name, admission="all", admission_options={}), block_bytes)
            row["hit_loss"] = round(1 - row["hit_blocks"] / max(b["hit_blocks"], 1), 6)
            row["store_all_last_tier_writes_per_hit"] = b["last_tier_writes_per_hit"]
        rows.append(row)
    oracle = tier_figures(tiers, replay(first, admission="oracle", admission_options={"future": key}), block_bytes)
    classes, reused, leaf, blocks = (np.array(c) for c in (rec.classes, rec.reused, rec.leaf, rec.blocks))
    allowed = 0.01 * recorded["hit_blocks"]
    per_hit = max(recorded["hit_blocks"], 1)
    served = unlimited(trace) if len(tiers) > 1 else runs[first].hits
    dram = belady_tier_hits(trace, tiers[0].blocks, served)
    fast = first_tier_bounds(trace, tiers[0].blocks, float(served.sum()))
    rows.append({
        "trace": trace.name, "capacity": spec, "policy": "reference",
        "belady_first_tier_hit_share": round(float(dram.sum() / max(served.sum(), 1)), 6),
        **fast,
        "oracle_policy": first,
        "oracle_last_tier_writes_per_hit": oracle["last_tier_writes_per_hit"],
        "oracle_hit_blocks": oracle["hit_blocks"],
        "class_bound_last_tier_writes_per_hit": round(admission_class_bound(classes, reused, allowed) / per_hit, 6),
        "class_bound_leaves_only_last_tier_writes_per_hit": round(
            admission_class_bound(classes, reused, allowed, leaf if leaf.size else None) / per_hit, 6),
        "subtree_class_bound_last_tier_writes_per_hit": round(
            subtree_class_bound(classes, reused, allowed, blocks, block_parents(trace)) / per_hit, 6),
        **exact_subtree_bounds(trace, rec, recorded["hit_blocks"], frontier),
    })
    for row in rows:
        emit(row, as_json)
    return rows


def _emit_windows(head: str, row: dict[str, Any]) -> None:
    grid = row["window_bound_by_age_ratio_first_tier_hit_share"]
    fitted = row["holdout_window_by_age_ratio_first_tier_hit_share"]
    print(f"{head} first-tier window bound by age resolution: "
          + ", ".join(f"ratio {r} {v:.3f}" for r, v in grid.items())
          + f", 600 steps {row['window_bound_first_tier_hit_share']:.3f}; fitted on the first half, second half: "
          + ", ".join(f"{r} {v:.3f}" for r, v in fitted.items())
          + f"; keep-until occupancy {row['keep_until_occupancy_first_tier_blocks']} blocks, over the tier's"
          f" capacity at {100 * row['keep_until_over_capacity_share']:.0f}% of accesses; held to the capacity at every"
          f" instant, density's buckets: table {row['instant_window_bound_first_tier_hit_share']:.3f} (a feasible"
          f" one {row['instant_window_feasible_first_tier_hit_share']:.3f}), rebuilt halfway"
          f" {row['instant_window_bound_halves_first_tier_hit_share']:.3f}; one priority order (not a bound)"
          f" {row['priority_order_first_tier_hit_share']:.3f}", flush=True)


def emit(row: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
        return
    head = f"{row['trace']:<14} {row['capacity']:>10} {row['policy']:<9}"
    if row["policy"] == "reference":
        print(f"{head} Belady first-tier hit share {row['belady_first_tier_hit_share']:.3f} (bounds for online rules: "
              f"keep-until {row['class_bound_first_tier_hit_share']:.3f}, with prefetch "
              f"{row['window_bound_first_tier_hit_share']:.3f}; richer classes {row['rich_class_bound_first_tier_hit_share']:.3f}"
              f" / {row['rich_window_bound_first_tier_hit_share']:.3f})  oracle admission "
              f"({row['oracle_policy']}) last-tier writes/hit {row['oracle_last_tier_writes_per_hit']:.3f}  class bound "
              f"at 1% hit loss {row['class_bound_last_tier_writes_per_hit']:.3f} (leaves only "
              f"{row['class_bound_leaves_only_last_tier_writes_per_hit']:.3f}, with subtrees "
              f"{row['subtree_class_bound_last_tier_writes_per_hit']:.3f})", flush=True)
        exact = "; ".join(
            f"{k.removeprefix('exact_subtree_')} " + ", ".join(
                f"{p['writes_per_hit']:.3f} at {100 * p['hit_loss']:.2f}% (budget {100 * p['budget']:g}%)" for p in v)
            for k, v in row.items() if k.startswith("exact_subtree_"))
        learned = "; ".join(f"{k.removeprefix('holdout_subtree_')} {v['writes_per_hit']:.3f} at {100 * v['hit_loss']:.2f}%"
                            for k, v in row.items() if k.startswith("holdout_subtree_"))
        print(f"{head} subtree refusals counted exactly, writes/hit by class set: {exact}; fitted on the first half, "
              f"applied to the second (budget 1%): {learned}", flush=True)
        online = ", ".join(f"{p['writes_per_hit']:.3f} at {100 * p['hit_loss']:.2f}% (budget {100 * p['budget']:g}%)"
                           for p in row.get("learned_subtree", []))
        print(f"{head} the learned rule's online scores, refusing the lowest share (chosen in hindsight): {online}",
              flush=True)
        _emit_windows(head, row)
        return
    shares = " ".join(f"{k} {v:.3f}" for k, v in row["hit_share_by_tier"].items())
    writes = " ".join(f"{k} {v}" for k, v in row["writes_by_tier"].items())
    extra = ""
    if "hit_loss" in row:
        extra = (f"  hit loss {100 * row['hit_loss']:.2f}% (store-all writes/hit "
                 f"{row['store_all_last_tier_writes_per_hit']:.3f}), skipped {row['skipped_writes']}")
    print(f"{head} [{row['admission']}] hits by tier: {shares}  writes: {writes}  last-tier writes/hit "
          f"{row['last_tier_writes_per_hit']:.3f}{extra}", flush=True)
