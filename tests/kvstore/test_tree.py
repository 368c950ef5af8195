"""ChildIndex: the cached subtree of a block from the index's parent and child-count columns."""

from __future__ import annotations

import numpy as np

from kvstore.index import NO_PARENT, RadixIndex
from kvstore.tree import ChildIndex


def test_child_index_is_exact_as_the_tree_changes() -> None:
    idx = RadixIndex()
    a = idx.insert_chain([b"a%d" % i for i in range(4)], NO_PARENT, 0, 1, 0, 1, 0.0, 1e9).tolist()
    fork = idx.insert_chain([b"f%d" % i for i in range(3)], a[1], 2, 1, 0, 1, 0.0, 1e9).tolist()
    kids = ChildIndex(idx)
    assert sorted(kids.below(a[1])) == sorted(a[2:] + fork)
    built = kids.rebuilds
    assert kids.below(a[2]) == [a[3]] and kids.rebuilds == built  # nothing changed: no rebuild
    more = idx.insert_chain([b"g0", b"g1"], fork[0], 3, 1, 0, 1, 0.0, 1e9).tolist()  # grown since
    assert sorted(kids.below(fork[0])) == sorted(fork[1:] + more)
    assert kids.rebuilds == built + 1
    idx.remove(fork[2])
    idx.remove(fork[1])
    recycled = idx.insert_chain([b"h0"], a[3], 4, 1, 0, 1, 0.0, 1e9).tolist()  # a freed id, elsewhere
    assert sorted(kids.below(a[1])) == sorted([a[2], a[3], fork[0], *more, *recycled])
    assert kids.below(a[1]) == sorted(idx.subtree(np.array([a[1]])).tolist()[1:], key=kids.below(a[1]).index)
