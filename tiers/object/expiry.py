"""Expiry on the object tier: touches (refreshed expiry written back) and the sweeper.

Objects are immutable, so a block's expiry in its header is the one it was written with. A hit
refreshes it in the store's index; :meth:`Expiry.update_expiry` writes the refreshed time
back as a small touch object beside the block, rate-limited by ``touch_min_s``. The sweeper
deletes an object once both its header expiry and its touch (if any) have passed: it walks the
whole bucket, so it also expires blocks other nodes wrote and no index holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvstore.clock import Clock
from kvstore.keys import BlockHash
from tiers.object.blobs import BlobStore
from tiers.object.config import ObjectConfig
from tiers.object.format import (
    SUFFIX,
    TOUCH_SUFFIX,
    Header,
    key_of,
    pack_touch,
    unpack_touch,
)

log = logging.getLogger(__name__)


class Expiry:
    """Touches and the sweeper of an :class:`~tiers.object.tier.ObjectTier`, which owns one
    and calls it. It owns the sweep's position; the maps (``key -> payload size``, the
    effective expiry, the keys with a touch object), their lock and the counters are the
    tier's, handed in here, as are the tier's object paths and how it forgets deleted keys.
    The tier checks that it is open and listed before it calls."""

    def __init__(
        self,
        *,
        name: str,
        config: ObjectConfig,
        clock: Clock,
        blobs: BlobStore,
        blocks_dir: str,
        lock: threading.Lock,
        sizes: dict[BlockHash, int],
        expiry: dict[BlockHash, float],
        touched: set[BlockHash],
        counters: Any,
        path: Callable[[BlockHash], str],
        touch_path: Callable[[BlockHash], str],
        forget: Callable[[Iterable[BlockHash]], None],
    ) -> None:
        self.name = name
        self.config = config
        self._clock = clock
        self.blobs = blobs
        self._blocks = blocks_dir
        self._lock = lock
        self._sizes = sizes
        self._expiry = expiry
        self._touched = touched
        self._counters = counters
        self.path = path
        self.touch_path = touch_path
        self._forget = forget
        self._sweep_after = ""  # where the next sweep resumes, in name order

    def update_expiry(self, items: Iterable[tuple[BlockHash, float]]) -> None:
        """Write refreshed expiry times back as small touch objects, in one batch.

        Only keys this tier knows, and only when the expiry moves by ``touch_min_s`` or more: a
        hit refreshes every block of its prefix, and one small PUT per block per hit would cost
        more than the blocks. Never raises: a touch that cannot be written (the store is
        unreachable) only shortens a block's life, and is counted (``touches_dropped``).
        """
        pending: dict[BlockHash, float] = {}
        with self._lock:
            for key, expiry in items:
                known = self._expiry.get(key)
                if known is not None and expiry >= known + self.config.touch_min_s:
                    pending[key] = float(expiry)
        if not pending:
            return
        paths = {self.touch_path(k): pack_touch(k, e) for k, e in pending.items()}
        results = self.blobs.put_small(paths)
        written = [k for k, ok in zip(pending, results, strict=True) if ok]
        with self._lock:
            for key in written:
                if key in self._sizes:
                    self._expiry[key] = max(self._expiry.get(key, 0.0), pending[key])
                    self._touched.add(key)
            self._counters.touches_written += len(written)
            self._counters.touches_dropped += len(pending) - len(written)

    def read_touches(self, listed: Iterable[str]) -> dict[BlockHash, float]:
        """``{key: expiry}`` from the touch objects at ``listed`` (damaged ones ignored)."""
        paths = [p for p in listed if p.endswith(TOUCH_SUFFIX)]
        keys = [key_of(p.removesuffix(TOUCH_SUFFIX) + SUFFIX) for p in paths]
        pairs = [(k, p) for k, p in zip(keys, paths, strict=True) if k is not None]
        if not pairs:
            return {}
        blobs = self.blobs.cat([p for _, p in pairs])
        out: dict[BlockHash, float] = {}
        for (k, _), blob in zip(pairs, blobs, strict=True):
            if blob is not None and (e := unpack_touch(blob, k)) is not None:
                out[k] = e
        return out

    def sweep(self, limit: int | None = None) -> int:
        """Delete objects whose expiry has passed; returns how many were deleted.

        Examines at most ``limit`` (default ``sweep_work_cap``) objects, in name order from where
        the previous pass stopped (on S3 one LIST per 1,000, resumed with StartAfter), and starts
        over once it reaches the end. Expiry comes from the in-memory map when this tier knows
        the block, else from its header; a later touch (this node's or another's) always wins.
        """
        budget = self.config.sweep_work_cap if limit is None else limit
        listed = list(self.blobs.list(self._blocks, after=self._sweep_after, limit=budget))
        self._sweep_after = listed[-1] if len(listed) == budget else ""
        names = [p for p in listed if p.endswith(SUFFIX)]
        deleted = self._sweep_paths(names, self._clock())
        with self._lock:
            c = self._counters
            c.sweeps += 1
            c.sweep_examined += len(names)
            c.expired_deleted += deleted
        return deleted

    def _sweep_paths(self, paths: Sequence[str], now: float) -> int:
        keys = [k for p in paths if (k := key_of(p)) is not None]
        with self._lock:
            expiry = {k: self._expiry[k] for k in keys if k in self._expiry}
        unknown = [k for k in keys if k not in expiry]
        for k, h in zip(unknown, self.blobs.headers([(k, self.path(k)) for k in unknown]), strict=True):
            if isinstance(h, Header):
                expiry[k] = h.meta.expiry
        candidates = [k for k, e in expiry.items() if e <= now]
        touches = self.read_touches(self.touch_path(k) for k in candidates)
        expired = [k for k in candidates if touches.get(k, 0.0) <= now]
        if not expired:
            return 0
        self.blobs.delete([self.path(k) for k in expired] + [self.touch_path(k) for k in expired])
        self._forget(expired)
        log.info("object tier %r: swept %d expired objects", self.name, len(expired))
        return len(expired)
