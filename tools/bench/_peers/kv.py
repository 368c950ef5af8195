"""kvstore under the peer workload: in process, and through its daemon over shm and TCP.

Each has one DRAM tier of the workload's capacity with LRU eviction; a chunk is one block.
Through the daemon, puts and gets go in batches of at most ``BATCH_BYTES`` (16 chunks of this
geometry: the daemon's staging segment and frame limits are 512 MiB and 1 GiB), as an engine
would send a long prompt. Over shared memory a get is a lease on the blocks while they are
copied, and a tenant's leases together may hold at most the arena (``max_lease_fraction``), so
there gets go in batches that let every concurrent client hold one at once (capacity / clients;
8 chunks at 4K tokens): with whole 512 MiB requests, 8 clients at once were refused with
QuotaExceededError.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.buffers import default_copy_threads
from kvstore.client import connect
from kvstore.client.spawn import LocalDaemon, start_daemon
from kvstore.config import StoreConfig, TierSpec
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks
from kvstore.store import KVStore
from tools.bench._peers.base import Adapter
from tools.bench._peers.workload import Request, Workload

BATCH_BYTES = 512 << 20

_TOML = """
[store]
policy = "lru"

[[tiers]]
name = "dram"
kind = "dram"
capacity_bytes = {capacity}
slab_bytes = {slab}

[server]
max_payload = "1GiB"
"""


def namespace(w: Workload) -> Namespace:
    g = w.geometry
    layout = KVLayout("bfloat16", g.chunk_tokens, (LayerGroup("full", g.layers, g.kv_heads, g.head_dim),))
    return Namespace("bench/peers-llama-8b", layout)


class _Hashing:
    """Chained xxh3 hashes of a request's chunks, computed in every call that needs them."""

    ns: Namespace

    def hashes(self, req: Request) -> list[bytes]:
        return hash_blocks(self.ns, req.tokens)  # type: ignore[return-value]


class InProcess(_Hashing, Adapter):
    """``KVStore`` in this process: one DRAM tier (a shared-memory arena), LRU."""

    def open(self, w: Workload) -> None:
        self.w = w
        self.ns = namespace(w)
        self._root = Path(tempfile.mkdtemp(prefix="peers-kvstore-", dir=w.scratch))
        opts = {"capacity_bytes": w.capacity_bytes, "slab_bytes": w.slab_bytes, "copy_threads": w.copy_threads}
        tiers = (TierSpec("dram", "dram", opts),)
        self.kv = KVStore(StoreConfig(root=self._root, tiers=tiers, persist_on_close=False, policy="lru"))
        self.kv.register_namespace(self.ns)

    def store(self, req: Request, src: np.ndarray) -> None:
        self.kv.put(self.ns, self.hashes(req), src)

    def lookup(self, req: Request) -> int:
        return self.kv.lookup(self.ns, self.hashes(req)).num_blocks * self.w.geometry.chunk_tokens

    def retrieve(self, req: Request, dst: np.ndarray) -> int:
        return self.kv.get_into(self.ns, self.hashes(req), dst) * self.w.geometry.chunk_tokens

    def info(self) -> dict[str, Any]:
        return {"copy_threads": self.w.copy_threads or default_copy_threads()}

    def close(self) -> None:
        self.kv.close()
        shutil.rmtree(self._root, ignore_errors=True)


class _Daemon(_Hashing, Adapter):
    """A kvstore daemon on loopback (its own process, one DRAM tier, LRU) and a client."""

    plane = "auto"

    def open(self, w: Workload) -> None:
        self.w = w
        self.ns = namespace(w)
        self._tmp = Path(tempfile.mkdtemp(prefix="peers-daemon-", dir=w.scratch))
        cfg = self._tmp / "kvstore.toml"
        cfg.write_text(_TOML.format(capacity=w.capacity_bytes, slab=w.slab_bytes))
        self._daemon: LocalDaemon = start_daemon(self._tmp / "store", cfg)
        self._batch = max(1, BATCH_BYTES // w.geometry.chunk_bytes)
        self._get_batch = self._batch
        if self.plane == "shm":
            self._get_batch = max(1, min(self._batch, w.capacity_bytes // (w.clients * w.geometry.chunk_bytes)))
        self.c = self._connect()

    def _connect(self) -> Any:
        c = connect(self._daemon.url, plane=self.plane)
        if c.plane != self.plane:
            raise RuntimeError(f"asked for the {self.plane} plane, the client uses {c.plane!r}")
        return c

    def store(self, req: Request, src: np.ndarray) -> None:
        hashes, cb, b = self.hashes(req), self.w.geometry.chunk_bytes, self._batch
        for s in range(0, len(hashes), b):
            e = min(s + b, len(hashes))
            self.c.put(self.ns, hashes[:e], src[s * cb : e * cb], start=s)

    def lookup(self, req: Request) -> int:
        return self.c.lookup(self.ns, self.hashes(req)).num_blocks * self.w.geometry.chunk_tokens

    def retrieve(self, req: Request, dst: np.ndarray) -> int:
        hashes, cb, b = self.hashes(req), self.w.geometry.chunk_bytes, self._get_batch
        got = 0
        for s in range(0, len(hashes), b):
            e = min(s + b, len(hashes))
            n = self.c.get_into(self.ns, hashes[s:e], dst[s * cb : e * cb])
            got += n
            if n < e - s:
                break
        return got * self.w.geometry.chunk_tokens

    def client(self) -> Adapter:
        other = object.__new__(type(self))
        other.w, other.ns, other._daemon = self.w, self.ns, self._daemon
        other._batch, other._get_batch = self._batch, self._get_batch
        other.c = other._connect()
        return other

    def close_client(self) -> None:
        self.c.close()

    def close(self) -> None:
        self.c.close()
        self._daemon.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)


class DaemonShm(_Daemon):
    """Through the daemon's shared-memory plane (a lease and one copy out of its arena; puts
    through a staging segment)."""

    plane = "shm"


class DaemonTcp(_Daemon):
    """Through the daemon's framed TCP plane on loopback."""

    plane = "tcp"
