"""MLA with a cache of latents: cached latent + suffix equals transformers' uncached forward.

Small random-weight DeepseekV3 models, float32, on the CPU: one with a LoRA query (``q_lora_rank``)
and a small MoE layer after two dense ones, one with a plain query projection and dense layers
only. The store and the engine keep the latent (``kv_lora_rank + qk_rope_head_dim`` per token and
layer), never per-head K/V.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3Config"):
    pytest.skip("this transformers has no DeepseekV3", allow_module_level=True)

from engine.client import EngineCache  # noqa: E402
from engine.kvlayout import shape_of  # noqa: E402
from engine.reference.batch_mla import BatchedMLA  # noqa: E402
from engine.reference.hbm_cache import HbmCache  # noqa: E402
from engine.reference.mla import Dims, choose_form, latent_shape  # noqa: E402
from kvstore.config import StoreConfig, TierSpec  # noqa: E402
from kvstore.store import KVStore  # noqa: E402

BT = 16
LATENT, ROPE = 32, 16


def _config(**kw: object) -> object:
    base = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=LATENT, qk_rope_head_dim=ROPE,
        qk_nope_head_dim=16, v_head_dim=24, n_group=1, topk_group=1, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=1024,
    )
    base.update(kw)
    return transformers.DeepseekV3Config(**base)


def lora_moe() -> torch.nn.Module:
    """q_lora_rank set; layers 0-1 dense, layer 2 a 4-expert MoE."""
    torch.manual_seed(0)
    cfg = _config(num_hidden_layers=3, first_k_dense_replace=2, q_lora_rank=24)
    return transformers.DeepseekV3ForCausalLM(cfg).float().eval()


def plain_dense() -> torch.nn.Module:
    """q_lora_rank unset (one q_proj); both layers dense; RoPE not interleaved."""
    torch.manual_seed(1)
    cfg = _config(num_hidden_layers=2, first_k_dense_replace=2, q_lora_rank=None, rope_interleave=False)
    return transformers.DeepseekV3ForCausalLM(cfg).float().eval()


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"lora-moe": lora_moe, "plain-dense": plain_dense}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def reference(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own uncached forward: next-token logits after ``ids``."""
    return model(ids.unsqueeze(0)).logits[0, -1].float()


@pytest.fixture(params=list(MODELS))
def setup(request: pytest.FixtureRequest, tmp_path: Path):
    model = MODELS[request.param]()
    shape = latent_shape(model.config, torch.float32, BT)
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": 256 * shape.block_bytes, "slab_bytes": 8 * shape.block_bytes}),)
    store = KVStore(StoreConfig(root=tmp_path, tiers=tiers, persist_on_close=False))
    cache = EngineCache(store, shape.namespace(f"test/mla-{request.param}"), shape, max_pending=64)
    yield model, cache
    cache.close()
    store.close()


def test_the_store_keeps_the_latent_per_token_and_layer(setup) -> None:
    model, cache = setup
    layers = model.config.num_hidden_layers
    shape = cache.shape
    assert shape.block_bytes == (LATENT + ROPE) * layers * 4 * BT
    (group,) = cache.ns.layout.groups
    assert (group.kind, group.latent_dim, group.rope_dim, group.num_layers) == ("mla", LATENT, ROPE, layers)
    assert cache.ns.layout.bytes_per_token == (LATENT + ROPE) * layers * 4
    ids = torch.randint(0, 256, (3 * BT + 5,), generator=torch.Generator().manual_seed(7))
    BatchedMLA(model, cache, attention="loop", block_tokens=BT).prefill([ids])
    cache.flush()
    store = cache.store
    hashes = cache.hashes(ids)
    assert store.lookup(cache.ns, hashes).num_blocks == 3
    buf = torch.empty(3 * shape.block_bytes, dtype=torch.uint8)
    assert store.get_into(cache.ns, hashes, buf.numpy()) == 3  # exactly 3 latent blocks of that size


def test_a_per_head_kv_shape_is_refused(setup) -> None:
    model, cache = setup
    kv = shape_of(model.config, torch.float32, BT)
    other = EngineCache(cache.store, kv.namespace("test/mla-wrong"), kv)
    try:
        with pytest.raises(ValueError, match="latent_shape"):
            BatchedMLA(model, other, attention="loop", block_tokens=BT)
    finally:
        other.close()


def test_llama_is_not_an_mla_model() -> None:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2)
    with pytest.raises(ValueError, match="not an MLA model"):
        BatchedMLA(transformers.LlamaForCausalLM(cfg), None, attention="loop")


@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_cached_latent_plus_suffix_equals_the_uncached_forward(setup, form: str) -> None:
    """Through the in-process store: a cold prompt stores its latent blocks; the same prompt
    with a new suffix loads them and computes only the suffix; a greedy continuation of 4 tokens,
    each step a hit on everything before it, matches transformers' token by token."""
    model, cache = setup
    g = torch.Generator().manual_seed(2)
    lm = BatchedMLA(model, cache, attention="loop", block_tokens=BT, form=form)
    ids = torch.randint(0, 256, (3 * BT + 9,), generator=g)
    cold = lm.prefill([ids])[0]
    assert cold.hit_tokens == 0
    assert rel_err(cold.logits, reference(model, ids)) <= 1e-4
    cache.flush()
    ids = torch.cat([ids, torch.randint(0, 256, (11,), generator=g)])
    for step in range(4):
        got = lm.prefill([ids])[0]
        cache.flush()
        # The cold prompt's 3 full blocks, then every full block of the prompt before.
        assert got.hit_tokens == (3 * BT if step == 0 else (ids.numel() - 1) // BT * BT)
        want = reference(model, ids)
        assert rel_err(got.logits, want) <= 1e-4
        assert int(got.logits.argmax()) == int(want.argmax())
        ids = torch.cat([ids, got.logits.argmax().view(1)])
    assert lm.forms_run[form] == 5


def test_a_batch_of_different_cached_lengths_equals_each_uncached(setup) -> None:
    """Several requests of different cached lengths (none, part of a shared system prompt, a long
    history) in one forward pass, in both forms and by the automatic choice, each equal to
    transformers' uncached forward; the forms agree with each other."""
    model, cache = setup
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, 256, (2 * BT + 8,), generator=g)
    history = torch.cat([system, torch.randint(0, 256, (3 * BT,), generator=g)])
    BatchedMLA(model, cache, attention="loop", block_tokens=BT).prefill([history])
    cache.flush()
    prompts = [
        torch.randint(0, 256, (BT + 3,), generator=g),  # nothing cached
        torch.cat([system, torch.randint(0, 256, (20,), generator=g)]),  # the system prompt's 2 blocks
        torch.cat([history, torch.randint(0, 256, (5,), generator=g)]),  # the whole history: 5 blocks
        history[: 4 * BT],  # exactly 4 blocks: the last one is recomputed (one token must be)
    ]
    want = [reference(model, p) for p in prompts]
    outs = {}
    for form in ("naive", "absorbed", "auto"):
        got = BatchedMLA(model, cache, attention="loop", block_tokens=BT, form=form).prefill(prompts, store=False)
        assert [r.hit_tokens for r in got] == [0, 2 * BT, 5 * BT, 3 * BT]
        for r, w in zip(got, want, strict=True):
            assert rel_err(r.logits, w) <= 1e-4
            assert int(r.logits.argmax()) == int(w.argmax())
        outs[form] = torch.stack([r.logits for r in got])
    assert rel_err(outs["absorbed"], outs["naive"]) <= 1e-5


def test_hits_from_hbm_pages_are_latents_too(setup) -> None:
    """The HBM cache holds latent blocks: promoted from DRAM, admitted when computed, then
    served from device memory with the same logits."""
    model, cache = setup
    g = torch.Generator().manual_seed(4)
    hbm = HbmCache(cache, 64 * cache.shape.block_bytes, device="cpu")
    try:
        lm = BatchedMLA(model, cache, hbm=hbm, attention="loop", block_tokens=BT)
        system = torch.randint(0, 256, (2 * BT,), generator=g)
        BatchedMLA(model, cache, attention="loop", block_tokens=BT).prefill([system])
        cache.flush()
        prompts = [torch.cat([system, torch.randint(0, 256, (n,), generator=g)]) for n in (BT + 4, 9)]
        first = lm.prefill(prompts[:1])[0]
        assert (first.hit_tokens, first.hbm_tokens) == (2 * BT, 0)
        assert hbm.counters.promoted == 2 and hbm.counters.admitted == 1
        cache.flush()
        again = lm.prefill(prompts, store=False)
        assert [r.hbm_tokens for r in again] == [3 * BT, 2 * BT]
        for r, p in zip(again, prompts, strict=True):
            assert rel_err(r.logits, reference(model, p)) <= 1e-4
    finally:
        hbm.close()


def test_the_absorbed_form_in_query_chunks_equals_the_naive_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """One layer, 40 new tokens over 70: the absorbed form cut into chunks of 3 queries (its
    bound on the scores it holds at once) equals the naive form."""
    import engine.reference.mla as mla

    model = lora_moe()
    attn = model.model.layers[0].self_attn
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(6))
    cos, sin = model.model.rotary_emb(x.unsqueeze(0), torch.arange(70).unsqueeze(0))
    with torch.no_grad():
        q_nope, q_pe, rows = mla.project(attn, x, cos, sin)
        want = mla.attend_naive(attn, q_nope[30:], q_pe[30:], rows)
        monkeypatch.setattr(mla, "_SCORES", 4 * 70 * 3)  # heads x keys x 3 queries
        got = mla.attend_absorbed(attn, q_nope[30:], q_pe[30:], rows)
    assert got.shape == want.shape == (40, 4, 24)
    assert rel_err(got, want) <= 1e-5


def test_the_automatic_form_follows_the_flops() -> None:
    """DeepSeek-V3's attention dims: a short suffix over a long prefix runs absorbed (no
    decompression of the prefix); a prefill of thousands of new tokens runs naive."""
    d = Dims(heads=128, nope=128, rope=64, v=128, latent=512)
    assert choose_form("auto", d, [(16, 8192)]) == "absorbed"
    assert choose_form("auto", d, [(1, 32768)] * 4) == "absorbed"
    assert choose_form("auto", d, [(1300, 32768)]) == "naive"
    assert choose_form("auto", d, [(4096, 4096)]) == "naive"
    assert choose_form("naive", d, [(1, 32768)]) == "naive"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention-2 varlen needs CUDA")
def test_varlen_on_cuda_matches_the_per_request_loop(tmp_path: Path) -> None:
    """bf16 on CUDA: the batch through FlashAttention-2 varlen (naive form, V zero-padded to the
    nope + rope head) gives the per-request loop's logits in both forms, and transformers'
    uncached forward's within bf16 rounding."""
    model = lora_moe().to("cuda", torch.bfloat16)
    shape = latent_shape(model.config, torch.bfloat16, BT)
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": 256 * shape.block_bytes, "slab_bytes": 8 * shape.block_bytes}),)
    store = KVStore(StoreConfig(root=tmp_path, tiers=tiers, persist_on_close=False))
    cache = EngineCache(store, shape.namespace("test/mla-cuda"), shape, max_pending=64)
    try:
        g = torch.Generator().manual_seed(5)
        history = torch.randint(0, 256, (5 * BT + 3,), generator=g)
        BatchedMLA(model, cache, attention="varlen", block_tokens=BT).prefill([history])
        cache.flush()
        prompts = [torch.cat([history, torch.randint(0, 256, (n,), generator=g)]) for n in (9, 40)]
        prompts.append(torch.randint(0, 256, (2 * BT + 1,), generator=g))
        varlen = BatchedMLA(model, cache, attention="varlen", block_tokens=BT).prefill(prompts, store=False)
        assert [r.hit_tokens for r in varlen] == [5 * BT, 5 * BT, 0]
        for form in ("naive", "absorbed"):
            loop = BatchedMLA(model, cache, attention="loop", block_tokens=BT, form=form).prefill(prompts, store=False)
            for a, b in zip(varlen, loop, strict=True):
                assert rel_err(a.logits, b.logits) <= 2e-2
        for r, p in zip(varlen, prompts, strict=True):
            assert rel_err(r.logits, reference(model, p.to("cuda"))) <= 5e-2
    finally:
        cache.close()
        store.close()
