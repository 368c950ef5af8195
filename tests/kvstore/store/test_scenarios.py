"""Exact-order scenarios of the store core on null tiers and a fake clock: which block leaves,
in which order, what a failed make-room leaves behind, long chains, one write per durable block,
chain validation, the namespace table, and the counters of lookups and loads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.clock import FakeClock
from kvstore.config import StoreConfig
from kvstore.errors import QuotaExceededError, TierFullError, TierIOError, UsageError
from kvstore.keys import BlockHash, Namespace
from kvstore.registry import make_tier
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload, small_tiers
from tests.kvstore.store.conftest import NS, chain, get, null_tiers, put, resident, where
from tiers.faulty import FaultyTier

Make = Callable[..., KVStore]


# ---- leaf-exact eviction ---------------------------------------------------------------------------


def test_lru_evicts_leaves_only_and_a_parent_competes_at_its_own_recency(null_store: Make) -> None:
    s = null_store(4)
    put(s, ["a0", "a1"])  # leaves first into the policy: a1 older than a0
    put(s, ["b0"])
    put(s, ["a0", "a1", "c2"], start=2)  # a1 now has a child: held, not a candidate
    assert resident(s) == {"a0", "a1", "b0", "c2"}
    put(s, ["d0"])
    assert resident(s) == {"a0", "a1", "c2", "d0"}  # b0: the oldest leaf
    put(s, ["e0"])
    assert resident(s) == {"a0", "a1", "d0", "e0"}  # c2 went; its parent a1 is a leaf again
    put(s, ["f0"])
    assert resident(s) == {"a0", "d0", "e0", "f0"}  # a1 older than d0 and e0 although offered later
    put(s, ["g0"])
    assert resident(s) == {"d0", "e0", "f0", "g0"}
    assert s.stats()["evictions"] == 4 and s.stats()["failed_room"] == 0


def test_a_hit_makes_the_prefix_recent_deepest_first(null_store: Make) -> None:
    s = null_store(4)
    put(s, ["a0", "a1"])
    put(s, ["b0", "b1"])
    assert get(s, ["a0", "a1"]) == 2  # b1 is now the oldest leaf
    put(s, ["c0"])
    assert resident(s) == {"a0", "a1", "b0", "c0"}
    put(s, ["d0"])
    assert resident(s) == {"a0", "a1", "c0", "d0"}  # then b0 (older than a1)
    put(s, ["e0"])
    assert resident(s) == {"a0", "c0", "d0", "e0"}


def test_demotion_order_on_two_tiers(null_store: Make) -> None:
    s = null_store(2, 3)
    put(s, ["a0", "a1"])
    put(s, ["b0"])  # t0 full: a0 (least recent on t0) moves down
    assert where(s) == {"a0": ["t1"], "a1": ["t0"], "b0": ["t0"]}
    put(s, ["c0", "c1"])  # a1 then b0 move down; t1 now holds a0, a1, b0
    assert where(s) == {"a0": ["t1"], "a1": ["t1"], "b0": ["t1"], "c0": ["t0"], "c1": ["t0"]}
    put(s, ["d0"])  # c0 moves down; t1 makes room: a1 and b0 are its leaves, a1 the older
    assert where(s) == {"a0": ["t1"], "b0": ["t1"], "c0": ["t1"], "c1": ["t0"], "d0": ["t0"]}
    st = s.stats()
    assert (st["demotions"], st["evictions"]) == (4, 1)


def test_a_make_room_that_fails_evicts_nothing(null_store: Make) -> None:
    s = null_store(3)
    put(s, ["a0", "a1", "a2"])
    assert s.pin(NS, chain("a0", "a1", "a2")) == 3  # nothing may leave
    assert put(s, ["b0"]) == 0  # no exception: nothing stored
    st = s.stats()
    assert resident(s) == {"a0", "a1", "a2"}
    assert (st["evictions"], st["failed_room"], st["truncated_puts"]) == (0, 1, 1)
    assert s.unpin(NS, chain("a0", "a1", "a2")) == 3
    assert put(s, ["b0"]) == 1  # now the leaf a2 may leave
    assert resident(s) == {"a0", "a1", "b0"}


def test_make_room_finds_the_one_leaf_among_many_interior_blocks(null_store: Make) -> None:
    """One chain fills the tier; the work cap is far smaller than the chain: the leaf is still
    found at once (the last tier's policy orders leaves only)."""
    for policy in ("lru", "density", "arc", "cost"):
        s = null_store(500, policy=policy, evict_work_cap=4)
        names = [f"x{i}" for i in range(500)]
        assert put(s, names) == 500
        assert put(s, ["y0"]) == 1
        assert resident(s) == set(names[:-1]) | {"y0"}, policy


# ---- long chains -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tiers", [(100,), (50, 50), (10, 20, 30, 40)])
def test_a_chain_longer_than_the_store_keeps_its_leading_blocks(null_store: Make, tiers: tuple[int, ...]) -> None:
    s = null_store(*tiers)
    names = [f"l{i}" for i in range(150)]
    assert put(s, names) == 100  # the leading blocks that fit; no exception
    assert s.lookup(NS, chain(*names)).num_blocks == 100
    assert s.stats()["truncated_puts"] == 1 and s.stats()["blocks"] == 100
    assert put(s, ["m0"]) == 1  # the chain's leaf leaves for a new block
    assert s.lookup(NS, chain(*names)).num_blocks == 99


def test_a_long_chain_evicts_everything_else_first(null_store: Make) -> None:
    s = null_store(100)
    for i in range(20):
        put(s, [f"s{i}", f"s{i}x"])
    names = [f"l{i}" for i in range(120)]
    assert put(s, names) == 100
    assert resident(s) == set(names[:100])


# ---- failed demotions (issue 14 #2) -------------------------------------------------------------------


@pytest.mark.parametrize("error", [TierFullError, TierIOError], ids=["full", "io-error"])
def test_a_failed_demotion_never_drops_a_persistent_last_copy(tmp_path: Path, error: type) -> None:
    """NVMe over a lower tier whose writes fail (a full disk, ENOSPC): blocks put durably stay
    on NVMe with their copies; the tier reports full and the put that needed room fails."""
    clock = FakeClock()
    specs = (small_tiers(nvme_blocks=4)[1], null_tiers(8)[0])
    nvme = make_tier("nvme", "nvme", dict(specs[0].options), tmp_path, clock)
    lower = FaultyTier(make_tier("null", "t0", {"capacity_blocks": 8}, tmp_path, clock))
    with KVStore(StoreConfig(root=tmp_path, tiers=specs), clock=clock, tiers=[nvme, lower]) as s:
        s.register_namespace(SMALL_NS)
        c = chain_for(5, 4)
        assert s.put(SMALL_NS, c, [payload(h) for h in c], durable=True) == 4
        lower.inject("write", error, times=None)
        d = chain_for(6, 1)
        if error is TierIOError:
            with pytest.raises(TierIOError):
                s.put(SMALL_NS, d, [payload(d[0])])
        else:
            assert s.put(SMALL_NS, d, [payload(d[0])]) == 0
        assert s.lookup(SMALL_NS, c).tiers == ("nvme",) * 4  # every durable block kept
        assert all(nvme.contains(h) for h in c)
        assert s.stats()["evictions"] == 0
        lower.clear()
        assert s.put(SMALL_NS, d, [payload(d[0])]) == 1
        assert s.lookup(SMALL_NS, c).tiers == ("t0",) + ("nvme",) * 3


def test_a_volatile_tier_whose_demotions_fail_lets_a_leaf_go(tmp_path: Path, null_store: Make) -> None:
    """Above a lower tier that takes nothing, a volatile tier's own leaves may leave: nothing
    in it was put durably, and a cache must keep taking new prefixes."""
    clock = FakeClock()
    upper = make_tier("null", "t0", {"capacity_blocks": 2}, tmp_path, clock)
    lower = FaultyTier(make_tier("null", "t1", {"capacity_blocks": 8}, tmp_path, clock))
    s = null_store(tiers=[upper, lower])
    put(s, ["a0", "a1"])
    lower.inject("write", TierFullError, times=None)
    assert put(s, ["b0"]) == 1
    assert where(s) == {"a0": ["t0"], "b0": ["t0"]}  # a0's demotion failed; the leaf a1 left
    assert (s.stats()["evictions"], s.stats()["demotions"]) == (1, 0)


# ---- one write per durable block (item 5, issue 14 #1) -----------------------------------------------


class Recording(FaultyTier):
    """Records every write with its ``durable`` flag."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.writes: list[tuple[bytes, bool]] = []

    def write(self, key: BlockHash, src: Any, meta: Any, *, durable: bool = False) -> None:
        self.writes.append((bytes(key), durable))
        super().write(key, src, meta, durable=durable)


def _real_store(tmp_path: Path, specs: tuple, **kw: Any) -> tuple[KVStore, list[Recording]]:
    clock = FakeClock()
    tiers = [Recording(make_tier(t.kind, t.name, dict(t.options), tmp_path, clock)) for t in specs]
    s = KVStore(StoreConfig(root=tmp_path, tiers=specs, **kw), clock=clock, tiers=tiers)
    s.register_namespace(SMALL_NS)
    return s, tiers


@pytest.mark.parametrize("first", ["dram", "nvme"])
def test_a_durable_put_writes_each_block_once(tmp_path: Path, first: str) -> None:
    specs = small_tiers() if first == "dram" else small_tiers()[1:]
    s, tiers = _real_store(tmp_path, specs)
    with s:
        c = chain_for(1, 6)
        assert s.put(SMALL_NS, c, [payload(h) for h in c], durable=True) == 6
        nvme = next(t for t in tiers if t.kind == "nvme")
        assert sorted(nvme.writes) == sorted((bytes(h), True) for h in c)
        assert sum(len(t.writes) for t in tiers) == 6
        assert s.stats()["tier_writes"] == 6
        assert s.lookup(SMALL_NS, c).tiers == ("nvme",) * 6
        # A durable put of a chain cached before copies only what has no persistent copy.
        d = chain_for(2, 4)
        s.put(SMALL_NS, d[:2], [payload(h) for h in d[:2]])
        before = sum(len(t.writes) for t in tiers)
        assert s.put(SMALL_NS, d, [payload(h) for h in d[2:]], start=2, durable=True) == 2
        assert sum(len(t.writes) for t in tiers) - before == 4 - (0 if first == "dram" else 2)


def test_demoting_a_last_persistent_copy_writes_it_durably_first(tmp_path: Path) -> None:
    specs = (small_tiers(nvme_blocks=4)[1], small_tiers()[2])  # nvme (4 blocks) -> object
    s, (nvme, obj) = _real_store(tmp_path, specs)
    with s:
        c = chain_for(3, 4)
        s.put(SMALL_NS, c, [payload(h) for h in c], durable=True)
        d = chain_for(4, 4)
        s.put(SMALL_NS, d, [payload(h) for h in d])  # NVMe is full: c goes down to the object tier
        assert obj.writes and all(durable for _, durable in obj.writes)
        assert {k for k, _ in obj.writes} == {bytes(h) for h in c}
        assert s.lookup(SMALL_NS, c).tiers == ("object",) * 4


def test_a_demotion_from_a_volatile_tier_is_not_synced(tmp_path: Path) -> None:
    s, (dram, nvme, obj) = _real_store(tmp_path, small_tiers(dram_blocks=4))
    with s:
        for seed in range(3):
            c = chain_for(10 + seed, 4)
            s.put(SMALL_NS, c, [payload(h) for h in c])
        assert len(nvme.writes) == 8 and not any(durable for _, durable in nvme.writes)


# ---- chain validation (issue 14 #7) ---------------------------------------------------------------------


def test_a_chain_that_repeats_a_hash_is_refused_before_the_index_changes(null_store: Make) -> None:
    s = null_store(8)
    put(s, ["a0"])
    before = (len(s.index), s.index.children.copy())
    with pytest.raises(UsageError, match="repeats"):
        put(s, ["x0", "x0"])
    with pytest.raises(UsageError, match="repeats"):
        put(s, ["a0", "x1", "a0"], start=1)
    assert len(s.index) == before[0] and np.array_equal(s.index.children, before[1])
    assert put(s, ["x0"]) == 1  # the store is fine


def test_a_chain_through_a_block_cached_elsewhere_is_refused(null_store: Make) -> None:
    s = null_store(8)
    put(s, ["c0", "q1"])  # q1 is c0's child
    put(s, ["o0"])
    idx = s.index
    c0 = idx.id_of(chain("c0")[0])
    with pytest.raises(UsageError, match="another place"):
        put(s, ["o0", "q1"], start=1)  # q1 is cached under c0, not o0
    with pytest.raises(UsageError, match="another place"):
        put(s, ["q1"])  # at depth 0
    assert int(idx.children[c0]) == 1 and resident(s) == {"c0", "q1", "o0"}
    assert put(s, ["c0", "q1"]) == 0  # the real chain is still whole
    s.delete(NS, chain("c0"))
    assert resident(s) == {"o0"} and (idx.children[idx.live_ids()] >= 0).all()


# ---- the namespace table (issue 14 #5, #12) ----------------------------------------------------------------


def _ns(i: int) -> Namespace:
    return Namespace(f"test/ns-{i}", NS.layout)


def test_namespaces_have_a_limit_with_a_clear_error(null_store: Make) -> None:
    s = null_store(8, max_namespaces=3)  # NS is one
    s.register_namespace(_ns(1))
    s.register_namespace(_ns(2))
    with pytest.raises(QuotaExceededError, match="max_namespaces"):
        s.register_namespace(_ns(3))
    s.register_namespace(_ns(2), ttl_s=60.0)  # a known one still re-registers
    assert len(s.namespaces()) == 3


def test_a_store_holding_more_namespaces_than_its_limit_still_opens(tmp_path: Path) -> None:
    """Lowering max_namespaces below what the store holds: it opens and serves them all, and
    refuses only new ones."""
    cfg = StoreConfig(root=tmp_path, tiers=null_tiers(8), persist_on_close=False)
    with KVStore(cfg, clock=FakeClock()) as s:
        for i in range(4):
            s.register_namespace(_ns(i))
    small = StoreConfig(root=tmp_path, tiers=null_tiers(8), max_namespaces=2)
    with KVStore(small, clock=FakeClock()) as s:
        assert len(s.namespaces()) == 4
        s.register_namespace(_ns(3))
        with pytest.raises(QuotaExceededError):
            s.register_namespace(_ns(4))


def test_namespaces_json_is_written_only_when_it_changes(null_store: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    s = null_store(8)
    writes: list[Path] = []
    real = s._namespaces._write  # noqa: SLF001 - count the file writes

    def counting(path: Path, data: bytes) -> None:
        assert not s._lock._is_owned()  # noqa: SLF001 - two fsyncs never under the store lock
        writes.append(path)
        real(path, data)

    monkeypatch.setattr(s._namespaces, "_write", counting)  # noqa: SLF001
    for _ in range(5):
        s.register_namespace(NS)  # engines reconnecting
    assert writes == []
    s.register_namespace(NS, ttl_s=120.0)
    s.register_namespace(_ns(1))
    assert len(writes) == 2
    saved = json.loads(writes[-1].read_text())
    assert {e["namespace"]["model_id"] for e in saved} == {NS.model_id, "test/ns-1"}


@pytest.mark.parametrize("damage", ['[{"namespace": 5}]', "{not json", '{"a": 1}'])
def test_a_damaged_namespaces_json_is_quarantined(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / "namespaces.json").write_text(damage)
    with KVStore(StoreConfig(root=root, tiers=null_tiers(4)), clock=FakeClock()) as s:
        assert s.stats()["namespaces_quarantined"] == 1
        assert [p.name.startswith("namespaces.json.corrupt-") for p in root.iterdir()].count(True) == 1
        s.register_namespace(NS)
        assert put(s, ["a0"]) == 1
    assert json.loads((root / "namespaces.json").read_text())[0]["namespace"]["model_id"] == NS.model_id


# ---- counters (issue 15 #2) -----------------------------------------------------------------------------------


def test_lookups_and_loads_are_counted_apart(null_store: Make) -> None:
    s = null_store(8)
    put(s, ["a0", "a1", "a2"])
    assert s.lookup(NS, chain("a0", "a1", "a2", "a3")).num_blocks == 3
    assert get(s, ["a0", "a1", "z2"]) == 2
    st = s.stats()
    assert (st["lookups"], st["lookup_blocks"], st["lookup_hit_blocks"]) == (1, 4, 3)
    assert (st["loads"], st["load_blocks"], st["hit_blocks"], st["loaded_blocks"]) == (1, 3, 2, 2)
    assert st["lookup_hit_rate"] == 0.75 and st["block_hit_rate"] == pytest.approx(2 / 3)


# ---- a just-stored chain survives its next read (item 4) ------------------------------------------------------


@pytest.mark.parametrize("policy", ["density", "lru", "arc", "cost"])
def test_store_then_retrieve_on_one_full_tier_hits_all(null_store: Make, policy: str) -> None:
    s = null_store(1024, policy=policy)
    for r in range(64):  # the tier is full of older requests
        put(s, [f"old{r}-{i}" for i in range(32)])
    rounds = [[f"new{r}-{i}" for i in range(64)] for r in range(16)]  # 1,024 blocks: they fit
    for names in rounds:
        assert put(s, names) == 64
    hits = sum(get(s, names) for names in rounds)
    assert hits == 16 * 64


def test_store_then_retrieve_on_a_full_dram_tier_hits_all(tmp_path: Path) -> None:
    """The same on a real shared-memory DRAM tier with the default policy."""
    specs = small_tiers(dram_blocks=64)[:1]
    with KVStore(StoreConfig(root=tmp_path, tiers=specs), clock=FakeClock()) as s:
        s.register_namespace(SMALL_NS)
        for r in range(16):
            c = chain_for(100 + r, 8)
            s.put(SMALL_NS, c, [payload(h) for h in c])
        fresh = [chain_for(200 + r, 8) for r in range(8)]
        for c in fresh:
            assert s.put(SMALL_NS, c, [payload(h) for h in c]) == 8
        for c in fresh:
            buf = np.zeros(8 * BB, np.uint8)
            assert s.get_into(SMALL_NS, c, buf) == 8
            assert buf[:BB].tobytes() == payload(c[0])


def test_touching_an_empty_hit_raises_nothing_and_reorders_nothing(null_store: Make) -> None:
    """``Ledger.touch_hits`` of no blocks (its same-tiers fast path reads the first block's tiers)
    leaves every policy's order as it was: the oldest leaf still leaves first."""
    s = null_store(2)
    put(s, ["a0"])
    put(s, ["b0"])
    s._ledger.touch_hits(np.empty(0, np.int64), 10.0, 20.0)  # noqa: SLF001 - the ledger's own call
    put(s, ["c0"])
    assert resident(s) == {"b0", "c0"}


def test_a_hit_tells_each_tier_policy_once_with_its_own_blocks_deepest_first(null_store: Make) -> None:
    """A load whose prefix lies in two tiers: one ``touch_many`` per tier, each with that tier's
    blocks of the hit, deepest first (what a per-block touch would have told each policy)."""
    s = null_store(2, 8, promote_on_hit=False)
    put(s, ["a0", "a1", "a2", "a3"])  # the upper tier keeps two of them
    tiers = where(s)
    calls: list[tuple[int, list[str]]] = []
    for k, pol in enumerate(s._ledger.policies):  # noqa: SLF001 - spying on the store's own policies
        def spy(bids: list[int], now: float, k: int = k, real: Any = pol.touch_many) -> None:
            calls.append((k, [s.index.hash_of(b).rstrip(b".").decode() for b in bids]))
            real(bids, now)
        pol.touch_many = spy  # type: ignore[method-assign]  # an instance spy
    assert get(s, ["a0", "a1", "a2", "a3"]) == 4
    deepest_first = ["a3", "a2", "a1", "a0"]
    assert calls == [(k, [n for n in deepest_first if f"t{k}" in tiers[n]]) for k in (0, 1) if any(f"t{k}" in t for t in tiers.values())]
    assert {n for _, names in calls for n in names} == set(deepest_first)
    assert len(calls) == 2 and len(set(map(tuple, tiers.values()))) == 2  # two tiers, two kinds of block
