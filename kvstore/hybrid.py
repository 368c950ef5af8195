"""Two-part blocks for sliding-window and hybrid models, on top of the store's public API.

A model whose layers mix full attention with sliding-window attention (SWA) is stored as two
namespaces (``docs/hybrid.md``):

- the **full part** (``HybridNamespaces.full``): the full-attention layers' KV of every block,
  keyed by the usual chained block hashes. Every hit needs it for every block before its end.
- the **window part** (``HybridNamespaces.window``): the SWA layers' KV of the ``window - 1``
  tokens before a block boundary, stored only at *checkpoints*. The window of checkpoint block
  ``i`` is one block keyed by :meth:`HybridNamespaces.window_key` (a hash of the window
  namespace's root and the chained hash of block ``i``, so it names the whole prefix too). Its
  parent in the radix index is block ``i``'s full part (``window_chain``): the store's
  prefix-closure then guarantees that a window leaves the store before the full part under it,
  never the reverse. A model with no full-attention layer (all SWA) has no full part; its
  windows are chains of length 1 under the window namespace's root.

A hit ends at a checkpoint: :func:`find_checkpoint` returns the nearest checkpoint at or before
the end of the cached full part; the engine loads the full part up to it and its window and
recomputes the blocks after it (at most ``every_blocks`` of them when the periodic checkpoints
are cached: *bounded replay*).

Works on any object with the store's ``register_namespace`` / ``lookup`` / ``get_into`` /
``put``: the in-process :class:`kvstore.store.KVStore` or a daemon client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import xxhash

from kvstore.errors import UsageError
from kvstore.keys import BlockHash, Namespace, hash_blocks, split_layout

WINDOW_SUFFIX = "#swa-window"
"""Appended to the model id of the window namespace: its descriptor differs from the full
part's by more than the layout, so tools that compare a model's registered layouts (restart,
``kvctl``) do not report the pair as a layout mismatch."""

_WINDOW_TAG = b"kvstore.swa-window.v1\0"


class StoreAPI(Protocol):
    def register_namespace(self, ns: Namespace, ttl_s: float | None = None) -> None: ...
    def lookup(self, ns: Namespace, hashes: Sequence[bytes]) -> Any: ...
    def get_into(self, ns: Namespace, hashes: Sequence[bytes], dst: Any) -> int: ...
    def put(self, ns: Namespace, hashes: Sequence[bytes], blocks: Any, *, start: int = 0, durable: bool = False) -> int: ...


@dataclass(frozen=True, slots=True)
class HybridNamespaces:
    """The full-part and window-part namespaces of one model deployment."""

    model: Namespace
    """The model's own descriptor, with every layer group (what a store-everything engine uses)."""
    full: Namespace | None
    window: Namespace | None
    _key_prefix: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        if self.window is not None:
            object.__setattr__(self, "_key_prefix", _WINDOW_TAG + bytes(self.window.root))

    @classmethod
    def of(cls, ns: Namespace) -> HybridNamespaces:
        """Split ``ns`` (its layout has ``sliding`` groups) into its two part namespaces."""
        full_layout, window_layout = split_layout(ns.layout)
        if window_layout is None:
            raise UsageError(
                f"namespace of {ns.model_id!r} has no 'sliding' layer group: store it as one "
                "namespace (a hybrid split only pays off for sliding-window layers)"
            )
        full = replace(ns, layout=full_layout) if full_layout is not None else None
        window = replace(ns, model_id=ns.model_id + WINDOW_SUFFIX, layout=window_layout)
        return cls(ns, full, window)

    @property
    def block_tokens(self) -> int:
        return self.model.block_tokens

    @property
    def window_tokens(self) -> int:
        """Tokens a window block holds: the largest window minus one."""
        assert self.window is not None
        return self.window.block_tokens

    @property
    def chain_ns(self) -> Namespace:
        """The namespace the chained block hashes are rooted in: the full part's (its blocks are
        stored under those hashes), or the model's for an all-SWA model (whose window blocks
        are keyed by hashes of those hashes)."""
        return self.full if self.full is not None else self.model

    def parts(self) -> list[Namespace]:
        return [ns for ns in (self.full, self.window) if ns is not None]

    def register(self, store: StoreAPI, ttl_s: float | None = None) -> None:
        for ns in self.parts():
            store.register_namespace(ns, ttl_s)

    def hashes(self, tokens: Any, extra_keys: bytes | Sequence[bytes] | None = None) -> list[BlockHash]:
        return hash_blocks(self.chain_ns, tokens, extra_keys)

    def window_key(self, block_hash: bytes) -> BlockHash:
        """The key of the window stored at the checkpoint whose last block is ``block_hash``."""
        return BlockHash(xxhash.xxh3_128_digest(self._key_prefix + bytes(block_hash)))

    def window_chain(self, hashes: Sequence[bytes], i: int) -> list[bytes]:
        """The chain to ``put`` checkpoint ``i``'s window with (``start=len(chain) - 1``): under
        its full block when there is a full part, alone otherwise."""
        key = self.window_key(hashes[i])
        if self.full is None:
            return [key]
        return [*hashes[: i + 1], key]


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
    max_probes: int = 0
    """Lookups :func:`find_checkpoint` may make; 0: ``every_blocks + 8``."""

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


def find_checkpoint(store: StoreAPI, hyb: HybridNamespaces, hashes: Sequence[bytes], n: int, policy: CheckpointPolicy) -> int:
    """The nearest cached checkpoint among blocks ``0..n-1`` (their full part is cached), or -1.

    One ``lookup`` per candidate, nearest first (:meth:`CheckpointPolicy.probe_order`); the
    usual multi-turn hit (the previous prompt's end) is found by the first.
    """
    assert hyb.window is not None
    for i in policy.probe_order(n):
        if store.lookup(hyb.window, [hyb.window_key(hashes[i])]).num_blocks:
            return i
    return -1
