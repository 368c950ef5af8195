"""The recompute cost model: FLOPs by depth and attention kind, bytes by layout, tier costs."""

from __future__ import annotations

import numpy as np
import pytest

from eviction.cost import MODELS, CostModel, ModelShape
from kvstore.errors import ConfigError


def test_llama_shape_and_bytes() -> None:
    cm = CostModel.for_model("llama-3-8b", 512)
    assert cm.model.kv_bytes_per_token == 128 * 1024  # 32 layers x K,V x 8 heads x 128 x bf16
    assert cm.block_bytes == 64 * 1024 * 1024
    # The linear layers dominate a shallow block: 2 FLOPs per parameter per token.
    assert cm.block_flops(0) == pytest.approx(2 * 7.5e9 * 512, rel=0.02)


def test_full_attention_cost_grows_with_depth_and_sums_to_the_prefix() -> None:
    cm = CostModel.for_model("llama-3-8b", 512)
    f = cm.block_flops(np.arange(64))
    assert (np.diff(f) > 0).all()
    # Each step adds the attention of 512 tokens over 512 more keys: 4 x layers x dim x 512^2.
    assert np.diff(f) == pytest.approx(np.full(63, 4 * 32 * 4096 * 512 * 512))
    assert float(cm.prefix_flops(64 * 512)) == pytest.approx(float(f.sum()))
    assert float(cm.prefix_flops(700)) == pytest.approx(float(cm.token_flops(np.arange(700)).sum()))


def test_sliding_window_cost_stops_growing_past_the_window() -> None:
    shape = ModelShape(1e9, 16, 2048, attention="sliding", window=1024)
    cm = CostModel(shape, 256)
    f = cm.block_flops(np.arange(12))
    assert (np.diff(f[:4]) > 0).all()  # inside the window
    assert np.allclose(f[5:], f[5])  # every block past it attends to 1,024 keys
    assert float(cm.prefix_flops(3000)) == pytest.approx(float(cm.token_flops(np.arange(3000)).sum()))


def test_hit_value_on_the_last_tier_and_above() -> None:
    cm = CostModel.for_model("llama-3-8b", 512)
    d = np.array([0, 10, 100])
    last = cm.hit_value(d, cm.block_bytes, "nvme", "")
    assert (np.diff(last) > 0).all()  # a deeper block saves more recompute
    upper = cm.hit_value(d, cm.block_bytes, "dram", "nvme")
    assert np.allclose(upper, upper[0]) and upper[0] > 0  # saves the NVMe load, at any depth
    # A load from DRAM at 50 GB/s is much cheaper than recomputing 512 tokens at 400 TFLOP/s.
    assert cm.load_seconds(cm.block_bytes, "dram") < 0.1 * float(cm.recompute_seconds(0))


def test_every_preset_and_bad_shapes() -> None:
    for name in MODELS:
        cm = CostModel.for_model(name, 64)
        assert cm.block_bytes > 0 and float(cm.block_flops(3)) > float(cm.block_flops(0))
    with pytest.raises(ConfigError, match="unknown model"):
        CostModel.for_model("gpt-7", 64)
    with pytest.raises(ConfigError, match="attention"):
        ModelShape(1e9, 2, 64, attention="linear")
    with pytest.raises(ConfigError, match="window"):
        ModelShape(1e9, 2, 64, attention="sliding")
    with pytest.raises(ConfigError, match="block_tokens"):
        CostModel(MODELS["llama-3-8b"], 0)
