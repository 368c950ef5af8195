"""The lhd policy: LRU before it has learned, the learned order across classes, runs of victims
as first() would give them, the density formula, and the LRU shadow that guards it (every policy
also passes test_conformance.py). Time is plain numbers; nothing sleeps."""

from __future__ import annotations

import numpy as np
import pytest

from eviction.lhd import _GAP0, _NEW_TAIL, LHDConfig, LHDPolicy, LRUShadow, density
from kvstore.errors import ConfigError
from kvstore.registry import build_config, policy_class
from tests.eviction.conftest import LAST, FakeView, evict_first, evict_leaf


def _policy(view: FakeView, **options: object) -> LHDPolicy:
    pol = LHDPolicy(build_config(LHDConfig, dict(options), "lhd"))
    pol.bind(view, LAST)
    return pol


def _chain(view: FakeView, first: int, n: int) -> list[int]:
    ids = [view.add(first)]
    for b in range(first + 1, first + n):
        ids.append(view.add(b, ids[-1]))
    return ids


def _put(pol: LHDPolicy, chain: list[int], now: float) -> None:
    pol.insert_many(np.array(chain[::-1], np.int64), np.full(len(chain), 4096), now)  # leaves first


def _read(pol: LHDPolicy, view: FakeView, chain: list[int], now: float) -> None:
    view.hits[chain] += 1
    pol.touch_many(chain[::-1], now)  # deepest first


def test_registry_builds_lhd() -> None:
    assert policy_class("lhd") is LHDPolicy


@pytest.mark.parametrize(
    "options",
    [{"bins": 2}, {"age0": 0}, {"decay": 0}, {"gap_memory": 1.0}, {"margin": -1}, {"window": 0}, {"period": 0}, {"retry": -1}],
)
def test_config_is_validated(options: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        LHDConfig(**options)  # type: ignore[arg-type]


def test_before_the_first_tables_the_order_is_lru_and_a_chain_leaves_from_its_tail() -> None:
    view = FakeView()
    pol = _policy(view)
    a, b = _chain(view, 0, 4), _chain(view, 10, 4)
    _put(pol, a, 0.0)
    _put(pol, b, 1.0)
    assert pol.first() == a[-1]
    assert pol.victims(6) == [a[3]]  # one at a time: its parent may come next
    assert pol.first() == a[-1]  # victims() changed nothing
    assert evict_first(pol, view, 6) == [a[3], a[2], a[1], a[0], b[3], b[2]]
    _read(pol, view, b[:2], 2.0)
    lone = [view.add(k) for k in (30, 31, 32)]
    for t, bid in enumerate(lone):
        _put(pol, [bid], 3.0 + t)
    _put(pol, [view.add(40)], 9.0)
    assert pol.victims(5)[:1] == [b[1]]


def test_first_follows_the_learned_order_through_removals_and_new_offers() -> None:
    """With learned tables and chains of several classes, first() after each removal equals a
    ranking from scratch of the offered leaves (the kept order and its heap agree with it)."""
    rng = np.random.default_rng(3)
    view = FakeView()
    pol = _policy(view, period=64, min_events=0)
    chains = [_chain(view, 20 * k, int(rng.integers(2, 8))) for k in range(12)]
    for k, c in enumerate(chains):
        _put(pol, c, float(k))
    for t in range(12, 60):
        c = chains[int(rng.integers(0, len(chains)))]
        _read(pol, view, c[: int(rng.integers(1, len(c) + 1))], float(t))
    assert pol._density is not None
    for _ in range(20):
        bid = pol.first()
        assert bid is not None
        pol._invalidate()
        assert pol.first() == bid  # ranked afresh: the same
        assert pol.victims(5) == [bid]
        evict_leaf(pol, view, bid)


def test_the_learned_order_evicts_a_young_block_of_a_class_that_never_returns() -> None:
    """Tails (unread blocks with no child) were never hit; chains read every few seconds were
    hit young. A tail put now goes before a read chain idle longer (LRU would take the chain)."""
    view = FakeView()
    pol = _policy(view, period=1 << 30, min_events=0)
    pol._hits[_GAP0, 1:10] = 100.0  # re-read chains: hit at ages up to ~8 s
    pol._ends[_GAP0, 12] = 10.0
    pol._ends[_NEW_TAIL, 1:12] = 100.0  # tails: never hit
    pol._recompute()
    a = _chain(view, 0, 3)
    _put(pol, a, 0.0)
    _read(pol, view, a, 1.0)  # a: read again after 1 s, a chain of the first gap class
    tail = view.add(50)
    _put(pol, [tail], 3.0)  # a lone put: a tail, never read
    _put(pol, [view.add(60)], 4.0)  # time moves on (a leaf touched now ranks last)
    assert pol.first() == tail


def test_density_is_hits_to_come_over_space_time_to_come() -> None:
    width = np.ones(4)
    hits = np.array([0.0, 0.0, 10.0, 0.0])
    ends = np.array([0.0, 0.0, 0.0, 10.0])
    d = density(hits, ends, width)
    # From bin 0: 10 hits over 20 blocks x (1 + 1 + 0.5 + (in bin 3: 10 x 0.5)).
    assert d[0] == pytest.approx(10.0 / (20 + 20 + 15 + 5))
    assert d[3] == 0.0  # nothing is hit past bin 2
    assert d[2] > d[1] > d[0]  # closer to the hits, less space-time to spend
    assert np.all(density(np.zeros(4), np.zeros(4), width) == 0.0)


def test_monotone_densities_keep_lru_order_within_a_class() -> None:
    view = FakeView()
    pol = _policy(view, period=1 << 30, min_events=0)
    pol._hits[_GAP0, 8] = 100.0  # a class hit only when old: LHD alone would keep the old ones
    pol._ends[_GAP0, 2] = 100.0
    pol._recompute()
    assert pol._density is not None
    assert np.all(np.diff(pol._density[_GAP0]) <= 0)


def test_the_shadow_counts_what_lru_would_hold() -> None:
    s = LRUShadow(size=4)
    assert s.access(-1, 1, 3, capacity=4) == 0  # three new blocks
    assert s.access(-1, 2, 2, capacity=4) == 0  # two more: five blocks, LRU holds four
    assert s.access(2, 3, 2, capacity=4) == 2  # the newest two: held
    # Stamp 1's three blocks have 2 blocks above them: LRU (room 4) holds two of them.
    assert s.access(1, 4, 3, capacity=4) == 2
    for k in range(5, 40):  # sequence numbers past the tree's size: it grows or drops old ones
        s.access(-1, k, 1, capacity=4)
    assert s.access(4, 40, 3, capacity=4) == 0  # 35 blocks since: gone under LRU
    assert s.access(39, 41, 1, capacity=4) == 1


def test_the_guard_orders_by_lru_while_the_policy_trails_lru() -> None:
    view = FakeView()
    pol = _policy(view, period=1 << 30, margin=0.01, window=1.0)
    pol._capacity = 100
    pol._account(own=50, lru=60, seen=100)  # 10% behind
    assert pol.lru_mode
    pol._hits[_GAP0, 1] = 1.0
    pol._recompute()
    assert not pol._learned()
    for _ in range(20):  # even afterwards: the shortfall decays
        pol._account(own=100, lru=100, seen=100)
    assert not pol.lru_mode and pol._learned()


def test_ordered_by_lru_the_shortfall_fades_at_the_retry_pace() -> None:
    view = FakeView()
    pol = _policy(view, margin=0.01, window=1e9, retry=1.0)
    pol._capacity = 100
    pol._account(own=50, lru=60, seen=100)
    assert pol.lru_mode
    pol._account(own=100, lru=100, seen=300)  # three retry periods: 10 x e^-3 < 1% of 500
    assert not pol.lru_mode
    slow = _policy(view, margin=0.01, window=1e9, retry=0.0)
    slow._capacity = 100
    slow._account(own=50, lru=60, seen=100)
    slow._account(own=100, lru=100, seen=300)
    assert slow.lru_mode  # at window's pace the shortfall is still there


def test_an_evicted_block_that_comes_back_is_an_lru_hit_if_lru_would_have_held_it() -> None:
    view = FakeView()
    pol = _policy(view, period=1 << 30)
    a = _chain(view, 0, 2)
    _put(pol, a, 0.0)
    _put(pol, [view.add(10)], 1.0)
    evict_leaf(pol, view, a[1])  # evicted here; LRU (room for three) would hold it
    view.add(a[1], a[0])
    own, lru = pol._own, pol._lru
    _put(pol, [a[1]], 2.0)
    assert pol._lru > lru and pol._own == pytest.approx(own * np.exp(-1 / (256 * 3)))
