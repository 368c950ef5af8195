"""Batched prefill: many requests with their own cached prefixes in one pass equal each run alone.

Small random-weight models (Llama with grouped-query attention, GPT-NeoX), float32, on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.client import EngineCache  # noqa: E402
from engine.kvlayout import shape_of  # noqa: E402
from engine.reference.batch import BatchedLM, batches  # noqa: E402
from engine.reference.hbm_cache import HbmCache  # noqa: E402
from engine.reference.hf import CachedLM  # noqa: E402
from kvstore.config import StoreConfig, TierSpec  # noqa: E402
from kvstore.store import KVStore  # noqa: E402
from tests.engine.reference.test_hf import MODELS, rel_err  # noqa: E402

BT = 16


def _store(tmp_path: Path, block_bytes: int, blocks: int = 128) -> KVStore:
    tiers = (TierSpec("dram", "dram", {"capacity_bytes": blocks * block_bytes, "slab_bytes": 8 * block_bytes}),)
    return KVStore(StoreConfig(root=tmp_path, tiers=tiers, persist_on_close=False))


@pytest.fixture(params=list(MODELS))
def setup(request: pytest.FixtureRequest, tmp_path: Path):
    model: torch.nn.Module = MODELS[request.param]()
    shape = shape_of(model.config, torch.float32, BT)
    store = _store(tmp_path, shape.block_bytes)
    cache = EngineCache(store, shape.namespace(f"test/batch-{request.param}"), shape, max_pending=64)
    yield model, cache
    cache.close()
    store.close()


def _prompts(g: torch.Generator) -> tuple[torch.Tensor, list[torch.Tensor]]:
    system = torch.randint(0, 256, (40,), generator=g)  # a shared system prompt (2.5 blocks)
    tails = [torch.randint(0, 256, (n,), generator=g) for n in (30, 7, 50, 1)]
    return system, [torch.cat([system, t]) for t in tails]


def test_batch_equals_each_request_alone(setup) -> None:
    model, cache = setup
    g = torch.Generator().manual_seed(1)
    system, prompts = _prompts(g)
    other = torch.randint(0, 256, (45,), generator=g)  # shares nothing
    prompts.append(other)
    plain = CachedLM(model, None)
    want = [plain.prefill(p).logits for p in prompts]
    lm = BatchedLM(model, cache, attention="loop", block_tokens=BT, layer_groups=2)
    cold = lm.prefill(prompts)  # nothing cached: all computed, new blocks stored
    assert [r.hit_tokens for r in cold] == [0] * len(prompts)
    cache.flush()
    warm = lm.prefill(prompts)  # every prompt's full blocks cached now (at least one token computed)
    assert [r.hit_tokens for r in warm] == [64, 32, 80, 32, 32]
    assert [r.computed_tokens for r in warm] == [6, 15, 10, 9, 13]
    for got in (cold, warm):
        for r, w in zip(got, want, strict=True):
            assert rel_err(r.logits, w) <= 1e-4
            assert int(r.logits.argmax()) == int(w.argmax())
    # The cold batch's stores were staged in the host ring (one copy for the batch, no clone
    # per store) and its space came back once they were done.
    cache.flush()
    assert lm._ring is not None and lm._ring.in_use == 0
    assert lm.timings.batches == 2 and lm.timings.plan > 0


def test_stores_larger_than_the_ring_stage_their_own_copies(setup) -> None:
    model, cache = setup
    g = torch.Generator().manual_seed(4)
    _, prompts = _prompts(g)
    small = BatchedLM(model, cache, attention="loop", block_tokens=BT, store_ring_bytes=cache.shape.block_bytes)
    small.prefill(prompts)  # more than one block to store: the ring cannot take the batch
    cache.flush()
    assert small._ring is not None and small._ring.in_use == 0
    warm = small.prefill(prompts)
    assert [r.hit_tokens for r in warm] == [64, 32, 80, 32]


def test_mixed_hits_in_one_batch(setup) -> None:
    """One request fully computed, one with its system prompt cached, one with a long history."""
    model, cache = setup
    g = torch.Generator().manual_seed(2)
    history = torch.randint(0, 256, (70,), generator=g)
    single = CachedLM(model, cache)
    single.prefill(history)
    cache.flush()
    prompts = [
        torch.randint(0, 256, (33,), generator=g),
        torch.cat([history[:20], torch.randint(0, 256, (25,), generator=g)]),
        torch.cat([history, torch.randint(0, 256, (12,), generator=g)]),
    ]
    plain = CachedLM(model, None)
    got = BatchedLM(model, cache, attention="loop", block_tokens=BT).prefill(prompts, store=False)
    assert [r.hit_tokens for r in got] == [0, 16, 64]
    for r, p in zip(got, prompts, strict=True):
        assert rel_err(r.logits, plain.prefill(p).logits) <= 1e-4


@pytest.mark.parametrize("gather", ["load", "compute"])
def test_hits_from_hbm_promotion_and_admission(setup, gather: str) -> None:
    """A DRAM hit is promoted into the HBM pages; computed blocks are admitted; the next batch is
    served from HBM with the same logits (HBM hits gathered on the load stream or just before
    each layer on the compute stream)."""
    model, cache = setup
    g = torch.Generator().manual_seed(3)
    hbm = HbmCache(cache, 64 * cache.shape.block_bytes, device="cpu")
    system, prompts = _prompts(g)
    single = CachedLM(model, cache)
    single.prefill(system)  # 2 full blocks in DRAM
    cache.flush()
    plain = CachedLM(model, None)
    lm = BatchedLM(model, cache, hbm=hbm, attention="loop", block_tokens=BT, hbm_gather=gather)
    first = lm.prefill(prompts[:1])
    assert first[0].hit_tokens == 32 and first[0].hbm_tokens == 0  # from DRAM, promoted
    assert hbm.counters.promoted == 2 and hbm.counters.admitted == 2  # blocks 2, 3 computed
    cache.flush()
    again = lm.prefill(prompts)
    assert [r.hbm_tokens for r in again] == [64, 32, 32, 32]
    assert [r.hit_tokens for r in again] == [64, 32, 32, 32]
    for r, p in zip(again, prompts, strict=True):
        assert rel_err(r.logits, plain.prefill(p).logits) <= 1e-4
    hbm.close()


def test_wide_views_move_the_same_bytes_in_8_byte_elements() -> None:
    from engine.kvlayout import wide

    x = torch.randn(3, 4, 2, 16, dtype=torch.bfloat16).transpose(1, 2)  # a token-major view of [n, H, T, D]
    w = wide(x)
    assert w.dtype == torch.int64 and w.shape == (3, 2, 4, 4)
    out = torch.empty(3, 2, 4, 16, dtype=torch.bfloat16)
    wide(out).copy_(w)
    assert torch.equal(out, x)
    odd = torch.randn(3, 5, dtype=torch.bfloat16)  # 10-byte rows: left as they are
    assert wide(odd) is odd


@pytest.mark.parametrize("gather", ["load", "compute"])
def test_a_prefix_promoted_in_a_batch_serves_the_rest_of_that_batch(setup, gather: str) -> None:
    """Two requests share a system prompt found in DRAM: the first promotes it, the second is
    gathered from the pages being filled in the same pass (ordered on one stream)."""
    model, cache = setup
    hbm = HbmCache(cache, 64 * cache.shape.block_bytes, device="cpu")
    system, prompts = _prompts(torch.Generator().manual_seed(4))
    CachedLM(model, cache).prefill(system)
    cache.flush()
    got = BatchedLM(model, cache, hbm=hbm, attention="loop", block_tokens=BT, hbm_gather=gather).prefill(prompts[:2], store=False)
    assert [(r.hit_tokens, r.hbm_tokens) for r in got] == [(32, 0), (32, 32)]
    plain = CachedLM(model, None)
    for r, p in zip(got, prompts[:2], strict=True):
        assert rel_err(r.logits, plain.prefill(p).logits) <= 1e-4
    hbm.close()


def test_batches_respects_both_budgets() -> None:
    reqs = [(100, 1000), (100, 1000), (500, 500), (50, 4000), (10, 10)]
    # 0+1 fill 200 of 300 computed tokens, 2 would overflow them; 3 and 4 fit together
    assert batches(reqs, max_tokens=300, max_rows=5000, block_tokens=64) == [[0, 1], [2], [3, 4]]
    # rows: 1024 + 1024, then 512; 3 (4032 rows) is over the limit and runs alone
    assert batches(reqs, max_tokens=10_000, max_rows=2200, block_tokens=64) == [[0, 1], [2], [3], [4]]


def test_rejects_varlen_on_cpu_and_hbm_without_store(setup) -> None:
    model, cache = setup
    with pytest.raises(ValueError, match="CUDA"):
        BatchedLM(model, cache, attention="varlen")
    with pytest.raises(ValueError, match="EngineCache"):
        BatchedLM(model, None, hbm=HbmCache(cache, 64 * cache.shape.block_bytes, device="cpu"))
