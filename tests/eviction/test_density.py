"""Density's age buckets (the sorted search over whole ages gives the log formula's buckets) and
its batched bookkeeping (the same state as one event at a time)."""

from __future__ import annotations

import numpy as np
import pytest

from eviction.base import TierContext
from eviction.density import (
    _LUT_AGES,
    NUM_BUCKETS,
    RATIO,
    DensityConfig,
    DensityPolicy,
    _age_buckets_by_log,
    age_bucket,
    age_buckets,
)
from tests.eviction.conftest import LAST, FakeView


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
    resident: list[int] = []
    gone: list[bytes] = []
    nxt = 0
    for step in range(3000):
        r = rng.random()
        if r < 0.55 or not resident:  # a chain, under a resident block or a root, leaves first
            parent = resident[int(rng.integers(len(resident)))] if resident and rng.random() < 0.5 else -1
            if parent >= 0 and not view.children[parent]:
                for pol in (eager, lazy):
                    pol.hold(parent)
            chain = []
            for _ in range(int(rng.integers(1, 7))):
                key = gone.pop(int(rng.integers(len(gone)))) if gone and rng.random() < 0.3 else rng.bytes(16)
                chain.append(view.add(nxt, parent, key=key))
                parent, nxt = nxt, nxt + 1
            ids = np.array(chain[::-1])
            for pol in (eager, lazy):
                pol.insert_many(ids, np.ones(ids.size), 0.0)
            resident += chain
        elif r < 0.65:
            bid = resident[int(rng.integers(len(resident)))]
            for pol in (eager, lazy):
                pol.touch(bid, 0.0)
        else:  # a make-room: victims taken one after another, each removed at once
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
        if step % 150 == 0:
            assert _ghost_state(lazy) == _ghost_state(eager), step
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
