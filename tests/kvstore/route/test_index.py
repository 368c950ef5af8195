"""The router's prefix index against a dict model: inserts, removals, collisions, growth."""

from __future__ import annotations

import numpy as np

from kvstore.route.index import PrefixIndex, hash_keys


def test_random_operations_match_a_dict_model() -> None:
    rng = np.random.default_rng(1)
    ix = PrefixIndex(16)
    model: dict[int, int] = {}
    # Keys that share their low bits collide in the table: probing must tell them apart.
    universe = np.concatenate([rng.integers(1, 2**63, 3000, dtype=np.uint64),
                               (np.arange(1, 200, dtype=np.uint64) << np.uint64(40)), np.array([0], dtype=np.uint64)])
    for _ in range(300):
        keys = rng.choice(universe, size=int(rng.integers(1, 200)))
        node, bit = int(rng.integers(0, 16)), 1 << int(rng.integers(0, 4))
        add = bool(rng.random() < 0.6)
        ix.update(keys, node, bit, add)
        field = bit << (4 * node)
        for k in {max(int(k), 1) for k in keys}:  # key 0 is stored as 1
            model[k] = (model.get(k, 0) | field) if add else (model.get(k, 0) & ~field)
        if rng.random() < 0.05:
            ix.clear_node(node)
            model = {k: v & ~(0xF << (4 * node)) for k, v in model.items()}
    probe = np.concatenate([universe, rng.integers(1, 2**63, 500, dtype=np.uint64)])
    got = ix.get(probe)
    assert got.tolist() == [model.get(max(int(k), 1), 0) for k in probe]
    assert len(ix) == sum(1 for v in model.values() if v)


def test_growth_keeps_every_key_and_drops_emptied_slots() -> None:
    ix = PrefixIndex(16)
    keys = np.arange(1, 100_001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    ix.update(keys, 0, 1, True)
    ix.update(keys[:50_000], 0, 1, False)
    ix.update(keys[:10], 3, 2, True)  # an insert that triggers no resize still finds old keys
    big = ix.nbytes
    ix.update(np.arange(1, 200_001, dtype=np.uint64) + np.uint64(1 << 60), 1, 1, True)
    assert (ix.get(keys[50_000:]) == 1).all()
    assert (ix.get(keys[:10]) == 2 << 12).all() and (ix.get(keys[10:50_000]) == 0).all()
    assert len(ix) == 50_000 + 10 + 200_000 and ix.nbytes >= big


def test_hash_keys_are_the_first_8_bytes_xor_the_mask() -> None:
    hs = [bytes(range(i, i + 16)) for i in range(3)]
    assert hash_keys(hs).tolist() == [int.from_bytes(h[:8], "little") for h in hs]
    assert hash_keys(hs, 5).tolist() == [int.from_bytes(h[:8], "little") ^ 5 for h in hs]
    assert hash_keys([]).size == 0
