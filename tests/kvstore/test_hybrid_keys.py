"""Two-part blocks: the layout split, window keys, checkpoint choice, and what the store does
with windows stored under their full blocks (prefix-closure, eviction order, restart)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvstore.config import TierSpec
from kvstore.errors import MissingPrefixError, UsageError
from kvstore.hybrid import WINDOW_SUFFIX, CheckpointPolicy, HybridNamespaces, find_checkpoint
from kvstore.keys import KVLayout, LayerGroup, Namespace, split_layout
from kvstore.store import KVStore

# 8 tokens x 2 layers x (K,V) x 2 heads x 32 dims x 4 bytes: 8 KiB per block; the window of a
# 33-token sliding layer (32 tokens kept) x 2 layers is 32 KiB.
HYBRID = Namespace(
    "test/hybrid",
    KVLayout("float32", 8, (LayerGroup("full", 2, 2, 32), LayerGroup("sliding", 2, 2, 32, window=33))),
)
ALL_SWA = Namespace("test/swa", KVLayout("float32", 8, (LayerGroup("sliding", 4, 2, 32, window=33),)))


def _tiers() -> tuple[TierSpec, ...]:
    return (
        TierSpec("dram", "dram", {"capacity_bytes": "2MiB", "slab_bytes": "64KiB"}),
        TierSpec("nvme", "nvme", {"capacity_bytes": "4MiB", "slab_bytes": "64KiB"}),
    )


def test_split_layout_keeps_full_groups_per_block_and_sliding_ones_per_window() -> None:
    full, window = split_layout(HYBRID.layout)
    assert full == KVLayout("float32", 8, (LayerGroup("full", 2, 2, 32),))
    assert window == KVLayout("float32", 32, (LayerGroup("sliding", 2, 2, 32, window=33),))
    assert full.block_bytes == 8 * 1024 and window.block_bytes == 32 * 1024
    mixed = KVLayout("bfloat16", 16, (LayerGroup("sliding", 1, 1, 8, window=128), LayerGroup("sliding", 1, 1, 8, window=512)))
    assert split_layout(mixed)[1].block_tokens == 511  # the largest window decides
    assert split_layout(mixed)[0] is None
    assert split_layout(KVLayout("float32", 8, (LayerGroup("full", 1, 1, 8),))) == (
        KVLayout("float32", 8, (LayerGroup("full", 1, 1, 8),)), None)
    with pytest.raises(UsageError, match="1 token"):
        split_layout(KVLayout("float32", 8, (LayerGroup("sliding", 1, 1, 8, window=1),)))


def test_hybrid_namespaces() -> None:
    hyb = HybridNamespaces.of(HYBRID)
    assert hyb.full is not None and hyb.window is not None
    assert hyb.window.model_id == "test/hybrid" + WINDOW_SUFFIX
    assert len({HYBRID.root, hyb.full.root, hyb.window.root}) == 3
    hashes = hyb.hashes(np.arange(40))
    assert len(hashes) == 5 and hyb.chain_ns is hyb.full
    keys = [hyb.window_key(h) for h in hashes]
    assert len(set(keys) | set(hashes)) == 10 and all(len(k) == 16 for k in keys)
    assert hyb.window_chain(hashes, 2) == [*hashes[:3], keys[2]]
    swa = HybridNamespaces.of(ALL_SWA)
    assert swa.full is None and swa.chain_ns is ALL_SWA  # chained in the model's own blocks
    assert swa.window_chain(swa.hashes(np.arange(40)), 2) == [swa.window_key(swa.hashes(np.arange(40))[2])]
    with pytest.raises(UsageError, match="no 'sliding'"):
        HybridNamespaces.of(Namespace("m", KVLayout("float32", 8, (LayerGroup("full", 1, 1, 8),))))


def test_checkpoint_policy() -> None:
    p = CheckpointPolicy(every_blocks=4)
    assert p.new_checkpoints(0, 9) == [3, 7, 9]
    assert p.new_checkpoints(4, 11) == [7, 11]
    assert p.new_checkpoints(5, 5) == [5]
    assert CheckpointPolicy(every_blocks=4, at_end=False).new_checkpoints(0, 9) == [3, 7]
    assert p.new_checkpoints(6, 5) == []
    # Nearest first: every block down to the last periodic one, then the periodic ones.
    assert p.probe_order(10) == [9, 8, 7, 3]
    assert p.probe_order(8) == [7, 3]
    assert p.probe_order(3) == [2, 1, 0]
    assert CheckpointPolicy(every_blocks=4, max_probes=2).probe_order(10) == [9, 8]
    with pytest.raises(UsageError):
        CheckpointPolicy(every_blocks=0)


def _put_prompt(store: KVStore, hyb: HybridNamespaces, seed: int, n_blocks: int, policy: CheckpointPolicy) -> list[bytes]:
    hashes = hyb.hashes(np.random.default_rng(seed).integers(0, 1000, n_blocks * 8))
    if hyb.full is not None:
        store.put(hyb.full, hashes, np.full(n_blocks * hyb.full.block_bytes, seed, np.uint8))
    assert hyb.window is not None
    for i in policy.new_checkpoints(0, n_blocks - 1):
        chain = hyb.window_chain(hashes, i)
        store.put(hyb.window, chain, np.full(hyb.window.block_bytes, i, np.uint8), start=len(chain) - 1)
    return hashes


def _has_window(store: KVStore, hyb: HybridNamespaces, hashes: list[bytes], i: int) -> bool:
    assert hyb.window is not None
    return store.lookup(hyb.window, [hyb.window_key(hashes[i])]).num_blocks == 1


def test_windows_load_and_sit_under_their_full_part(make_store: Callable[..., KVStore]) -> None:
    store = make_store(tiers=_tiers(), register=False)
    hyb = HybridNamespaces.of(HYBRID)
    hyb.register(store)
    policy = CheckpointPolicy(every_blocks=3)
    hashes = _put_prompt(store, hyb, 1, 8, policy)  # windows at 2, 5, 7
    assert find_checkpoint(store, hyb, hashes, 8, policy) == 7
    assert find_checkpoint(store, hyb, hashes, 7, policy) == 5
    assert find_checkpoint(store, hyb, hashes, 2, policy) == -1
    out = np.zeros(hyb.window.block_bytes, np.uint8)  # type: ignore[union-attr]
    assert store.get_into(hyb.window, [hyb.window_key(hashes[5])], out) == 1 and (out == 5).all()  # type: ignore[arg-type]
    # A full block under a window cannot go before it: deleting it takes the window too.
    assert store.delete(hyb.full, [hashes[7]]) == 2  # type: ignore[arg-type]
    assert not _has_window(store, hyb, hashes, 7) and _has_window(store, hyb, hashes, 5)
    # A window's chain must have its full part first (the store is prefix-closed).
    other = hyb.hashes(np.arange(16) + 5000)
    with pytest.raises(MissingPrefixError):
        store.put(hyb.window, hyb.window_chain(other, 1), np.zeros(hyb.window.block_bytes, np.uint8), start=2)  # type: ignore[union-attr]


def test_pressure_evicts_windows_before_their_full_part(make_store: Callable[..., KVStore]) -> None:
    """One DRAM tier, LRU: a full block with a window on it is never a victim; windows go first
    and no window is ever left without its full part."""
    full_bb = 8 * 1024
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": 48 * full_bb, "slab_bytes": 8 * full_bb}),)
    store = make_store(tiers=tiers, register=False, policy="lru")
    hyb = HybridNamespaces.of(HYBRID)
    hyb.register(store)
    policy = CheckpointPolicy(every_blocks=4)
    prompts = [_put_prompt(store, hyb, seed, 8, policy) for seed in range(8)]  # 2 windows each
    assert hyb.full is not None
    windows_lost = full_kept_under_lost_window = 0
    for hashes in prompts:
        n_full = store.lookup(hyb.full, hashes).num_blocks
        for i in (3, 7):
            if _has_window(store, hyb, hashes, i):
                assert n_full > i, "a window survived its full part"
            else:
                windows_lost += 1
                full_kept_under_lost_window += n_full > i
    assert windows_lost > 0  # the store was under pressure
    assert full_kept_under_lost_window > 0  # windows left while their full part stayed


def test_windows_survive_a_restart(make_store: Callable[..., KVStore]) -> None:
    """A window's parent is a block of another namespace; a warm restart rebuilds it in place."""
    for ns in (HYBRID, ALL_SWA):
        store = make_store(tiers=_tiers(), register=False)
        hyb = HybridNamespaces.of(ns)
        hyb.register(store)
        policy = CheckpointPolicy(every_blocks=3)
        hashes = _put_prompt(store, hyb, 2, 6, policy)
        store.close()
        store = make_store(tiers=_tiers(), register=False)
        hyb.register(store)
        assert store.stats()["counters"]["orphans_dropped"] == 0 if "counters" in store.stats() else True
        assert find_checkpoint(store, hyb, hashes, 6, policy) == 5
        out = np.zeros(hyb.window.block_bytes, np.uint8)  # type: ignore[union-attr]
        assert store.get_into(hyb.window, [hyb.window_key(hashes[2])], out) == 1 and (out == 2).all()  # type: ignore[arg-type]
        store.close()
