"""The hybrid engine: full part + checkpoint window + bounded replay gives the uncached answer.

Two small random-weight sliding-window models, float32 on the CPU: Gemma-3 (alternating local
and global layers) and Mistral with ``sliding_window`` (every layer local). Blocks of 8 tokens,
a 24-token window (23 tokens kept: not a multiple of the block), a checkpoint every 3 blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.hybrid import HybridLM, namespace_of, plan_of  # noqa: E402
from kvstore.client import connect  # noqa: E402
from kvstore.client.spawn import start_daemon  # noqa: E402
from kvstore.config import StoreConfig, TierSpec  # noqa: E402
from kvstore.errors import UsageError  # noqa: E402
from kvstore.hybrid import CheckpointPolicy  # noqa: E402
from kvstore.store import KVStore  # noqa: E402

BT, W, C = 8, 24, 3
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


MODELS: dict[str, Callable[[], Any]] = {"gemma3-alternating": gemma3, "mistral-all-swa": mistral}


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


def _scenarios(lm: HybridLM, plain: HybridLM, seed: int) -> None:
    base = _tokens(seed, 100)  # 12 full blocks: checkpoints 2, 5, 8 (every 3) and 11 (the end)
    first = lm.prefill(base)
    assert first.checkpoint == -1 and first.hit_tokens == 0
    # A hit that ends on a checkpoint: 49 tokens -> blocks 0..5 usable, block 5 is a checkpoint.
    _check(lm, plain, base[:49], checkpoint=5, replayed_blocks=0)
    # Between checkpoints: blocks 0..7 usable, nearest checkpoint 5, blocks 6 and 7 replayed.
    _check(lm, plain, base[:65], checkpoint=5, replayed_blocks=2)
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
        periodic_only.prefill(base)  # full part of 11 blocks, windows at 2, 5, 8 only
        lm = HybridLM(model, store, ns, policy=CheckpointPolicy(every_blocks=C))
        _check(lm, plain, torch.cat([base, _tokens(6, 20)]), checkpoint=8, replayed_blocks=2)
    finally:
        store.close()


def test_store_everything_baseline_equals_uncached(model: Any, tmp_path: Path) -> None:
    store = _store(tmp_path)
    ns = namespace_of(model, "test/everything", BT)
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
    ns = namespace_of(model, f"test/hybrid-daemon-{plane}", BT)
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
        assert store.delete(lm.hyb.window, [lm.hyb.window_key(hashes[5])]) == 1
        # Blocks 0..5 usable; checkpoint 5's window is gone: the hit ends at checkpoint 2.
        blocks_after = 3 if lm.hyb.full is not None else 0
        _check(lm, plain, base[:49], checkpoint=2, replayed_blocks=blocks_after, bounded=False)
    finally:
        store.close()


def test_unsupported_layer_types_are_refused() -> None:
    cfg = transformers.Gemma3TextConfig(sliding_window=W, sliding_window_pattern=2, **_SIZES)
    cfg.layer_types = ["sliding_attention", "linear_attention", "full_attention", "full_attention"]
    with pytest.raises(UsageError, match="linear_attention"):
        plan_of(cfg)
