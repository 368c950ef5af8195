"""The contract every store in the peer benchmark meets."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from tools.bench._peers.workload import Request, Workload


class PeerUnavailable(Exception):
    """The peer cannot run here (not installed, its server does not start): the bench says so
    in a JSON line and goes on with the others."""


class Adapter(ABC):
    serial = False
    """The store serves one call at a time (its handles share one lock): the concurrent phase
    would only measure a queue, so it is skipped and says so."""

    """One store under the workload.

    Lifecycle: :meth:`open` once, then any number of :meth:`store`, :meth:`lookup` and
    :meth:`retrieve` calls, then :meth:`close`. Every call is synchronous: when :meth:`store`
    returns, a :meth:`lookup` from any client finds the request (a store whose backend writes in
    the background waits for those writes, and that wait is timed). Tokens are hashed by the
    store itself, as the store's own engine integration would (LMCache hashes token ids; kvstore,
    Mooncake and the baselines use ``kvstore.keys.hash_blocks``), so hashing is in every figure.

    ``src`` and ``dst`` are the caller's buffers of ``Workload.request_bytes``: chunk ``i`` of the
    request (``Workload.chunk_tokens`` tokens) is ``[i * chunk_bytes, (i + 1) * chunk_bytes)``.
    """

    @abstractmethod
    def open(self, w: Workload) -> None:
        """Start the store with ``w.capacity_bytes`` of room and LRU eviction."""

    @abstractmethod
    def store(self, req: Request, src: np.ndarray) -> None:
        """Store every chunk of ``req`` from ``src``."""

    @abstractmethod
    def lookup(self, req: Request) -> int:
        """How many leading tokens of ``req`` are cached (a multiple of the chunk)."""

    @abstractmethod
    def retrieve(self, req: Request, dst: np.ndarray) -> int:
        """Load the leading cached chunks of ``req`` into ``dst``; returns the tokens loaded."""

    def client(self) -> Adapter:
        """A handle for one more concurrent client (its own connection where the store has
        connections); the default shares this one, which must then be thread-safe."""
        return self

    def close_client(self) -> None:
        """Give back what :meth:`client` opened (nothing by default)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Stop the store and free its memory."""

    def info(self) -> dict[str, Any]:
        """Extra fields for the result rows (versions, listening addresses, counters)."""
        return {}
