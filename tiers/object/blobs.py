"""Where the object tier's objects live: the one interface of its local and remote backends.

:class:`~tiers.object.tier.ObjectTier` decides (which objects, their format, capacity, expiry,
what a listing means); a :class:`BlobStore` moves whole objects by path and never decides.
Two implementations:

* :class:`~tiers.object.local.LocalBlobs`: plain files (``file://``): os calls, temp file +
  rename, ``fsync`` when durable, a payload read straight into the caller's buffer;
* :class:`~tiers.object.remote.RemoteBlobs`: any other fsspec URL (S3, GCS, ``memory://``):
  batched concurrent requests behind a circuit breaker, with a bounded queue for writes made
  while the store is unreachable (or write-behind).

Every method takes a batch and answers per item (a value or that item's KVStoreError), so a
remote backend turns a batch into one concurrent round of requests. Thread-safe.
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.block import BlockMeta
from kvstore.clock import Clock
from kvstore.errors import BlockNotFound, ConfigError, KVStoreError, TierIOError
from kvstore.keys import BlockHash
from tiers.object.config import ObjectConfig
from tiers.object.format import Header


@dataclass(frozen=True, slots=True)
class Blob:
    """One object to write: a block's ``key``, where it goes, its bytes (header and stored
    payload) and its payload size (what capacity counts)."""

    key: BlockHash
    path: str
    data: bytes
    size: int


class BlobStore(ABC):
    """Objects by path on one filesystem; see the module docstring.

    Contract: :meth:`write` publishes each object atomically (a reader sees the old object or
    the new one, never a part); :meth:`read_into` and :meth:`headers` verify what they return
    (CorruptBlockError for a damaged object, BlockNotFound for a missing one);
    :meth:`delete` of a missing path is not an error.
    """

    local: bool = False
    """Plain files of this machine: objects can be synced, renamed and quarantined."""
    fs: Any
    """The fsspec filesystem (for tools and tests that look at the objects)."""

    @abstractmethod
    def read_into(self, items: Sequence[tuple[BlockHash, str, memoryview]]) -> list[BlockMeta | KVStoreError]:
        """Each object's verified, decoded payload into its buffer; its header's metadata."""

    @abstractmethod
    def headers(self, items: Sequence[tuple[BlockHash, str]]) -> list[Header | KVStoreError]:
        """Each object's verified header (ranged reads: the payload is not fetched)."""

    @abstractmethod
    def write(self, blobs: Sequence[Blob], *, durable: bool) -> list[KVStoreError | None]:
        """Publish each object; ``durable``: it survives a crash of the machine when this
        returns. A backend may queue a non-durable write (read back by :meth:`queued`)."""

    @abstractmethod
    def delete(self, paths: Sequence[str]) -> None:
        """Remove these objects (missing ones are skipped)."""

    def stats(
        self, prefix: str, vouch: Callable[[str, tuple[int, int, int]], bool] | None = None
    ) -> dict[str, tuple[int, int, int, int] | None] | None:
        """``{path: (size, mtime_ns, ctime_ns, inode)}`` under ``prefix``, a listing that tells
        an object from the one a header manifest recorded (None for the files of a directory
        ``vouch`` accepts: listed, not statted); None (the default) when the backend cannot (a
        remote store: no manifest)."""
        return None

    def dir_stats(self, prefix: str) -> dict[str, tuple[int, int, int]]:
        """``{name: (mtime_ns, ctime_ns, inode)}`` of the directories under ``prefix`` (with
        :meth:`stats`: a backend that keeps a header manifest)."""
        return {}

    def stat_paths(self, paths: Sequence[str]) -> list[tuple[int, int, int, int] | None]:
        """The stat of each object, None where it is gone (with :meth:`stats`)."""
        return [None] * len(paths)

    def header_bytes(self, path: str) -> bytes | None:
        """The header bytes of the object at ``path``, or None (missing, damaged, or a backend
        without manifests)."""
        return None

    @abstractmethod
    def list(self, prefix: str, *, after: str = "", limit: int | None = None) -> dict[str, int]:
        """``{path: size}`` of the objects under ``prefix`` in name order, those after
        ``after``, at most ``limit``."""

    @abstractmethod
    def put_small(self, blobs: dict[str, bytes]) -> builtins.list[bool]:
        """Best-effort writes of small side objects (touch records); whether each was written.
        Never raises."""

    @abstractmethod
    def cat(self, paths: Sequence[str]) -> builtins.list[bytes | None]:
        """Best-effort reads of small side objects: each one's bytes, or None."""

    # ---- defaults: what a backend without a queue, a breaker or files to sync does ----------

    def delete_block(self, key: BlockHash, paths: Sequence[str], *, known: bool) -> bool:
        """Delete a block's object (``paths[0]``) and its side objects; returns whether the
        object existed. ``known``: the tier's maps hold it (else the store is asked first:
        deleting a missing object succeeds on S3, so the answer cannot come from the delete)."""
        existed = known or self._exists(key, paths[0])
        if existed:
            self.delete(paths)
        return existed

    def _exists(self, key: BlockHash, path: str) -> bool:
        (h,) = self.headers([(key, path)])
        if isinstance(h, BlockNotFound):
            return False
        if isinstance(h, TierIOError):
            raise h
        return True  # a header, or a damaged object: either way something is there

    def queued(self, key: BlockHash) -> Blob | None:
        """A write of ``key`` not sent yet (read-your-writes), if any."""
        return None

    def available(self) -> bool:
        """False while the store cannot be reached (no request is made then)."""
        return True

    def drain(self) -> int:
        """Send queued writes; returns how many reached the store."""
        return 0

    def tick(self) -> None:  # noqa: B027
        """Background work of the backend (a trial request, draining the queue)."""

    def quarantine(self, paths: Sequence[str], to: str) -> int:
        """Move damaged objects out of the way to ``to``; how many moved (0: not supported)."""
        return 0

    def age_s(self, path: str) -> float | None:
        """Seconds since the object was last modified, where the backend can tell."""
        return None

    def flush(self) -> None:  # noqa: B027
        """Make every completed write durable."""

    def close(self) -> None:  # noqa: B027
        """Drop what cannot be delivered any more (counted in :meth:`describe`)."""

    def describe(self) -> dict[str, Any]:
        return {"queued_writes": 0, "queued_bytes": 0, "dropped_writes": 0, "drained_writes": 0}


def open_blobs(
    name: str, url: str, config: ObjectConfig, clock: Clock, *, wake: Callable[[], None] | None
) -> tuple[BlobStore, str]:
    """The backend for ``url`` and the base path on it. ``wake``: wakes the tier's worker
    thread, which drains queued writes (given, a remote backend may write behind)."""
    from fsspec.core import url_to_fs

    scheme = url.split("://", 1)[0] if "://" in url else "file"
    options = dict(config.storage_options)
    s3: Any = None
    if scheme in ("s3", "s3a"):
        from tiers.object import s3  # s3fs is an optional extra: import it only when asked for

        options = s3.storage_options(config)
    try:
        fs, base = url_to_fs(url, **options)
    except ImportError as e:
        raise ConfigError(
            f"object tier {name!r}: url {url!r} needs {e.name or 'an fsspec backend'}; "
            "for s3:// run pip install 'kvstore-llm[s3]'"
        ) from e
    except ValueError as e:
        raise ConfigError(f"object tier {name!r}: cannot use url {url!r}: {e}") from e
    base = base.rstrip("/")
    # The backends import this module for the interface: imported here, when a tier opens.
    from tiers.object.local import LocalBlobs
    from tiers.object.remote import RemoteBlobs

    protocol = fs.protocol
    if "file" in ((protocol,) if isinstance(protocol, str) else tuple(protocol)):
        return LocalBlobs(fs, name, base), base
    return RemoteBlobs(fs, name, base, config, clock, s3=s3, wake=wake), base


def window(listed: dict[str, int], after: str, limit: int | None) -> dict[str, int]:
    """The entries of a listing after ``after`` in name order, at most ``limit``."""
    names = sorted(p for p in listed if p > after)[:limit]
    return {p: listed[p] for p in names}
