"""The reference engine: a real transformers model skips cached prefill and gives the same answer.

Small random-weight models of two architectures (Llama with grouped-query attention, GPT-NeoX
with partial rotary embeddings and parallel residuals), float32, on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.client import EngineCache  # noqa: E402
from engine.kvlayout import pack, shape_of, unpack_layer  # noqa: E402
from engine.reference.hf import CachedLM  # noqa: E402
from kvstore.config import StoreConfig, TierSpec  # noqa: E402
from kvstore.errors import UsageError  # noqa: E402
from kvstore.store import KVStore  # noqa: E402

BT = 16


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def neox() -> torch.nn.Module:
    cfg = transformers.GPTNeoXConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, rotary_pct=0.5, max_position_embeddings=1024,
    )
    torch.manual_seed(1)
    return transformers.GPTNeoXForCausalLM(cfg).float().eval()


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"llama-gqa": llama, "gpt-neox": neox}


@pytest.fixture(params=list(MODELS))
def engine(request: pytest.FixtureRequest, tmp_path: Path):
    model = MODELS[request.param]()
    shape = shape_of(model.config, torch.float32, BT)
    ns = shape.namespace(f"test/{request.param}")
    tiers = (
        TierSpec("dram", "dram", {"capacity_bytes": 64 * shape.block_bytes, "slab_bytes": 8 * shape.block_bytes}),
        TierSpec("nvme", "nvme", {"capacity_bytes": 64 * shape.block_bytes, "slab_bytes": 8 * shape.block_bytes}),
    )
    store = KVStore(StoreConfig(root=tmp_path, tiers=tiers))
    cache = EngineCache(store, ns, shape)
    yield CachedLM(model, cache), CachedLM(model, None)
    cache.close()
    store.close()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_cached_and_uncached_runs_agree(engine) -> None:
    cached, plain = engine
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (70,), generator=g)
    ref = plain.prefill(prompt)
    first = cached.prefill(prompt)
    assert first.hit_tokens == 0 and first.computed_tokens == 70
    assert rel_err(first.logits, ref.logits) <= 1e-4
    cached.cache.flush()
    second = cached.prefill(prompt)
    assert second.hit_tokens == 64 and second.computed_tokens == 6  # 4 blocks loaded
    assert rel_err(second.logits, ref.logits) <= 1e-4
    # A prompt sharing 3 blocks (48 tokens) hits exactly those.
    other = torch.cat([prompt[:48], torch.randint(0, 256, (40,), generator=g)])
    third = cached.prefill(other)
    assert third.hit_tokens == 48
    assert rel_err(third.logits, plain.prefill(other).logits) <= 1e-4


def test_same_greedy_continuation(engine) -> None:
    cached, plain = engine
    prompt = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(3))
    want, _ = plain.generate(prompt, 12)
    cached.generate(prompt, 1)  # warm the store
    cached.cache.flush()
    got, pre = cached.generate(prompt, 12)
    assert pre.hit_tokens == 48
    assert got == want


def test_whole_prompt_cached_still_computes_one_token(engine) -> None:
    cached, plain = engine
    prompt = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(5))
    cached.prefill(prompt)
    cached.cache.flush()
    again = cached.prefill(prompt)
    assert again.hit_tokens == 48 and again.computed_tokens == 16  # 4 full blocks, 3 may load
    assert rel_err(again.logits, plain.prefill(prompt).logits) <= 1e-4


def test_pack_unpack_round_trip() -> None:
    shape = shape_of(llama().config, torch.float32, 4)
    keys = [torch.randn(1, shape.kv_heads, 12, shape.head_dim) for _ in range(shape.num_layers)]
    values = [torch.randn(1, shape.kv_heads, 12, shape.head_dim) for _ in range(shape.num_layers)]
    blocks = pack(keys, values, shape, 1, 3)
    assert blocks.shape == (2, shape.block_bytes) and blocks.dtype == torch.uint8
    for layer in range(shape.num_layers):
        k, v = unpack_layer(blocks, shape, layer)
        assert torch.equal(k, keys[layer][:, :, 4:12])
        assert torch.equal(v, values[layer][:, :, 4:12])


@pytest.mark.parametrize("plane", ["shm", "tcp"])
def test_reference_engine_through_a_daemon(tmp_path: Path, plane: str) -> None:
    """The same engine against the daemon: leases over shared memory, copies over TCP."""
    from engine.gpu import ArenaBlocks, HostBlocks
    from kvstore.client import connect
    from kvstore.client.spawn import start_daemon

    model = llama()
    shape = shape_of(model.config, torch.float32, BT)
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(11))
    ref = CachedLM(model, None).prefill(prompt)
    with start_daemon(tmp_path / "store") as d:
        client = connect(d.url, plane=plane)
        try:
            cache = EngineCache(client, shape.namespace("test/llama-daemon"), shape)
            lm = CachedLM(model, cache)
            lm.prefill(prompt)
            cache.flush()
            loaded = cache.load(cache.hashes(prompt), 4)
            assert isinstance(loaded, ArenaBlocks if plane == "shm" else HostBlocks)
            assert loaded.num_blocks == 4
            loaded.release()
            again = lm.prefill(prompt)
            assert again.hit_tokens == 64
            assert rel_err(again.logits, ref.logits) <= 1e-4
            cache.close()
        finally:
            client.close()



_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
SLIDING: dict[str, Callable[[], torch.nn.Module]] = {
    "gemma3-alternating": lambda: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(sliding_window=16, sliding_window_pattern=2, **_SIZES)),
    "mistral-sliding-window": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=16, **_SIZES)),
    "gpt-oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **_SIZES, sliding_window=16, num_local_experts=2, num_experts_per_tok=1,
        layer_types=["sliding_attention", "full_attention"])),
}


@pytest.mark.parametrize("name", list(SLIDING))
def test_sliding_window_models_are_refused_with_a_pointer_to_the_hybrid_engine(name: str) -> None:
    """Issue 16: CachedLM stored and loaded every token of every layer, which a sliding-window
    layer does not keep. It refuses such a model at construction, naming the engine that
    serves it."""
    with pytest.raises(UsageError, match=r"sliding_attention layers .*engine\.reference\.hybrid\.HybridLM.*docs/hybrid\.md"):
        CachedLM(SLIDING[name](), None)


def test_mistral_without_a_window_is_served() -> None:
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**{**_SIZES, "sliding_window": None}))
    assert CachedLM(model, None).prefill(torch.arange(5)).computed_tokens == 5
