"""The engine-side cache client: tokens -> block hashes -> lookup -> load -> (engine computes) ->
store the new full blocks asynchronously.

It works against anything with the store's public API (``register_namespace``, ``lookup``,
``get_into``, ``put``): the in-process :class:`kvstore.store.KVStore`, or a daemon client.
Stores run on a background thread: the engine never waits for one. When too many stores are in
flight the newest is dropped and counted (the cache is an optimisation; backpressure on the
engine would be worse than a miss later).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.gpu import ArenaBlocks, HostBlocks
from engine.kvlayout import KVShape
from kvstore.errors import KVStoreError, UsageError
from kvstore.keys import BlockHash, Namespace, hash_blocks

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ClientCounters:
    lookups: int = 0
    hit_blocks: int = 0
    stores_submitted: int = 0
    stores_done: int = 0
    stores_dropped: int = 0
    store_errors: int = 0


class EngineCache:
    """One model's view of the store. Thread-safe for one engine thread plus the store thread."""

    def __init__(self, store: Any, ns: Namespace, shape: KVShape, *, max_pending: int = 4) -> None:
        if ns.block_bytes != shape.block_bytes:
            raise ValueError(f"namespace blocks are {ns.block_bytes} bytes, the KV shape's {shape.block_bytes}")
        self.store = store
        self.ns = ns
        self.shape = shape
        store.register_namespace(ns)
        self.counters = ClientCounters()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-store")
        self._slots = threading.BoundedSemaphore(max_pending)
        self._pin = torch.cuda.is_available()
        # Leases (zero-copy reads from the store's shared-memory arena) when the store offers
        # them; the first refusal (no arena tier first) switches to copies for good.
        self._leases = hasattr(store, "acquire")
        self._d2h: dict[torch.device, torch.cuda.Stream] = {}  # one copy-out stream per device

    def hashes(self, tokens: Any) -> list[BlockHash]:
        return hash_blocks(self.ns, tokens)

    def load(self, hashes: list[BlockHash], max_blocks: int) -> ArenaBlocks | HostBlocks:
        """The leading cached blocks (at most ``max_blocks``). From an in-process store with a
        shared-memory arena they stay in the arena, held by a lease, and are copied straight to
        the device; otherwise they are copied into a host buffer (pinned when CUDA is present).
        The caller calls ``release()`` once its copies are done."""
        self.counters.lookups += 1
        max_blocks = min(max_blocks, len(hashes))
        if max_blocks <= 0:
            return HostBlocks(torch.empty((0, self.shape.block_bytes), dtype=torch.uint8))
        if self._leases:
            try:
                blocks = ArenaBlocks(self.store, self.store.acquire(self.ns, hashes[:max_blocks]))
                self.counters.hit_blocks += blocks.num_blocks
                return blocks
            except UsageError as e:
                log.info("store has no arena to lease from (%s); loading by copy", e)
                self._leases = False
        buf = torch.empty((max_blocks, self.shape.block_bytes), dtype=torch.uint8, pin_memory=self._pin)
        n = self.store.get_into(self.ns, hashes[:max_blocks], buf.view(-1).numpy())
        self.counters.hit_blocks += n
        return HostBlocks(buf[:n])

    def store_async(self, hashes: list[BlockHash], blocks: torch.Tensor, start: int) -> Future[int] | None:
        """Store ``blocks`` (``[m, block_bytes]`` uint8, blocks ``start..start+m-1`` of
        ``hashes``) in the background. Device tensors are copied to pinned host memory on a side
        stream first; the store thread waits for that copy, the engine does not."""
        if blocks.shape[0] == 0:
            return None
        if not self._slots.acquire(blocking=False):
            self.counters.stores_dropped += 1
            return None
        ready: torch.cuda.Event | None = None
        if blocks.device.type == "cuda":
            host = torch.empty(blocks.shape, dtype=torch.uint8, pin_memory=True)
            stream = self._d2h.get(blocks.device)
            if stream is None:
                stream = self._d2h[blocks.device] = torch.cuda.Stream(blocks.device)
            stream.wait_stream(torch.cuda.current_stream(blocks.device))
            with torch.cuda.stream(stream):
                host.copy_(blocks, non_blocking=True)
                blocks.record_stream(stream)
                ready = torch.cuda.Event()
                ready.record(stream)
            blocks = host
        else:
            blocks = blocks.clone()  # the engine may reuse its buffer
        chain = list(hashes[: start + blocks.shape[0]])
        self.counters.stores_submitted += 1
        return self._pool.submit(self._store, chain, blocks, start, ready)

    def _store(self, chain: list[BlockHash], blocks: torch.Tensor, start: int, ready: Any) -> int:
        try:
            if ready is not None:
                ready.synchronize()
            n = self.store.put(self.ns, chain, blocks.view(-1).numpy(), start=start)
            self.counters.stores_done += 1
            return n
        except KVStoreError as e:
            # A prefix evicted between the load and this store, a full tier: the next request
            # recomputes. Never the engine's problem.
            self.counters.store_errors += 1
            log.warning("background store failed: %s", e)
            return 0
        finally:
            self._slots.release()

    def flush(self) -> None:
        """Wait for every store submitted so far (tests, shutdown)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)
