"""A tiny random-weight Llama saved locally, for vLLM tests and benchmarks (no download).

Prompts are token ids (``TokensPrompt``) and the engine runs with ``skip_tokenizer_init``, so no
tokenizer is needed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


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
        torch_dtype="bfloat16",
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
    model.to(torch.bfloat16).save_pretrained(path)
    marker.write_text(json.dumps({**asdict(shape), "seed": seed}))
    return path
