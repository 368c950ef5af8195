"""Shared pieces of the vLLM end-to-end tests: the tiny models, a daemon, a scenario runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.vllm.harness import small_daemon
from engine.vllm.tiny import GQA128, SMALL, save_tiny_llama
from kvstore.client.spawn import LocalDaemon

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("models")
    return {"small": str(save_tiny_llama(base / "small", SMALL)), "gqa128": str(save_tiny_llama(base / "gqa128", GQA128))}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    with small_daemon(tmp_path_factory.mktemp("daemon")) as d:
        yield d


def run_scenario(spec: dict[str, Any], tmp: Path, timeout: float = 1200, inproc: bool = True,
                 env: dict[str, str] | None = None) -> list[list[dict[str, Any]]]:
    """Run one vLLM process on ``spec`` (see _scenario.py); its per-round results.

    ``inproc``: the engine core and the worker run in the test's process (vLLM's
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor): a third of the start-up
    time. At least one scenario runs vLLM's usual three processes, where the connector's
    metadata crosses process boundaries."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(tmp / "out.json")}
    if inproc:
        spec["engine"] = {**spec.get("engine", {}), "distributed_executor_backend": "uni"}
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if inproc else "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "tests.engine.vllm._scenario", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not (tmp / "out.json").exists():
        raise AssertionError(f"vLLM scenario failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    (tmp / "stderr.log").write_text(proc.stderr)
    return json.loads((tmp / "out.json").read_text())


def counters(tmp: Path) -> list[list[dict[str, int]]]:
    """The connector counters of the scenario run under ``tmp``: per round, per TP rank
    (cumulative; ``ConnectorCounters`` fields and ``rank``)."""
    return json.loads((tmp / "out.counters.json").read_text())


def round_stats(tmp: Path) -> list[dict[str, int | None]]:
    """Per round of the scenario run under ``tmp``: ``lookups``, the lookups the daemon answered
    in it (None while it was down), and ``preemptions``, vLLM's (None unless the engine was built
    with ``disable_log_stats=False``)."""
    return json.loads((tmp / "out.stats.json").read_text())


def one_lookup_per_admission(stats: list[dict[str, int | None]], rounds: list[list[list[int]]],
                             outs: list[list[dict[str, Any]]] | None = None, block: int = 32) -> None:
    """The scheduler asked the daemon once per request, and once more for each request that
    vLLM preempted and admitted again (its KV is gone from vLLM's pages), except for a request
    vLLM's own prefix cache served whole (``outs``: each round's outputs; ``known_s`` long
    enough that kvstore is still known to hold those blocks): it needs no lookup."""
    for i, (st, ps) in enumerate(zip(stats, rounds, strict=True)):
        whole = 0
        if outs is not None:
            whole = sum(1 for o, p in zip(outs[i], ps, strict=True)
                        if int(o["kvstore_hit_tokens"]) == 0 and (len(p) - 1) // block
                        and o["cached_tokens"] >= (len(p) - 1) // block * block)
        assert st["lookups"] == len(ps) + (st["preemptions"] or 0) - whole, f"round {i}: {st} for {len(ps)} requests"


def prompts(seed: int, lengths: list[int], prefix: int = 0, vocab: int = 2000) -> list[list[int]]:
    """Random token prompts; the first ``prefix`` tokens shared by all."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, prefix).tolist()
    return [shared + rng.integers(3, vocab, n - prefix).tolist() for n in lengths]


def same_outputs(got: list[dict[str, Any]], ref: list[dict[str, Any]], atol: float = 1e-3) -> None:
    """Identical greedy tokens; logprobs equal within ``atol`` (float32 models: a prefix
    computed in another batch shape rounds differently, by far less than this)."""
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g["tokens"] == r["tokens"], f"prompt {i}: tokens {g['tokens']} != {r['tokens']}"
        diff = np.max(np.abs(np.array(g["logprobs"]) - np.array(r["logprobs"])))
        assert diff <= atol, f"prompt {i}: logprobs differ by {diff}"
