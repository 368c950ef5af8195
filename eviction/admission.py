"""Admission to the slow, paid tiers: which demoted blocks are worth writing at all.

The store asks :meth:`Admission.admit` once per demotion into a tier the admission governs (by
default the last one, the object store, where every byte written is paid for and most blocks are
never read again), and only for a block no guarantee holds (unpinned, unused, stored by no
durable put, not recovered at open) and, unless the rule sets ``inner``, a leaf; a refused block
is dropped instead of written. A refused leaf leaves the store; a refused inner block leaves it
together with its whole cached subtree (the descendants no lookup could reach without it), and
only when that subtree is free to go: nothing of it in a tier above the demoting one, in use,
pinned, kept or protected by the operation in flight (otherwise the block is written and the
rule is not told). So the store stays prefix-closed with no hollow node, admission can lose hits
(a skipped block read again misses) but never a durable or pinned block.

* ``all``: write everything (the behaviour without admission).
* ``reuse`` (:class:`ReuseAdmission`; the store's default): learns,
  per block class, the share of demoted blocks that are read again, from the store's own
  history, and skips the classes least likely to be read again while the hit loss stays inside
  a budget (``hit_loss_budget``, a share of the store's hits). Class: hits so far (0, 1, 2, 3+)
  x depth (log2) x idle time at demotion (log2 seconds). Outcomes are read from the index,
  without hooks on the hit path: a stored block whose hit count rose was read again; a skipped
  block whose hash is back in the index was put again, i.e. a lost hit (a ghost, as in
  eviction/density.py); a decision with neither within ``horizon_s`` counts as not reused.
  Decisions are polled every ``poll`` decisions. The rule's statistics live in memory: after a
  restart it learns again (and skips nothing before ``poll`` decisions).
  With ``inner`` it also decides about blocks with cached children; the descendants dropped with
  a refused one are remembered as ghosts (:meth:`Admission.cut`): their return counts as a lost
  hit (the refusal cost it), and the loss per refused decision that came back weights every
  class's expected loss in the plan. A block whose parent is hollow (a corrupt copy dropped
  under a load leaves one) is refused without a decision: no lookup reaches it.

Admission objects see block ids and the index's columns, never payloads; the store calls them
under its lock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from eviction.online_model import ModelConfig, OnlineModel
from kvstore.tree import ChildIndex


class IndexView(Protocol):
    """What admission reads from the radix index (``kvstore.index.RadixIndex`` satisfies it)."""

    parent: np.ndarray
    depth: np.ndarray
    children: np.ndarray
    tiers: np.ndarray
    hits: np.ndarray
    last_access: np.ndarray

    def hash_of(self, bid: int) -> bytes: ...

    def id_of(self, key: bytes) -> int | None: ...


class Admission:
    """Admit everything; the base of every admission rule.

    ``bind`` is called once: ``view`` is the index, ``hits`` returns the store's hit blocks so
    far (the denominator of a hit-loss budget). ``admit(bid, now)`` is asked before a demotion
    writes ``bid`` into a governed tier, and only for a block the store may drop (unpinned,
    unused, stored by no durable put; a leaf unless ``inner``): a refusal is always honoured, so the rule learns from
    exactly the blocks it decides on. For a block with cached children the store first asks
    :meth:`refuses` (no side effect; it must answer what ``admit`` would) and asks ``admit``
    only when it may drop the block's subtree; then :meth:`cut` names the descendants that left
    with it.
    """

    name = "all"
    inner = False
    """Whether the rule may refuse a block with cached children (the store then keeps it as a
    hollow node, cutting its descendants off); otherwise it is asked about leaves only."""

    @dataclass(frozen=True, slots=True)
    class Config:
        pass

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def bind(self, view: IndexView, hits: Callable[[], int]) -> None:
        self.view, self.hits = view, hits

    def admit(self, bid: int, now: float) -> bool:
        return True

    def refuses(self, bid: int, now: float) -> bool:
        """Whether :meth:`admit` would refuse ``bid`` now; changes nothing (the default asks
        ``admit``: override it when ``admit`` records)."""
        return not self.admit(bid, now)

    def cut(self, keys: Sequence[bytes]) -> None:
        """The cached descendants of a refused block, dropped with it (their keys)."""

    def describe(self) -> dict[str, Any]:
        return {"admission": self.name}


def _check_budget(budget: float, margin: float, horizon_s: float) -> None:
    if not 0.0 <= budget < 1.0:
        raise ValueError(f"hit_loss_budget must be in [0, 1), got {budget}")
    if not 0.0 < margin <= 1.0:
        raise ValueError(f"margin must be in (0, 1], got {margin}")
    if horizon_s <= 0:
        raise ValueError(f"horizon_s must be positive, got {horizon_s}")


@dataclass(frozen=True, slots=True)
class ReuseConfig:
    hit_loss_budget: float = 0.0075
    """Hits that skipped writes may cost, as a share of the store's hits (0.01: 1%; 0: skip
    nothing). The rule counts every refused block that is put again, and the descendants
    that left with it, so what it counts is what is lost; but the count lags (a refused block
    comes back minutes to hours later), so the loss can pass the budget before skipping stops:
    at 1% the conversation trace lost 0.87% with ``density`` and 1.25% with ``lru``; the
    default 0.75% lost 0.68% with ``density`` (docs/eviction.md)."""
    margin: float = 0.5
    """Share of the budget the *expected* loss of the skipped classes may use; the rest absorbs
    estimation error. Measured loss past the full budget stops all skipping until it is back."""
    min_samples: int = 64
    """Decisions a class needs before it may be skipped."""
    window: int = 1 << 16
    """Decisions remembered (stored and skipped) to learn outcomes from."""
    poll: int = 512
    """Decisions between two polls of the index for outcomes and two re-plans."""
    decay: float = 0.9
    """Per re-plan, old class statistics fade by this factor."""
    horizon_s: float = 600.0
    """A decision not followed by a reuse within this long (store clock) counts as not reused;
    a skipped block that comes back later still counts as a lost hit."""
    inner: bool = True
    """Also decide about blocks with cached children: a refused one leaves the store with its
    whole cached subtree (only when all of it may go; otherwise it is written). False: leaves
    only, which saves little, because chains leave the upper tiers head first (1.24 object
    writes per hit against 0.90 on the conversation trace; docs/eviction.md)."""

    subtree: bool = False
    """Also class a block with cached children by the size of that subtree (log2 buckets),
    which a refusal takes with it: bigger subtrees cost more hits when the trace comes back.
    Tried, not the default: 1.026 object writes per hit at 0.59% loss against 0.905 at 0.68%
    without it (conversation trace, ``density``, DRAM 5%), at twice the replay's processor time
    (a subtree walk per inner decision; docs/eviction.md, "Admission to the last tier")."""

    def __post_init__(self) -> None:
        _check_budget(self.hit_loss_budget, self.margin, self.horizon_s)
        if self.min_samples < 1 or self.window < 1 or self.poll < 1:
            raise ValueError("min_samples, window and poll must be positive")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


_HITS, _DEPTHS, _IDLE, _SUBTREES = 4, 8, 16, 8


def block_class(hits: int, depth: int, idle_s: float, shape: int, subtree: int = 0) -> int:
    """The class a demoted block is learned in: hits so far, depth and idle time (bucketed),
    and its shape: 0 a leaf that never lost a child to admission (a request's partial last
    block never gets a child and is almost never read again), 1 a leaf whose child admission
    skipped, 2 a block with cached children; with ``subtree`` (the cached descendants, log2
    buckets) for rules that class by it."""
    h = min(hits, _HITS - 1)
    d = min(int(math.log2(depth + 1)), _DEPTHS - 1)
    i = min(int(math.log2(max(idle_s, 0.0) + 1.0)), _IDLE - 1)
    t = min(int(math.log2(subtree + 1)), _SUBTREES - 1)
    return (((t * 3 + shape) * _HITS + h) * _DEPTHS + d) * _IDLE + i


class ReuseAdmission(Admission):
    """Skip the classes least likely to be read again, within a hit-loss budget."""

    name = "reuse"
    Config = ReuseConfig  # type: ignore[assignment]  # replaces the base's empty Config class

    def __init__(self, config: ReuseConfig | None = None) -> None:
        super().__init__(config or ReuseConfig())
        self._init_decisions()
        n = _SUBTREES * 3 * _HITS * _DEPTHS * _IDLE if self.config.subtree else 3 * _HITS * _DEPTHS * _IDLE
        self._sized = (-1, 0)  # (block id, its subtree size) of the last decision asked about
        self.seen = np.zeros(n)  # decisions per class whose outcome is known (decayed)
        self.reused = np.zeros(n)  # of them, read (or put) again within the horizon
        self.skip = np.zeros(n, dtype=bool)  # the classes skipped now
        # (time, key, class, hits at decision, stored), oldest first; outcome not known yet
        self.pending: deque[tuple[float, bytes, int, int, bool]] = deque()

    def _init_decisions(self) -> None:
        """The state of every rule that decides block by block and may cut subtrees (this
        one and :class:`LearnedAdmission`): ghosts, parents, counters."""
        self.inner = self.config.inner
        self.children_of: ChildIndex | None = None
        # Skipped past the horizon (True) or unreachable (False): a return is still a loss.
        self.ghosts: dict[bytes, bool] = {}
        self.parents: dict[bytes, bool] = {}  # blocks whose child was skipped, oldest first
        self.decisions = 0
        self._polled = -1
        self.unreachable = 0
        """Blocks refused because their parent is hollow (no decision; see :meth:`admit`)."""
        self.cut_blocks = 0
        """Cached descendants dropped with a refused inner block (:meth:`cut`)."""
        self.returns = 0
        """Refused blocks (decisions) that came back."""
        self.lost = 0
        """Skipped blocks put again later: hits the skipping cost (an upper bound: a block put
        again would have hit only if its whole prefix was still cached)."""

    def _due(self, now: float) -> None:
        """Poll before the decision that completes ``poll`` of them (once: :meth:`refuses` and
        :meth:`admit` of one block both get here)."""
        if (self.decisions + 1) % self.config.poll == 0 and self._polled != self.decisions:
            self._polled = self.decisions
            self._poll(now)

    def _class(self, bid: int, key: bytes, now: float) -> int:
        v = self.view
        inner = bool(int(v.children[bid]))
        shape = 2 if inner else int(key in self.parents)
        return block_class(int(v.hits[bid]), int(v.depth[bid]), now - float(v.last_access[bid]), shape,
                           self._subtree(bid) if inner and self.config.subtree else 0)

    def _subtree(self, bid: int) -> int:
        """The cached descendants of ``bid`` (asked twice per decision: remembered once)."""
        if self._sized[0] != bid:
            if self.children_of is None:
                self.children_of = ChildIndex(self.view)  # type: ignore[arg-type]  # the store's view is a TreeView
            self._sized = (bid, len(self.children_of.below(bid)))
        return self._sized[1]

    def _hollow_parent(self, bid: int) -> bool:
        parent = int(self.view.parent[bid])
        return parent >= 0 and not int(self.view.tiers[parent])

    def refuses(self, bid: int, now: float) -> bool:
        if self._hollow_parent(bid):
            return True
        self._due(now)
        return self._refused(bid, now)

    def admit(self, bid: int, now: float) -> bool:
        key = bytes(self.view.hash_of(bid))
        if self._unreachable(bid, key):
            return False
        self._due(now)
        stored = self._decide(bid, key, now)
        self._note_parent(bid, key, stored)
        return stored

    def _refused(self, bid: int, now: float) -> bool:
        """:meth:`refuses` past the hollow-parent check and the poll: the rule's own answer."""
        return bool(self.skip[self._class(bid, bytes(self.view.hash_of(bid)), now)])

    def _decide(self, bid: int, key: bytes, now: float) -> bool:
        """:meth:`admit` past the hollow-parent check and the poll: decide and record."""
        c = self._class(bid, key, now)
        self._sized = (-1, 0)  # the next decision about this id may see another subtree
        self.decisions += 1
        stored = not self.skip[c]
        self.pending.append((now, key, c, int(self.view.hits[bid]), stored))
        if len(self.pending) > self.config.window:
            self._expire(self.pending.popleft())
        return stored

    def _note_parent(self, bid: int, key: bytes, stored: bool) -> None:
        """A skipped block's parent is a leaf whose child admission skipped (its shape)."""
        self.parents.pop(key, None)
        parent = int(self.view.parent[bid])
        if not stored and parent >= 0:
            self._remember(self.parents, bytes(self.view.hash_of(parent)))

    def _unreachable(self, bid: int, key: bytes) -> bool:
        """Whether ``bid``'s parent is hollow: no lookup reaches the block until its parent is
        put again, and that put re-puts this block too, so a write now earns nothing. Not a
        decision; a return still counts as a lost hit."""
        if not self._hollow_parent(bid):
            return False
        self.unreachable += 1
        self._remember(self.ghosts, key, False)
        return True

    def cut(self, keys: Sequence[bytes]) -> None:
        """Dropped with a refused ancestor: ghosts whose return is a hit the refusal cost (not
        a decision's return)."""
        self.cut_blocks += len(keys)
        for key in keys:
            self._remember(self.ghosts, bytes(key), False)

    def _remember(self, table: dict[bytes, bool], key: bytes, value: bool = True) -> None:
        table[key] = value
        if len(table) > self.config.window:
            del table[next(iter(table))]

    def _back(self, key: bytes) -> bool:
        """A skipped block is back: put again, with a copy (a hollow node has none)."""
        bid = self.view.id_of(key)
        return bid is not None and int(self.view.tiers[bid]) != 0

    def _expire(self, record: tuple[float, bytes, int, int, bool]) -> None:
        """Past the horizon without a reuse: counted as not reused."""
        _, key, c, _, stored = record
        self.seen[c] += 1
        if not stored:
            self._remember(self.ghosts, key)

    def _poll(self, now: float) -> None:
        """Learn the outcomes known now, then choose the classes to skip."""
        horizon = now - self.config.horizon_s
        keep: deque[tuple[float, bytes, int, int, bool]] = deque()
        for record in self.pending:
            t, key, c, hits, stored = record
            if stored:
                bid = self.view.id_of(key)
                again = bid is not None and int(self.view.hits[bid]) > hits
            else:
                again = self._back(key)
                self.lost += int(again)
                self.returns += int(again)
            if again:
                self.seen[c] += 1
                self.reused[c] += 1
            elif t < horizon:
                self._expire(record)
            else:
                keep.append(record)
        self.pending = keep
        back = [k for k in self.ghosts if self._back(k)]
        for k in back:
            self.returns += int(self.ghosts.pop(k))
        self.lost += len(back)
        self._plan()
        self.seen *= self.config.decay
        self.reused *= self.config.decay

    def _plan(self) -> None:
        """Greedy by reuse rate: skip the least reused classes while their expected lost hits
        (rate x decisions) stay within the budget's share; none while the measured loss is past
        the budget."""
        cfg = self.config
        hits = max(self.hits(), 1)
        self.skip[:] = False
        if cfg.hit_loss_budget == 0 or self.lost > cfg.hit_loss_budget * hits:
            return
        ready = np.flatnonzero(self.seen >= cfg.min_samples)
        if not ready.size:
            return
        rate = self.reused[ready] / self.seen[ready]
        order = np.argsort(rate, kind="stable")
        # The budget is scaled to the hits the store earns over as many decisions as the
        # statistics hold.
        per_decision_hits = hits / max(self.decisions, 1)
        allowance = cfg.margin * cfg.hit_loss_budget * per_decision_hits * float(self.seen.sum())
        # A refused inner block also costs the hits of the descendants it cut off (they come
        # back as returns of unreachable blocks): each class's reuses are weighted by the loss
        # measured per refused block that came back.
        weight = max(1.0, self.lost / self.returns) if self.returns else 1.0
        spent = 0.0
        for j in order.tolist():
            cost = weight * float(self.reused[ready[j]])
            if spent + cost > allowance:
                break
            spent += cost
            self.skip[ready[j]] = True

    def describe(self) -> dict[str, Any]:
        return {
            "admission": self.name,
            "hit_loss_budget": self.config.hit_loss_budget,
            "inner": self.inner,
            "skipping_classes": int(self.skip.sum()),
            "admission_lost_hits": self.lost,
            "unreachable_skipped": self.unreachable,
            "cut_descendants": self.cut_blocks,
        }


@dataclass(frozen=True, slots=True)
class LearnedConfig:
    hit_loss_budget: float = 0.01
    """As :class:`ReuseConfig`'s: hits that skipped writes may cost, a share of the store's
    hits. The rule keeps the measured loss *plus* the expected loss of its skipped decisions
    still within their horizon under it, so it loses less than the budget on a finite trace."""
    margin: float = 0.5
    """Share of the budget the model's *expected* loss of the skipped decisions may use."""
    horizon_s: float = 1200.0
    """A decision is labelled (read or put again, or not) once this long has passed since it:
    the model learns only from outcomes that are in the past."""
    poll: int = 512
    """Decisions between two polls of the index for outcomes and two re-plans of the threshold."""
    window: int = 1 << 16
    """Decisions remembered whose label is not final yet; and ghosts of skipped blocks."""
    train_window: int = 1 << 15
    """Labelled decisions the model is fitted on (the latest)."""
    refit_every: int = 4096
    """Labelled decisions between two fits."""
    min_samples: int = 2048
    """Labelled decisions before the first fit; nothing is skipped before it."""
    reference: int = 8192
    """The latest decisions the threshold is planned on (their predicted probabilities)."""
    l2: float = 1.0
    prior_weight: float = 4.0
    """Hits lost per predicted reuse before any is measured (a refusal's subtree comes back
    with it, and returns after the horizon count too; :meth:`LearnedAdmission.weight`)."""
    inner: bool = True
    """As :class:`ReuseConfig`'s: also decide about blocks with cached children."""
    subtree_cost: bool = True
    """Score a block with cached children that the threshold may skip by its subtree too
    (:meth:`LearnedAdmission._score`; a walk of the subtree, for those blocks only)."""

    def __post_init__(self) -> None:
        _check_budget(self.hit_loss_budget, self.margin, self.horizon_s)
        if min(self.poll, self.window, self.train_window, self.refit_every, self.min_samples, self.reference) < 1:
            raise ValueError("poll, window, train_window, refit_every, min_samples and reference must be positive")
        if self.l2 <= 0:
            raise ValueError(f"l2 must be positive, got {self.l2}")


def _log2_edges(top: int, start: float = 1.0) -> list[float]:
    return [start * 2.0**k for k in range(top)]


LEARNED_FEATURES = ("hits", "depth", "idle_s", "shape", "children", "parent_hits", "parent_gap_s",
                    "parent_children", "hit_deficit")
"""What the ``learned`` rule sees of a block leaving the next-to-last tier: its hits so far,
depth, idle time, shape (0 a leaf, 1 a leaf whose child admission skipped, 2 a block with cached
children), cached children, and of its parent (-1 without one): the hits, how much later the
parent was last read than the block (a later turn went through the parent and not this
block: the conversation moved on past it), its cached children, and how many of the parent's
hits did not reach the block."""

LEARNED_EDGES: tuple[list[float], ...] = (
    [0.5, 1.5, 2.5, 3.5, 5.5, 9.5],
    _log2_edges(10),
    _log2_edges(14),
    [0.5, 1.5],
    [0.5, 1.5, 2.5, 4.5],
    [-0.5, 0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5],
    [-0.5, 0.5, *_log2_edges(13, 2.0)],
    [-0.5, 1.5, 2.5, 4.5, 8.5, 16.5],
    [-0.5, 0.5, 1.5, 3.5, 7.5, 15.5],
)
LEARNED_CROSSES = ((0, 2), (3, 2), (6, 2))
"""Crossed pairs of :data:`LEARNED_FEATURES`: hits, shape and the parent's lead, each by idle time."""


def learned_features(view: IndexView, bid: int, now: float, child_skipped: bool = False) -> list[float]:
    """:data:`LEARNED_FEATURES` of ``bid`` now (``child_skipped``: admission skipped a child of
    this leaf)."""
    v = view
    hits, last = int(v.hits[bid]), float(v.last_access[bid])
    kids = int(v.children[bid])
    shape = 2 if kids else int(child_skipped)
    parent = int(v.parent[bid])
    if parent >= 0:
        ph = int(v.hits[parent])
        up = (ph, float(v.last_access[parent]) - last, int(v.children[parent]), max(ph - hits, 0))
    else:
        up = (-1, -1.0, -1, -1)
    return [hits, int(v.depth[bid]), now - last, shape, kids, *up]


_PRIOR = 16.0
"""Predicted reuses the prior loss weight is worth (:meth:`LearnedAdmission.weight`)."""
_RAMP = 16
"""The skipped share of the reference decisions grows by at most 1/``_RAMP`` per plan: the
first plans have a weight measured on few returns."""


class LearnedAdmission(ReuseAdmission):
    """Skip the decisions a model learned online predicts least likely to be read again.

    The model (eviction/online_model.py) is fitted on the store's own past decisions, each
    labelled once its horizon has passed: read again (a stored block's hit count rose; a skipped
    one was put again) or not. Outcomes are read from the index as :class:`ReuseAdmission` reads
    them, and the loss is counted the same way (refused blocks and the descendants cut with them
    that come back). At every poll the threshold is planned on the latest ``reference``
    decisions' predicted probabilities: the least likely are skipped while their expected lost
    hits (probability x the loss measured per refused block that came back) stay within the
    budget's margin; measured loss past the budget stops all skipping until it is back."""

    name = "learned"
    Config = LearnedConfig  # type: ignore[assignment]  # replaces the base's empty Config class

    def __init__(self, config: LearnedConfig | None = None) -> None:
        cfg = config or LearnedConfig()
        Admission.__init__(self, cfg)
        self._init_decisions()
        self.model = OnlineModel(LEARNED_EDGES, LEARNED_CROSSES,
                                 ModelConfig(window=cfg.train_window, refit_every=cfg.refit_every,
                                             min_samples=cfg.min_samples, l2=cfg.l2))
        self.threshold = 0.0
        """Decisions predicted below this probability are skipped (0: none)."""
        self._skipping = 0  # of the reference decisions, how many the threshold skips
        w = cfg.window
        # Per decision row (decision number mod window): its features, time, block, hits then,
        # whether it was stored and whether it was read (or put) again by now.
        self._cols = np.zeros((w, self.model.slots), np.int32)
        self._time = np.zeros(w)
        self._bid = np.zeros(w, np.int64)
        self._hits_at = np.zeros(w, np.int64)
        self._stored = np.zeros(w, bool)
        self._again = np.zeros(w, bool)
        self._p = np.zeros(w)  # predicted blocks read again if refused: probability x blocks taken
        self._ratio = np.ones(w)  # blocks a refusal takes / writes it saves (1 unless measured)
        self._tk = np.ones(w)  # blocks a refusal takes (1 unless measured)
        self._took = self._saved = self._p_now = 1.0
        self._keys: list[bytes] = [b""] * w
        self.expected = 0.0
        """Predicted reuses of the skipped decisions so far (the measured loss over it is the
        loss per predicted reuse: the weight of every prediction)."""
        self._head = 0
        """The oldest decision whose label is not final yet (decisions before it are labelled)."""
        self._asked: tuple[int, float, tuple[int, ...], float] = (-1, 0.0, (), 0.0)
        self.labelled = 0

    def features(self, bid: int, now: float) -> list[float]:
        """:data:`LEARNED_FEATURES` of ``bid`` now."""
        return learned_features(self.view, bid, now, bytes(self.view.hash_of(bid)) in self.parents)

    def _score(self, bid: int, now: float) -> tuple[tuple[int, ...], float]:
        """The decision's encoded features and score: the predicted probability, and for a
        block with cached children that the threshold might skip, that probability x the
        blocks a refusal takes (they come back with it) / the writes it saves (the block and
        its descendants not written to a lower tier yet). Asked twice per decision, by
        :meth:`refuses` and :meth:`admit`: computed once."""
        b, t, cols, score = self._asked
        if b == bid and t == now:
            return cols, score
        cols = self.model.encode(self.features(bid, now))
        p = self.model.predict(cols) if self.model.ready else 1.0
        took, saved = 1.0, 1.0
        if p < self.threshold and self.config.subtree_cost and int(self.view.children[bid]):
            if self.children_of is None:
                self.children_of = ChildIndex(self.view)  # type: ignore[arg-type]  # the store's view is a TreeView
            below = self.children_of.below(bid)
            took = 1.0 + len(below)
            if below:
                masks = self.view.tiers[np.array(below, np.int64)]
                saved += float((masks < (1 << int(self.view.tiers[bid]).bit_length())).sum())
        self._took, self._saved, self._p_now = took, saved, p
        score = p * took / saved
        self._asked = (bid, now, cols, score)
        return cols, score

    def _refused(self, bid: int, now: float) -> bool:
        return self._score(bid, now)[1] < self.threshold

    def _decide(self, bid: int, key: bytes, now: float) -> bool:
        v = self.view
        cols, score = self._score(bid, now)
        self._asked = (-1, 0.0, (), 0.0)
        stored = score >= self.threshold
        cfg = self.config
        if self.decisions - self._head >= cfg.window:
            self._label(self._head + 1)  # the oldest row is needed: labelled early
        row = self.decisions % cfg.window
        self._cols[row] = cols
        self._time[row], self._bid[row], self._hits_at[row] = now, bid, int(v.hits[bid])
        self._stored[row], self._again[row], self._keys[row] = stored, False, key
        self._p[row] = self._p_now * self._took
        self._ratio[row] = self._took / self._saved
        self._tk[row] = self._took
        if not stored:
            self.expected += self._p[row]
        self.decisions += 1
        return stored

    def _rows(self, lo: int, hi: int) -> np.ndarray:
        return np.arange(lo, hi) % self.config.window

    def _label(self, upto: int) -> None:
        """Decisions ``_head`` to ``upto`` (excluded) are past their horizon: their labels are
        final; the model observes them, and a skipped one not back by now becomes a ghost (its
        return still counts as a lost hit)."""
        rows = self._rows(self._head, upto)
        self._head = upto
        if not rows.size:
            return
        self.model.observe_many(self._cols[rows], self._again[rows])
        self.labelled += rows.size
        for r in rows[~self._stored[rows] & ~self._again[rows]].tolist():
            self._remember(self.ghosts, self._keys[r])

    def _poll(self, now: float) -> None:
        rows = self._rows(self._head, self.decisions)
        open_ = rows[~self._again[rows]]
        stored = open_[self._stored[open_]]
        v = self.view
        bids = self._bid[stored]
        rose = stored[v.hits[bids].astype(np.int64) > self._hits_at[stored]]
        keys = self._keys
        for r in rose.tolist():  # the id may hold another block by now
            if v.id_of(keys[r]) == int(self._bid[r]):
                self._again[r] = True
        for r in open_[~self._stored[open_]].tolist():
            if self._back(keys[r]):
                self._again[r] = True
                self.lost += 1
                self.returns += 1
        passed = int(np.searchsorted(self._time[rows], now - self.config.horizon_s, side="left")) if rows.size else 0
        self._label(self._head + passed)
        back = [k for k in self.ghosts if self._back(k)]
        for k in back:
            self.returns += int(self.ghosts.pop(k))
        self.lost += len(back)
        self._plan()

    def weight(self) -> float:
        """Hits lost per predicted reuse of a skipped decision: measured (every return of a
        skipped block or of a descendant cut with it, whenever it came, over the predicted
        reuses of every skipped decision; it lags the returns, so it rises as they come in),
        with a prior of ``prior_weight`` worth ``_PRIOR`` predicted reuses."""
        w0 = self.config.prior_weight
        return max(1.0, (self.lost + _PRIOR * w0) / (self.expected + _PRIOR))

    def _plan(self) -> None:
        """The threshold: the latest ``reference`` decisions' predictions, least likely first,
        skipped while their expected loss (prediction x :meth:`weight`) stays within the
        budget's ``margin`` (scaled to the hits earned over as many decisions); none while the
        measured loss plus the expected loss of the skipped decisions still in their horizon
        is past the whole budget."""
        cfg = self.config
        self.threshold = 0.0
        hits = max(self.hits(), 1)
        skipping, self._skipping = self._skipping, 0
        if cfg.hit_loss_budget == 0 or not self.model.ready:
            return
        weight = self.weight()
        rows = self._rows(self._head, self.decisions)
        out = rows[~self._stored[rows] & ~self._again[rows]]
        slack = cfg.hit_loss_budget * hits - self.lost - weight * float(self._p[out].sum())
        if slack <= 0:
            return
        n = min(self.decisions, cfg.window, cfg.reference)
        rows = (self.decisions - n + np.arange(n)) % cfg.window
        p = self.model.predict_many(self._cols[rows])
        score = p * self._ratio[rows]
        order = np.argsort(score, kind="stable")
        score, cost = score[order], (p * self._tk[rows])[order]
        allowance = cfg.margin * slack
        k = int(np.searchsorted(np.cumsum(weight * cost), allowance, side="right"))
        k = min(k, skipping + n // _RAMP)
        self._skipping = k
        if k:
            self.threshold = float(score[k - 1]) if k == n else float(score[k - 1] + score[k]) / 2

    def describe(self) -> dict[str, Any]:
        return {
            "admission": self.name,
            "hit_loss_budget": self.config.hit_loss_budget,
            "inner": self.inner,
            "threshold": round(self.threshold, 6),
            "model_fits": self.model.fits,
            "labelled_decisions": self.labelled,
            "admission_lost_hits": self.lost,
            "unreachable_skipped": self.unreachable,
            "cut_descendants": self.cut_blocks,
        }
