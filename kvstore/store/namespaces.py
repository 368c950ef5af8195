"""The store's namespace table: registration, the layout-mismatch check, ``namespaces.json``.

The index keeps a namespace as a small integer (its ``ns`` column is 16 bits), so the table is
bounded by ``StoreConfig.max_namespaces`` (at most :data:`MAX_NAMESPACES`): a registration past
it is refused with a clear error instead of overflowing the column. The file is written *outside*
the store lock (two fsyncs must not stall every lookup) and only when a registration changed
what it holds. A damaged file is moved aside (``namespaces.json.corrupt-<time>``), logged and
counted, and the store starts without it, as the tiers do with their own damaged metadata.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.api import layout_mismatch
from kvstore.config import MAX_NAMESPACES
from kvstore.errors import (
    KVStoreError,
    QuotaExceededError,
    UnknownNamespaceError,
)
from kvstore.inspection import layout_conflicts
from kvstore.keys import Namespace

log = logging.getLogger("kvstore.store")

NAMESPACES_FILE = "namespaces.json"


def read_namespaces(root: Path) -> list[tuple[Namespace, float]]:
    """The registered namespaces and their TTLs saved under a store's ``root`` (none if absent).
    Raises KVStoreError for a damaged file (read-only tools report it; the store quarantines)."""
    path = root / NAMESPACES_FILE
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise KVStoreError(f"cannot read {path}: {e}; restore it or remove it to re-register") from e
    try:
        return [(Namespace.from_dict(e["namespace"]), float(e["ttl_s"])) for e in entries]
    except (TypeError, KeyError, ValueError, AttributeError) as e:  # UsageError is a ValueError
        raise KVStoreError(f"cannot read {path}: malformed entry ({e!r}); restore it or remove it to re-register") from e


@dataclass(slots=True)
class NsInfo:
    nid: int
    digest: bytes
    namespace: Namespace | None  # None: seen on a persistent tier, not registered yet
    ttl_s: float
    # Traffic of this namespace since the store opened (per-namespace and token counters).
    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    load_blocks: int = 0
    hit_blocks: int = 0
    hits_by_tier: Counter[str] = field(default_factory=Counter)
    _bb_of: Namespace | None = None
    _bb: int = 0

    @property
    def block_bytes(self) -> int:
        """The registered namespace's block bytes, computed once (the layout's property sums
        its groups at every call; the data path asks per request)."""
        ns = self.namespace
        if ns is not self._bb_of:
            if ns is None:
                raise RuntimeError(f"namespace {self.digest.hex()} is not registered")
            self._bb_of, self._bb = ns, ns.block_bytes
        return self._bb

    def traffic(self) -> dict[str, Any]:
        bt = self.namespace.block_tokens if self.namespace is not None else 0
        return {
            "ns": self.digest.hex(), "model_id": self.namespace.model_id if self.namespace else None,
            "block_tokens": bt, "lookup_blocks": self.lookup_blocks, "lookup_hit_blocks": self.lookup_hit_blocks,
            "load_blocks": self.load_blocks, "hit_blocks": self.hit_blocks,
            "hit_tokens_by_tier": {k: v * bt for k, v in self.hits_by_tier.items()},
        }


_RECENT_CONFLICTS = 16


class NamespaceTable:
    """Namespaces by digest and by index id. Callers hold the store lock around every method
    except :meth:`save`, which takes only the table's own file lock."""

    def __init__(self, root: Path, limit: int, write: Callable[[Path, bytes], None]) -> None:
        self._path = root / NAMESPACES_FILE
        self._limit = limit
        self._write = write
        self._file_lock = threading.Lock()
        self._version = 0  # bumped by every change the file should show
        self._saved = 0
        self.by_digest: dict[bytes, NsInfo] = {}
        self.by_id: list[NsInfo] = []
        self.quarantined = 0
        self.layout_conflicts = 0  # registrations that met another layout of their deployment
        self.recent_conflicts: deque[dict[str, Any]] = deque(maxlen=_RECENT_CONFLICTS)

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[NsInfo]:
        return iter(self.by_id)

    def load(self) -> None:
        """Read the file at open; a damaged one is moved aside and the store starts without it."""
        try:
            entries = read_namespaces(self._path.parent)
        except KVStoreError as e:
            aside = self._path.with_name(f"{self._path.name}.corrupt-{int(time.time())}")
            try:
                self._path.rename(aside)
            except OSError as err:
                raise KVStoreError(f"{e}; moving it aside to {aside} failed too: {err.strerror}") from err
            self.quarantined += 1
            log.error("%s: moved to %s; namespaces re-register as engines connect", e, aside)
            return
        for ns, ttl_s in entries:
            if ns.root not in self.by_digest:
                self.add(ns.root, ns, ttl_s)
        self._saved = self._version

    def add(self, digest: bytes, ns: Namespace | None, ttl_s: float, *, new: bool = False) -> NsInfo:
        """A namespace entry. ``new``: a registration, held to ``max_namespaces``; what the
        store already holds (its file, its tiers' blocks) only to what the index can tell apart."""
        limit = self._limit if new else MAX_NAMESPACES
        if len(self.by_id) >= limit:
            raise QuotaExceededError(
                f"the store holds {len(self.by_id)} namespaces, its limit (max_namespaces = "
                f"{limit}); reuse an existing namespace or raise [store] max_namespaces "
                f"(at most {MAX_NAMESPACES})"
            )
        info = NsInfo(len(self.by_id), digest, ns, float(ttl_s))
        self.by_id.append(info)
        self.by_digest[digest] = info
        if ns is not None:
            self._version += 1
        return info

    def register(self, ns: Namespace, ttl_s: float | None, default_ttl_s: float) -> tuple[NsInfo, bool]:
        """Add or update ``ns``; returns its entry and whether the file must change."""
        info = self.by_digest.get(ns.root)
        if info is None:
            return self.add(ns.root, ns, default_ttl_s if ttl_s is None else ttl_s, new=True), True
        if ttl_s is None:
            ttl_s = info.ttl_s if info.namespace is not None else default_ttl_s
        changed = info.namespace != ns or info.ttl_s != float(ttl_s)
        info.namespace, info.ttl_s = ns, float(ttl_s)
        if changed:
            self._version += 1
        return info, changed

    def conflicts(self, ns: Namespace, holds_blocks: Callable[[int], bool] | None = None) -> list[Namespace]:
        """Registered namespaces of ``ns``'s model deployment (model id, revision, rank, LoRA,
        salt) with another layout: their blocks and ``ns``'s never hit each other. With
        ``holds_blocks`` (a namespace's ``nid`` -> whether it has a cached block), only those
        that hold blocks: an empty one (an engine that registered and stored nothing, say one
        whose start failed on another block size) costs no hit, so it is no conflict."""
        key = ns.model_key()
        return [i.namespace for i in self.by_id
                if i.namespace is not None and i.digest != ns.root and i.namespace.model_key() == key
                and (holds_blocks is None or holds_blocks(i.nid))]

    def note_conflicts(self, ns: Namespace, holds_blocks: Callable[[int], bool] | None = None) -> list[dict[str, Any]]:
        """After registering ``ns``: count and remember its layout conflicts, as warnings
        (:func:`kvstore.inspection.layout_conflicts`); empty when there are none."""
        warnings = layout_conflicts(ns, self.conflicts(ns, holds_blocks))
        if warnings:
            self.layout_conflicts += 1
            self.recent_conflicts.extend(warnings)
        return warnings

    def learned(self, digest: bytes, ns: Namespace, ttl_s: float) -> NsInfo:
        """A namespace found in a persistent tier's own data (a cold rebuild)."""
        info = self.by_digest.get(digest)
        if info is None:
            return self.add(digest, ns, ttl_s)
        info.namespace = ns
        self._version += 1
        return info

    def get(self, ns: Namespace) -> NsInfo:
        """The registered entry of ``ns``; UnknownNamespaceError or LayoutMismatchError."""
        info = self.by_digest.get(ns.root)
        if info is not None and info.namespace is not None:
            return info
        for other in self.by_id:
            if other.namespace is not None and other.namespace.model_key() == ns.model_key():
                raise layout_mismatch(other.namespace, ns)
        raise UnknownNamespaceError(
            f"namespace {ns.root.hex()} (model {ns.model_id!r}) is not registered; "
            "call store.register_namespace(ns) first"
        )

    def registered(self) -> list[tuple[Namespace, float]]:
        return [(i.namespace, i.ttl_s) for i in self.by_id if i.namespace is not None]

    def snapshot(self) -> tuple[int, bytes] | None:
        """Under the store lock: the file's new content and its version, or None if unchanged."""
        if self._version == self._saved:
            return None
        entries = [{"namespace": ns.to_dict(), "ttl_s": ttl} for ns, ttl in self.registered()]
        return self._version, json.dumps(entries, indent=1).encode()

    def save(self, snap: tuple[int, bytes] | None) -> None:
        """Outside the store lock: write a :meth:`snapshot` unless a newer one is on disk."""
        if snap is None:
            return
        version, data = snap
        with self._file_lock:
            if version <= self._saved:
                return
            self._write(self._path, data)
            self._saved = version

