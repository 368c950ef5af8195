"""The one suite every registered eviction policy passes (the contract of eviction/base.py),
then scenario tests that pin each policy's exact eviction order.

Time is a FakeClock or plain numbers; nothing sleeps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eviction.arc import ARCPolicy
from eviction.base import EvictionPolicy, TierContext
from eviction.chain import ChainPolicy
from eviction.costaware import CostAwarePolicy
from eviction.density import DensityConfig, DensityPolicy
from eviction.lhd import LHDPolicy
from eviction.lrb import LRBPolicy
from eviction.lru import LRUPolicy
from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.keys import KVLayout, LayerGroup, Namespace
from kvstore.registry import POLICIES, build_config, make_policies, policy_class
from kvstore.store import KVStore
from tests.eviction.conftest import LAST, UPPER, FakeView

NAMES = sorted(POLICIES)


def _make(name: str, view: FakeView, tier: TierContext = LAST, **options: object) -> EvictionPolicy:
    cls = policy_class(name)
    pol = cls(build_config(cls.Config, dict(options), name))
    pol.bind(view, tier)
    return pol


@pytest.fixture(params=NAMES)
def name(request: pytest.FixtureRequest) -> str:
    return request.param


# ---- the protocol ------------------------------------------------------------------------------


def test_registry_name_matches_class(name: str) -> None:
    cls = policy_class(name)
    assert cls.name == name and issubclass(cls, EvictionPolicy)
    assert cls(cls.Config()).admit(0, 4096, 0.0) in (True, False)


def test_insert_remove_and_len(name: str, view: FakeView) -> None:
    pol = _make(name, view)
    for b in range(10):
        pol.insert(view.add(b), 4096, float(b))
    assert len(pol) == 10
    for b in (3, 7):
        pol.remove(b)
        view.drop(b)
    pol.remove(3)  # twice: a no-op
    pol.remove(999)  # unknown: a no-op
    pol.touch(999, 11.0)  # unknown: a no-op
    assert len(pol) == 8
    assert sorted(pol.candidates()) == [0, 1, 2, 4, 5, 6, 8, 9]


@pytest.mark.parametrize("tier", [LAST, UPPER], ids=["last", "upper"])
def test_candidates_offer_every_resident_block_once(name: str, view: FakeView, tier: TierContext) -> None:
    """Chains and lone blocks: whatever the order, a full pass offers each resident block exactly
    once (the store may skip all of them), and nothing that is not resident. On the last tier
    only leaves are offered: a block with cached children is held."""
    pol = _make(name, view, tier)
    bid = 0
    for chain in range(6):
        parent = -1
        for _ in range(chain + 1):
            view.add(bid, parent)
            parent = bid
            bid += 1
        for b in range(bid - 1, bid - chain - 2, -1):  # leaves first, as the store inserts
            pol.insert(b, 4096, float(chain))
    for b in (0, 3, 5):
        pol.touch(b, 10.0)
    offered = list(pol.candidates())
    expect = [b for b in range(bid) if tier is UPPER or not view.children[b]]
    assert sorted(offered) == expect
    assert len(offered) == len(set(offered))


def test_last_tier_holds_and_offers_as_children_come_and_go(name: str, view: FakeView) -> None:
    """hold/offer: a leaf that gains a child stops being offered; a parent whose last child
    left is offered again, and every resident block is still known (touch, remove, len)."""
    pol = _make(name, view, LAST)
    a = view.add(0)
    pol.insert(a, 4096, 0.0)
    assert list(pol.candidates()) == [a]
    b = view.add(1, a)
    pol.hold(a)  # the store: a gained its first cached child
    pol.insert(b, 4096, 1.0)
    assert list(pol.candidates()) == [b]
    pol.touch(a, 2.0)  # a held block still takes hits
    assert len(pol) == 2
    pol.remove(b)
    view.drop(b)
    pol.offer(a)  # the store: a lost its last child
    assert list(pol.candidates()) == [a]
    pol.hold(a)
    pol.remove(a)  # a held block may leave the tier (its copy moved), and is forgotten
    view.drop(a)
    assert list(pol.candidates()) == [] and len(pol) == 0


def test_last_tier_offers_leaves_before_parents(name: str, view: FakeView) -> None:
    """On the last tier only leaves may leave: a long chain's parents must not come first, or
    the store scans past them on every eviction."""
    pol = _make(name, view, LAST)
    chain = [view.add(0)]
    for b in range(1, 8):
        chain.append(view.add(b, chain[-1]))
    for b in reversed(chain):
        pol.insert(b, 4096, 0.0)
    first = next(iter(pol.candidates()))
    assert view.children[first] == 0


def test_remove_all_then_reuse_ids(name: str, view: FakeView) -> None:
    """The index recycles block ids: a removed id inserted again is a new block."""
    pol = _make(name, view)
    for b in range(5):
        pol.insert(view.add(b), 4096, 0.0)
    for b in range(5):
        pol.remove(b)
        view.drop(b)
    assert len(pol) == 0 and list(pol.candidates()) == []
    pol.insert(view.add(2, key=b"new-block-2-----"), 4096, 1.0)
    assert list(pol.candidates()) == [2] and len(pol) == 1


def _random_chains(view: FakeView, rng: np.random.Generator, count: int, longest: int) -> list[list[int]]:
    """``count`` chains of 1 to ``longest - 1`` blocks in ``view``, ids from 0, each root first."""
    chains: list[list[int]] = []
    bid = 0
    for _ in range(count):
        parent, chain = -1, []
        for _ in range(int(rng.integers(1, longest))):
            chain.append(view.add(bid, parent))
            parent = bid
            bid += 1
        chains.append(chain)
    return chains


@pytest.mark.parametrize("tier", [LAST, UPPER], ids=["last", "upper"])
@pytest.mark.parametrize("ghosts", [False, True], ids=["fresh", "ghosts"])
@pytest.mark.parametrize("queued", [False, True], ids=["", "queued"])
def test_insert_many_equals_inserts_in_order(name: str, tier: TierContext, ghosts: bool, queued: bool) -> None:
    """What a warm restart and a put's chain rely on: one insert_many is the per-block inserts
    in the same order (leaves first), across table rebuilds, with repeats, blocks already
    resident, blocks back from the ghost ring and (``queued``) a victim queue that new blocks
    may join."""
    options = {"period": 64} if issubclass(policy_class(name).Config, DensityConfig) else {}
    view = FakeView()
    chains = _random_chains(view, np.random.default_rng(3), 40, 13)
    bid = sum(map(len, chains))
    one, many = _make(name, view, tier, **options), _make(name, view, tier, **options)
    early = [b for chain in chains[:3] for b in reversed(chain)]
    for pol in (one, many):  # resident before the batch, some hit, some evicted (ghosts)
        for b in early:
            pol.insert(b, 4096, 0.0)
        pol.touch(early[0], 1.0)
        if ghosts:
            pol.remove(early[-1])
        if queued:
            pol.first()  # a ranking fills the victim queue (and takes its first entry)
    batch = [b for chain in chains[3:] for b in reversed(chain)]
    batch[5:5] = batch[:3] + early[:4]  # repeats and residents: no-ops
    batch.append(view.add(bid, chains[0][-1]))  # extends a resident chain
    batch += [view.add(bid + 1), view.add(bid + 2, bid + 1)]  # root first
    bid += 3
    if ghosts:
        batch.append(early[-1])  # comes back
    created = np.arange(len(batch), dtype=np.float64)
    for b, t in zip(batch, created.tolist(), strict=True):
        one.insert(b, 4096, t)
    many.insert_many(np.array(batch), np.full(len(batch), 4096), created)
    assert len(one) == len(many)
    if isinstance(one, DensityPolicy):  # the state a later ranking reads, not only this one
        assert (one._tick, one._n, one._hits[:bid], one._extended[:bid]) == (many._tick, many._n, many._hits[:bid], many._extended[:bid])
        assert [one._pos[b] for b in range(bid)] == [many._pos[b] for b in range(bid)]
        for col in ("_cls", "_last"):
            assert np.array_equal(getattr(one, col)[:bid], getattr(many, col)[:bid])
        assert np.array_equal(one._resident[: one._n], many._resident[: many._n])
        assert np.array_equal(one._ended, many._ended) and np.array_equal(one._reuses, many._reuses)
    assert list(one.candidates()) == list(many.candidates())
    for pol in (one, many):  # and they go on alike
        pol.touch(batch[7], 2.0)
        pol.insert(view.add(bid), 4096, 3.0)
    assert list(one.candidates()) == list(many.candidates())


@pytest.mark.parametrize("tier", [LAST, UPPER], ids=["last", "upper"])
def test_touch_many_equals_touches_in_order(name: str, tier: TierContext) -> None:
    """What a load or a lease relies on: one touch_many of a hit prefix (deepest first) is the
    per-block touches in the same order, with repeats, ids not resident, held blocks, and
    evictions between the hits (the store's own make-room: take the first offer, offer its
    parent)."""
    options: dict[str, object] = {"period": 64} if issubclass(policy_class(name).Config, DensityConfig) else {}
    if name == "chain":  # the exception wherever it applies: comparisons made and settled
        options = {"patience": 100.0, "adapt": False}
    view = FakeView()
    rng = np.random.default_rng(5)
    chains = _random_chains(view, rng, 24, 30)
    bid = sum(map(len, chains))
    one, many = _make(name, view, tier, **options), _make(name, view, tier, **options)
    for pol in (one, many):
        for t, chain in enumerate(chains):
            pol.insert_many(np.array(chain[::-1]), np.full(len(chain), 4096), float(t))
    gone: set[int] = set()
    for step in range(80):
        now = 100.0 + step * float(rng.integers(1, 5))
        chain = [b for b in chains[int(rng.integers(len(chains)))] if b not in gone]
        hit = chain[: int(rng.integers(len(chain) // 2, len(chain) + 1))][::-1] + [bid + 7, *chain[:1]]
        for b in hit:
            one.touch(b, now)
        many.touch_many(hit, now)
        for _ in range(3):  # a make-room of three blocks
            victim = one.first()
            assert victim == many.first()
            if victim is None:
                break
            parent = int(view.parent[victim]) if tier.last else -1
            for pol in (one, many):
                pol.remove_leaves([victim], [parent if parent >= 0 and view.children[parent] == 1 else -1])
            view.drop(victim)
            gone.add(victim)
        assert len(one) == len(many)
        assert list(one.candidates()) == list(many.candidates())
    if isinstance(one, ChainPolicy) and isinstance(many, ChainPolicy):
        assert (one.score, one.deviations) == (many.score, many.deviations)


def test_store_stays_prefix_closed_under_pressure(name: str, tmp_path: Path) -> None:
    """Through a real store (null tiers: metadata only): many chains through a small tier, hits
    on some; every cached block's parent stays cached, and each policy keeps the tier full."""
    clock = FakeClock()
    ns = Namespace("conf/tiny", KVLayout("uint8", 4, (LayerGroup("full", 1, 1, 1),)))
    cfg = StoreConfig(
        root=tmp_path, tiers=(TierSpec("a", "null", {"capacity_blocks": 12}), TierSpec("b", "null", {"capacity_blocks": 24})),
        policy=name, persist_on_close=False,
    )
    src = bytes(ns.block_bytes)
    with KVStore(cfg, clock=clock) as s:
        s.register_namespace(ns)
        rng = np.random.default_rng(0)
        for _ in range(200):
            clock.advance(1.0)
            doc = int(rng.integers(0, 15))
            chain = [bytes([doc, d]) * 8 for d in range(int(rng.integers(1, 9)))]
            n = s.get_into(ns, chain, [bytearray(ns.block_bytes)] * len(chain))
            s.put(ns, chain, [src] * (len(chain) - n), start=n)
        idx = s.index
        live = idx.live_ids()
        parents = idx.parent[live]
        assert all(p < 0 or idx.tiers[p] for p in parents.tolist())
        assert 0 < len(live) <= 36 and s.stats()["hit_blocks"] > 0


# ---- scenarios: exact orders -------------------------------------------------------------------


def test_arc_probation_then_protected_and_ghost_return(view: FakeView) -> None:
    pol = _make("arc", view)
    for b in range(6):
        pol.insert(view.add(b), 4096, 0.0)
    pol.touch(1, 1.0)
    pol.touch(4, 1.0)  # 1 and 4 move to the protected list, in that order
    assert list(pol.candidates()) == [0, 2, 3, 5, 1, 4]
    pol.remove(0)  # evicted from probation: its hash is a ghost of B1
    key = view.hash_of(0)
    view.drop(0)
    pol.insert(view.add(7, key=key), 4096, 2.0)  # comes back: straight to protected
    assert list(pol.candidates()) == [2, 3, 5, 1, 4, 7]


def test_arc_one_hit_blocks_do_not_flush_hit_blocks(view: FakeView) -> None:
    """A scan of blocks seen once competes only with the probation list."""
    pol = _make("arc", view)
    for b in range(4):
        pol.insert(view.add(b), 4096, 0.0)
        pol.touch(b, 0.5)  # hot: hit once
    for b in range(4, 40):  # a scan through a 10-block tier
        pol.insert(view.add(b), 4096, 1.0)
        if len(pol) > 10:
            victim = next(iter(pol.candidates()))
            pol.remove(victim)
            view.drop(victim)
    assert {0, 1, 2, 3} <= set(pol.candidates())


def _density_trained(view: FakeView, name: str = "density") -> EvictionPolicy:
    """Blocks 0-3 are hit every few events; blocks 100+ stream by once, never hit again, and
    leave. After enough events (period 64) the tables say: a hit block is worth keeping."""
    pol = _make(name, view, LAST, period=64)
    for b in range(4):
        pol.insert(view.add(b), 4096, 0.0)
    nxt = 100
    for _ in range(200):
        for b in range(4):
            pol.touch(b, 0.0)
        for _ in range(3):
            pol.insert(view.add(nxt), 4096, 0.0)
            old = nxt - 12
            if old >= 100:
                pol.remove(old)
                view.drop(old)
            nxt += 1
    return pol


def test_density_starts_least_recently_used(view: FakeView) -> None:
    pol = _make("density", view)
    for b in (5, 2, 9, 1):
        pol.insert(view.add(b), 4096, 0.0)
    pol.touch(2, 1.0)
    assert list(pol.candidates()) == [5, 9, 1, 2]


def test_density_learns_that_one_hit_blocks_go_first(view: FakeView) -> None:
    pol = _density_trained(view)
    offered = list(pol.candidates())
    # Resident: the hot blocks 0-3 and the last 12 streamed ones, 688-699. Streamed blocks
    # older than a few events were never seen hit: density 0, oldest first. The youngest three
    # still might be (the hot ones were once that young). The hot ones go last; among them the
    # one hit most recently first, because hits come every 7 events: it has the longest wait.
    assert offered == [*range(688, 697), 699, 698, 697, 3, 2, 0, 1]


def test_density_ghost_remembers_a_returning_block(view: FakeView) -> None:
    pol = _density_trained(view)
    gone = 600  # streamed by and left; its hash is still in the ghost ring
    key = bytes((gone).to_bytes(16, "little"))
    bid = view.add(3000, key=key)
    pol.insert(bid, 4096, 0.0)
    assert pol._hits[bid] == 1  # came back: counted as a reuse, not as a new block


@pytest.mark.parametrize("tier", [LAST, UPPER], ids=["last", "upper"])
def test_cost_aware_weighs_a_hit_by_what_it_saves(view: FakeView, tier: TierContext) -> None:
    """On the last tier a hit saves a recompute, dearer for a deeper block; above it, only the
    load from the tier below, the same at any depth."""
    pol = _make("cost", view, tier, block_tokens=512)
    chain = [view.add(0)]
    for b in range(1, 64):
        chain.append(view.add(b, chain[-1]))
    w = pol.weights(np.array(chain))  # type: ignore[attr-defined]
    if tier.last:
        assert (np.diff(w) > 0).all() and w[-1] > 1.5 * w[0]
    else:
        assert (w == w[0]).all() and w[0] > 0


def test_cost_aware_above_a_tier_priced_alike_ranks_by_reuse_as_density_does() -> None:
    """Above a tier that loads as fast (the replay's null tiers), a hit saves no load time:
    the weight stays positive and equal for every block (a zero weight tied every block, so
    each new block was the next victim and DRAM kept old blocks before reused ones), and the
    upper tier's order is density's, event for event."""
    alike = TierContext("t0", "null", 0, "null")
    view = FakeView()
    cost = _make("cost", view, alike, block_tokens=512, period=256)
    dens = _make("density", view, alike, period=256)
    rng = np.random.default_rng(7)
    resident: list[int] = []
    for step in range(3000):
        r = rng.random()
        if r < 0.45 or not resident:
            parent = resident[int(rng.integers(len(resident)))] if resident and rng.random() < 0.5 else -1
            bid = view.add(step, parent)
            for pol in (cost, dens):
                pol.insert(bid, 4096, 0.0)
            resident.append(bid)
        elif r < 0.75:
            bid = resident[int(rng.integers(len(resident)))]
            for pol in (cost, dens):
                pol.touch(bid, 0.0)
        else:
            victim = cost.first()
            assert victim == dens.first()
            for pol in (cost, dens):
                pol.remove(victim)  # type: ignore[arg-type]
            resident.remove(victim)  # type: ignore[arg-type]
    w = cost.weights(np.array(resident))  # type: ignore[attr-defined]
    assert (w == w[0]).all() and w[0] > 0
    assert cost._table is not None  # (the learned ranking, not only LRU before the first table)


def test_cost_aware_ranks_equal_reuse_by_depth() -> None:
    """With the same learned density everywhere, the density policy offers the older block and
    the cost-aware one the shallower (cheaper to recompute), however young."""
    for name, expected in (("density", [1, 102]), ("cost", [102, 1])):
        v = FakeView()
        pol = _make(name, v, LAST, block_tokens=512) if name == "cost" else _make(name, v, LAST)
        chain = [v.add(0)]
        for b in range(1, 100):
            chain.append(v.add(b, chain[-1]))
        v.children[:] = 0  # let every block be a leaf: only depth and age differ
        for b in range(100):
            pol.insert(b, 4096, 0.0)
        pol.insert(v.add(102), 4096, 0.0)  # depth 0, the youngest
        pol._table = np.ones_like(pol._ended)  # type: ignore[attr-defined]  # a flat density
        order = [b for b in pol.candidates() if b in (1, 102)]
        assert order == expected, name


def test_density_config_is_validated() -> None:
    with pytest.raises(ValueError, match="decay"):
        DensityConfig(decay=0.0)
    with pytest.raises(ValueError, match="period"):
        DensityConfig(period=1)


def test_make_policies_binds_every_tier(tmp_path: Path) -> None:
    tiers = [type("T", (), {"name": n, "kind": k})() for n, k in (("a", "dram"), ("b", "nvme"))]
    view = FakeView()
    pols = make_policies("density", {"ghost_factor": 2}, view, tiers)
    assert [type(p) for p in pols] == [DensityPolicy, DensityPolicy]
    assert [p._tier for p in pols] == [TierContext("a", "dram", 0, "nvme"), TierContext("b", "nvme", 1, "")]
    assert pols[1]._tier.last and not pols[0]._tier.last
    assert pols[0].config.ghost_factor == 2


def test_store_default_policy_is_chain() -> None:
    assert StoreConfig().policy == "chain"
    assert policy_class(StoreConfig().policy) is ChainPolicy
    known = {LRUPolicy, ARCPolicy, DensityPolicy, CostAwarePolicy, LRBPolicy, ChainPolicy, LHDPolicy}
    assert known == {policy_class(n) for n in NAMES}
