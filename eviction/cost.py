"""The recompute cost model: what a miss costs, what holding and loading a block costs.

A block of ``B`` tokens at depth ``d`` (its position in the prefix chain) covers the positions
``[dB, (d+1)B)``. Prefilling a token at position ``p`` costs ``2 * params`` FLOPs in the linear
layers plus ``4 * layers * attn_dim * ctx(p)`` in attention (``QK^T`` and ``AV``, two FLOPs per
multiply-add, over ``ctx(p)`` keys), where ``ctx(p) = p + 1`` for full and MLA attention and
``min(p + 1, window)`` for sliding-window attention. So a deep block costs more to recompute than a
shallow one, and a hit on it saves more.

Bytes per block come from the KV layout (:class:`kvstore.keys.KVLayout`). Tiers cost time to load
a byte from (``load_bytes_per_s``, measured figures from docs/benchmarks.md and the design notes)
and a relative price to hold one (``hold_cost``, DRAM = 1); the cost-aware policy weighs a hit by
the time it saves over the next cheaper alternative, per byte held, per unit of holding price.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import ConfigError
from kvstore.keys import KVLayout, LayerGroup

ATTENTION_KINDS = ("full", "mla", "sliding")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What prefill FLOPs depend on. ``params``: parameters active per token, embeddings
    excluded; ``attn_dim``: query heads x head dim (0: ``hidden``)."""

    params: float
    layers: int
    hidden: int
    attention: str = "full"
    window: int = 0
    attn_dim: int = 0
    layout: KVLayout | None = None
    """The model's KV layout with 1-token blocks (block tokens are the caller's choice)."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}")
        if self.params <= 0 or self.layers <= 0 or self.hidden <= 0:
            raise ConfigError("params, layers and hidden must be positive")
        if self.attention == "sliding" and self.window <= 0:
            raise ConfigError("sliding attention needs window > 0 (tokens)")

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layout.bytes_per_token if self.layout is not None else 0


def _layout(dtype: str, *groups: LayerGroup) -> KVLayout:
    return KVLayout(dtype, 1, groups)


MODELS: dict[str, ModelShape] = {
    # 8.03B parameters, of which 0.53B are the (untied) embedding and LM head.
    "llama-3-8b": ModelShape(7.5e9, 32, 4096, layout=_layout("bfloat16", LayerGroup("full", 32, 8, 128))),
    "llama-3-70b": ModelShape(69e9, 80, 8192, layout=_layout("bfloat16", LayerGroup("full", 80, 8, 128))),
    # MoE: 37B parameters active per token; MLA keeps a 512 + 64 latent per token and layer.
    "deepseek-v3": ModelShape(
        37e9, 61, 7168, attention="mla", attn_dim=128 * 192,
        layout=_layout("bfloat16", LayerGroup("mla", 61, latent_dim=512, rope_dim=64)),
    ),
}


@dataclass(frozen=True, slots=True)
class TierCost:
    load_bytes_per_s: float
    hold_cost: float
    """Relative price of holding a byte for a unit of time (DRAM = 1)."""


# Nominal production figures; the development VMs measure less (NVMe 1.4-1.5 GB/s, S3 on
# loopback 130-170 MB/s), at which a 64 MiB Llama-3-8B block loads slower than it recomputes.
TIER_COSTS: dict[str, TierCost] = {
    "hbm": TierCost(2e12, 10.0),
    "dram": TierCost(50e9, 1.0),  # pinned host-to-device copies: 55 GB/s measured on an H200
    "null": TierCost(50e9, 1.0),  # the replay's stand-in: priced like DRAM
    "nvme": TierCost(6e9, 0.05),  # one PCIe 4.0 drive, O_DIRECT
    "object": TierCost(1e9, 0.01),  # parallel ranged GETs from one node
    "s3": TierCost(1e9, 0.01),
}
_DEFAULT_TIER = TierCost(50e9, 1.0)


@dataclass(frozen=True, slots=True)
class CostModel:
    model: ModelShape
    block_tokens: int
    flops_per_s: float = 4e14
    """Effective prefill throughput: 2 x 7.5e9 x 25k tokens/s, Llama-3-8B on one H200."""
    tiers: dict[str, TierCost] = field(default_factory=lambda: dict(TIER_COSTS))

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ConfigError(f"block_tokens must be positive, got {self.block_tokens}")
        if self.flops_per_s <= 0:
            raise ConfigError(f"flops_per_s must be positive, got {self.flops_per_s}")

    @classmethod
    def for_model(cls, name: str, block_tokens: int, flops_per_s: float = 4e14) -> CostModel:
        try:
            shape = MODELS[name]
        except KeyError:
            raise ConfigError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None
        return cls(shape, block_tokens, flops_per_s)

    @property
    def block_bytes(self) -> int:
        return self.model.kv_bytes_per_token * self.block_tokens

    def token_flops(self, positions: np.ndarray) -> np.ndarray:
        """Prefill FLOPs of the tokens at 0-based ``positions``."""
        m = self.model
        ctx = np.asarray(positions, dtype=np.float64) + 1.0
        if m.attention == "sliding":
            ctx = np.minimum(ctx, m.window)
        return 2.0 * m.params + 4.0 * m.layers * (m.attn_dim or m.hidden) * ctx

    def block_flops(self, depths: np.ndarray | int, tokens: np.ndarray | int | None = None) -> np.ndarray:
        """Prefill FLOPs of the blocks at ``depths`` (of ``tokens`` tokens each; default full)."""
        d = np.asarray(depths, dtype=np.float64)
        n = np.full_like(d, self.block_tokens) if tokens is None else np.asarray(tokens, np.float64)
        m = self.model
        start = d * self.block_tokens  # ctx of the block's tokens: start+1 .. start+n
        if m.attention == "sliding":
            ctx_sum = _sliding_ctx_sum(start, n, m.window)
        else:
            ctx_sum = n * start + n * (n + 1) / 2
        return 2.0 * m.params * n + 4.0 * m.layers * (m.attn_dim or m.hidden) * ctx_sum

    def prefix_flops(self, tokens: np.ndarray | int) -> np.ndarray:
        """Prefill FLOPs of a prompt's first ``tokens`` tokens."""
        return self.block_flops(np.zeros(np.shape(tokens)), tokens)

    def recompute_seconds(self, depths: np.ndarray | int) -> np.ndarray:
        return self.block_flops(depths) / self.flops_per_s

    def tier(self, kind: str) -> TierCost:
        return self.tiers.get(kind, _DEFAULT_TIER)

    def load_seconds(self, nbytes: float, kind: str) -> float:
        return nbytes / self.tier(kind).load_bytes_per_s

    def hit_value(self, depths: np.ndarray, nbytes: float, kind: str, next_kind: str) -> np.ndarray:
        """Seconds a hit saves per byte-unit of holding price, for blocks kept in tier ``kind``.

        On the last tier (``next_kind`` empty) the alternative to a hit is recomputing; above
        it, loading from the tier below: the same for every block of a size, so it scales the
        tier's ranking by reuse without changing it. Where the tier below loads as fast (tiers
        priced alike, such as the replay's null tiers) a hit saves no load time; the value is
        then one second per byte-unit, not zero, which would tie every block and erase the
        ranking (every new block would be the next victim: the tier would keep old blocks
        before reused ones).
        """
        here = self.load_seconds(nbytes, kind)
        if next_kind:
            saved = np.full(np.shape(depths), max(self.load_seconds(nbytes, next_kind) - here, 0.0) or 1.0)
        else:
            saved = np.maximum(self.recompute_seconds(depths) - here, 0.0)
        return saved / (max(nbytes, 1.0) * self.tier(kind).hold_cost)


def _sliding_ctx_sum(start: np.ndarray, n: np.ndarray, window: int) -> np.ndarray:
    """Sum over t in [start+1, start+n] of min(t, window)."""
    lo, hi = start + 1, start + n
    below_hi = np.minimum(hi, window)
    part1 = np.where(below_hi >= lo, (lo + below_hi) * (below_hi - lo + 1) / 2, 0.0)
    part2 = np.maximum(hi - np.maximum(lo, window + 1) + 1, 0.0) * window
    return part1 + part2
