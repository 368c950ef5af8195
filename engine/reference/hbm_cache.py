"""Hot prefix blocks kept in device memory, served to the batched engine with no host transfer.

An :class:`HbmCache` sits in front of an :class:`engine.client.EngineCache` (the store): a block
of a prompt's prefix that is resident here is gathered straight from device memory into the
engine's KV rows; only the blocks after the resident run are loaded from the store's DRAM arena
(and those are *promoted*: copied into HBM pages from the device staging they were loaded into,
so the next request finds them here). Blocks the engine computes are admitted too.

The pages are an :class:`tiers.hbm.HbmTier` (one device allocation carved by the slab allocator,
blocks used in place through ``offsets`` / ``pool``) sized to the budget the engine gives. A page
holds its block in the engine's row layout, ``[layers][K, V][block_tokens][kv_heads][head_dim]``
(token-major, as the batched engine's KV rows), not the store's payload layout: a hit is then one
plain gather per request, layer and K/V into the rows, with no transpose. Blocks are converted
once, when they are promoted or admitted (from the rows they were just loaded or computed into),
and back to the store's layout when one is written back.

Policy: write-through, like SGLang's HiCache ``write_through``: every block here also goes to
the store (the engine stores what it computes; promoted blocks came from it), so *demotion* under
pressure is dropping the device copy; a victim the store no longer holds (its DRAM evicted it) is
first written back (one device-to-host copy and a put) when its parent is still in the store,
else it is dropped and counted. Victims are least recently used first; a hit touches its blocks
deepest first, so parents stay more recent than their children and chains shrink from the tail.
Blocks acquired by a batch in flight are never victims.

Ordering contract: the engine writes pages on its load stream (promotion) or its compute stream
(admission, after the load stream's work was waited for), and reads them on its load stream, which
waits for the compute stream at the start of every batch: a page is never read before it is
written, nor reused while a read of it is queued. Not thread-safe: one engine thread.
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.client import EngineCache
from engine.kvlayout import wide
from kvstore.block import BlockMeta
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import BlockHash
from tiers.hbm import HbmConfig, HbmTier

log = logging.getLogger(__name__)

_SLAB_TARGET = 64 << 20


@dataclass(slots=True)
class HbmCounters:
    hit_blocks: int = 0
    promoted: int = 0
    admitted: int = 0
    evicted: int = 0
    written_back: int = 0
    dropped: int = 0
    """Victims neither in the store nor writable to it (their parent had left the store)."""


@dataclass(slots=True)
class _Entry:
    chain: tuple[BlockHash, ...]
    """The prefix chain the block was admitted with (its own hash is ``chain[depth]``)."""
    depth: int
    in_use: int = 0


@dataclass(slots=True)
class Reservation:
    """Pages reserved for blocks ``start .. start+len(keys)-1`` of a chain, to be filled by the
    caller (per layer and K/V: ``part(layer, kv).index_copy_(0, slots, rows)``)."""

    keys: list[BlockHash]
    slots: torch.Tensor
    """int64 page indices on the device, one per key."""
    start: int


class HbmCache:
    """A budgeted device-memory block cache for one model (one :class:`EngineCache`)."""

    def __init__(self, cache: EngineCache, budget_bytes: int, *, device: str | torch.device | None = None) -> None:
        shape = cache.shape
        self.cache = cache
        self.shape = shape
        self.slot_bytes = -(-shape.block_bytes // 4096) * 4096
        per_slab = max(1, min(_SLAB_TARGET, budget_bytes) // self.slot_bytes)
        slab = per_slab * self.slot_bytes  # a multiple of the slot: page i is at i * slot_bytes
        if budget_bytes < slab:
            raise ConfigError(
                f"HBM budget {budget_bytes} bytes is below one block ({slab} bytes); raise it or pass no HbmCache"
            )
        dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-hbm-")
        self.tier = HbmTier(
            "engine-hbm", HbmConfig(budget_bytes // slab * slab, slab, device=str(dev)), root=Path(self._tmp.name)
        )
        self.device = self.tier.device
        self.pages = self.tier.pool.view(-1, self.slot_bytes)
        """The page pool as ``[pages, slot_bytes]`` uint8: page ``i`` holds one block."""
        self._part = shape.layer_bytes // 2  # K (or V) of one layer of one block
        self.capacity_blocks = int(self.pages.shape[0])
        self._lru: OrderedDict[BlockHash, _Entry] = OrderedDict()  # least recently used first
        self.counters = HbmCounters()
        self._ns_root = bytes(cache.ns.root)

    def part(self, layer: int, kv: int) -> torch.Tensor:
        """K (``kv=0``) or V (``kv=1``) of layer ``layer`` in every page: ``[pages, width]`` (the
        ``[block_tokens, kv_heads, head_dim]`` rows of the block, in 8-byte units when possible)."""
        lo = (2 * layer + kv) * self._part
        return wide(self.pages[:, lo : lo + self._part])

    @property
    def budget_bytes(self) -> int:
        return self.capacity_blocks * self.slot_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: list[BlockHash], limit: int) -> int:
        """How many leading blocks of ``hashes`` (at most ``limit``) are resident."""
        n = 0
        for h in hashes[: max(0, limit)]:
            if h not in self._lru:
                break
            n += 1
        return n

    def acquire(self, hashes: list[BlockHash]) -> torch.Tensor:
        """Page indices (int64, on the device) of resident ``hashes``, held in use until
        :meth:`release`; touches them deepest first."""
        for h in reversed(hashes):
            e = self._lru[h]
            e.in_use += 1
            self._lru.move_to_end(h)
        self.counters.hit_blocks += len(hashes)
        return self._slots(hashes)

    def release(self, hashes: list[BlockHash]) -> None:
        for h in hashes:
            e = self._lru.get(h)
            if e is not None and e.in_use > 0:
                e.in_use -= 1

    def reserve(self, chain: list[BlockHash], start: int, count: int, *, promoted: bool) -> Reservation | None:
        """Pages for blocks ``start .. start+count-1`` of ``chain`` (held in use like
        :meth:`acquire`; the caller fills them and releases ``keys``). Only a run that continues
        the resident chain is admitted (a block after a gap could never be matched); the run
        stops early when no victim is left. None when nothing can be admitted."""
        if count <= 0 or self.match(chain, start) < start:
            return None
        frozen = tuple(chain[: start + count])
        keys: list[BlockHash] = []
        for depth in range(start, start + count):
            h = chain[depth]
            if h in self._lru:  # already resident (another request of the batch admitted it)
                break
            if not self._make_room():
                break
            meta = BlockMeta(self._ns_root, bytes(chain[depth - 1]) if depth else self._ns_root, depth,
                             self.shape.block_bytes, math.inf, 0, 0.0)
            self.tier.reserve(h, meta)
            self._lru[h] = _Entry(frozen, depth, in_use=1)
            keys.append(h)
        if not keys:
            return None
        for h in reversed(keys):  # deepest first: a chain's tail is the first to go
            self._lru.move_to_end(h)
        if promoted:
            self.counters.promoted += len(keys)
        else:
            self.counters.admitted += len(keys)
        return Reservation(keys, self._slots(keys), start)

    def close(self) -> None:
        self.tier.close()
        self._lru.clear()
        self._tmp.cleanup()

    # ---- helpers --------------------------------------------------------------------------

    def _slots(self, hashes: list[BlockHash]) -> torch.Tensor:
        offs = self.tier.offsets(hashes)
        return torch.tensor([o // self.slot_bytes for o in offs], dtype=torch.long).to(self.device, non_blocking=True)

    def _make_room(self) -> bool:
        if len(self._lru) < self.capacity_blocks:
            return True
        for h, e in self._lru.items():  # least recent first
            if e.in_use == 0:
                self._demote(h, e)
                return True
        return False

    def _demote(self, h: BlockHash, e: _Entry) -> None:
        store, ns = self.cache.store, self.cache.ns
        chain = list(e.chain[: e.depth + 1])
        try:
            have = store.lookup(ns, chain).num_blocks
            if have <= e.depth:
                if have < e.depth:
                    self.counters.dropped += 1
                else:  # the parent is in the store, this block is not: write it back
                    page = self.tier.view(h)
                    if page.is_cuda:
                        torch.cuda.synchronize(page.device)  # its writes are queued on other streams
                    s = self.shape
                    rows = page[: s.block_bytes].view(s.dtype).view(s.num_layers, 2, s.block_tokens, s.kv_heads, s.head_dim)
                    host = rows.transpose(2, 3).contiguous().view(torch.uint8).view(-1).to("cpu")  # the store's layout
                    store.put(ns, chain, host.numpy(), start=e.depth)
                    self.counters.written_back += 1
        except KVStoreError as err:
            self.counters.dropped += 1
            log.warning("demotion of an HBM block failed, dropped: %s", err)
        self.tier.delete(h)
        del self._lru[h]
        self.counters.evicted += 1
