"""The connector's settings, read from ``kv_connector_extra_config`` once and validated."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any

from kvstore.client.client import PLANES
from kvstore.errors import ConfigError

LOAD_MODES = ("async", "layerwise")
SLIDING_MODES = ("auto", "window", "every_layer")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` keys (all optional)."""

    url: str = ""
    """The daemon (default ``$KVSTORE_URL``, else http://127.0.0.1:7070)."""
    token: str = ""
    """Bearer token of this tenant (default ``$KVSTORE_TOKEN``)."""
    plane: str = "auto"
    """Data plane: auto (shared memory on the daemon's node, else TCP), shm, tcp, ucx."""
    model_id: str = ""
    """The namespace's model id (default: vLLM's served model name / model path)."""
    model_revision: str = ""
    """The namespace's revision (default: vLLM's ``revision``, else ``main``)."""
    ttl_s: float = 0.0
    """TTL of this engine's blocks in seconds (0: the daemon's default)."""
    load_mode: str = "async"
    """``async``: loads run between scheduler steps (the scheduler never waits on the store);
    ``layerwise``: loads run during the forward pass, each attention layer waiting only for its
    own layer."""
    save: bool = True
    """Store new full prompt blocks (False: a read-only consumer)."""
    min_load_blocks: int = 1
    """Load only when at least this many blocks beyond vLLM's own prefix hit are in kvstore."""
    known_s: float = 30.0
    """A prompt that vLLM's own prefix cache holds whole (nothing kvstore could load) skips the
    lookup when kvstore was seen holding its blocks (a lookup's answer or this engine's save) less
    than this many seconds ago; the lookup only decided what to save again (blocks the daemon lost
    while vLLM kept them), which then waits at most this long. 0: a lookup for every request."""
    lookup_timeout_s: float = 0.5
    """Socket timeout of the scheduler's lookups: a daemon slower than this is treated as down."""
    load_timeout_s: float = 2.0
    save_timeout_s: float = 10.0
    max_pending_saves: int = 8
    """Saves in flight per worker; a save past it is dropped and counted (never waited for)."""
    backoff_s: float = 0.5
    """First wait before reconnecting to a daemon that failed; doubles up to ``max_backoff_s``."""
    max_backoff_s: float = 10.0
    layer_group: int = 4
    """``layerwise`` loads: layers copied to the device per DMA tile (a smaller group makes the
    first layer ready sooner; ``async`` loads copy whole blocks)."""
    piece_bytes: int = 128 << 20
    """Bytes of one DMA tile of a load, and of one piece of a save (a GPU's device-to-host copy
    into the daemon's staging segment, put while the next piece crosses the link)."""
    stage_bytes: int = 512 << 20
    """Device staging of a GPU load: a ring of ``stage_bytes // piece_bytes`` tiles."""
    lease_head_bytes: int = 32 << 20
    """``async`` loads over shared memory: the lease is taken in chunks, the first of this many
    bytes and each next four times larger, and a chunk's copies are queued as soon as its lease
    is back, so the later leases overlap the first copies (0: one lease per request)."""
    lease_at_lookup: bool = True
    """Over shared memory with tensor parallel degree 1: the scheduler's lookup also leases the
    blocks the daemon's arena holds (one round trip, ``engine.vllm.leases``), so the worker's
    copies start without an ACQUIRE of their own; given back once they have landed, or at the
    end of the step when the request does not load then. False: the worker leases them itself."""
    page_kernel: bool = False
    """Copy every layer's pages in one Triton kernel launch (``engine.pagecopy``: a load tile's
    scatter, a save's gather) where Triton is installed and the layers share one dtype and
    strides, checked against torch's bytes once at start; else a kernel a layer. Off by default
    until its GPU figures are in ``docs/benchmarks.md``."""
    device_puts: bool = True
    """On a GPU with the daemon on this node: saves by PUT_DEVICE (the daemon copies the pages
    from the GPU into its arena: no host copy), where the daemon offers it; False: through the
    connection's staging segment."""
    sliding: str = "auto"
    """Sliding-window layers (Mistral, Gemma 2/3, gpt-oss): ``window``: stored only as window
    pieces at checkpoints (``kvstore.hybrid``: a hit ends at a checkpoint, vLLM recomputes at
    most ``checkpoint_every_blocks - 1`` blocks past it; needs vLLM's prefix cache off);
    ``every_layer``: every layer of every block, as for a dense model; ``auto``: ``window`` when
    vLLM's prefix cache is off, else ``every_layer``."""
    checkpoint_every_blocks: int = 16
    """``window``: a checkpoint every this many blocks of a prompt (C: the replay bound). Recurrent
    state is stored where vLLM keeps it: C is then vLLM's ``--prefix-cache-retention-interval``
    over the block size."""
    checkpoint_at_end: bool = True
    """``window``: a checkpoint at each stored prompt's last full block."""
    checkpoint_at_hits: bool = True
    """``window``: a checkpoint where a hit's cached blocks ended past its checkpoint (the next
    hit that ends there replays nothing)."""
    block_format: str = "vllm"
    """How a layer's page is laid out in a stored block: ``vllm`` (vLLM's page, ``[H][N][K then
    V]``, a namespace of its own) or ``kvstore`` (the store's own K/V planes, the reference
    engines': with the same ``model_id`` and revision, this engine and ``engine.reference.hybrid`` /
    ``engine.hf`` share blocks; dense pages only)."""
    load_failure_policy: str = "recompute"
    """What vLLM does with a block that failed to load: ``recompute`` (kvstore sets vLLM's
    ``kv_load_failure_policy`` to it) or ``fail`` (keep vLLM's own setting)."""

    def __post_init__(self) -> None:
        if self.plane not in PLANES:
            raise ConfigError(f"kv_connector_extra_config.plane must be one of {', '.join(PLANES)}, got {self.plane!r}")
        if self.load_mode not in LOAD_MODES:
            raise ConfigError(
                f"kv_connector_extra_config.load_mode must be one of {', '.join(LOAD_MODES)}, got {self.load_mode!r}"
            )
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(
                "kv_connector_extra_config.load_failure_policy must be 'recompute' or 'fail', "
                f"got {self.load_failure_policy!r}"
            )
        for name in ("lookup_timeout_s", "load_timeout_s", "save_timeout_s", "backoff_s", "max_backoff_s"):
            v = getattr(self, name)
            if not v > 0:
                raise ConfigError(f"kv_connector_extra_config.{name} must be > 0 seconds, got {v!r}")
        if self.known_s < 0:
            raise ConfigError(f"kv_connector_extra_config.known_s must be >= 0 seconds, got {self.known_s!r}")
        if self.ttl_s < 0:
            raise ConfigError(f"kv_connector_extra_config.ttl_s must be >= 0 seconds, got {self.ttl_s!r}")
        if self.max_backoff_s < self.backoff_s:
            raise ConfigError("kv_connector_extra_config.max_backoff_s must be >= backoff_s")
        if self.sliding not in SLIDING_MODES:
            raise ConfigError(
                f"kv_connector_extra_config.sliding must be one of {', '.join(SLIDING_MODES)}, got {self.sliding!r}"
            )
        if self.block_format not in ("vllm", "kvstore"):
            raise ConfigError(
                f"kv_connector_extra_config.block_format must be 'vllm' or 'kvstore', got {self.block_format!r}"
            )
        if self.stage_bytes < self.piece_bytes:
            raise ConfigError("kv_connector_extra_config.stage_bytes must be >= piece_bytes")
        if self.lease_head_bytes < 0:
            raise ConfigError(f"kv_connector_extra_config.lease_head_bytes must be >= 0, got {self.lease_head_bytes!r}")
        for name in ("min_load_blocks", "max_pending_saves", "layer_group", "piece_bytes", "checkpoint_every_blocks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"kv_connector_extra_config.{name} must be >= 1, got {getattr(self, name)!r}")

    @property
    def daemon_url(self) -> str:
        return self.url or os.environ.get("KVSTORE_URL", "http://127.0.0.1:7070")

    @property
    def daemon_token(self) -> str | None:
        return self.token or os.environ.get("KVSTORE_TOKEN") or None

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; an unknown key or a value of the wrong type is a
        :class:`ConfigError` naming the key and the known ones."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown key(s) {', '.join(unknown)}; "
                f"kvstore's connector knows {', '.join(known)}"
            )
        values: dict[str, Any] = {}
        for key, raw in extra.items():
            default = known[key].default
            values[key] = _coerce(key, raw, type(default))
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(key: str, raw: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0", "yes", "no"):
            return raw.lower() in ("true", "1", "yes")
        raise ConfigError(f"kv_connector_extra_config.{key} must be true or false, got {raw!r}")
    if kind in (int, float):
        if isinstance(raw, bool):
            raise ConfigError(f"kv_connector_extra_config.{key} must be a number, got {raw!r}")
        try:
            value = kind(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"kv_connector_extra_config.{key} must be a number, got {raw!r}") from None
        if kind is int and isinstance(raw, float) and raw != value:
            raise ConfigError(f"kv_connector_extra_config.{key} must be a whole number, got {raw!r}")
        return value
    if not isinstance(raw, str):
        raise ConfigError(f"kv_connector_extra_config.{key} must be a string, got {raw!r}")
    return raw
