"""LMCache (``lmcache==0.5.6``) under the peer workload: its ``LMCacheEngine`` in this process.

The engine hashes the request's token ids into 256-token chunks itself and moves bytes
through a GPU connector. Its ``MockGPUConnector`` copies nothing, so :class:`CpuCopyConnector`
(below) does what a GPU connector does on a CPU: ``from_gpu`` copies the chunk's bytes from
the caller's buffer into LMCache's memory object, ``to_gpu`` copies them back out. With torch's
CPU build LMCache's CUDA ops do not load and the engine runs on the CPU device.

Backends (LRU, LMCache's default ``cache_policy``, everywhere):

* ``lmcache-cpu``: ``LocalCPUBackend``, ``max_local_cpu_size`` = the workload's capacity;
* ``lmcache-cpu-mt``: the same, its connector copying with kvstore's multi-threaded copy;
* ``lmcache-disk``: ``LocalDiskBackend`` under the bench's scratch directory,
  ``max_local_disk_size`` = the capacity, ``local_cpu`` off (the CPU pool is then only the
  allocator, sized for one request and two chunks);
* ``lmcache-redis``: ``RemoteBackend`` to a ``redis-server`` on loopback with ``maxmemory`` =
  the capacity (+5% and 16 MiB for Redis's own keys and allocator: with exactly the capacity it
  evicted chunks of cached requests) and ``allkeys-lru``, ``remote_serde = naive``,
  ``local_cpu`` off.

Disk and Redis writes run in LMCache's background; :meth:`store` waits until a lookup in that
backend finds the whole request (that wait is in the store figure; a request still not whole
after ``SETTLE_TIMEOUT_S`` is counted in ``unsettled_stores`` and its lookups then report the
missing tokens: at 4K Redis lost requests that way). With ``local_cpu`` off the
CPU pool only stages, and concurrent retrieves each take part of it and wait for the rest
(seen: 8 clients on Redis waited forever), so there one engine serves one call at a time, as
vLLM calls it from one thread per worker; the CPU backend's retrieves run concurrently.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.buffers import copy_pool
from tools.bench._peers.base import Adapter, PeerUnavailable
from tools.bench._peers.procs import redis_server
from tools.bench._peers.workload import Request, Workload

SETTLE_TIMEOUT_S = 60.0
CLOSE_WAIT_S = 30.0
GiB = float(1 << 30)


def _np_copy(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst, src)


def _pool_copy(dst: np.ndarray, src: np.ndarray) -> None:
    copy_pool().copy(((memoryview(dst), memoryview(src)),))


def _connector_class() -> type:
    import torch
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    def _bytes(memory_obj: Any) -> np.ndarray:
        return memory_obj.tensor.view(torch.uint8).view(-1).numpy()

    class CpuCopyConnector(GPUConnectorInterface):
        """LMCache's connector contract on the CPU: the caller's buffer is ``kv`` (flat bytes,
        ``token_bytes`` a token, chunks contiguous); one ``np.copyto`` each way (torch's
        ``copy_`` of bytes, which LMCache's own non-CUDA connectors use, at torch's default
        of one intra-op thread per core ran at a third to half its speed here: 0.7-0.9 against
        2.2-3.7 GB/s, and 1.1 against 1.9-2.4), or ``copy`` (the ``-mt`` variant: kvstore's
        multi-threaded copy)."""

        def __init__(self, kv_shape: tuple[int, ...], token_bytes: int,
                     copy: Callable[[np.ndarray, np.ndarray], None] = _np_copy) -> None:
            self.kv_shape, self.token_bytes, self.copy = kv_shape, token_bytes, copy

        def get_shape(self, num_tokens: int) -> torch.Size:
            layers, kv, _, heads, dim = self.kv_shape
            return torch.Size([layers, kv, num_tokens, heads, dim])

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            self.copy(_bytes(memory_obj), kw["kv"][start * self.token_bytes : end * self.token_bytes])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            self.copy(kw["kv"][start * self.token_bytes : end * self.token_bytes], _bytes(memory_obj))

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(m, s, e, **kw)

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(m, s, e, **kw)

        def initialize_kvcaches_ptr(self, **kw: Any) -> None:
            pass

    return CpuCopyConnector


class _LMCache(Adapter):
    backend = "LocalCPUBackend"  # where a stored request must be found before store returns
    serial = False  # one call at a time (the CPU pool only stages: see the module docstring)
    copy: Callable[[np.ndarray, np.ndarray], None] = staticmethod(_np_copy)

    def _config(self, w: Workload) -> dict[str, Any]:
        raise NotImplementedError

    def open(self, w: Workload) -> None:
        try:
            import lmcache
            import torch
            from lmcache.v1.cache_engine import LMCacheEngineBuilder
            from lmcache.v1.config import LMCacheEngineConfig
            from lmcache.v1.metadata import LMCacheMetadata
        except ImportError as e:
            raise PeerUnavailable(f"lmcache is not installed ({e}); run make bench-peers") from e
        self.w, self._torch, self._builder = w, torch, LMCacheEngineBuilder
        self._version = getattr(lmcache, "__version__", "?")
        self._stack = ExitStack()
        self._dir = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="peers-lmcache-", dir=w.scratch)))
        g = w.geometry
        self._id = f"peers-{type(self).__name__}"
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=g.chunk_tokens, lmcache_instance_id=self._id,
                                                save_unfull_chunk=False, **self._config(w))
        shape = (g.layers, 2, g.chunk_tokens, g.kv_heads, g.head_dim)
        md = LMCacheMetadata(model_name="bench/peers-llama-8b", world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=shape, role="worker")
        conn = _connector_class()(shape, g.token_bytes, type(self).copy)
        self.engine = LMCacheEngineBuilder.get_or_create(self._id, cfg, md, conn, lambda t, r: None, lambda o, r: o)
        self.engine.post_init()
        self.unsettled = 0  # stores the backend did not hold within SETTLE_TIMEOUT_S
        self._lock: contextlib.AbstractContextManager[Any] = threading.Lock() if self.serial else contextlib.nullcontext()

    def _tokens(self, req: Request) -> Any:
        return self._torch.from_numpy(req.tokens.astype(np.int64))

    def store(self, req: Request, src: np.ndarray) -> None:
        tokens = self._tokens(req)
        with self._lock:
            self.engine.store(tokens, kv=src)
        if self.backend != "LocalCPUBackend":
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while self.engine.lookup(tokens, search_range=[self.backend]) < len(tokens):
                if time.monotonic() > deadline:  # lost on the way (Redis evicted it?): counted, and
                    self.unsettled += 1          # the lookups after report the missing tokens
                    return
                time.sleep(0.001)

    def lookup(self, req: Request) -> int:
        return int(self.engine.lookup(self._tokens(req)))

    def retrieve(self, req: Request, dst: np.ndarray) -> int:
        with self._lock:
            mask = self.engine.retrieve(self._tokens(req), kv=dst)
        return int(mask.sum())

    def close(self) -> None:
        # LMCache's RemoteBackend close was seen to hang for minutes: give it CLOSE_WAIT_S, then
        # go on (the child process exits with os._exit, so a stuck thread cannot hold it).
        t = threading.Thread(target=self._destroy, name="lmcache-destroy", daemon=True)
        t.start()
        t.join(CLOSE_WAIT_S)
        if t.is_alive():
            print(f"LMCache's engine did not close within {CLOSE_WAIT_S:.0f} s; going on", file=sys.stderr)
        self._stack.close()

    def _destroy(self) -> None:
        with contextlib.suppress(Exception):  # LMCache's own shutdown logs its errors
            self._builder.destroy(self._id)

    def info(self) -> dict[str, Any]:
        return {"lmcache_version": self._version, "unsettled_stores": self.unsettled}


class LocalCpu(_LMCache):
    def _config(self, w: Workload) -> dict[str, Any]:
        return {"local_cpu": True, "max_local_cpu_size": w.capacity_bytes / GiB}


class LocalCpuMt(LocalCpu):
    """``lmcache-cpu`` with the connector's copies split across threads by kvstore's
    ``CopyPool`` (``default_copy_threads()`` threads): what LMCache's CPU backend reaches with the same
    multi-threaded copy as kvstore. Not LMCache's own code (LMCache has no CPU copy-thread
    option); the goal rows compare against ``lmcache-cpu``."""

    copy = staticmethod(_pool_copy)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "copy_threads": copy_pool().threads}


def _staging(w: Workload) -> float:
    """The CPU pool when it is only the allocator: one request and two chunks, in GiB."""
    return (w.request_bytes + 2 * w.geometry.chunk_bytes) / GiB


class LocalDisk(_LMCache):
    backend = "LocalDiskBackend"
    serial = True

    def _config(self, w: Workload) -> dict[str, Any]:
        disk = self._dir / "disk"
        disk.mkdir()
        return {"local_cpu": False, "max_local_cpu_size": _staging(w), "local_disk": f"file://{disk}/",
                "max_local_disk_size": w.capacity_bytes / GiB}


class Redis(_LMCache):
    backend = "RemoteBackend"
    serial = True

    def _config(self, w: Workload) -> dict[str, Any]:
        port, self._listen = self._stack.enter_context(redis_server(w.capacity_bytes, self._dir))
        return {"local_cpu": False, "max_local_cpu_size": _staging(w), "remote_url": f"redis://127.0.0.1:{port}",
                "remote_serde": "naive"}

    def info(self) -> dict[str, Any]:
        return {**super().info(), "listening": self._listen}
