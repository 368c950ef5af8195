"""The engine-side cache client: tokens -> block hashes -> lookup -> load -> (engine computes) ->
store the new full blocks asynchronously.

It works against anything with the store's public API (``register_namespace``, ``lookup``,
``get_into``, ``put``): the in-process :class:`kvstore.store.KVStore`, or a daemon client.
Stores run on a background thread: the engine never waits for one. When too many stores are in
flight the newest is dropped and counted (the cache is an optimisation; backpressure on the
engine would be worse than a miss later).

The cache never breaks the engine. A call that finds the store unreachable (the daemon down or
restarting: its refused connection is found at once, the client does not retry a refusal) or
slow (a load past ``timeout_s``: a daemon that accepts and hangs) opens a :class:`Breaker`: from
then on a load answers "no hit" and a store is dropped and counted, both at once and without
touching the network, while a background thread reconnects with exponential backoff. The first probe that
succeeds closes the breaker and hits resume by themselves (:class:`engine.breaker.Breaker`, the
one the vLLM connector and the SGLang backend use too).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.breaker import Breaker, unreachable
from engine.gpu import ArenaBlocks, HostBlocks
from engine.kvlayout import KVShape
from kvstore.errors import DaemonUnavailableError, KVStoreError, UsageError
from kvstore.keys import BlockHash, Namespace, hash_blocks

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ClientCounters:
    lookups: int = 0
    hit_blocks: int = 0
    lookups_skipped: int = 0
    """Loads answered "no hit" without a call: the store was unavailable (breaker open)."""
    load_errors: int = 0
    """Loads that failed (unreachable, timed out, or refused) and answered "no hit"."""
    stores_submitted: int = 0
    stores_done: int = 0
    stores_dropped: int = 0
    """Stores dropped because too many were in flight."""
    stores_skipped: int = 0
    """Stores dropped without a call: the store was unavailable (breaker open)."""
    store_errors: int = 0


_AUTO: Any = object()


class EngineCache:
    """One model's view of the store. Thread-safe for one engine thread plus the store thread.

    ``store``: the store (in-process, or a daemon client); or None with ``connect``, a function
    that makes one (``lambda: kvstore.client.connect(url)``), called in the background until it
    succeeds, so an engine may start before its daemon. ``timeout_s``: how long a load may take,
    plus its bytes at ``min_load_gbps``, before the engine goes on without it and the store
    counts as down (default: 1 s for a daemon client; no limit for an in-process store, which
    has no network to hang on). ``backoff_s`` / ``max_backoff_s``: the reconnection backoff
    while the store is unavailable. ``background=False``: nothing reconnects by itself
    (tests call ``breaker.probe_now()``).
    """

    def __init__(
        self,
        store: Any,
        ns: Namespace,
        shape: KVShape,
        *,
        max_pending: int = 4,
        timeout_s: float | None = _AUTO,
        connect: Callable[[], Any] | None = None,
        backoff_s: float = 0.05,
        max_backoff_s: float = 5.0,
        min_load_gbps: float = 1.0,
        background: bool = True,
    ) -> None:
        if ns.block_bytes != shape.block_bytes:
            raise ValueError(f"namespace blocks are {ns.block_bytes} bytes, the KV shape's {shape.block_bytes}")
        if store is None and connect is None:
            raise UsageError("EngineCache needs a store, or connect= (a function that returns one)")
        self.store = store
        self.ns = ns
        self.shape = shape
        self._connect = connect
        self.counters = ClientCounters()
        self.breaker = Breaker(self._reconnect, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
                               background=background, name=f"kvstore ({getattr(store, 'url', 'store')})")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-store")
        self._slots = threading.BoundedSemaphore(max_pending)
        self._pin = torch.cuda.is_available()
        self._d2h: dict[torch.device, torch.cuda.Stream] = {}  # one copy-out stream per device
        self._timeout = timeout_s
        self._bytes_per_s = min_load_gbps * 1e9
        self._io: ThreadPoolExecutor | None = None
        self._leases = False
        if store is not None:
            self._adopt(store)
            try:
                store.register_namespace(ns)
            except (KVStoreError, OSError) as e:
                if not unreachable(e):
                    raise  # a layout mismatch, a bad token: the deployment's mistake, said now
                self.breaker.trip(e)
        else:
            self.breaker.trip(DaemonUnavailableError("not connected yet"))

    def _adopt(self, store: Any) -> None:
        self.store = store
        # Leases (zero-copy reads from the store's shared-memory arena) when the store offers
        # them; the first refusal (no arena tier first) switches to copies for good.
        self._leases = hasattr(store, "acquire")
        if self._timeout is _AUTO:
            self._timeout = 1.0 if hasattr(store, "url") else None
        if self._timeout is not None and self._io is None:
            self._io = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")

    def _reconnect(self) -> None:
        """The breaker's probe: (re)connect if need be and register the namespace again (a
        restarted daemon forgot it; idempotent otherwise)."""
        if self.store is None:
            assert self._connect is not None
            self._adopt(self._connect())
        self.store.register_namespace(self.ns)

    @property
    def available(self) -> bool:
        """Whether loads and stores go to the store now (the breaker is closed)."""
        return self.breaker.closed

    def hashes(self, tokens: Any) -> list[BlockHash]:
        return hash_blocks(self.ns, tokens)

    def _empty(self) -> HostBlocks:
        return HostBlocks(torch.empty((0, self.shape.block_bytes), dtype=torch.uint8))

    def load(self, hashes: list[BlockHash], max_blocks: int) -> ArenaBlocks | HostBlocks:
        """The leading cached blocks (at most ``max_blocks``). From an in-process store with a
        shared-memory arena they stay in the arena, held by a lease, and are copied straight to
        the device; otherwise they are copied into a host buffer (pinned when CUDA is present).
        The caller calls ``release()`` once its copies are done. Never raises for the store's
        sake: unavailable, slow or failing, the answer is "no hit"."""
        self.counters.lookups += 1
        max_blocks = min(max_blocks, len(hashes))
        if max_blocks <= 0:
            return self._empty()
        if not self.breaker.closed:
            self.counters.lookups_skipped += 1
            return self._empty()
        try:
            blocks = self._bounded(self._load, hashes[:max_blocks])
        except (KVStoreError, OSError) as e:
            self.counters.load_errors += 1
            if unreachable(e):
                self.breaker.trip(e)
            else:
                log.warning("load failed, treated as a miss: %s", e)
            return self._empty()
        self.counters.hit_blocks += blocks.num_blocks
        return blocks

    def _load(self, hashes: list[BlockHash]) -> ArenaBlocks | HostBlocks:
        if self._leases:
            try:
                return ArenaBlocks(self.store, self.store.acquire(self.ns, hashes))
            except UsageError as e:
                log.info("store has no arena to lease from (%s); loading by copy", e)
                self._leases = False
        buf = torch.empty((len(hashes), self.shape.block_bytes), dtype=torch.uint8, pin_memory=self._pin)
        n = self.store.get_into(self.ns, hashes, buf.view(-1).numpy())
        return HostBlocks(buf[:n])

    def _bounded(self, fn: Callable[[list[BlockHash]], ArenaBlocks | HostBlocks], hashes: list[BlockHash]) -> ArenaBlocks | HostBlocks:
        """``fn(hashes)``, given up after ``timeout_s`` (the call finishes on its own thread;
        a lease it returns late is given back)."""
        if self._io is None:
            return fn(hashes)
        assert self._timeout is not None  # _io is made only with a timeout
        limit = self._timeout + len(hashes) * self.shape.block_bytes / self._bytes_per_s
        fut = self._io.submit(fn, hashes)
        try:
            return fut.result(timeout=limit)
        except TimeoutError as e:
            fut.add_done_callback(_release_late)
            raise TimeoutError(f"a load of {len(hashes)} blocks took longer than {limit:.3g} s") from e

    def store_async(self, hashes: list[BlockHash], blocks: torch.Tensor, start: int,
                    tokens: Any | None = None, *, ready: Any = None,
                    done: Callable[[], None] | None = None) -> Future[int] | None:
        """Store ``blocks`` (``[m, block_bytes]`` uint8, blocks ``start..start+m-1`` of
        ``hashes``) in the background. Device tensors are copied to pinned host memory on a side
        stream first; the store thread waits for that copy, the engine does not. While the
        store is unavailable the blocks are dropped and counted (``stores_skipped``).
        ``tokens``: those blocks' token ids (CPU), sent along for the daemon's KV events.
        ``ready``: host ``blocks`` in a buffer the caller lends until ``done`` is called (a
        staging ring), with the event of the copy that fills them (True: already filled): they
        are stored from there, not copied again. ``done`` is called once the blocks are no
        longer read (stored, skipped or dropped), on any thread."""
        if blocks.shape[0] == 0:
            _done(done)
            return None
        if not self.breaker.closed:
            self.counters.stores_skipped += 1
            _done(done)
            return None
        if not self._slots.acquire(blocking=False):
            self.counters.stores_dropped += 1
            _done(done)
            return None
        if ready is not None:
            if blocks.device.type != "cpu":
                raise ValueError("store_async(ready=...) takes host blocks the caller copied itself")
            ready = None if ready is True else ready
        elif blocks.device.type == "cuda":
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
        return self._pool.submit(self._store, chain, blocks, start, ready, tokens, done)

    def _store(self, chain: list[BlockHash], blocks: torch.Tensor, start: int, ready: Any, tokens: Any = None,
               done: Callable[[], None] | None = None) -> int:
        try:
            if ready is not None:
                ready.synchronize()
            if not self.breaker.closed:  # it opened while this store waited its turn
                self.counters.stores_skipped += 1
                return 0
            n = self.store.put(self.ns, chain, blocks.view(-1).numpy(), start=start, tokens=tokens)
            self.counters.stores_done += 1
            return n
        except (KVStoreError, OSError) as e:
            # A prefix evicted between the load and this store, a full tier, the daemon gone:
            # the next request recomputes. Never the engine's problem.
            self.counters.store_errors += 1
            if unreachable(e):
                self.breaker.trip(e)
            else:
                log.warning("background store failed: %s", e)
            return 0
        finally:
            self._slots.release()
            if done is not None:
                done()

    def flush(self) -> None:
        """Wait for every store submitted so far (tests, shutdown)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self.breaker.close()
        self.flush()
        self._pool.shutdown(wait=True)
        if self._io is not None:
            self._io.shutdown(wait=False)


def _done(done: Callable[[], None] | None) -> None:
    if done is not None:
        done()


def _release_late(fut: Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().release()
