"""Durable puts for :class:`KVStore`: a chain asked to be durable is written to a persistent
tier (outside the lock where it can be) before the put returns.

A mixin: it relies on the attributes :class:`kvstore.store.core.KVStore` sets up in
``__init__`` and is not used on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore.block import BlockMeta, payload_checksum
from kvstore.errors import (
    KVStoreError,
    TierFullError,
    UsageError,
)
from kvstore.keys import BlockHash
from kvstore.store._common import (
    _lowest_bit,
    _NsInfo,
)

log = logging.getLogger("kvstore.store")


class DurablePath:

    def _make_durable(
        self, hashes: Sequence[bytes], ids: list[int], srcs: list[memoryview], start: int, info: _NsInfo
    ) -> None:
        if not self._persistent:
            raise UsageError("durable=True needs a persistent tier (nvme or object) in the config")
        p = self._persistent[0]
        persistent_mask = sum(1 << k for k in self._persistent)
        self._adopt_prewritten(hashes, ids, start, p, persistent_mask)
        self._write_durable_batch(hashes, ids, srcs, start, info, p, persistent_mask)
        for i, bid in enumerate(ids):
            mask = int(self.index.tiers[bid])
            key = BlockHash(hashes[i])
            if mask & persistent_mask:
                continue
            meta = self._meta_for(bid, key, info)
            if i >= start:
                src = srcs[i - start]
            else:
                src = self._scratch[-1].view(meta.size)
                self.tiers[_lowest_bit(mask)].read_into(key, src)
            if not self._place(bid, p, src, meta, {bid}, durable=True):
                raise TierFullError(
                    f"tier {self.tiers[p].name!r} has no room for a durable copy of block {i}; "
                    "add capacity or unpin prefixes"
                )
            del src
        self.tiers[p].flush()

    def _prewrite_durable(
        self, info: _NsInfo, hashes: Sequence[bytes], srcs: list[memoryview], start: int
    ) -> KVStoreError | None:
        """Write a durable put's new blocks to the first persistent tier *before* taking the
        store's lock, so that a slow disk or a hung object store holds up this put only: every
        other request (loads and lookups included) waits on that lock. Content addressing makes
        the early copy safe; :meth:`_adopt_prewritten` then records it under the lock. A tier
        without room for them all is left to the locked path, which makes room. Returns the
        error of a failed write: the put caches the blocks, then raises it."""
        if not self._persistent:
            return None
        p = self._persistent[0]
        tier, idx = self.tiers[p], self.index
        mask = sum(1 << k for k in self._persistent)
        with self._lock:
            if idx.match(hashes).num_blocks < start:
                return None  # the put refuses it (MissingPrefixError)
            now = self._clock()
            todo = [i for i in range(start, len(hashes))
                    if (bid := idx.id_of(hashes[i])) is None or not int(idx.tiers[bid]) & mask]
        bb = info.namespace.block_bytes  # type: ignore[union-attr]
        free = tier.usage()
        if not todo or free.capacity_bytes - free.used_bytes < len(todo) * bb:
            return None
        items = [
            (BlockHash(hashes[i]), srcs[i - start],
             BlockMeta(info.digest, hashes[i - 1] if i else info.digest, i, bb, now + info.ttl_s,
                       payload_checksum(srcs[i - start]), now))
            for i in todo
        ]
        failed = [e for e in tier.write_many(items, durable=True) if e is not None and not isinstance(e, TierFullError)]
        if failed:
            with self._lock:
                self.counters.tier_errors += len(failed)
            log.error("durable writes to tier %s failed: %s", tier.name, failed[0])
            return failed[0]
        return None

    def _adopt_prewritten(
        self, hashes: Sequence[bytes], ids: list[int], start: int, p: int, persistent_mask: int
    ) -> None:
        """Record the copies :meth:`_prewrite_durable` made (under the lock; no I/O)."""
        tier, idx = self.tiers[p], self.index
        for i in range(start, len(ids)):
            bid = ids[i]
            if not int(idx.tiers[bid]) & persistent_mask and tier.contains(BlockHash(hashes[i])):
                size = int(idx.size[bid])
                self.events.placed(idx.hash_of(bid), p, int(idx.tiers[bid]), size, int(idx.depth[bid]))
                idx.tiers[bid] |= 1 << p
                self._policies[p].insert(bid, size, self._clock())

    def _write_durable_batch(
        self,
        hashes: Sequence[bytes],
        ids: list[int],
        srcs: list[memoryview],
        start: int,
        info: _NsInfo,
        p: int,
        persistent_mask: int,
    ) -> None:
        """Write the caller's blocks that persistent tier ``p`` has room for with one
        ``write_many`` (one concurrent batch of PUTs on an object store, not a request per
        block in turn). :meth:`_make_durable` then writes the rest one by one, making room."""
        tier, idx = self.tiers[p], self.index
        todo = [(i, bid) for i, bid in enumerate(ids) if i >= start and not int(idx.tiers[bid]) & persistent_mask]
        free = tier.usage()
        if len(todo) < 2 or free.capacity_bytes - free.used_bytes < sum(int(idx.size[b]) for _, b in todo):
            return
        metas = [self._meta_for(bid, BlockHash(hashes[i]), info) for i, bid in todo]
        items = [(BlockHash(hashes[i]), srcs[i - start], m) for (i, _), m in zip(todo, metas, strict=True)]
        failed: list[KVStoreError] = []
        for (_, bid), meta, err in zip(todo, metas, tier.write_many(items, durable=True), strict=True):
            if err is None:
                self.events.placed(idx.hash_of(bid), p, int(idx.tiers[bid]), meta.size, int(idx.depth[bid]))
                idx.tiers[bid] |= 1 << p
                self._policies[p].insert(bid, meta.size, meta.created)
            elif not isinstance(err, TierFullError):  # a full tier: the loop makes room
                failed.append(err)
        if failed:
            self.counters.tier_errors += len(failed)
            log.error("durable writes to tier %s failed: %s", tier.name, failed[0])
            raise failed[0]
