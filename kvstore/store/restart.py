"""Warm restart and close as plain functions over the store's parts: rebuilding the index from
the persistent tiers' metadata (parents first, orphans dropped, namespaces learned), persisting
refreshed expiry, and writing volatile blocks down on close.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.clock import Clock
from kvstore.config import StoreConfig
from kvstore.errors import (
    BlockNotFound,
    CorruptBlockError,
    KVStoreError,
    QuotaExceededError,
    TierIOError,
)
from kvstore.index import NO_PARENT
from kvstore.keys import BlockHash, Namespace
from kvstore.retention import PinBook
from kvstore.store.ledger import Ledger, bits, lowest_bit
from kvstore.store.namespaces import NamespaceTable
from kvstore.store.placer import Placer
from tiers.base import BlockColumns, hash_groups, hash_list

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


CLOSE_PASSES = 4
"""Passes of :func:`persist_volatile`: a block whose persistent copy a make-room of the pass
moved away (or dropped, its copy above kept) is volatile again, and written by the next."""


def persist_volatile(placer: Placer) -> int:
    """Write blocks held only by volatile tiers down to a persistent tier, parents first, so
    that a clean restart (an upgrade, a reboot) keeps them. Meanwhile admission refuses nothing
    (:attr:`Placer.closing`): nothing leaves the store because it stops. A block the first
    persistent tier cannot take goes to the next; one none can take (all of them full of pinned
    or in-use blocks, or failing) is counted in ``dropped_on_close`` and logged with the reason,
    and so are its cached descendants, which a restart could not reach without it. Expired
    blocks are not written (a restart drops them)."""
    tiers, idx = placer.tiers, placer.index
    persistent = [k for k, t in enumerate(tiers) if t.persistent]
    if not persistent:
        return 0
    written = 0
    failed: dict[BlockHash, str] = {}
    now = placer.clock()
    placer.closing = True
    try:
        for _ in range(CLOSE_PASSES):
            todo = _volatile_keys(placer, now, failed)
            if not todo:
                break
            for key in todo:
                bid = idx.id_of(key)
                if bid is None or int(idx.tiers[bid]) & placer.persistent_mask or not int(idx.tiers[bid]):
                    continue  # gone meanwhile (expired, or taken along), or persisted already
                parent = int(idx.parent[bid])
                if int(idx.depth[bid]) and (pk := idx.hash_of_or_none(parent)) is not None and pk in failed:
                    failed[key] = f"its parent {pk.hex()} could not be persisted"
                    continue
                reason = _persist_one(placer, bid, persistent)
                if reason is None:
                    written += 1
                else:
                    failed[key] = reason
    finally:
        placer.closing = False
    if failed:
        placer.ledger.counters.dropped_on_close += len(failed)
        first = next(iter(failed.items()))
        log.warning("close: %d cached block(s) could not be written to a persistent tier and are lost "
                    "at restart (dropped_on_close); the first, %s: %s", len(failed), first[0].hex(), first[1])
        for key, reason in list(failed.items())[1:64]:
            log.warning("close: block %s not persisted: %s", key.hex(), reason)
    log.info("persisted %d volatile blocks on close", written)
    return written


def _volatile_keys(placer: Placer, now: float, failed: dict[BlockHash, str]) -> list[BlockHash]:
    """Blocks held only by volatile tiers, unexpired (or pinned), not failed yet, parents first."""
    idx = placer.index
    ids = idx.live_ids()
    ids = ids[(idx.tiers[ids] & placer.persistent_mask) == 0]
    ids = ids[idx.tiers[ids] != 0]
    ids = ids[(idx.expiry[ids] > now) | (idx.pins[ids] > 0)]
    keys = [idx.hash_of(b) for b in ids[np.argsort(idx.depth[ids], kind="stable")].tolist()]
    return [k for k in keys if k not in failed]


def _persist_one(placer: Placer, bid: int, persistent: Sequence[int]) -> str | None:
    """Write ``bid`` to the first persistent tier that takes it; None, or why none did."""
    idx, tiers = placer.index, placer.tiers
    key = idx.hash_of(bid)
    src_tier = tiers[lowest_bit(int(idx.tiers[bid]))]
    meta = src_tier.meta(key)
    if meta is None:
        return f"its copy on {src_tier.name} has no metadata"
    why = []
    for p in persistent:
        buf = placer.scratch[-1].view(meta.size)
        try:
            src_tier.read_into(key, buf)
            if placer.place(bid, p, buf, meta.with_expiry(float(idx.expiry[bid])), {bid}):
                return None
            why.append(f"{tiers[p].name} could make no room (full of pinned or in-use blocks)")
        except (TierIOError, CorruptBlockError, BlockNotFound) as e:
            why.append(f"{tiers[p].name}: {e}")
        finally:
            del buf
        if idx.id_of(key) != bid:
            return "it left the store while room was made"
    return "; ".join(why)


def recover(
    tiers: Sequence,
    ledger: Ledger,
    placer: Placer,
    namespaces: NamespaceTable,
    pins: PinBook,
    config: StoreConfig,
    clock: Clock,
) -> None:
    """Rebuild the index from the persistent tiers' own metadata (warm restart), as columns:
    the tiers' scans (:meth:`Tier.scan_columns`) merged, the blocks sorted by depth, their
    namespaces and parents checked with numpy, and every block inserted in one index call."""
    # A guarantee whose deadline passed while the store was down is dropped unapplied: the
    # first expiry pass would otherwise release it, taking the pin of another record off the
    # blocks the two share.
    pins.due(clock())
    persistent = [k for k, t in enumerate(tiers) if t.persistent]
    shared = {k for k, t in enumerate(tiers) if getattr(t, "shared", False)}
    counters = ledger.counters
    idx = ledger.index
    merged = merge_scans(tiers, persistent)
    if merged is None:
        return
    if len(idx):
        raise RuntimeError(f"recover rebuilds an empty index; this one holds {len(idx)} blocks")
    keys, cols, masks = merged
    first, group = hash_groups(cols.ns)
    digests = hash_list(cols.ns[first])
    foreign = learn_namespaces(tiers, namespaces, set(digests), config.default_ttl_s)
    now = clock()
    # Parents first: the order the index, and the policies (reversed), learn the blocks in.
    order = np.argsort(cols.depth, kind="stable")
    cols, masks, group = cols.take(order), masks[order], group[order]
    keys = [keys[i] for i in order.tolist()]
    n = len(keys)
    # Per namespace, in the order its first block comes: its id and block size (-1: any), or
    # not served (another schema version or layout, or past max_namespaces).
    nids = np.zeros(len(digests), np.int64)
    block_bytes = np.full(len(digests), -1, np.int64)
    served = np.ones(len(digests), bool)
    _, first_at = np.unique(group, return_index=True)
    for g in np.argsort(first_at, kind="stable").tolist():
        d = digests[g]
        info = namespaces.by_digest.get(d)
        if d in foreign:
            served[g] = False
        elif info is None:  # a namespace of its own, made at its first block
            try:
                nids[g] = namespaces.add(d, None, config.default_ttl_s).nid
            except QuotaExceededError as e:  # past max_namespaces: kept on the tier, not served
                log.warning("blocks of namespace %s are not served: %s", d.hex(), e)
                served[g] = False
        else:
            nids[g] = info.nid
            if info.namespace is not None:
                block_bytes[g] = info.namespace.block_bytes
    bb = block_bytes[group]
    # Another schema version or layout: never served, and left where it is for the stores it
    # belongs to.
    alien = ~served[group] | ((bb >= 0) & (cols.size != bb))
    counters.foreign_blocks += int(alien.sum())
    # A block is reachable when its parent is, one level up (a root: its parent is its
    # namespace); decided level by level, parents first.
    at = dict(zip(keys, range(n), strict=True))
    parent_at = np.fromiter(map(at.get, hash_list(cols.parent), itertools.repeat(-1)), np.int64, n)
    depth = cols.depth
    ok = ~alien
    ok &= (depth > 0) | (cols.parent == cols.ns)
    starts = np.flatnonzero(np.diff(depth)) + 1
    for a, b in zip([0, *starts.tolist()], [*starts.tolist(), n], strict=True):
        d = int(depth[a])
        if d == 0:
            continue
        p = parent_at[a:b]
        linked = p >= 0
        up = np.zeros(b - a, bool)
        up[linked] = ok[p[linked]] & (depth[p[linked]] == d - 1)
        ok[a:b] &= up
    drop_orphans(tiers, shared, keys, masks, ~alien & ~ok, counters)
    keep = np.flatnonzero(ok)
    if keep.size:
        renumber = np.full(n, NO_PARENT, np.int64)
        renumber[keep] = np.arange(keep.size)
        kept = cols.take(keep)
        ids = idx.insert_blocks(
            [keys[i] for i in keep.tolist()],
            np.where(kept.depth == 0, NO_PARENT, renumber[parent_at[keep]]),
            kept.depth.astype(np.int32),
            kept.size.astype(np.uint32),
            nids[group[keep]].astype(np.uint16),
            masks[keep],
            kept.created,
            kept.expiry,
            local_parents=True,
        )
        # Policies learn the blocks deepest first, so leaves are the first candidates: one
        # insert_many per tier, in the order of per-block inserts (the last tier's policy sees
        # the final child counts and holds the blocks that have children).
        back = np.asarray(ids, np.int64)[::-1]
        back_masks, back_sizes, back_created = masks[keep][::-1], kept.size[::-1].astype(np.uint32), kept.created[::-1]
        for k in range(len(tiers)):
            on_k = (back_masks & (1 << k)) != 0
            if on_k.any():
                ledger.policies[k].insert_many(back[on_k], back_sizes[on_k], back_created[on_k])
        placer.keep_always(back)  # admission never refuses a block that was stored before
        counters.recovered_blocks += int(keep.size)
    for record in pins:  # before expiry: a pinned block must not expire at open
        if record.until is None or record.until > now:
            ledger.pin([i for h in record.hashes if (i := idx.id_of(h)) is not None])
    placer.expire(now, config.expire_work_cap)
    log.info("recovered %d blocks", counters.recovered_blocks)


def merge_scans(tiers: Sequence, persistent: Sequence[int]) -> tuple[list[BlockHash], BlockColumns, np.ndarray] | None:
    """Every block the persistent tiers hold, once: its key, its metadata (the copy with the
    latest expiry; the first such), and the mask of tiers that hold it, in the order the
    tiers' scans first name the blocks. None when they hold none."""
    parts = [(k, BlockColumns.concat(tiers[k].scan_columns())) for k in persistent]
    parts = [(k, c) for k, c in parts if len(c)]
    if not parts:
        return None
    cols = BlockColumns.concat(c for _, c in parts)
    bits = np.concatenate([np.full(len(c), 1 << k, np.uint8) for k, c in parts])
    keys = cols.key_list()
    first_of = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True))
    if len(first_of) == len(keys):
        return keys, cols, bits
    # A block on several tiers: one row, all their bits.
    group = np.fromiter(map(first_of.__getitem__, keys), np.int64, len(keys))
    masks = np.zeros(len(keys), np.uint8)
    np.bitwise_or.at(masks, group, bits)
    latest = np.full(len(keys), -np.inf)
    np.maximum.at(latest, group, cols.expiry)
    best = np.flatnonzero(cols.expiry == latest[group])
    _, pick = np.unique(group[best], return_index=True)
    winners = best[pick]  # one row per block: its first copy of the latest expiry
    reps = group[winners]
    by_rep = np.argsort(reps, kind="stable")
    rows, reps = winners[by_rep], reps[by_rep]
    return [keys[i] for i in reps.tolist()], cols.take(rows), masks[reps]


def drop_orphans(tiers: Sequence, shared: set[int], keys: list[BlockHash], masks: np.ndarray,
                 orphan: np.ndarray, counters: Any) -> None:
    """Blocks whose parent did not survive (it lived only in DRAM) can never be reached by a
    prefix match: free their room. Not on a shared tier: there the parent may be in another
    node's DRAM, to be written later (a probe then finds both)."""
    rows = np.flatnonzero(orphan)
    counters.orphans_dropped += int(rows.size)
    if rows.size:
        log.warning("recovered %d block(s) whose parent no persistent tier held (orphans_dropped): no "
                    "lookup can reach them, so they are dropped; the first: %s", rows.size, keys[rows[0]].hex())
    for k in bits(int(np.bitwise_or.reduce(masks[rows]))) if rows.size else ():
        if k in shared:
            continue
        gone = [keys[i] for i in rows[(masks[rows] & (1 << k)) != 0].tolist()]
        for key, r in zip(gone, tiers[k].delete_many(gone), strict=True):
            if isinstance(r, KVStoreError):
                log.warning("could not drop orphan %s from tier %s: %s", key.hex(), tiers[k].name, r)


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
