"""Model families on vLLM's CPU build, end to end: an fp8 KV cache, MLA (a tiny DeepSeek-V2),
a sliding-window model (Mistral) and a hybrid full + sliding model (Gemma 3).

Each family: vLLM alone, then two fresh vLLM processes against one daemon (the first stores, the
second hits), all three with the same thread binding (vLLM computes on another number of threads
when a connector is set); the second's greedy tokens and logprobs equal vLLM alone's.
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
