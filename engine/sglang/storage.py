"""``KVStoreHiCache``: kvstore as SGLang's HiCache storage backend (the L3 under its host pool).

Load it with ``--hicache-storage-backend dynamic`` and::

    --hicache-storage-backend-extra-config '{"backend_name": "kvstore", "module_path":
        "engine.sglang.storage", "class_name": "KVStoreHiCache", "url": "http://127.0.0.1:7070"}'

SGLang names each page by a string key that already chains the whole prefix (a hash of the
page's tokens and its parent's key). A key becomes a kvstore block hash as
``xxh3_128(namespace root || key)``: the namespace (model, TP rank unless MLA, page format)
keeps deployments apart, as HiCacheFile's key suffixes do. ``batch_set_v1`` stores the pages of
one sequence as one chain (with ``extra_info.prefix_keys`` the chain continues its prefix), so
the daemon's prefix-closed index and eviction see SGLang's prefixes.

Every call goes through the circuit breaker of ``engine.breaker``: with the daemon down or
slow, lookups answer "not there" at once, reads fail (SGLang recomputes) and writes are dropped;
the breaker reconnects in the background.

Token ids for KV events. SGLang's storage calls carry no tokens, but the backup operation
that makes them does (``StorageOperation.token_ids``). With ``"token_ids": true`` in the extra
config (or inside ``with send_token_ids():``) the backend wraps ``HiCacheController._page_backup``
so that each write of its pages sends their token ids with the put (4 bytes a token); the daemon's
KV events then carry them in ``BlockStored.token_ids``, as vLLM's do. A caller may also pass them
itself: ``extra_info.extra_info["token_ids"]``, the tokens of the call's pages.

Differences from HiCacheFile, by design: a read returns the leading pages that are present
(kvstore is prefix-closed: a page whose parent was evicted is not served); pools other than the
KV pool (Mamba, SWA and DeepSeek sidecars of ``*_v2``) are answered as misses.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from engine.breaker import DaemonLink
from kvstore.client import Client, connect
from kvstore.errors import ConfigError, KVStoreError, MissingPrefixError
from kvstore.keys import DTYPE_BYTES, BlockHash, KVLayout, LayerGroup, Namespace

log = logging.getLogger("kvstore.sglang")

_KEYS = ("backend_name", "module_path", "class_name", "url", "token", "plane", "timeout_s", "ttl_s",
         "model_id", "backoff_s", "max_backoff_s", "token_ids")

_backup = threading.local()
"""The backup operation whose pages this thread is writing (``_page_backup`` under
:func:`send_token_ids`): where a write finds its pages' token ids."""


def _with_operation(page_backup: Any) -> Any:
    def wrapper(self: Any, operation: Any) -> Any:
        _backup.op = operation
        try:
            return page_backup(self, operation)
        finally:
            _backup.op = None

    wrapper.kvstore_original = page_backup  # type: ignore[attr-defined]  # a marker on the wrapper function
    return wrapper


def _install() -> Any:
    """Wrap ``HiCacheController._page_backup`` (once); the function it replaced, or None."""
    from sglang.srt.managers.cache_controller import HiCacheController

    original = HiCacheController._page_backup
    if hasattr(original, "kvstore_original"):
        return None
    HiCacheController._page_backup = _with_operation(original)  # type: ignore[method-assign, unused-ignore]  # patched on purpose; Any without sglang
    return original


@contextlib.contextmanager
def send_token_ids() -> Iterator[None]:
    """Within: SGLang's backups of host pages send the pages' token ids with each write (the
    ``"token_ids": true`` extra config installs the same for the process's life)."""
    from sglang.srt.managers.cache_controller import HiCacheController

    original = _install()
    try:
        yield
    finally:
        if original is not None:
            HiCacheController._page_backup = original  # type: ignore[method-assign, unused-ignore]  # as above


def _page_tokens(keys: Sequence[str], extra_info: Any, page_tokens: int) -> Any:
    """The token ids of the pages ``keys`` (``page_tokens`` each), or None: the caller's
    (``extra_info.extra_info["token_ids"]``), else the backup operation's that is writing them."""
    given = getattr(extra_info, "extra_info", None) or {}
    tokens = given.get("token_ids")
    if tokens is None:
        op = getattr(_backup, "op", None)
        hashes = getattr(op, "hash_value", None) or []
        if not keys or keys[0] not in hashes:
            return None
        i = hashes.index(keys[0])
        tokens = op.token_ids[i * page_tokens:(i + len(keys)) * page_tokens]  # type: ignore[union-attr]  # op is set: hashes is not empty
    return tokens if len(tokens) == len(keys) * page_tokens else None


def _host_layout(pool: Any) -> KVLayout | None:
    """The KV layout of an MHA host pool (its page is ``[layers][K, V][page][heads][dim]``)."""
    names = ("page_size", "layer_num", "head_num", "head_dim", "dtype")
    if not all(hasattr(pool, n) for n in names):
        return None
    dtype = str(pool.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        return None
    return KVLayout(dtype, int(pool.page_size), (LayerGroup("full", int(pool.layer_num), int(pool.head_num), int(pool.head_dim)),))


def _opaque_layout(page_bytes: int, page_size: int) -> KVLayout:
    """Pages of another shape (MLA, a packed pool): described only by their size."""
    per_token = page_bytes // max(page_size, 1)
    if per_token * page_size != page_bytes or per_token % 2:
        return KVLayout("uint8", 1, (LayerGroup("full", 1, 1, page_bytes // 2),))
    return KVLayout("uint8", page_size, (LayerGroup("full", 1, 1, per_token // 2),))


class KVStoreHiCache(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a kvstore daemon (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - set(_KEYS))
        if unknown:
            raise ConfigError(
                f"hicache storage extra config has unknown key(s) {', '.join(unknown)}; "
                f"kvstore's backend knows {', '.join(_KEYS[3:])}"
            )
        self.config = storage_config
        self.url = str(extra.get("url") or "http://127.0.0.1:7070")
        self.model_id = str(extra.get("model_id") or storage_config.model_name or "sglang")
        try:
            timeout = float(extra.get("timeout_s", 2.0))
            self.ttl_s = float(extra["ttl_s"]) if "ttl_s" in extra else None
            backoff, max_backoff = float(extra.get("backoff_s", 0.5)), float(extra.get("max_backoff_s", 10.0))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"hicache storage extra config: timeout_s, ttl_s and backoff_s are seconds ({e})") from e
        token, plane = extra.get("token"), str(extra.get("plane", "auto"))
        # MLA KV is the same on every TP rank: one copy, written by the storage writer.
        self.shared = bool(storage_config.is_mla_model)
        self.writer = storage_config.is_storage_writer
        self.ns: Namespace | None = None
        self._root = b""
        self._namespaces: list[Namespace] = []

        def make() -> Client:
            return connect(self.url, token=token, plane=plane, timeout=timeout, retries=0)

        def on_connect(client: Client) -> None:
            for ns in self._namespaces:
                client.register_namespace(ns, self.ttl_s)

        self.link: DaemonLink[Client] = DaemonLink(
            make, name="kvstore-hicache", on_connect=on_connect, backoff_s=backoff, max_backoff_s=max_backoff,
        )
        if extra.get("token_ids"):
            try:
                _install()
            except ImportError as e:
                raise ConfigError(
                    f"hicache storage extra config token_ids: SGLang's HiCacheController cannot be imported "
                    f"({e}); install SGLang's full dependencies, or drop token_ids (the KV events then "
                    "carry no token ids)"
                ) from e
        self.counters = {"hit_pages": 0, "miss_pages": 0, "stored_pages": 0, "dropped_pages": 0, "errors": 0}

    # -- namespace ----------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        layout = _host_layout(mem_pool_host)
        if layout is not None:
            self._set_layout(layout)

    def _set_layout(self, layout: KVLayout) -> None:
        cfg = self.config
        rank, world = (0, 1) if self.shared else (cfg.tp_rank, cfg.tp_size)
        if cfg.pp_size > 1:  # each stage holds its own layers
            rank, world = rank * cfg.pp_size + cfg.pp_rank, world * cfg.pp_size
        ns = Namespace(self.model_id, layout, model_revision="sglang-hicache1", rank=rank, world_size=world)
        self.ns, self._root = ns, bytes(ns.root)
        self._namespaces = [ns]
        self.link.call(lambda c: c.register_namespace(ns, self.ttl_s), None)
        log.info("kvstore hicache: namespace %s (%s, %d bytes per page)", self._root.hex()[:16], self.model_id, ns.block_bytes)

    def _ensure_ns(self, page_bytes: int) -> Namespace:
        if self.ns is None:
            page_size = int(getattr(getattr(self, "mem_pool_host", None), "page_size", 1) or 1)
            self._set_layout(_opaque_layout(page_bytes, page_size))
        assert self.ns is not None
        if self.ns.block_bytes != page_bytes:
            raise KVStoreError(f"a page of {page_bytes} bytes in a namespace of {self.ns.block_bytes}-byte pages")
        return self.ns

    def _hashes(self, keys: Sequence[str]) -> list[BlockHash]:
        root = self._root
        return [BlockHash(xxhash.xxh3_128_digest(root + k.encode())) for k in keys]

    # -- the byte-level interface -------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading keys present: one lookup RPC."""
        if self.ns is None or not keys:
            return 0
        ns, hashes = self.ns, self._hashes(keys)
        return self.link.call(lambda c: c.lookup(ns, hashes).num_blocks, 0)

    def _get_into(self, keys: Sequence[str], bufs: list[Any], page_bytes: int) -> int:
        try:
            ns = self._ensure_ns(page_bytes)
        except KVStoreError:
            return 0
        hashes = self._hashes(keys)
        try:
            n = self.link.call(lambda c: c.get_into(ns, hashes, bufs), 0)
        except KVStoreError as e:
            self.counters["errors"] += 1
            log.warning("kvstore hicache read failed: %s", e)
            n = 0
        self.counters["hit_pages"] += n
        self.counters["miss_pages"] += len(keys) - n
        return n

    def _put(self, keys: Sequence[str], srcs: list[Any], page_bytes: int, prefix: Sequence[str] = (),
             extra_info: Any = None) -> bool:
        if not keys:
            return True
        if not self.writer:
            return True  # MLA: another rank writes the shared copy
        try:
            ns = self._ensure_ns(page_bytes)
        except KVStoreError:
            return False
        chain = self._hashes([*prefix, *keys])
        start = len(prefix)
        tokens = _page_tokens(keys, extra_info, ns.block_tokens)
        try:
            try:
                ok = self.link.call(lambda c: c.put(ns, chain, srcs, start=start, tokens=tokens), -1) >= 0
            except MissingPrefixError:  # the prefix left the store: keep these pages as their own chain
                ok = self.link.call(lambda c: c.put(ns, chain[start:], srcs, start=0, tokens=tokens), -1) >= 0
        except KVStoreError as e:
            self.counters["errors"] += 1
            log.warning("kvstore hicache write failed: %s", e)
            ok = False
        self.counters["stored_pages" if ok else "dropped_pages"] += len(keys)
        return ok

    @staticmethod
    def _bytes(t: torch.Tensor) -> Any:
        return t.contiguous().view(-1).view(torch.uint8).numpy()

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        out = self.batch_get([key], None if target_location is None else [target_location])
        return out[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[torch.Tensor | None]:
        if not keys:
            return []
        if target_locations is None:
            if self.ns is None:
                return [None] * len(keys)
            target_locations = [torch.empty(self.ns.block_bytes, dtype=torch.uint8) for _ in keys]
        page_bytes = target_locations[0].numel() * target_locations[0].element_size()
        n = self._get_into(keys, [t.view(-1).view(torch.uint8).numpy() for t in target_locations], page_bytes)
        return [t if i < n else None for i, t in enumerate(target_locations)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store ``values`` as one chain (SGLang passes the consecutive pages of one sequence)."""
        if not keys:
            return True
        page_bytes = values[0].numel() * values[0].element_size()
        return self._put(keys, [self._bytes(v) for v in values], page_bytes)

    # -- zero-copy into / out of the host pool ------------------------------------------------------

    def _page_views(self, pool: Any, host_indices: torch.Tensor, n: int) -> tuple[list[Any], int] | None:
        """Each page's own memory in a page-first host pool (None for other layouts)."""
        if getattr(pool, "layout", None) not in ("page_first", "page_first_direct"):
            return None
        meta = pool.get_page_buffer_meta(host_indices)
        if meta is None:
            return None
        ptrs, sizes = meta
        if len(ptrs) != n:
            return None
        views = [memoryview((ctypes.c_char * int(s)).from_address(int(p))).cast("B") for p, s in zip(ptrs, sizes, strict=True)]
        return views, int(sizes[0])

    def _page_offsets(self, pool: Any, host_indices: torch.Tensor, n: int) -> list[int]:
        page = int(getattr(pool, "page_size", 1) or 1)
        return [int(host_indices[i * page].item()) for i in range(n)]

    def _get_pages(self, pool: Any, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        n = len(keys)
        if n == 0:
            return []
        direct = self._page_views(pool, host_indices, n)
        if direct is not None:
            views, page_bytes = direct
            got = self._get_into(keys, views, page_bytes)
        else:
            dummy = pool.get_dummy_flat_data_page()
            staging = [torch.empty_like(dummy) for _ in range(n)]
            got = self._get_into(keys, [self._bytes(s) for s in staging], dummy.numel() * dummy.element_size())
            for off, page in zip(self._page_offsets(pool, host_indices, n)[:got], staging, strict=False):
                pool.set_from_flat_data_page(off, page)
        return [i < got for i in range(n)]

    def _set_pages(self, pool: Any, keys: list[str], host_indices: torch.Tensor, extra_info: Any) -> list[bool]:
        n = len(keys)
        if n == 0:
            return []
        prefix = list(getattr(extra_info, "prefix_keys", None) or [])
        direct = self._page_views(pool, host_indices, n)
        if direct is not None:
            srcs, page_bytes = direct
        else:
            pages = [pool.get_data_page(off, flat=True) for off in self._page_offsets(pool, host_indices, n)]
            srcs, page_bytes = [self._bytes(p) for p in pages], pages[0].numel() * pages[0].element_size()
        return [self._put(keys, srcs, page_bytes, prefix, extra_info)] * n

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._get_pages(self.mem_pool_host, keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._set_pages(self.mem_pool_host, keys, host_indices, extra_info)

    # -- the pool-aware (v2) interface: the KV pool only ---------------------------------------------

    def _kv_pool(self) -> Any:
        pools = getattr(self, "registered_pools", {})
        return pools.get(PoolName.KV) or pools.get("kv") or getattr(self, "mem_pool_host", None)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        if pool_transfers:  # sidecar pools (Mamba, SWA...) are not stored: no usable prefix
            return PoolTransferResult(0, {}, [])
        kv = self.batch_exists(keys, extra_info)
        return PoolTransferResult(kv, {PoolName.KV: kv} if kv else {}, list(range(1, kv + 1)))

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            ok = t.name == PoolName.KV and t.host_indices is not None
            out[t.name] = self._get_pages(self._kv_pool(), keys, t.host_indices) if ok else [False] * len(keys)
        return out

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            ok = t.name == PoolName.KV and t.host_indices is not None
            out[t.name] = self._set_pages(self._kv_pool(), keys, t.host_indices, extra_info) if ok else [False] * len(keys)
        return out

    def clear(self) -> None:
        log.info("kvstore hicache: clear() leaves the daemon's blocks (evict with kvctl)")

    def get_stats(self) -> dict[str, int]:
        return {**self.counters, "breaker_short_circuited": self.link.counters.short_circuited,
                "breaker_opened": self.link.breaker.opened}

    def close(self) -> None:
        self.link.close()
