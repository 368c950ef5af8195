"""The null tier: the Tier contract minus the bytes (what a replay needs), and a store over it
decides exactly as over a DRAM tier of the same block capacity."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.clock import FakeClock
from kvstore.config import StoreConfig, TierSpec
from kvstore.errors import (
    BlockNotFound,
    BufferSizeError,
    ConfigError,
    TierFullError,
    TierIOError,
    UsageError,
)
from kvstore.registry import make_tier
from kvstore.store import KVStore
from tests.conftest import BB, SMALL_NS, chain_for, payload
from tiers.null import NullTier

MakeBlock = Callable[..., Any]


def _tier(tmp_path: Path, **options: Any) -> NullTier:
    return make_tier("null", "n0", options, tmp_path)  # type: ignore[no-any-return]


def test_sizes_round_trip_but_no_bytes(tmp_path: Path, make_block: MakeBlock) -> None:
    t = _tier(tmp_path, capacity_blocks=4)
    b = make_block(5000, seed=1)
    t.write(b.key, b.data, b.meta)
    assert t.contains(b.key)
    dst = bytearray(b"\xab" * 6000)
    assert t.read_into(b.key, memoryview(dst)) == 5000
    assert dst == b"\xab" * 6000  # nothing is written: the tier holds no payload
    assert t.meta(b.key) == b.meta
    with pytest.raises(BufferSizeError):
        t.read_into(b.key, memoryview(bytearray(10)))
    with pytest.raises(UsageError):
        t.read_into(b.key, memoryview(bytes(6000)))  # read-only
    with pytest.raises(BufferSizeError):
        t.write(b.key, b.data[:10], b.meta)


def test_read_many_reports_what_read_into_raises(tmp_path: Path, make_block: MakeBlock) -> None:
    t = _tier(tmp_path, capacity_blocks=4)
    a, b, missing = make_block(5000, seed=1), make_block(4096, seed=2), make_block(4096, seed=3)
    t.write_many([(a.key, memoryview(a.data), a.meta), (b.key, b.data, b.meta)])
    whole = memoryview(bytearray(8192))
    out = t.read_many([a.key, missing.key, b.key, b.key, a.key],
                      [memoryview(bytearray(6000)), whole[:4096], whole[4096:], memoryview(bytes(4096)), whole[:10]])
    assert out[0] == 5000 and out[2] == 4096
    assert isinstance(out[1], BlockNotFound)
    assert isinstance(out[3], UsageError)  # read-only
    assert isinstance(out[4], BufferSizeError)


def test_missing_contains_delete_and_usage(tmp_path: Path, make_block: MakeBlock) -> None:
    t = _tier(tmp_path, capacity_bytes=3 * 4096)
    a, b = make_block(4096, seed=2), make_block(4096, seed=3)
    with pytest.raises(BlockNotFound):
        t.read_into(a.key, memoryview(bytearray(4096)))
    t.write(a.key, a.data, a.meta)
    t.write(b.key, b.data, b.meta)
    u = t.usage()
    assert (u.used_bytes, u.capacity_bytes, u.blocks) == (8192, 3 * 4096, 2)
    assert t.delete(a.key) and not t.delete(a.key)
    assert t.usage().used_bytes == 4096 and not t.contains(a.key)
    assert t.describe()["kind"] == "null"


@pytest.mark.parametrize("options", [{"capacity_blocks": 3}, {"capacity_bytes": 3 * 4096}])
def test_fill_to_capacity_then_full(tmp_path: Path, make_block: MakeBlock, options: dict[str, int]) -> None:
    t = _tier(tmp_path, **options)
    blocks = [make_block(4096, seed=10 + i) for i in range(4)]
    for b in blocks[:3]:
        assert t.fits(4096)
        t.write(b.key, b.data, b.meta)
    assert not t.fits(4096)
    with pytest.raises(TierFullError):
        t.write(blocks[3].key, blocks[3].data, blocks[3].meta)
    t.write(blocks[0].key, blocks[0].data, blocks[0].meta)  # a rewrite fits when full
    assert t.usage().blocks == 3


def test_expiry_scan_close(tmp_path: Path, make_block: MakeBlock) -> None:
    t = _tier(tmp_path, capacity_blocks=4)
    b = make_block(100, seed=4)
    t.write(b.key, b.data, b.meta)
    t.update_expiry([(b.key, 123.0), (make_block(100, seed=5).key, 1.0)])  # a missing key: harmless
    assert dict(t.scan())[b.key].expiry == 123.0
    t.close()
    t.close()
    with pytest.raises(TierIOError):
        t.write(b.key, b.data, b.meta)


def test_config_needs_a_bound(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="capacity_blocks or capacity_bytes"):
        _tier(tmp_path)
    with pytest.raises(ConfigError):
        _tier(tmp_path, capacity_blocks=-1)


@pytest.mark.parametrize("policy", ["lru", "density"])
def test_store_over_null_decides_like_over_dram(tmp_path: Path, policy: str) -> None:
    """Same workload, same clock: a DRAM tier of 12 blocks and a null tier of 12 blocks give the
    same hits, evictions and final contents; only the bytes differ."""
    outcomes = []
    for kind, options in (("dram", {"capacity_bytes": 12 * BB, "slab_bytes": 4 * BB}), ("null", {"capacity_blocks": 12})):
        clock = FakeClock()
        cfg = StoreConfig(root=tmp_path / kind, tiers=(TierSpec("t", kind, options),), policy=policy, persist_on_close=False)
        rng = np.random.default_rng(7)
        with KVStore(cfg, clock=clock) as s:
            s.register_namespace(SMALL_NS)
            hits = []
            for _ in range(150):
                clock.advance(1.0)
                chain = chain_for(int(rng.integers(0, 12)), int(rng.integers(1, 6)))
                n = s.get_into(SMALL_NS, chain, np.empty(len(chain) * BB, np.uint8))
                s.put(SMALL_NS, chain, [payload(h) for h in chain[n:]], start=n)
                hits.append(n)
            outcomes.append((hits, s.stats()["evictions"], sorted(b["hash"] for b in s.iter_blocks())))
    assert outcomes[0] == outcomes[1]
    assert sum(outcomes[0][0]) > 0 and outcomes[0][1] > 0
