"""``python -m tools.bench vllm --workload families``: one row per model family the vLLM connector
stores (dense GQA, fp8 KV, MLA, every layer sliding, sliding and full layers mixed: with vLLM's
hybrid KV cache manager, without it, and every layer stored; linear attention and full layers
mixed: recurrent state at checkpoints), vLLM alone and vLLM with kvstore in the same run, on
vLLM's CPU build. ``KVSTORE_BENCH_FAMILIES=name,name`` runs only those rows.

Per family (a tiny random-weight model, ``engine.vllm.tiny``): ``DOCS`` documents of ``DOC``
tokens, each asked ``QUESTIONS`` questions of ``QUESTION`` tokens, one request at a time. Each
engine is its own process: vLLM alone (prefix cache off, as the kvstore engines of the sliding
families need it; its TTFT is a full prefill), and with kvstore (a first process reads every
document with its first question, which stores it; a fresh process then asks the other questions:
its hits come from the daemon; its saves are awaited after each question, so the next one
finds the windows this one stored where its replay ended). Reported: the hit tokens, the bytes the daemon holds per cached
token against storing every layer of every block (the daemon's own count of this tenant's bytes),
the tokens replayed per hit (sliding families: cached tokens past the checkpoint the hit ended
on, which vLLM recomputed), for the half-sliding rows the bytes against the same prompts stored
with every layer (``sliding = every_layer``, a row of its own: both counted by the daemon), and
the TTFT of each engine (vLLM's ``first_token_latency``), one
compute thread per engine, bound to the same core (``VLLM_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tools.bench._common import result

DOCS, DOC, QUESTIONS, QUESTION, C = 2, 1000, 3, 48, 8
LONG_DOC, LONG_C = 3500, 32
"""The long half-sliding rows: documents far longer than the window (64 tokens), C = 32."""
STATE_BT, STATE_C = 640, 2
"""The recurrent row: vLLM's blocks for the tiny Qwen3-Next (it sets them from the state's size),
and a checkpoint every 2 of them: vLLM keeps a state (and offers it to the connector) where its
prefix cache retains one, every ``--prefix-cache-retention-interval`` tokens a prefill chunk ends
on, and at each prompt's last full block."""
RECURRENT = {"prefix_caching": True, "dtype": "bfloat16", "block_size": None,
             "max_num_batched_tokens": STATE_BT * STATE_C, "prefix_cache_retention_interval": STATE_BT * STATE_C}
"""vLLM keeps recurrent states at block boundaries only with its prefix cache on (``align``
mode); the gated delta net runs on the CPU in bfloat16 only."""
ONE_GROUP = {"disable_hybrid_kv_cache_manager": True}
EVERY_LAYER = {"sliding": "every_layer"}


@dataclass(frozen=True, slots=True)
class Family:
    model: str
    engine: dict[str, Any] = field(default_factory=dict)
    connector: dict[str, Any] = field(default_factory=dict)
    doc: int = DOC
    baseline: str = ""
    """The row that stored the same prompts with every layer: bytes are compared with its."""

    @property
    def c(self) -> int:
        if self.engine.get("prefix_cache_retention_interval"):  # recurrent state: vLLM's checkpoints
            return STATE_C
        return int(self.connector.get("checkpoint_every_blocks", 0))


def _windows(c: int) -> dict[str, Any]:
    return {"sliding": "window", "checkpoint_every_blocks": c}


FAMILIES = {
    "dense-gqa": Family("llama"),
    "fp8-kv": Family("llama", {"kv_cache_dtype": "fp8"}),
    "mla": Family("deepseek"),
    "sliding-all": Family("mistral", connector=_windows(C)),
    "sliding-half-every-layer": Family("gemma3", ONE_GROUP, EVERY_LAYER),
    "sliding-half": Family("gemma3", connector=_windows(C), baseline="sliding-half-every-layer"),
    "sliding-half-one-group": Family("gemma3", ONE_GROUP, _windows(C), baseline="sliding-half-every-layer"),
    "sliding-half-long-every-layer": Family("gemma3-w64", ONE_GROUP, EVERY_LAYER, doc=LONG_DOC),
    "sliding-half-long": Family("gemma3-w64", connector=_windows(LONG_C), doc=LONG_DOC,
                                baseline="sliding-half-long-every-layer"),
    "recurrent-half": Family("qwen3-next", RECURRENT, doc=LONG_DOC),
}
"""``sliding-half``: vLLM's hybrid KV cache manager on (its default with kvstore's connector);
``-one-group``: off (``--disable-hybrid-kv-cache-manager``); ``-every-layer``: every layer of
every block stored (the manager off: with it vLLM keeps only the windows). ``recurrent-half``: a
Qwen3-Next (gated delta net and full layers alternating); "every layer" is the full layers' pages
and a state at every block."""


def _workload(quick: bool, doc_tokens: int = DOC) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    docs, doc = (1, min(500, doc_tokens)) if quick else (DOCS, doc_tokens)
    out: dict[str, Any] = {"store": [], "ask": []}
    for _ in range(docs):
        d = rng.integers(3, 2000, doc).tolist()
        qs = [rng.integers(3, 2000, QUESTION).tolist() for _ in range(QUESTIONS)]
        out["store"].append(d + qs[0])
        out["ask"] += [d + q for q in qs[1:]]
    return out


def _models(base: Path) -> dict[str, Path]:
    from engine.vllm.tiny import (
        SMALL,
        save_tiny_deepseek,
        save_tiny_gemma3,
        save_tiny_llama,
        save_tiny_mistral,
        save_tiny_qwen3_next,
    )

    return {"llama": save_tiny_llama(base / "llama", SMALL), "deepseek": save_tiny_deepseek(base / "deepseek"),
            "mistral": save_tiny_mistral(base / "mistral", window=128),
            "gemma3": save_tiny_gemma3(base / "gemma3", window=128),
            "gemma3-w64": save_tiny_gemma3(base / "gemma3-w64", window=64),
            "qwen3-next": save_tiny_qwen3_next(base / "qwen3-next")}


def child(spec_path: str) -> None:
    """One engine process: ``store`` (read the documents, flush the saves) or ``ask`` (TTFT of
    each question, one at a time)."""
    from engine.vllm.harness import (
        flush_saves,
        generate,
        generate_timed,
        kvstore_transfer,
        make_llm,
        worker_namespaces,
    )

    spec = json.loads(Path(spec_path).read_text())
    transfer = None if spec["url"] is None else kvstore_transfer(spec["url"], **spec["connector"],
                                                                  save_timeout_s=120, load_timeout_s=120,
                                                                  lookup_timeout_s=60, max_pending_saves=256)
    engine = {"prefix_caching": False, "dtype": "float32", **spec["engine"]}
    llm = make_llm(spec["model"], kv_transfer_config=transfer, max_model_len=4096, disable_log_stats=False,
                   **engine)
    # Warm-up (kernels, first calls): shorter than a block, so nothing of it is stored.
    generate(llm, [list(range(5, 20))], max_tokens=1)
    out: dict[str, Any] = {"ttft_ms": [], "hit": [], "replayed": [], "block_bytes": 0}
    if spec["phase"] == "store":
        generate(llm, spec["workload"]["store"], max_tokens=1)
        flush_saves(llm)
    else:
        for p in spec["workload"]["ask"]:
            if engine["prefix_caching"]:  # every hit from kvstore, none from vLLM's own cache
                llm.reset_prefix_cache()
            c, ttft = generate_timed(llm, p, 1)
            out["ttft_ms"].append(ttft * 1e3)
            out["hit"].append(c.kvstore_hit_tokens)
            out["replayed"].append(c.kvstore_replayed_tokens)
            if transfer is not None:  # the next question finds this one's windows (at_hits)
                flush_saves(llm)
    if transfer is not None:
        ns = worker_namespaces(llm)[0]
        out["block_bytes"] = ns.block_bytes  # every layer of one block (the model's namespace)
        out["block_tokens"] = ns.block_tokens
    Path(spec["out"]).write_text(json.dumps(out))


def _engine(name: str, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    path = tmp / f"{name}.json"
    spec = {**spec, "out": str(tmp / f"{name}.out.json")}
    path.write_text(json.dumps(spec))
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": str(sorted(os.sched_getaffinity(0))[0]),
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tools.bench.vllm_families", str(path)], env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm families bench {name!r} failed:\n{proc.stderr[-4000:]}")
    print(f"vllm families bench: {name} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return json.loads(Path(spec["out"]).read_text())


def run(quick: bool, tmp: Path) -> Iterator[dict[str, Any]]:
    from engine.vllm.harness import small_daemon
    from kvstore.client import connect

    models = _models(tmp / "models")
    only = [n for n in os.environ.get("KVSTORE_BENCH_FAMILIES", "").split(",") if n]
    stored: dict[str, int] = {}  # bytes the daemon held after each row's store phase
    for family, f in FAMILIES.items():
        if only and family not in only:
            continue
        w = _workload(quick, f.doc)
        base = {"model": str(models[f.model]), "engine": f.engine, "connector": f.connector, "workload": w}
        # vLLM alone: a full prefill each time (its prefix cache off, so no retention interval)
        solo = {k: v for k, v in f.engine.items() if k != "prefix_cache_retention_interval"}
        alone = _engine(f"{family}-alone", {**base, "engine": {**solo, "prefix_caching": False}, "url": None,
                                            "phase": "ask"}, tmp)
        with small_daemon(tmp / f"daemon-{family}", dram="1GiB") as d:
            _engine(f"{family}-store", {**base, "url": d.url, "phase": "store"}, tmp)
            with connect(d.url, plane="tcp", timeout=60) as c:
                used = stored[family] = int(c.stats()["usage"]["used_bytes"])
            kv = _engine(f"{family}-kvstore", {**base, "url": d.url, "phase": "ask"}, tmp)
        bt = kv["block_tokens"]
        cached = sum(len(p) // bt for p in w["store"])  # full blocks the first process stored
        replayed = [r for h, r in zip(kv["hit"], kv["replayed"], strict=True) if h]
        t_alone, t_kv = statistics.median(alone["ttft_ms"]), statistics.median(kv["ttft_ms"])
        yield result(
            "vllm", f"family {family}: TTFT p50", t_kv, "ms", t_alone, family=family, requests=len(w["ask"]),
            hit_tokens=sum(kv["hit"]), prompt_tokens=sum(len(p) for p in w["ask"]),
            bytes_per_cached_token=round(used / (cached * bt), 1),
            every_layer_bytes_per_token=kv["block_bytes"] // bt,
            bytes_vs_every_layer=round(used / (cached * kv["block_bytes"]), 3),
            bytes_vs_every_layer_measured=(round(used / stored[f.baseline], 3) if f.baseline in stored else None),
            replayed_tokens_per_hit=round(statistics.mean(replayed), 1) if replayed else None,
            replayed_tokens_max=max(replayed, default=0),
            replay_bound_tokens=(f.c - 1) * bt if f.c else 0, checkpoint_every_blocks=f.c or None,
            hybrid_kv_cache_manager=not f.engine.get("disable_hybrid_kv_cache_manager", False),
            doc_tokens=len(w["store"][0]) - QUESTION, question_tokens=QUESTION, block_tokens=bt,
        )


if __name__ == "__main__":
    child(sys.argv[1])
