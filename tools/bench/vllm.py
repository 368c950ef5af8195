"""vllm: vLLM's CPU build with kvstore vs vLLM alone vs vLLM's ExampleConnector, same run.

A long-document QA workload in the style of LMCache's ``long_doc_qa``: ``DOCS`` documents of
``DOC`` tokens are read once, then asked a new ``QUESTION``-token question each, one request at a
time (time to first token), then all at once (prefill throughput, tokens per second counting
hit tokens as processed). The question is 1/24 of the document, so a prefix hit on the whole
document is a 96% token hit rate. vLLM's own KV holds ``KV_BLOCKS`` pages (about two
documents), as a GPU's HBM holds a fraction of a long-document working set: vLLM alone, with
its prefix cache on, has evicted a document by the time it is asked about it.

Engines, each in its own process, on one random-weight Llama (``engine.vllm.tiny.BENCH``):
``vllm`` (prefix cache on, no connector: the baseline), ``kvstore`` (async loads),
``kvstore-layerwise``, ``example`` (vLLM's ExampleConnector, safetensors files: it keys whole
prompts, so a new question never hits), ``kvstore-down`` (the connector pointed at a daemon that
is not there: what a dead daemon costs). Figures: mean TTFT (ms, baseline: ``vllm``'s) and
prefill throughput (tokens/s), with each engine's token hit rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tools.bench._common import result

DOCS, DOC, QUESTION, KV_BLOCKS = 8, 1536, 64, 128
ENGINES = ("vllm", "kvstore", "kvstore-layerwise", "example", "kvstore-down")


def _workload(quick: bool) -> dict[str, Any]:
    docs, doc, question = (4, 768, 32) if quick else (DOCS, DOC, QUESTION)
    rng = np.random.default_rng(7)
    texts = [rng.integers(3, 2000, doc).tolist() for _ in range(docs)]
    ask = [[t + rng.integers(3, 2000, question).tolist() for t in texts] for _ in range(2)]
    return {"docs": texts, "ttft": ask[0], "batch": ask[1]}


def _child(spec_path: str) -> None:
    """One engine: read the documents, then the TTFT pass and the batch pass."""
    from engine.vllm.harness import example_transfer, generate, kvstore_transfer, make_llm

    spec = json.loads(Path(spec_path).read_text())
    engine, w = spec["engine"], spec["workload"]
    transfer = None
    if engine.startswith("kvstore"):
        mode = "layerwise" if engine == "kvstore-layerwise" else "async"
        transfer = kvstore_transfer(spec["url"], load_mode=mode)
    elif engine == "example":
        transfer = example_transfer(spec["example_dir"])
    llm = make_llm(spec["model"], kv_transfer_config=transfer, prefix_caching=True,
                   num_gpu_blocks_override=spec["kv_blocks"], max_model_len=(spec["kv_blocks"] - 2) * 32,
                   distributed_executor_backend="uni")
    generate(llm, [w["docs"][0][:64]], max_tokens=1)  # warm-up (kernels, first-call costs)
    for d in w["docs"]:
        generate(llm, [d], max_tokens=1)
    if transfer is not None and engine.startswith("kvstore"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        get_kv_transfer_group().flush()  # the documents' blocks are in the daemon
    ttft, hits, tokens = [], 0, 0
    for p in w["ttft"]:
        t0 = time.perf_counter()
        (c,) = generate(llm, [p], max_tokens=1)
        ttft.append(time.perf_counter() - t0)
        hits += c.cached_tokens
        tokens += len(p)
    t0 = time.perf_counter()
    outs = generate(llm, w["batch"], max_tokens=1)
    batch_s = time.perf_counter() - t0
    out = {"ttft_ms": [x * 1e3 for x in ttft], "ttft_hit_rate": hits / tokens, "batch_s": batch_s,
           "batch_tokens": sum(len(p) for p in w["batch"]),
           "batch_hit_rate": sum(o.cached_tokens for o in outs) / sum(len(p) for p in w["batch"])}
    Path(spec["out"]).write_text(json.dumps(out))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_engine(engine: str, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    path = tmp / f"{engine}.json"
    spec = {**spec, "engine": engine, "out": str(tmp / f"{engine}.out.json")}
    path.write_text(json.dumps(spec))
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-m", "tools.bench.vllm", "--child", str(path)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench engine {engine!r} failed:\n{proc.stderr[-4000:]}")
    return json.loads(Path(spec["out"]).read_text())


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm bench: vLLM is not installed in this Python (use .venv-vllm: make test-vllm "
              "creates it); skipped", file=sys.stderr)
        return
    from engine.vllm.harness import small_daemon
    from engine.vllm.tiny import BENCH, SMALL, save_tiny_llama

    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-vllm-"))
    try:
        model = save_tiny_llama(tmp / "model", SMALL if args.quick else BENCH)
        w = _workload(args.quick)
        base = {"model": str(model), "workload": w, "kv_blocks": 64 if args.quick else KV_BLOCKS,
                "example_dir": str(tmp / "example")}
        (tmp / "example").mkdir()
        res: dict[str, dict[str, Any]] = {}
        with small_daemon(tmp / "daemon", dram="1GiB") as d:
            for engine in ENGINES:
                url = f"http://127.0.0.1:{_free_port()}" if engine == "kvstore-down" else d.url
                if engine.startswith("kvstore") and engine != "kvstore-down":
                    with small_daemon(tmp / f"daemon-{engine}", dram="1GiB") as fresh:  # each starts cold
                        res[engine] = _run_engine(engine, {**base, "url": fresh.url}, tmp)
                else:
                    res[engine] = _run_engine(engine, {**base, "url": url}, tmp)
        ref = res["vllm"]
        ref_ttft = statistics.median(ref["ttft_ms"])
        ref_tput = ref["batch_tokens"] / ref["batch_s"]
        shape = {"docs": len(w["docs"]), "doc_tokens": len(w["docs"][0]), "question_tokens": len(w["ttft"][0]) - len(w["docs"][0])}
        for engine in ENGINES[1:]:
            r = res[engine]
            yield result("vllm", f"ttft_median_{engine}", statistics.median(r["ttft_ms"]), "ms", ref_ttft,
                         hit_rate=round(r["ttft_hit_rate"], 4), baseline_hit_rate=round(ref["ttft_hit_rate"], 4),
                         ttft_mean_ms=round(statistics.mean(r["ttft_ms"]), 2), **shape)
            yield result("vllm", f"prefill_tokens_per_s_{engine}", r["batch_tokens"] / r["batch_s"], "tok/s", ref_tput,
                         hit_rate=round(r["batch_hit_rate"], 4), baseline_hit_rate=round(ref["batch_hit_rate"], 4), **shape)
        yield from _breaker_cost(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _breaker_cost(tmp: Path) -> Iterator[dict[str, Any]]:
    """What one scheduler lookup costs with the daemon down (breaker open: the fallback at
    once) against a lookup the daemon answers, same run."""
    from engine.vllm.config import ConnectorConfig
    from engine.vllm.connector import make_link
    from engine.vllm.harness import small_daemon
    from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks

    ns = Namespace("bench/vllm-breaker", KVLayout("bfloat16", 32, (LayerGroup("full", 6, 2, 128),)))
    hashes = hash_blocks(ns, list(range(DOC + QUESTION)))
    n = 2000
    with small_daemon(tmp / "daemon-breaker", dram="64MiB") as d:
        up = make_link(ConnectorConfig(url=d.url), "bench-up", 0.5, [ns])
        t0 = time.perf_counter()
        for _ in range(n // 10):
            up.call(lambda c: c.lookup(ns, hashes).num_blocks, 0)
        answered = (time.perf_counter() - t0) / (n // 10)
        up.close()
    down = make_link(ConnectorConfig(url=f"http://127.0.0.1:{_free_port()}"), "bench-down", 0.5, [ns])
    t0 = time.perf_counter()
    for _ in range(n):
        down.call(lambda c: c.lookup(ns, hashes).num_blocks, 0)
    open_s = (time.perf_counter() - t0) / n
    down.close()
    yield result("vllm", "lookup_us_daemon_down", open_s * 1e6, "us", answered * 1e6,
                 note="baseline: a lookup the daemon answers", blocks=len(hashes))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
    else:
        print("usage: python -m tools.bench vllm [--json] [--quick]", file=sys.stderr)
        sys.exit(2)
