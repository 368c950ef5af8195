"""Tiny random-weight models saved locally, for vLLM tests and benchmarks (no download): a Llama
(dense GQA), a Mistral (every layer sliding), a Gemma 3 (sliding and full layers), a
DeepSeek-V2 (MLA) and a Qwen3-Next (gated delta net linear attention and full layers).

Prompts are token ids (``TokensPrompt``) and the engine runs with ``skip_tokenizer_init``, so no
tokenizer is needed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True, slots=True)
class TinyShape:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 2048
    max_positions: int = 4096


SMALL = TinyShape()
"""GQA, head_dim 64: the default test model."""
GQA128 = TinyShape(hidden=512, layers=2, heads=4, kv_heads=1, head_dim=128, intermediate=512)
"""GQA with head_dim 128 (one KV head per four query heads), the shape of most served models."""
BENCH = TinyShape(hidden=512, layers=6, heads=4, kv_heads=2, head_dim=128, intermediate=1024)
"""``tools/bench vllm``: enough compute per token that a prefill hit shows on a CPU."""


def save_tiny_llama(path: str | Path, shape: TinyShape = SMALL, seed: int = 0) -> Path:
    """Save a random-weight Llama of ``shape`` under ``path`` (kept if already there)."""
    path = Path(path)
    marker = path / "tiny_shape.json"
    if marker.exists() and json.loads(marker.read_text()) == {**asdict(shape), "seed": seed}:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate,
        vocab_size=shape.vocab,
        max_position_embeddings=shape.max_positions,
        torch_dtype="bfloat16",  # type: ignore[call-arg, unused-ignore]  # the older name; transformers still takes it
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # Larger weights than the default init (norms kept at 1): peaked logits that depend on the
    # whole prefix, so wrong KV changes the greedy tokens (a test that compares tokens sees it).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.15)
    model.to(torch.bfloat16).save_pretrained(path)  # type: ignore[arg-type, unused-ignore]  # transformers types .to oddly
    marker.write_text(json.dumps({**asdict(shape), "seed": seed}))
    return path


def _randomize(model: PreTrainedModel, seed: int, norm: float = 1.0) -> None:
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(norm)
            else:
                p.normal_(0.0, 0.15)


def _small_args(window: int) -> dict[str, Any]:
    """A transformers config's arguments for :data:`SMALL` with a sliding window."""
    s = SMALL
    return dict(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                num_key_value_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate,
                vocab_size=s.vocab, max_position_embeddings=s.max_positions, sliding_window=window,
                bos_token_id=1, eos_token_id=2)


def _save(path: Path, model: PreTrainedModel, tag: dict[str, object]) -> Path:
    model.save_pretrained(path)
    (path / "tiny_shape.json").write_text(json.dumps(tag))
    return path


def _kept(path: Path, tag: dict[str, object]) -> bool:
    marker = path / "tiny_shape.json"
    return marker.exists() and json.loads(marker.read_text()) == tag


def save_tiny_mistral(path: str | Path, window: int = 64, seed: int = 0) -> Path:
    """A random-weight Mistral (every layer slides over ``window`` tokens), float32."""
    path, tag = Path(path), {"family": "mistral", "window": window, "seed": seed}
    if _kept(path, tag):
        return path
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(**_small_args(window), tie_word_embeddings=False)
    model = MistralForCausalLM(cfg)
    _randomize(model, seed)
    return _save(path, model, tag)


def save_tiny_gemma3(path: str | Path, window: int = 64, seed: int = 0) -> Path:
    """A random-weight Gemma 3 text model: sliding and full layers alternate (the sliding ones
    over ``window`` tokens), float32."""
    path, tag = Path(path), {"family": "gemma3", "window": window, "seed": seed, "tied": False}
    if _kept(path, tag):
        return path
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(**_small_args(window), pad_token_id=0, tie_word_embeddings=False,
                           layer_types=["sliding_attention", "full_attention"] * (SMALL.layers // 2))
    model = Gemma3ForCausalLM(cfg)
    _randomize(model, seed, norm=0.0)  # Gemma's norms scale by 1 + weight
    return _save(path, model, tag)


def save_tiny_deepseek(path: str | Path, seed: int = 0) -> Path:
    """A random-weight DeepSeek-V2 with MLA, the latent shape vLLM's CPU MLA kernel runs
    (kv_lora_rank 512 + rope 64 = 576), two dense layers, float32."""
    path, tag = Path(path), {"family": "deepseek_v2", "seed": seed}
    if _kept(path, tag):
        return path
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                           moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                           first_k_dense_replace=2, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                           qk_nope_head_dim=32, v_head_dim=32, vocab_size=2048, max_position_embeddings=4096,
                           bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = DeepseekV2ForCausalLM(cfg)
    _randomize(model, seed)
    return _save(path, model, tag)


def save_tiny_qwen3_next(path: str | Path, seed: int = 0) -> Path:
    """A random-weight Qwen3-Next: gated delta net linear attention and full attention layers
    alternating, a small mixture of experts (vLLM's Qwen3-Next needs one), bfloat16. The shape vLLM 0.32's CPU build runs: its gated delta net
    kernel needs bfloat16 and 128-wide linear heads (2 key heads, 4 value heads: a layer's state
    is a conv state ``[3, 1024]`` bf16 and a recurrent state ``[4, 128, 128]`` fp32), and with
    its prefix cache on (``mamba_cache_mode`` ``align``) vLLM sets the block size to 544 tokens,
    the attention page (2 KV heads of 64) as large as a layer's state."""
    path, tag = Path(path), {"family": "qwen3_next", "seed": seed, "experts": 4}
    if _kept(path, tag):
        return path
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    s = SMALL
    cfg = Qwen3NextConfig(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                          num_key_value_heads=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate,
                          vocab_size=s.vocab, max_position_embeddings=s.max_positions,
                          layer_types=["linear_attention", "full_attention"] * (s.layers // 2),
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                          linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = Qwen3NextForCausalLM(cfg)
    _randomize(model, seed, norm=0.0)  # Qwen3-Next's RMS norms scale by 1 + weight...
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:  # ...but not the gated one after the delta rule: 0 would mute it
                p.fill_(1.0)
    model.to(torch.bfloat16)  # type: ignore[arg-type, unused-ignore]  # transformers types .to oddly
    return _save(path, model, tag)
