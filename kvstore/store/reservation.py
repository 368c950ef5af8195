"""A two-phase put into the DRAM arena: :meth:`KVStore.reserve` hands out arena slots for the
new blocks of a chain, the caller writes the payloads there itself (a device-to-host DMA from a
GPU, straight into the memory that *is* the store's first tier), and :meth:`Reservation.commit`
publishes them. In process only: a daemon's clients map the arena read-only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from kvstore.errors import UsageError


class Reservation:
    """Arena slots for blocks ``first, first+1, ...`` of a chain (``locations[i]`` is block
    ``first + i``'s ``(offset, size)`` in the arena named ``arena``), from
    :meth:`KVStore.reserve`.

    Contract: until :meth:`commit` or :meth:`abort` the blocks are in the store's index as
    hollow nodes (a lookup or a load stops before them, another put of the chain stops at them)
    and the chain is pinned; nothing of a slot is served before it is committed. Write block
    ``first + i``'s payload into slot ``i`` (``views()[i]``, or the caller's own mapping of the
    arena at ``locations[i]``), then :meth:`commit` the count of leading slots whose bytes are
    all written: the rest are given back, never served half-written. :meth:`abort` (or leaving a
    ``with`` block without a commit, an exception included) commits nothing. Exactly one of them, once; until then the
    chain stays pinned. A reservation dropped without either is aborted by the store at its next
    ``reserve``, ``put``, ``stats`` or ``close`` (counted in ``abandoned_reservations``): its
    finalizer only hands it over (``orphaned``), so no store code runs inside the collector.
    A writer that cannot tell whether its copies into the slots have landed (a DMA queued behind
    an event that has not completed) ends it with :meth:`quarantine` instead of :meth:`abort`.
    Not thread-safe: one owner.
    """

    def __init__(self, arena: str, first: int, stored: int, locations: tuple[tuple[int, int], ...],
                 views: Callable[[], list[memoryview]], finish: Callable[[int], int],
                 prepare: Callable[[], None] | None = None,
                 orphaned: Callable[[Callable[[int], int]], None] | None = None,
                 set_aside: Callable[[], Callable[[], None]] | None = None) -> None:
        self.arena = arena
        """The shared-memory arena's name (:func:`kvstore.shm.attach_arena`)."""
        self.first = first
        """Chain position of the first slot's block."""
        self.stored = stored
        """Leading blocks of the chain cached at the reservation (the put's ``start`` and the
        blocks after it cached already): ``first`` when there are slots."""
        self.locations = locations
        self._views = views
        self._finish = finish
        self._prepare = prepare
        self._set_aside = set_aside
        self.done = False
        """Committed or aborted."""
        self._orphan: weakref.finalize | None = None
        if orphaned is not None:
            self._orphan = weakref.finalize(self, orphaned, finish)
            self._orphan.atexit = False

    @property
    def num_blocks(self) -> int:
        return len(self.locations)

    def views(self) -> list[memoryview]:
        """A writable view of every slot, in order (drop them before :meth:`commit`)."""
        if self.done:
            raise UsageError("this reservation is committed or aborted: its slots are the store's")
        return self._views()

    def prepare(self) -> None:
        """Optional: build what :meth:`commit` publishes (the blocks' records) now, without the
        store's lock, so that the commit that follows is shorter: call it while the copies into
        the slots are in flight (a host that waits for a DMA has the time). Idempotent."""
        if self.done:
            raise UsageError("this reservation is committed or aborted already")
        if self._prepare is not None and self.locations:
            self._prepare()

    def commit(self, count: int | None = None) -> int:
        """Publish the leading ``count`` slots (default: all) as cached blocks; give the others
        back. Returns how many blocks were new (as :meth:`KVStore.put` does)."""
        n = self.num_blocks if count is None else count
        if not 0 <= n <= self.num_blocks:
            raise UsageError(f"commit({count}) of a reservation of {self.num_blocks} slots")
        if self.done:
            raise UsageError("this reservation is committed or aborted already")
        self._settled()
        return self._finish(n)

    def abort(self) -> None:
        """Commit nothing (idempotent, and a no-op after :meth:`commit`)."""
        if not self.done:
            self._settled()
            self._finish(0)

    def quarantine(self) -> Callable[[], None]:
        """Commit nothing, as :meth:`abort` (the chain is unpinned, no block of it is stored), but
        keep the slots out of the allocator: copies into them may still be in flight. Returns
        the function that gives them back, to be called once nothing can write them any more
        (a second call does nothing); until then no reservation or put gets them and no read
        finds them."""
        if self.done:
            raise UsageError("this reservation is committed or aborted already")
        if self._set_aside is None:
            raise UsageError("this reservation has no slots to set aside")
        self._settled()
        return self._set_aside()

    def _settled(self) -> None:
        self.done = True
        if self._orphan is not None:
            self._orphan.detach()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        """Whatever was not committed in the block is aborted (an exception, or no commit)."""
        self.abort()
