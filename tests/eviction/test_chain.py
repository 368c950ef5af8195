"""The chain policy: LRU exactly where no long chain loops, the loop exception in exact order,
and the comparison that switches it on and off (every policy also passes test_conformance.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eviction.chain import ChainConfig, ChainPolicy
from eviction.lru import LRUPolicy
from kvstore.errors import ConfigError
from kvstore.registry import build_config, policy_class
from tests.eviction.conftest import LAST, UPPER, FakeView, evict_first, evict_leaf


def _chain(view: FakeView, first: int, n: int) -> list[int]:
    ids = [view.add(first)]
    for b in range(first + 1, first + n):
        ids.append(view.add(b, ids[-1]))
    return ids


def _put(pol: ChainPolicy, chain: list[int], now: float) -> None:
    for b in reversed(chain):  # leaves first, as the store inserts a chain
        pol.insert(b, 4096, now)


def _read(pol: ChainPolicy, chain: list[int], now: float) -> None:
    for b in reversed(chain):  # deepest first, as the store touches a hit prefix
        pol.touch(b, now)


def _three_chains(**options: object) -> tuple[ChainPolicy, FakeView, list[list[int]]]:
    """Chains A, B, C of 8 blocks, stored at t = 0, 1, 2 and read again at t = 10, 11, 12: each
    has a typical gap of 10 s, and at t = 12 LRU's victim (A's leaf, idle 2 s) is young."""
    view = FakeView()
    pol = ChainPolicy(build_config(ChainConfig, dict(options), "chain"))
    pol.bind(view, LAST)
    chains = [_chain(view, 10 * k, 8) for k in range(3)]
    for k, c in enumerate(chains):
        _put(pol, c, float(k))
    for k, c in enumerate(chains):
        _read(pol, c, 10.0 + k)
    return pol, view, chains


def test_registry_builds_chain() -> None:
    assert policy_class("chain") is ChainPolicy


def test_without_evidence_the_order_is_lru() -> None:
    pol, _, chains = _three_chains()
    assert pol.first() == chains[0][-1]  # A's leaf: least recently used
    assert pol.score == 0.0


def test_the_loop_exception_takes_the_chain_expected_back_last_from_its_tail() -> None:
    """A is due back at 20, B at 21, C (being served at 12) is left out: B leaves, tail first."""
    pol, view, chains = _three_chains(adapt=False)
    b = chains[1]
    assert evict_first(pol, view, 3) == [b[7], b[6], b[5]]


def test_an_old_victim_is_lru_s_whatever_the_rule() -> None:
    """Once LRU's victim has been idle past its typical gap, LRU's order stands."""
    pol, view, chains = _three_chains(adapt=False)
    pol.insert(view.add(100), 4096, 25.0)  # time moves on
    assert pol.first() == chains[0][-1]


def test_the_comparison_switches_the_exception_on_when_lru_s_pick_is_read_first() -> None:
    pol, _, chains = _three_chains()
    a, _, c = chains
    assert pol.first() == a[-1]  # LRU's pick; the pair (A's leaf, B's leaf) is remembered
    _read(pol, a, 13.0)  # A, which LRU would have evicted, is read first
    assert pol.score == 1.0
    # Now B's leaf is LRU's (idle 2 s, young); C (due at 22) is expected back after B (21).
    assert pol.first() == c[-1]


def test_the_comparison_keeps_lru_when_the_alternative_s_pick_is_read_first() -> None:
    pol, _, chains = _three_chains()
    a, b, _ = chains
    assert pol.first() == a[-1]
    _read(pol, b, 13.0)  # B, which the exception would have evicted, is read first
    assert pol.score == -1.0
    assert pol.first() == a[-1]


def test_an_evicted_pick_is_followed_by_its_hash_when_it_comes_back() -> None:
    """LRU's pick was evicted; when its chain is stored again, the block's hash settles the pair."""
    pol, view, chains = _three_chains()
    a = chains[0]
    assert pol.first() == a[-1]
    evict_leaf(pol, view, a[-1])
    _read(pol, a[:-1], 13.0)  # A comes back: its prefix is read ...
    view.add(a[-1], a[-2])  # ... and its lost leaf (same id, same hash) is stored again
    pol.hold(a[-2])
    pol.insert(a[-1], 4096, 13.0)
    assert pol.score == 1.0


def test_pending_comparisons_are_bounded() -> None:
    pol, _, chains = _three_chains(pending=1)
    assert pol.first() == chains[0][-1]
    assert len(pol._pairs) == 1


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_short_chains_are_ordered_exactly_as_lru(seed: int) -> None:
    """Chains short beside the tier (chat turns in a large cache): the same victims as LRU after
    every event, whatever the reads, evictions and times."""
    rng = np.random.default_rng(seed)
    view = FakeView()
    chain, lru = ChainPolicy(ChainConfig(adapt=False)), LRUPolicy()
    for pol in (chain, lru):
        pol.bind(view, LAST)
    chains: list[list[int]] = []
    bid, now = 0, 0.0
    for _ in range(60):
        chains.append(_chain(view, bid, int(rng.integers(1, 3))))
        bid += len(chains[-1])
        for pol in (chain, lru):
            _put(pol, chains[-1], now)  # type: ignore[arg-type]
    for _ in range(80):
        now += float(rng.integers(0, 5))
        op = rng.integers(0, 3)
        if op == 0:  # a chain is read again
            c = chains[int(rng.integers(0, len(chains)))]
            live = [b for b in c if b in lru._stamp]
            for pol in (chain, lru):
                _read(pol, live, now)  # type: ignore[arg-type]
        elif op == 1 and len(lru):  # the store takes the first victim
            victim = lru.first()
            assert chain.first() == victim
            parent = int(view.parent[victim])  # type: ignore[index]
            for pol in (chain, lru):
                pol.remove(victim)  # type: ignore[arg-type]
            view.drop(victim)  # type: ignore[arg-type]
            if parent >= 0 and not view.children[parent]:
                for pol in (chain, lru):
                    pol.offer(parent)
        else:  # a new short chain
            chains.append(_chain(view, bid, int(rng.integers(1, 3))))
            bid += len(chains[-1])
            for pol in (chain, lru):
                _put(pol, chains[-1], now)  # type: ignore[arg-type]
        assert chain.first() == lru.first()
    assert list(chain.candidates()) == list(lru.candidates())


@pytest.mark.parametrize(
    "options", [{"chains": 0}, {"patience": 0}, {"memory": 0}, {"memory": 1.5}, {"pending": 0}, {"short": -1}])
def test_config_is_validated(options: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        build_config(ChainConfig, options, "chain")


def _upper(**options: object) -> tuple[ChainPolicy, FakeView]:
    """Six lone blocks on an upper tier; the segmented LRU without ``tails`` unless asked (a lone
    block has no cached child, so with ``tails`` each would enter at the old end)."""
    options.setdefault("tails", False)
    view = FakeView()
    pol = ChainPolicy(build_config(ChainConfig, dict(options), "chain"))
    pol.bind(view, UPPER)
    for b in range(6):
        pol.insert(view.add(b), 4096, float(b))
    return pol, view


def test_upper_tier_read_blocks_go_down_after_unread_ones_within_their_share() -> None:
    pol, _ = _upper(protected=0.5)
    pol.touch(1, 10.0)
    pol.touch(3, 11.0)
    assert list(pol.candidates()) == [0, 2, 4, 5, 1, 3]
    pol.touch(0, 12.0)
    pol.touch(2, 13.0)  # four read blocks, room for three: the least recently read (1) joins the unread
    assert list(pol.candidates()) == [4, 5, 1, 3, 0, 2]
    assert pol.first() == 4 and len(pol) == 6
    pol.remove(4)
    pol.remove(3)
    assert list(pol.candidates()) == [5, 1, 0, 2] and len(pol) == 4


def test_upper_tier_a_promoted_block_that_was_read_joins_the_read_ones() -> None:
    pol, view = _upper(protected=0.5)
    view.hits[6] = 1  # read on a lower tier, now promoted here
    pol.insert(view.add(6), 4096, 20.0)
    assert list(pol.candidates()) == [0, 1, 2, 3, 4, 5, 6]
    pol.insert(view.add(7), 4096, 21.0)
    assert list(pol.candidates()) == [0, 1, 2, 3, 4, 5, 7, 6]


def test_upper_tier_without_a_protected_share_is_lru() -> None:
    pol, _ = _upper(protected=0.0)
    lru = LRUPolicy()
    lru.bind(FakeView(), UPPER)
    for b in range(6):
        lru.insert(b, 4096, float(b))
    for b, t in ((1, 10.0), (3, 11.0), (0, 12.0), (1, 13.0)):
        pol.touch(b, t)
        lru.touch(b, t)
    assert list(pol.candidates()) == list(lru.candidates()) == [2, 4, 5, 3, 0, 1]


def test_upper_tier_with_tails_a_put_s_tail_joins_the_unread_ones_at_their_old_end() -> None:
    view = FakeView()
    pol = ChainPolicy(ChainConfig(tails=True))
    pol.bind(view, UPPER)
    a = _chain(view, 0, 3)
    _put(pol, a, 0.0)  # a[2] has no cached child: the old end; a[1], a[0] the young end
    assert list(pol.candidates()) == [a[2], a[1], a[0]]
    b = _chain(view, 10, 2)
    pol.insert_many(np.array(b[::-1]), np.full(2, 4096), 1.0)  # (the vectorised insert: the same)
    assert list(pol.candidates()) == [b[1], a[2], a[1], a[0], b[0]]
    pol.touch(b[1], 2.0)  # read: with the read ones, as without tails
    assert list(pol.candidates()) == [a[2], a[1], a[0], b[0], b[1]]


def _settled(**options: object) -> tuple[ChainPolicy, FakeView]:
    view = FakeView()
    pol = ChainPolicy(build_config(ChainConfig, {"settle": 0, **options}, "chain"))
    pol.bind(view, UPPER)
    return pol, view


def _inner(view: FakeView, bid: int) -> int:
    """A block with a cached child (on another tier): not a put's tail."""
    view.add(bid)
    view.add(bid + 1000, bid)
    return bid


def _read_once(pol: ChainPolicy, view: FakeView, bids: list[int], now: float) -> None:
    for b in bids:
        view.hits[b] += 1  # (the index counts the load; the policy is told by touch)
        pol.touch(b, now)


def test_upper_tier_before_settling_the_order_is_the_segmented_lru_s() -> None:
    """Until ``settle`` blocks have left the tier a lone block enters at the young end; then at
    the old end (a put's tail)."""
    view = FakeView()
    pol = ChainPolicy(ChainConfig(settle=2))
    pol.bind(view, UPPER)
    for b in range(3):
        pol.insert(view.add(b), 4096, float(b))
    assert list(pol.candidates()) == [0, 1, 2]
    pol.remove(0)
    pol.remove(1)  # two blocks have left: settled
    pol.insert(view.add(3), 4096, 3.0)
    assert list(pol.candidates()) == [3, 2]


def test_upper_tier_a_block_read_once_pushed_out_goes_first_while_such_blocks_come_back_less() -> None:
    def setup(evidence: bool) -> list[int]:
        pol, view = _settled(protected=0.5)
        if evidence:  # an unread inner block moved down came back; no block read once did
            pol.insert(_inner(view, 100), 4096, 0.0)
            pol.remove(100)
            pol.insert(100, 4096, 0.5)
        for b in range(6):
            pol.insert(_inner(view, b), 4096, float(b))
        _read_once(pol, view, [0, 1, 2], 10.0)
        _read_once(pol, view, [3], 11.0)  # four read, room for three (or 3.5): 0 is pushed out
        return list(pol.candidates())

    assert setup(evidence=False) == [4, 5, 0, 1, 2, 3]  # no evidence: the young end of the unread
    assert setup(evidence=True) == [0, 100, 4, 5, 1, 2, 3]  # read once and not since: first


def _evidence_then_push_out(pol: ChainPolicy, view: FakeView, deep0: int) -> list[int]:
    """An unread inner block moved down came back (the once rule holds); six inner blocks, 0 at
    depth ``deep0``; 0, 1, 2 and then 3 read once: 0 is pushed out of the share."""
    pol.insert(_inner(view, 100), 4096, 0.0)
    pol.remove(100)
    pol.insert(100, 4096, 0.5)
    for b in range(6):
        pol.insert(_inner(view, b), 4096, float(b))
    view.depth[0] = deep0
    _read_once(pol, view, [0, 1, 2], 10.0)
    _read_once(pol, view, [3], 11.0)
    return list(pol.candidates())


def test_upper_tier_a_long_chain_s_block_read_once_keeps_its_place() -> None:
    """Seven blocks resident, ``short = 2``: a block at depth 3.5 or deeper is a long chain's."""
    pol, view = _settled(protected=0.5, short=2.0)
    assert _evidence_then_push_out(pol, view, 3) == [0, 100, 4, 5, 1, 2, 3]  # shallow: first
    pol, view = _settled(protected=0.5, short=2.0)
    assert _evidence_then_push_out(pol, view, 4) == [100, 4, 5, 0, 1, 2, 3]  # deep: the young end
    pol, view = _settled(protected=0.5, short=0.0)
    assert _evidence_then_push_out(pol, view, 4000) == [0, 100, 4, 5, 1, 2, 3]  # short = 0: any depth


@pytest.mark.parametrize("batch", [False, True])
def test_upper_tier_a_long_chain_s_tail_enters_at_the_young_end(batch: bool) -> None:
    """Settled, ``short = 2``: a lone block (depth 0) is a put's tail, at the old end; the tail
    of a chain at depth 2 with 4 blocks resident is a long chain's, at the young end."""
    pol, view = _settled(short=2.0)
    pol.insert(view.add(10), 4096, 0.0)
    chain = _chain(view, 20, 3)
    if batch:
        pol.insert_many(np.array(chain), np.full(3, 4096), 1.0)
    else:
        for b in chain:
            pol.insert(b, 4096, 1.0)
    assert list(pol.candidates()) == [10, 20, 21, 22]
    pol, view = _settled(short=4.0)  # depth 1 or deeper is long: a lone block still is not
    pol.insert(view.add(10), 4096, 0.0)
    pol.insert(view.add(11), 4096, 0.0)
    assert list(pol.candidates()) == [11, 10]


def test_upper_tier_with_tails_the_tail_rule_holds_at_every_depth_and_the_once_rule_never() -> None:
    view = FakeView()
    pol = ChainPolicy(ChainConfig(tails=True, settle=0, short=2.0, protected=0.5))
    pol.bind(view, UPPER)
    assert _evidence_then_push_out(pol, view, 0) == [100, 4, 5, 0, 1, 2, 3]  # pushed out: young end
    pol.insert(view.add(10), 4096, 20.0)
    chain = _chain(view, 30, 3)
    for b in chain:
        pol.insert(b, 4096, 21.0)
    assert list(pol.candidates())[:2] == [32, 10]  # tails, deep or not, at the old end


def test_upper_tier_the_once_rule_stays_off_while_blocks_read_once_come_back_more() -> None:
    pol, view = _settled(protected=0.5)
    for b in range(4):
        pol.insert(_inner(view, b), 4096, float(b))
    _read_once(pol, view, [0, 1, 2], 10.0)  # 0 pushed out, at the young end of the unread
    assert list(pol.candidates()) == [3, 0, 1, 2]
    pol.remove(0)  # read once, moved down ...
    pol.insert(0, 4096, 11.0)  # ... and back (a promotion): with the read ones
    for b in range(10, 13):
        pol.insert(_inner(view, b), 4096, float(b))
    _read_once(pol, view, [10, 11, 12], 20.0)
    order = list(pol.candidates())
    assert order.index(3) < order.index(1)  # pushed-out blocks read once joined the young end


@pytest.mark.parametrize("short", [64.0, 2.0])
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ipteb"), st.integers(0, 23)), max_size=150))
def test_upper_tier_settled_every_resident_block_is_offered_once(short: float, ops: list[tuple[str, int]]) -> None:
    """Whatever the rules do to the order (``short = 2``: deep blocks of the chains of four
    left alone), the candidates are the resident blocks, each once."""
    pol, view = _settled(protected=0.4, short=short)
    for b in range(24):
        view.add(b, b - 1 if b % 4 else -1)  # chains of four
    resident: set[int] = set()
    for t, (op, b) in enumerate(ops):
        if op == "i" and b not in resident:
            pol.insert(b, 4096, float(t))
            resident.add(b)
        elif op == "p" and b not in resident:
            view.hits[b] += 1  # a promotion of a block read below
            pol.insert_many(np.array([b]), np.array([4096]), float(t))
            resident.add(b)
        elif op == "t" and b in resident:
            view.hits[b] += 1
            pol.touch_many([b], float(t))
        elif op in "eb" and b in resident:
            pol.remove(b)
            resident.discard(b)
        order = list(pol.candidates())
        assert sorted(order) == sorted(resident) and len(pol) == len(resident)
