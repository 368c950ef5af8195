"""The workload of the peer benchmark and the driver that times one store under it.

Geometry: Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB of K and V per token),
in chunks of 256 tokens (LMCache's default chunk; 32 MiB each): every store keys, stores and
loads whole chunks. A request of ``tokens`` tokens is one contiguous buffer of its chunks.

Phases, for one store at one request size (``drive``):

1. **store**: ``rounds`` rounds, each storing ``fit`` new requests (new token ids), so from round
   two on every store makes room by evicting the oldest (LRU, capacity equal for all
   stores: ``fit`` requests and two chunks of slack). Figure: bytes / time of the store calls.
2. **lookup**: each of the ``fit`` cached requests, ``lookups`` times; figure: the median
   latency; baseline: hashing the request's tokens (``kvstore.keys.hash_blocks``), the floor of
   any lookup.
3. **retrieve**: each cached request ``rounds`` times into a zeroed buffer; every chunk is
   checked against the xxh3 digest taken when it was stored. Figure: bytes / time.
4. **concurrent**: ``clients`` threads, each with its own client handle, retrieve the cached
   requests round robin; figure: the p99 latency of one retrieve; baseline: the median latency
   of one retrieve alone (phase 3). Skipped for a store that serves one call at a time
   (``Adapter.serial``): its p99 would be the queue.

A memcpy of the same bytes is timed between the rounds of phases 1 and 3 in the same process:
the baseline of the store and retrieve figures, one thread (``np.copyto``) and, beside it, the
same bytes cut into ``memcpy_threads`` equal parts that as many threads ``memmove`` at once
(``memcpy_mt_gbps``; ``default_copy_threads()`` threads, the count a kvstore DRAM tier copies with by
default), so that a store that copies with several threads is read against both. Bytes are random (one random tile repeated)
with each chunk stamped with its request and chunk number, so a chunk served for the wrong
request or at the wrong place fails the check.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvstore.buffers import default_copy_threads
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks

if TYPE_CHECKING:
    from tools.bench._peers.base import Adapter

MiB = 1 << 20
TILE = 64 * MiB  # random bytes repeated over a request (generating 4 GiB would take seconds)
MEMCPY_BYTES = 512 * MiB  # the memcpy baseline's size (GB/s does not change past the caches)


@dataclass(frozen=True, slots=True)
class Geometry:
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2  # bf16
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "dtype_bytes", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"geometry: {name} must be > 0, got {getattr(self, name)}")

    @property
    def token_bytes(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.token_bytes * self.chunk_tokens


@dataclass(frozen=True, slots=True)
class Workload:
    tokens: int
    """Tokens per request (a multiple of the chunk)."""
    fit: int
    """Requests the capacity holds; each store round stores this many new ones."""
    rounds: int = 3
    lookups: int = 10
    clients: int = 8
    per_client: int = 2
    """Retrieves per client in the concurrent phase."""
    concurrent: bool = True
    """Run the concurrent phase (off: the rows say it was not run)."""
    geometry: Geometry = field(default_factory=Geometry)
    scratch: str = "."
    """A directory on the disk for stores that write files (LMCache's disk backend)."""
    copy_threads: int = 0
    """kvstore's DRAM tier ``copy_threads`` (0: its default, ``default_copy_threads()``)."""

    def __post_init__(self) -> None:
        ct = self.geometry.chunk_tokens
        if self.tokens <= 0 or self.tokens % ct:
            raise ValueError(f"tokens per request must be a positive multiple of {ct}, got {self.tokens}")
        for name in ("fit", "rounds", "lookups", "clients", "per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def chunks(self) -> int:
        return self.tokens // self.geometry.chunk_tokens

    @property
    def request_bytes(self) -> int:
        return self.tokens * self.geometry.token_bytes

    @property
    def slab_bytes(self) -> int:
        """kvstore's DRAM slab size: 8 chunks (the capacity is rounded up to whole slabs)."""
        return 8 * self.geometry.chunk_bytes

    @property
    def capacity_bytes(self) -> int:
        """Room every store gets: ``fit`` requests and two chunks, in whole kvstore slabs."""
        want = self.fit * self.request_bytes + 2 * self.geometry.chunk_bytes
        return -(-want // self.slab_bytes) * self.slab_bytes


@dataclass(frozen=True, slots=True)
class Request:
    rid: int
    tokens: np.ndarray  # int32 token ids


def make_request(w: Workload, rid: int) -> Request:
    """Request ``rid``: token ids no other request shares (so no two requests share a prefix)."""
    rng = np.random.default_rng(1_000_003 + rid)
    return Request(rid, rng.integers(0, 1 << 30, w.tokens, dtype=np.int32))


def make_buffer(w: Workload) -> np.ndarray:
    """A request-sized buffer of random bytes (one random tile, repeated), faulted in."""
    buf = np.empty(w.request_bytes, np.uint8)
    tile = np.random.default_rng(7).integers(0, 256, min(TILE, buf.nbytes), dtype=np.uint8)
    for off in range(0, buf.nbytes, tile.nbytes):
        n = min(tile.nbytes, buf.nbytes - off)
        buf[off : off + n] = tile[:n]
    return buf


def stamp(w: Workload, buf: np.ndarray, rid: int) -> list[int]:
    """Write request ``rid``'s stamp at the start of every chunk; returns the chunk digests."""
    cb = w.geometry.chunk_bytes
    for c in range(w.chunks):
        buf[c * cb : c * cb + 16] = np.array([rid, c], np.uint64).view(np.uint8)
    return digests(w, buf, w.chunks)


def digests(w: Workload, buf: np.ndarray, chunks: int) -> list[int]:
    cb = w.geometry.chunk_bytes
    return [xxhash.xxh3_64_intdigest(memoryview(buf[c * cb : (c + 1) * cb])) for c in range(chunks)]


def memcpy_gbps(src: np.ndarray, scratch: np.ndarray) -> float:
    """GB/s of one ``np.copyto`` of ``scratch.nbytes`` bytes (both buffers faulted in already)."""
    t0 = time.perf_counter()
    np.copyto(scratch, src[: scratch.nbytes])
    return scratch.nbytes / 1e9 / (time.perf_counter() - t0)


class MtMemcpy:
    """A memcpy by ``threads`` threads of a pool started once: each moves one equal part."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="peers-memcpy")

    def gbps(self, src: np.ndarray, scratch: np.ndarray) -> float:
        n, k = scratch.nbytes, self.threads
        cuts = [i * n // k for i in range(k + 1)]
        d, s = scratch.ctypes.data, src.ctypes.data
        t0 = time.perf_counter()
        futures = [self._pool.submit(ctypes.memmove, d + a, s + a, b - a) for a, b in zip(cuts, cuts[1:], strict=False)]
        for f in futures:
            f.result()
        return n / 1e9 / (time.perf_counter() - t0)

    def close(self) -> None:
        self._pool.shutdown()


def percentile(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q))


@dataclass
class Figures:
    """What :func:`drive` measured for one store at one request size (times in seconds)."""

    store_bytes: int = 0
    store_s: float = 0.0
    store_lat: list[float] = field(default_factory=list)
    """Seconds of each store call (one request), in order: paired runs compare them one by one."""
    first_round_gbps: float = 0.0
    retrieve_bytes: int = 0
    retrieve_s: float = 0.0
    retrieve_lat: list[float] = field(default_factory=list)
    lookup_lat: list[float] = field(default_factory=list)
    hash_lat: list[float] = field(default_factory=list)
    concurrent_lat: list[float] = field(default_factory=list)
    memcpy_gbps: list[float] = field(default_factory=list)
    memcpy_mt_gbps: list[float] = field(default_factory=list)
    memcpy_threads: int = 1
    missing_tokens: int = 0
    """Tokens of cached requests that a lookup or retrieve did not find (should be 0)."""
    wrong_chunks: int = 0
    """Chunks whose bytes differ from what was stored (must be 0)."""
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        """The figures: GB/s, ms; the rows of the bench are built from these."""
        ms = 1e3
        return {
            "store_gbps": self.store_bytes / 1e9 / self.store_s if self.store_s else 0.0,
            "first_round_gbps": self.first_round_gbps,
            "retrieve_gbps": self.retrieve_bytes / 1e9 / self.retrieve_s if self.retrieve_s else 0.0,
            "memcpy_gbps": statistics.median(self.memcpy_gbps) if self.memcpy_gbps else 0.0,
            "memcpy_mt_gbps": statistics.median(self.memcpy_mt_gbps) if self.memcpy_mt_gbps else 0.0,
            "memcpy_threads": self.memcpy_threads,
            "lookup_ms": statistics.median(self.lookup_lat) * ms if self.lookup_lat else 0.0,
            "hash_ms": statistics.median(self.hash_lat) * ms if self.hash_lat else 0.0,
            "retrieve_p50_ms": statistics.median(self.retrieve_lat) * ms if self.retrieve_lat else 0.0,
            "concurrent_p50_ms": statistics.median(self.concurrent_lat) * ms if self.concurrent_lat else 0.0,
            "concurrent_p99_ms": percentile(self.concurrent_lat, 99) * ms if self.concurrent_lat else 0.0,
        }


def drive(adapter: Adapter, w: Workload) -> Figures:
    """Run the four phases (module docstring) against an opened ``adapter``."""
    f = Figures(memcpy_threads=default_copy_threads())
    mt = MtMemcpy(f.memcpy_threads)
    try:
        return _drive(adapter, w, f, mt)
    finally:
        mt.close()


def _drive(adapter: Adapter, w: Workload, f: Figures, mt: MtMemcpy) -> Figures:
    g = w.geometry
    buf = make_buffer(w)
    scratch = np.empty(min(MEMCPY_BYTES, w.request_bytes), np.uint8)
    scratch.fill(1)
    sums: dict[int, list[int]] = {}
    rid = 0
    cached: list[Request] = []
    for rnd in range(w.rounds):
        round_bytes, round_s = 0, 0.0
        cached = []
        for _ in range(w.fit):
            req = make_request(w, rid)
            rid += 1
            sums[req.rid] = stamp(w, buf, req.rid)
            t0 = time.perf_counter()
            adapter.store(req, buf)
            dt = time.perf_counter() - t0
            f.store_lat.append(dt)
            round_s += dt
            round_bytes += w.request_bytes
            cached.append(req)
        f.store_bytes += round_bytes
        f.store_s += round_s
        if rnd == 0:
            f.first_round_gbps = round_bytes / 1e9 / round_s
        f.memcpy_gbps.append(memcpy_gbps(buf, scratch))
        f.memcpy_mt_gbps.append(mt.gbps(buf, scratch))

    ns = Namespace("bench/peers-floor", KVLayout("bfloat16", g.chunk_tokens, (LayerGroup("full", g.layers, g.kv_heads, g.head_dim),)))
    for _ in range(w.lookups):
        for req in cached:
            t0 = time.perf_counter()
            hash_blocks(ns, req.tokens)
            f.hash_lat.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            hit = adapter.lookup(req)
            f.lookup_lat.append(time.perf_counter() - t0)
            if hit != w.tokens:
                f.missing_tokens += w.tokens - hit
                f.errors.append(f"lookup of request {req.rid}: {hit} of {w.tokens} tokens cached")

    for _ in range(w.rounds):
        for req in cached:
            buf.fill(0)
            t0 = time.perf_counter()
            got = adapter.retrieve(req, buf)
            dt = time.perf_counter() - t0
            f.retrieve_s += dt
            f.retrieve_lat.append(dt)
            f.retrieve_bytes += got * g.token_bytes
            _check(w, f, req, buf, got, sums[req.rid])
        f.memcpy_gbps.append(memcpy_gbps(buf, scratch))
        f.memcpy_mt_gbps.append(mt.gbps(buf, scratch))

    del scratch
    if w.concurrent and not adapter.serial:
        _concurrent(adapter, w, f, cached, buf, sums)
    return f


def _check(w: Workload, f: Figures, req: Request, buf: np.ndarray, got: int, want: list[int]) -> None:
    if got != w.tokens:
        f.missing_tokens += w.tokens - got
        f.errors.append(f"retrieve of request {req.rid}: {got} of {w.tokens} tokens loaded")
    n = got // w.geometry.chunk_tokens
    bad = sum(a != b for a, b in zip(digests(w, buf, n), want[:n], strict=True))
    if bad:
        f.wrong_chunks += bad
        f.errors.append(f"retrieve of request {req.rid}: {bad} of {n} chunks hold other bytes")


def _concurrent(adapter: Adapter, w: Workload, f: Figures, cached: list[Request], buf: np.ndarray,
                sums: dict[int, list[int]]) -> None:
    """``clients`` threads retrieve the cached requests round robin. Request ``k`` always lands
    in buffer ``k``: clients that load the same request at once write the same bytes, so each
    buffer can be checked after."""
    dsts = [buf] + [np.zeros(w.request_bytes, np.uint8) for _ in cached[1:]]
    for d in dsts:
        d.fill(0)
    handles = [adapter.client() for _ in range(w.clients)]
    start = threading.Barrier(w.clients)
    lat: list[list[float]] = [[] for _ in range(w.clients)]
    got: list[list[tuple[int, int]]] = [[] for _ in range(w.clients)]
    errors: list[str] = []

    def client(i: int) -> None:
        h = handles[i]
        try:
            start.wait()
            for j in range(w.per_client):
                k = (i + j) % len(cached)
                t0 = time.perf_counter()
                n = h.retrieve(cached[k], dsts[k])
                lat[i].append(time.perf_counter() - t0)
                got[i].append((k, n))
        except Exception as e:  # counted and reported: the figure is how it went under load
            errors.append(f"client {i}: {type(e).__name__}: {e}")
            start.abort()

    threads = [threading.Thread(target=client, args=(i,), name=f"peer-client-{i}") for i in range(w.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h in handles:
        if h is not adapter:
            h.close_client()
    f.errors.extend(errors)
    f.concurrent_lat = [x for per in lat for x in per]
    loaded = [min((n for ks in got for k2, n in ks if k2 == k), default=-1) for k in range(len(cached))]
    for k, n in enumerate(loaded):
        if n >= 0:
            _check(w, f, cached[k], dsts[k], n, sums[cached[k].rid])


def _rotated(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


def drive_paired(adapters: dict[str, Adapter], w: Workload) -> dict[str, Figures]:
    """The phases of :func:`drive` for several opened stores at once, interleaved: each request
    is stored into every store, then each cached request is retrieved from every store, the
    order rotating by one store per request, so that every store's call of a request runs
    within moments of the others' (a neighbour's load hits them alike; run one after another,
    the stores saw memcpy speeds 1.5x apart). The concurrent phase runs store after store."""
    figs = {n: Figures(memcpy_threads=default_copy_threads()) for n in adapters}
    mt = MtMemcpy(default_copy_threads())
    try:
        _drive_paired(adapters, w, figs, mt)
    finally:
        mt.close()
    return figs


def _drive_paired(adapters: dict[str, Adapter], w: Workload, figs: dict[str, Figures], mt: MtMemcpy) -> None:
    g, names = w.geometry, list(adapters)
    buf = make_buffer(w)
    scratch = np.empty(min(MEMCPY_BYTES, w.request_bytes), np.uint8)
    scratch.fill(1)
    sums: dict[int, list[int]] = {}
    cached: list[Request] = []

    def baselines(scratch: np.ndarray) -> None:
        one, many = memcpy_gbps(buf, scratch), mt.gbps(buf, scratch)
        for f in figs.values():
            f.memcpy_gbps.append(one)
            f.memcpy_mt_gbps.append(many)

    k = 0
    for rnd in range(w.rounds):
        cached = []
        round_s = dict.fromkeys(names, 0.0)
        for _ in range(w.fit):
            req = make_request(w, k)
            sums[req.rid] = stamp(w, buf, req.rid)
            for n in _rotated(names, k):
                t0 = time.perf_counter()
                adapters[n].store(req, buf)
                dt = time.perf_counter() - t0
                figs[n].store_lat.append(dt)
                round_s[n] += dt
            k += 1
            cached.append(req)
        for n, f in figs.items():
            f.store_bytes += w.fit * w.request_bytes
            f.store_s += round_s[n]
            if rnd == 0:
                f.first_round_gbps = w.fit * w.request_bytes / 1e9 / round_s[n]
        baselines(scratch)

    ns = Namespace("bench/peers-floor", KVLayout("bfloat16", g.chunk_tokens, (LayerGroup("full", g.layers, g.kv_heads, g.head_dim),)))
    for _ in range(w.lookups):
        for req in cached:
            t0 = time.perf_counter()
            hash_blocks(ns, req.tokens)
            hash_s = time.perf_counter() - t0
            for n in names:
                f = figs[n]
                f.hash_lat.append(hash_s)
                t0 = time.perf_counter()
                hit = adapters[n].lookup(req)
                f.lookup_lat.append(time.perf_counter() - t0)
                if hit != w.tokens:
                    f.missing_tokens += w.tokens - hit
                    f.errors.append(f"lookup of request {req.rid}: {hit} of {w.tokens} tokens cached")

    k = 0
    for _ in range(w.rounds):
        for req in cached:
            for n in _rotated(names, k):
                f = figs[n]
                buf.fill(0)
                t0 = time.perf_counter()
                got = adapters[n].retrieve(req, buf)
                dt = time.perf_counter() - t0
                f.retrieve_s += dt
                f.retrieve_lat.append(dt)
                f.retrieve_bytes += got * g.token_bytes
                _check(w, f, req, buf, got, sums[req.rid])
            k += 1
        baselines(scratch)

    del scratch
    for n in names:
        if w.concurrent and not adapters[n].serial:
            _concurrent(adapters[n], w, figs[n], cached, buf, sums)
