"""The LRB-style learned policy (eviction/lrb.py): its config, its model, and its ranking once
it has learned. The protocol itself is checked by the conformance suite (test_conformance.py,
which runs every registered policy)."""

from __future__ import annotations

import numpy as np
import pytest

from eviction.lrb import BASE_GROUPS, GROUPS, LRBConfig, LRBPolicy, Model
from kvstore.errors import ConfigError
from tests.eviction.conftest import LAST, UPPER, FakeView

SMALL = {"refit_every": 64, "min_samples": 16, "window": 0.5, "sample": 64, "period": 64}


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"objective": "belady"}, "objective must be one of"),
        ({"window": 0}, "window must be > 0"),
        ({"groups": ("age", "colour")}, "unknown feature group"),
        ({"min_samples": 8}, "min_samples"),
        ({"refit_every": 10}, "refit_every"),
    ],
)
def test_a_bad_option_says_what_to_change(options: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        LRBConfig(**options)


def test_the_default_groups_leave_out_the_crosses() -> None:
    assert LRBConfig().groups == BASE_GROUPS
    assert set(BASE_GROUPS) < {g for g, _ in GROUPS} and not any(" x " in g for g in BASE_GROUPS)


def test_the_logistic_fit_ranks_the_bins_by_their_share_read_again() -> None:
    rng = np.random.default_rng(0)
    n = 4000
    bins = np.stack([rng.integers(0, 4, n), rng.integers(0, 3, n)])
    share = np.array([0.05, 0.2, 0.5, 0.9])[bins[0]]  # group 1 says nothing
    y = (rng.random(n) < share).astype(np.float64)
    m = Model.zero([4, 3])
    m.fit(bins, y, ridge=1.0, sweeps=6)
    assert list(np.argsort(m.weights[0])) == [0, 1, 2, 3]
    p = 1 / (1 + np.exp(-m.logit(bins)))
    for b, want in enumerate((0.05, 0.2, 0.5, 0.9)):
        assert abs(p[bins[0] == b].mean() - want) < 0.04
    assert np.ptp(m.weights[1]) < 0.3


def _workload(pol: LRBPolicy, view: FakeView, hot: int = 40, rounds: int = 30, room: int = 60) -> None:
    """Hot blocks come back every round; every round brings new cold blocks that never do.
    The tier holds ``room`` blocks: a victim leaves each time it is over."""
    nxt = hot

    def make_room() -> None:
        while len(pol) > room:
            bid = pol.first()
            assert bid is not None
            pol.remove(bid)

    for b in range(hot):
        pol.insert(view.add(b), 4096, 0.0)
    for r in range(rounds):
        for b in range(hot):
            view.hits[b] += 1
            if pol._pos[b] == -1:  # back from below (promotion): an insert
                pol.insert(b, 4096, float(r))
            else:
                pol.touch(b, float(r))
            make_room()
        for _ in range(30):
            pol.insert(view.add(nxt), 4096, float(r))
            nxt += 1
            make_room()


@pytest.mark.parametrize("objective", ["tiebreak", "window"])
def test_once_fitted_the_model_keeps_blocks_that_come_back(objective: str) -> None:
    view = FakeView()
    pol = LRBPolicy(LRBConfig(objective=objective, **SMALL))
    pol.bind(view, UPPER)
    _workload(pol, view)
    assert pol.fits > 0 and pol.model is not None
    hot, cold = np.arange(0, 40), np.arange(880, 940)  # (940 blocks in all)
    hot = hot[[pol._pos[b] >= 0 for b in hot]]
    # (the last cold blocks: most have left already, so their features are of their last access)
    score = pol.model.logit(pol.features(np.concatenate([hot, cold])))
    assert hot.size and cold.size and score[: hot.size].mean() > score[hot.size :].mean()
    assert hot.size >= 30, objective  # most hot blocks are resident at the end (LRU keeps 30)


def test_the_tiebreak_keeps_density_order_between_different_scores() -> None:
    view = FakeView()
    pol = LRBPolicy(LRBConfig(**SMALL))
    pol.bind(view, UPPER)
    _workload(pol, view)
    assert pol.fits > 0
    pol._queue = []
    pol._refill(set())
    scores = [e[2] for e in pol._queue]
    assert scores and all(a >= b for a, b in zip(scores, scores[1:], strict=False))  # best victim last
    assert pol.joins_queue  # its queue keeps density's scores: a new block may join it


def test_on_the_last_tier_a_learned_ranking_offers_only_leaves() -> None:
    view = FakeView()
    pol = LRBPolicy(LRBConfig(**SMALL))
    pol.bind(view, LAST)
    nxt, chains = 0, []
    for r in range(60):
        parent = -1
        chain = []
        for _ in range(4):
            b = view.add(nxt, parent)
            chain.append(b)
            parent = b
            nxt += 1
        for b in reversed(chain):  # leaves first, as the store enters a put's chain
            pol.insert(b, 4096, float(r))
        chains.append(chain)
        for old in chains[-3:-1]:  # the last chains come back
            for b in reversed(old):
                if pol._pos[b] != -1:
                    view.hits[b] += 1
                    pol.touch(b, float(r))
        while len(pol) > 40:
            bid = pol.first()
            assert bid is not None and view.children[bid] == 0, "a block with cached children was offered"
            p = int(view.parent[bid])
            pol.remove(bid)
            view.drop(bid)
            if p >= 0 and view.children[p] == 0:
                pol.offer(p)
    assert pol.fits > 0
    for bid in pol.candidates():
        assert view.children[bid] == 0
