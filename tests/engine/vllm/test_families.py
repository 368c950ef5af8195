"""Model families on vLLM's CPU build, end to end: an fp8 KV cache, MLA (a tiny DeepSeek-V2),
a sliding-window model (Mistral), a hybrid full + sliding model (Gemma 3), with vLLM's hybrid
KV cache manager on (its sliding-window KV cache groups) and off, and a hybrid full + linear
attention model (Qwen3-Next: recurrent state at checkpoints).

Each family: vLLM alone, then two fresh vLLM processes against one daemon (the first stores, the
second hits), all three with the same thread binding (vLLM computes on another number of threads
when a connector is set); the second's greedy tokens and logprobs equal vLLM alone's (MLA: vLLM's
when its own ExampleConnector loads the same blocks, as its CPU MLA backend is not invariant to
the batch's shape).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed here: run `make test-vllm`")

from engine.vllm.harness import small_daemon  # noqa: E402
from tests.engine.vllm.conftest import counters, prompts, run_scenario, same_outputs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROBUST = {"lookup_timeout_s": 60, "load_timeout_s": 120, "save_timeout_s": 120, "max_pending_saves": 256}
ENGINE = {"prefix_caching": False, "max_model_len": 1024, "dtype": "float32"}


def _bind() -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": str(sorted(os.sched_getaffinity(0))[0])}


def _hit(out: dict[str, Any]) -> int:
    return int(out["kvstore_hit_tokens"])


def run_family(model: str, engine: dict[str, Any], connector: dict[str, Any], ps: list[list[int]],
               tmp: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(vLLM alone, the storing process, the hitting process): one round of ``ps`` each."""
    env = _bind()
    (alone,) = run_scenario({"model": model, "connector": None, "engine": engine, "rounds": [{"prompts": ps}]},
                            tmp / "alone", env=env)
    with small_daemon(tmp / "daemon") as d:
        spec = {"model": model, "url": d.url, "connector": {**ROBUST, **connector}, "engine": engine,
                "rounds": [{"prompts": ps}]}
        (stored,) = run_scenario(spec, tmp / "stored", env=env)
        (hit,) = run_scenario(spec, tmp / "hit", env=env)
    return alone, stored, hit


def test_fp8_kv_cache(models: dict[str, str], tmp_path: Path) -> None:
    """``--kv-cache-dtype fp8``: 1-byte pages stored and loaded as they are; the namespace holds
    the fp8 format and the digest of the layers' scales."""
    bt = 32
    ps = prompts(11, [200, 330])
    alone, stored, hit = run_family(models["small"], {**ENGINE, "kv_cache_dtype": "fp8"}, {"load_mode": "async"},
                                    ps, tmp_path)
    same_outputs(stored, alone)
    assert [_hit(o) for o in hit] == [(len(p) - 1) // bt * bt for p in ps]
    same_outputs(hit, alone)
    (c,) = counters(tmp_path / "hit")[0]
    assert c["loaded_blocks"] == sum((len(p) - 1) // bt for p in ps) and c["failed_blocks"] == 0


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from engine.vllm.tiny import (
        save_tiny_deepseek,
        save_tiny_gemma3,
        save_tiny_mistral,
        save_tiny_qwen3_next,
    )

    base = tmp_path_factory.mktemp("family-models")
    return {"mistral": str(save_tiny_mistral(base / "mistral", window=64)),
            "gemma3": str(save_tiny_gemma3(base / "gemma3", window=64)),
            "deepseek": str(save_tiny_deepseek(base / "deepseek")),
            "qwen3_next": str(save_tiny_qwen3_next(base / "qwen3-next"))}


def test_mla_latent_pages(family_models: dict[str, str], tmp_path: Path) -> None:
    """A tiny DeepSeek-V2 on vLLM's CPU MLA backend (kv_lora_rank 512 + rope 64, 16-token pages:
    the CPU build forces them, and turns vLLM's prefix cache and chunked prefill off): a fresh
    process loads every stored block but the last of each prompt, without a failure, and answers
    as vLLM does when its own ExampleConnector loads the same blocks.

    The reference is vLLM with its ExampleConnector (one process: a cold round that stores, then
    a round that loads), not vLLM alone: vLLM 0.32's CPU MLA backend is not invariant to the
    batch (vLLM alone answers the same prompt differently alone and beside another one:
    first-token logprobs 0.1-0.5 apart, ``docs/vllm.md``), and a hit changes the batch's shape
    (a few new tokens over a loaded context). The ExampleConnector loads the same whole blocks
    (all but the one holding the last prompt token), so its loaded round computes in the same
    shapes as kvstore's hit; only the latent bytes loaded can differ."""
    bt = 16
    ps = prompts(12, [150, 233])
    env = _bind()
    model, conn = family_models["deepseek"], {**ROBUST, "load_mode": "layerwise"}
    example = {"model": model, "connector": None, "example": str(tmp_path / "example-kv"), "engine": ENGINE,
               "rounds": [{"prompts": ps}, {"prompts": ps}]}
    cold, loaded = run_scenario(example, tmp_path / "example", env=env)
    with small_daemon(tmp_path / "daemon") as d:
        spec = {"model": model, "url": d.url, "connector": conn, "engine": ENGINE, "rounds": [{"prompts": ps}]}
        (stored,) = run_scenario(spec, tmp_path / "stored", env=env)
        (hit,) = run_scenario(spec, tmp_path / "hit", env=env)
    same_outputs(stored, cold)  # nothing loaded by either
    want = [(len(p) - 1) // bt * bt for p in ps]
    assert [_hit(o) for o in hit] == want
    assert [o["cached_tokens"] for o in loaded] == [o["cached_tokens"] for o in hit] == want
    same_outputs(hit, loaded, atol=1e-6)  # the same shapes, the same latent bytes: the same floats
    (s,) = counters(tmp_path / "stored")[0]
    assert s["saved_blocks"] == sum(len(p) // bt for p in ps)
    (c,) = counters(tmp_path / "hit")[0]
    assert c["loaded_blocks"] == sum((len(p) - 1) // bt for p in ps) and c["failed_blocks"] == 0


# A prompt of 10 full 32-token blocks, and one that shares its first 250 tokens (7 full blocks).
A = prompts(13, [330])[0]
B = A[:250] + prompts(14, [150])[0]
C = 4  # checkpoint_every_blocks: A's windows are stored at blocks 3, 7 and 9 (its end)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_window_hits_end_at_checkpoints_with_bounded_replay(family: str, family_models: dict[str, str],
                                                                    tmp_path: Path) -> None:
    """Mistral (every layer slides over 64 tokens) and Gemma 3 (sliding and full layers
    alternate), vLLM's prefix cache off and its hybrid KV cache manager off (one KV cache group;
    for Mistral the same either way): the sliding layers are stored as 2-block windows at
    checkpoints. A hit on A ends at its last checkpoint (nothing replayed); B shares 7 of A's
    blocks but none of A's checkpoints past block 3: it loads blocks 0-3 and vLLM recomputes the
    rest (3 cached blocks replayed, under the bound of C - 1)."""
    bt = 32
    conn = {"load_mode": "async", "sliding": "window", "checkpoint_every_blocks": C}
    env = _bind()
    model = family_models[family]
    (alone,) = run_scenario({"model": model, "connector": None, "engine": ENGINE, "rounds": [{"prompts": [A, B]}]},
                            tmp_path / "alone", env=env)
    engine = {**ENGINE, "disable_hybrid_kv_cache_manager": True}
    with small_daemon(tmp_path / "daemon") as d:
        spec = {"model": model, "url": d.url, "connector": {**ROBUST, **conn}, "engine": engine}
        (stored,) = run_scenario({**spec, "rounds": [{"prompts": [A]}]}, tmp_path / "stored", env=env)
        (hit,) = run_scenario({**spec, "rounds": [{"prompts": [A, B]}]}, tmp_path / "hit", env=env)
    same_outputs(stored, alone[:1])
    assert [_hit(o) for o in hit] == [10 * bt, 4 * bt]
    # Mistral has no full layer: a hit's "cached blocks" are its checkpoint's, so nothing replays.
    assert [o["kvstore_replayed_tokens"] for o in hit] == [0, 3 * bt if family == "gemma3" else 0]
    same_outputs(hit, alone)
    (c,) = counters(tmp_path / "stored")[0]
    assert c["saved_pieces"] == 6  # the windows of checkpoints 3, 7, 9: blocks 2, 3, 6, 7, 8, 9


def test_hybrid_manager_windows_shared_with_the_one_group_mode(family_models: dict[str, str], tmp_path: Path) -> None:
    """Gemma 3 with vLLM's hybrid KV cache manager on (the connector is ``SupportsHMA``): a
    sliding-window KV cache group whose pages hold only the window, beside the full-attention
    one, and vLLM's prefix cache on. A prompt stored by an engine with the manager off (one KV
    cache group, prefix cache off) is a hit for it: both modes store the same blocks under the
    same keys. A hits on its last checkpoint, B on checkpoint 3 with 3 cached blocks replayed
    (< C); B's own windows (checkpoints 6 = where its replay ended, 7, and its end 11) then let a
    third engine hit all of B's 12 blocks with nothing replayed. Greedy tokens and logprobs equal
    vLLM alone's (its hybrid manager and prefix cache on, as vLLM runs Gemma 3 by default)."""
    bt = 32
    conn = {**ROBUST, "load_mode": "async", "checkpoint_every_blocks": C}
    env = _bind()
    model = family_models["gemma3"]
    hma = {**ENGINE, "prefix_caching": True}
    (alone,) = run_scenario({"model": model, "connector": None, "engine": hma, "rounds": [{"prompts": [A, B]}]},
                            tmp_path / "alone", env=env)
    with small_daemon(tmp_path / "daemon") as d:
        one_group = {**ENGINE, "disable_hybrid_kv_cache_manager": True}
        base = {"model": model, "url": d.url}
        (stored,) = run_scenario({**base, "connector": {**conn, "sliding": "window"}, "engine": one_group,
                                  "rounds": [{"prompts": [A]}]}, tmp_path / "stored", env=env)
        (hit,) = run_scenario({**base, "connector": conn, "engine": hma, "rounds": [{"prompts": [A, B]}]},
                              tmp_path / "hit", env=env)
        (again,) = run_scenario({**base, "connector": conn, "engine": hma, "rounds": [{"prompts": [B]}]},
                                tmp_path / "again", env=env)
    same_outputs(stored, alone[:1])
    assert [_hit(o) for o in hit] == [10 * bt, 4 * bt]
    assert [o["kvstore_replayed_tokens"] for o in hit] == [0, 3 * bt]
    same_outputs(hit, alone)
    (c,) = counters(tmp_path / "hit")[0]
    assert c["failed_blocks"] == 0
    # B's windows of checkpoints 6, 7 and 11 (blocks 5, 6, 7, 10, 11) are 4 new pieces: block 6's
    # is A's (the same prefix, the same key), stored by the first engine.
    assert c["saved_pieces"] == 4
    assert [(_hit(o), o["kvstore_replayed_tokens"]) for o in again] == [(12 * bt, 0)]
    same_outputs(again, alone[1:])


def _reference_engine(model: str, url: str) -> Any:
    """``engine.reference.hybrid.HybridLM`` (transformers, float32) over the daemon at ``url``, C = 4."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.reference.hybrid import HybridLM, namespace_of
    from kvstore.client import connect
    from kvstore.hybrid import CheckpointPolicy

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    client = connect(url, plane="tcp", timeout=60)
    return HybridLM(hf, client, namespace_of(hf, model, 32), policy=CheckpointPolicy(every_blocks=C),
                    attention="model")


def test_blocks_shared_with_the_reference_engine(family_models: dict[str, str], tmp_path: Path) -> None:
    """``block_format = kvstore``: the connector stores the reference engine's format under its
    namespace (model id = the model path, revision ``main``). A prompt the reference engine
    (``engine.reference.hybrid``) stored is a hit for vLLM (hybrid KV cache manager on), with the same
    checkpoints and bounded replay; a prompt vLLM stored is a hit for the reference engine.
    Both answer as vLLM alone does."""
    bt = 32
    env = _bind()
    model = family_models["gemma3"]
    hma = {**ENGINE, "prefix_caching": True}
    (alone,) = run_scenario({"model": model, "connector": None, "engine": hma, "rounds": [{"prompts": [A, B]}]},
                            tmp_path / "alone", env=env)
    conn = {**ROBUST, "load_mode": "async", "checkpoint_every_blocks": C, "block_format": "kvstore"}
    with small_daemon(tmp_path / "daemon") as d:
        ref = _reference_engine(model, d.url)
        tokens, pre = ref.generate(A, 8)  # stores A's blocks, windows at checkpoints 3, 7, 9
        assert pre.checkpoint == -1 and tuple(tokens) == tuple(alone[0]["tokens"])
        (hit,) = run_scenario({"model": model, "url": d.url, "connector": conn, "engine": hma,
                               "rounds": [{"prompts": [A, B]}]}, tmp_path / "hit", env=env)
        # vLLM stored B's blocks 4-11 and windows at 6, 7 and 11: the reference engine hits all 12.
        tokens, pre = ref.generate(B, 8)
        assert (pre.checkpoint, pre.hit_tokens, pre.replayed_tokens) == (11, 12 * bt, 0)
        assert tuple(tokens) == tuple(alone[1]["tokens"])
        ref.store.close()
    assert [_hit(o) for o in hit] == [10 * bt, 4 * bt]
    assert [o["kvstore_replayed_tokens"] for o in hit] == [0, 3 * bt]
    same_outputs(hit, alone)


def test_recurrent_state_at_vllms_checkpoints(family_models: dict[str, str], tmp_path: Path) -> None:
    """A tiny Qwen3-Next (gated delta net linear attention and full attention alternating, bf16),
    vLLM's prefix cache on (its ``align`` mode keeps a state at retained block boundaries; vLLM
    picks 640-token blocks), prefill chunks and a retention interval of 2 blocks: vLLM offers the
    connector the state at blocks 1 and 3 and at the prompt's last full block 4
    (``boundary_state_offloads``), where it is stored beside the full part. A fresh process hits
    all 5 of A's blocks on its last checkpoint, and B, which shares 3 of A's blocks, hits the
    checkpoint at block 1 and replays block 2 (under the bound, C - 1 = 1 block); vLLM keeps, and
    the connector stores, B's state where its replay ended (block 2: where B leaves A's cached
    prefix) and at its end (block 3), so a third process hits D, which shares 3 blocks with both,
    on block 2 with nothing replayed. Greedy tokens and logprobs equal vLLM alone's, each prompt
    in its own round in every run (vLLM alone then serves B and D from its own prefix cache at
    the same blocks: the same chunks as the hits)."""
    bt, every = 640, 2
    a = prompts(15, [3300])[0]
    b = a[:2000] + prompts(16, [600])[0]
    d = a[:1950] + prompts(17, [400])[0]
    engine = {"prefix_caching": True, "dtype": "bfloat16", "max_model_len": 4096, "block_size": None,
              "max_num_batched_tokens": every * bt, "prefix_cache_retention_interval": every * bt}
    rounds = [{"prompts": [a]}, {"prompts": [b]}, {"prompts": [d]}]
    env = _bind()
    model = family_models["qwen3_next"]
    alone = run_scenario({"model": model, "connector": None, "engine": engine, "rounds": rounds},
                         tmp_path / "alone", env=env)
    with small_daemon(tmp_path / "daemon") as d:
        spec = {"model": model, "url": d.url, "connector": {**ROBUST, "load_mode": "async"}, "engine": engine}
        (stored,) = run_scenario({**spec, "rounds": rounds[:1]}, tmp_path / "stored", env=env)
        hit = run_scenario({**spec, "rounds": rounds[:2]}, tmp_path / "hit", env=env)
        (again,) = run_scenario({**spec, "rounds": rounds[2:]}, tmp_path / "again", env=env)
    same_outputs(stored, alone[0])
    (s,) = counters(tmp_path / "stored")[0]
    assert (s["saved_blocks"], s["saved_states"]) == (5, 3)  # states at blocks 1, 3 and 4
    assert [(_hit(o), o["kvstore_replayed_tokens"]) for rnd in hit for o in rnd] == [(5 * bt, 0), (2 * bt, bt)]
    for got, want in zip([*hit, again], alone, strict=True):
        same_outputs(got, want)
    c = counters(tmp_path / "hit")[-1][0]
    assert c["failed_blocks"] == 0 and c["loaded_blocks"] == 7
    assert c["saved_states"] == 2  # B's at blocks 2 and 3
    assert [(_hit(o), o["kvstore_replayed_tokens"]) for o in again] == [(3 * bt, 0)]
