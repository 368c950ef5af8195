"""A tier wrapper that fails on purpose, for tests of the store's error paths.

``FaultyTier(inner)`` behaves exactly like ``inner`` until a fault is armed::

    faulty = FaultyTier(tier)
    faulty.inject("write", TierIOError, times=1)                   # the next write fails
    faulty.inject("read_into", CorruptBlockError, when=lambda k: k == key)  # every read of key
    faulty.inject("write", TierFullError, after=3, times=None)     # all writes after the 3rd

A fault raises *before* the inner tier is called, so a failed write leaves nothing behind and a
failed delete deletes nothing, as the Tier contract requires of real failures. ``read_many``
and ``write_many`` go through :meth:`read_into` / :meth:`write` key by key, so faults land on
single blocks of a batch.

Not in the registry: it wraps a tier that the test built, it is not configured.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.block import BlockMeta
from kvstore.buffers import Buffer
from kvstore.errors import KVStoreError, UsageError
from kvstore.keys import BlockHash
from tiers.base import Arena, Tier, TierUsage

OPERATIONS = (
    "contains",
    "read_into",
    "write",
    "delete",
    "usage",
    "fits",
    "meta",
    "scan",
    "register_namespace",
    "update_expiry",
    "flush",
    "probe",
)

KeyPredicate = Callable[[BlockHash | None], bool]


@dataclass(slots=True)
class Fault:
    """One armed fault. ``seen`` counts matching calls, ``fired`` the errors raised."""

    op: str
    error: type[KVStoreError] | KVStoreError
    when: KeyPredicate | None = None
    after: int = 0
    times: int | None = 1
    seen: int = 0
    fired: int = 0

    @property
    def spent(self) -> bool:
        return self.times is not None and self.fired >= self.times

    def make_error(self, key: BlockHash | None) -> KVStoreError:
        if isinstance(self.error, KVStoreError):
            return self.error
        where = f" on block {key.hex()}" if key is not None else ""
        return self.error(f"injected fault: {self.op}{where} ({self.error.__name__})")


class FaultyTier(Tier):
    """Wraps ``inner``; see the module docstring. Other attributes (``shm_name``, ``path``, ...)
    are the inner tier's. Thread-safe: arming and firing faults take a lock."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner.name)
        self.inner = inner
        # Instance attributes shadow the class-level ones: the wrapper reports what it wraps,
        # so that the store treats it exactly like the inner tier.
        self.kind = inner.kind  # type: ignore[misc]  # shadows the ClassVar on purpose
        self.persistent = inner.persistent  # type: ignore[misc]  # shadows the ClassVar on purpose
        self.shared = inner.shared
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        """Calls per operation, faulted or not."""
        self.injected: list[tuple[str, BlockHash | None]] = []
        """``(operation, key)`` of every fault that fired, in order."""

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the wrapper lacks: the inner tier's extras.
        if name == "inner":  # not set yet (during __init__ or unpickling): avoid recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def arena(self) -> Arena | None:
        """The inner tier's: reads and writes in place bypass the wrapper (no fault fires there)."""
        return self.inner.arena()

    # ---- arming --------------------------------------------------------------------------------

    def inject(
        self,
        op: str,
        error: type[KVStoreError] | KVStoreError,
        *,
        times: int | None = 1,
        after: int = 0,
        when: KeyPredicate | None = None,
    ) -> Fault:
        """Arm a fault on ``op`` (one of :data:`OPERATIONS`).

        The first ``after`` matching calls pass; the next ``times`` raise ``error`` (a class,
        instantiated with a message naming the block, or an instance raised as is);
        ``times=None`` raises forever. ``when(key)`` selects the calls that match (``key`` is
        None for operations without one); without it every call matches. The first armed
        fault that fires wins.
        """
        if op not in OPERATIONS:
            raise UsageError(f"cannot inject into {op!r}; choose one of {', '.join(OPERATIONS)}")
        if not (
            isinstance(error, KVStoreError)
            or (isinstance(error, type) and issubclass(error, KVStoreError))
        ):
            raise UsageError(f"inject a KVStoreError (class or instance), not {error!r}")
        if after < 0 or (times is not None and times < 1):
            raise UsageError("after must be >= 0 and times >= 1 (or None for forever)")
        fault = Fault(op, error, when, after, times)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        """Disarm every fault (counters and the ``injected`` log stay)."""
        with self._lock:
            self._faults.clear()

    def _check(self, op: str, key: BlockHash | None = None) -> None:
        err: KVStoreError | None = None
        with self._lock:
            self.calls[op] += 1
            for fault in self._faults:
                if (
                    fault.op != op
                    or fault.spent
                    or (fault.when is not None and not fault.when(key))
                ):
                    continue
                fault.seen += 1
                if fault.seen <= fault.after:
                    continue
                fault.fired += 1
                self.injected.append((op, key))
                err = fault.make_error(key)
                break
        if err is not None:
            raise err

    # ---- Tier, delegated -------------------------------------------------------------------------

    def contains(self, key: BlockHash) -> bool:
        self._check("contains", key)
        return self.inner.contains(key)

    def read_into(self, key: BlockHash, dst: memoryview) -> int:
        self._check("read_into", key)
        return self.inner.read_into(key, dst)

    def write(self, key: BlockHash, src: Buffer, meta: BlockMeta, *, durable: bool = False) -> None:
        self._check("write", key)
        self.inner.write(key, src, meta, durable=durable)

    def delete(self, key: BlockHash) -> bool:
        self._check("delete", key)
        return self.inner.delete(key)

    def usage(self) -> TierUsage:
        self._check("usage")
        return self.inner.usage()

    def fits(self, size: int) -> bool:
        self._check("fits")
        return self.inner.fits(size)

    def size_class(self, size: int) -> int:
        return self.inner.size_class(size)

    def meta(self, key: BlockHash) -> BlockMeta | None:
        self._check("meta", key)
        return self.inner.meta(key)

    def scan(self) -> Iterator[tuple[BlockHash, BlockMeta]]:
        self._check("scan")
        return self.inner.scan()

    def register_namespace(self, digest: bytes, descriptor: bytes) -> None:
        self._check("register_namespace")
        self.inner.register_namespace(digest, descriptor)

    def update_expiry(self, items: Iterable[tuple[BlockHash, float]]) -> None:
        self._check("update_expiry")
        self.inner.update_expiry(items)

    def flush(self) -> None:
        self._check("flush")
        self.inner.flush()

    def available(self) -> bool:
        return self.inner.available()

    def namespaces(self) -> dict[bytes, bytes]:
        return self.inner.namespaces()

    def probe(self, keys: Sequence[BlockHash]) -> list[BlockMeta]:
        self._check("probe", keys[0] if keys else None)
        return self.inner.probe(keys)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> dict[str, Any]:
        d = self.inner.describe()
        d["faults_injected"] = len(self.injected)
        return d
