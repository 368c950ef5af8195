"""One vLLM process of the end-to-end tests: ``python -m tests.engine.vllm._scenario SPEC.json``.

SPEC names the model, the connector settings (or none; or ``example``: a folder for vLLM's own
ExampleConnector instead), the engine settings and the rounds to
run; the results (per round, per prompt: tokens, logprobs, cached and kvstore-hit tokens) go to
SPEC's ``out`` as JSON, and each round's connector counters per tensor-parallel rank beside it
(``out.counters.json``; read by ``conftest.counters``), and per round the lookups the daemon
answered and vLLM's preemptions (``out.stats.json``; ``conftest.round_stats``). Each round's
saves are awaited before the next (``flush_saves``), so a round's lookups see every block the
previous ones stored. A round may kill or restart the test's daemon first (``daemon`` in the
spec: its data dir and ports), so a run can lose its daemon mid-way and get it back, or drop
one tensor-parallel rank's copy of its prompts' blocks (``drop``: that rank; the scheduler,
which looks up rank 0's, still finds them: the rank's load fails).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from engine.vllm.harness import (
    BLOCK_SIZE,
    example_transfer,
    flush_saves,
    generate,
    kvstore_transfer,
    make_llm,
    preemptions,
    small_daemon,
    worker_counters,
    worker_namespaces,
)
from kvstore.client import connect
from kvstore.errors import KVStoreError
from kvstore.keys import hash_blocks


def _restart(spec: dict[str, Any]) -> Any:
    from kvstore.client.spawn import start_daemon

    d = spec["daemon"]
    return start_daemon(Path(d["root"]) / "store", Path(d["root"]) / "kvstore.toml",
                        args=["--http-port", str(d["http_port"]), "--data-port", str(d["data_port"])])


def _lookups(url: str | None) -> int | None:
    """Lookups the daemon has answered (None: no daemon, or it is down)."""
    if url is None:
        return None
    try:
        with connect(url, plane="tcp", timeout=60, retries=0) as c:
            return int(c.stats()["store"]["lookups"])
    except KVStoreError:
        return None


def _drop(llm: Any, url: str, rank: int, prompts: list[list[int]]) -> None:
    """Delete rank ``rank``'s copy of every full block of ``prompts`` from the daemon."""
    (ns,) = [ns for ns in worker_namespaces(llm) if ns.rank == rank]
    with connect(url, plane="tcp", timeout=60, retries=0) as c:
        c.register_namespace(ns)
        for p in prompts:
            tokens = np.asarray(p[: len(p) // BLOCK_SIZE * BLOCK_SIZE], dtype=np.int32)
            hashes = hash_blocks(ns, tokens)
            if c.delete(ns, hashes) != len(hashes):
                raise AssertionError(f"rank {rank} did not hold every block of a {len(p)}-token prompt")


def main(path: str) -> None:
    spec = json.loads(Path(path).read_text())
    daemon = None
    url = spec.get("url")
    if spec.get("daemon"):  # this process owns the daemon (the kill-and-restart scenario)
        daemon = small_daemon(spec["daemon"]["root"])
        url = daemon.url
        spec["daemon"]["http_port"] = daemon.info["http_port"]
        spec["daemon"]["data_port"] = daemon.info["data_port"]
    transfer = None if spec.get("connector") is None else kvstore_transfer(url, **spec["connector"])
    if spec.get("example"):
        transfer = example_transfer(spec["example"])
    t0 = time.perf_counter()
    llm = make_llm(spec["model"], kv_transfer_config=transfer, **spec.get("engine", {}))
    print(f"scenario: engine up in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    results = []
    counters: list[list[dict[str, int]]] = []  # per round, per TP rank (cumulative)
    stats: list[dict[str, int | None]] = []  # per round: daemon lookups, vLLM preemptions
    log_stats = spec.get("engine", {}).get("disable_log_stats") is False
    try:
        for rnd in spec["rounds"]:
            if rnd.get("drop") is not None:
                _drop(llm, url, rnd["drop"], rnd["prompts"])
            lookups0, preempted0 = _lookups(url), preemptions(llm) if log_stats else None
            action = rnd.get("daemon")
            killer = None
            if action == "kill":
                daemon.kill()
            elif action == "kill_during":  # SIGKILL while the requests of this step of the scenario run
                killer = threading.Timer(rnd.get("after_s", 0.3), daemon.kill)
                killer.start()
            elif action == "restart":
                daemon = _restart(spec)
            t0 = time.perf_counter()
            outs = generate(llm, rnd["prompts"], rnd.get("max_tokens", 8))
            print(f"scenario: round {len(results)} in {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
            if killer is not None:
                killer.join()
            if transfer is not None:
                flush_saves(llm)
            results.append([asdict(o) for o in outs])
            counters.append(worker_counters(llm))
            lookups1 = _lookups(url)
            stats.append({
                "lookups": None if lookups0 is None or lookups1 is None else lookups1 - lookups0,
                "preemptions": None if preempted0 is None else preemptions(llm) - preempted0,
            })
            if rnd.get("until_hit") and not any(o.kvstore_hit_tokens for o in outs):
                # The connector reconnects in the background: repeat (bounded) until it has.
                for _ in range(rnd["until_hit"]):
                    outs = generate(llm, rnd["prompts"], rnd.get("max_tokens", 8))
                    if transfer is not None:
                        flush_saves(llm)
                    results[-1] = [asdict(o) for o in outs]
                    counters[-1] = worker_counters(llm)
                    if any(o.kvstore_hit_tokens for o in outs):
                        break
    finally:
        Path(spec["out"]).write_text(json.dumps(results))
        Path(spec["out"]).with_suffix(".counters.json").write_text(json.dumps(counters))
        Path(spec["out"]).with_suffix(".stats.json").write_text(json.dumps(stats))
        if daemon is not None and daemon.proc.poll() is None:
            daemon.stop()


if __name__ == "__main__":
    main(sys.argv[1])
