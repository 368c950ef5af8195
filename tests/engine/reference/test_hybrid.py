"""The hybrid engine: full part + checkpoint window + bounded replay gives the uncached answer.

Small random-weight models, float32 on the CPU: Gemma-3 (alternating local and global layers),
Mistral with ``sliding_window`` (every layer local) and Qwen3-Next (linear attention: conv and
recurrent state) through every test; gpt-oss (windows with attention sinks, experts) and LFM2
(short convolutions) through the hit scenarios. Blocks of 8 tokens,
a 16-token window (15 tokens of state: not a multiple of the block, so a checkpoint needs the
pieces of 2 blocks), a checkpoint every 4 blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.reference.hybrid import HybridLM, namespace_of, plan_of  # noqa: E402
from kvstore.client import connect  # noqa: E402
from kvstore.client.spawn import start_daemon  # noqa: E402
from kvstore.config import StoreConfig, TierSpec  # noqa: E402
from kvstore.errors import UsageError  # noqa: E402
from kvstore.hybrid import CheckpointPolicy  # noqa: E402
from kvstore.store import KVStore  # noqa: E402

BT, W, C = 8, 16, 4
_SIZES = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
)


def gemma3() -> Any:
    cfg = transformers.Gemma3TextConfig(sliding_window=W, sliding_window_pattern=2, **_SIZES)
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(cfg).float().eval()


def mistral() -> Any:
    cfg = transformers.MistralConfig(sliding_window=W, **_SIZES)
    torch.manual_seed(1)
    return transformers.MistralForCausalLM(cfg).float().eval()


def qwen3_next() -> Any:
    """Gated delta-net linear attention (conv + recurrent state) between full-attention layers."""
    cfg = transformers.Qwen3NextConfig(
        **_SIZES, layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=0,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
    )
    torch.manual_seed(2)
    return transformers.Qwen3NextForCausalLM(cfg).float().eval()


def lfm2() -> Any:
    """Short convolutions (a conv state) between full-attention layers."""
    cfg = transformers.Lfm2Config(**{k: v for k, v in _SIZES.items() if k != "head_dim"},
                                  layer_types=["conv", "full_attention"] * 2)
    torch.manual_seed(3)
    return transformers.Lfm2ForCausalLM(cfg).float().eval()


def gpt_oss() -> Any:
    """Alternating 16-token windows and full layers with attention sinks and a mixture of experts."""
    cfg = transformers.GptOssConfig(
        **{**_SIZES, "intermediate_size": 64}, sliding_window=W, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    torch.manual_seed(4)
    return transformers.GptOssForCausalLM(cfg).float().eval()


MODELS: dict[str, Callable[[], Any]] = {
    "gemma3-alternating": gemma3, "mistral-all-swa": mistral, "qwen3-next-linear": qwen3_next,
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _store(root: Path) -> KVStore:
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": "16MiB", "slab_bytes": "1MiB"}),)
    return KVStore(StoreConfig(root=root, tiers=tiers))


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest) -> Any:
    return MODELS[request.param]()


def _tokens(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _check(lm: HybridLM, plain: HybridLM, prompt: torch.Tensor, checkpoint: int, replayed_blocks: int, *, bounded: bool = True) -> None:
    """Cached + replay equals uncached: logits within 1e-4 and the same greedy continuation."""
    ref_tokens, ref = plain.generate(prompt, 8, use_cache=False)
    tokens, pre = lm.generate(prompt, 8)
    assert pre.checkpoint == checkpoint
    assert pre.hit_tokens == (checkpoint + 1) * BT
    assert pre.computed_tokens == prompt.numel() - pre.hit_tokens
    if lm.hyb.full is not None:  # all-SWA: nothing past the checkpoint is cached, nothing replays
        assert pre.replayed_tokens == replayed_blocks * BT
        if bounded:  # the periodic checkpoints are cached: at most C - 1 blocks replay
            assert pre.replayed_tokens <= (C - 1) * BT
    assert rel_err(pre.logits, ref.logits) <= 1e-4
    assert tokens == ref_tokens
    # The cache counts every token seen (the model's positions come from it), loaded ones too:
    # the prompt and the 7 decode steps after it.
    assert int(pre.cache.get_seq_length()) == int(ref.cache.get_seq_length()) == prompt.numel() + 7
    if lm.cone and pre.replayed_tokens:  # the replay computed its dependency cone, exactly
        assert pre.cone == _cone_oracle(lm, checkpoint, replayed_blocks, prompt.numel())
        assert sum(pre.cone) < len(pre.cone) * pre.computed_tokens
    else:
        assert pre.cone == ()


def _cone_oracle(lm: HybridLM, checkpoint: int, replayed_blocks: int, total: int) -> tuple[int, ...]:
    """Positions each layer must compute, by dependency sets, top layer first: the top layer's
    output is needed for the new tokens; a full layer needs its input where its output is
    needed (its KV before the hit's end is loaded); a sliding layer also needs its input at the
    ``W - 1`` positions before each needed output, and from the first block of a window piece
    the prefill stores (its new checkpoints' pieces) on; the hit's checkpoint bounds them all."""
    start, end = (checkpoint + 1) * BT, (checkpoint + 1 + replayed_blocks) * BT
    ckpts = set(lm.policy.new_checkpoints(checkpoint + 1, total // BT - 1))
    if lm.policy.at_hits:
        ckpts.add(checkpoint + replayed_blocks)
    pieces = [j for p in ckpts for j in lm.hyb.checkpoint_blocks(p) if start <= j * BT < end]
    need = set(range(end, total))
    rows = []
    for kind, w in reversed(list(zip(lm.plan.kinds, lm.plan.windows, strict=True))):
        inputs = set(need)
        if kind == "sliding":
            for q in need:
                inputs |= set(range(q - w + 1, q + 1))
            if pieces:
                inputs |= set(range(min(pieces) * BT, total))
        need = {p for p in inputs if p >= start}
        assert need == set(range(min(need), total))  # a suffix: a slice of the hidden states
        rows.append(len(need))
    return tuple(reversed(rows))


def _scenarios(lm: HybridLM, plain: HybridLM, seed: int) -> None:
    base = _tokens(seed, 100)  # 12 full blocks: checkpoints 3, 7 and 11 (every 4, and the end)
    first = lm.prefill(base)
    assert first.checkpoint == -1 and first.hit_tokens == 0
    # A hit that ends on a checkpoint: 65 tokens -> blocks 0..7 usable, block 7 is a checkpoint.
    _check(lm, plain, base[:65], checkpoint=7, replayed_blocks=0)
    # Between checkpoints: blocks 0..5 usable, nearest checkpoint 3, blocks 4 and 5 replayed.
    _check(lm, plain, base[:49], checkpoint=3, replayed_blocks=2)
    # The whole stored prompt and past it: the end checkpoint (11), then new tokens.
    _check(lm, plain, torch.cat([base, _tokens(seed + 1, 37)]), checkpoint=11, replayed_blocks=0)


def test_cached_prefill_equals_uncached(model: Any, tmp_path: Path) -> None:
    store = _store(tmp_path)
    ns = namespace_of(model, "test/hybrid", BT)
    lm = HybridLM(model, store, ns, policy=CheckpointPolicy(every_blocks=C))
    plain = HybridLM(model, None, ns)
    try:
        _scenarios(lm, plain, seed=3)
    finally:
        store.close()


def test_hit_past_the_last_checkpoint_replays_from_it(model: Any, tmp_path: Path) -> None:
    """A full part that runs past the last checkpoint (no window at the prompt's end): the hit
    is at the last periodic checkpoint and the blocks after it are replayed."""
    store = _store(tmp_path)
    ns = namespace_of(model, "test/hybrid", BT)
    periodic_only = HybridLM(model, store, ns, policy=CheckpointPolicy(every_blocks=C, at_end=False))
    plain = HybridLM(model, None, ns)
    try:
        base = _tokens(5, 90)
        periodic_only.prefill(base)  # full part of 11 blocks, checkpoints 3 and 7 only
        lm = HybridLM(model, store, ns, policy=CheckpointPolicy(every_blocks=C))
        _check(lm, plain, torch.cat([base, _tokens(6, 20)]), checkpoint=7, replayed_blocks=3)
    finally:
        store.close()


def test_a_replayed_hit_stores_a_checkpoint_where_it_ended(model: Any, tmp_path: Path) -> None:
    """``at_hits``: a hit between checkpoints replays once; the engine then holds the window at
    the hit's end and stores it, so the next prompt that leaves the chain there replays nothing."""
    store = _store(tmp_path)
    ns = namespace_of(model, "test/hybrid", BT)
    lm = HybridLM(model, store, ns, policy=CheckpointPolicy(every_blocks=C))
    if lm.hyb.full is None:
        store.close()
        pytest.skip("no full part: a hit always ends on a checkpoint")
    plain = HybridLM(model, None, ns)
    try:
        base = _tokens(7, 100)
        lm.prefill(base)
        # Blocks 0..5 of the stored prompt, then another question (ending at block 7, where
        # at_end puts a checkpoint): checkpoint 3, 2 blocks replay.
        _check(lm, plain, torch.cat([base[:48], _tokens(8, 20)]), checkpoint=3, replayed_blocks=2)
        # Leaving at the same place again: block 5 is a checkpoint now.
        _check(lm, plain, torch.cat([base[:48], _tokens(9, 21)]), checkpoint=5, replayed_blocks=0)
        off = HybridLM(model, store, replace(ns, model_id="test/hybrid-no-hits"),
                       policy=CheckpointPolicy(every_blocks=C, at_hits=False))
        lm.close()  # idempotent
        off.prefill(base)
        _check(off, plain, torch.cat([base[:48], _tokens(8, 20)]), checkpoint=3, replayed_blocks=2)
        _check(off, plain, torch.cat([base[:48], _tokens(9, 21)]), checkpoint=3, replayed_blocks=2)
    finally:
        store.close()


def test_store_everything_baseline_equals_uncached(model: Any, tmp_path: Path) -> None:
    ns = namespace_of(model, "test/everything", BT)
    if "recurrent" in [g.kind for g in ns.layout.groups]:
        with pytest.raises(UsageError, match="per-block form"):
            HybridLM(model, None, ns, everything=True)
        return
    store = _store(tmp_path)
    lm = HybridLM(model, store, ns, everything=True)
    plain = HybridLM(model, None, ns)
    try:
        base = _tokens(9, 70)
        lm.prefill(base)
        ref_tokens, ref = plain.generate(torch.cat([base, _tokens(10, 9)]), 6, use_cache=False)
        tokens, pre = lm.generate(torch.cat([base, _tokens(10, 9)]), 6)
        assert pre.hit_tokens == 64 and pre.replayed_tokens == 0
        assert rel_err(pre.logits, ref.logits) <= 1e-4
        assert tokens == ref_tokens
    finally:
        store.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = start_daemon(tmp_path_factory.mktemp("hybrid-daemon"))
    try:
        yield d.url
    finally:
        d.stop()


@pytest.mark.parametrize("plane", ["shm", "tcp"])
def test_through_the_daemon(model: Any, daemon: str, plane: str) -> None:
    ns = namespace_of(model, f"test/{model.config.model_type}-daemon-{plane}", BT)  # one id per model
    with connect(daemon, plane=plane) as client:
        lm = HybridLM(model, client, ns, policy=CheckpointPolicy(every_blocks=C))
        _scenarios(lm, HybridLM(model, None, ns), seed=11)


def test_a_window_evicted_falls_back_to_an_earlier_checkpoint(model: Any, tmp_path: Path) -> None:
    store = _store(tmp_path)
    ns = namespace_of(model, "test/hybrid", BT)
    lm = HybridLM(model, store, ns, policy=CheckpointPolicy(every_blocks=C))
    plain = HybridLM(model, None, ns)
    try:
        base = _tokens(13, 100)
        lm.prefill(base)
        hashes = lm.hyb.hashes(base)
        # Block 7's window piece (or its recurrent state) goes: checkpoint 7 is gone, 3 and 11 stay.
        if lm.hyb.window is not None:
            assert store.delete(lm.hyb.window, [lm.hyb.window_key(hashes[7])]) == 1
        else:
            assert lm.hyb.state is not None
            assert store.delete(lm.hyb.state, [lm.hyb.state_key(hashes[7])]) == 1
        blocks_after = 4 if lm.hyb.full is not None else 0
        _check(lm, plain, base[:65], checkpoint=3, replayed_blocks=blocks_after, bounded=False)
        # The replaying prefill stored the piece again: checkpoint 7 is back.
        _check(lm, plain, base[:65], checkpoint=7, replayed_blocks=0)
    finally:
        store.close()


def test_a_put_whose_prefix_left_is_skipped(model: Any, tmp_path: Path) -> None:
    """The put after a hit extends the loaded prefix; if that prefix left the store in between,
    the put is skipped (the prefill's answer stands) and a later prefill starts cold."""
    store = _store(tmp_path)
    ns = namespace_of(model, "test/hybrid", BT)
    lm = HybridLM(model, store, ns, policy=CheckpointPolicy(every_blocks=C))
    if lm.hyb.full is None:
        store.close()
        pytest.skip("no full part: every put is a chain of one block")
    try:
        base = _tokens(21, 100)
        lm.prefill(base[:40])  # 5 blocks: checkpoints 3 (every 4) and 4 (the end)
        hashes = lm.hyb.hashes(base)
        real_put = store.put

        def evict_then_put(ns: Any, chain: Any, blocks: Any, *, start: int = 0, durable: bool = False) -> int:
            store.delete(lm.hyb.full, [hashes[0]])  # the loaded prefix leaves before the put
            return real_put(ns, chain, blocks, start=start, durable=durable)

        store.put = evict_then_put  # type: ignore[method-assign]
        ref = HybridLM(model, None, ns).prefill(base, use_cache=False, store=False)
        pre = lm.prefill(base)
        assert pre.checkpoint == 4 and pre.stored_bytes == 0
        assert rel_err(pre.logits, ref.logits) <= 1e-4
        store.put = real_put  # type: ignore[method-assign]
        assert lm.prefill(base).checkpoint == -1
    finally:
        store.close()


@pytest.mark.parametrize(("make", "kinds"), [(gpt_oss, ["full", "sliding"]), (lfm2, ["full", "recurrent"])])
def test_more_architectures(make: Callable[[], Any], kinds: list[str], tmp_path: Path) -> None:
    """gpt-oss (windows with sinks and experts) and LFM2 (a conv state only, no recurrent one)
    through the hit scenarios, in process."""
    model = make()
    store = _store(tmp_path)
    ns = namespace_of(model, f"test/{model.config.model_type}", BT)
    assert [g.kind for g in ns.layout.groups] == kinds
    try:
        _scenarios(HybridLM(model, store, ns, policy=CheckpointPolicy(every_blocks=C)), HybridLM(model, None, ns), seed=23)
    finally:
        store.close()


def test_the_cone_prunes_a_long_replay_to_what_the_answer_needs(tmp_path: Path) -> None:
    """An 8-layer Gemma-3 (alternating), a checkpoint every 8 blocks, a hit that replays 7 blocks
    (56 tokens) with 10 new tokens: the top full layer computes only the new tokens, each
    sliding layer below it ``W - 1`` more positions (first the stored pieces' 16), the lowest
    the whole replay: 315 of 528 layer-positions (322 when it stores the hit's window). The answer equals the uncached prefill and
    the engine without the cone (float32, the same greedy continuation)."""
    cfg = transformers.Gemma3TextConfig(sliding_window=W, sliding_window_pattern=2, **{**_SIZES, "num_hidden_layers": 8})
    torch.manual_seed(5)
    m = transformers.Gemma3ForCausalLM(cfg).float().eval()
    store = _store(tmp_path)
    ns = namespace_of(m, "test/cone", BT)
    policy = CheckpointPolicy(every_blocks=8)
    try:
        lm = HybridLM(m, store, ns, policy=policy)
        assert lm.cone
        base = _tokens(31, 200)
        lm.prefill(base)
        prompt = torch.cat([base[:184], _tokens(32, 10)])
        plain = HybridLM(m, None, ns)
        uncone = HybridLM(m, store, ns, policy=policy, cone=False)
        b = uncone.prefill(prompt, store=False)
        assert b.cone == () and b.checkpoint == 15 and b.replayed_tokens == 56
        pre = lm.prefill(prompt, store=False)  # nothing to store: no piece widens the cone
        assert pre.cone == (66, 55, 55, 40, 40, 25, 25, 10)
        assert rel_err(pre.logits, b.logits) <= 1e-4
        # Stored: the window pieces at the hit's end (blocks 21 and 22) need one position more.
        _check(lm, plain, prompt, checkpoint=15, replayed_blocks=7, bounded=False)
        # Those pieces came out of the cone: a prompt that leaves the chain there hits them, right.
        _check(lm, plain, torch.cat([base[:184], _tokens(33, 12)]), checkpoint=22, replayed_blocks=0)
    finally:
        store.close()


def test_unsupported_layer_types_are_refused() -> None:
    cfg = transformers.Gemma3TextConfig(sliding_window=W, sliding_window_pattern=2, **_SIZES)
    cfg.layer_types = ["sliding_attention", "hybrid", "full_attention", "full_attention"]
    with pytest.raises(UsageError, match="hybrid"):
        plan_of(cfg)


def test_flash_attention_needs_cuda_and_refuses_what_it_cannot_compute() -> None:
    """``attention="flash"`` is CUDA-only; ``auto`` falls back to the model's attention (on the
    CPU, and for soft-capping or sinks, which FlashAttention-2 here does not take)."""
    m = gemma3()
    ns = namespace_of(m, "test/flash-refusal", BT)
    with pytest.raises(UsageError, match="CUDA"):
        HybridLM(m, None, ns, attention="flash")
    with pytest.raises(UsageError, match="CUDA"):
        HybridLM(m, None, ns, attention="cudnn")
    with pytest.raises(UsageError, match="attention must be"):
        HybridLM(m, None, ns, attention="sdpa")
    assert HybridLM(m, None, ns).attention == "model"  # auto on the CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlashAttention-2)")
def test_flash_attention_gives_the_models_answer_on_cuda(tmp_path: Path) -> None:
    """On CUDA (bf16), FlashAttention-2 with the sliding window as its left window gives the
    model's own attention's next token, for a full prefill longer than the window and for a
    cached hit that replays blocks (CI has no CUDA: this runs on a GPU machine)."""
    m = gemma3().to(device="cuda", dtype=torch.bfloat16)
    ns = namespace_of(m, "test/flash", BT)
    store = _store(tmp_path)
    try:
        model_attn = HybridLM(m, store, ns, policy=CheckpointPolicy(every_blocks=C), attention="model")
        flash = HybridLM(m, store, ns, policy=CheckpointPolicy(every_blocks=C), attention="flash")
        base = _tokens(11, 120)
        model_attn.prefill(base)
        prompt = torch.cat([base[:90], _tokens(12, 20)])  # leaves the chain between checkpoints
        for kw in ({"use_cache": False}, {}):
            a = model_attn.prefill(prompt, store=False, **kw)
            b = flash.prefill(prompt, store=False, **kw)
            assert a.replayed_tokens == b.replayed_tokens
            assert int(a.logits.argmax()) == int(b.logits.argmax())
            assert float((a.logits - b.logits).abs().max() / a.logits.abs().max()) <= 2e-2
        model_attn.close()
        flash.close()
    finally:
        store.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN attention)")
def test_cudnn_full_layers_give_flash_attentions_answer_on_cuda(tmp_path: Path) -> None:
    """On CUDA (bf16): cuDNN for the full layers (bottom-right causal by a split and a log-sum-exp
    merge) equals FlashAttention-2 on random inputs of many shapes, and through the engine gives
    the same next token, with and without the cone (CI has no CUDA: this runs on a GPU machine)."""
    from engine.reference.hybrid import _cudnn_full, _flash_window, cudnn_check

    dev = torch.device("cuda")
    mode = cudnn_check(dev)
    assert mode in ("gqa", "expand")
    for s_q, t in ((1, 1), (7, 7), (5, 300), (130, 1000), (512, 4096)):
        g = torch.Generator(device=dev).manual_seed(s_q * 7 + t)
        q = torch.randn((1, s_q, 8, 128), device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
        k = torch.randn((1, 2, t, 128), device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn((1, 2, t, 128), device=dev, dtype=torch.bfloat16, generator=g)
        ref = _flash_window(None, q, k, v, None, 0.088)[0].float()
        out = _cudnn_full(q, k, v, 0.088, mode).float()
        assert float((out - ref).norm() / ref.norm()) < 1e-2, (s_q, t)
    m = gemma3().to(device="cuda", dtype=torch.bfloat16)
    ns = namespace_of(m, "test/cudnn", BT)
    store = _store(tmp_path)
    try:
        flash = HybridLM(m, store, ns, policy=CheckpointPolicy(every_blocks=C), attention="flash", cone=False)
        base = _tokens(11, 120)
        flash.prefill(base)
        prompt = torch.cat([base[:90], _tokens(12, 20)])  # leaves the chain between checkpoints
        b = flash.prefill(prompt, store=False)
        for cone in (False, True):
            lm = HybridLM(m, store, ns, policy=CheckpointPolicy(every_blocks=C), attention="cudnn", cone=cone)
            a = lm.prefill(prompt, store=False)
            assert a.replayed_tokens == b.replayed_tokens > 0 and bool(a.cone) == cone
            assert int(a.logits.argmax()) == int(b.logits.argmax())
            assert float((a.logits - b.logits).abs().max() / b.logits.abs().max()) <= 2e-2
            lm.close()
        flash.close()
    finally:
        store.close()
