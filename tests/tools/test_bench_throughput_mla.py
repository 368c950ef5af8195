"""throughput --model mla: the stream on a tiny DeepseekV3 on the CPU, and the MLA FLOP bound."""

from __future__ import annotations

import json

import pytest

from tools.bench.__main__ import main

KEYS = {"bench", "metric", "value", "unit", "baseline", "ratio"}


def test_mla_throughput_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Every engine runs the stream with latent blocks; the batch agrees with each request alone."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip("this transformers has no DeepseekV3")
    assert main(["throughput", "--model", "mla", "--json", "--smoke"]) == 0
    rows = {r["metric"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"mla_dram_hit80_tokens_per_s", "mla_hbm_hit80_tokens_per_s", "mla_ideal_hit80_tokens_per_s",
                         "mla_hbm_vs_ideal_hit80"}
    for r in rows.values():
        assert r.keys() >= KEYS and r["value"] > 0 and r["baseline"] > 0
    assert rows["mla_dram_hit80_tokens_per_s"]["measured_hit"] > 0.7
    assert rows["mla_hbm_hit80_tokens_per_s"]["hbm_share_of_hits"] == 1.0
    extra = rows["mla_hbm_vs_ideal_hit80"]
    assert extra["kv_bytes_per_token"] == (32 + 16) * 2 * 4  # latent + rope, 2 layers, float32
    for check in (extra["check"], extra["check_hbm"]):
        assert check["same_greedy_token"] == check["checked_requests"] == 2
        assert check["logits_rel_err"] <= 1e-4
        assert check["hit_tokens_alone"] == check["hit_tokens_batched"]
        assert len(check["top2_margin_alone"]) == 2 and min(check["top2_margin_alone"]) >= 0


def test_mla_flop_bound_counts_the_decompression_of_hits() -> None:
    """Every hit is decompressed by kv_b_proj in every layer (8.4M multiply-adds per token and
    layer at this shape, 4% of a computed token's): at 96% hit that alone caps a 1K-token prompt
    near 1/(0.04 + 0.96 x 0.042) = 12.5x, where the Llama-style bound (hits cost only the new
    tokens' attention over them) is 24.6x; longer prompts approach the attention's own limit."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tools.bench.throughput_mla import flop_bound, flop_bound_by_length

    cfg = transformers.DeepseekV3Config(
        hidden_size=4096, intermediate_size=10752, num_hidden_layers=2, first_k_dense_replace=2,
        num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    )
    by_len = flop_bound_by_length(cfg, 0.96)
    assert 11.5 < by_len["1024"] < 13.5
    assert all(11.5 < b < 13.5 for b in by_len.values())
    stream = [[torch.zeros(4096, dtype=torch.long), torch.zeros(4096 * 25 // 24, dtype=torch.long)]]
    assert flop_bound(cfg, [], stream) == pytest.approx(by_len["4096"], rel=0.02)
