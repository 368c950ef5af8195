"""The cached subtree of a block, for code that holds the radix index's columns but must not
import the index (the admission rules, which import only the leaves; the store's placer, which
reaches the policies only through their protocol). A leaf: numpy only."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TreeView(Protocol):
    """What :class:`ChildIndex` reads from the radix index (``kvstore.index.RadixIndex``
    satisfies it): each block's parent and child count, which ids are live."""

    parent: np.ndarray
    children: np.ndarray
    flags: np.ndarray

    def live_ids(self) -> np.ndarray: ...


class ChildIndex:
    """The cached subtree of a block, from an index that keeps only a parent and a child count
    per block: a copy of the parent column sorted by parent, rebuilt (one argsort) when a child
    count shows it is stale. The children it finds are checked against the live columns (an id
    may have left, or been recycled under another parent), and a block whose checked children
    are fewer than its count gained a child since the copy: then the copy is rebuilt. So the
    answer is exact; a rebuild is needed only once the subtrees asked about were grown after the
    last one (admission asks about blocks leaving the next-to-last tier: old ones)."""

    def __init__(self, view: TreeView) -> None:
        self.view = view
        self._parents = np.zeros(0, np.int64)
        self._kids = np.zeros(0, np.int64)
        self.rebuilds = 0

    def _rebuild(self) -> None:
        v = self.view
        ids = v.live_ids()
        parents = v.parent[ids].astype(np.int64)
        linked = parents >= 0
        ids, parents = ids[linked], parents[linked]
        order = np.argsort(parents, kind="stable")
        self._kids, self._parents = ids[order], parents[order]
        self.rebuilds += 1

    def _children(self, bid: int) -> list[int] | None:
        """The live children of ``bid``, or None when the copy lacks some."""
        v = self.view
        want = int(v.children[bid])
        if not want:
            return []
        lo, hi = np.searchsorted(self._parents, (bid, bid + 1))
        kids = self._kids[lo:hi]
        kids = kids[(v.flags[kids] != 0) & (v.parent[kids] == bid)]
        return kids.tolist() if kids.size == want else None

    def below(self, bid: int) -> list[int]:
        """Every cached descendant of ``bid``, each after its parent (reversed: leaves first)."""
        for _ in range(2):
            out: list[int] = []
            stack = [bid]
            while stack:
                kids = self._children(stack.pop())
                if kids is None:
                    break
                out.extend(kids)
                stack.extend(kids)
            else:
                return out
            self._rebuild()
        raise RuntimeError(f"block id {bid}: the child counts disagree with the parent column after a rebuild")
