"""The engine's HBM block cache: budget, LRU order, in-use protection, write-through demotion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engine.client import EngineCache  # noqa: E402
from engine.kvlayout import KVShape  # noqa: E402
from engine.reference.hbm_cache import HbmCache  # noqa: E402
from kvstore.config import StoreConfig, TierSpec  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402
from kvstore.store import KVStore  # noqa: E402

SHAPE = KVShape(num_layers=2, kv_heads=1, head_dim=8, dtype=torch.float32, block_tokens=4)  # 512-byte blocks
PAGE = 4096


@pytest.fixture
def cache(tmp_path: Path):
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": 64 * PAGE, "slab_bytes": 8 * PAGE}),)
    store = KVStore(StoreConfig(root=tmp_path, tiers=tiers, persist_on_close=False))
    c = EngineCache(store, SHAPE.namespace("test/hbm-cache"), SHAPE)
    yield c
    c.close()
    store.close()


def _chain(cache: EngineCache, seed: int, blocks: int) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 1000, blocks * SHAPE.block_tokens)
    return list(cache.hashes(tokens))


def _fill(hbm: HbmCache, chain: list[bytes], start: int, count: int, value: int) -> list[bytes]:
    res = hbm.reserve(chain, start, count, promoted=False)
    assert res is not None
    hbm.pages.index_fill_(0, res.slots, value)
    hbm.release(res.keys)
    return res.keys


def test_budget_sets_capacity_and_rejects_less_than_a_block(cache: EngineCache) -> None:
    hbm = HbmCache(cache, 4 * PAGE + 100, device="cpu")
    assert hbm.capacity_blocks == 4 and hbm.budget_bytes == 4 * PAGE
    with pytest.raises(ConfigError, match="raise it"):
        HbmCache(cache, 100, device="cpu")
    hbm.close()


def test_resident_blocks_are_served_in_place(cache: EngineCache) -> None:
    hbm = HbmCache(cache, 4 * PAGE, device="cpu")
    chain = _chain(cache, 0, 3)
    _fill(hbm, chain, 0, 2, 7)
    assert hbm.match(chain, 3) == 2 and hbm.match(chain, 1) == 1
    slots = hbm.acquire(chain[:2])
    assert torch.equal(hbm.pages[slots], torch.full((2, PAGE), 7, dtype=torch.uint8))
    assert torch.equal(hbm.tier.view(chain[0]), torch.full((SHAPE.block_bytes,), 7, dtype=torch.uint8))
    hbm.release(chain[:2])
    assert hbm.counters.hit_blocks == 2 and hbm.counters.admitted == 2
    hbm.close()


def test_only_runs_that_continue_the_resident_chain_are_admitted(cache: EngineCache) -> None:
    hbm = HbmCache(cache, 4 * PAGE, device="cpu")
    chain = _chain(cache, 1, 4)
    assert hbm.reserve(chain, 2, 2, promoted=True) is None  # blocks 0, 1 are not resident
    _fill(hbm, chain, 0, 1, 1)
    res = hbm.reserve(chain, 1, 3, promoted=True)
    assert res is not None and res.keys == chain[1:4] and hbm.counters.promoted == 3
    hbm.close()


def test_least_recent_leaves_first_and_blocks_in_use_stay(cache: EngineCache) -> None:
    hbm = HbmCache(cache, 4 * PAGE, device="cpu")
    a, b, c = _chain(cache, 2, 2), _chain(cache, 3, 2), _chain(cache, 4, 2)
    for i, ch in enumerate((a, b)):
        cache.store.put(cache.ns, ch, np.zeros(2 * SHAPE.block_bytes, np.uint8))  # write-through
        _fill(hbm, ch, 0, 2, i)
    hbm.acquire(a)
    hbm.release(a)  # a is more recent than b now
    hbm.acquire(b[:1])  # b's first block is in use
    _fill(hbm, c, 0, 2, 9)  # needs two pages: b[1] then a's least recent (its tail, a[1])
    assert hbm.match(b, 2) == 1 and hbm.match(a, 2) == 1 and hbm.match(c, 2) == 2
    assert hbm.counters.evicted == 2 and hbm.counters.written_back == 0  # the store had both
    assert hbm.reserve(_chain(cache, 5, 1), 0, 1, promoted=False) is not None  # a[0] goes
    hbm.acquire(c)
    assert hbm.reserve(_chain(cache, 6, 1), 0, 1, promoted=False) is None  # every page in use
    hbm.release(b[:1])
    assert hbm.reserve(_chain(cache, 6, 1), 0, 1, promoted=False) is not None  # b[0] is free again
    hbm.close()


def test_a_victim_the_store_lost_is_written_back_when_its_parent_is_there(cache: EngineCache) -> None:
    hbm = HbmCache(cache, 2 * PAGE, device="cpu")
    chain = _chain(cache, 7, 2)
    cache.store.put(cache.ns, chain[:1], np.zeros(SHAPE.block_bytes, np.uint8))  # only block 0 stored
    _fill(hbm, chain, 0, 2, 5)
    orphan = _chain(cache, 8, 2)
    _fill(hbm, orphan, 0, 2, 6)  # evicts chain[1] (written back: parent stored), then chain[0] (stored)
    assert hbm.counters.written_back == 1 and hbm.counters.dropped == 0
    buf = np.empty(2 * SHAPE.block_bytes, np.uint8)
    assert cache.store.get_into(cache.ns, chain, buf) == 2
    assert (buf[SHAPE.block_bytes :] == 5).all()
    _fill(hbm, _chain(cache, 9, 2), 0, 2, 1)  # orphan's blocks: none in the store, parent of [1] neither
    assert hbm.counters.dropped == 1 and hbm.counters.written_back == 2  # orphan[0] (root parent) written
    hbm.close()
