"""Two-part blocks for sliding-window and hybrid models, on top of the store's public API.

A model whose layers mix full attention with sliding-window attention (SWA) is stored as two
namespaces (``docs/hybrid.md``):

- the **full part** (``HybridNamespaces.full``): the full-attention layers' KV of every block,
  keyed by the usual chained block hashes. Every hit needs it for every block before its end.
- the **state part** (``HybridNamespaces.state``), for recurrent layers (Mamba, linear
  attention, short convolutions): their fixed-size state at a checkpoint's boundary, one block
  per checkpoint keyed by :meth:`HybridNamespaces.state_key`, under the checkpoint's full block.
- the **window part** (``HybridNamespaces.window``): the SWA layers' KV of a block (a *window
  piece*), stored only for the ``k = window_blocks`` blocks before each *checkpoint*: the
  sliding layers' whole state at a block boundary is the ``window - 1`` tokens before it.
  Block ``j``'s piece is keyed by :meth:`HybridNamespaces.window_key` (a hash of the window
  namespace's root and block ``j``'s chained hash, so it names the whole prefix too) and its
  parent in the radix index is block ``j``'s full part (``window_chain``): the store's
  prefix-closure then guarantees that a piece leaves the store before the full part under it,
  never the reverse. A model with no full-attention layer (all SWA) has no full part; its
  pieces are chains of length 1 under the window namespace's root.

Block ``i`` is a checkpoint while the pieces of blocks ``i-k+1..i`` (and its state) are cached; checkpoints
close together share pieces, so the window bytes are those of the union of the windows (at
most every block's, never more). A hit ends at a checkpoint: :func:`find_checkpoint` returns
the nearest one at or before the end of the cached full part; the engine loads the full part up
to it and its pieces and recomputes the blocks after it (at most ``every_blocks - 1`` of them
when the periodic checkpoints are cached: *bounded replay*).

Works on any object with the store's ``register_namespace`` / ``lookup`` / ``get_into`` /
``put``: the in-process :class:`kvstore.store.KVStore` or a daemon client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import xxhash

from kvstore.api import KVCacheAPI
from kvstore.errors import UsageError
from kvstore.keys import (
    BlockHash,
    Namespace,
    hash_blocks,
    split_layout,
    state_layout,
    window_blocks,
)

WINDOW_SUFFIX = "#swa-window"
"""Appended to the model id of the window namespace: its descriptor differs from the full
part's by more than the layout, so tools that compare a model's registered layouts (restart,
``kvctl``) do not report the pair as a layout mismatch."""

STATE_SUFFIX = "#state"
"""Appended to the model id of the state namespace (recurrent layers' state at checkpoints)."""

_WINDOW_TAG = b"kvstore.swa-window.v1\0"
_STATE_TAG = b"kvstore.recurrent-state.v1\0"


StoreAPI = KVCacheAPI[Any]
"""The in-process :class:`kvstore.store.KVStore` or a daemon client."""


@dataclass(frozen=True, slots=True)
class HybridNamespaces:
    """The part namespaces (full, window, state) of one model deployment."""

    model: Namespace
    """The model's own descriptor, with every layer group (what a store-everything engine uses)."""
    full: Namespace | None
    window: Namespace | None
    state: Namespace | None = None
    """Recurrent layers' state (Mamba, linear attention, short convolutions): one block per
    checkpoint, keyed by :meth:`state_key`, under the checkpoint's full block."""
    _key_prefix: bytes = field(init=False, repr=False, compare=False, default=b"")
    _state_prefix: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        if self.window is not None:
            object.__setattr__(self, "_key_prefix", _WINDOW_TAG + bytes(self.window.root))
        if self.state is not None:
            object.__setattr__(self, "_state_prefix", _STATE_TAG + bytes(self.state.root))

    @classmethod
    def of(cls, ns: Namespace) -> HybridNamespaces:
        """Split ``ns`` (its layout has ``sliding`` or ``recurrent`` groups) into its parts."""
        full_layout, window_layout = split_layout(ns.layout)
        states = state_layout(ns.layout)
        if window_layout is None and states is None:
            raise UsageError(
                f"namespace of {ns.model_id!r} has no 'sliding' or 'recurrent' layer group: store "
                "it as one namespace (the hybrid split pays off only for those layers)"
            )
        full = replace(ns, layout=full_layout) if full_layout is not None else None
        window = replace(ns, model_id=ns.model_id + WINDOW_SUFFIX, layout=window_layout) if window_layout else None
        state = replace(ns, model_id=ns.model_id + STATE_SUFFIX, layout=states) if states else None
        return cls(ns, full, window, state)

    @property
    def block_tokens(self) -> int:
        return self.model.block_tokens

    @property
    def window_blocks(self) -> int:
        """Pieces a checkpoint needs: the blocks its ``window - 1`` tokens reach into."""
        return window_blocks(self.model.layout)

    @property
    def window_tokens(self) -> int:
        """Tokens of sliding-layer state at a block boundary: the largest window minus one."""
        return max((g.window for g in self.model.layout.groups if g.kind == "sliding"), default=1) - 1

    def checkpoint_blocks(self, i: int) -> range:
        """The blocks whose pieces checkpoint ``i`` needs."""
        return range(max(0, i - self.window_blocks + 1), i + 1)

    @property
    def chain_ns(self) -> Namespace:
        """The namespace the chained block hashes are rooted in: the full part's (its blocks are
        stored under those hashes), or the model's for an all-SWA model (whose window blocks
        are keyed by hashes of those hashes)."""
        return self.full if self.full is not None else self.model

    def parts(self) -> list[Namespace]:
        return [ns for ns in (self.full, self.window, self.state) if ns is not None]

    def register(self, store: StoreAPI, ttl_s: float | None = None) -> None:
        for ns in self.parts():
            store.register_namespace(ns, ttl_s)

    def hashes(self, tokens: Any, extra_keys: bytes | Sequence[bytes] | None = None) -> list[BlockHash]:
        return hash_blocks(self.chain_ns, tokens, extra_keys)

    def window_key(self, block_hash: bytes) -> BlockHash:
        """The key of the window piece of the block whose chained hash is ``block_hash``."""
        return BlockHash(xxhash.xxh3_128_digest(self._key_prefix + bytes(block_hash)))

    def window_chain(self, hashes: Sequence[bytes], i: int) -> list[bytes]:
        """The chain to ``put`` block ``i``'s window piece with (``start=len(chain) - 1``):
        under its full block when there is a full part, alone otherwise."""
        return self._under(hashes, i, self.window_key(hashes[i]))

    def state_key(self, block_hash: bytes) -> BlockHash:
        """The key of the recurrent state at the end of the block whose hash is ``block_hash``."""
        return BlockHash(xxhash.xxh3_128_digest(self._state_prefix + bytes(block_hash)))

    def state_chain(self, hashes: Sequence[bytes], i: int) -> list[bytes]:
        """The chain to ``put`` checkpoint ``i``'s recurrent state with, like :meth:`window_chain`."""
        return self._under(hashes, i, self.state_key(hashes[i]))

    def _under(self, hashes: Sequence[bytes], i: int, key: BlockHash) -> list[bytes]:
        return [key] if self.full is None else [*hashes[: i + 1], key]


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """Where windows are stored: the last full block of each stored prompt (``at_end``) and
    every ``every_blocks``-th block of a chain (blocks ``C-1, 2C-1, ...``, 0-based).

    ``every_blocks`` (C) bounds the replay of a hit: with the periodic checkpoints cached, at
    most C - 1 cached blocks are recomputed after the checkpoint a hit ends on. Smaller C: less
    replay, more window bytes (one window per C blocks).
    """

    every_blocks: int = 16
    at_end: bool = True
    at_hits: bool = True
    """Also where a hit's cached full part ended past its checkpoint: the engine replayed up to
    there and holds that window, so it stores it and the next hit that ends there (the same
    document with another question, a branch of a conversation) replays nothing."""
    max_probes: int = 0
    """Candidates :func:`find_checkpoint` may try; 0: ``every_blocks + 8``."""

    def __post_init__(self) -> None:
        if self.every_blocks <= 0:
            raise UsageError(f"every_blocks must be > 0 (blocks between checkpoints), got {self.every_blocks}")
        if self.max_probes < 0:
            raise UsageError(f"max_probes must be >= 0, got {self.max_probes}")

    def is_periodic(self, i: int) -> bool:
        return (i + 1) % self.every_blocks == 0

    def new_checkpoints(self, first: int, last: int) -> list[int]:
        """Checkpoints among blocks ``first..last`` (the blocks a prefill computed; ``last`` is
        the prompt's last full block)."""
        c = self.every_blocks
        out = list(range(((first + 1 + c - 1) // c) * c - 1, last + 1, c))
        if self.at_end and last >= first and (not out or out[-1] != last):
            out.append(last)
        return [i for i in out if i >= first]

    def probe_order(self, n: int) -> list[int]:
        """Candidate checkpoints for a hit whose cached full part is blocks ``0..n-1``, nearest
        first: every block down to the last periodic checkpoint (a prompt's end can be anywhere),
        then the periodic ones below; at most ``max_probes`` of them."""
        limit = self.max_probes or self.every_blocks + 8
        c = self.every_blocks
        top = n - 1
        periodic = ((top + 1) // c) * c - 1
        order = list(range(top, max(periodic, -1), -1))
        order += range(periodic, -1, -c)
        return order[:limit]


@dataclass(frozen=True, slots=True)
class HybridLookup:
    """Where a prompt's hit ends in a hybrid store."""

    full_blocks: int
    """Leading blocks whose full part is cached (for an all-SWA or all-recurrent model, which has
    no full part: every block asked about)."""
    checkpoint: int
    """The nearest cached checkpoint among them, or -1: load blocks ``0..checkpoint``."""

    @property
    def replay_blocks(self) -> int:
        """Cached blocks after the checkpoint, which the engine recomputes (0 without a full part)."""
        return self.full_blocks - self.checkpoint - 1 if self.checkpoint >= 0 else self.full_blocks


def lookup(store: StoreAPI, hyb: HybridNamespaces, hashes: Sequence[bytes], policy: CheckpointPolicy) -> HybridLookup:
    """The longest cached full-part prefix of ``hashes`` and the nearest checkpoint at or before
    its end. Changes nothing."""
    n = store.lookup(hyb.full, hashes).num_blocks if hyb.full is not None else len(hashes)
    c = find_checkpoint(store, hyb, hashes, n, policy)
    return HybridLookup(n if hyb.full is not None else max(c + 1, 0), c)


def find_checkpoint(store: StoreAPI, hyb: HybridNamespaces, hashes: Sequence[bytes], n: int, policy: CheckpointPolicy) -> int:
    """The nearest cached checkpoint among blocks ``0..n-1`` (their full part is cached), or -1.

    One ``lookup`` per part and candidate, nearest first (:meth:`CheckpointPolicy.probe_order`), of the
    candidate's piece keys in reverse order: the store's match counts the leading cached keys,
    so a short count names the missing piece, and every candidate whose window holds it is
    skipped. The usual multi-turn hit (the previous prompt's end) is found by the first lookup.
    """
    below = n  # candidates at or above a known missing piece cannot be checkpoints
    for i in policy.probe_order(n):
        if i >= below:
            continue
        if hyb.window is not None:
            keys = [hyb.window_key(hashes[j]) for j in reversed(hyb.checkpoint_blocks(i))]
            m = store.lookup(hyb.window, keys).num_blocks
            if m < len(keys):
                below = i - m  # block i - m has no piece: no checkpoint from there to i + k - 1
                continue
        if hyb.state is not None and not store.lookup(hyb.state, [hyb.state_key(hashes[i])]).num_blocks:
            continue
        return i
    return -1
