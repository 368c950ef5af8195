"""Leases taken at the scheduler's lookup (``Client.lookup_lease``, the daemon's LOOKUP_LEASE):
the worker's copies of a hit start without an ACQUIRE round trip of their own.

The scheduler asks the daemon once per request: how many leading blocks it holds, and a lease on
those the arena holds now. The lease stays with the scheduler's connection; what crosses to the
worker in the step's metadata is where the blocks lie (:class:`PreLease`: the arena's name and
each block's offset). The worker copies from them (``engine.gpu.HeldBlocks``) and reports the
request once its copies have landed (``Worker.take_landed``, vLLM's worker metadata of the step);
only then does the scheduler give the lease back. A lease whose request does not load in the
step of its lookup (vLLM could not allocate its pages, or its own prefix cache covers the hit)
is given back at that step's end: a waiting request pins nothing. A worker that cannot use the
lease (another arena: the daemon restarted) takes its own, as without one.

Only where the scheduler's namespace is the worker's (tensor parallel degree 1) and for dense
pages: other ranks and hybrid pages take their leases themselves.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.vllm")


@dataclass(frozen=True, slots=True)
class PreLease:
    """Where a load's leading blocks lie in the daemon's arena, held by the scheduler's lease:
    block ``start + i`` of the load at ``locations[i]``."""

    arena: str
    locations: tuple[tuple[int, int], ...]

    @property
    def num_blocks(self) -> int:
        return len(self.locations)


class LeaseBook:
    """The scheduler's leases from its lookups, by request: ``held`` (taken at the lookup, not
    yet lent to a load) and ``lent`` (a worker copies from it; given back when the worker
    reports its copies landed). At most one lease per request. Scheduler thread only."""

    def __init__(self) -> None:
        self.held: dict[str, Any] = {}
        """request id -> its lookup's lease (a ``ClientLease``), no load planned yet."""
        self.lent: dict[str, list[Any]] = {}
        """request id -> leases whose blocks a worker's load reads (one, unless vLLM loaded the
        request again before its first load's report came back)."""

    def take(self, req_id: str, lease: Any) -> None:
        """``lease`` (None: the lookup leased nothing) from ``req_id``'s lookup."""
        self.drop(req_id)
        if lease is not None and lease.num_blocks:
            self.held[req_id] = lease
        elif lease is not None:
            _give_back(lease)

    def lend(self, req_id: str, start: int, count: int) -> PreLease | None:
        """The held lease's blocks ``start .. start+count-1`` for the worker's load (those of them
        it covers), now lent; None (and given back) when it covers none of them."""
        lease = self.held.pop(req_id, None)
        if lease is None:
            return None
        locs = tuple(lease.locations[start : start + count])
        if not locs:
            _give_back(lease)
            return None
        self.lent.setdefault(req_id, []).append(lease)
        return PreLease(lease.arena, locs)

    def drop(self, req_id: str) -> None:
        """Give back ``req_id``'s held lease (a lent one stays until its copies landed)."""
        lease = self.held.pop(req_id, None)
        if lease is not None:
            _give_back(lease)

    def end_step(self) -> int:
        """Give back every lease not lent in this step (its request loads nothing now); returns
        how many."""
        held, self.held = self.held, {}
        for lease in held.values():
            _give_back(lease)
        return len(held)

    def landed(self, req_ids: Any) -> None:
        """The workers' copies of these requests' loads have landed: give their leases back."""
        for req_id in req_ids:
            for lease in self.lent.pop(req_id, ()):
                _give_back(lease)

    def close(self) -> None:
        self.end_step()
        self.landed(list(self.lent))


def lease_chunks(n: int, head: int) -> list[tuple[int, int]]:
    """Block ranges of a load of ``n`` blocks leased piece by piece: ``head`` blocks, then each
    piece 4x the one before (the first DMA waits only for a small lease; the later leases come
    back while the earlier pieces cross the link)."""
    out, a, size = [], 0, max(1, head)
    while a < n:
        out.append((a, min(n, a + size)))
        a, size = out[-1][1], size * 4
    return out


def _give_back(lease: Any) -> None:
    """Release without waiting for the daemon's reply (read with the connection's next call);
    a daemon that is gone has dropped it already."""
    with contextlib.suppress(KVStoreError, OSError):
        lease.release()
