"""Warm restart and close as plain functions over the store's parts: rebuilding the index from
the persistent tiers' metadata (parents first, orphans dropped, namespaces learned), persisting
refreshed expiry, and writing volatile blocks down on close.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from kvstore.block import BlockMeta
from kvstore.clock import Clock
from kvstore.config import StoreConfig
from kvstore.errors import (
    BlockNotFound,
    CorruptBlockError,
    QuotaExceededError,
    TierIOError,
)
from kvstore.index import NO_PARENT
from kvstore.keys import BlockHash, Namespace
from kvstore.retention import PinBook
from kvstore.store.ledger import Ledger, bits, lowest_bit
from kvstore.store.namespaces import NamespaceTable
from kvstore.store.placer import Placer

log = logging.getLogger("kvstore.store")

Expiry = dict[int, list[tuple[BlockHash, float]]]


def take_expiry(ledger: Ledger, persistent: Sequence[int]) -> tuple[Expiry, int]:
    """Under the lock: the refreshed expiry times each persistent tier has to learn, and how
    many blocks they are for; the blocks are no longer dirty."""
    dirty = ledger.dirty_expiry
    if not dirty:
        return {}, 0
    idx = ledger.index
    per_tier: Expiry = {k: [] for k in persistent}
    for bid in dirty:
        mask = int(idx.tiers[bid])
        for k in persistent:
            if mask & (1 << k):
                per_tier[k].append((idx.hash_of(bid), float(idx.expiry[bid])))
    n = len(dirty)
    dirty.clear()
    return per_tier, n


def write_expiry(tiers: Sequence, updates: Expiry) -> None:
    """Outside the lock (a remote tier may take its timeouts): each tier skips keys it no
    longer holds, and a lost update only shortens a block's life."""
    for k, items in updates.items():
        if items:
            tiers[k].update_expiry(items)


def persist_volatile(placer: Placer) -> int:
    """Write blocks held only by volatile tiers down to the first persistent tier, parents
    first, so that a clean restart (an upgrade, a reboot) keeps them. Stops at the first block
    the tier cannot take."""
    tiers, idx = placer.tiers, placer.index
    persistent = [k for k, t in enumerate(tiers) if t.persistent]
    if not persistent:
        return 0
    p = persistent[0]
    ids = idx.live_ids()
    ids = ids[(idx.tiers[ids] & placer.persistent_mask) == 0]
    ids = ids[idx.tiers[ids] != 0]
    written = 0
    for bid in ids[np.argsort(idx.depth[ids], kind="stable")].tolist():
        key = idx.hash_of(bid)
        src_tier = tiers[lowest_bit(int(idx.tiers[bid]))]
        meta = src_tier.meta(key)
        if meta is None:
            continue
        buf = placer.scratch[-1].view(meta.size)
        try:
            src_tier.read_into(key, buf)
            if not placer.place(bid, p, buf, meta.with_expiry(float(idx.expiry[bid])), {bid}):
                break
        except (TierIOError, CorruptBlockError, BlockNotFound) as e:
            log.warning("could not persist %s on close: %s", key.hex(), e)
            break
        finally:
            del buf
        written += 1
    log.info("persisted %d volatile blocks on close", written)
    return written


def recover(
    tiers: Sequence,
    ledger: Ledger,
    placer: Placer,
    namespaces: NamespaceTable,
    pins: PinBook,
    config: StoreConfig,
    clock: Clock,
) -> None:
    """Rebuild the index from the persistent tiers' own metadata (warm restart)."""
    # A guarantee whose deadline passed while the store was down is dropped unapplied: the
    # first expiry pass would otherwise release it, taking the pin of another record off the
    # blocks the two share.
    pins.due(clock())
    persistent = [k for k, t in enumerate(tiers) if t.persistent]
    shared = {k for k, t in enumerate(tiers) if getattr(t, "shared", False)}
    counters = ledger.counters
    found: dict[bytes, tuple[BlockMeta, int]] = {}
    for k in persistent:
        bit = 1 << k
        for key, meta in tiers[k].scan():
            prev = found.get(key)
            if prev is None:
                found[key] = (meta, bit)
            else:
                found[key] = (meta if meta.expiry > prev[0].expiry else prev[0], prev[1] | bit)
    if not found:
        return
    foreign = learn_namespaces(tiers, namespaces, {meta.ns for meta, _ in found.values()}, config.default_ttl_s)
    now = clock()
    idx = ledger.index
    id_of = idx.id_of
    order = sorted(found.items(), key=lambda kv: kv[1][0].depth)
    recovered: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # per level: ids, masks, sizes, created
    # Per namespace digest: (nid, its block bytes or None when not registered), or None for a
    # foreign one.
    ns_state: dict[bytes, tuple[int, int | None] | None] = {}
    # The depth level being collected, as columns.
    keys: list[bytes] = []
    masks: list[int] = []
    pids: list[int] = []
    metas: list[BlockMeta] = []
    nids: list[int] = []

    def drop_orphan(key: bytes, mask: int) -> None:
        # A block whose parent did not survive (it lived only in DRAM) can never be reached by
        # a prefix match; free its room. Not on a shared tier: there the parent may be in
        # another node's DRAM, to be written later (a probe then finds both).
        counters.orphans_dropped += 1
        for k in bits(mask):
            if k in shared:
                continue
            try:
                tiers[k].delete(BlockHash(key))
            except TierIOError as e:
                log.warning("could not drop orphan %s from tier %s: %s", key.hex(), tiers[k].name, e)

    def insert_level(depth: int) -> None:
        # One depth level at a time: every parent is already in the index.
        if not keys:
            return
        parents = np.array(pids, np.int64)
        linked = parents != NO_PARENT
        wrong = linked & (idx.depth[np.where(linked, parents, 0)] != depth - 1)
        keep = None
        if wrong.any():  # a parent at another depth: damaged metadata, an orphan
            for i in np.flatnonzero(wrong).tolist():
                drop_orphan(keys[i], masks[i])
            keep = np.flatnonzero(~wrong)
        n = len(keys) if keep is None else keep.size
        if n:
            cols = (keys, masks, metas, nids) if keep is None else (
                [c[i] for i in keep.tolist()] for c in (keys, masks, metas, nids))
            lk, lm, lmeta, ln = cols
            mask_col = np.array(lm, np.uint8)
            sizes = np.fromiter(map(attrgetter("size"), lmeta), np.uint32, n)
            created = np.fromiter(map(attrgetter("created"), lmeta), np.float64, n)
            ids = idx.insert_blocks(
                lk,
                (parents if keep is None else parents[keep]).astype(np.int32),
                np.full(n, depth, np.int32),
                sizes,
                np.array(ln, np.uint16),
                mask_col,
                created,
                np.fromiter(map(attrgetter("expiry"), lmeta), np.float64, n),
            )
            recovered.append((np.asarray(ids, np.int64), mask_col, sizes, created))
        for c in (keys, masks, pids, metas, nids):
            c.clear()

    depth = 0
    for key, (meta, mask) in order:
        if meta.depth != depth:
            insert_level(depth)
            depth = meta.depth
        ns = meta.ns
        if ns in ns_state:
            state = ns_state[ns]
        else:
            info = namespaces.by_digest.get(ns)
            if ns in foreign:
                state = None
            elif info is None:
                state = (-1, None)  # a namespace of its own, made at its first block
            else:
                state = (info.nid, info.namespace.block_bytes if info.namespace is not None else None)
            ns_state[ns] = state
        if state is None or (state[1] is not None and meta.size != state[1]):
            # Another schema version or layout: never served, and left where it is for the
            # stores it belongs to.
            counters.foreign_blocks += 1
            continue
        if state[0] < 0:
            try:
                state = ns_state[ns] = (namespaces.add(ns, None, config.default_ttl_s).nid, None)
            except QuotaExceededError as e:  # past max_namespaces: kept on the tier, not served
                log.warning("blocks of namespace %s are not served: %s", ns.hex(), e)
                ns_state[ns] = None
                counters.foreign_blocks += 1
                continue
        pid = (NO_PARENT if meta.parent == ns else None) if depth == 0 else id_of(meta.parent)
        if pid is None:
            drop_orphan(key, mask)
            continue
        keys.append(key)
        masks.append(mask)
        pids.append(pid)
        metas.append(meta)
        nids.append(state[0])
    insert_level(depth)
    # Policies learn the blocks deepest first, so leaves are the first candidates: one
    # insert_many per tier, in the order of per-block inserts (the last tier's policy sees the
    # final child counts and holds the blocks that have children).
    n_recovered = 0
    if recovered:
        all_ids, all_masks, all_sizes, all_created = (np.concatenate(col)[::-1] for col in zip(*recovered, strict=True))
        n_recovered = all_ids.size
        for k in range(len(tiers)):
            on_k = (all_masks & (1 << k)) != 0
            if on_k.any():
                ledger.policies[k].insert_many(all_ids[on_k], all_sizes[on_k], all_created[on_k])
        placer.keep_always(all_ids)  # admission never refuses a block that was stored before
    counters.recovered_blocks += n_recovered
    for record in pins:  # before expiry: a pinned block must not expire at open
        if record.until is None or record.until > now:
            ledger.pin([i for h in record.hashes if (i := idx.id_of(h)) is not None])
    placer.expire(now, config.expire_work_cap)
    log.info("recovered %d blocks", counters.recovered_blocks)


def learn_namespaces(tiers: Sequence, namespaces: NamespaceTable, digests: set[bytes], default_ttl_s: float) -> set[bytes]:
    """Register the namespaces of recovered blocks that namespaces.json lacks, from the
    descriptors the persistent tiers keep (object headers: blocks other stores wrote).
    Returns the digests that are *foreign*: another schema version, or a descriptor that does
    not hash to its digest. Their blocks are reported, never served."""
    unknown = {d for d in digests if d not in namespaces.by_digest}
    descriptors: dict[bytes, bytes] = {}
    for t in tiers:
        if unknown and t.persistent:
            for d, desc in t.namespaces().items():
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
        for other in namespaces:
            if other.namespace is not None and other.namespace.model_key() == ns.model_key():
                log.warning(
                    "learned namespace %s of model %r has another layout than the registered %s; "
                    "their blocks are kept apart", d.hex(), ns.model_id, other.digest.hex(),
                )
        try:
            namespaces.learned(d, ns, default_ttl_s)
        except QuotaExceededError as e:
            log.warning("blocks of namespace %s are not served: %s", d.hex(), e)
            foreign.add(d)
            continue
        for t in tiers:
            t.register_namespace(d, desc)
        log.info("learned namespace %s (model %r) from a persistent tier", d.hex(), ns.model_id)
    return foreign
