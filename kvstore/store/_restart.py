"""Warm restart for :class:`KVStore`: rebuilding the index from the persistent tiers' metadata,
dropping orphans, learning namespaces, and persisting expiry and volatile state on close.

A mixin: it relies on the attributes :class:`kvstore.store.core.KVStore` sets up in
``__init__`` and is not used on its own.
"""

from __future__ import annotations

import json
import logging

import numpy as np

from kvstore.block import BlockMeta
from kvstore.errors import (
    BlockNotFound,
    CorruptBlockError,
    TierIOError,
)
from kvstore.index import NO_PARENT
from kvstore.keys import BlockHash, Namespace
from kvstore.store._common import (
    _lowest_bit,
)

log = logging.getLogger("kvstore.store")


class Restart:

    def _persist_expiry(self) -> int:
        updates, n = self._take_expiry()
        self._write_expiry(updates)
        return n

    def _take_expiry(self) -> tuple[dict[int, list[tuple[BlockHash, float]]], int]:
        """Under the lock: the refreshed expiry times each persistent tier has to learn, and
        how many blocks they are for; the blocks are no longer dirty."""
        if not self._dirty_expiry:
            return {}, 0
        idx = self.index
        per_tier: dict[int, list[tuple[BlockHash, float]]] = {k: [] for k in self._persistent}
        for bid in self._dirty_expiry:
            mask = int(idx.tiers[bid])
            for k in self._persistent:
                if mask & (1 << k):
                    per_tier[k].append((idx.hash_of(bid), float(idx.expiry[bid])))
        n = len(self._dirty_expiry)
        self._dirty_expiry.clear()
        return per_tier, n

    def _write_expiry(self, updates: dict[int, list[tuple[BlockHash, float]]]) -> None:
        """Outside the lock (a remote tier may take its timeouts): each tier skips keys it no
        longer holds, and a lost update only shortens a block's life."""
        for k, items in updates.items():
            if items:
                self.tiers[k].update_expiry(items)

    def _persist_volatile(self) -> int:
        """Write blocks held only by volatile tiers down to the first persistent tier, parents
        first, so that a clean restart (an upgrade, a reboot) keeps them. Stops at the first
        block the tier cannot take."""
        if not self._persistent:
            return 0
        p = self._persistent[0]
        persistent_mask = sum(1 << k for k in self._persistent)
        idx = self.index
        ids = idx.live_ids()
        ids = ids[(idx.tiers[ids] & persistent_mask) == 0]
        ids = ids[idx.tiers[ids] != 0]
        written = 0
        for bid in ids[np.argsort(idx.depth[ids], kind="stable")].tolist():
            key = idx.hash_of(bid)
            src_tier = self.tiers[_lowest_bit(int(idx.tiers[bid]))]
            meta = src_tier.meta(key)
            if meta is None:
                continue
            buf = self._scratch[-1].view(meta.size)
            try:
                src_tier.read_into(key, buf)
                if not self._place(bid, p, buf, meta.with_expiry(float(idx.expiry[bid])), {bid}):
                    break
            except (TierIOError, CorruptBlockError, BlockNotFound) as e:
                log.warning("could not persist %s on close: %s", key.hex(), e)
                break
            finally:
                del buf
            written += 1
        log.info("persisted %d volatile blocks on close", written)
        return written

    # ---- restart ------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Rebuild the index from the persistent tiers' own metadata (warm restart)."""
        # A guarantee whose deadline passed while the store was down is dropped unapplied: the
        # first expiry pass would otherwise release it, taking the pin of another record off
        # the blocks the two share.
        self._pins.due(self._clock())
        found: dict[bytes, tuple[BlockMeta, int]] = {}
        for k in self._persistent:
            for key, meta in self.tiers[k].scan():
                prev = found.get(key)
                mask = (prev[1] if prev else 0) | (1 << k)
                best = meta if prev is None or meta.expiry > prev[0].expiry else prev[0]
                found[key] = (best, mask)
        if not found:
            return
        foreign = self._learn_namespaces({meta.ns for meta, _ in found.values()})
        now = self._clock()
        idx = self.index
        order = sorted(found.items(), key=lambda kv: kv[1][0].depth)
        recovered: list[tuple[int, int, BlockMeta]] = []
        block_bytes: dict[bytes, int | None] = {}  # per namespace digest; None: not registered
        level: list[tuple[bytes, int, int, BlockMeta, int]] = []  # (key, mask, parent id, meta, nid)

        def insert_level() -> None:
            # One depth level at a time: every parent is already in the index.
            if not level:
                return
            ids = idx.insert_blocks(
                [e[0] for e in level],
                np.fromiter((e[2] for e in level), np.int32, len(level)),
                np.fromiter((e[3].depth for e in level), np.int32, len(level)),
                np.fromiter((e[3].size for e in level), np.uint32, len(level)),
                np.fromiter((e[4] for e in level), np.uint16, len(level)),
                np.fromiter((e[1] for e in level), np.uint8, len(level)),
                np.fromiter((e[3].created for e in level), np.float64, len(level)),
                np.fromiter((e[3].expiry for e in level), np.float64, len(level)),
            )
            recovered.extend(zip(ids.tolist(), (e[1] for e in level), (e[3] for e in level), strict=True))
            level.clear()

        depth = 0
        for key, (meta, mask) in order:
            if meta.depth != depth:
                insert_level()
                depth = meta.depth
            info = self._ns_by_digest.get(meta.ns)
            if meta.ns not in block_bytes:
                ns_ = info.namespace if info is not None else None
                block_bytes[meta.ns] = ns_.block_bytes if ns_ is not None else None
            expected = block_bytes[meta.ns]
            if meta.ns in foreign or (expected is not None and meta.size != expected):
                # Another schema version or layout: never served, and left where it is for
                # the stores it belongs to.
                self.counters.foreign_blocks += 1
                continue
            if info is None:
                info = self._new_ns(meta.ns, None, self.config.default_ttl_s)
            if meta.depth == 0:
                pid = NO_PARENT if meta.parent == meta.ns else None
            else:
                pid = idx.id_of(meta.parent)
            if pid is None or (pid != NO_PARENT and idx.depth[pid] != meta.depth - 1):
                self._drop_orphan(key, mask)
                continue
            level.append((key, mask, pid, meta, info.nid))
        insert_level()
        # Policies learn the blocks deepest first, so leaves are the first candidates.
        for bid, mask, meta in reversed(recovered):
            m = mask
            while m:
                k = _lowest_bit(m)
                m &= m - 1
                self._policies[k].insert(bid, meta.size, meta.created)
        self.counters.recovered_blocks += len(recovered)
        for record in self._pins:  # before expiry: a pinned block must not expire at open
            if record.until is None or record.until > now:
                ids = [i for h in record.hashes if (i := idx.id_of(h)) is not None]
                idx.add_pins(np.array(ids, dtype=np.int64), 1)
        self._expire(now, self.config.expire_work_cap)
        log.info("recovered %d blocks", self.counters.recovered_blocks)

    def _drop_orphan(self, key: bytes, mask: int) -> None:
        # A block whose parent did not survive (it lived only in DRAM) can never be reached
        # by a prefix match; free its room. Not on a shared tier: there the parent may be in
        # another node's DRAM, to be written later (a probe then finds both).
        self.counters.orphans_dropped += 1
        while mask:
            k = _lowest_bit(mask)
            mask &= mask - 1
            if k in self._shared:
                continue
            try:
                self.tiers[k].delete(BlockHash(key))
            except TierIOError as e:
                log.warning("could not drop orphan %s from tier %s: %s", key.hex(), self.tiers[k].name, e)

    def _learn_namespaces(self, digests: set[bytes]) -> set[bytes]:
        """Register the namespaces of recovered blocks that namespaces.json lacks, from the
        descriptors the persistent tiers keep (object headers: blocks other stores wrote).
        Returns the digests that are *foreign*: another schema version, or a descriptor that
        does not hash to its digest. Their blocks are reported, never served."""
        unknown = {d for d in digests if d not in self._ns_by_digest}
        descriptors: dict[bytes, bytes] = {}
        for k in self._persistent:
            if unknown:
                for d, desc in self.tiers[k].namespaces().items():
                    if d in unknown:
                        descriptors.setdefault(d, desc)
        foreign: set[bytes] = set()
        for d, desc in descriptors.items():
            try:
                ns = Namespace.from_dict(json.loads(desc))
                if ns.root != d:
                    raise ValueError(f"the descriptor hashes to {ns.root.hex()}")
            except (ValueError, KeyError, TypeError) as e:  # UsageError is a ValueError
                log.warning("blocks of namespace %s are foreign, never served: %s", d.hex(), e)
                foreign.add(d)
                continue
            for other in self._ns_list:
                if other.namespace is not None and other.namespace.model_key() == ns.model_key():
                    log.warning(
                        "learned namespace %s of model %r has another layout than the "
                        "registered %s; their blocks are kept apart",
                        d.hex(), ns.model_id, other.digest.hex(),
                    )
            self._new_ns(d, ns, self.config.default_ttl_s)
            for t in self.tiers:
                t.register_namespace(d, desc)
            log.info("learned namespace %s (model %r) from a persistent tier", d.hex(), ns.model_id)
        if len(descriptors) > len(foreign):
            self._save_namespaces()
        return foreign
