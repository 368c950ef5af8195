"""Two-part blocks: the layout split, window keys, checkpoint choice, and what the store does
with windows stored under their full blocks (prefix-closure, eviction order, restart)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvstore.config import TierSpec
from kvstore.errors import MissingPrefixError, UsageError
from kvstore.hybrid import (
    WINDOW_SUFFIX,
    CheckpointPolicy,
    HybridLookup,
    HybridNamespaces,
    find_checkpoint,
)
from kvstore.hybrid import lookup as hybrid_lookup
from kvstore.keys import KVLayout, LayerGroup, Namespace, split_layout, window_blocks
from kvstore.store import KVStore

# 8 tokens x 2 layers x (K,V) x 2 heads x 32 dims x 4 bytes: 8 KiB per block, for the full
# part and for a window piece alike. A 17-token window keeps 16 tokens: 2 blocks of pieces.
HYBRID = Namespace(
    "test/hybrid",
    KVLayout("float32", 8, (LayerGroup("full", 2, 2, 32), LayerGroup("sliding", 2, 2, 32, window=17))),
)
ALL_SWA = Namespace("test/swa", KVLayout("float32", 8, (LayerGroup("sliding", 2, 2, 32, window=17),)))


def _tiers() -> tuple[TierSpec, ...]:
    return (
        TierSpec("dram", "dram", {"capacity_bytes": "2MiB", "slab_bytes": "64KiB"}),
        TierSpec("nvme", "nvme", {"capacity_bytes": "4MiB", "slab_bytes": "64KiB"}),
    )


def test_split_layout_and_window_blocks() -> None:
    full, window = split_layout(HYBRID.layout)
    assert full == KVLayout("float32", 8, (LayerGroup("full", 2, 2, 32),))
    assert window == KVLayout("float32", 8, (LayerGroup("sliding", 2, 2, 32, window=17),))
    assert full.block_bytes == window.block_bytes == 8 * 1024
    assert window_blocks(HYBRID.layout) == 2  # 16 tokens of state: exactly 2 blocks
    mixed = KVLayout("bfloat16", 16, (LayerGroup("sliding", 1, 1, 8, window=128), LayerGroup("sliding", 1, 1, 8, window=512)))
    assert window_blocks(mixed) == 32  # the largest window decides: 511 tokens
    assert split_layout(mixed)[0] is None
    assert window_blocks(KVLayout("float32", 8, (LayerGroup("sliding", 1, 1, 8, window=18),))) == 3
    plain = KVLayout("float32", 8, (LayerGroup("full", 1, 1, 8),))
    assert split_layout(plain) == (plain, None) and window_blocks(plain) == 0


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
    assert list(hyb.checkpoint_blocks(3)) == [2, 3] and list(hyb.checkpoint_blocks(0)) == [0]
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
    """What the engine stores for a prompt of ``n_blocks``: the full part, then the pieces of
    every checkpoint's window (piece ``j`` filled with byte ``j``)."""
    hashes = hyb.hashes(np.random.default_rng(seed).integers(0, 1000, n_blocks * 8))
    if hyb.full is not None:
        store.put(hyb.full, hashes, np.full(n_blocks * hyb.full.block_bytes, seed, np.uint8))
    assert hyb.window is not None
    for j in sorted({j for i in policy.new_checkpoints(0, n_blocks - 1) for j in hyb.checkpoint_blocks(i)}):
        chain = hyb.window_chain(hashes, j)
        store.put(hyb.window, chain, np.full(hyb.window.block_bytes, j, np.uint8), start=len(chain) - 1)
    return hashes


def _has_piece(store: KVStore, hyb: HybridNamespaces, hashes: list[bytes], j: int) -> bool:
    assert hyb.window is not None
    return store.lookup(hyb.window, [hyb.window_key(hashes[j])]).num_blocks == 1


def test_checkpoints_are_found_by_their_pieces(make_store: Callable[..., KVStore]) -> None:
    store = make_store(tiers=_tiers(), register=False)
    for ns in (HYBRID, ALL_SWA):
        hyb = HybridNamespaces.of(ns)
        hyb.register(store)
        policy = CheckpointPolicy(every_blocks=4)
        hashes = _put_prompt(store, hyb, 1, 10, policy)  # checkpoints 3, 7, 9: pieces 2-3, 6-9
        assert [j for j in range(10) if _has_piece(store, hyb, hashes, j)] == [2, 3, 6, 7, 8, 9]
        assert find_checkpoint(store, hyb, hashes, 10, policy) == 9
        assert find_checkpoint(store, hyb, hashes, 9, policy) == 8  # shares its pieces with 7 and 9
        assert find_checkpoint(store, hyb, hashes, 7, policy) == 3
        assert find_checkpoint(store, hyb, hashes, 3, policy) == -1
        out = np.zeros(2 * hyb.window.block_bytes, np.uint8)  # type: ignore[union-attr]
        keys = [hyb.window_key(hashes[j]) for j in hyb.checkpoint_blocks(7)]
        assert store.get_into(hyb.window, keys, out) == 2  # type: ignore[arg-type]
        assert (out[: hyb.window.block_bytes] == 6).all() and (out[hyb.window.block_bytes :] == 7).all()  # type: ignore[union-attr]
        # A missing piece disqualifies every checkpoint whose window holds it.
        assert store.delete(hyb.window, [hyb.window_key(hashes[7])]) == 1  # type: ignore[arg-type]
        assert find_checkpoint(store, hyb, hashes, 9, policy) == 3
        assert find_checkpoint(store, hyb, hashes, 10, policy) == 9
        # The longest full-part prefix and the nearest checkpoint at or before it.
        where = hybrid_lookup(store, hyb, hashes[:9], policy)
        if hyb.full is not None:
            assert where == HybridLookup(9, 3) and where.replay_blocks == 5
        else:  # nothing past the checkpoint is cached: nothing to replay
            assert where == HybridLookup(4, 3) and where.replay_blocks == 0
        assert hybrid_lookup(store, hyb, hyb.hashes(np.arange(24) + 7000), policy).checkpoint == -1


def test_pieces_sit_under_their_full_part(make_store: Callable[..., KVStore]) -> None:
    store = make_store(tiers=_tiers(), register=False)
    hyb = HybridNamespaces.of(HYBRID)
    hyb.register(store)
    assert hyb.full is not None and hyb.window is not None
    hashes = _put_prompt(store, hyb, 1, 8, CheckpointPolicy(every_blocks=4))  # pieces 2, 3, 6, 7
    # A full block under a piece cannot go before it: deleting it takes the piece too.
    assert store.delete(hyb.full, [hashes[7]]) == 2
    assert not _has_piece(store, hyb, hashes, 7) and _has_piece(store, hyb, hashes, 6)
    # A piece's chain must have its full part first (the store is prefix-closed).
    other = hyb.hashes(np.arange(16) + 5000)
    with pytest.raises(MissingPrefixError):
        store.put(hyb.window, hyb.window_chain(other, 1), np.zeros(hyb.window.block_bytes, np.uint8), start=2)


def test_pressure_evicts_pieces_before_their_full_part(make_store: Callable[..., KVStore]) -> None:
    """One DRAM tier, LRU: a full block with a piece on it is never a victim; pieces go first
    and no piece is ever left without its full part."""
    bb = 8 * 1024
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": 48 * bb, "slab_bytes": 8 * bb}),)
    store = make_store(tiers=tiers, register=False, policy="lru")
    hyb = HybridNamespaces.of(HYBRID)
    hyb.register(store)
    policy = CheckpointPolicy(every_blocks=4)
    assert hyb.full is not None
    prompts = [_put_prompt(store, hyb, seed, 8, policy) for seed in range(4)]  # 48 blocks: full
    lost: list[tuple[int, int]] = []  # (prompt, piece) in the order they left
    for extra in range(12):  # one new block at a time: one victim at a time
        one = hyb.hashes(np.arange(8) + 10_000 * (extra + 1))
        store.put(hyb.full, one, np.zeros(hyb.full.block_bytes, np.uint8))
        for p, hashes in enumerate(prompts):
            n_full = store.lookup(hyb.full, hashes).num_blocks
            for j in (2, 3, 6, 7):
                if _has_piece(store, hyb, hashes, j):
                    assert n_full > j, "a window piece survived its full part"
                elif (p, j) not in lost:
                    lost.append((p, j))
        if extra == 3:  # four victims so far: all four pieces of prompt 0, none of its full part
            assert store.lookup(hyb.full, prompts[0]).num_blocks == 8
    # The oldest prompt's full part is the LRU's first choice, but every full block there has a
    # child: its 4 pieces leave first (the oldest first), then its full blocks from the end.
    assert lost[:4] == [(0, 2), (0, 3), (0, 6), (0, 7)]
    assert store.lookup(hyb.full, prompts[0]).num_blocks == 0 and store.lookup(hyb.full, prompts[1]).num_blocks == 8


def test_windows_survive_a_restart(make_store: Callable[..., KVStore]) -> None:
    """A window's parent is a block of another namespace; a warm restart rebuilds it in place."""
    for ns in (HYBRID, ALL_SWA):
        store = make_store(tiers=_tiers(), register=False)
        hyb = HybridNamespaces.of(ns)
        hyb.register(store)
        policy = CheckpointPolicy(every_blocks=3)
        hashes = _put_prompt(store, hyb, 2, 6, policy)  # checkpoints 2 and 5
        store.close()
        store = make_store(tiers=_tiers(), register=False)
        hyb.register(store)
        assert store.stats()["counters"]["orphans_dropped"] == 0 if "counters" in store.stats() else True
        assert find_checkpoint(store, hyb, hashes, 6, policy) == 5
        out = np.zeros(hyb.window.block_bytes, np.uint8)  # type: ignore[union-attr]
        assert store.get_into(hyb.window, [hyb.window_key(hashes[2])], out) == 1 and (out == 2).all()  # type: ignore[arg-type]
        store.close()
