"""Cost-aware eviction: hit density weighted by what a hit is worth on this tier.

A block's rank is ``predicted reuse x value of a hit / (bytes x holding price of the tier)``:

* predicted reuse: the learned hit density of :mod:`eviction.density` (hits per unit of
  space-time for the block's class at its age; the age is what ages a block, as the inflation
  value does in GreedyDual, but learned instead of assumed);
* value of a hit (:meth:`eviction.cost.CostModel.hit_value`): on the last tier, the recompute
  time it saves, which grows with the block's depth (attention over a longer prefix), minus the
  time to load it; on a faster tier, the load time it saves over the tier below;
* bytes and the tier's holding price: from the model's KV layout and the tier's kind.

The same blocks-per-namespace size makes bytes a constant within a tier today; it is kept in the
formula so that mixed namespaces rank correctly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eviction.base import BlockView, TierContext
from eviction.cost import MODELS, CostModel
from eviction.density import DensityConfig, DensityPolicy
from kvstore.errors import ConfigError


@dataclass(frozen=True, slots=True)
class CostAwareConfig(DensityConfig):
    model: str = "llama-3-8b"
    """A preset of :data:`eviction.cost.MODELS`."""
    block_tokens: int = 0
    """Tokens per block; 0: the block's bytes over the model's KV bytes per token."""
    flops_per_s: float = 4e14

    def __post_init__(self) -> None:
        DensityConfig.__post_init__(self)
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}; known: {', '.join(sorted(MODELS))}")
        if self.block_tokens < 0:
            raise ConfigError(f"block_tokens must be >= 0, got {self.block_tokens}")


class CostAwarePolicy(DensityPolicy):
    name = "cost"
    Config = CostAwareConfig
    config: CostAwareConfig
    weighted = True

    def __init__(self, config: CostAwareConfig | None = None) -> None:
        super().__init__(config or CostAwareConfig())
        self._model: CostModel | None = None
        self._by_depth = np.zeros(0)

    def bind(self, view: BlockView, tier: TierContext) -> None:
        super().bind(view, tier)
        self._model = None  # the tier changed: rebuild the table lazily

    def _cost_model(self, block_bytes: int) -> CostModel:
        cfg = self.config
        if self._model is None:
            shape = MODELS[cfg.model]
            tokens = cfg.block_tokens or max(1, block_bytes // max(shape.kv_bytes_per_token, 1))
            self._model = CostModel(shape, tokens, cfg.flops_per_s)
        return self._model

    def weights(self, ids: np.ndarray) -> np.ndarray | None:
        view = self._view
        if view is None or not ids.size:
            return None
        depth = view.depth[ids]
        try:
            return self._by_depth[depth]  # (a depth past the table raises: no max to find first)
        except IndexError:
            pass
        top = int(np.maximum.reduce(depth))
        model = self._cost_model(int(view.size[ids[0]]))
        depths = np.arange(max(top + 1, 2 * self._by_depth.size, 64))
        self._by_depth = model.hit_value(depths, model.block_bytes or float(view.size[ids[0]]), self._tier.kind, self._tier.next_kind)
        return self._by_depth[depth]
