"""vllm: vLLM's CPU build with kvstore vs vLLM alone vs vLLM's ExampleConnector, same run.

Two workloads, both in each engine's process (vLLM's prefix cache is reset between them):

``long-doc-qa``, in the style of LMCache's ``long_doc_qa``: ``DOCS`` documents of ``DOC`` tokens
are read once, then asked a new ``QUESTION``-token question each, one request at a time (time to
first token), then all at once (prefill throughput, tokens per second counting hit tokens as
processed). The question is 1/24 of the document, so a prefix hit on the whole document is a 96%
token hit rate. vLLM's own KV holds ``KV_BLOCKS`` pages (about two documents), as a GPU's HBM
holds a fraction of a long-document working set: vLLM alone, with its prefix cache on, has
evicted a document by the time it is asked about it.

``multi-round-qa``, the smallest honest version of LMCache's ``multi-round-qa``: ``USERS``
users share a ``SYSTEM``-token system prompt and each has a ``HISTORY``-token history; in each of
``ROUNDS`` rounds every user in turn asks a ``QUESTION``-token question and the engine answers
``ANSWER`` tokens (greedy), which join that user's history. The users' contexts together are
larger than vLLM's KV, so by a user's next turn vLLM alone has evicted its history (the shared
system prompt stays hot). TTFT is vLLM's own per-request figure (``first_token_latency``).

``--workload qps``: the same multi-round QA as LMCache runs it, concurrent, at a fixed request
rate: ``QPS_USERS`` users, each with its own history, join ``1/QPS`` s apart; a user asks its next
question ``QPS_USERS/QPS`` s after its previous one was sent, or as soon as its answer is in if that
took longer (LMCache's ``multi-round-qa.py`` schedule), so at the default ``QPS`` several requests
are in flight at once in vLLM's scheduler (the engine is stepped by hand, ``LLMEngine.step``,
requests added between steps when they are due). TTFT is counted from the request's scheduled
arrival (a request due while a step runs waits for it, as it would in a server), p50 and p90;
with the token hit rate, the CPU per request, and how many requests were in flight. Engines:
``vllm``, ``kvstore`` (async loads), ``kvstore-layerwise``, ``example``.

``--tp 2``: the long-document QA at tensor parallelism 2 (two worker processes over gloo, bound
one core each with ``VLLM_CPU_OMP_THREADS_BIND``), vLLM alone vs kvstore (async, layer-wise):
TTFT and prefill tokens/s counting hits; CPU time adds every process of the engine.

Engines, each in its own process, on one random-weight Llama (``engine.vllm.tiny.BENCH``):
``vllm`` (prefix cache on, no connector: the baseline), ``kvstore`` (async loads),
``kvstore-layerwise``, ``example`` (vLLM's ExampleConnector, safetensors files: it keys whole
prompts, so a new question never hits), ``kvstore-down`` (the connector pointed at a daemon that
is not there: what a dead daemon costs, and the same computation as the baseline).

Fairness on a shared CPU box: every engine runs with the same number of compute threads
(``THREADS``, default 1: on a box whose load exceeds its cores, two OpenMP threads spend their
time waiting for each other at every barrier), a throw-away engine process runs first (the
first vLLM process after the model is written paid for cold caches), and each request's CPU time
(the engine's process plus, for kvstore, the daemon's) is reported beside its wall time: CPU time
is what the request cost, wall time is also what the other jobs on the box cost it.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tools.bench._common import result

DOCS, DOC, QUESTION, KV_BLOCKS = 8, 1536, 64, 128
USERS, ROUNDS, SYSTEM, HISTORY, ANSWER = 6, 3, 512, 512, 32
ENGINES = ("vllm", "kvstore", "kvstore-layerwise", "example", "kvstore-down")
THREADS_ENV = "KVSTORE_BENCH_VLLM_THREADS"
# --workload qps: 8 users x 3 rounds of contexts 1,088-1,280 tokens (about 320 pages against
# vLLM's 128: vLLM alone has evicted a user's history by its next turn). At 0.5 requests/s the
# offered work (~1.3 CPU-s per request for vLLM alone on one thread) keeps one core 65% busy when
# the box is quiet, so requests overlap (queues form on a loaded box) without the run becoming
# a backlog measurement; a run is ~50 s of arrivals per engine.
QPS, QPS_USERS, QPS_ROUNDS = 0.5, 8, 3
QPS_ENGINES = ("vllm", "kvstore", "kvstore-layerwise", "example")
TP_ENGINES = ("vllm", "kvstore", "kvstore-layerwise")
WORKLOADS = ("standard", "qps", "overhead", "families")
# --workload overhead: what the connector costs a request when it has nothing to load, both
# engines in lockstep (tools/bench/vllm_overhead.py).


def _threads() -> int:
    raw = os.environ.get(THREADS_ENV, "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise SystemExit(f"{THREADS_ENV} must be a whole number of threads >= 1, got {raw!r}")
    return n


def _usage(message: str) -> SystemExit:
    print(f"vllm bench: {message}", file=sys.stderr)
    return SystemExit(2)  # the bench CLI's code for bad arguments


def _options(args: argparse.Namespace) -> tuple[str, int, float]:
    """``--workload``, ``--tp`` and ``--qps``, checked (a bad value exits with what to pass)."""
    workload = getattr(args, "workload", None) or "standard"
    tp = int(getattr(args, "tp", 1) or 1)
    qps = float(getattr(args, "qps", 0.0) or QPS)
    if workload not in WORKLOADS:
        raise _usage(f"--workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    if tp not in (1, 2):
        raise _usage(f"--tp must be 1 or 2 (the box's cores bind one rank each), got {tp}")
    if tp > 1 and workload != "standard":
        raise _usage("--tp 2 runs the long-document QA only; drop --workload")
    if tp > len(os.sched_getaffinity(0)):
        raise _usage(f"--tp {tp} binds one core per rank; this process may use {len(os.sched_getaffinity(0))}")
    if not qps > 0:
        raise _usage(f"--qps must be a request rate > 0, got {qps}")
    return workload, tp, qps


def _workload(quick: bool) -> dict[str, Any]:
    docs, doc, question = (4, 768, 32) if quick else (DOCS, DOC, QUESTION)
    rng = np.random.default_rng(7)
    texts = [rng.integers(3, 2000, doc).tolist() for _ in range(docs)]
    ask = [[t + rng.integers(3, 2000, question).tolist() for t in texts] for _ in range(2)]
    users, rounds, system, history, answer = (6, 3, 256, 256, 16) if quick else (USERS, ROUNDS, SYSTEM, HISTORY, ANSWER)
    mrq = {"system": rng.integers(3, 2000, system).tolist(),
           "history": [rng.integers(3, 2000, history).tolist() for _ in range(users)],
           "questions": [[rng.integers(3, 2000, question).tolist() for _ in range(users)] for _ in range(rounds)],
           "answer": answer}
    return {"docs": texts, "ttft": ask[0], "batch": ask[1], "mrq": mrq}


def _qps_workload(quick: bool) -> dict[str, Any]:
    users, rounds, system, history, question, answer = (
        (4, 2, 256, 256, 32, 16) if quick else (QPS_USERS, QPS_ROUNDS, SYSTEM, HISTORY, QUESTION, ANSWER))
    rng = np.random.default_rng(11)
    return {"system": rng.integers(3, 2000, system).tolist(),
            "history": [rng.integers(3, 2000, history).tolist() for _ in range(users)],
            "questions": [[rng.integers(3, 2000, question).tolist() for _ in range(users)] for _ in range(rounds)],
            "answer": answer}


class _Cpu:
    """CPU seconds of this process (all threads), of its child processes when the engine runs
    in several (tensor parallelism), plus the daemon's, if there is one."""

    def __init__(self, daemon_pid: int | None, children: bool = False) -> None:
        import psutil

        self._daemon = psutil.Process(daemon_pid) if daemon_pid else None
        self._me = psutil.Process() if children else None

    def __call__(self) -> float:
        import psutil

        t = time.process_time()
        others = [self._daemon] if self._daemon is not None else []
        if self._me is not None:
            others += self._me.children(recursive=True)
        for p in others:
            try:
                c = p.cpu_times()
            except psutil.NoSuchProcess:  # a helper process that has ended: its time is gone
                continue
            t += c.user + c.system
        return t


def _child(spec_path: str) -> None:
    """One engine: the long-document QA (documents, TTFT pass, batch pass), then multi-round QA
    (``standard``, at TP=1); or the fixed-rate multi-round QA (``qps``)."""
    from engine.vllm.harness import example_transfer, generate, kvstore_transfer, make_llm

    spec = json.loads(Path(spec_path).read_text())
    engine, kind, tp = spec["engine"], spec["kind"], spec["tp"]
    transfer = None
    if engine.startswith("kvstore"):
        mode = "layerwise" if engine == "kvstore-layerwise" else "async"
        transfer = kvstore_transfer(spec["url"], load_mode=mode)
    elif engine == "example":
        transfer = example_transfer(spec["example_dir"])
    llm = make_llm(spec["model"], kv_transfer_config=transfer, prefix_caching=True,
                   num_gpu_blocks_override=spec["kv_blocks"], max_model_len=min(4096, (spec["kv_blocks"] - 2) * 32),
                   distributed_executor_backend="mp" if tp > 1 else "uni", tensor_parallel_size=tp,
                   disable_log_stats=False)
    cpu = _Cpu(spec.get("daemon_pid"), children=tp > 1)
    generate(llm, [[5 + i % 1000 for i in range(64)]], max_tokens=1)  # warm-up (kernels, first-call costs)
    if engine == "warmup":
        Path(spec["out"]).write_text("{}")
        return
    if kind == "qps":
        out = _qps(llm, spec["workload"], spec["qps"], cpu)
    else:
        out = _long_doc(llm, spec["workload"], cpu, kvstore=engine.startswith("kvstore"))
        if tp == 1:
            llm.reset_prefix_cache()
            out.update(_multi_round(llm, spec["workload"]["mrq"], cpu))
    Path(spec["out"]).write_text(json.dumps(out))


def _long_doc(llm: Any, w: dict[str, Any], cpu: _Cpu, kvstore: bool) -> dict[str, Any]:
    """Read every document, then a question on each, one at a time (TTFT), then all at once."""
    import torch

    from engine.vllm.harness import flush_saves, generate

    for d in w["docs"]:
        generate(llm, [d], max_tokens=1)
    if kvstore:
        flush_saves(llm)  # the documents' blocks are in the daemon
    ttft, ttft_cpu, hits, tokens = [], [], 0, 0
    for p in w["ttft"]:
        c0, t0 = cpu(), time.perf_counter()
        (c,) = generate(llm, [p], max_tokens=1)
        ttft.append(time.perf_counter() - t0)
        ttft_cpu.append(cpu() - c0)
        hits += c.cached_tokens
        tokens += len(p)
    c0, t0 = cpu(), time.perf_counter()
    outs = generate(llm, w["batch"], max_tokens=1)
    batch_s, batch_cpu = time.perf_counter() - t0, cpu() - c0
    return {"ttft_ms": [x * 1e3 for x in ttft], "ttft_cpu_ms": [x * 1e3 for x in ttft_cpu],
            "ttft_hit_rate": hits / tokens, "batch_s": batch_s, "batch_cpu_s": batch_cpu,
            "batch_tokens": sum(len(p) for p in w["batch"]),
            "batch_hit_rate": sum(o.cached_tokens for o in outs) / sum(len(p) for p in w["batch"]),
            "threads": torch.get_num_threads()}


def _multi_round(llm: Any, mrq: dict[str, Any], cpu: _Cpu) -> dict[str, Any]:
    """Every user in turn, round after round; one request at a time."""
    from engine.vllm.harness import flush_saves, generate_timed

    contexts = [mrq["system"] + h for h in mrq["history"]]
    ttft, req_cpu, hits, tokens = [], [], 0, 0
    for questions in mrq["questions"]:
        for u, q in enumerate(questions):
            prompt = contexts[u] + q
            c0 = cpu()
            c, first_token_s = generate_timed(llm, prompt, mrq["answer"])
            # The user reads the answer before the next turn: the saves land meanwhile (their
            # CPU is this request's; a no-op without kvstore).
            flush_saves(llm)
            req_cpu.append(cpu() - c0)
            ttft.append(first_token_s)
            hits += c.cached_tokens
            tokens += len(prompt)
            contexts[u] = prompt + list(c.tokens)
    return {"mrq_ttft_ms": [x * 1e3 for x in ttft], "mrq_cpu_ms": [x * 1e3 for x in req_cpu],
            "mrq_hit_rate": hits / tokens, "mrq_tokens": tokens, "mrq_requests": len(ttft)}


def _vllm_request(prompt: list[int], max_tokens: int) -> tuple[Any, Any]:
    """A greedy token-id request for ``LLM.enqueue``: its prompt and sampling parameters."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True)


def _qps(llm: Any, mrq: dict[str, Any], qps: float, cpu: Callable[[], float],
         clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
         request: Callable[[list[int], int], tuple[Any, Any]] = _vllm_request) -> dict[str, Any]:
    """Multi-round QA at ``qps`` requests/s, several in flight: LMCache's schedule (user u joins
    at ``u/qps``; its next question is due ``users/qps`` after its last was due, or when that
    answer is in if later), vLLM's engine stepped here and each request added when due.

    ``clock``, ``sleep`` and ``request`` are the tests' way in (a fake clock, no vLLM)."""
    engine = llm.llm_engine
    users, rounds = len(mrq["history"]), len(mrq["questions"])
    gap = users / qps
    contexts = [mrq["system"] + h for h in mrq["history"]]
    done_rounds = [0] * users
    due: list[float | None] = [u / qps for u in range(users)]  # seconds from the start; None: in flight
    sent: dict[str, tuple[int, float, float, list[int]]] = {}  # request id: user, due, late, prompt
    ttft: list[float] = []
    arrivals: list[float] = []
    in_flight: list[int] = []
    hits = tokens = 0
    c0, t0 = cpu(), clock()
    while len(ttft) < users * rounds:
        now = clock() - t0
        for u in range(users):
            at = due[u]
            if at is None or at > now:
                continue
            prompt = contexts[u] + mrq["questions"][done_rounds[u]][u]
            tokens_prompt, params = request(prompt, mrq["answer"])
            (rid,) = llm.enqueue([tokens_prompt], params, use_tqdm=False)
            # vLLM counts its TTFT from here; a request due while a step ran waited for it.
            # Outputs carry the caller's id, enqueue returns vLLM's ("<caller's>-<8 random>").
            sent[rid.rsplit("-", 1)[0]] = (u, at, clock() - t0 - at, prompt)
            arrivals.append(at)
            due[u] = None
        if not engine.has_unfinished_requests():
            waiting = [d for d in due if d is not None]
            if not waiting:
                raise RuntimeError(f"vllm bench: nothing in flight and nothing due after {len(ttft)} of "
                                   f"{users * rounds} requests (a request vLLM never finished)")
            sleep(max(0.0, min(waiting) - (clock() - t0)))  # idle until the next arrival
            continue
        in_flight.append(engine.get_num_unfinished_requests())  # the requests this step serves
        outs = engine.step()
        for out in outs:
            if not out.finished:
                continue
            u, at, late, prompt = sent.pop(out.request_id)
            metrics = out.metrics
            if metrics is None or not metrics.first_token_latency:
                raise RuntimeError("vllm bench: no first-token latency in vLLM's request stats "
                                   "(the engine needs disable_log_stats=False)")
            ttft.append(late + float(metrics.first_token_latency))
            hits += int(out.num_cached_tokens or 0)
            tokens += len(prompt)
            contexts[u] = prompt + list(out.outputs[0].token_ids)
            done_rounds[u] += 1
            if done_rounds[u] < rounds:
                due[u] = max(at + gap, clock() - t0)
    wall, spent = clock() - t0, cpu() - c0
    return {"ttft_ms": [x * 1e3 for x in ttft], "hit_rate": hits / tokens, "tokens": tokens,
            "requests": len(ttft), "cpu_ms_per_request": spent / len(ttft) * 1e3, "wall_s": wall,
            "arrivals_s": arrivals, "in_flight_mean": statistics.mean(in_flight),
            "in_flight_max": max(in_flight)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine_env(spec: dict[str, Any]) -> dict[str, str]:
    """The environment of an engine's process: in-process engine core at TP=1, the thread count."""
    root = str(Path(__file__).resolve().parents[2])
    tp = spec["tp"]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if tp > 1 else "0",
           "OMP_NUM_THREADS": str(spec["threads"]),
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    if tp > 1:  # one core per rank (vLLM's CPU build binds a NUMA node per rank otherwise)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:tp])
    return env


def _run_engine(engine: str, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    path = tmp / f"{engine}.json"
    spec = {**spec, "engine": engine, "out": str(tmp / f"{engine}.out.json")}
    path.write_text(json.dumps(spec))
    env = _engine_env(spec)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tools.bench.vllm", "--child", str(path)], env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench engine {engine!r} failed:\n{proc.stderr[-4000:]}")
    print(f"vllm bench: {engine} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return json.loads(Path(spec["out"]).read_text())


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    workload, tp, qps = _options(args)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm bench: vLLM is not installed in this Python (use .venv-vllm: make test-vllm "
              "creates it); skipped", file=sys.stderr)
        return
    from engine.vllm.harness import small_daemon
    from engine.vllm.tiny import BENCH, SMALL, save_tiny_llama
    from tools.bench import vllm_overhead

    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-vllm-"))
    try:
        if workload == "families":  # one row per model family: tools/bench/vllm_families.py
            from tools.bench import vllm_families

            yield from vllm_families.run(args.quick, tmp)
            return
        model = save_tiny_llama(tmp / "model", SMALL if args.quick else BENCH)
        engines: tuple[str, ...]
        if workload == "qps":
            w, engines = _qps_workload(args.quick), QPS_ENGINES
        elif workload == "overhead":
            w, engines = vllm_overhead.workload(args.quick), vllm_overhead.ENGINES  # (in lockstep below)
        else:
            w, engines = _workload(args.quick), ENGINES if tp == 1 else TP_ENGINES
        blocks = vllm_overhead.BLOCKS if workload == "overhead" else KV_BLOCKS
        base: dict[str, Any] = {"model": str(model), "workload": w, "kv_blocks": 64 if args.quick and workload != "overhead" else blocks,
                "example_dir": str(tmp / "example"), "threads": _threads(), "kind": workload, "tp": tp,
                "qps": qps}
        (tmp / "example").mkdir()
        _run_engine("warmup", {**base, "url": ""}, tmp)  # pays the first process's cold caches
        if workload == "overhead":  # both engines at once, in lockstep
            with small_daemon(tmp / "daemon-kvstore", dram="1GiB") as fresh:
                yield from vllm_overhead.run(base, tmp, (fresh.url, fresh.pid), _engine_env)
            return
        res: dict[str, dict[str, Any]] = {}
        for engine in engines:
            if engine.startswith("kvstore") and engine != "kvstore-down":
                with small_daemon(tmp / f"daemon-{engine}", dram="1GiB") as fresh:  # each starts cold
                    res[engine] = _run_engine(engine, {**base, "url": fresh.url, "daemon_pid": fresh.pid}, tmp)
            else:  # kvstore-down: a port nobody listens on
                res[engine] = _run_engine(engine, {**base, "url": f"http://127.0.0.1:{_free_port()}"}, tmp)
        if workload == "qps":
            yield from _qps_rows(res, w, base["threads"], qps)
        elif tp > 1:
            yield from _tp_rows(res, w, base["threads"], tp)
        else:
            yield from _rows(res, w, base["threads"])
            yield from _breaker_cost(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _long_doc_shape(w: dict[str, Any], threads: int) -> dict[str, Any]:
    return {"docs": len(w["docs"]), "doc_tokens": len(w["docs"][0]),
            "question_tokens": len(w["ttft"][0]) - len(w["docs"][0]), "threads": threads}


def _rows(res: dict[str, dict[str, Any]], w: dict[str, Any], threads: int) -> Iterator[dict[str, Any]]:
    ref = res["vllm"]
    med = statistics.median
    shape = _long_doc_shape(w, threads)
    mrq = w["mrq"]
    mrq_shape = {"users": len(mrq["history"]), "rounds": len(mrq["questions"]), "system_tokens": len(mrq["system"]),
                 "history_tokens": len(mrq["history"][0]), "answer_tokens": mrq["answer"], "threads": threads}
    for engine in ENGINES:
        r = res[engine]
        if engine != "vllm":
            yield result("vllm", f"ttft_median_{engine}", med(r["ttft_ms"]), "ms", med(ref["ttft_ms"]),
                         hit_rate=round(r["ttft_hit_rate"], 4), baseline_hit_rate=round(ref["ttft_hit_rate"], 4),
                         ttft_mean_ms=round(statistics.mean(r["ttft_ms"]), 2), **shape)
        yield result("vllm", f"ttft_cpu_ms_median_{engine}", med(r["ttft_cpu_ms"]), "ms", med(ref["ttft_cpu_ms"]),
                     note="CPU time per TTFT request: the engine's process (+ the daemon's)",
                     engine_threads=r["threads"], **shape)
        if engine != "vllm":
            yield result("vllm", f"prefill_tokens_per_s_{engine}", r["batch_tokens"] / r["batch_s"], "tok/s",
                         ref["batch_tokens"] / ref["batch_s"], hit_rate=round(r["batch_hit_rate"], 4),
                         baseline_hit_rate=round(ref["batch_hit_rate"], 4), **shape)
            yield result("vllm", f"prefill_tokens_per_cpu_s_{engine}", r["batch_tokens"] / r["batch_cpu_s"], "tok/s",
                         ref["batch_tokens"] / ref["batch_cpu_s"], note="batch pass, per CPU second", **shape)
            yield result("vllm", f"mrq_ttft_median_{engine}", med(r["mrq_ttft_ms"]), "ms", med(ref["mrq_ttft_ms"]),
                         hit_rate=round(r["mrq_hit_rate"], 4), baseline_hit_rate=round(ref["mrq_hit_rate"], 4),
                         ttft_mean_ms=round(statistics.mean(r["mrq_ttft_ms"]), 2), workload="multi-round-qa",
                         **mrq_shape)
        yield result("vllm", f"mrq_cpu_ms_per_request_{engine}", statistics.mean(r["mrq_cpu_ms"]), "ms",
                     statistics.mean(ref["mrq_cpu_ms"]), note="prefill + answer, engine (+ daemon) CPU",
                     hit_rate=round(r["mrq_hit_rate"], 4), workload="multi-round-qa", **mrq_shape)


def _tp_rows(res: dict[str, dict[str, Any]], w: dict[str, Any], threads: int, tp: int) -> Iterator[dict[str, Any]]:
    """Long-document QA at TP=``tp``: each engine against vLLM alone at the same TP, same run."""
    ref = res["vllm"]
    med = statistics.median
    shape = {**_long_doc_shape(w, threads), "tp": tp, "workload": "long-doc-qa"}
    for engine in TP_ENGINES:
        r = res[engine]
        yield result("vllm", f"tp{tp}_ttft_cpu_ms_median_{engine}", med(r["ttft_cpu_ms"]), "ms",
                     med(ref["ttft_cpu_ms"]), note="CPU per TTFT request: every engine process (+ the daemon)",
                     **shape)
        if engine == "vllm":
            continue
        yield result("vllm", f"tp{tp}_ttft_median_{engine}", med(r["ttft_ms"]), "ms", med(ref["ttft_ms"]),
                     hit_rate=round(r["ttft_hit_rate"], 4), baseline_hit_rate=round(ref["ttft_hit_rate"], 4),
                     ttft_mean_ms=round(statistics.mean(r["ttft_ms"]), 2), **shape)
        yield result("vllm", f"tp{tp}_prefill_tokens_per_s_{engine}", r["batch_tokens"] / r["batch_s"], "tok/s",
                     ref["batch_tokens"] / ref["batch_s"], hit_rate=round(r["batch_hit_rate"], 4),
                     baseline_hit_rate=round(ref["batch_hit_rate"], 4), note="tokens counting hits", **shape)
        yield result("vllm", f"tp{tp}_prefill_tokens_per_cpu_s_{engine}", r["batch_tokens"] / r["batch_cpu_s"],
                     "tok/s", ref["batch_tokens"] / ref["batch_cpu_s"], note="batch pass, per CPU second", **shape)


def _qps_rows(res: dict[str, dict[str, Any]], w: dict[str, Any], threads: int, qps: float) -> Iterator[dict[str, Any]]:
    """Fixed-rate multi-round QA: TTFT p50/p90, hit rate and CPU per request against vLLM alone."""
    ref = res["vllm"]
    shape = {"workload": "multi-round-qa-qps", "qps": qps, "users": len(w["history"]),
             "rounds": len(w["questions"]), "system_tokens": len(w["system"]),
             "history_tokens": len(w["history"][0]), "question_tokens": len(w["questions"][0][0]),
             "answer_tokens": w["answer"], "threads": threads}

    def pct(r: dict[str, Any], q: float) -> float:
        return float(np.percentile(r["ttft_ms"], q))

    for engine in QPS_ENGINES:
        r = res[engine]
        run_ = {"hit_rate": round(r["hit_rate"], 4), "baseline_hit_rate": round(ref["hit_rate"], 4),
                "in_flight_mean": round(r["in_flight_mean"], 2), "in_flight_max": r["in_flight_max"],
                "wall_s": round(r["wall_s"], 1), **shape}
        yield result("vllm", f"qps_ttft_p50_{engine}", pct(r, 50), "ms", pct(ref, 50), **run_)
        yield result("vllm", f"qps_ttft_p90_{engine}", pct(r, 90), "ms", pct(ref, 90), **run_)
        yield result("vllm", f"qps_cpu_ms_per_request_{engine}", r["cpu_ms_per_request"], "ms",
                     ref["cpu_ms_per_request"], note="prefill + answer, engine (+ daemon) CPU", **run_)


def _breaker_cost(tmp: Path) -> Iterator[dict[str, Any]]:
    """What one scheduler lookup costs with the daemon down (breaker open: the fallback at
    once) against a lookup the daemon answers, same run."""
    from engine.vllm.config import ConnectorConfig
    from engine.vllm.harness import small_daemon
    from engine.vllm.link import make_link
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
        print("usage: python -m tools.bench vllm [--json] [--quick] [--workload qps|overhead [--qps R]] [--tp 2]", file=sys.stderr)
        sys.exit(2)
