"""``tools.bench vllm --workload overhead``: what the connector costs a request when it has
nothing to load, measured in lockstep.

Two engines live at once, vLLM alone and vLLM with the connector (against a fresh daemon), each
in its own process; the controller sends them the same request one after the other, alternating
which goes first, so both see the same box at nearly the same moment and a drift of the machine's
load (other work on a shared box) lands on both. Each prompt is asked once (nothing cached
anywhere: one lookup that misses, the prompt's blocks saved in the background), then each again
(every block in vLLM's own prefix cache: one lookup, nothing loaded, nothing saved). The figure is
the median of the per-request ratios (paired), beside the ratio of the medians.

What a request costs:

* wall: the request's own time, ``generate`` to its return;
* CPU: the engine process's (all threads) plus the daemon's, from the end of the engine's
  previous request to the end of this one, so work a request leaves in the background (the saves)
  is counted in it. The connector's saves are waited for after each of its requests, outside the
  wall timer (their CPU counted), so they do not run while the other engine is timed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import numpy as np

from tools.bench._common import result

PROMPTS, TOKENS, BLOCKS = 24, 512, 512
ENGINES = ("vllm", "kvstore")
PHASES = ("miss", "hit")
WHAT = {"miss": "nothing cached anywhere: one lookup that misses, the prompt's blocks saved in the background",
        "hit": "every block in vLLM's own prefix cache: one lookup, nothing loaded or saved"}


def workload(quick: bool) -> dict[str, Any]:
    n, tokens = (8, 256) if quick else (PROMPTS, TOKENS)
    rng = np.random.default_rng(13)
    return {"prompts": [rng.integers(3, 2000, tokens).tolist() for _ in range(n)]}


def order(i: int) -> tuple[str, ...]:
    """Which engine goes first for prompt ``i``: they take turns."""
    return ENGINES if i % 2 == 0 else ENGINES[::-1]


def lockstep(ask: Callable[[str, str, int], dict[str, float]], flush: Callable[[str], float],
             prompts: int, after: Callable[[str], None] = lambda phase: None) -> dict[str, dict[str, list[float]]]:
    """Drive both engines through both phases: ``ask(engine, phase, i)`` runs prompt ``i`` on
    one engine and returns its ``ms``, ``cpu_ms`` and ``cached`` tokens; ``flush(engine)`` waits
    for an engine's background saves and returns their CPU (after the miss phase: in no request)."""
    out: dict[str, dict[str, list[float]]] = {e: {} for e in ENGINES}
    after("start")
    for phase in PHASES:
        for e in ENGINES:
            for k in ("ms", "cpu_ms", "cached"):
                out[e][f"{phase}_{k}"] = []
        for i in range(prompts):
            for e in order(i):
                got = ask(e, phase, i)
                for k in ("ms", "cpu_ms", "cached"):
                    out[e][f"{phase}_{k}"].append(float(got[k]))
        if phase == "miss":
            for e in ENGINES:
                out[e]["flush_cpu_ms"] = [flush(e)]
        after(phase)
    return out


def rows(res: dict[str, dict[str, list[float]]], shape: dict[str, Any],
         counters: Any = None, lookups: dict[str, int] | None = None) -> Iterator[dict[str, Any]]:
    """Per phase and unit: kvstore's median against vLLM alone's, and the median of the paired
    per-request ratios (the figure the goal reads); ``lookups``: the daemon's lookups per phase."""
    kv, ref = res["kvstore"], res["vllm"]
    for phase in PHASES:
        for unit in ("ms", "cpu_ms"):
            a, b = kv[f"{phase}_{unit}"], ref[f"{phase}_{unit}"]
            paired = [x / y for x, y in zip(a, b, strict=True) if y > 0]
            q = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [float("nan")] * 3
            yield result("vllm", f"overhead_{phase}_{unit.replace('_ms', '')}_median_kvstore", statistics.median(a), "ms",
                         statistics.median(b), goal_ratio=1.02, paired_ratio=round(statistics.median(paired), 4),
                         paired_iqr=[round(q[0], 4), round(q[2], 4)], mean=round(statistics.mean(a), 3),
                         baseline_mean=round(statistics.mean(b), 3), cached_tokens=int(sum(kv[f"{phase}_cached"])),
                         baseline_cached_tokens=int(sum(ref[f"{phase}_cached"])), note=WHAT[phase],
                         daemon_lookups=(lookups or {}).get(phase),
                         workload="overhead", lockstep=True, **shape)
    yield result("vllm", "overhead_flush_cpu_kvstore", kv["flush_cpu_ms"][0], "ms", ref["flush_cpu_ms"][0],
                 note="CPU of waiting for the background saves after the miss phase (in no request's time)",
                 counters=counters, workload="overhead", lockstep=True, **shape)


def run(base: dict[str, Any], tmp: Path, daemon: Any, env_for: Callable[[dict[str, Any]], dict[str, str]]) -> Iterator[dict[str, Any]]:
    """Both engines as servers of the controller; ``daemon``: the kvstore engine's (url, pid)."""
    key = secrets.token_bytes(16)
    address = str(tmp / "overhead.sock")
    prompts: Sequence[Sequence[int]] = base["workload"]["prompts"]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    conns: dict[str, Connection] = {}
    with Listener(address, family="AF_UNIX", authkey=key) as ls:
        try:
            for e in ENGINES:
                url, pid = daemon if e == "kvstore" else ("", None)
                spec = {**base, "engine": e, "url": url, "daemon_pid": pid, "address": address}
                path = tmp / f"overhead-{e}.json"
                path.write_text(json.dumps(spec))
                env = {**env_for(spec), "KVSTORE_BENCH_KEY": key.hex()}
                procs[e] = subprocess.Popen([sys.executable, "-m", "tools.bench.vllm_overhead", str(path)], env=env,
                                            stdout=subprocess.DEVNULL, stderr=open(tmp / f"overhead-{e}.log", "wb"))  # noqa: SIM115 (the child owns it)
            for _ in ENGINES:
                c = ls.accept()
                conns[c.recv()] = c  # each engine names itself once it is built and warm
            print("vllm bench: both engines up; lockstep", file=sys.stderr, flush=True)

            def ask(e: str, phase: str, i: int) -> dict[str, float]:
                conns[e].send(("gen", list(prompts[i])))
                return dict(conns[e].recv())

            def flush(e: str) -> float:
                conns[e].send(("flush", None))
                return float(conns[e].recv())

            from kvstore.client import connect

            seen: dict[str, int] = {}

            def after(phase: str) -> None:  # the daemon's lookups in each phase (untimed)
                with connect(daemon[0], retries=0) as c:
                    seen[phase] = int(c.stats()["store"]["lookups"])

            res = lockstep(ask, flush, len(prompts), after)
            lookups = {"miss": seen["miss"] - seen["start"], "hit": seen["hit"] - seen["miss"]}
            conns["kvstore"].send(("counters", None))
            counters = conns["kvstore"].recv()
            shape = {"prompts": len(prompts), "prompt_tokens": len(prompts[0]), "threads": base["threads"]}
            yield from rows(res, shape, counters, lookups)
        except (EOFError, ConnectionError) as e:
            logs = {name: (tmp / f"overhead-{name}.log").read_bytes()[-3000:].decode(errors="replace") for name in ENGINES}
            raise RuntimeError(f"vllm bench: an overhead engine ended early ({e!r}); its log:\n{logs}") from e
        finally:
            for c in conns.values():
                with contextlib.suppress(BrokenPipeError, ConnectionError, OSError):
                    c.send(("quit", None))
                c.close()
            for p in procs.values():
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _serve(spec_path: str) -> None:
    """One engine, a server of the controller: build, warm up, then run what it is sent."""
    from engine.vllm.harness import (
        flush_saves,
        generate,
        kvstore_transfer,
        make_llm,
        worker_counters,
    )
    from tools.bench.vllm import _Cpu

    spec = json.loads(Path(spec_path).read_text())
    kvstore = spec["engine"] == "kvstore"
    llm = make_llm(spec["model"], kv_transfer_config=kvstore_transfer(spec["url"]) if kvstore else None,
                   prefix_caching=True, num_gpu_blocks_override=spec["kv_blocks"],
                   max_model_len=min(4096, (spec["kv_blocks"] - 2) * 32), distributed_executor_backend="uni")
    cpu = _Cpu(spec.get("daemon_pid"))
    generate(llm, [[5 + i % 1000 for i in range(64)]], max_tokens=1)  # warm-up (kernels, first-call costs)
    conn = Client(spec["address"], family="AF_UNIX", authkey=bytes.fromhex(os.environ["KVSTORE_BENCH_KEY"]))
    conn.send(spec["engine"])
    last = cpu()
    while True:
        op, arg = conn.recv()
        if op == "gen":
            t0 = time.perf_counter()
            (c,) = generate(llm, [arg], max_tokens=1)
            ms = (time.perf_counter() - t0) * 1e3
            if kvstore:
                flush_saves(llm)  # off the wall timer, on the CPU one: not while the other engine runs
            now = cpu()
            conn.send({"ms": ms, "cpu_ms": (now - last) * 1e3, "cached": c.cached_tokens})
            last = now
        elif op == "flush":
            c0 = cpu()
            if kvstore:
                flush_saves(llm)
            last = cpu()
            conn.send((last - c0) * 1e3)
        elif op == "counters":
            conn.send(worker_counters(llm) if kvstore else None)
        else:
            break
    conn.close()


if __name__ == "__main__":
    _serve(sys.argv[1])
