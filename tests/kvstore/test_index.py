"""Radix index: longest-prefix match, prefix-closure, pins, in-use counts, expiry."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.index import NO_PARENT, RadixIndex


def h(*path: int) -> bytes:
    """A fake 16-byte hash naming a path in the tree."""
    return bytes(path).ljust(16, b"\xff")


def chain(idx: RadixIndex, *path: int, expiry: float = 100.0, tier_bit: int = 1) -> np.ndarray:
    """Insert the blocks of ``path`` that are missing; returns ids of the whole path."""
    keys = [h(*path[: i + 1]) for i in range(len(path))]
    m = idx.match(keys)
    n = m.num_blocks
    parent = int(m.ids[-1]) if n else NO_PARENT
    if n < len(keys):
        idx.insert_chain(keys[n:], parent, n, 4096, 0, tier_bit, 0.0, expiry)
    return idx.match(keys).ids


def test_longest_prefix_match_and_location() -> None:
    idx = RadixIndex(capacity=4)  # forces growth
    chain(idx, 1, 2, 3, 4)
    chain(idx, 1, 2, 9, tier_bit=2)
    m = idx.match([h(1), h(1, 2), h(1, 2, 3), h(1, 2, 3, 7)])
    assert m.num_blocks == 3
    assert m.tiers.tolist() == [1, 1, 1]
    m = idx.match([h(1), h(1, 2), h(1, 2, 9)])
    assert m.num_blocks == 3 and m.tiers.tolist() == [1, 1, 2]
    assert idx.match([h(5)]).num_blocks == 0
    assert idx.match([]).num_blocks == 0
    assert len(idx) == 5
    assert idx.depth[idx.id_of(h(1, 2, 9))] == 2


def test_children_counts_keep_the_store_prefix_closed() -> None:
    idx = RadixIndex()
    ids = chain(idx, 1, 2, 3)
    chain(idx, 1, 2, 8)
    a, b, c = ids.tolist()
    assert idx.children[a] == 1 and idx.children[b] == 2 and idx.children[c] == 0
    assert not idx.evictable_leaf(b)
    with pytest.raises(RuntimeError, match="children"):
        idx.remove(b)
    idx.remove(c)
    idx.remove(idx.id_of(h(1, 2, 8)))
    assert idx.evictable_leaf(b)
    idx.remove(b)
    assert idx.match([h(1), h(1, 2)]).num_blocks == 1


def test_pins_and_in_use_protect() -> None:
    idx = RadixIndex()
    ids = chain(idx, 1, 2)
    leaf = int(ids[-1])
    idx.add_pins(ids, 1)
    assert not idx.evictable_leaf(leaf)
    idx.add_pins(ids, -1)
    assert idx.evictable_leaf(leaf)
    idx.add_in_use(ids, 1)
    assert not idx.evictable_leaf(leaf) and not idx.movable(leaf)
    idx.add_in_use(ids, -1)
    assert idx.movable(leaf)
    with pytest.raises(RuntimeError, match="not pinned"):
        idx.add_pins(ids, -1)


def test_expiry_match_and_expired_leaves_deepest_first() -> None:
    idx = RadixIndex()
    ids = chain(idx, 1, 2, 3, expiry=50.0)
    keys = [h(1), h(1, 2), h(1, 2, 3)]
    assert idx.match(keys, now=10.0).num_blocks == 3
    assert idx.match(keys, now=60.0).num_blocks == 0
    idx.touch(ids[:1], now=55.0, expiry=200.0)  # the root was refreshed, the rest expired
    assert idx.match(keys, now=60.0).num_blocks == 1
    assert idx.hits[ids[0]] == 1 and idx.last_access[ids[0]] == 55.0
    assert idx.expired_leaves(60.0, 10).tolist() == [ids[2]]  # only leaves; parent has a child
    idx.remove(int(ids[2]))
    assert idx.expired_leaves(60.0, 10).tolist() == [ids[1]]
    idx.add_pins(ids[1:2], 1)
    assert idx.expired_leaves(60.0, 10).size == 0


def test_expired_leaves_work_cap_prefers_deep() -> None:
    idx = RadixIndex()
    for i in range(10):
        chain(idx, 1, 2 + i, expiry=5.0)  # ten leaves at depth 1 under a shared root
    chain(idx, 9, expiry=5.0)  # a root-level leaf
    got = idx.expired_leaves(10.0, 3)
    assert got.size == 3 and (idx.depth[got] == 1).all()


def test_ids_are_reused_and_touch_never_shortens_expiry() -> None:
    idx = RadixIndex()
    ids = chain(idx, 1, expiry=100.0)
    idx.touch(ids, 1.0, 50.0)
    assert idx.expiry[ids[0]] == 100.0
    idx.remove(int(ids[0]))
    again = chain(idx, 7)
    assert again.tolist() == ids.tolist()
    idx.remove(int(again[0]))
    with pytest.raises(KeyError):
        idx.hash_of(int(again[0]))
    assert idx.hash_of_or_none(int(again[0])) is None


def test_subtree() -> None:
    idx = RadixIndex()
    a = chain(idx, 1, 2, 3)
    b = chain(idx, 1, 2, 4, 5)
    chain(idx, 6)
    sub = idx.subtree(np.array([a[1]]))
    assert sorted(sub.tolist()) == sorted({int(a[1]), int(a[2]), int(b[2]), int(b[3])})


def test_insert_twice_is_a_bug() -> None:
    idx = RadixIndex()
    chain(idx, 1)
    with pytest.raises(RuntimeError, match="twice"):
        idx.insert_chain([h(1)], NO_PARENT, 0, 1, 0, 1, 0.0, 1.0)


def test_memory_per_block_is_reported() -> None:
    idx = RadixIndex()
    for i in range(100):
        chain(idx, i, 1)
    assert idx.memory_bytes() > 0


def test_insert_blocks_by_level_equals_insert_chain() -> None:
    """A warm restart inserts a depth level at a time: the columns come out as the chains'."""
    keys = [bytes([i]) * 16 for i in range(7)]
    # Two chains sharing a root: 0-1-2 and 0-3-4, plus a second root 5-6.
    a, b = RadixIndex(), RadixIndex()
    a.insert_chain(keys[0:3], NO_PARENT, 0, 64, 1, 2, 10.0, 99.0)
    a.insert_chain(keys[3:5], a.id_of(keys[0]), 1, 64, 1, 2, 10.0, 99.0)
    a.insert_chain(keys[5:7], NO_PARENT, 0, 64, 1, 2, 10.0, 50.0)
    levels = [[0, 5], [1, 3, 6], [2, 4]]
    parent_key = {1: 0, 3: 0, 6: 5, 2: 1, 4: 3}
    for depth, members in enumerate(levels):
        parents = np.array([b.id_of(keys[parent_key[m]]) if m in parent_key else NO_PARENT for m in members], np.int32)
        n = len(members)
        expiry = np.array([50.0 if m >= 5 else 99.0 for m in members])
        b.insert_blocks([keys[m] for m in members], parents, np.full(n, depth, np.int32), np.full(n, 64, np.uint32),
                        np.full(n, 1, np.uint16), np.full(n, 2, np.uint8), np.full(n, 10.0), expiry)
    for k in keys:
        ia, ib = a.id_of(k), b.id_of(k)
        pa, pb = int(a.parent[ia]), int(b.parent[ib])
        assert (pa == NO_PARENT) == (pb == NO_PARENT)
        if pa != NO_PARENT:
            assert a.hash_of(pa) == b.hash_of(pb)
        for col in ("depth", "size", "ns", "tiers", "children", "last_access", "expiry"):
            assert getattr(a, col)[ia] == getattr(b, col)[ib], (k, col)
    assert a.expired_leaves(60.0, 10).size == b.expired_leaves(60.0, 10).size == 1
    with pytest.raises(RuntimeError, match="inserted twice"):
        b.insert_blocks([keys[0]], np.array([NO_PARENT], np.int32), np.zeros(1, np.int32), np.ones(1, np.uint32),
                        np.ones(1, np.uint16), np.ones(1, np.uint8), np.zeros(1), np.ones(1))


def test_remove_many_is_remove_of_each_in_order() -> None:
    """A batched eviction: leaves, then a parent whose last child went earlier in the batch."""
    one, many = RadixIndex(), RadixIndex()
    for idx in (one, many):
        chain(idx, 1, 2, 3)
        chain(idx, 1, 2, 4)
        chain(idx, 5, expiry=50.0)
    ids = [int(x) for x in one.match([h(1), h(1, 2), h(1, 2, 3)]).ids]
    leaf4 = int(one.match([h(1), h(1, 2), h(1, 2, 4)]).ids[-1])
    victims = [ids[2], leaf4, ids[1]]  # both leaves, then their parent
    for bid in victims:
        one.remove(bid)
    assert many.remove_many(victims) == [h(1, 2, 3), h(1, 2, 4), h(1, 2)]
    for col in ("children", "flags", "tiers"):
        assert np.array_equal(getattr(one, col), getattr(many, col)), col
    assert len(one) == len(many) == 2 and many._free == one._free  # noqa: SLF001 - ids recycled alike
    assert int(many.children[ids[0]]) == 0
    assert many.expired_leaves(100.0, 10).tolist() == one.expired_leaves(100.0, 10).tolist()


def test_remove_many_refuses_a_parent_before_its_children() -> None:
    idx = RadixIndex()
    ids = chain(idx, 1, 2).tolist()
    for bad in ([ids[0]], [ids[0], ids[1]], [ids[1], ids[1]]):
        with pytest.raises((RuntimeError, KeyError)):
            idx.remove_many(bad)
    assert len(idx) == 2 and int(idx.children[ids[0]]) == 1  # refused: nothing changed
    assert idx.remove_many([ids[1], ids[0]]) == [h(1, 2), h(1)] and len(idx) == 0
