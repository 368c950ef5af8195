"""Density's age buckets (the sorted search over whole ages gives the log formula's buckets) and
its batched bookkeeping (the same state as one event at a time)."""

from __future__ import annotations

import numpy as np
import pytest

from eviction.base import TierContext
from eviction.density import (
    _LOW,
    _LUT_AGES,
    _MID,
    _UP,
    NUM_BUCKETS,
    NUM_CLASSES,
    RATIO,
    DensityConfig,
    DensityPolicy,
    _age_buckets_by_log,
    age_bucket,
    age_buckets,
    density_table,
)
from tests.eviction.conftest import LAST, UPPER, FakeView


def test_whole_ages_fall_in_the_buckets_of_the_log_formula() -> None:
    edges = np.floor(RATIO ** np.arange(NUM_BUCKETS + 2)).astype(np.int64)
    ages = np.concatenate([np.arange(-3, 5000), (edges[:, None] + np.arange(-2, 3)).ravel(),
                           np.random.default_rng(0).integers(0, 1 << 40, 20_000)])
    got = age_buckets(ages)
    assert np.array_equal(got, _age_buckets_by_log(ages))
    assert [age_bucket(int(a)) for a in ages[:300]] == got[:300].tolist()
    assert got.max() == NUM_BUCKETS - 1 and got.min() == 0


def test_whole_ages_below_the_table_size_take_the_same_buckets_from_the_table() -> None:
    ages = np.concatenate([np.arange(-3, 1 << 16), np.arange(_LUT_AGES - 5000, _LUT_AGES)])
    assert ages.max() < _LUT_AGES  # the table's path, not the sorted search's
    assert np.array_equal(age_buckets(ages), _age_buckets_by_log(ages))
    assert np.array_equal(age_buckets(ages.astype(np.uint32)[3:]), _age_buckets_by_log(ages[3:]))


def test_fractional_ages_use_the_formula() -> None:
    ages = np.array([0.0, 0.5, 1.0, 1.5, 2.7, 1e9])
    assert age_buckets(ages).tolist() == [age_bucket(a) for a in ages.tolist()]


def _ghost_state(pol: DensityPolicy) -> tuple:
    ended = pol._ended.tolist()  # (flushes the removals' ghosts into the ring)
    g = pol._ghosts
    entries = sorted((k, int(g.cls[i]), int(g.t0[i]), int(g.hits[i])) for k, i in g.where.items())
    return (pol._tick, ended, pol._reuses.tolist(), entries, len(g),
            pol._resident[: pol._n].tolist(), sorted(pol._held), list(pol._queue))


def _drive(
    pols: list[DensityPolicy], view: FakeView, rng: np.random.Generator, steps: int, make_room,
    chains: float = 0.5, hits: float = 0.1,
) -> None:
    """A random workload on ``pols`` alike, step by step: a chain (leaves first) under a
    resident block or a root, some of whose hashes come back from the ghost ring (with
    probability ``chains``), a hit (``hits``), else a make-room
    (``make_room(view, resident, gone)`` takes the victims)."""
    resident: list[int] = []
    gone: list[bytes] = []
    nxt = 0
    for _ in range(steps):
        r = rng.random()
        if r < chains or not resident:
            parent = resident[int(rng.integers(len(resident)))] if resident and rng.random() < 0.5 else -1
            if parent >= 0 and not view.children[parent]:
                for pol in pols:
                    pol.hold(parent)
            chain = []
            for _ in range(int(rng.integers(1, 7))):
                key = gone.pop(int(rng.integers(len(gone)))) if gone and rng.random() < 0.3 else rng.bytes(16)
                chain.append(view.add(nxt, parent, key=key))
                parent, nxt = nxt, nxt + 1
            ids = np.array(chain[::-1])
            for pol in pols:
                pol.insert_many(ids, np.ones(ids.size), 0.0)
            resident += chain
        elif r < chains + hits:
            bid = resident[int(rng.integers(len(resident)))]
            for pol in pols:
                pol.touch(bid, 0.0)
        else:
            make_room(view, resident, gone)


@pytest.mark.parametrize("factor", [0.5, 8.0])
def test_ghosts_of_a_batch_of_removals_equal_those_of_one_at_a_time(factor: float) -> None:
    """A batched eviction's ghosts enter the ring at the next flush (``_flush_gone``): the ring,
    the censored counts and the ranking end as when each removal pushes its ghost and trims the
    ring at once (``eager``), through chains, holds, offers, returns from the ring, ring growth
    and table rebuilds."""
    rng = np.random.default_rng(7)
    view = FakeView(40_000)
    cfg = DensityConfig(period=256, ghost_factor=factor, sample=64)
    eager, lazy = DensityPolicy(cfg), DensityPolicy(cfg)
    for pol in (eager, lazy):
        pol.bind(view, LAST)
    rooms = [0]

    def take(view: FakeView, resident: list[int], gone: list[bytes]) -> None:
        """Victims taken one after another, each removed at once."""
        for _ in range(int(rng.integers(1, 9))):
            bid = eager.first()
            assert bid == lazy.first()
            if bid is None:
                break
            for pol in (eager, lazy):
                pol.remove(bid)
            eager._flush_gone()
            resident.remove(bid)
            gone.append(view.hash_of(bid))
            p = int(view.parent[bid])
            view.drop(bid)
            if p >= 0 and not view.children[p] and p in resident:
                for pol in (eager, lazy):
                    pol.offer(p)
        rooms[0] += 1
        if rooms[0] % 50 == 0:
            assert _ghost_state(lazy) == _ghost_state(eager), rooms[0]

    _drive([eager, lazy], view, rng, 3000, take, chains=0.55)
    assert lazy._ghosts.cap > 1024 or factor < 1  # the ring grew on the way
    assert _ghost_state(lazy) == _ghost_state(eager)


@pytest.mark.parametrize("batched", [False, True])
def test_a_block_back_after_its_ghost_left_keeps_the_stores_hit_count(batched: bool) -> None:
    """With no ghost ring, a block evicted and promoted back is a stranger to the policy; its
    class still counts the hits the index saw (every tier's), not zero."""
    view = FakeView(16)
    pol = DensityPolicy(DensityConfig(ghost_factor=0.0))
    pol.bind(view, TierContext("dram", "dram", 0, "nvme"))
    view.add(0)
    pol.insert(0, 4096, 0.0)
    pol.remove(0)
    view.hits[0] = 3  # hit three times on a tier below while DRAM did not hold it
    if batched:
        pol.insert_many(np.array([0]), np.array([4096]), 0.0)
    else:
        pol.insert(0, 4096, 0.0)
    assert pol._hits[0] == 3
    assert pol._cls[0] == 3 * 2  # hit class 3-4, chain not extended past it
    view.add(1)  # a new block: the index has no hit for it
    pol.insert(1, 4096, 0.0)
    assert pol._hits[1] == 0


def _density_table_by_bucket(reuses: np.ndarray, exposure: np.ndarray) -> np.ndarray:
    """The table one current age bucket at a time (the code before it was vectorised): the
    oracle of the test below."""
    with np.errstate(invalid="ignore", divide="ignore"):
        hazard = np.where(exposure > 0, reuses / exposure, 0.0)
    hazard = np.clip(hazard, 0.0, 1.0)
    ones = np.ones((reuses.shape[0], 1))
    survival = np.cumprod(np.concatenate([ones, 1.0 - hazard[:, :-1]], axis=1), axis=1)
    mass = survival * hazard
    out = np.zeros_like(reuses, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        for a in range(NUM_BUCKETS):
            age = _LOW[a]
            m = mass[:, a:]
            hits = np.cumsum(m, axis=1)
            held = np.cumsum(m * np.maximum(_MID[a:] - age, 0.5), axis=1)
            held += (survival[:, a : a + 1] - hits) * (_UP[a:] - age)
            d = np.where(held > 0, hits / held, 0.0)
            out[:, a] = d.max(axis=1)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_vectorised_density_table_equals_the_table_bucket_by_bucket(seed: int) -> None:
    """Bit for bit (the ranking compares its values): sparse and dense counts, decayed
    (fractional) counts, empty classes, hazards of one."""
    rng = np.random.default_rng(seed)
    shape = (NUM_CLASSES, NUM_BUCKETS)
    ended = rng.integers(0, [1, 3, 50, 5000][seed % 4] + 1, shape) * rng.random(shape) ** (seed % 3)
    ended[rng.random(shape) < 0.3] = 0.0
    reuses = np.minimum(ended, np.floor(ended * rng.random(shape) * 1.2))
    if seed == 5:
        reuses[:, :5] = ended[:, :5]  # every lifetime that reached the bucket was reused there
    exposure = np.cumsum(ended[:, ::-1], axis=1)[:, ::-1]
    got, want = density_table(reuses, exposure), _density_table_by_bucket(reuses, exposure)
    assert got.tobytes() == want.tobytes()
    assert (got > 0).any() or seed % 4 == 0


def _old_refill_queue(pol: DensityPolicy) -> list[tuple[int, int, float]]:
    """The victim queue a refill built before its integer keys (the oracle of the tests
    below): every ranked block scored, the ``take`` lowest by (score, last access)."""
    cfg, ids = pol.config, pol._resident[: pol._n].copy()
    take = max(cfg.queue_min, int(ids.size * cfg.queue_fraction))
    last = pol._last[ids]
    if pol._table is None:
        score = last.astype(np.float64)
    else:
        score = pol._table.ravel().take(pol._cls[ids] * NUM_BUCKETS + age_buckets(pol._tick - last))
        w = pol.weights(ids)
        if w is not None:
            score = score * w
    order = np.lexsort((last, score))[:take][::-1]
    return list(zip(ids[order].tolist(), last[order].tolist(), score[order].tolist(), strict=True))


@pytest.mark.parametrize(("name", "seed"), [("density", 3), ("cost", 11)])
def test_runs_of_victims_equal_victims_one_at_a_time(name: str, seed: int) -> None:
    """``victims(n)`` and ``remove_leaves`` (the store's batched eviction) take the blocks that
    ``first`` then ``remove`` and ``offer`` of each take, and leave the same policy (ghosts,
    ranking, queue), when the store takes a whole run, a leading part of it (then one offer
    through ``first``, as where a block may not leave), through refills, rebuilds and samples
    drawn with replacement (``sample`` below the ranked blocks)."""
    from eviction.costaware import CostAwarePolicy

    rng = np.random.default_rng(seed)
    view = FakeView(60_000)
    cls = CostAwarePolicy if name == "cost" else DensityPolicy
    cfg = cls.Config(period=256, sample=64)  # type: ignore[call-arg]
    single, runs = cls(cfg), cls(cfg)
    for pol in (single, runs):
        pol.bind(view, LAST)
    taken = {"run": 0, "first": 0}

    def take(view: FakeView, resident: list[int], gone: list[bytes]) -> None:
        want = int(rng.integers(1, 30))
        while want > 0:
            run = runs.victims(want)
            part = run[: int(rng.integers(0, len(run) + 1))] if run and rng.random() < 0.3 else run
            left: dict[int, int] = {}  # children of the parents, less those taken so far
            offers = []
            for b in part:
                p = int(view.parent[b])
                if p >= 0:
                    left[p] = left.get(p, int(view.children[p])) - 1
                offers.append(p if p >= 0 and not left[p] else -1)
            for b, offer in zip(part, offers, strict=True):
                assert single.first() == b
                single.remove(b)
                if offer >= 0:
                    single.offer(offer)
            runs.remove_leaves(part, offers)
            for b in part:
                gone.append(view.hash_of(b))
                view.drop(b)
                resident.remove(b)
            taken["run"] += len(part)
            want -= len(part)
            if not run:
                assert single.first() is None
                return
            if len(part) < len(run):  # the store stops at this block: it asks first() once
                assert runs.first() == single.first() == run[len(part)]
                taken["first"] += 1
                return

    _drive([single, runs], view, rng, 2500, take)
    assert _ghost_state(single) == _ghost_state(runs)
    assert taken["run"] > 1000 and taken["first"] > 20


@pytest.mark.parametrize("name", ["density", "cost"])
def test_a_refill_ranks_as_the_lexsort_of_score_and_last_access(name: str) -> None:
    """The refill's integer keys (density) and its partition (cost) queue exactly the blocks,
    in the order, that a full lexsort of (score, last access) over the ranked blocks gives,
    before and after the first table, with scores tied at zero and not."""
    from eviction.costaware import CostAwarePolicy

    rng = np.random.default_rng(5)
    view = FakeView(60_000)
    cls = CostAwarePolicy if name == "cost" else DensityPolicy
    pol = cls(cls.Config(period=256))  # type: ignore[call-arg]
    pol.bind(view, LAST)
    checked = []

    def take(view: FakeView, resident: list[int], gone: list[bytes]) -> None:
        if pol._n:
            want = _old_refill_queue(pol)
            pol._queue = []
            pol._refill(set())
            assert pol._queue == want
            checked.append(pol._table is not None)
        for _ in range(int(rng.integers(1, 9))):
            bid = pol.first()
            if bid is None:
                return
            p = int(view.parent[bid])
            pol.remove(bid)
            gone.append(view.hash_of(bid))
            view.drop(bid)
            resident.remove(bid)
            if p >= 0 and not view.children[p]:
                pol.offer(p)

    _drive([pol], view, rng, 2500, take)
    assert sum(checked) > 200 and not all(checked)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_walk_past_skipped_blocks_ranks_ahead_and_offers_the_same_blocks(seed: int) -> None:
    """A make-room walk that must pass many blocks the store skips (a long load's own blocks,
    protected while it is promoted into a smaller DRAM) offers the same blocks in the same
    order, and leaves the same queue, as one refill per ``queue_min`` blocks passed did, with
    far fewer rankings (one ranking ahead for several refills: ``_walk_refill``)."""
    rng = np.random.default_rng(seed)
    view = FakeView(60_000)
    cfg = DensityConfig(period=256)
    ahead, plain = DensityPolicy(cfg), DensityPolicy(cfg)
    plain.walk_ahead = False
    refills = {"ahead": 0, "plain": 0}
    for name, pol in (("ahead", ahead), ("plain", plain)):
        pol.bind(view, UPPER)
        refill = pol._refill

        def counted(offered: set[int], take: int | None = None, _r=refill, _n=name) -> None:
            refills[_n] += 1
            _r(offered, take)

        pol._refill = counted  # type: ignore[method-assign]
    walked = []

    def take(view: FakeView, resident: list[int], gone: list[bytes]) -> None:
        protect = {b for b in resident if rng.random() < 0.97}
        walks = []
        for pol in (ahead, plain):
            seq = []
            for bid in pol.candidates():
                seq.append(bid)
                if bid not in protect:
                    break
            walks.append(seq)
        assert walks[0] == walks[1]
        assert ahead._queue == plain._queue
        walked.append(len(walks[0]))
        if walks[0] and walks[0][-1] not in protect:
            bid = walks[0][-1]
            for pol in (ahead, plain):
                pol.remove(bid)
            resident.remove(bid)
            gone.append(view.hash_of(bid))
            view.drop(bid)

    _drive([ahead, plain], view, rng, 2500, take)
    assert _ghost_state(ahead) == _ghost_state(plain)
    assert max(walked) > 100 and ahead._table is not None, max(walked)
    assert refills["ahead"] < refills["plain"] / 2
    # One walk past every ranked block: a refill per queue_min blocks, against a handful.
    before = dict(refills)
    walks = [list(pol.candidates()) for pol in (ahead, plain)]
    assert walks[0] == walks[1] and len(walks[0]) == ahead._n > 500
    assert refills["plain"] - before["plain"] > ahead._n // cfg.queue_min // 2
    assert refills["ahead"] - before["ahead"] <= 6
