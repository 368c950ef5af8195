"""The object tier's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import ConfigError

_TiB = 1024**4
_MiB = 1024**2


@dataclass(frozen=True)
class ObjectConfig:
    """The object tier's options (TOML ``[[tiers]]`` keys, or ``KVSTORE_TIER_<NAME>_<KEY>``).
    S3 fields left empty fall back to the standard AWS environment and config files."""

    url: str = ""
    """Where objects live (``s3://bucket/prefix``, ``file:///path``); empty is ``file://<tier
    dir>/objects``, private to this store. Any explicit URL is treated as shared with other
    nodes."""
    capacity_bytes: int = _TiB
    """Payload bytes this node may keep there."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to the fsspec filesystem as is (wins over the S3 fields below)."""
    # S3 (s3:// URLs). Empty values fall back to the standard AWS environment and config files.
    endpoint_url: str = ""
    """S3: the endpoint (``http://127.0.0.1:7480`` for a RADOS Gateway, MinIO, ...); empty: AWS."""
    region: str = ""
    """S3: the region; empty: ``AWS_REGION`` / the AWS config file."""
    access_key_id: str = ""
    """S3: the access key; empty: the standard AWS environment and config files."""
    secret_access_key: str = field(default="", repr=False)
    """S3: the secret key (never printed); better from ``KVSTORE_TIER_<NAME>_SECRET_ACCESS_KEY`` or
    the AWS environment than in the file."""
    session_token: str = field(default="", repr=False)
    """S3: a temporary session token (never printed)."""
    profile: str = ""
    """S3: a profile of the AWS config files."""
    connect_timeout_s: float = 2.0
    """S3: seconds to connect before a request fails."""
    read_timeout_s: float = 10.0
    """S3: seconds to wait for a reply's bytes before a request fails."""
    max_attempts: int = 2
    """Attempts per request, the first included (botocore's standard retry mode)."""
    request_deadline_s: float = 0.0
    """Hard bound on one request, retries included (0: ``max_attempts x (connect_timeout_s +
    read_timeout_s)``). botocore's read timeout is not armed while aiohttp waits for the
    ``100 Continue`` of a PUT, so a hung server would otherwise hold a write forever."""
    max_concurrency: int = 16
    """Requests of one batch in flight at once."""
    # Outages (remote URLs).
    breaker_failures: int = 3
    """Consecutive failed batches that make the tier unavailable."""
    breaker_retry_s: float = 5.0
    """How long an unavailable tier waits before one trial request."""
    write_queue_bytes: int = 64 * _MiB
    """Non-durable writes held while the store is unreachable; past this they are dropped."""
    write_behind: bool = True
    """Remote URLs: a non-durable write (a demotion) is queued and sent by the background
    thread at once, so the store never waits on the network under its lock; a write that does
    not fit in the queue is sent synchronously. Durable writes are always synchronous, and so
    is every write when there is no background thread (``worker_interval_s = 0``)."""
    # Sharing.
    discover_max_blocks: int = 64
    """On a lookup miss, how many further blocks a shared tier may be probed for (0: never)."""
    # Expiry.
    sweep_interval_s: float = 600.0
    """How often the background sweeper runs (0: only when :meth:`ObjectTier.sweep` is called)."""
    sweep_work_cap: int = 1000
    """Objects a sweep pass may examine."""
    touch_min_s: float = 3600.0
    """A refreshed expiry is written back only when it moves by at least this much."""
    lifecycle_days: int = 0
    """S3 only: install a bucket lifecycle rule deleting objects this many days after writing."""
    manifest: bool = True
    """Local objects only: write a header manifest at close (``tiers/object/manifest.py``), so
    that the next warm restart reads one file instead of every object's header."""
    worker_interval_s: float = 1.0
    """Tick of the background thread (breaker trial, queue drain, sweeps); 0: no thread, the
    owner calls :meth:`ObjectTier.tick`."""
    # Compression.
    compress_namespaces: tuple[str, ...] = ()
    """Namespaces whose blocks are byte-shuffled and zstd-compressed here: model ids, namespace
    digests (hex), or ``"*"`` for every namespace."""
    compress_level: int = 1
    """zstd level (1..22) of ``compress_namespaces``' blocks."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise ConfigError(
                f"object url must be a string like 's3://bucket/kv', got {self.url!r}"
            )
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise ConfigError(
                f"object capacity_bytes must be a positive size like '1TiB', got {self.capacity_bytes!r}"
            )
        if not isinstance(self.storage_options, dict):
            raise ConfigError(
                "object storage_options must be a table of fsspec options "
                f"(e.g. {{endpoint_url = '...'}}), got {self.storage_options!r}"
            )
        names = self.compress_namespaces
        if isinstance(names, str):  # from the environment: "model-a,model-b"
            names = tuple(n.strip() for n in names.split(",") if n.strip())
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise ConfigError(
                "object compress_namespaces must be a list of model ids, namespace digests "
                f"(hex) or '*', got {names!r}"
            )
        object.__setattr__(self, "compress_namespaces", tuple(names))
        positive = ("connect_timeout_s", "read_timeout_s", "max_attempts", "max_concurrency",
                    "breaker_failures", "write_queue_bytes", "sweep_work_cap")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"object {name} must be positive, got {getattr(self, name)!r}")
        non_negative = ("request_deadline_s", "breaker_retry_s", "discover_max_blocks", "sweep_interval_s",
                        "touch_min_s", "lifecycle_days", "worker_interval_s")
        for name in non_negative:
            if not getattr(self, name) >= 0:
                raise ConfigError(f"object {name} must be >= 0, got {getattr(self, name)!r}")
        if not 1 <= self.compress_level <= 22:
            raise ConfigError(f"object compress_level must be 1..22 (zstd), got {self.compress_level}")
