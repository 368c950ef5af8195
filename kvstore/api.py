"""The store's public API: the :class:`KVCacheAPI` protocol and its result types.

Two classes implement it: :class:`kvstore.store.KVStore` (in process) and
:class:`kvstore.client.Client` (a daemon over shared memory, TCP or UCX). Code written against
``KVCacheAPI`` runs on either; ``tests/api/`` runs one suite against both, and checks that their
signatures match this protocol's.

A leaf module: it imports nothing of the store, so engines, the daemon and the client can use
these types without pulling in the store core.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, TypeVar, runtime_checkable

import numpy as np

from kvstore.errors import LayoutMismatchError
from kvstore.keys import Namespace


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How many leading blocks of a prompt are cached, and in which tier each one is."""

    num_blocks: int
    block_tokens: int
    tiers: tuple[str, ...]
    """Fastest tier holding each cached block."""
    unavailable: tuple[str, ...] = ()
    """Tiers that cannot be reached now (a remote store is down): blocks held only there are
    not counted, so the engine recomputes them instead of waiting on a timeout."""

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_tokens


@dataclass(slots=True, eq=False)
class Lease:
    """Leading cached blocks held in the shared-memory arena of the first tier for a reader
    that maps it (``kvstore.shm.attach_arena(arena)``); see :meth:`KVStore.acquire`.

    Block ``i`` is at ``locations[i] = (offset, size)`` of the arena. While the lease is held the
    blocks are *in use*: they neither move nor leave, so their bytes stay put. Give it back with
    :meth:`KVStore.release` (a second release is a no-op).
    """

    arena: str
    locations: tuple[tuple[int, int], ...]
    _ids: np.ndarray = field(repr=False)
    _released: bool = field(default=False, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.locations)


@dataclass(frozen=True, slots=True)
class ArenaPeek:
    """Where the arena held the leading blocks of a prompt at one instant, *without holding
    them* (:meth:`KVStore.peek_arena`): a reader may start copying them at once, and keeps
    the copy only for the blocks :meth:`KVStore.confirm_peek` confirms once it holds a lease."""

    arena: str
    locations: tuple[tuple[int, int], ...]
    stamp: int
    """The arena's count of freed slots when the locations were read."""

    @property
    def num_blocks(self) -> int:
        return len(self.locations)


def field_diffs(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """``(dotted key, a's value, b's value)`` of every field where two nested dicts differ."""
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            yield from field_diffs(va, vb, f"{prefix}{k}.")
        elif va != vb:
            yield f"{prefix}{k}", va, vb


def layout_mismatch(registered: Namespace, asked: Namespace) -> LayoutMismatchError:
    """The error for using ``asked`` while the same model deployment is registered as
    ``registered`` with another layout: its blocks are not interchangeable."""
    diffs = [f"{k}: registered {a!r}, asked {b!r}" for k, a, b in field_diffs(registered.to_dict(), asked.to_dict())]
    return LayoutMismatchError(
        f"namespace for model {asked.model_id!r} differs from the registered one "
        f"({'; '.join(diffs)}); its blocks are not interchangeable. Register this "
        "namespace explicitly if both layouts are meant to be cached."
    )


@runtime_checkable
class LeaseLike(Protocol):
    """What every lease says: the arena (shared-memory name, for ``kvstore.shm.attach_arena``)
    and each held block's ``(offset, size)`` in it. :class:`Lease` (in process) and
    ``kvstore.client.ClientLease`` (which adds read-only ``views`` of the blocks) are leases."""

    @property
    def arena(self) -> str: ...
    @property
    def locations(self) -> tuple[tuple[int, int], ...]: ...
    @property
    def num_blocks(self) -> int: ...


@runtime_checkable
class PinLike(Protocol):
    """What every pin says: the namespace (``Namespace.root`` as the caller registered it), the
    pinned prefix's length in blocks, and its deadline (wall-clock seconds; None: until
    unpinned). :class:`kvstore.retention.PinRecord` (in process, with the block hashes) and
    ``kvstore.client.ClientPin`` (a daemon's tenant view, without them) are pins."""

    @property
    def ns(self) -> bytes: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def until(self) -> float | None: ...


L = TypeVar("L", bound=LeaseLike)


@runtime_checkable
class KVCacheAPI(Protocol[L]):
    """The KV-cache store as an engine sees it; ``L`` is the implementation's lease type.

    Blocks are named by their chain hashes (:func:`kvstore.keys.hash_blocks`); the store is
    prefix-closed, so every answer is about the *leading* blocks of ``hashes``. Errors are the
    classes of :mod:`kvstore.errors`, the same from both implementations (the client raises the
    class the daemon's reply names). Differences that remain, by design: a client registers a
    namespace on its first use (the store raises UnknownNamespaceError; both raise
    LayoutMismatchError when the deployment is registered with another layout), :meth:`acquire` on a
    client needs the shared-memory plane (UsageError otherwise), and :meth:`stats` of a client
    is the daemon's view for its tenant (``usage``; the store's ``store`` only for an admin).
    The two-phase put (``KVStore.reserve``: arena slots the caller writes, then a commit) is
    not part of it, on purpose: it hands out writable arena memory, and a daemon maps its
    arena read-only into its clients; through a daemon a save is a :meth:`put`.
    """

    def register_namespace(self, ns: Namespace, ttl_s: float | None = None) -> None:
        """Make ``ns`` usable; ``ttl_s`` (default: the store's, or the one it has) applies to its
        blocks. LayoutMismatchError when the deployment is registered with another layout."""
        ...

    def lookup(self, ns: Namespace, hashes: Sequence[bytes]) -> LookupResult:
        """How many leading blocks are cached and where, counting only reachable tiers (those
        that are not are named in ``unavailable``). Changes nothing."""
        ...

    def get_into(self, ns: Namespace, hashes: Sequence[bytes], dst: Any | Sequence[Any]) -> int:
        """Load the leading cached blocks into caller buffers (one of ``k * block_bytes`` bytes
        or ``k`` of ``block_bytes``); returns how many loaded. Block ``i`` is in buffer ``i``."""
        ...

    def put(
        self,
        ns: Namespace,
        hashes: Sequence[bytes],
        blocks: Any | Sequence[Any],
        *,
        start: int = 0,
        durable: bool = False,
        tokens: Any | None = None,
    ) -> int:
        """Store the payloads of ``hashes[start:]`` (blocks before ``start`` must be cached:
        MissingPrefixError); returns how many were new. ``durable``: on a persistent tier,
        synced, when it returns. ``tokens``: the token ids of those blocks (``block_tokens``
        each), for KV event subscribers only (a daemon's ``BlockStored.token_ids``)."""
        ...

    def pin(self, ns: Namespace, hashes: Sequence[bytes], *, until: float | None = None) -> int:
        """Protect the cached prefix from expiry and eviction; returns its length. With ``until``
        a retention guarantee (RetentionError, nothing pinned, when it cannot be given)."""
        ...

    def unpin(self, ns: Namespace, hashes: Sequence[bytes]) -> int:
        """Undo one pin of the longest pinned prefix (a guarantee only whole), else take the
        blocks out of an untimed pin; returns how many blocks were unpinned."""
        ...

    def pins(self) -> Sequence[PinLike]:
        """The pins in force (a daemon's: this tenant's only), in pinning order."""
        ...

    def delete(self, ns: Namespace, hashes: Sequence[bytes]) -> int:
        """Delete these blocks and every cached block extending them (pinned or in-use ones and
        their ancestors stay); returns how many left."""
        ...

    def acquire(self, ns: Namespace, hashes: Sequence[bytes]) -> L:
        """Hold the leading cached blocks in the shared-memory arena (zero copy) until
        :meth:`release`; meanwhile they neither move nor leave."""
        ...

    def release(self, lease: L) -> None:
        """Give back an :meth:`acquire` lease. Idempotent."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters and usage, as a JSON-able dict."""
        ...

    def close(self) -> None:
        """Release everything; a second close is a no-op."""
        ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...
