"""Keys: the namespace descriptor and chained block hashes.

A block hash identifies a block *and its whole prefix*::

    h_0 = root = xxh3_128(canonical namespace descriptor)
    h_i = xxh3_128(h_{i-1} || token ids of block i as little-endian int32 || extra keys)

Only full blocks are hashed. Everything that changes what a block's KV holds (model, revision,
KV layout, parallel rank, LoRA, tenant salt, hash algorithm, schema version) is in the namespace
and so in every hash: two engines that disagree on any of it can never share a block.

The hashes are pinned by golden vectors in ``tests/kvstore/test_keys.py``; changing this module's
output is a schema change (bump :data:`SCHEMA_VERSION`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NewType, cast

import numpy as np
import xxhash

from kvstore.errors import UsageError

SCHEMA_VERSION = 1
HASH_BYTES = 16
MAX_FIELD_BYTES = 1024
"""A string field of a namespace (model id, revision, LoRA id, salt) holds at most this many
bytes of UTF-8: a descriptor travels in every object header and in ``namespaces.json``."""

BlockHash = NewType("BlockHash", bytes)
"""16 bytes: a block and its whole prefix."""

_HASHERS = {"xxh3_128": xxhash.xxh3_128_digest}

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

ATTENTION_KINDS = ("full", "mla", "sliding", "recurrent")


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers that share one attention kind and KV shape.

    ``full``: K and V of ``kv_heads`` x ``head_dim`` per token and layer.
    ``mla``: one latent vector of ``latent_dim + rope_dim`` per token and layer (DeepSeek MLA).
    ``sliding``: like ``full``, but attention only reaches back ``window`` tokens, so a hit needs
    only the blocks inside the window (``docs/hybrid.md``: the store keeps only those).
    ``recurrent``: no per-token KV; a fixed-size state per sequence of ``latent_dim`` elements per
    layer (Mamba, linear attention, short convolutions), stored at checkpoints only.
    """

    kind: str
    num_layers: int
    kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0
    rope_dim: int = 0
    window: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise UsageError(
                f"layer group kind {self.kind!r} is not one of {', '.join(ATTENTION_KINDS)}"
            )
        if self.num_layers <= 0:
            raise UsageError(f"layer group needs num_layers > 0, got {self.num_layers}")
        if self.kind in ("full", "sliding") and (self.kv_heads <= 0 or self.head_dim <= 0):
            raise UsageError(f"a {self.kind!r} layer group needs kv_heads > 0 and head_dim > 0")
        if self.kind == "mla" and self.latent_dim <= 0:
            raise UsageError("an 'mla' layer group needs latent_dim > 0 (kv_lora_rank)")
        if self.kind == "sliding" and self.window <= 0:
            raise UsageError("a 'sliding' layer group needs window > 0 (tokens)")
        if self.kind == "recurrent" and self.latent_dim <= 0:
            raise UsageError("a 'recurrent' layer group needs latent_dim > 0 (state elements per layer)")

    def elements_per_token(self) -> int:
        if self.kind == "recurrent":
            return 0
        if self.kind == "mla":
            return self.num_layers * (self.latent_dim + self.rope_dim)
        return self.num_layers * 2 * self.kv_heads * self.head_dim

    def state_elements(self) -> int:
        """Elements of fixed-size state (not per token): ``recurrent`` groups only."""
        return self.num_layers * self.latent_dim if self.kind == "recurrent" else 0


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one block's payload holds: dtype, tokens per block and the layer groups."""

    dtype: str
    block_tokens: int
    groups: tuple[LayerGroup, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise UsageError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if self.block_tokens <= 0:
            raise UsageError(f"block_tokens must be > 0, got {self.block_tokens}")
        if not self.groups:
            raise UsageError("a KV layout needs at least one layer group")
        object.__setattr__(self, "groups", tuple(self.groups))

    @property
    def bytes_per_token(self) -> int:
        return DTYPE_BYTES[self.dtype] * sum(g.elements_per_token() for g in self.groups)

    @property
    def state_bytes(self) -> int:
        """Bytes of the fixed-size state of the ``recurrent`` groups (0 without)."""
        return DTYPE_BYTES[self.dtype] * sum(g.state_elements() for g in self.groups)

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one full block (with the state at its end, for recurrent groups)."""
        return self.bytes_per_token * self.block_tokens + self.state_bytes

    @property
    def num_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)


@dataclass(frozen=True, slots=True)
class Namespace:
    """A versioned namespace descriptor; its digest is the root of every block hash in it."""

    model_id: str
    layout: KVLayout
    model_revision: str = "main"
    rank: int = 0
    world_size: int = 1
    lora_id: str = ""
    tenant_salt: str = ""
    hash_algo: str = "xxh3_128"
    schema_version: int = SCHEMA_VERSION
    _root: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        if not self.model_id:
            raise UsageError("a namespace needs a model_id")
        for name in ("model_id", "model_revision", "lora_id", "tenant_salt", "hash_algo"):
            _check_text(name, getattr(self, name))
        if self.hash_algo not in _HASHERS:
            raise UsageError(
                f"hash_algo {self.hash_algo!r} is not supported; use one of {', '.join(_HASHERS)}"
            )
        if not 0 <= self.rank < self.world_size:
            raise UsageError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.schema_version != SCHEMA_VERSION:
            raise UsageError(
                f"namespace schema_version {self.schema_version} is not this build's "
                f"{SCHEMA_VERSION}; blocks written under it cannot be read by this version"
            )
        object.__setattr__(self, "_root", _HASHERS[self.hash_algo](self.canonical_bytes()))

    @property
    def root(self) -> BlockHash:
        """The namespace digest: the parent hash of every block at depth 0."""
        return BlockHash(self._root)

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_root")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Namespace:
        d = dict(d)
        layout = dict(d.pop("layout"))
        groups = tuple(LayerGroup(**g) for g in layout.pop("groups"))
        return cls(layout=KVLayout(groups=groups, **layout), **d)

    def canonical_bytes(self) -> bytes:
        """A stable encoding: sorted-key compact JSON. Changing it changes every hash."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def model_key(self) -> tuple[str, str, int, int, str, str]:
        """The fields that name a model deployment, without its layout (for mismatch reports)."""
        return (
            self.model_id,
            self.model_revision,
            self.rank,
            self.world_size,
            self.lora_id,
            self.tenant_salt,
        )


def _check_text(name: str, value: object) -> None:
    """A descriptor's string field must survive every place it is written: JSON replies (UTF-8,
    so no lone surrogate), ``namespaces.json``, object headers and logs (no control characters),
    within :data:`MAX_FIELD_BYTES`."""
    if not isinstance(value, str):
        raise UsageError(f"namespace {name} must be a string, got {type(value).__name__}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(
            f"namespace {name} {value[:40]!r} is not valid Unicode text (a lone surrogate); "
            "send the id as UTF-8"
        ) from None
    if len(raw) > MAX_FIELD_BYTES:
        raise UsageError(f"namespace {name} has {len(raw)} bytes of UTF-8, over the limit of {MAX_FIELD_BYTES}")
    if not value.isprintable():
        raise UsageError(f"namespace {name} {value[:40]!r} holds control characters; use printable text")


def _token_bytes(tokens: Any) -> np.ndarray:
    """Token ids as a 1-D little-endian int32 array, without a per-token Python loop."""
    if type(tokens).__module__.startswith("torch"):
        tokens = tokens.detach().to("cpu").numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise UsageError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype("<i4")
    if arr.dtype.kind not in "iu":
        raise UsageError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.dtype("<i4"):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -(2**31) or hi >= 2**31:
            raise UsageError(f"token ids must fit in int32, got range [{lo}, {hi}]")
        arr = arr.astype("<i4")
    return np.ascontiguousarray(arr)


def hash_blocks(
    ns: Namespace,
    tokens: Any,
    extra_keys: bytes | Sequence[bytes] | None = None,
    *,
    parent: bytes | None = None,
) -> list[BlockHash]:
    """Chained hashes of every *full* block of ``tokens`` under ``ns``.

    ``tokens``: a list, numpy array or torch tensor of token ids. ``extra_keys``: bytes appended
    to every block (e.g. a multimodal content hash), or one bytes per full block. ``parent``:
    the hash of the block these tokens follow, to go on with a chain hashed in parts
    (``hash_blocks(ns, t[:k * bt]) + hash_blocks(ns, t[k * bt:], parent=<its last hash>)`` is
    ``hash_blocks(ns, t)``); None starts at the namespace's root.
    """
    tok = _token_bytes(tokens)
    bt = ns.layout.block_tokens
    n = tok.size // bt
    if n == 0:
        return []
    hasher = _HASHERS[ns.hash_algo]
    if extra_keys is not None and not isinstance(extra_keys, bytes | bytearray):  # one per block
        extras = list(extra_keys)
        if len(extras) < n:
            raise UsageError(f"extra_keys has {len(extras)} entries for {n} full blocks")
        blocks = tok[: n * bt].view(np.uint8).reshape(n, bt * 4)
        chain: list[BlockHash] = []
        prev = ns.root if parent is None else bytes(parent)
        for i in range(n):
            prev = BlockHash(hasher(prev + blocks[i].tobytes() + bytes(extras[i])))
            chain.append(prev)
        return chain
    extra = bytes(extra_keys or b"")
    # One bytes object for all tokens; per block only a slice, a concatenation and the hash
    # (measured faster than writing the parent into preallocated rows through a memoryview).
    tb = tok[: n * bt].tobytes()
    step = bt * 4
    out: list[bytes] = []
    append = out.append
    prev = ns.root if parent is None else bytes(parent)
    for off in range(0, n * step, step):
        prev = hasher(prev + tb[off : off + step] + extra)
        append(prev)
    return cast("list[BlockHash]", out)  # BlockHash is bytes (no per-block wrapping)


def split_layout(layout: KVLayout) -> tuple[KVLayout | None, KVLayout | None]:
    """A hybrid layout as the two parts a hybrid store keeps (``docs/hybrid.md``).

    The *full part*: every ``full`` and ``mla`` group (every hit needs it for every block). The
    *window part*: every ``sliding`` group, per block too, but stored only for the blocks inside
    the window of a checkpoint (:func:`window_blocks` of them before each). Either part is None
    when the layout has no group of that kind. ``recurrent`` groups are in neither: see
    :func:`state_layout`.
    """
    full = tuple(g for g in layout.groups if g.kind in ("full", "mla"))
    sliding = tuple(g for g in layout.groups if g.kind == "sliding")
    full_part = KVLayout(layout.dtype, layout.block_tokens, full) if full else None
    window_part = KVLayout(layout.dtype, layout.block_tokens, sliding) if sliding else None
    return full_part, window_part


def state_layout(layout: KVLayout) -> KVLayout | None:
    """The *state part* of a hybrid layout: its ``recurrent`` groups, one state per checkpoint
    (``block_bytes`` is the state's size). None without recurrent groups."""
    groups = tuple(g for g in layout.groups if g.kind == "recurrent")
    return KVLayout(layout.dtype, layout.block_tokens, groups) if groups else None


def window_blocks(layout: KVLayout) -> int:
    """Blocks before a block boundary that a later token's sliding window reaches: a token
    attends to itself and the ``window - 1`` tokens before it, so the state at a boundary is
    the ``window - 1`` tokens before it (the largest window's, if the groups differ). 0 without
    sliding groups."""
    windows = [g.window for g in layout.groups if g.kind == "sliding"]
    if not windows:
        return 0
    return max(1, -(-(max(windows) - 1) // layout.block_tokens))
