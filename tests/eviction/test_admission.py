"""Admission to the last tier: what a refusal may drop, and the reuse rule's hit-loss budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eviction.admission import (
    LEARNED_FEATURES,
    Admission,
    LearnedAdmission,
    LearnedConfig,
    ReuseAdmission,
    ReuseConfig,
    block_class,
)
from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.index import NO_PARENT, RadixIndex
from kvstore.registry import ADMISSIONS, admission_class, register_admission
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS


class Never(Admission):
    """Refuses every block it is asked about."""

    name = "never"
    asked: list[int] = []

    def admit(self, bid: int, now: float) -> bool:
        Never.asked.append(bid)
        return False

    def refuses(self, bid: int, now: float) -> bool:
        return True


class NeverInner(Never):
    """Refuses every block, inner ones too."""

    name = "never-inner"
    inner = True


@pytest.fixture(autouse=True)
def _never() -> Any:
    register_admission("never", "tests.eviction.test_admission:Never")
    register_admission("never-inner", "tests.eviction.test_admission:NeverInner")
    Never.asked = []
    yield
    ADMISSIONS.pop("never", None)
    ADMISSIONS.pop("never-inner", None)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _store(tmp_path: Path, tiers: tuple[TierSpec, ...], admission: str = "never", **kw: Any) -> KVStore:
    config = StoreConfig(root=tmp_path, tiers=tiers, admission=admission, persist_on_close=False, **kw)
    s = KVStore(config, clock=FakeClock(1_000.0))
    s.register_namespace(SMALL_NS)
    return s


NULL3 = (
    TierSpec("dram", "null", {"capacity_blocks": 2}),
    TierSpec("nvme", "null", {"capacity_blocks": 2}),
    TierSpec("object", "null", {"capacity_blocks": 100}),
)


NVME3 = (  # a persistent middle tier: durable puts land there
    TierSpec("dram", "null", {"capacity_blocks": 1}),
    TierSpec("nvme", "nvme", {"capacity_bytes": 2 * 65536, "slab_bytes": 65536}),
    TierSpec("object", "null", {"capacity_blocks": 100}),
)


def _put(s: KVStore, ids: list[int], **kw: Any) -> None:
    src = memoryview(bytearray(BB))
    s.put(SMALL_NS, [_key(i) for i in ids], [src] * len(ids), **kw)


def _in_last(s: KVStore, ids: list[int]) -> int:
    return s.lookup(SMALL_NS, [_key(i) for i in ids]).num_blocks


def test_registered_rules() -> None:
    assert admission_class("all") is Admission
    assert admission_class("reuse") is ReuseAdmission
    assert admission_class("learned") is LearnedAdmission


def test_reuse_is_the_default_and_reported(tmp_path: Path) -> None:
    assert StoreConfig().admission == "reuse"
    s = KVStore(StoreConfig(root=tmp_path, tiers=NULL3, persist_on_close=False), clock=FakeClock(1_000.0))
    st = s.stats()
    assert st["admission"] == {"admission": "reuse", "hit_loss_budget": 0.0075, "inner": True,
                               "skipping_classes": 0, "admission_lost_hits": 0, "unreachable_skipped": 0,
                               "cut_descendants": 0}
    assert (st["skipped_writes"], st["skipped_bytes"]) == (0, 0)
    s.close()


def test_refused_leaves_leave_and_are_counted(tmp_path: Path) -> None:
    s = _store(tmp_path, NULL3)
    for i in range(6):  # six one-block chains: four pass through the middle tier, two refused
        _put(s, [i])
    st = s.stats()
    assert st["skipped_writes"] == 2
    assert st["skipped_bytes"] == 2 * BB
    assert st["tiers"][2]["bytes_in"] == 0
    assert [_in_last(s, [i]) for i in range(6)] == [0, 0, 1, 1, 1, 1]
    s.close()


def test_inner_blocks_are_never_asked_by_a_leaf_rule(tmp_path: Path) -> None:
    s = _store(tmp_path, NULL3)
    _put(s, [0, 1, 2, 3, 4, 5])  # one chain: only its leaves may be refused
    _put(s, [10, 11])
    st = s.stats()
    index = s.index
    assert all(int(index.children[b]) == 0 for b in Never.asked)
    assert st["skipped_writes"] == len(Never.asked)
    s.close()


def _tiers(dram: int, nvme: int) -> tuple[TierSpec, ...]:
    return (TierSpec("dram", "null", {"capacity_blocks": dram}), TierSpec("nvme", "null", {"capacity_blocks": nvme}),
            TierSpec("object", "null", {"capacity_blocks": 100}))


def test_a_refused_inner_block_leaves_with_its_subtree(tmp_path: Path) -> None:
    s = _store(tmp_path, _tiers(1, 4), "never-inner", policy="lru")
    _put(s, [0, 1, 2])  # DRAM {2}, NVMe {0, 1}
    for i in (10, 11, 12):  # each pushes DRAM's block down; the last makes NVMe demote block 0
        _put(s, [i])
    index = s.index
    assert [index.id_of(_key(i)) for i in (0, 1, 2)] == [None] * 3  # the chain is gone, no hollow node
    assert _in_last(s, [0]) == 0 and _in_last(s, [10]) == 1
    st = s.stats()
    assert (st["skipped_writes"], st["skipped_bytes"]) == (3, 3 * BB)  # none of the three is written
    assert st["tiers"][2]["bytes_in"] == 0
    assert st["admission"]["admission"] == "never-inner"
    assert len(Never.asked) == 1  # asked about block 0 only: its descendants went with it
    s.close()


def test_an_inner_block_whose_subtree_is_above_is_written(tmp_path: Path) -> None:
    """Block 0 leaves NVMe while its descendant 2 is moving down from DRAM: the subtree may not
    go, so block 0 is written (and the rule never asked)."""
    s = _store(tmp_path, _tiers(1, 2), "never-inner", policy="lru")
    _put(s, [0, 1, 2])  # DRAM {2}, NVMe {0, 1}
    _put(s, [10])  # 2 moves to NVMe, which demotes 0
    assert s.lookup(SMALL_NS, [_key(0)]).tiers == ("object",)
    assert _in_last(s, [0, 1, 2]) == 3
    assert Never.asked == []
    s.close()


def test_pinned_prefix_is_always_stored(tmp_path: Path) -> None:
    s = _store(tmp_path, NULL3)
    _put(s, [0])
    assert s.pin(SMALL_NS, [_key(0)]) == 1
    for i in range(1, 6):
        _put(s, [i])
    assert s.lookup(SMALL_NS, [_key(0)]).tiers == ("object",)  # demoted, written although refused
    assert s.stats()["skipped_writes"] == 1  # block 1, the other block pushed out of the upper tiers
    assert _in_last(s, [1]) == 0
    s.close()


def test_durable_puts_are_always_stored(tmp_path: Path) -> None:
    tiers = NVME3
    s = _store(tmp_path, tiers)
    _put(s, [0], durable=True)
    for i in range(1, 2 * 65536 // BB + 6):  # past both upper tiers
        _put(s, [i])
    assert s.lookup(SMALL_NS, [_key(0)]).tiers == ("object",)  # refused, written all the same
    st = s.stats()
    assert st["tiers"][2]["bytes_in"] == BB  # it alone: every other block leaving was skipped
    assert st["skipped_writes"] == 4  # the upper tiers hold all but five blocks; block 0 stored
    s.close()


def test_durable_puts_are_stored_after_a_restart(tmp_path: Path) -> None:
    """A restart forgets which puts were durable: every recovered block is kept."""
    tiers = NVME3
    s = _store(tmp_path, tiers)
    _put(s, [0], durable=True)
    s.close()
    s = _store(tmp_path, tiers)
    assert s.stats()["recovered_blocks"] == 1
    for i in range(1, 2 * 65536 // BB + 6):
        _put(s, [i])
    assert s.lookup(SMALL_NS, [_key(0)]).tiers == ("object",)
    st = s.stats()
    assert st["tiers"][2]["bytes_in"] == BB
    assert st["skipped_writes"] == 4
    s.close()


class FakeView:
    """Index columns for a handful of blocks, with keys ``b"k<bid>"``."""

    def __init__(self, n: int) -> None:
        self.parent = np.full(n, -1, np.int32)
        self.depth = np.zeros(n, np.int32)
        self.children = np.zeros(n, np.int32)
        self.tiers = np.ones(n, np.uint8)
        self.hits = np.zeros(n, np.uint32)
        self.last_access = np.zeros(n)
        self.live: set[int] = set(range(n))

    def hash_of(self, bid: int) -> bytes:
        return b"k%d" % bid

    def id_of(self, key: bytes) -> int | None:
        bid = int(key[1:])
        return bid if bid in self.live else None


class Rule(ReuseAdmission):
    """The reuse rule over a fake view, dropping what it refuses (as the store does); every
    block asked about was last read at ``now`` (idle 0 s: one class per depth)."""

    def admit(self, bid: int, now: float) -> bool:
        self.view.last_access[bid] = now  # type: ignore[attr-defined]
        ok = super().admit(bid, now)
        if not ok:
            self.view.live.discard(bid)  # type: ignore[attr-defined]
        return ok


def _rule(view: FakeView, hits_per_decision: float, **kw: Any) -> ReuseAdmission:
    adm = Rule(ReuseConfig(min_samples=4, poll=10, decay=1.0, horizon_s=5.0, **kw))
    adm.bind(view, lambda: int(hits_per_decision * adm.decisions))
    return adm


def test_a_class_never_read_again_is_skipped_and_a_reread_one_stored() -> None:
    view = FakeView(400)
    view.depth[200:] = 8  # class B: deeper; its blocks are all read again
    adm = _rule(view, 0.5, hit_loss_budget=0.01, margin=1.0)
    for b in range(100):  # one second a pair: a decision resolves 5 s later, or at a reuse
        adm.admit(b, float(b))
        adm.admit(200 + b, float(b))
        view.hits[200 + b] += 1  # read again right after
    a, b = block_class(0, 0, 0.0, 0), block_class(0, 8, 0.0, 0)
    assert adm.skip[a] and not adm.skip[b]
    assert adm.admit(150, 100.0) is False
    assert adm.admit(350, 100.0) is True
    assert adm.lost == 0


def test_measured_loss_past_the_budget_stops_skipping() -> None:
    view = FakeView(400)
    adm = _rule(view, 5.0, hit_loss_budget=0.01, margin=1.0)  # 1% of hits: 0.05 per decision
    for b in range(40):
        adm.admit(b, float(b))
    assert adm.admit(40, 40.0) is False  # never read again so far: skipped
    refused = [b for b in range(41, 80) if not adm.admit(b, float(b))]
    view.live |= set(refused[:11])  # 11 refused blocks are put again: past 1% of 5 x 100 hits
    for b in range(80, 100):
        adm.admit(b, float(b))
    assert adm.lost == 11
    assert not adm.skip.any()
    assert all(adm.admit(b, float(b)) for b in range(100, 120))


def test_a_block_under_a_hollow_parent_is_skipped_and_its_return_counted() -> None:
    view = FakeView(100)
    view.parent[1], view.depth[1] = 0, 1
    view.tiers[0] = 0  # block 0 was refused: hollow; block 1 below it is unreachable
    adm = _rule(view, 1.0, hit_loss_budget=0.01)
    assert adm.admit(1, 0.0) is False
    assert (adm.unreachable, adm.decisions) == (1, 0)  # no decision: nothing learned from it
    assert adm.describe()["unreachable_skipped"] == 1
    view.live.add(1)  # put again (its parent too): a hit the parent's refusal cost
    view.tiers[0] = 1
    for b in range(10, 20):  # the poll after 10 decisions sees it back
        adm.admit(b, float(b))
    assert adm.lost == 1
    assert adm.returns == 0  # not a decision's return: the loss weight of the classes rises


def test_refuses_answers_what_admit_will() -> None:
    view = FakeView(400)
    view.children[::3] = 1  # some blocks have children: shape 2
    view.depth[:] = np.arange(400) % 7
    adm = _rule(view, 0.2, hit_loss_budget=0.05, margin=1.0)
    answers = []
    for b in range(300):
        view.last_access[b] = float(b)  # as Rule.admit sets it
        will_refuse = adm.refuses(b, float(b))
        answers.append(will_refuse)
        assert adm.admit(b, float(b)) is not will_refuse, f"block {b}"
        if b % 5 == 0:
            view.hits[b] += 1
    assert any(answers) and not all(answers)  # both answers were checked


def test_descendants_cut_with_a_refused_block_count_as_lost_when_back() -> None:
    view = FakeView(100)
    adm = _rule(view, 1.0, hit_loss_budget=0.01)
    adm.cut([view.hash_of(5), view.hash_of(6)])
    view.live.discard(5)
    view.live.discard(6)
    assert adm.describe()["cut_descendants"] == 2
    view.live.add(6)  # put again: a hit the refusal cost
    for b in range(10, 20):
        adm.admit(b, float(b))
    assert (adm.lost, adm.returns) == (1, 0)


def test_budget_zero_skips_nothing() -> None:
    view = FakeView(100)
    adm = _rule(view, 1.0, hit_loss_budget=0.0)
    assert all(adm.admit(b, float(b)) for b in range(100))


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="hit_loss_budget"):
        ReuseConfig(hit_loss_budget=1.5)
    with pytest.raises(ValueError, match="horizon_s"):
        ReuseConfig(horizon_s=0)


def test_the_daemon_runs_admission_and_reports_it(tmp_path: Path) -> None:
    """The daemon's store runs the reuse rule with inner decisions over real DRAM, NVMe and
    object tiers; blocks never read again past the horizon are skipped, and the skips show in
    ``/v1/stats`` and ``/metrics``."""
    import httpx

    from kvstore.client import connect
    from kvstore.server.config import ServerConfig, TenantSpec
    from kvstore.server.daemon import ThreadedDaemon
    from tests.conftest import payload, small_tiers

    token = "token-of-the-operators-01234"

    clock = FakeClock(1_000.0)
    options = {"inner": True, "poll": 1, "min_samples": 1, "hit_loss_budget": 0.5, "margin": 1.0, "horizon_s": 5.0}
    store_cfg = StoreConfig(root=tmp_path, tiers=small_tiers(dram_blocks=4, nvme_blocks=8), admission_options=options)
    server_cfg = ServerConfig(http_port=0, data_port=0, ucx_port=0, tenants=(TenantSpec("ops", token, admin=True),))
    d = ThreadedDaemon(store_cfg, server_cfg, clock=clock)
    try:
        with connect(d.url, token=token, plane="tcp") as c:
            for i in range(24):  # one-off three-block chains, ten seconds apart: none is read again
                chain = [_key(1000 * i + j) for j in range(3)]
                c.put(SMALL_NS, chain, [payload(k, BB) for k in chain])
                clock.advance(10.0)
        with httpx.Client(base_url=d.url, timeout=10, headers={"Authorization": f"Bearer {token}"}) as h:
            st = h.get("/v1/stats").json()["store"]
            text = h.get("/metrics").text
    finally:
        d.stop()
    assert st["admission"]["admission"] == "reuse" and st["admission"]["inner"] is True
    assert st["skipped_writes"] > 0 and st["skipped_bytes"] == st["skipped_writes"] * BB
    assert st["admission"]["cut_descendants"] > 0  # inner blocks left with their subtrees
    assert f"kvstore_skipped_writes_total {float(st['skipped_writes'])}" in text


def test_subtree_classes_tell_big_subtrees_from_small() -> None:
    idx = RadixIndex()
    small = idx.insert_chain([b"s%d" % i for i in range(2)], NO_PARENT, 0, 1, 0, 1, 0.0, 1e9).tolist()
    big = idx.insert_chain([b"b%d" % i for i in range(9)], NO_PARENT, 0, 1, 0, 1, 0.0, 1e9).tolist()
    adm = ReuseAdmission(ReuseConfig(subtree=True))
    adm.bind(idx, lambda: 0)
    # Two blocks alike but for the subtree a refusal would take: 1 and 8 cached descendants.
    assert adm._class(small[0], idx.hash_of(small[0]), 0.0) == block_class(0, 0, 0.0, 2, 1)
    assert adm._class(big[0], idx.hash_of(big[0]), 0.0) == block_class(0, 0, 0.0, 2, 8)
    assert block_class(0, 0, 0.0, 2, 1) != block_class(0, 0, 0.0, 2, 8)
    assert adm.admit(big[0], 0.0)  # nothing learned yet: written
    # Without the option every subtree is one class, the ids of the rule before it.
    plain = ReuseAdmission(ReuseConfig())
    plain.bind(idx, lambda: 0)
    assert plain._class(big[0], idx.hash_of(big[0]), 0.0) == block_class(0, 0, 0.0, 2) == block_class(0, 0, 0.0, 2, 0)


class Learned(LearnedAdmission):
    """The learned rule over a fake view, dropping what it refuses (as the store does)."""

    def admit(self, bid: int, now: float) -> bool:
        ok = super().admit(bid, now)
        if not ok:
            self.view.live.discard(bid)  # type: ignore[attr-defined]
        return ok


def _learned(view: FakeView, hits_per_decision: float, **kw: Any) -> LearnedAdmission:
    cfg = {"poll": 10, "horizon_s": 5.0, "min_samples": 40, "refit_every": 20, "reference": 64, **kw}
    adm = Learned(LearnedConfig(**cfg))
    adm.bind(view, lambda: int(hits_per_decision * adm.decisions))
    return adm


def test_learned_skips_what_was_never_read_again_and_stores_what_was() -> None:
    """Two kinds of blocks, told apart by depth: shallow ones are never read again, deep ones
    always are (one second apart, labelled 5 s later). Nothing is skipped before the model's
    first fit; then the shallow kind is, the deep kind never, and no hit is lost."""
    view = FakeView(1000)
    view.depth[500:] = 8
    adm = _learned(view, 0.5, hit_loss_budget=0.05, margin=1.0)
    early = []
    for b in range(200):
        now = float(b)
        view.last_access[[b, 500 + b]] = now
        early.append(adm.admit(b, now))
        assert adm.admit(500 + b, now), f"deep block {500 + b} refused"
        view.hits[500 + b] += 1  # read again right after
    assert all(early[:40]) and adm.model.fits > 0
    assert not all(early[100:])
    assert adm.threshold > 0
    shallow = adm.model.predict(adm.model.encode(adm.features(300, 300.0)))
    view.last_access[800] = 300.0
    deep = adm.model.predict(adm.model.encode(adm.features(800, 300.0)))
    assert shallow < 0.05 < 0.9 < deep
    assert adm.lost == 0
    d = adm.describe()
    assert d["admission"] == "learned" and d["model_fits"] == adm.model.fits and d["labelled_decisions"] > 0
    assert len(adm.features(300, 300.0)) == len(LEARNED_FEATURES)


def test_learned_labels_only_the_past() -> None:
    """A decision is observed by the model only once its horizon has passed."""
    view = FakeView(100)
    adm = _learned(view, 1.0, horizon_s=50.0)
    for b in range(30):
        adm.admit(b, float(b))
    assert adm.labelled == 0 and adm.model.samples == 0  # nothing is 50 s old yet
    for b in range(30, 100):
        adm.admit(b, float(b))
    assert 0 < adm.model.samples == adm.labelled <= 100 - 50


def test_learned_stops_skipping_when_the_measured_loss_passes_the_budget() -> None:
    view = FakeView(600)
    adm = _learned(view, 5.0, hit_loss_budget=0.01, margin=1.0)
    for b in range(100):
        view.last_access[b] = float(b)
        adm.admit(b, float(b))
    refused = [b for b in range(100, 200) if not adm.admit(b, float(b))]
    assert len(refused) > 12
    view.live |= set(refused[:12])  # put again: 12 lost hits, past 1% of the 5 x 215 hits
    for b in range(200, 215):
        adm.admit(b, float(b))
    assert adm.lost >= 12
    assert adm.threshold == 0.0
    assert all(adm.admit(b, float(b)) for b in range(215, 240))


def test_learned_refuses_answers_what_admit_will() -> None:
    view = FakeView(600)
    view.children[::3] = 1
    view.depth[:] = np.arange(600) % 7
    view.parent[1:] = np.arange(599)
    # (a fake view has no subtrees to walk: scored by probability alone)
    adm = _learned(view, 0.2, hit_loss_budget=0.05, margin=1.0, subtree_cost=False)
    answers = []
    for b in range(500):
        view.last_access[b] = float(b)
        will_refuse = adm.refuses(b, float(b))
        answers.append(will_refuse)
        assert adm.admit(b, float(b)) is not will_refuse, f"block {b}"
        if b % 5 == 0:
            view.hits[b] += 1
    assert any(answers) and not all(answers)


def test_learned_budget_zero_skips_nothing_and_config_is_validated() -> None:
    view = FakeView(300)
    adm = _learned(view, 1.0, hit_loss_budget=0.0)
    assert all(adm.admit(b, float(b)) for b in range(300))
    assert adm.model.fits > 0
    with pytest.raises(ValueError, match="hit_loss_budget"):
        LearnedConfig(hit_loss_budget=-0.1)
    with pytest.raises(ValueError, match="positive"):
        LearnedConfig(reference=0)
