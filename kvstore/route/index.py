"""The router's global prefix index: which node holds a block, on which tiers, in 16 bytes a slot.

An open-addressing hash table in two numpy arrays: ``keys`` (u64: the first 8 bytes of a block
hash, XOR its tenant's mask; 0 marks an empty slot) and ``vals`` (u64: 4 bits per node, the
tiers of that node holding the block, so 16 nodes at most). Linear probing, filled to half at
most; a removed block keeps its slot with value 0 until the next resize drops it (no tombstone
logic in the probe loop). Every operation is vectorised over a batch of keys: a lookup of a
128K-token prompt (8K blocks) is a handful of numpy passes, no per-block Python.

8 bytes of a hash are what the event log keeps too (``kvstore.events.KEY_BYTES``): a collision
among 1e8 distinct blocks is expected about 3e-4 times; it could only make the router prefer a
node that then misses, never serve a wrong block (the node's own store matches on 16 bytes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_NODES = 16
BITS = 4
"""Tier bits per node: at most 4 tiers (media) are told apart."""
_FILL = 0.5
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def hash_keys(hashes: Sequence[bytes], mask: int = 0) -> np.ndarray:
    """Block hashes (16 bytes each) as index keys: their first 8 bytes as little-endian u64,
    XOR ``mask`` (a tenant's, :func:`kvstore.wire.kvevents.tenant_mask`)."""
    if not hashes:
        return np.zeros(0, dtype=np.uint64)
    width = len(hashes[0])
    buf = b"".join(hashes)
    if len(buf) != width * len(hashes) or width < 8:
        raise ValueError("block hashes must all have the same length of at least 8 bytes")
    keys = np.frombuffer(buf, dtype="<u8").reshape(len(hashes), -1)[:, 0] if width % 8 == 0 else (
        np.frombuffer(buf, dtype=np.uint8).reshape(len(hashes), width)[:, :8].copy().view("<u8").ravel())
    keys = keys.astype(np.uint64)
    if mask:
        keys ^= np.uint64(mask)
    return keys


class PrefixIndex:
    """``key -> per-node tier masks``; not thread-safe (the router holds a lock around it)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        cap = 1 << max(4, (capacity - 1).bit_length())
        self._keys = np.zeros(cap, dtype=np.uint64)
        self._vals = np.zeros(cap, dtype=np.uint64)
        self._used = 0  # slots holding a key (live or emptied)

    # ---- reading ----------------------------------------------------------------------------

    def get(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key (0: no node holds it)."""
        slots = self._find(_nonzero(keys))
        return np.where(slots >= 0, self._vals[slots], np.uint64(0))

    def __len__(self) -> int:
        """Blocks held by some node."""
        return int(np.count_nonzero(self._vals))

    @property
    def nbytes(self) -> int:
        return int(self._keys.nbytes + self._vals.nbytes)

    # ---- writing ----------------------------------------------------------------------------

    def update(self, keys: np.ndarray, node: int, bits: int, add: bool) -> None:
        """Set (``add``) or clear tier ``bits`` (a 4-bit mask) of ``node`` on every key."""
        if not 0 <= node < MAX_NODES:
            raise ValueError(f"node {node} is outside 0..{MAX_NODES - 1}")
        if not keys.size:
            return
        field = np.uint64((bits & 0xF) << (BITS * node))
        if add:
            slots = self._slots(keys)
            self._vals[slots] |= field
        else:
            keys = _nonzero(keys)
            slots = self._find(keys)
            found = slots[slots >= 0]
            self._vals[found] &= ~field

    def clear_node(self, node: int) -> None:
        """Forget everything ``node`` said (it restarted, or a resync begins)."""
        self._vals &= ~np.uint64(0xF << (BITS * node))

    # ---- the table --------------------------------------------------------------------------

    def _home(self, keys: np.ndarray) -> np.ndarray:
        """First slot of each key: Fibonacci hashing (the top bits of key * 2^64/phi), so keys
        that differ only in a few bits (trace ids, not hashes) do not pile up in one run."""
        shift = np.uint64(64 - (self._keys.size.bit_length() - 1))
        return (keys * _GOLDEN) >> shift

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key, -1 where absent."""
        out = np.full(keys.size, -1, dtype=np.int64)
        mask = np.uint64(self._keys.size - 1)
        slot = self._home(keys)
        pending = np.arange(keys.size)
        while pending.size:
            cur = self._keys[slot]
            hit = cur == keys[pending]
            out[pending[hit]] = slot[hit].astype(np.int64)
            go = ~hit & (cur != 0)  # occupied by another key: probe on; empty: a miss
            pending = pending[go]
            slot = (slot[go] + np.uint64(1)) & mask
        return out

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key, inserting the missing ones (duplicates in ``keys`` allowed)."""
        keys = _nonzero(keys)
        uniq, inverse = np.unique(keys, return_inverse=True)
        if (self._used + uniq.size) > _FILL * self._keys.size:
            self._resize(uniq.size)
        out = np.empty(uniq.size, dtype=np.int64)
        mask = np.uint64(self._keys.size - 1)
        slot = self._home(uniq)
        pending = np.arange(uniq.size)
        while pending.size:
            cur = self._keys[slot]
            hit = cur == uniq[pending]
            out[pending[hit]] = slot[hit].astype(np.int64)
            empty = np.flatnonzero(cur == 0)
            if empty.size:
                # Several keys may reach one empty slot in one probe step: the first takes it, the
                # others find it taken by another key at the step after and probe on.
                taken, first = np.unique(slot[empty], return_index=True)
                winners = pending[empty[first]]
                self._keys[taken] = uniq[winners]
                out[winners] = taken.astype(np.int64)
                self._used += int(taken.size)
                won = np.zeros(pending.size, dtype=bool)
                won[empty[first]] = True
                go = ~hit & ~won
            else:
                go = ~hit
            pending = pending[go]
            slot = (slot[go] + np.uint64(1)) & mask
        return out[inverse]

    def _resize(self, extra: int) -> None:
        """Drop emptied slots; grow until the live keys and ``extra`` more fit."""
        live = self._vals != 0
        keys, vals = self._keys[live], self._vals[live]
        cap = self._keys.size
        while keys.size + extra > _FILL * cap:
            cap *= 2
        self._keys = np.zeros(cap, dtype=np.uint64)
        self._vals = np.zeros(cap, dtype=np.uint64)
        self._used = 0
        if keys.size:
            self._vals[self._slots(keys)] = vals


def _nonzero(keys: np.ndarray) -> np.ndarray:
    """Key 0 marks an empty slot: the one hash whose first 8 bytes are 0 is stored as 1."""
    keys = np.asarray(keys, dtype=np.uint64)
    return np.where(keys == 0, np.uint64(1), keys)
