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
import threading
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


def rows(res: dict[str, dict[str, list[float]]], shape: dict[str, Any], counters: Any = None,
         lookups: dict[str, int] | None = None, hooks: dict[str, dict[str, float]] | None = None) -> Iterator[dict[str, Any]]:
    """Per phase and unit: kvstore's median against vLLM alone's, and the median of the paired
    per-request ratios (the figure the goal reads); ``lookups``: the daemon's lookups per phase;
    ``hooks``: per phase, ms per request inside each connector method vLLM called."""
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
                         connector_ms=_hooks_row((hooks or {}).get(phase)),
                         workload="overhead", lockstep=True, **shape)
    yield result("vllm", "overhead_flush_cpu_kvstore", kv["flush_cpu_ms"][0], "ms", ref["flush_cpu_ms"][0],
                 note="CPU of waiting for the background saves after the miss phase (in no request's time)",
                 counters=counters, workload="overhead", lockstep=True, **shape)


def _hooks_row(per: dict[str, float] | None) -> dict[str, Any] | None:
    """The connector's ms per request: in all, and each method that took any."""
    if per is None:
        return None
    top = {k: round(v, 4) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 0.0005}
    return {"total": round(sum(per.values()), 4), **top}


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
                env = {**env_for(spec), "BENCH_OVERHEAD_AUTHKEY": key.hex()}
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

            hooks: dict[str, dict[str, float]] = {}

            def after(phase: str) -> None:  # the daemon's lookups and the hooks' time, per phase (untimed)
                with connect(daemon[0], retries=0) as c:
                    seen[phase] = int(c.stats()["store"]["lookups"])
                conns["kvstore"].send(("hooks", None))
                hooks[phase] = conns["kvstore"].recv()

            res = lockstep(ask, flush, len(prompts), after)
            lookups = {"miss": seen["miss"] - seen["start"], "hit": seen["hit"] - seen["miss"]}
            n = len(prompts)
            in_hooks = {ph: {k: (hooks[ph][k] - hooks[prev][k]) / n * 1e3 for k in hooks[ph]}
                        for ph, prev in (("miss", "start"), ("hit", "miss"))}
            conns["kvstore"].send(("counters", None))
            counters = conns["kvstore"].recv()
            shape = {"prompts": len(prompts), "prompt_tokens": len(prompts[0]), "threads": base["threads"]}
            yield from rows(res, shape, counters, lookups, in_hooks)
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


HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
         "request_finished", "request_finished_all_groups", "handle_preemptions", "bind_connector_metadata",
         "clear_connector_metadata",
         "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
         "get_transfer_results", "get_block_ids_with_load_errors")
"""The connector's methods vLLM calls on its own threads (scheduler and worker) as it serves."""


def time_hooks(cls: Any) -> dict[str, float]:
    """Wrap ``cls``'s :data:`HOOKS` so that each adds its seconds (the outermost call only, on
    the thread vLLM calls it on) to the returned dict, by name: the connector's time inside
    vLLM's step, measured directly rather than as the difference of two noisy runs."""
    spent: dict[str, float] = dict.fromkeys(HOOKS, 0.0)
    local = threading.local()  # each thread's depth of hook calls: a hook on another thread is its own outermost

    def wrap(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            if getattr(local, "depth", 0):
                return f(*a, **k)
            local.depth = 1
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
                local.depth = 0

        return timed

    for name in HOOKS:
        f = getattr(cls, name, None)
        if f is not None:
            setattr(cls, name, wrap(name, f))
    return spent


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
    spent: dict[str, float] = {}
    if kvstore:  # one process (vLLM's engine core in process at TP=1): both sides' hooks
        from engine.vllm.connector import KVStoreConnector

        spent = time_hooks(KVStoreConnector)
    llm = make_llm(spec["model"], kv_transfer_config=kvstore_transfer(spec["url"]) if kvstore else None,
                   prefix_caching=True, num_gpu_blocks_override=spec["kv_blocks"],
                   max_model_len=min(4096, (spec["kv_blocks"] - 2) * 32), distributed_executor_backend="uni")
    cpu = _Cpu(spec.get("daemon_pid"))
    generate(llm, [[5 + i % 1000 for i in range(64)]], max_tokens=1)  # warm-up (kernels, first-call costs)
    conn = Client(spec["address"], family="AF_UNIX", authkey=bytes.fromhex(os.environ["BENCH_OVERHEAD_AUTHKEY"]))
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
        elif op == "hooks":
            conn.send(dict(spent))
        else:
            break
    conn.close()


if __name__ == "__main__":
    _serve(sys.argv[1])
