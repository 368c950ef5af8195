"""A slab allocator over one contiguous arena (a shared-memory segment or a preallocated file).

The arena is cut into slabs of ``slab_bytes``. A slab serves one size class (a block size rounded
up to ``align``); it is split into equal slots. Blocks of one namespace all have one size, so a
class rarely wastes more than the rounding. A slab that empties goes back to the pool and can
serve another class. Allocation and free are O(1) and allocate no Python objects per block beyond
the free-list entry; the allocator holds no payload and does no I/O.

Not thread-safe by itself: the owning tier holds its lock around calls.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.errors import UsageError
from tiers.base import TierUsage


@dataclass(slots=True)
class _Slab:
    index: int
    slot_bytes: int = 0  # 0: unassigned
    free: list[int] = field(default_factory=list)
    busy: bytearray = field(default_factory=bytearray)  # one byte per slot: catches double frees
    used: int = 0
    freed: array = field(default_factory=lambda: array("Q"))  # per slot: the allocator's frees at its last free
    reset_at: int = 0  # the allocator's frees when the slab took its class (its old slots' stamps are gone)


class SlabAllocator:
    def __init__(self, capacity_bytes: int, slab_bytes: int, align: int = 4096) -> None:
        if slab_bytes <= 0 or slab_bytes % align:
            raise UsageError(f"slab_bytes ({slab_bytes}) must be a positive multiple of {align}")
        if capacity_bytes < slab_bytes:
            raise UsageError(
                f"capacity ({capacity_bytes} bytes) is smaller than one slab ({slab_bytes} bytes); "
                "raise the tier's capacity or lower its slab_bytes"
            )
        self.align = align
        self.slab_bytes = slab_bytes
        self.n_slabs = capacity_bytes // slab_bytes
        self.capacity_bytes = self.n_slabs * slab_bytes
        self._slabs = [_Slab(i) for i in range(self.n_slabs)]
        self._unassigned: list[int] = list(range(self.n_slabs - 1, -1, -1))
        self._partial: dict[int, set[int]] = {}  # slot_bytes -> slabs with a free slot
        self._empty: set[int] = set()  # assigned slabs with no used slot: free for any class
        self._stale: set[int] = set()  # slabs whose free lists wait for claims to settle
        self.used_bytes = 0  # bytes of slots handed out (padded)
        self.frees = 0
        """Slots freed so far: the stamp an optimistic reader takes (``freed_since``); each slot
        keeps the count at its last free (8 bytes a slot, in its slab)."""

    def slot_bytes(self, size: int) -> int:
        """The size class of a ``size``-byte block."""
        if size <= 0:
            raise UsageError(f"a block must have a positive size, got {size}")
        slot = -(-size // self.align) * self.align
        if slot > self.slab_bytes:
            raise UsageError(
                f"a {size}-byte block does not fit in one {self.slab_bytes}-byte slab; "
                "raise the tier's slab_bytes"
            )
        return slot

    def fits(self, size: int) -> bool:
        slot = self.slot_bytes(size)
        if self._stale:
            self._settle()
        return bool(self._partial.get(slot)) or bool(self._unassigned) or bool(self._empty)

    def alloc(self, size: int) -> int | None:
        """Offset of a free slot for ``size`` bytes, or None when the class and the pool are full."""
        slot = self.slot_bytes(size)
        if self._stale:
            self._settle()
        got = self._slab_for(slot)
        if got is None:
            return None
        slab, partial = got
        k = slab.free.pop()
        slab.busy[k] = 1
        slab.used += 1
        self._empty.discard(slab.index)
        if not slab.free:
            partial.discard(slab.index)
        self.used_bytes += slot
        return slab.index * self.slab_bytes + k * slot

    def alloc_many(self, size: int, count: int) -> list[int]:
        """Up to ``count`` slots for ``size`` bytes, as ``count`` calls of :meth:`alloc` would
        hand them out (fewer when the class and the pool run out), taken a slab at a time: one
        slice of its free list and one busy-mark per slab, not a call per slot."""
        slot = self.slot_bytes(size)
        if self._stale:
            self._settle()
        out: list[int] = []
        while len(out) < count:
            got = self._slab_for(slot)
            if got is None:
                break
            slab, partial = got
            k = min(count - len(out), len(slab.free))
            cut = len(slab.free) - k
            ks = slab.free[cut:][::-1]  # (the order k pops would take them in)
            del slab.free[cut:]
            np.frombuffer(slab.busy, np.uint8)[ks] = 1
            slab.used += k
            self._empty.discard(slab.index)
            if not slab.free:
                partial.discard(slab.index)
            self.used_bytes += k * slot
            base = slab.index * self.slab_bytes
            out += [base + j * slot for j in ks]
        return out

    def free(self, offset: int) -> None:
        slab = self._slabs[offset // self.slab_bytes]
        if not slab.slot_bytes:
            raise RuntimeError(f"free of offset {offset} in an unassigned slab {slab.index}")
        if self._stale:
            self._settle()
        k, rem = divmod(offset - slab.index * self.slab_bytes, slab.slot_bytes)
        if rem or not slab.busy[k]:
            raise RuntimeError(f"free of offset {offset}: not an allocated slot (double free?)")
        slab.busy[k] = 0
        slab.free.append(k)
        self.frees += 1
        slab.freed[k] = self.frees
        slab.used -= 1
        self.used_bytes -= slab.slot_bytes
        self._partial.setdefault(slab.slot_bytes, set()).add(slab.index)
        if slab.used == 0:
            self._empty.add(slab.index)

    def freed_since(self, offsets: Iterable[int], stamp: int) -> bool:
        """Whether any slot at ``offsets`` was freed after ``frees`` was ``stamp``."""
        if self.frees == stamp:
            return False
        for o in offsets:
            slab = self._slabs[o // self.slab_bytes]
            if slab.reset_at > stamp or not slab.slot_bytes:
                return True
            if slab.freed[(o - slab.index * self.slab_bytes) // slab.slot_bytes] > stamp:
                return True
        return False

    def claim(self, offset: int, size: int) -> None:
        """Mark the slot at ``offset`` used (rebuilding occupancy after a restart)."""
        slot = self.slot_bytes(size)
        slab = self._slabs[offset // self.slab_bytes]
        if slab.slot_bytes == 0:
            self._unassigned.remove(slab.index)
            self._assign(slab, slot)
            self._partial.setdefault(slot, set()).add(slab.index)
        elif slab.slot_bytes != slot:
            raise RuntimeError(
                f"slot at offset {offset} claimed for class {slot} in slab of class {slab.slot_bytes}"
            )
        k = (offset - slab.index * self.slab_bytes) // slot
        if slab.busy[k]:
            raise RuntimeError(f"slot at offset {offset} claimed twice")
        slab.busy[k] = 1
        slab.used += 1
        self._empty.discard(slab.index)
        self.used_bytes += slot
        # Free lists are rebuilt once after a run of claims (a restart claims every block).
        self._stale.add(slab.index)

    def slot_bytes_many(self, sizes: np.ndarray) -> np.ndarray:
        """:meth:`slot_bytes` of each size, 0 where it would raise (no slab can hold it)."""
        sizes = np.asarray(sizes, np.uint64)
        ok = (sizes > 0) & (sizes <= self.slab_bytes)  # slab_bytes is a multiple of align
        slot = np.zeros(sizes.shape, np.int64)
        a = self.align
        slot[ok] = (sizes[ok].astype(np.int64) + (a - 1)) // a * a
        return slot

    def claim_many(self, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """:meth:`claim` of each ``(offset, size)`` in order (a restart claims every block);
        True where it succeeded, False where ``claim`` would have raised, as it would have left
        the allocator."""
        offsets = np.asarray(offsets, np.uint64)
        n = offsets.size
        slot = self.slot_bytes_many(sizes)
        slab_i = offsets // np.uint64(self.slab_bytes)
        ok = (slot > 0) & (slab_i < self.n_slabs)
        out = np.zeros(n, bool)
        todo = np.flatnonzero(ok)
        if not todo.size:
            return out
        si = slab_i[todo].astype(np.int64)
        sl = slot[todo]
        # A slab's class: its own, or that of the first claim in it (which assigns it even when
        # the claim then fails, as claim() does).
        cls = np.fromiter((s.slot_bytes for s in self._slabs), np.int64, self.n_slabs)
        slabs, first = np.unique(si, return_index=True)
        fresh = cls[slabs] == 0
        if fresh.any():
            new = slabs[fresh].tolist()
            for i, c in zip(new, sl[first[fresh]].tolist(), strict=True):
                self._assign(self._slabs[i], c)
                self._partial.setdefault(c, set()).add(i)
                cls[i] = c
            taken = set(new)
            self._unassigned = [i for i in self._unassigned if i not in taken]
        k = (offsets[todo].astype(np.int64) - si * self.slab_bytes) // sl
        fit = (cls[si] == sl) & (k < self.slab_bytes // sl)
        todo, si, sl, k = todo[fit], si[fit], sl[fit], k[fit]
        order = np.argsort(si, kind="stable")
        todo, si, k = todo[order], si[order], k[order]
        bounds = np.flatnonzero(np.diff(si)) + 1
        for start, rows, ks in zip([0, *bounds.tolist()], np.split(todo, bounds), np.split(k, bounds), strict=True):
            if not rows.size:
                continue
            slab = self._slabs[int(si[start])]
            busy = np.frombuffer(slab.busy, np.uint8)
            # The first claim of a free slot wins; a repeat, or a slot already used, fails.
            _, once = np.unique(ks, return_index=True)
            won = np.zeros(ks.size, bool)
            won[once] = busy[ks[once]] == 0
            if not won.any():
                continue
            busy[ks[won]] = 1
            count = int(won.sum())
            slab.used += count
            self.used_bytes += count * slab.slot_bytes
            self._empty.discard(slab.index)
            self._stale.add(slab.index)
            out[rows[won]] = True
        return out

    def _settle(self) -> None:
        for i in self._stale:
            slab = self._slabs[i]
            slab.free = [k for k in range(len(slab.busy) - 1, -1, -1) if not slab.busy[k]]
            if slab.free:
                self._partial.setdefault(slab.slot_bytes, set()).add(i)
            else:
                self._partial.get(slab.slot_bytes, set()).discard(i)
        self._stale.clear()

    def _assign(self, slab: _Slab, slot: int) -> None:
        slab.slot_bytes = slot
        # Pop from the end: the lowest slot first, so a fresh arena fills front to back.
        slab.free = list(range(self.slab_bytes // slot - 1, -1, -1))
        slab.busy = bytearray(len(slab.free))
        slab.freed = array("Q", bytes(8 * len(slab.free)))
        slab.reset_at = self.frees
        slab.used = 0

    def _slab_for(self, slot: int) -> tuple[_Slab, set[int]] | None:
        """A slab of class ``slot`` with a free slot (a partial one, else one taken from the
        pool and assigned) and the class's partial set, or None when there is none."""
        partial = self._partial.get(slot)
        if partial:
            return self._slabs[next(iter(partial))], partial
        slab_i = self._take_slab()
        if slab_i is None:
            return None
        slab = self._slabs[slab_i]
        self._assign(slab, slot)
        partial = self._partial.setdefault(slot, set())
        partial.add(slab.index)
        return slab, partial

    def _take_slab(self) -> int | None:
        if self._unassigned:
            return self._unassigned.pop()
        if self._empty:  # an emptied slab of another class
            i = self._empty.pop()
            self._partial.get(self._slabs[i].slot_bytes, set()).discard(i)
            return i
        return None


class SlabMap:
    """The slot books of a tier that keeps ``key -> (offset, meta)`` over a
    :class:`SlabAllocator` (DRAM, HBM): delete and the capacity queries. The tier owns one and
    calls it; the lock, the map and the allocator are the tier's, handed in here, and every
    call takes the lock."""

    def __init__(self, lock: threading.Lock, entries: dict[Any, tuple[int, Any]], alloc: SlabAllocator) -> None:
        self.lock = lock
        self.entries = entries
        self.alloc = alloc

    def delete(self, key: bytes) -> bool:
        with self.lock:
            entry = self.entries.pop(key, None)
            if entry is None:
                return False
            self.alloc.free(entry[0])
            return True

    def usage(self) -> TierUsage:
        """``used_bytes`` counts whole slots (sizes rounded up to 4 KiB): the room really taken."""
        with self.lock:
            return TierUsage(self.alloc.used_bytes, self.alloc.capacity_bytes, len(self.entries))

    def fits(self, size: int) -> bool:
        """Whether a free slot of ``size``'s class exists; UsageError if no slab can hold it."""
        with self.lock:
            return self.alloc.fits(size)

    def size_class(self, size: int) -> int:
        return self.alloc.slot_bytes(size)
