"""The EvictionPolicy protocol: which block of a tier should leave first.

A policy orders the blocks resident in *one* tier (the store keeps one policy instance per tier).
It sees block ids (small ints from the radix index), sizes and times, never payloads, and it
never removes anything itself:

* ``bind(view, tier)`` is called once, before any other call: ``view`` gives read-only access to
  the index columns (parent, depth, children, size, hits) and to a block's hash (for ghost
  entries that outlive a block id, which the index recycles); ``tier`` says which tier the
  policy orders and whether it is the last one (where only leaves may leave the store).
* ``insert`` / ``touch`` / ``remove`` keep its view in sync with the tier; the store calls them
  under its lock, once per event. ``touch`` is a hit (a load of the block), nothing else.
  ``remove`` of an unknown id is a no-op. The store inserts a new chain leaves first and touches
  a hit prefix deepest first, so that parents are always more recent than their children.
  ``touch_many`` is ``touch`` of each block in order, at one time (a hit prefix: the store
  calls it once per tier per load or lease); a policy may override it with a faster loop of
  the same outcome.
  ``insert_many`` is ``insert`` of each block in order (a warm restart learns every block with
  one call per tier); a policy may override it with a vectorised version of the same outcome.
* On the **last tier** only leaves may leave the store, so a last-tier policy orders leaves
  only: a block inserted while it has cached children (``view.children[bid] > 0``) starts
  *held*; the store calls ``hold(bid)`` when a resident block gains its first cached child and
  ``offer(bid)`` when it loses its last one. A held block is still resident (``touch`` and
  ``remove`` apply, its statistics are kept) but ``candidates()`` does not yield it. This is
  what lets the store find a victim in O(1) or O(log n) however long and forked the chains are
  (SGLang's radix cache: evict a leaf, its parent may become one). Upper tiers never see
  ``hold``/``offer``: there every block may move down.
* ``candidates()`` yields ids in eviction order, best victim first. The store consumes it lazily,
  skips what it may not evict (pinned, in use), stops at its work cap, and only then removes the
  chosen blocks: eviction is atomic (it frees enough or evicts nothing). The store does not mutate the policy while iterating; a policy may
  reorganise itself inside its own iterator. Every resident block must eventually be yielded, so
  that the store can always make room when room can be made.
* ``admit`` lets a policy refuse a block at the door of a tier (default: admit all); a refused
  block goes to the next tier, and a block no tier admits ends the put there.

Time (``now``) is the store's wall clock; policies that count in events keep their own counter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class BlockView(Protocol):
    """Read-only columns of the radix index (``kvstore.index.RadixIndex`` satisfies it).

    Columns are numpy arrays indexed by block id; the index may replace an array when it grows,
    so read ``view.depth[bid]`` at the time of use instead of keeping the array.
    """

    parent: np.ndarray
    depth: np.ndarray
    children: np.ndarray
    size: np.ndarray
    hits: np.ndarray

    def hash_of(self, bid: int) -> bytes: ...


@dataclass(frozen=True, slots=True)
class TierContext:
    """The tier a policy instance orders: its name and kind, its position (0 = fastest), the
    kind of the next tier down (``""`` for the last), and whether it is the last one."""

    name: str = "t0"
    kind: str = ""
    position: int = 0
    next_kind: str = ""

    @property
    def last(self) -> bool:
        return not self.next_kind


class EvictionPolicy(ABC):
    name: str = ""

    def bind(self, view: BlockView, tier: TierContext) -> None:  # noqa: B027
        """Learn the index view and the tier; called once before any other call."""

    @abstractmethod
    def insert(self, bid: int, size: int, now: float) -> None: ...

    def insert_many(self, ids: np.ndarray, sizes: np.ndarray, now: np.ndarray | float) -> None:
        """``insert(ids[i], sizes[i], now[i])`` for each ``i`` in order (``now``: one time per
        block, or one for all)."""
        nows = np.broadcast_to(np.asarray(now, np.float64), np.shape(ids)).tolist()
        for bid, size, t in zip(np.asarray(ids).tolist(), np.asarray(sizes).tolist(), nows, strict=True):
            self.insert(bid, size, t)

    @abstractmethod
    def touch(self, bid: int, now: float) -> None: ...

    def touch_many(self, bids: list[int], now: float) -> None:
        """``touch(bid, now)`` for each ``bid`` in order (a hit prefix, deepest first)."""
        touch = self.touch
        for bid in bids:
            touch(bid, now)

    @abstractmethod
    def remove(self, bid: int) -> None: ...

    def hold(self, bid: int) -> None:
        """Last tier only: resident ``bid`` gained a cached child; stop yielding it."""
        raise NotImplementedError(f"policy {self.name!r} cannot order the last tier: implement hold/offer")

    def offer(self, bid: int) -> None:
        """Last tier only: resident ``bid`` lost its last cached child; yield it again."""
        raise NotImplementedError(f"policy {self.name!r} cannot order the last tier: implement hold/offer")

    @abstractmethod
    def candidates(self) -> Iterator[int]: ...

    def first(self) -> int | None:
        """The first of :meth:`candidates` (None: no block), for the usual make-room that takes
        the first offer; a policy may answer it without building an iterator."""
        return next(self.candidates(), None)

    runs: bool = False
    """Whether :meth:`victims` may answer more than one block (the store then takes a run of
    last-tier victims with one call each to :meth:`victims` and :meth:`remove_leaves`)."""

    def victims(self, n: int) -> list[int]:
        """Last tier: up to ``n`` blocks that :meth:`first` would offer one after the other if
        the store took each in turn (:meth:`remove_leaves`: removed, its parent offered when
        left childless), at least one while any block is offered. Changes no order: the store
        takes a leading part of the answer with :meth:`remove_leaves` and, where it stops,
        asks :meth:`first` again. A policy whose next victim may be a parent just offered
        answers one block (the default, for a policy whose :meth:`first` changes nothing)."""
        bid = self.first()
        return [] if bid is None else [bid]

    def remove_leaves(self, bids: list[int], parents: list[int]) -> None:
        """``remove(bids[i])`` then, when ``parents[i] >= 0``, ``offer(parents[i])``, for each
        ``i`` in order: the leaves of a batched eviction that :meth:`victims` answered (or
        any leaves); a policy may override it with one loop of the same outcome."""
        for bid, p in zip(bids, parents, strict=True):
            self.remove(bid)
            if p >= 0:
                self.offer(p)

    @abstractmethod
    def __len__(self) -> int: ...

    def admit(self, bid: int, size: int, now: float) -> bool:
        return True
